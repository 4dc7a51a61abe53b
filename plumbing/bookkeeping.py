"""The run's bookkeeping: everything train.py does that is not the algorithm.

    arg, check_ranges     a config field with its help, choices and range; the range check
    Run                   what a training run holds, and its timers
    save_checkpoint       ckpt.pt, written once over the run's state; load_checkpoint, resume_config
    get_rng, set_rng      Python, NumPy, torch and CUDA generator states
    atomic_save, _json    write to a temp file, then rename: a kill never leaves a torn file
    cached                load a cache, or build and save it (the warm-up, a method's setup);
                          a corrupt or unreadable one is reported in one line and rebuilt
    optimizer_step        one update, skipped if the loss or a gradient is not finite
    Guard                 SIGTERM / Ctrl-C finish the step and save; divergence, OOM, interrupts in one line
    log_eval, summarize   metrics.jsonl, summary.json; plot -> curve.png
    CODE                  a fingerprint of the code of every module a run uses

Nothing here knows a method by name: a method's state is saved and restored whatever it holds
(anything with state_dict/load_state_dict is saved through it, the rest as it is).
"""
import contextlib
import dataclasses
import glob
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import field

import numpy as np
import torch

import model as M
from plumbing.parallel import OutOfSync, any_rank, pick_device, writer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = [os.path.relpath(p, ROOT) for folder in ('', 'plumbing', 'plugins')              # what a run executes
           for p in glob.glob(os.path.join(ROOT, folder, '*.py'))]


def fingerprint(files=()):
    """sha1 of the repo's modules (and any other files a run's code came from), 10 hex digits."""
    paths = sorted({os.path.join(ROOT, f) for f in MODULES} | {os.path.abspath(f) for f in files})
    return hashlib.sha1(b''.join(open(p, 'rb').read() for p in paths)).hexdigest()[:10]


CODE = fingerprint()  # in config.json, summary.json, ckpt.pt: the bench reruns a run made by other code


def hook_files(method):
    """The files a method's hooks come from (the repo's modules, or a fork's own file, e.g. tests/fork_variant.py)."""
    hooks = [method.loss, method.context, method.sample, method.state, method.setup, method.after_step, method.step]
    return [f for f in (getattr(sys.modules.get(getattr(h, '__module__', None)), '__file__', None) for h in hooks if h) if f]


def code_of(method):
    """The fingerprint of a run of this method: the repo's modules plus the files its hooks come from."""
    return fingerprint(hook_files(method))


# ----------------------------------------------------------------------------- config fields and errors

def arg(default, help, choices=None, lo=None, hi=None, open_lo=False, after_setup=False, group=None, unless=None):
    """A config field: its default, help, and what argparse and check_ranges enforce (choices: a list,
    or a function that gives it once the plugins are imported).
    after_setup: the flag acts only after a method's setup, so runs that differ in it share one.
    unless: the switch with which nothing reads it (given with it, it is refused)."""
    return field(default=default, metadata=dict(help=help, choices=choices, lo=lo, hi=hi, open_lo=open_lo,
                                                after_setup=after_setup, group=group, unless=unless))


def check_ranges(args):
    """Every field's range from its metadata, e.g. arg(3, 'J', lo=1): --J 0 -> one line, exit 2."""
    for f in dataclasses.fields(args):
        v, m = getattr(args, f.name), f.metadata
        lo_ok = m.get('lo') is None or (v > m['lo'] if m['open_lo'] else v >= m['lo'])
        if not lo_ok or (m.get('hi') is not None and v > m['hi']):
            rng = f"{'(' if m['open_lo'] else '['}{m['lo']}, {m['hi']}]" if m.get('hi') is not None else \
                f"{'>' if m['open_lo'] else '>='} {m['lo']}"
            die(f'--{f.name} must be {"in " if m.get("hi") is not None else ""}{rng}, got {v}')


def native_bf16():
    """Does this CUDA card run bf16 in hardware (compute capability 8.0 and up), not emulated?"""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # a torch without the argument
        return torch.cuda.get_device_capability()[0] >= 8


def die(msg):
    """A bad argument: one line, exit status 2."""
    print(f'train.py: error: {msg}', file=sys.stderr)
    sys.exit(2)


def fail(msg):
    """A run that cannot go on (not a bad argument): one line, exit status 1."""
    print(f'train.py: {msg}', file=sys.stderr)
    sys.exit(1)


