"""Compare every method on one environment: several seeds, one base, one episode budget.

    python bench.py --env tooluse            # every entry x seeds 1,2,3 -> runs/compare-tooluse/results.md
    python bench.py --env tooluse --quick    # the quick entries x seeds 1,2,3 at 1024 episodes -> compare-tooluse-quick/
    python bench.py --env tooluse --tune     # 3 settings per method on seed 0 -> compare-tooluse/tuning.json

Each run is its own `python train.py` process (a crash costs one run, not the bench), its
output in <compare dir>/logs/<name>.log. Finished runs are reused, interrupted ones resumed
from their ckpt.pt, so a rerun only does what is missing. Seed 0 is the validation seed:
--tune picks each method's knob on it, and the compare reports seeds >= 1 only, with the
tuned flags when tuning.json exists (--no_tuned ignores it). Any other `--flag value` or
`--set key=value` goes to train.py for every run. Run names carry the budget and a hash of
the flags beyond the entry's own, so quick, full and tuned runs never collide.

Reported per entry: final held-out success mean ± std (sample std over seeds), best, the
area under the success-vs-episodes curve / budget, the episodes the seed-mean curve needs
to reach GRPO's final mean success (the paper's sample-efficiency claim), base, teacher
success and wall time; LOPD's diagnostics where logged. Not done: significance tests (with
3 seeds, read the min-max band in curves.png), and runs of several environments at once.

Measured on 2 CPU cores (--jobs 2, tool use, warm-up cached; README): full 27 runs 5,261 s
(88 min); quick 10 runs 504 s; tune 21 runs at --episodes 1024, 1,559 s (building the warm-up
included, ~95 s, which the first run of an environment pays once).
"""
import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm import tqdm

import methods  # the registry: the entries, tuning grids and costs all come from it
import lopd_method  # noqa: E402 (after methods, which imports it)

ROOT = os.path.dirname(os.path.abspath(__file__))


# entry -> train.py flags: every method's own entry first, then the ablations (methods.py, Method.bench)
_BENCH = sorted(((e, name, b) for name, m in methods.METHODS.items() for e, b in m.bench.items()),
                key=lambda x: x[0] not in methods.METHODS)
ENTRIES = {e: ['--method', name] + b.get('flags', []) for e, name, b in _BENCH}
# --quick: the quick entries × 3 seeds, 1024 episodes, evaluated every 256 episodes (at the default batch of 16) on 500 tasks
QUICK_ENTRIES = [e for e, _, b in _BENCH if b.get('quick')]
QUICK_FLAGS = ['--episodes', '1024', '--eval_tasks', '500', '--eval_every', '16']
# --tune: the same number of settings for every method (methods.py, Method.tune), the default
# first (a tie keeps it). Ablations take their method's choice (lopd-m0 keeps its margin 0: entry flags win).
TUNE = {name: m.tune for name, m in methods.METHODS.items() if len(m.tune) > 1}
# seconds per full run on one of 2 busy cores (README's compare): only the launch order uses them
COST = {e: b.get('cost', 300) for e, _, b in _BENCH}
REFERENCE = 'grpo'  # the paper's sample-efficiency claim: episodes to reach RLVR's (GRPO's) final success
OWN = ('--method', '--seed', '--name', '--resume')  # set by bench.py per run, never forwarded


