"""Where a run computes: its device, and torchrun's ranks (data parallel).

`torchrun --nproc_per_node N train.py …`: every rank draws the same tasks, rolls out its contiguous
share of them (its own sampling stream), and the shares are gathered, so every rank holds the whole
batch and takes the same update: the method's state (θ, φ, the bank, β, a critic) stays the same on
every rank without a gradient all-reduce, and any method runs as it does in one process. What is
split is generation, the slow part of an on-policy step; evaluation is split the same way. Rank 0
writes the files and prints; the warm-up and a method's setup are built by rank 0 and read by the rest.
"""
import contextlib
import datetime
import os
import sys

import numpy as np
import torch
import torch.distributed as dist


class OutOfSync(RuntimeError):
    """The ranks' weights differ: an update was not the same on every rank."""


def pick_device(name):
    if name == 'cuda' or (name == 'auto' and torch.cuda.is_available()):
        return torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)))  # torchrun: one GPU per rank
    if name != 'auto':
        return torch.device(name)
    if getattr(torch.backends, 'mps', None) and torch.backends.mps.is_available():
        return torch.device('mps')
    return torch.device('cpu')


def device_info(device, dtype):
    """What a run computes on, for its first line and summary.json: the device (a GPU's name), the dtype, the torch
    build; and why not CUDA, where this torch is built for CUDA but sees no device (a wheel whose CUDA the driver
    does not run trains on the CPU, slowly, unless something says so)."""
    info = {'device': str(device), 'dtype': 'bf16 autocast' if dtype == torch.bfloat16 else 'float32',
            'torch': torch.__version__, 'name': torch.cuda.get_device_name(device) if device.type == 'cuda' else None}
    if device.type == 'cpu' and torch.version.cuda and not torch.cuda.is_available():
        info['note'] = f'this torch is built for CUDA {torch.version.cuda} but sees no CUDA device'
    return info


def describe_device(info):
    """-> 'device: cuda:0 (NVIDIA …), bf16 autocast, torch …[; note]' (one line)."""
    name = f" ({info['name']})" if info.get('name') else ''
    return f"device: {info['device']}{name}, {info['dtype']}, torch {info['torch']}" + (f"; {info['note']}" if info.get('note') else '')


def decode_rows(run, today):
    """Rows decoded at once (--decode_rows; -1: on CUDA every row a KV-cache estimate fits in half the free memory,
    since one decoding step is launch-bound and costs about the same for 4 rows as for 64; elsewhere `today`, the
    phase's rows before the flag, so that no sampled number changes). 0 = the whole batch."""
    if run.args.decode_rows >= 0 or run.device.type != 'cuda':
        return run.args.decode_rows if run.args.decode_rows >= 0 else today
    c = run.model.config
    head = getattr(c, 'head_dim', None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * getattr(c, 'num_key_value_heads', c.num_attention_heads) * head * 2   # bf16 K and V, a token
    per_row = kv * DECODE_TOKENS + 4 * c.vocab_size                            # the cache of an episode, and its float32 logits
    return max(1, int(0.5 * torch.cuda.mem_get_info(run.device)[0] // per_row))


DECODE_TOKENS = 2048   # a long episode's tokens, system prompt and context included (the estimate's)


def world():
    """(rank, number of ranks): torchrun's, or (0, 1) in one process."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def writer():
    return world()[0] == 0


def init_distributed(device):
    """Join torchrun's process group (gloo on CPU, nccl on CUDA); the other ranks go quiet."""
    if int(os.environ.get('WORLD_SIZE', 1)) <= 1 or dist.is_initialized():
        return
    cuda = pick_device(device).type == 'cuda'
    if cuda:
        torch.cuda.set_device(pick_device(device))
    # rank 0 builds the warm-up while the others wait (minutes): the default 10-minute timeout is too short
    dist.init_process_group('nccl' if cuda else 'gloo', timeout=datetime.timedelta(hours=2))
    if not writer():
        os.environ['TQDM_DISABLE'] = '1'
        sys.stdout = open(os.devnull, 'w')


def finish():
    """The ranks leave torchrun's process group together: a rank that exits while gloo's threads still
    hold the group can abort ('terminate called without an active exception') and take the others down."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def rank0_first():
    """Rank 0 runs the block first (it builds a cache), then the others (they read it)."""
    rank, n = world()
    if n > 1 and rank:
        dist.barrier()
    yield
    if n > 1 and not rank:
        dist.barrier()


def shared(run, fn, items):
    """fn(items) -> a list, or a tuple of lists, one entry per item; under torchrun each rank runs fn on
    its contiguous share of items, with its own sampling stream, and the shares are gathered in
    order, so that every rank returns what one process would (up to which stream sampled what)."""
    rank, n = world()
    if n == 1:
        return fn(items)
    cuts, before = np.linspace(0, len(items), n + 1).round().astype(int), run.episodes
    with torch.random.fork_rng(devices=[run.device] if run.device.type == 'cuda' else []):
        torch.manual_seed(hash((run.args.seed, run.step, run.episodes, rank)) % 2 ** 31)
        mine = fn(items[cuts[rank]:cuts[rank + 1]])
    every = [None] * n
    dist.all_gather_object(every, (mine, run.episodes - before))  # a sampler may count episodes itself (PSP)
    run.episodes = before + sum(extra for _, extra in every)
    every = [part for part, _ in every]
    if isinstance(mine, tuple):
        return tuple([x for part in every for x in part[k]] for k in range(len(mine)))
    return [x for part in every for x in part]


def any_rank(flag, device):
    """True on every rank if it is True on one (a signal caught by one rank stops them all)."""
    if world()[1] == 1:
        return bool(flag)
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def check_in_sync(run):
    """Every rank took the same updates: their trained weights agree (a cheap checksum), else stop."""
    if world()[1] == 1:
        return
    with torch.no_grad():
        total = torch.tensor([float(sum(p.double().sum() for p in run.model.parameters() if p.requires_grad))], device=run.device)
    every = [torch.zeros(1, dtype=total.dtype, device=run.device) for _ in range(world()[1])]  # NCCL gathers on the device
    dist.all_gather(every, total)
    if any(e.item() != every[0].item() for e in every):
        raise OutOfSync(f'the ranks\' weights differ ({[e.item() for e in every]}): an update was not the same on every rank')