# ----------------------------------------------------------------------------- the run

class Run:
    """Everything a training run holds; ckpt.pt saves it whole (save_checkpoint)."""

    def __init__(self, args, method, code):
        self.args, self.method, self.code = args, method, code
        self.teacher_kind = getattr(args, 'teacher', '') or method.teacher
        self.device = pick_device(args.device)
        # bf16 autocast only where the card runs it natively (a pre-Ampere card emulates it, slower than float32);
        # the losses are computed in fp32 (lopd._f32)
        bf16 = args.dtype == 'bf16' or (args.dtype == 'auto' and self.device.type == 'cuda' and native_bf16())
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.dir = os.path.join(args.out_dir, args.name)
        self.rng = random.Random(args.seed)
        self.step, self.episodes, self.metrics, self.wall, self.t0 = 0, 0, [], 0.0, time.time()
        self.setup_episodes = 0  # of run.episodes, those the method's setup sampled (--setup_free does not count them)
        self.times = {k: 0.0 for k in ['warmup', 'rollout', 'teacher', 'student', 'eval']}  # a method may add its own
        self.peaks = {}  # on CUDA, each phase's peak of allocated memory, GiB (lap; summary.json's peak_gib)
        self.log = {'loss': [], 'reward': [], 'skipped': []}  # since the last evaluation (skipped: whole run)
        self.skips_in_a_row = 0
        self.state = {}  # the method's own (methods.Method.state)
        # set by train.build: the environment, tokenizer, student θ, teacher, θ's optimizer
        self.env = self.tok = self.model = self.teacher = self.opt = None
        self.base = None  # the base's draw: its warm-up seed, the torch and CPU kernels that built it, its reading curve
        self.device_info = None  # what it computes on: device, dtype, torch (parallel.device_info; summary.json)
        self.tb = None  # the TensorBoard writer, opened at the first evaluation with --tensorboard

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)

    def lap(self, key=None):
        """The one timer: the seconds since the last lap go to times[key]; lap() starts the clock. A step's phases
        are one line each (run.lap('rollout') after step 1, ...); train.take_step starts its clock."""
        if self.device.type == 'cuda':
            torch.cuda.synchronize()                                            # CUDA runs ahead of the host
        now, last = time.time(), getattr(self, '_lap', None)
        if key is not None and last is not None:
            self.times[key] = self.times.get(key, 0.0) + now - last
            if self.device.type == 'cuda':                                      # the phase's memory peak, since its lap()
                self.peaks[key] = max(self.peaks.get(key, 0.0), torch.cuda.max_memory_allocated(self.device) / 2 ** 30)
        if self.device.type == 'cuda':
            torch.cuda.reset_peak_memory_stats(self.device)
        self._lap = now

    def record(self, **logs):
        """A step's numbers, averaged into the next evaluation's line of metrics.jsonl."""
        for k, v in logs.items():
            self.log.setdefault(k, []).append(v)


# ----------------------------------------------------------------------------- writing files

def atomic_save(obj, path):
    """Write to a temp file and rename: a kill mid-write never leaves a corrupt file (the
    temp name is per process, so two runs building the same cache cannot tear it). Under
    torchrun only rank 0 writes files."""
    if not writer():
        return
    tmp = f'{path}.{os.getpid()}.tmp'
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_json(obj, path):
    if not writer():
        return
    tmp = f'{path}.{os.getpid()}.tmp'
    with open(tmp, 'w') as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def get_rng(run):
    state = {'rng': run.rng.getstate(), 'torch_rng': torch.get_rng_state(), 'np_rng': np.random.get_state()}
    if run.device.type == 'cuda':
        state.update(cuda_rng=torch.cuda.get_rng_state(run.device))
    return state


def set_rng(run, state):
    run.rng.setstate(state['rng'])
    torch.set_rng_state(state['torch_rng'].cpu())
    np.random.set_state(state['np_rng'])
    if 'cuda_rng' in state and run.device.type == 'cuda':
        torch.cuda.set_rng_state(state['cuda_rng'].cpu(), run.device)


def pack(state):
    """A method's state dict -> what torch.save gets: state_dict() where there is one."""
    return {k: v.state_dict() if hasattr(v, 'state_dict') else v for k, v in state.items()}