def die(msg):
    print(f'bench.py: error: {msg}', file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        die(message)


def method_of(entry):
    f = ENTRIES[entry]
    return f[f.index('--method') + 1]


# ----------------------------------------------------------------------------- planning runs

def train_args(flags):
    """train.py's own parser on these flags -> its Args; a bad flag is bench's one-line error."""
    import train  # slow (torch), so only once the bench's own arguments are known good
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return train.parse_args(flags)
    except SystemExit:
        die(f"train.py rejects `{' '.join(flags)}`: {err.getvalue().strip().removeprefix('train.py: error: ')}")


def for_method(flags, method):
    """Drop the flags (and their values) that the method does not read: a compare forwards e.g.
    --cold_start_steps to every entry, and only the runs of methods that have it take it."""
    import train
    bools = {f.name for f in dataclasses.fields(train.config_class()) if f.type is bool}
    foreign = {k for m in methods.METHODS.values() for k in m.flags} - set(methods.METHODS[method].flags)
    out, i = [], 0
    while i < len(flags):
        name = flags[i][2:].split('=')[0] if flags[i].startswith('--') else None
        n = 1 if name is None or name in bools or '=' in flags[i] else 2
        out += [] if name in foreign else flags[i:i + n]
        i += n
    return out


def plan(prefix, entry, own, flags, env, seed, label=''):
    """One run: its name and train.py flags. `own` = the entry's flags, `flags` = everything.
    The name has the budget and, if `flags` change anything beyond `own`, a hash of that."""
    import bookkeeping
    import train
    flags = for_method(flags, method_of(entry))
    args = train_args(flags + ['--env', env])
    a, b = dataclasses.asdict(train_args(own + ['--env', env])), dataclasses.asdict(args)
    diff = sorted((k, v) for k, v in b.items() if a[k] != v and k not in ('episodes', 'device'))
    tag = '-' + hashlib.sha1(json.dumps(diff).encode()).hexdigest()[:6] if diff else ''
    name = f"{prefix}-{entry}-{env}-e{b['episodes']}{tag}{label}-s{seed}"
    shared = methods.METHODS[args.method].setup and bookkeeping.setup_key(dataclasses.replace(args, seed=seed), '', train.CODE)
    return {'entry': entry, 'seed': seed, 'name': name, 'budget': b['episodes'], 'flags': flags + ['--env', env],
            'setup': shared or None}


def status(run_dir, budget):
    """'done' (summary.json at the budget), 'resume' (a checkpoint to continue), 'new', or
    'stale' (made by other code: train.CODE differs; it is run again from scratch)."""
    import train
    cfg = read_json(os.path.join(run_dir, 'config.json'))
    if cfg is not None and cfg.get('code') != train.CODE:
        return 'stale'
    s = read_json(os.path.join(run_dir, 'summary.json'))
    if s and s.get('episodes', 0) >= budget:
        return 'done'
    return 'resume' if os.path.isfile(os.path.join(run_dir, 'ckpt.pt')) else 'new'


def cached(log, what):
    """train.py prints '<what>: [cached ]<path>.pt' once the warm-up / a method's setup is cached
    or loaded (the warm-up's progress bar also starts with 'warm-up:', hence the regex)."""
    return re.search(rf'^{what}: (cached )?.+\.pt$', log, re.M) is not None


def launch(cmd, log_path, env, signals=()):
    """Run one train.py to the end, its stdout and stderr appended to log_path (a resumed run
    keeps its history) -> exit status. signals: (what, event) pairs, each event set once the
    log says `what` is cached (or the run ended)."""
    with open(log_path, 'a') as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    pending = [(w, ev) for w, ev in signals if ev is not None]
    while pending and p.poll() is None:
        text = open(log_path, errors='replace').read()
        for w, ev in pending:
            if cached(text, w):
                ev.set()
        pending = [(w, ev) for w, ev in pending if not ev.is_set()]
        time.sleep(1)
    for _, ev in pending:
        ev.set()
    return p.wait()


def run_all(runs, out_dir, log_dir, jobs):
    """Launch every run not yet finished, `jobs` at a time -> (launched, failed) names."""
    todo = [(r, status(os.path.join(out_dir, r['name']), r['budget'])) for r in runs]
    todo = [(r, s) for r, s in todo if s != 'done']
    if not todo:
        return [], []
    os.makedirs(log_dir, exist_ok=True)
    # one BLAS thread per run when several share the cores: the model is tiny, extra threads only spin
    env = {'OMP_NUM_THREADS': str(max(1, (os.cpu_count() or 1) // jobs)), **os.environ,
           'PYTHONUNBUFFERED': '1', 'TQDM_MININTERVAL': '30'}  # logs: unbuffered, a progress line per 30 s
    bar, lock, running, failed = tqdm(total=len(todo), desc='bench runs', dynamic_ncols=True), threading.Lock(), [], []
    # longest first, so that the last runs to finish are short ones and no core idles long
    todo.sort(key=lambda rs: -COST.get(rs[0]['entry'], 0))
    # runs with the same setup (LOPD's cold start, shared by its ablations of one seed): the first builds it,
    # the others wait until it is cached (the longest-first order makes that wait rare)
    builders = {}

    def one(item, warm=None):
        r, s = item
        d = os.path.join(out_dir, r['name'])
        built = waits = None
        if r['setup'] and s != 'resume':
            with lock:
                waits = builders.get(r['setup'])
                if waits is None:
                    builders[r['setup']] = built = threading.Event()
            if waits is not None:
                waits.wait()
        if s == 'stale':
            shutil.rmtree(d)
        cmd = [sys.executable, os.path.join(ROOT, 'train.py')]
        cmd += (['--resume', d, '--episodes', str(r['budget'])] if s == 'resume' else
                r['flags'] + ['--seed', str(r['seed']), '--name', r['name'], '--out_dir', out_dir])
        with lock:
            running.append(r['name'])
            bar.set_postfix_str(', '.join(running))
        try:
            rc = launch(cmd, os.path.join(log_dir, r['name'] + '.log'), env, [('warm-up', warm), ('setup', built)])
        finally:  # a builder that failed releases its waiters too (they build the setup themselves)
            if built is not None:
                built.set()
        with lock:
            running.remove(r['name'])
            failed.extend([r['name']] if rc else [])
            bar.update(1)

    pool = ThreadPoolExecutor(jobs)
    try:
        # the first run alone until its warm-up is cached: two runs building it would race on one file
        warm = threading.Event()
        first = pool.submit(one, todo[0], warm)
        while not warm.is_set() and not first.done():
            time.sleep(0.2)
        list(pool.map(one, todo[1:]))
        first.result()
    except KeyboardInterrupt:  # the runs got the Ctrl-C too: they save a checkpoint and stop
        pool.shutdown(cancel_futures=True)
        bar.close()
        print('bench: interrupted; the same command continues where it stopped', file=sys.stderr)
        sys.exit(130)
    pool.shutdown()
    bar.close()
    return [r['name'] for r, _ in todo], failed


# ----------------------------------------------------------------------------- aggregation

def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_run(run_dir):
    """-> (summary or None, config or {}, eval points sorted by episodes). A resumed run may
    have logged a step twice; the last line for a step wins. A torn last line is skipped."""
    evals = {}
    with contextlib.suppress(OSError), open(os.path.join(run_dir, 'metrics.jsonl')) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                m = json.loads(line)
                evals[m.get('step')] = m
    return (read_json(os.path.join(run_dir, 'summary.json')), read_json(os.path.join(run_dir, 'config.json')) or {},
            sorted(evals.values(), key=lambda m: m['episodes']))


def auc(x, y, budget):
    """Area under success vs episodes (trapezoid over the eval points) / budget, in [0, 1].
    e.g. x = [0, 512, 1024], y = [0.5, 0.5, 1.0], budget 1024 -> (256 + 384) / 1024 = 0.625."""
    return float(np.trapezoid(y, np.minimum(np.asarray(x, float), budget)) / budget)


def episodes_to_reach(x, y, target):
    """The first eval point whose success is >= target, or None (not reached)."""
    hit = np.nonzero(np.asarray(y) >= target - 1e-9)[0]
    return int(x[hit[0]]) if len(hit) else None


def mean_of(values):
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def bootstrap_ci(values, n_boot=2000, seed=0, level=0.95):
    """The mean of per-task values over seeds and tasks, with a two-level bootstrap interval: resample
    the seeds, then each drawn seed's tasks, with replacement. values (S, T) -> (mean, lo, hi).
    e.g. one seed, tasks [0, 1]: the mean is 0.5 and the interval is about (0, 1)."""
    v = np.asarray(values, float)
    S, T = v.shape
    rng = np.random.default_rng(seed)
    s = rng.integers(0, S, (n_boot, S))                                          # (n_boot, S) seeds drawn
    t = rng.integers(0, T, (n_boot, S, T))                                       # (n_boot, S, T) tasks drawn per seed
    means = v[s[..., None], t].mean((1, 2))                                      # (n_boot,)
    lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(v.mean()), float(lo), float(hi)


def final_stats(evs):
    """Per seed, the last evaluation's per-task values -> {metric: (mean, lo, hi)} over tasks and seeds."""
    out = {}
    for name, key, f in [('reward', 'task_reward', float), ('success', 'task_reward', lambda r: float(r >= 1)),
                         ('reward_sampled', 'task_reward_sampled', float)]:
        rows = [[f(r) for r in ev[-1][key]] for ev in evs if ev[-1].get(key)]
        if rows and len({len(r) for r in rows}) == 1:
            out[name] = bootstrap_ci(rows)
    return out


def summarize(run_dirs, budget):
    """Finished runs of one entry -> its row of results.json (None if no run finished)."""
    runs = [(s, c, ev) for s, c, ev in map(load_run, run_dirs) if s and ev and s.get('episodes', 0) >= budget]
    if not runs:
        return None
    # seed curves of the graded reward on the union of their eval points (linear in between)
    x = np.unique(np.concatenate([[m['episodes'] for m in ev] for _, _, ev in runs]))
    Y = np.stack([np.interp(x, [m['episodes'] for m in ev], [m.get('reward', m['success']) for m in ev]) for _, _, ev in runs])
    final = [ev[-1].get('reward', ev[-1]['success']) for _, _, ev in runs]
    aucs = [auc(x, y, budget) for y in Y]
    setup = [s.get('setup_episodes', 0) for s, _, _ in runs]
    row = {'seeds': [s.get('seed') for s, _, _ in runs], 'final': final, 'final_mean': float(np.mean(final)),
           'final_std': float(np.std(final, ddof=1)) if len(final) > 1 else 0.0, 'ci': final_stats([ev for _, _, ev in runs]),
           'best_mean': mean_of([max(m.get('reward', m['success']) for m in ev) for _, _, ev in runs]),
           'auc_mean': float(np.mean(aucs)), 'auc_std': float(np.std(aucs, ddof=1)) if len(aucs) > 1 else 0.0,
           'base_mean': mean_of([ev[0].get('reward', ev[0]['success']) for _, _, ev in runs]),
           'success_mean': mean_of([ev[-1]['success'] for _, _, ev in runs]),
           'base_success_mean': mean_of([ev[0]['success'] for _, _, ev in runs]),
           'setup_episodes': float(np.mean(setup)),
           'teacher_reward': mean_of([s.get('teacher_reward', s.get('teacher_success')) for s, _, _ in runs]),
           'wall_seconds': mean_of([s.get('wall_seconds') for s, _, _ in runs]),
           'family_base': family_means([ev[0] for _, _, ev in runs]), 'family_final': family_means([ev[-1] for _, _, ev in runs]),
           'curve': {'episodes': x.tolist(), 'mean': Y.mean(0).tolist(), 'std': Y.std(0).tolist(),
                     'min': Y.min(0).tolist(), 'max': Y.max(0).tolist(), 'seeds': Y.tolist()}}
    last = lambda k: mean_of([ev[-1].get(k) for _, _, ev in runs])
    avg = lambda k: mean_of([mean_of([m.get(k) for m in ev]) for _, _, ev in runs])
    diag = {'teacher_reward': last('teacher_reward'), 'student_reward_same_tasks': last('student_reward_same_tasks'),
            'delta_mean': avg('delta'), 'anchor_mean': avg('anchor'), 'family_hit_mean': avg('family_hit'),
            'beta_final': last('beta'),
            # before any update every teacher's weights are θ0, so θ0 without its context is the
            # student of the first evaluation, on the same tasks
            'teacher_without_context': mean_of([ev[0].get('student_reward_same_tasks') for _, _, ev in runs])}
    row['diagnostics'] = {k: v for k, v in diag.items() if v is not None}
    # per seed, every evaluation's diagnostics: β, Δ, anchor, family hit over time (for a notebook)
    keys = ['episodes', 'training_episodes', 'reward', 'success', 'teacher_reward', 'student_reward_same_tasks', 'beta', 'delta',
            'anchor', 'family_hit', 'phi_grad_kl', 'phi_grad_margin', 'phi_grad_anchor']
    row['evals'] = [[{k: m.get(k) for k in keys} for m in ev] for _, _, ev in runs]
    return row


def family_means(evals):
    """Seed-mean reward per family, from evaluations that logged one."""
    fams = {}
    for m in evals:
        for f, v in m.get('family', {}).items():
            fams.setdefault(f, []).append(v)
    return {f: float(np.mean(v)) for f, v in fams.items()}


def add_reach(results):
    """Episodes each entry's seed-mean curve needs to reach GRPO's final mean reward, both ways of
    counting: every episode sampled (a setup's bank or pool included), and, as the paper counts,
    only the training episodes (the setup's are subtracted)."""
    target = results[REFERENCE]['final_mean'] if results.get(REFERENCE) else None
    for r in results.values():
        if r:
            n = episodes_to_reach(r['curve']['episodes'], r['curve']['mean'], target) if target is not None else None
            r['episodes_to_grpo_final'] = n
            r['training_episodes_to_grpo_final'] = None if n is None else max(0, int(n - r['setup_episodes']))
    return target


# ----------------------------------------------------------------------------- writing

def fmt(v, spec='.3f'):
    return '—' if v is None else format(v, spec)


def ci(r, k):
    """'0.512 [0.487, 0.538]' from a row's bootstrap interval, or '—'."""
    v = r.get('ci', {}).get(k)
    return '—' if not v else f'{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]'


def final(r):
    """The final reward with its interval, or mean ± std over seeds for runs that kept no per-task values."""
    return ci(r, 'reward') if r.get('ci', {}).get('reward') else f"{r['final_mean']:.3f} ± {r['final_std']:.3f}"


def write_results(cmp_dir, results, meta, target):
    results_json = {**meta, 'grpo_final_mean': target, 'entries': results}
    with open(os.path.join(cmp_dir, 'results.json'), 'w') as f:
        json.dump(results_json, f, indent=1)

    def reach(r, k):
        n = r[k]
        return ('n/a (no grpo)' if target is None else 'not reached' if n is None else
                '0 (GRPO ends ≤ base)' if n == 0 else str(n))  # 0: the target says nothing about speed
    md = [f"# {meta['env']}: seeds {', '.join(map(str, meta['seeds']))}, {meta['episodes']} episodes each", '',
          f"`{meta['command']}` at commit {meta['commit']} (train.CODE {meta['code']}); forwarded flags: `{' '.join(meta['forwarded']) or '—'}`; "
          f"tuned flags: {'tuning.json' if meta['tuned'] else 'none'}. Held-out graded reward (the fraction of checks "
          f"passed) and success (every check), greedy, and the reward sampled at temperature 0.7; [lo, hi] is a 95% "
          f"bootstrap interval over tasks and seeds (± the std over seeds, for runs that kept no per-task values). GRPO's final mean reward (the target of \"episodes to GRPO\"): "
          f"{fmt(target)}, reached counting every episode sampled / only the training episodes (the paper's: a bank or "
          f"pool built before training is not counted). AUC = area under reward vs episodes / budget. wall s = each run's "
          f"own seconds; runs that share one seed's method setup (LOPD's cold start) share it: the first builds it.", '',
          '| entry | flags | seeds | final reward | success | reward, sampled | AUC | episodes to GRPO final '
          '(all / training) | base reward | base success | teacher | wall s |',
          '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for e, r in results.items():
        flags = f"`{' '.join(meta['flags'][e])}`"
        md.append(f'| {e} | {flags} | 0 |' + ' — |' * 9 if not r else
                  f"| {e} | {flags} | {len(r['final'])} | {final(r)} | "
                  f"{ci(r, 'success')} | {ci(r, 'reward_sampled')} | "
                  f"{r['auc_mean']:.3f} | {reach(r, 'episodes_to_grpo_final')} / {reach(r, 'training_episodes_to_grpo_final')} | "
                  f"{fmt(r['base_mean'])} | {fmt(r['base_success_mean'])} | {fmt(r['teacher_reward'])} | {fmt(r['wall_seconds'], '.0f')} |")
    md += ['', 'Diagnostics (final = last evaluation, mean = over evaluations; seed means; teacher and student '
           'on the same first `--teacher_eval` held-out tasks; teacher without context = θ0 alone, the first evaluation):', '',
           '| entry | teacher reward (final) | teacher without context | student, same tasks | mean Δ | final β | mean ‖z − z0‖² | mean family hit |',
           '|---|---|---|---|---|---|---|---|']
    keys = ['teacher_reward', 'teacher_without_context', 'student_reward_same_tasks', 'delta_mean', 'beta_final',
            'anchor_mean', 'family_hit_mean']
    md += [f"| {e} | " + ' | '.join(fmt(r['diagnostics'].get(k)) for k in keys) + ' |'
           for e, r in results.items() if r and r['diagnostics']]
    md += forgetting_table(results)
    if meta['failed']:
        md += ['', 'Failed runs (see logs/): ' + ', '.join(meta['failed'])]
    with open(os.path.join(cmp_dir, 'results.md'), 'w') as f:
        f.write('\n'.join(md) + '\n')


def forgetting_table(results, solved=0.8):
    """Families the base solves (reward >= `solved`): base -> final reward per entry (seed means),
    so that a family the student loses shows up, whatever the mean does."""
    rows = [r for r in results.values() if r and r.get('family_base')]
    if not rows:
        return []
    base = {f: float(np.mean([r['family_base'][f] for r in rows if f in r['family_base']])) for f in rows[0]['family_base']}
    fams = [f for f, v in base.items() if v >= solved]
    if not fams:
        return []
    names = [e for e, r in results.items() if r and r.get('family_final')]
    md = ['', f'Families the base solves (base reward >= {solved}): final reward per entry (seed means):', '',
          '| family | base | ' + ' | '.join(names) + ' |', '|---|---|' + '---|' * len(names)]
    return md + [f'| {f} | {base[f]:.2f} | ' + ' | '.join(fmt(results[e]['family_final'].get(f), '.2f') for e in names) + ' |'
                 for f in fams]


def plot_curves(path, results, target):
    import matplotlib
    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for e, r in results.items():
        if r:
            c = r['curve']
            n = len(r['final'])
            line, = ax.plot(c['episodes'], c['mean'], '-', marker='.', label=f"{e} ({n} seed{'s' * (n > 1)})")
            ax.fill_between(c['episodes'], c['min'], c['max'], color=line.get_color(), alpha=0.15)
    if target is not None:
        ax.axhline(target, color='k', ls=':', lw=1, label="GRPO's final mean reward")
    ax.set(xlabel='episodes sampled', ylabel='held-out graded reward (seed mean, min–max band)', ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_tuning(cmp_dir, grid, meta):
    """Best final success per entry on seed 0 -> tuning.json (merged with earlier tunings) + tuning.md."""
    path = os.path.join(cmp_dir, 'tuning.json')
    tuning = (read_json(path) or {}) | {'meta': meta}
    md = ['# Tuning on seed 0 (validation seed, not reported)', '', '| entry | setting | final success | best | chosen |',
          '|---|---|---|---|---|']
    for e, settings in grid.items():
        done = [s for s in settings if s['final_success'] is not None]
        best = max(done, key=lambda s: s['final_success']) if done else None  # max keeps the first of ties
        tuning[e] = {'flags': best['setting'] if best else [], 'final_success': best and best['final_success'], 'grid': settings}
        md += [f"| {e} | `{' '.join(s['setting']) or 'default'}` | {fmt(s['final_success'])} | {fmt(s['best_success'])} | "
               f"{'✓' if s is best else ''} |" for s in settings]
    with open(path, 'w') as f:
        json.dump(tuning, f, indent=1)
    with open(os.path.join(cmp_dir, 'tuning.md'), 'w') as f:
        f.write('\n'.join(md) + '\n')


# ----------------------------------------------------------------------------- the teacher-gap report

def gap_rows(run, rollout, tasks):
    """Before any student update: the student's and its teacher's held-out success on the same tasks
    (greedy), overall and on opaque families, and the privileged-information utility statistics
    (pi_utility) on the student's own sampled rollouts. The teacher's context is the method's own,
    built on the student's sampled rollouts of each task (G per task: SDPO's sibling), the first of
    each group taken. LOPD and Traj-text also get the control: other-family experiences only (as latents, as text).
    -> {row name: (teacher success per task, rows that got a context, utility statistics)}."""
    import torch
    import model as M
    G = run.method.group
    eps, bodies, masks = rollout(run.model, run.tok, run.env, [t for t in tasks for _ in range(G)])
    contexts = {run.args.method: methods.embed_context(run, run.method.context(run, eps))[::G]}
    others = lambda: lopd_method.retrieve(run, [e.task for e in eps[::G]], other_family=True)
    if run.args.method == 'lopd':
        contexts['lopd-control'] = lopd_method.latents(run, eps[::G], grad=False, found=others())
    if run.args.method == 'trajtext':  # the same control as text: what other families' experiences tell
        contexts['trajtext-control'] = methods.embed_context(run, [methods.bank_text(f) for f in others()])
    out = {}
    with torch.no_grad():
        for name, ctx in contexts.items():
            teps = rollout(run.teacher, run.tok, run.env, tasks, greedy=True, prefixes=methods.with_default(run, ctx))[0]
            out[name] = ([e.reward for e in teps], float(np.mean([p is not None for p in ctx])),
                         pi_utility(run, eps[::G], bodies[::G], masks[::G], ctx))
    return out


def pi_utility(run, eps, bodies, masks, ctx, rows=50):
    """KL-based statistics of a context, before training (after the study of 16 privileged-information
    setups, arXiv 2608.04794): on the student's own sampled rollouts, each rollout's mean over its agent
    tokens of D(π_θ(·|x,y<t) ‖ π_T(·|c,x,y<t)) (reverse KL, what the distillation loss minimises), then
    the mean over the rollouts that succeeded and over those that failed. Rollouts without a context are left out."""
    import lopd
    import model as M
    per = []
    for i in range(0, len(eps), rows):
        ids, amask, attn = M.pad_batch(bodies[i:i + rows], masks[i:i + rows], run.tok.pad, run.device)
        logits_t = M.logits_on(run.teacher, methods.with_default(run, ctx[i:i + rows]), ids, attn, run.args.score_chunk)
        logits_s = M.logits_on(run.model, M.bos_prefix(run.model, run.tok, ids.shape[0]), ids, attn, run.args.score_chunk)
        d = lopd.divergence(logits_s, logits_t, 'rkl')
        per += ((d * amask).sum(1) / amask.sum(1).clamp(min=1)).tolist()
    kept = [(k, e.success) for k, e, p in zip(per, eps, ctx) if p is not None]
    mean = lambda won: float(np.mean([k for k, w in kept if w == won])) if any(w == won for _, w in kept) else None
    return {'kl_success': mean(True), 'kl_failure': mean(False)}


def spearman(x, y):
    """Spearman's rank correlation (ties get their mean rank); None if either side is constant."""
    rank = lambda v: np.array([np.mean([j for j, w in enumerate(sorted(v)) if w == u]) for u in v])
    rx, ry = rank(list(x)), rank(list(y))
    return None if len(x) < 3 or rx.std() == 0 or ry.std() == 0 else float(np.corrcoef(rx, ry)[0, 1])


def utility_correlation(cmp_dir, table):
    """How well each before-training statistic predicts each quick-compare run's gain over the base:
    Spearman's ρ over the (entry, seed) pairs whose method has a row here (an ablation takes its
    method's row: lopd-frozen uses lopd's). -> {statistic: (ρ, pairs)}, or None without results.json."""
    res = read_json(os.path.join(cmp_dir, 'results.json'))
    if not res:
        return None
    stats = {'teacher gap': lambda r: r['success'] - table['student']['success'], 'KL, successes': lambda r: r['kl_success'],
             'KL, failures': lambda r: r['kl_failure'],
             'KL, failures − successes': lambda r: None if None in (r['kl_failure'], r['kl_success']) else r['kl_failure'] - r['kl_success']}
    out = {}
    for name, f in stats.items():
        pairs = [(f(table[row]), final - r['base_mean']) for e, r in res['entries'].items() if r
                 for row in [e if e in table else method_of(e) if e in ENTRIES else None] if row in table and f(table[row]) is not None
                 for final in r['final']]
        out[name] = (spearman(*zip(*pairs)) if pairs else None, len(pairs))
    return out


def teacher_gap(o, out_dir, cmp_dir):
    """bench.py --teacher_gap: for every method with a teacher (and LOPD's variants in GAP_EXTRA), build
    its run (warm-up, base evaluation, setup: LOPD's cold start) and measure gap_rows on the first
    --gap_tasks held-out tasks. -> teacher_gap.md / .json in the compare folder."""
    import torch
    import bookkeeping
    import train
    t0, rows, student = time.time(), {}, None
    entries = {m: ['--method', m] for m, x in methods.METHODS.items() if x.context and (not o.methods or m in o.entries)}
    entries.update({k: v for k, v in GAP_EXTRA.items() if not o.methods or k in o.entries})
    for entry, own in entries.items():
        m = own[own.index('--method') + 1]
        flags = for_method(o.extras, m) + own + ['--env', o.env, '--out_dir', out_dir, '--name', f'gap-{entry}-{o.env}',
                                                   '--overwrite', '--eval_tasks', str(o.gap_tasks), '--teacher_eval', '0']
        args = train_args(flags)
        bookkeeping.claim_run_dir(os.path.join(out_dir, args.name), True)
        run = train.build(args)
        tasks = run.env.eval_tasks[:o.gap_tasks]
        with torch.no_grad():
            if student is None:
                student = [e.reward for e in train.rollout(run.model, run.tok, run.env, tasks, greedy=True)[0]]
            for name, r in gap_rows(run, train.rollout, tasks).items():
                rows[entry + name[len(m):]] = r  # e.g. lopd-balanced, lopd-balanced-control
        opaque = np.array([t.family in getattr(run.env, 'opaque', ()) for t in tasks])
        write_gap(cmp_dir, o, train.CODE, time.time() - t0, tasks, opaque, student, rows)  # so far: a long report can be read as it goes
        print(f'teacher gap: {entry} done ({time.time() - t0:.0f}s)', flush=True)
    print('\n'.join(write_gap(cmp_dir, o, train.CODE, time.time() - t0, tasks, opaque, student, rows)))
    return os.path.join(cmp_dir, 'teacher_gap.md')


def write_gap(cmp_dir, o, code, seconds, tasks, opaque, student, rows):
    """teacher_gap.md / .json from what is measured so far, with the utility statistics and, where the
    quick compare's results.json is in the same folder, how well each predicts the gains."""
    split = lambda r: (float(np.mean(r)), float(np.mean(np.array(r)[opaque])) if opaque.any() else None)
    gap = lambda a, b: f'{a - b:+.3f}' if a is not None and b is not None else '—'
    s_all, s_op = split(student)
    fams = sorted({t.family for t in tasks})
    by_family = lambda r: {f: float(np.mean([x for x, t in zip(r, tasks) if t.family == f])) for f in fams}
    table = {'student': {'success': s_all, 'opaque': s_op, 'by_family': by_family(student)}}
    md = [f'Held-out tasks: the first {len(tasks)} ({int(opaque.sum())} of opaque families), greedy, before any update; '
          'held-out graded reward (0/1 success where the reward is 0/1).',
          f"`python bench.py {' '.join(o.argv)}`, code {code}, {seconds:.0f} s.", GAP_LEGEND, '',
          '| teacher of | with context | teacher | student | gap | teacher, opaque | student, opaque | gap, opaque | '
          'KL, successes | KL, failures |',
          '|---|---|---|---|---|---|---|---|---|---|']
    for name, (r, cov, kl) in rows.items():
        t_all, t_op = split(r)
        table[name] = {'success': t_all, 'opaque': t_op, 'with_context': cov, 'by_family': by_family(r), **kl}
        md.append(f'| {name} | {cov:.2f} | {t_all:.3f} | {s_all:.3f} | {gap(t_all, s_all)} | {fmt(t_op)} | {fmt(s_op)} | '
                  f"{gap(t_op, s_op)} | {fmt(kl['kl_success'], '.4f')} | {fmt(kl['kl_failure'], '.4f')} |")
    corr = utility_correlation(cmp_dir, table)
    if corr:
        md += ['', "Privileged-information utility: Spearman's ρ between each statistic above (before training) and "
               "the gain over the base of each run of this folder's results.json (one pair per entry and seed; "
               "an ablation takes its method's row):", '', '| statistic | ρ | pairs |', '|---|---|---|']
        md += [f'| {k} | {fmt(rho, "+.2f")} | {n} |' for k, (rho, n) in corr.items()]
        table['utility_correlation'] = {k: {'rho': rho, 'pairs': n} for k, (rho, n) in corr.items()}
    os.makedirs(cmp_dir, exist_ok=True)
    with open(os.path.join(cmp_dir, 'teacher_gap.json'), 'w') as f:
        json.dump(table, f, indent=1)
    with open(os.path.join(cmp_dir, 'teacher_gap.md'), 'w') as f:
        f.write('\n'.join(md) + '\n')
    return md


# LOPD's choices that the teacher-gap report shows side by side (the paper's own cold start, self-retrieval)
GAP_EXTRA = {'opsd-answer': ['--method', 'opsd', '--opsd_context', 'answer'],  # this task's plan and answer
             'lopd-nll': ['--method', 'lopd', '--cold_start', 'nll'],        # the paper's cold start
             'lopd-nll-stored': ['--method', 'lopd', '--cold_start', 'nll', '--cold_start_sample', 'stored'],  # ... and its sampling
             'lopd-nll-reader': ['--method', 'lopd', '--cold_start', 'nll', '--reader', 'trained'],
             'lopd-self': ['--method', 'lopd', '--allow_same_task'],           # self-retrieval, as the paper's code allows
             'lopd-expert': ['--method', 'lopd', '--bank_source', 'expert'],    # upper bounds: a bank of expert demos
             'trajtext-expert': ['--method', 'trajtext', '--bank_source', 'expert']}
GAP_LEGEND = ('KL, successes / failures: the mean per-token KL(student ‖ teacher with its context) on the student\'s own sampled rollouts that succeeded / failed (one per task). lopd-control: LOPD\'s teacher with latents composed from other-family experiences only (must not help); '
              'trajtext-control: the same other-family experiences shown as text; '
              'lopd (default cold start): distils the teacher reading the experiences as text into it reading the latents; lopd-nll: the paper\'s cold start '
              '(NLL of the successes given their latents); -stored: its rollouts drawn as stored, not family-balanced; -reader: a trainable reader; '
              'lopd-self: retrieval may return the task itself; opsd-answer: OPSD shown this task\'s plan and answer; -expert: the bank filled with the '
              'scripted expert\'s demos instead of the base\'s rollouts (an upper bound, not the method).')


# ----------------------------------------------------------------------------- memory (--memory)

def step_memory(B, T, V, chunk, d=64):
    """Run in a fresh process: one distillation step (the student's forward with its graph, the frozen
    teacher's without, full-vocabulary reverse KL, backward, AdamW) of a 1-layer Llama of width d with
    a V-token vocabulary on (B, T) tokens -> (resident GiB before the step, peak GiB during it)."""
    import copy
    import resource
    import torch
    import lopd
    import model as M
    torch.manual_seed(0)
    student = M.tiny_llama(V, d_model=d, n_layer=1, n_head=2, max_len=T + 1)
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    ids, attn = torch.randint(0, V, (B, T)), torch.ones(B, T, dtype=torch.long)
    bos = lambda m: [M.embed(m, torch.tensor([0]))] * B
    gib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # ru_maxrss is in KiB on Linux
    before = gib()
    with torch.no_grad():
        logits_t = M.logits_on(teacher, bos(teacher), ids, attn, chunk=chunk)
    loss = lopd.distill_loss(M.logits_on(student, bos(student), ids, attn, chunk=chunk), logits_t, attn.float())
    loss.backward()
    opt.step()
    return before, gib()


def lora_memory(r=16):
    """Parameter bytes of student + θ0 + EMA teacher for a Qwen2.5-0.5B-shaped model (built on the meta
    device: counts, no weights): three bf16 copies, vs one bf16 copy and two float32 LoRA adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device('meta'):
        model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=r, lora_alpha=2 * r, target_modules='all-linear'))
    base = sum(p.numel() for n, p in model.named_parameters() if 'lora_' not in n)
    adapter = sum(p.numel() for n, p in model.named_parameters() if 'lora_' in n)
    return base, adapter


def memory_report(o):
    """--memory: the two tables of the README's "Your own model on one GPU" section, printed."""
    B, T, V = 4, 2048, 151936
    rows = []
    for b, chunk in [(1, 0), (2, 0), (1, 1024), (2, 1024), (B, 1024), (B, 256)]:
        code = f'import bench; print(*bench.step_memory({b}, {T}, {V}, {chunk}))'
        out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True)
        if out.returncode:
            die(f'--memory: the step with B={b}, chunk={chunk} failed: {out.stderr.strip().splitlines()[-1:]}')
        before, peak = map(float, out.stdout.split())
        rows.append((b, chunk, before, peak))
        print(f'B={b} T={T} V={V} chunk={chunk or "none"}: resident {before:.2f} GiB before the step, peak {peak:.2f} GiB '
              f'(+{peak - before:.2f})', flush=True)
    step = {(b, c): peak - before for b, c, before, peak in rows}
    # unchunked, B = 4 needs more memory than this machine has: the step's memory is linear in B, so
    # it is extrapolated from B = 1 and 2 (the chunked step's does not grow with B: it is one chunk's)
    unchunked = step[1, 0] + (B - 1) * (step[2, 0] - step[1, 0])
    print(f'B={B} unchunked, extrapolated from B=1 and 2: +{unchunked:.2f} GiB; chunked / unchunked: '
          f'{step[B, 1024] / unchunked:.3f} (chunk 1024), {step[B, 256] / unchunked:.3f} (chunk 256)')
    base, adapter = lora_memory()
    three, lora = 3 * base * 2, base * 2 + 2 * adapter * 4
    print(f'0.5B-shaped Qwen2 ({base / 1e6:.0f}M parameters; LoRA r=16 on every linear layer: {adapter / 1e6:.1f}M): '
          f'student + θ0 + EMA as three bf16 copies {three / 2 ** 30:.2f} GiB, as one bf16 copy + two fp32 adapters '
          f'{lora / 2 ** 30:.2f} GiB ({lora / three:.3f}x); AdamW state {base * 8 / 2 ** 30:.2f} GiB (full) vs '
          f'{adapter * 8 / 2 ** 30:.3f} GiB (adapter)')


# ----------------------------------------------------------------------------- main

def parse(argv):
    p = Parser(description=__doc__.split('\n')[0], allow_abbrev=False,  # --seed must not abbreviate --seeds
               epilog='Other --flag value pairs are forwarded to train.py for every run.')
    p.add_argument('--env', default='tooluse', help='environment (train.py --env)')
    p.add_argument('--methods', default='', help=f"comma-separated entries of {', '.join(ENTRIES)} "
                   f"(default: all; --quick: {','.join(QUICK_ENTRIES)})")
    p.add_argument('--seeds', default='', help='comma-separated seeds >= 1 (default 1,2,3)')
    p.add_argument('--quick', action='store_true',
                   help=f"{' '.join(QUICK_FLAGS)}, {len(QUICK_ENTRIES)} entries, in compare-<env>-quick/")
    p.add_argument('--tune', action='store_true', help='3 settings per method on seed 0 -> tuning.json (used by compares)')
    p.add_argument('--teacher_gap', action='store_true', help="every teacher's and its student's success before "
                   'training, overall and on opaque families -> teacher_gap.md')
    p.add_argument('--gap_tasks', type=int, default=200, help='held-out tasks of the --teacher_gap report')
    p.add_argument('--no_tuned', action='store_true', help="ignore tuning.json's chosen flags")
    p.add_argument('--out_dir', default='runs', help='where the runs, the warm-up cache and compare-<env>/ go')
    p.add_argument('--jobs', type=int, default=2, help='runs at a time (one core each on a 2-core machine)')
    p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', help='a train.py flag, every run (repeatable)')
    p.add_argument('--memory', action='store_true', help='peak memory of one distillation step at V = 151,936, T = 2,048, '
                   'chunked vs unchunked scoring, and LoRA parameter memory for a 0.5B-shaped model (no training runs)')
    p.add_argument('--curves', default='', metavar='RUN,RUN', help='plot the held-out reward of finished run folders, '
                   'one line each (no training) -> --png')
    p.add_argument('--png', default='curves.png', help="where --curves writes its plot")
    o, extras = p.parse_known_args(argv)
    if o.jobs < 1:
        die(f'--jobs must be >= 1, got {o.jobs}')
    for kv in o.set:
        if '=' not in kv:
            die(f'--set {kv!r}: expected KEY=VALUE')
        k, v = kv.split('=', 1)
        extras += [f'--{k}'] if v.lower() == 'true' else [] if v.lower() == 'false' else [f'--{k}', v]
    bad = [t for t in extras if t.split('=')[0] in OWN]
    if bad:
        die(f'{bad[0]} is set by bench.py per run (use --methods / --seeds)')
    o.entries = [e for e in (o.methods or ','.join(QUICK_ENTRIES if o.quick else ENTRIES)).split(',') if e]
    unknown = [e for e in o.entries if e not in ENTRIES and not (o.teacher_gap and e in GAP_EXTRA)]
    if unknown:
        known = [*ENTRIES, *GAP_EXTRA] if o.teacher_gap else ENTRIES  # the report also takes LOPD's variants
        die(f"--methods: {unknown[0]!r} is not one of {', '.join(known)}")
    try:
        o.seeds = [int(s) for s in (o.seeds or '1,2,3').split(',')]
    except ValueError:
        die(f'--seeds {o.seeds!r}: expected comma-separated integers')
    if 0 in o.seeds or min(o.seeds) < 0:
        die('--seeds must be >= 1: seed 0 is the tuning (validation) seed and is not reported')
    if o.tune and not set(o.entries) & set(TUNE):
        die(f"--tune: none of {', '.join(o.entries)} has a grid (methods: {', '.join(TUNE)})")
    o.extras = (QUICK_FLAGS if o.quick else []) + extras  # the user's flags come last, so they win
    return o


def main(argv=None):
    t0, commit = time.time(), git_commit()  # the code the runs are made with, not what is committed meanwhile
    o = parse(sys.argv[1:] if argv is None else argv)
    out_dir = os.path.abspath(o.out_dir)
    cmp_dir = os.path.join(out_dir, f"compare-{o.env}{'-quick' if o.quick else ''}")  # a quick tuning tunes quick runs
    tuned = {} if o.no_tuned or o.tune else read_json(os.path.join(cmp_dir, 'tuning.json')) or {}
    if o.memory:
        return memory_report(o)
    if o.curves:
        rows = {os.path.basename(os.path.normpath(d)): summarize([d], (read_json(os.path.join(d, 'summary.json')) or {})
                                                                 .get('episodes', 1)) for d in o.curves.split(',')}
        if not all(rows.values()):
            die(f"--curves: no finished run in {', '.join(d for d, r in rows.items() if not r)}")
        plot_curves(o.png, rows, None)
        return print(f'bench: {len(rows)} curves in {o.png}')
    if o.teacher_gap:
        o.argv = sys.argv[1:] if argv is None else argv
        print(f'bench: teacher gap in {time.time() - t0:.0f}s; table in {os.path.relpath(teacher_gap(o, out_dir, cmp_dir))}')
        return
    if o.tune:
        entries = [e for e in o.entries if e in TUNE]
        runs = [plan('tune', e, ENTRIES[e] + s, s + o.extras + ENTRIES[e], o.env, 0,
                     '-' + ''.join(x.lstrip('-') for x in s) if s else '-default') | {'setting': s}
                for e in entries for s in TUNE[e]]
    else:
        # an entry's own flags come last, so that an ablation holds whatever was tuned or forwarded
        tuned_flags = {e: (tuned.get(e) or tuned.get(method_of(e)) or {}).get('flags', []) for e in o.entries}
        runs = [plan('cmp', e, ENTRIES[e], tuned_flags[e] + o.extras + ENTRIES[e], o.env, s)
                for e in o.entries for s in o.seeds]
    os.makedirs(cmp_dir, exist_ok=True)  # only now: every run's flags passed train.py's checks
    launched, failed = run_all(runs, out_dir, os.path.join(cmp_dir, 'logs'), o.jobs)
    command = 'python bench.py ' + ' '.join(sys.argv[1:] if argv is None else argv)
    meta = {'env': o.env, 'episodes': runs[0]['budget'], 'forwarded': o.extras, 'command': command,
            'commit': commit, 'code': train_code(), 'failed': failed}
    if o.tune:
        grid = {}
        for r in runs:
            s = read_json(os.path.join(out_dir, r['name'], 'summary.json')) or {}
            grid.setdefault(r['entry'], []).append({'setting': r['setting'], 'name': r['name'], 'final_success':
                                                    s.get('final_success'), 'best_success': s.get('best_success')})
        write_tuning(cmp_dir, grid, meta)
        table = os.path.join(cmp_dir, 'tuning.md')
    else:
        results = {e: summarize([os.path.join(out_dir, r['name']) for r in runs if r['entry'] == e], runs[0]['budget'])
                   for e in o.entries}
        target = add_reach(results)
        shown = {e: tuned_flags[e] + ENTRIES[e] for e in o.entries}
        write_results(cmp_dir, results, meta | {'seeds': o.seeds, 'tuned': bool(tuned), 'flags': shown}, target)
        plot_curves(os.path.join(cmp_dir, 'curves.png'), results, target)
        table = os.path.join(cmp_dir, 'results.md')
    print(f'bench: {len(runs)} runs ({len(launched)} launched, {len(failed)} failed) in {time.time() - t0:.0f}s; '
          f'table in {os.path.relpath(table)}')
    sys.exit(1 if failed else 0)


def train_code():
    import train
    return train.CODE


def git_commit():
    with contextlib.suppress(Exception):
        return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    return 'unknown'


if __name__ == '__main__':
    main()
