"""Building a run from its config: the model and its warm-up, θ0 and θ, the teacher, θ's optimizer,
the method's state; resumed from a checkpoint, or set up and evaluated at the base. train.build
calls it with train's own rollout and evaluation."""
import copy
import dataclasses
import os
import sys

import torch

import envs
import model as M
import warmup
from plumbing import bookkeeping as bk
from plumbing import parallel
from plumbing.bookkeeping import die
from plumbing.registry import METHODS


def build(args, rollout, evaluate):
    """The run: model, warm-up, teacher, optimizer, the method's state; resumed, or set up (the
    method's setup plays with `rollout`) and evaluated at the base (`evaluate`; the first checkpoint)."""
    method = METHODS[args.method]
    run = bk.Run(args, method, bk.code_of(method))
    run.device_info = parallel.device_info(run.device, run.dtype)
    if parallel.writer():
        print(parallel.describe_device(run.device_info))                       # before anything is built on it
    run.env = envs.make_env(args.env)
    if args.model and not args.lora_r and run.dtype == torch.bfloat16:
        die('--lora_r 0 with --model in bf16 would train bf16 weights with no float32 master copy, where AdamW\'s '
            'small updates round away: keep an adapter (--lora_r 16) or train in float32 (--dtype fp32)')
    try:
        run.tok, run.model = warmup.load_model(args, run.env, run.dtype)
    except ValueError as e:  # a chat template that is not one layout
        die(f'--model {args.model}: {e}')
    if args.model and args.lora_r:  # a real model's warm-up trains an adapter too, folded into θ0 below
        run.model = M.with_lora(run.model, run.tok, args.lora_r)
    run.model.to(run.device).eval()                                             # train mode only in θ's steps
    if args.grad_ckpt:  # the warm-up's backward holds a batch's activations too
        M.checkpoint_activations(run.model)
    run.lap()
    with parallel.rank0_first():
        wpath, _ = warmup.warmup(args, run.tok, run.model, run.env, run.device)
    run.lap('warmup')
    run.base = {'warmup_seed': args.warmup_seed, **warmup.base_info(wpath)}    # which base, for summary.json
    torch.manual_seed(args.seed)
    if args.lora_r:  # θ0 = the warmed-up base, frozen; θ = θ0 + a fresh adapter. A bf16 --model's merge rounds the
        # warm-up's delta into bf16 weights: the part of it under bf16's resolution (~0.4% of a weight) is lost
        run.model = M.with_lora(M.merged(run.model), run.tok, args.lora_r).to(run.device).eval()
    if args.grad_ckpt:
        M.checkpoint_activations(run.model)
    run.teacher = make_teacher(run.model, run.teacher_kind)
    run.opt = torch.optim.AdamW([p for p in run.model.parameters() if p.requires_grad], lr=args.lr or method.lr,
                                weight_decay=0.0)
    run.state = method.state(run)
    if args.resume:
        bk.load_checkpoint(run, args.resume)
        print(f'resumed at step {run.step}, {run.episodes} episodes')
        acts(run, run.metrics[0]['reward'], quiet=True)
        return run
    if parallel.writer():
        open(os.path.join(run.dir, 'metrics.jsonl'), 'w').close()
    bk.atomic_json({**dataclasses.asdict(args), 'code': run.code}, os.path.join(run.dir, 'config.json'))
    with run.autocast():
        if method.setup:
            with parallel.rank0_first():
                bk.cached_setup(run, lambda run: method.setup(run, rollout), run.base['id'])
        run.setup_episodes = run.episodes
        # the base, after the setup: a setup fills a bank or a pool or trains φ, never θ, so the student is
        # still the base; the teacher reads the context the setup built (before it, it had none: the student)
        m = evaluate(run)
        print(f"base model: held-out reward {m['reward']:.3f}, success {m['success']:.3f}" +
              (f"; teacher reward {m['teacher_reward']:.3f}" if 'teacher_reward' in m else ''))
        premise(m)
        acts(run, m['reward'])
    bk.save_checkpoint(run)  # a run killed from here on can be resumed
    return run


GAP_FLOOR = 0.05  # a student takes about half its teacher's excess: under +5 points, a gain within the noise


def premise(m):
    """Every method distils a teacher that knows more than its student: print their paired gap at the base
    and, under GAP_FLOOR, one line saying that the premise fails here, and what to try."""
    gap = bk.paired_gap(m.get('task_teacher_reward'), m['task_reward'])
    if gap is None:  # no teacher, or no teacher evaluation
        return
    n, (mean, lo, hi) = len(m['task_teacher_reward']), gap
    print(f'teacher - student at the base, paired on the same {n} held-out tasks: {mean:+.3f} [{lo:+.3f}, {hi:+.3f}]')
    if mean < GAP_FLOOR:
        print(f'train.py: the teacher knows nothing its student does not ({mean:+.3f} < +{GAP_FLOOR:.2f}): distilling it '
              f'can teach little. Start from the shipped base (no --warmup_seed, no --build_base), or, for a base built '
              f'here, see whether it reads a context (the warm-up\'s gate lines: under 0.15 it does not) and try a '
              f'longer reading tail (--warmup_tail 1) or another --warmup_seed', file=sys.stderr)


ACT_FLOOR = 0.5  # a built base under half the shipped base's held-out reward cannot act: it has little to learn from


def acts(run, reward, quiet=False):
    """A base built here (--warmup_seed, --build_base) is a draw of this machine's float kernels: the gate on acting.
    Its greedy held-out reward at the base against the shipped one's, in summary.json ('base': 'acts') and, where it
    is under ACT_FLOOR of it, one line on stderr saying what to try. The shipped base and other models pass."""
    ref = warmup.manifest()
    if run.base.get('shipped') or not (ref and ref['facts']) or run.args.model or run.args.env != ref['recipe']['env']:
        return
    run.base['acts'] = ok = reward >= ACT_FLOOR * ref['facts']['reward']
    if not ok and not quiet:
        print(f'train.py: this base cannot act: its held-out reward {reward:.3f} is under half the shipped base\'s '
              f'({ref["facts"]["reward"]:.3f}); a base built here is a draw of this machine\'s float kernels, and one that '
              f'cannot act gives its teacher nothing to know. Start from the shipped base (drop --warmup_seed and '
              f'--build_base) or try another seed (docs/bases.md)', file=sys.stderr)


def make_teacher(model, kind):
    """The teacher's weights: θ0 frozen, an EMA of θ, θ itself (live), or none. With LoRA, θ0 is the
    same model with the adapter off and the EMA teacher a second adapter: no copy of the model."""
    if kind in ('live', 'none'):
        return model if kind == 'live' else None
    if M.is_lora(model):
        return M.Adapter(model) if kind == 'frozen' else M.add_ema(model)
    return frozen_copy(model)


def frozen_copy(model):
    return copy.deepcopy(model).eval().requires_grad_(False)                    # θ0