def unpack(state, saved):
    """Restore a packed state into `state`, in place. Modules are checked (names, shapes) before
    anything changes, so a mismatched file raises and leaves the run as it was."""
    if set(saved) != set(state):
        raise ValueError(f'state holds {sorted(saved)}, the method has {sorted(state)}')
    for k, v in state.items():
        if isinstance(v, torch.nn.Module):
            mine = v.state_dict()
            bad = [n for n in mine if n not in saved[k] or saved[k][n].shape != mine[n].shape]
            if bad or set(saved[k]) != set(mine):
                raise ValueError(f'size mismatch for {k}.{(bad or sorted(set(saved[k]) ^ set(mine)))[0]}')
    for k, v in state.items():
        if hasattr(v, 'load_state_dict'):
            v.load_state_dict(saved[k])
        else:
            state[k] = saved[k]


COUNTERS = ('step', 'episodes', 'setup_episodes', 'metrics', 'times', 'log', 'skips_in_a_row')  # plain values a run carries


def save_checkpoint(run):
    state = {'args': dataclasses.asdict(run.args), 'code': run.code, 'wall': run.wall + time.time() - run.t0,
             'model': M.trainable_state(run.model), 'opt': run.opt.state_dict(), 'state': pack(run.state),
             **{k: getattr(run, k) for k in COUNTERS}, **get_rng(run)}
    if run.teacher_kind == 'ema':
        state['ema'] = run.teacher.state_dict()
    atomic_save(state, os.path.join(run.dir, 'ckpt.pt'))


def load_checkpoint(run, path):
    try:
        state = torch.load(path, map_location=run.device, weights_only=False)
        M.load_trainable(run.model, state['model'])
        run.opt.load_state_dict(state['opt'])
        if run.teacher_kind == 'ema':
            run.teacher.load_state_dict(state['ema'])
        unpack(run.state, state['state'])
        for k in COUNTERS:
            setattr(run, k, state[k] if k != 'setup_episodes' else state.get(k, 0))  # older checkpoints lack it
        run.wall = state['wall']
        set_rng(run, state)
    except Exception as e:  # corrupt file, a missing entry, or weights of another shape
        msg = ' '.join(str(e).split())  # load_state_dict says what mismatches on its 2nd line
        die(f'cannot resume from {path}: {type(e).__name__}: {msg[:300]}')
    # the metrics log is rewritten from the checkpoint: evals written after it (a run
    # killed between an eval and its checkpoint) are dropped, as they will be redone
    if not writer():
        return
    with open(os.path.join(run.dir, 'metrics.jsonl.tmp'), 'w') as f:
        f.writelines(json.dumps(m) + '\n' for m in run.metrics)
    os.replace(os.path.join(run.dir, 'metrics.jsonl.tmp'), os.path.join(run.dir, 'metrics.jsonl'))


RESUMABLE = ('resume', 'episodes', 'device', 'dtype', 'max_skips', 'grad_ckpt', 'tensorboard', 'export', 'plugin')  # what --resume may change


def resume_config(args, argv, config_class):
    """--resume: the saved config wins; only the budget (and where it runs) may change."""
    path = os.path.join(args.resume, 'ckpt.pt') if os.path.isdir(args.resume) else args.resume
    if not os.path.isfile(path):
        die(f'--resume: no checkpoint at {path}')
    try:
        saved = torch.load(path, map_location='cpu', weights_only=False)['args']
        saved = {k: v for k, v in saved.items() if k in {f.name for f in dataclasses.fields(config_class)}}
    except Exception as e:
        die(f'cannot resume from {path}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ""}')
    given = {a[2:].split('=')[0] for a in argv if a.startswith('--')}
    changed = [k for k in given if k not in RESUMABLE + ('out_dir', 'name') and getattr(args, k) != saved.get(k)]
    if changed:
        die(f'--resume continues the saved config; --{changed[0]} cannot be changed (only --{", --".join(RESUMABLE[1:])})')
    run_dir = os.path.dirname(os.path.abspath(path))  # the folder resumed is the one written, even if moved
    return config_class(**{**saved, 'resume': path, 'out_dir': os.path.dirname(run_dir), 'name': os.path.basename(run_dir),
                           'overwrite': False, **{k: getattr(args, k) for k in RESUMABLE[2:] if k in given},
                           'episodes': max(saved['episodes'], args.episodes) if 'episodes' in given else saved['episodes']})


RUN_FILES = ['ckpt.pt', 'summary.json', 'metrics.jsonl', 'config.json', 'curve.png']


def claim_run_dir(run_dir, overwrite):
    """A new run never replaces a finished or resumable one, unless asked (--overwrite)."""
    kind = 'a finished' if os.path.isfile(os.path.join(run_dir, 'summary.json')) else \
        'a resumable' if os.path.isfile(os.path.join(run_dir, 'ckpt.pt')) else None
    if kind and not overwrite:
        die(f'{run_dir} holds {kind} run; continue it with --resume {run_dir}, pick another --name, or --overwrite')
    for f in RUN_FILES:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(run_dir, f))
    os.makedirs(run_dir, exist_ok=True)


# ----------------------------------------------------------------------------- caches

def cached(path, what, build, apply, device):
    """The one caching helper: apply(torch.load(path)) if the file is good, else build() ->
    the dict to save, saved atomically. -> True if it came from the cache. A corrupt or
    unreadable file, or one whose contents do not fit (apply raises before changing
    anything), is reported in one line and rebuilt. train.py prints '<what>: [cached ]<path>',
    which the bench waits for."""
    if os.path.exists(path):
        try:
            apply(torch.load(path, map_location=device, weights_only=False))
            print(f'{what}: cached {path}')
            return True
        except Exception as e:
            print(f'train.py: {what} cache {path} is unreadable ({type(e).__name__}: '
                  f'{" ".join(str(e).split())[:120]}); rebuilding it', file=sys.stderr)
    state = build()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_save(state, path)
    print(f'{what}: {path}')
    return False


def load_module(module, saved):
    """module.load_state_dict(saved), refused before any change if names or shapes differ."""
    unpack({'m': module}, {'m': saved})


# the CPU threads the caches (the warm-up, a method's setup) are built on, whatever the process runs on: sums split over
# threads round differently (1 and 2 threads gave two bases, and two cold starts whose runs differed by up to 2.6
# points), so a notebook on one thread and train.py on two share one setup; 2, so that a 2-core machine builds at full speed
BUILD_THREADS = 2


@contextlib.contextmanager
def build_threads():
    """Build a cache on BUILD_THREADS threads; the process gets its own count back after, an error included. Also a
    decorator (`@build_threads()`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def setup_key(args, base_id, code):
    """What a method's setup depends on: every flag but those marked after_setup, the base, the code, and what rounds
    its sums (the torch and the CPU kernels: a cold start built under others is another draw, as a base is)."""
    kept = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if not f.metadata.get('after_setup')}
    return json.dumps([kept, base_id, code, BUILD_THREADS, torch.__version__, torch.backends.cpu.get_cpu_capability()],
                      sort_keys=True)


def cached_setup(run, setup, base_id):
    """A method's one-time setup (LOPD: bank filling + cold start), cached under out_dir like the
    warm-up: LOPD and its ablations of one seed (--freeze_composer, --margin 0) differ only after
    it, so they share one (setup-<method>-<env>-s<seed>-<hash>.pt). The cache holds everything a setup changes, RNG states included, so a
    run that loads it continues exactly as if it had built it (tests/test_reliability.py)."""
    a = run.args
    key = setup_key(a, base_id, run.code)
    path = os.path.join(a.out_dir, f'setup-{a.method}-{a.env}-s{a.seed}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.pt')
    parts = ('episodes', 'log', 'skips_in_a_row')

    @build_threads()
    def build():
        setup(run)
        return {'key': key, 'state': pack(run.state), **{k: getattr(run, k) for k in parts}, **get_rng(run)}

    def apply(saved):
        if saved['key'] != key:
            raise ValueError('the key inside differs')
        lrs = {k: [g['lr'] for g in o.param_groups] for k, o in run.state.items() if isinstance(o, torch.optim.Optimizer)}
        unpack(run.state, saved['state'])
        for k, lr in lrs.items():  # the run's flags set an optimizer's lr (--lr_composer is not in the key), not the cache
            for g, x in zip(run.state[k].param_groups, lr):
                g['lr'] = x
        for k in parts:
            setattr(run, k, saved[k])
        set_rng(run, saved)

    cached(path, 'setup', build, apply, run.device)


# ----------------------------------------------------------------------------- numerical guards, stopping

class Diverged(Exception):
    """Too many updates in a row were skipped for non-finite numbers (--max_skips)."""


def optimizer_step(run, opt, loss, module):
    """One update of a module (or a list of parameters), skipped (counted, logged) if the loss or a
    gradient is not finite (loss: a tensor, or a function that accumulates micro-batches' gradients; -> the loss), so a NaN never reaches the weights; --max_skips skips in a row stop the run."""
    opt.zero_grad(set_to_none=True)
    accumulated = callable(loss)  # --micro_batch: a function that runs each micro-batch's forward and backward
    if accumulated:               # and returns the whole batch's loss, detached (None: no gradient anywhere)
        loss = loss()
        if loss is None:
            return loss
    elif not loss.requires_grad:  # nothing this step depends on the parameters (e.g. nothing retrieved)
        return loss
    if torch.isfinite(loss):
        if not accumulated:
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(module.parameters() if isinstance(module, torch.nn.Module) else module, 1.0)
        if torch.isfinite(norm):
            opt.step()
            run.skips_in_a_row = 0
            return loss
    return skip(run, opt, loss)


def set_lr(opt, lr):
    for g in opt.param_groups:
        g['lr'] = lr


def skip(run, opt, loss):
    """The NaN guard: an update whose loss or gradient is not finite never reaches the weights; it is counted,
    logged, and --max_skips of them in a row stop the run. -> the loss."""
    opt.zero_grad(set_to_none=True)
    run.log['skipped'].append(1)
    run.skips_in_a_row += 1
    print(f'step {run.step + 1}: non-finite {"loss" if not torch.isfinite(loss) else "gradient"}, update skipped', file=sys.stderr)
    if run.skips_in_a_row >= run.args.max_skips:
        raise Diverged(f'{run.skips_in_a_row} updates in a row had a non-finite loss or gradient; '
                       f'none reached the weights: lower --lr or look at the inputs of these steps')
    return loss


class Guard:
    """Around a whole run. SIGTERM and a first Ctrl-C during training set `now`: the loop finishes
    the step and saves a checkpoint; before training (nothing to save yet) or at a second Ctrl-C
    they leave at once. Interrupts, divergence and out-of-memory end in one line, exit status 1."""

    def __init__(self, args):
        self.args, self.run, self.now, self.training = args, None, False, False

    def __enter__(self):
        self.old = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def stop(self, device):
        """Stop now? Under torchrun, on every rank as soon as one rank caught a signal."""
        self.now = any_rank(self.now, device)
        return self.now

    def on_signal(self, sig, frame):
        if not self.training or (self.now and sig == signal.SIGINT):
            raise KeyboardInterrupt
        self.now = True
        print('\nstopping after this step (Ctrl-C again: at once, without saving)', file=sys.stderr)

    def __exit__(self, kind, e, tb):
        for s, h in self.old.items():
            signal.signal(s, h)
        a, where = self.args, os.path.join(self.args.out_dir, self.args.name)
        if kind is KeyboardInterrupt:
            if not os.path.isfile(os.path.join(where, 'ckpt.pt')):
                fail("interrupted before the first checkpoint (written once the method's setup is done); nothing to resume")
            fail(f'interrupted; the last checkpoint is in {where}/ (continue with --resume {where})')
        if kind in (Diverged, OutOfSync):
            fail(f'stopped in step {self.run.step + 1}: {e}; the last checkpoint is in {where}/')
        if kind is not None and issubclass(kind, RuntimeError) and 'out of memory' in str(e).lower():
            fail(f'out of memory on {pick_device(a.device)}: lower --micro_batch (now {a.micro_batch}: rows per forward and '
                 f'backward in every phase), --batch (now {a.batch}), --score_chunk (now {a.score_chunk}), '
                 f'or turn on --grad_ckpt; the last checkpoint, if any, is in {where}/')
        return False


# ----------------------------------------------------------------------------- metrics, summary, plot

def log_eval(run, m):
    """One evaluation -> metrics.jsonl, with the counters, the means of what was logged since
    the last one, and the plain numbers of the method's state (LOPD's β)."""
    def mean(v):  # None, not NaN, so that metrics.jsonl stays strict JSON
        v = [x for x in v if not math.isnan(x)]
        return float(np.mean(v)) if v else None
    m.update(step=run.step, episodes=run.episodes, training_episodes=run.episodes - run.setup_episodes, **{k: v for k, v in run.state.items() if isinstance(v, float)},
             loss=mean(run.log['loss']), train_reward=mean(run.log['reward']),
             **{k: mean(v) for k, v in run.log.items() if k not in ('loss', 'reward', 'skipped')},
             skipped=sum(run.log['skipped']), times={k: round(v, 2) for k, v in run.times.items()})
    run.metrics.append(m)
    for k in run.log:
        if k != 'skipped':
            run.log[k] = []
    if writer():
        with open(os.path.join(run.dir, 'metrics.jsonl'), 'a') as f:
            f.write(json.dumps(m) + '\n')
        if getattr(run.args, 'tensorboard', False):
            tensorboard(run, m)
    return m


def tensorboard(run, m):
    """The same numbers as metrics.jsonl, as TensorBoard scalars against episodes (--tensorboard)."""
    if run.tb is None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            die('--tensorboard needs the tensorboard package: pip install tensorboard')
        run.tb = SummaryWriter(os.path.join(run.dir, 'tensorboard'))
    flat = {k: v for k, v in m.items() if isinstance(v, (int, float)) and k not in ('step', 'episodes')}
    flat.update({f'{k}/{f}': v for k in ('family', 'times') for f, v in m.get(k, {}).items()})
    for k, v in flat.items():
        run.tb.add_scalar(k, v, m['episodes'])
    run.tb.flush()


def paired_gap(a, b, n_boot=2000, seed=0, level=0.95):
    """The mean of a − b over the tasks a covers (a per-task list, b its superset's, the same tasks first), with a
    bootstrap interval over those tasks -> (mean, lo, hi), or None without a."""
    if not a:
        return None
    d = np.subtract(a, b[:len(a)])
    means = d[np.random.default_rng(seed).integers(0, len(d), (n_boot, len(d)))].mean(1)
    return float(d.mean()), *map(float, np.percentile(means, [50 * (1 - level), 50 * (1 + level)]))


def summarize(run):
    """summary.json and the one-line summary."""
    a, base, final = run.args, run.metrics[0], run.metrics[-1]
    wall = run.wall + time.time() - run.t0
    atomic_json({'method': a.method, 'env': a.env, 'seed': a.seed, 'episodes': run.episodes,
                 'setup_episodes': run.setup_episodes, 'base_reward': base['reward'], 'final_reward': final['reward'],
                 'base_success': base['success'], 'final_success': final['success'],
                 'best_success': max(m['success'] for m in run.metrics),
                 **{f'{k}_{w}': m.get(w) for k, m in (('base', base), ('final', final)) for w in ('reward_sampled', 'success_sampled')},
                 'teacher_reward': final.get('teacher_reward'), 'teacher_success': final.get('teacher_success'),
                 'wall_seconds': round(wall, 1), 'time_split': {k: round(v, 1) for k, v in run.times.items()},
                 'skipped_updates': sum(run.log['skipped']), 'code': run.code, 'base': run.base,
                 'device': run.device_info, 'peak_gib': {k: round(v, 3) for k, v in run.peaks.items()},
                 'teacher_gap_base': paired_gap(base.get('task_teacher_reward'), base['task_reward'])},
                os.path.join(run.dir, 'summary.json'))
    split = ', '.join(f'{k} {v:.0f}s' for k, v in run.times.items() if v >= 0.5)
    return (f"{a.name}: held-out reward {base['reward']:.3f} -> {final['reward']:.3f}, success {base['success']:.3f} -> "
            f"{final['success']:.3f} after {run.episodes} episodes in {wall:.0f}s ({split}); outputs in {run.dir}/")


def plot(run):
    if not writer():
        return
    from matplotlib.figure import Figure  # no pyplot: the caller's plotting backend is left alone
    x = [m['episodes'] for m in run.metrics]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(x, [m['reward'] for m in run.metrics], 'o-', label=f'{run.args.method} student, reward (greedy)')
    ax.plot(x, [m['success'] for m in run.metrics], 'o:', alpha=0.7, label=f'{run.args.method} student, success (greedy)')
    if any('teacher_reward' in m for m in run.metrics):
        ax.plot(x, [m.get('teacher_reward', np.nan) for m in run.metrics], 's--', alpha=0.6, label='teacher with context, reward')
    ax.set(xlabel='episodes sampled', ylabel='held-out graded reward / success', ylim=(0, 1), title=f'{run.args.name}')
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(run.dir, 'curve.png.tmp'), dpi=100, format='png')
    os.replace(os.path.join(run.dir, 'curve.png.tmp'), os.path.join(run.dir, 'curve.png'))
