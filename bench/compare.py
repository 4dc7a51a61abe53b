"""Compare every method on one environment: several seeds, one base (or several), one episode budget.

    python -m bench --env tooluse            # every entry x seeds 1,2,3 -> runs/compare-tooluse/results.md
    python -m bench --env tooluse --quick    # the quick entries x seeds 1,2,3 at 1024 episodes -> compare-tooluse-quick/
    python -m bench --env tooluse --tune     # lr ×1/3, ×1, ×3 and a knob per method on seed 0 -> compare-tooluse/tuning.json
    python -m bench --env tooluse --warmup_seeds 4,7,8   # every entry x seeds 1,2,3 on each of three bases

Each run is its own `python train.py` process (a crash costs one run, not the bench), its
output in <compare dir>/logs/<name>.log. Finished runs are reused, interrupted ones resumed
from their ckpt.pt, so a rerun only does what is missing. Seed 0 is the validation seed:
--tune picks each method's learning rate or knob on it (a winner is run again beside the default on seed
100, the second validation seed, and kept only if it still wins), and the compare reports seeds >= 1 only, with the
tuned flags when tuning.json exists (--no_tuned ignores it). Any other `--flag value` or
`--set key=value` goes to train.py for every run. Run names carry the budget and a hash of
the flags beyond the entry's own, so quick, full and tuned runs never collide.

A base (train.py --warmup_seed: the tiny model's init and the warm-up's data order) is one draw: a
compare on one base says what a method does from that base. --warmup_seeds runs every entry and seed
on each base given (names end -w<W>-s<seed>; tuning stays on train.py's default base), and every
interval then resamples the bases, then their seeds, then the tasks (report.bootstrap_ci).

Reported per entry (report.py): final held-out graded reward and success with 95% bootstrap
intervals over tasks and seeds, the reward sampled at temperature 0.7, the area under the
reward-vs-episodes curve / budget, the episodes the seed-mean curve needs to reach GRPO's
final mean (the paper's sample-efficiency claim, counting the setup's episodes and not), base,
teacher and wall time, LOPD's diagnostics, the families the base solves, and what success
hides: the held-out action types, the student's entropy and action length (actions.png). --teacher_gap and
--memory (gap.py) train nothing.
"""
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

import train
import warmup
from bench import gap  # the reports that train nothing: --teacher_gap, --memory
from bench import report  # what a compare writes: rows with intervals, tables, curves
from bench.entries import (CONFIRM_SEED, COST, ENTRIES, OWN, QUICK_ENTRIES, QUICK_FLAGS, ROOT, TUNE, Parser, die,
                           for_method, method_of, read_registry, train_args)
from plumbing import bookkeeping, config
from plumbing.registry import METHODS

def plan(prefix, entry, own, flags, env, seed, label='', base=None):
    """One run: its name and train.py flags. `own` = the entry's flags, `flags` = everything.
    The name has the budget and, if `flags` change anything beyond `own`, a hash of that. base: a
    warm-up seed given by --warmup_seeds, named '-w<base>' (None: the flags' base, named as ever)."""
    if base is not None:  # part of the args, so of the setup's key: runs of two bases never share a setup
        own, flags, label = own + ['--warmup_seed', str(base)], flags + ['--warmup_seed', str(base)], f'{label}-w{base}'
    flags = for_method(flags, method_of(entry))
    args = train_args(flags + ['--env', env])
    a, b = dataclasses.asdict(train_args(own + ['--env', env])), dataclasses.asdict(args)
    diff = sorted((k, v) for k, v in b.items() if a[k] != v and k not in ('episodes', 'device', 'plugin'))
    tag = '-' + hashlib.sha1(json.dumps(diff).encode()).hexdigest()[:6] if diff else ''
    name = f"{prefix}-{entry}-{env}-e{b['episodes']}{tag}{label}-s{seed}"
    shared = METHODS[args.method].setup and bookkeeping.setup_key(dataclasses.replace(args, seed=seed), '', train.CODE)
    return {'entry': entry, 'seed': seed, 'name': name, 'budget': b['episodes'], 'flags': flags + ['--env', env],
            'setup': shared or None, 'warmup_seed': args.warmup_seed, 'code': bookkeeping.code_of(METHODS[args.method])}


def status(run_dir, budget, code=None):
    """'done' (summary.json at the budget), 'resume' (a checkpoint to continue), 'new', or
    'stale' (made by other code: its fingerprint is not `code`, train.CODE for the repo's methods; run again from scratch)."""
    cfg = report.read_json(os.path.join(run_dir, 'config.json'))
    if cfg is not None and cfg.get('code') != (code or train.CODE):
        return 'stale'
    s = report.read_json(os.path.join(run_dir, 'summary.json'))
    if s and s.get('episodes', 0) >= budget:
        return 'done'
    return 'resume' if os.path.isfile(os.path.join(run_dir, 'ckpt.pt')) else 'new'


def cached(log, what):
    """train.py prints '<what>: [cached ]<path>.pt' once the warm-up / a method's setup is cached
    or loaded, and 'warm-up: shipped <path>.safetensors' for the shipped base (the warm-up's progress bar also
    starts with 'warm-up:', hence the regex)."""
    return re.search(rf'^{what}: (cached |shipped )?.+\.(pt|safetensors)$', log, re.M) is not None


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
    todo = [(r, status(os.path.join(out_dir, r['name']), r['budget'], r.get('code'))) for r in runs]
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
    # the others wait until it is cached (the longest-first order makes that wait rare); likewise the first run
    # of each base builds its warm-up alone: two runs building it would race on one file
    builders, warming = {}, {}

    def first_or_wait(table, key):
        """The first run to need `key` builds it: -> the event it sets when done; any other waits for that, -> None."""
        with lock:
            waits = table.get(key)
            if waits is None:
                table[key] = mine = threading.Event()
                return mine
        waits.wait()
        return None

    def one(item):
        r, s = item
        d = os.path.join(out_dir, r['name'])
        warm = first_or_wait(warming, r['warmup_seed'])                        # its base's warm-up
        built = first_or_wait(builders, r['setup']) if r['setup'] and s != 'resume' else None   # its shared setup
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
        finally:  # a builder that failed releases its waiters too (they build the warm-up or setup themselves)
            for ev in (warm, built):
                if ev is not None:
                    ev.set()
        with lock:
            running.remove(r['name'])
            failed.extend([r['name']] if rc else [])
            bar.update(1)

    pool = ThreadPoolExecutor(jobs)
    try:
        list(pool.map(one, todo))
    except KeyboardInterrupt:  # the runs got the Ctrl-C too: they save a checkpoint and stop
        pool.shutdown(cancel_futures=True)
        bar.close()
        print('bench: interrupted; the same command continues where it stopped', file=sys.stderr)
        sys.exit(130)
    pool.shutdown()
    bar.close()
    return [r['name'] for r, _ in todo], failed


# ----------------------------------------------------------------------------- main

def parse(argv):
    p = Parser(prog='python -m bench', description=__doc__.split('\n')[0], allow_abbrev=False,  # --seed must not abbreviate --seeds
               epilog='Other --flag value pairs are forwarded to train.py for every run.')
    p.add_argument('--env', default='tooluse', help='environment (train.py --env)')
    p.add_argument('--plugin', default='', metavar='FILE[,FILE]', help="a fork's own .py file: the methods it registers "
                   "become entries (train.py --plugin, forwarded to every run)")
    p.add_argument('--methods', default='', help=f"comma-separated entries of {', '.join(ENTRIES)} "
                   f"(default: all; --quick: {','.join(QUICK_ENTRIES)})")
    p.add_argument('--seeds', default='', help='comma-separated seeds >= 1 (default 1,2,3)')
    p.add_argument('--warmup_seeds', default='', help="comma-separated bases (train.py --warmup_seed), every entry "
                   "and seed on each, the intervals over bases too (default: train.py's base alone, runs named as ever)")
    p.add_argument('--quick', action='store_true',
                   help=f"{' '.join(QUICK_FLAGS)}, {len(QUICK_ENTRIES)} entries, in compare-<env>-quick/")
    p.add_argument('--tune', action='store_true', help='per method, lr ×1/3, ×1, ×3 and one other setting of its key '
                   'knob on seed 0, the winner confirmed on seed 100 -> tuning.json (used by compares)')
    p.add_argument('--teacher_gap', action='store_true', help="every teacher's and its student's success before "
                   'training, overall and on opaque families -> teacher_gap.md')
    p.add_argument('--gap_tasks', type=int, default=200, help='held-out tasks of the --teacher_gap report')
    p.add_argument('--gap_seed', type=int, default=0, help="the seed whose setup the report's teachers are built "
                   "from (LOPD's cold start, OPSD's pool); with OMP_NUM_THREADS=1 a compare's seed's cached setups are reused")
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
        die(f'{bad[0]} is set by bench per run (use --methods / --seeds)')
    if o.plugin:  # its methods join the registry, then the entries; every run imports it too (train.py --plugin)
        for path in o.plugin.split(','):
            config.load_plugin(path)
        read_registry()
        o.plugin = ','.join(os.path.abspath(os.path.expanduser(p)) for p in o.plugin.split(','))
        extras += ['--plugin', o.plugin]
    o.entries = [e for e in (o.methods or ','.join(QUICK_ENTRIES if o.quick else ENTRIES)).split(',') if e]
    unknown = [e for e in o.entries if e not in ENTRIES and not (o.teacher_gap and e in gap.GAP_EXTRA)]
    if unknown:
        known = [*ENTRIES, *gap.GAP_EXTRA] if o.teacher_gap else ENTRIES  # the report also takes LOPD's variants
        die(f"--methods: {unknown[0]!r} is not one of {', '.join(known)}")
    try:
        o.seeds = [int(s) for s in (o.seeds or '1,2,3').split(',')]
    except ValueError:
        die(f'--seeds {o.seeds!r}: expected comma-separated integers')
    if {0, CONFIRM_SEED} & set(o.seeds) or min(o.seeds) < 0:
        die(f'--seeds must be >= 1 and not {CONFIRM_SEED}: seeds 0 and {CONFIRM_SEED} are the tuning (validation) seeds, never reported')
    try:
        o.warmup_seeds = [int(w) for w in o.warmup_seeds.split(',')] if o.warmup_seeds else []
    except ValueError:
        die(f'--warmup_seeds {o.warmup_seeds!r}: expected comma-separated integers')
    if o.warmup_seeds and (min(o.warmup_seeds) < 0 or len(set(o.warmup_seeds)) < len(o.warmup_seeds)):
        die(f"--warmup_seeds {','.join(map(str, o.warmup_seeds))}: each base once, and >= 0")
    if o.warmup_seeds and (o.tune or o.teacher_gap):
        die(f"--warmup_seeds is for compares: {'--tune tunes' if o.tune else '--teacher_gap reports'} on one base "
            f"(train.py's, or forward --warmup_seed W)")
    if o.warmup_seeds and any(t.split('=')[0] == '--warmup_seed' for t in extras):
        die('--warmup_seed is set by bench per run when --warmup_seeds is given (list the bases there)')
    if o.tune and not set(o.entries) & set(TUNE):
        die(f"--tune: none of {', '.join(o.entries)} has a grid (methods: {', '.join(TUNE)})")
    o.extras = (QUICK_FLAGS if o.quick else []) + extras  # the user's flags come last, so they win
    return o


def main(argv=None):
    t0, commit = time.time(), git_commit()  # the code the runs are made with, not what is committed meanwhile
    o = parse(sys.argv[1:] if argv is None else argv)
    out_dir = os.path.abspath(o.out_dir)
    cmp_dir = os.path.join(out_dir, f"compare-{o.env}{'-quick' if o.quick else ''}")  # a quick tuning tunes quick runs
    tuned = {} if o.no_tuned or o.tune else report.read_json(os.path.join(cmp_dir, 'tuning.json')) or {}
    if o.memory:
        return gap.memory_report(o)
    if o.curves:
        rows = {os.path.basename(os.path.normpath(d)): report.summarize([d], (report.read_json(os.path.join(d, 'summary.json')) or {})
                                                                 .get('episodes', 1)) for d in o.curves.split(',')}
        if not all(rows.values()):
            die(f"--curves: no finished run in {', '.join(d for d, r in rows.items() if not r)}")
        report.plot_curves(o.png, rows, None)
        return print(f'bench: {len(rows)} curves in {o.png}')
    if o.teacher_gap:
        o.argv = sys.argv[1:] if argv is None else argv
        table = gap.teacher_gap(o, out_dir, cmp_dir)  # before the f-string reads the clock
        print(f'bench: teacher gap in {time.time() - t0:.0f}s; table in {os.path.relpath(table)}')
        return
    if o.tune:
        entries = [e for e in o.entries if e in TUNE]
        runs = [tune_plan(e, s, o, 0) | {'setting': s} for e in entries for s in TUNE[e]]
    else:
        # an entry's own flags come last, so that an ablation holds whatever was tuned or forwarded
        tuned_flags = {e: (tuned.get(e) or tuned.get(method_of(e)) or {}).get('flags', []) for e in o.entries}
        # the bases innermost: with --jobs 2 the first two runs build two bases' warm-ups side by side
        runs = [plan('cmp', e, ENTRIES[e], tuned_flags[e] + o.extras + ENTRIES[e], o.env, s, base=w)
                for e in o.entries for s in o.seeds for w in o.warmup_seeds or [None]]
    os.makedirs(cmp_dir, exist_ok=True)  # only now: every run's flags passed train.py's checks
    launched, failed = run_all(runs, out_dir, os.path.join(cmp_dir, 'logs'), o.jobs)
    command = 'python -m bench ' + ' '.join(sys.argv[1:] if argv is None else argv)
    meta = {'env': o.env, 'episodes': runs[0]['budget'], 'forwarded': o.extras, 'command': command,
            'commit': commit, 'code': train_code(), 'failed': failed, **machine(), 'wall_s': round(time.time() - t0),
            'runs': len(runs), 'launched': len(launched),
            'warmup_seeds': list(dict.fromkeys(r['warmup_seed'] for r in runs))}  # the bases, as planned
    if o.tune:
        grid = {}
        for r in runs:
            grid.setdefault(r['entry'], []).append({'setting': r['setting'], **tune_result(out_dir, r)})
        # a setting that beats the default on seed 0 is run again, beside the default, on a second validation seed:
        # the noise over one seed's tasks is smaller than the noise between seeds (report.choose_setting)
        moved = {e: (settings[0], best) for e, settings in grid.items()
                 for best in [report.choose_setting(settings)[0]] if best and best is not settings[0]}
        confirm = [tune_plan(e, s['setting'], o, CONFIRM_SEED) | {'setting': s} for e, pair in moved.items() for s in pair]
        launched2, failed2 = run_all(confirm, out_dir, os.path.join(cmp_dir, 'logs'), o.jobs)
        for r in confirm:
            r['setting']['confirm'] = tune_result(out_dir, r)
        runs, launched, failed = runs + confirm, launched + launched2, failed + failed2
        meta |= {'failed': failed, 'wall_s': round(time.time() - t0), 'confirm_seed': CONFIRM_SEED,
                 'runs': len(runs), 'launched': len(launched)}
        report.write_tuning(cmp_dir, grid, meta)
        table = os.path.join(cmp_dir, 'tuning.md')
    else:
        results = {e: report.summarize([os.path.join(out_dir, r['name']) for r in runs if r['entry'] == e], runs[0]['budget'],
                                       by_base=bool(o.warmup_seeds)) for e in o.entries}
        target = report.add_reach(results)
        shown = {e: tuned_flags[e] + ENTRIES[e] for e in o.entries}
        report.write_results(cmp_dir, results, meta | {'seeds': o.seeds, 'tuned': bool(tuned), 'flags': shown}, target)
        report.plot_curves(os.path.join(cmp_dir, 'curves.png'), results, target)
        report.plot_actions(os.path.join(cmp_dir, 'actions.png'), results)
        table = os.path.join(cmp_dir, 'results.md')
    print(f'bench: {len(runs)} runs ({len(launched)} launched, {len(failed)} failed) in {time.time() - t0:.0f}s; '
          f'table in {os.path.relpath(table)}')
    sys.exit(1 if failed else 0)


def tune_plan(entry, setting, o, seed):
    """One tuning run: the entry with one setting of its grid (flags), named after the setting."""
    label = '-' + ''.join(x.lstrip('-') for x in setting) if setting else '-default'
    return plan('tune', entry, ENTRIES[entry] + setting, setting + o.extras + ENTRIES[entry], o.env, seed, label)


def tune_result(out_dir, r):
    """A tuning run's final reward and success and its last evaluation's per-task rewards (None if unfinished)."""
    s, _, evs = report.load_run(os.path.join(out_dir, r['name']))
    done = s and s.get('episodes', 0) >= r['budget'] and evs and evs[-1].get('task_reward')
    return {'name': r['name'], 'final_reward': s['final_reward'] if done else None,
            'final_success': s['final_success'] if done else None, 'task_reward': evs[-1]['task_reward'] if done else None}


def machine():
    """What a number was measured on: the date, the machine and the versions that decide it; the torch build
    and the CPU's kernel set decide the base too (warmup.py keys its cache on them)."""
    import platform
    from importlib.metadata import version
    return {'date': time.strftime('%Y-%m-%d'), 'machine': f'{platform.machine()}, {os.cpu_count()} cores, {platform.system()}',
            'python': platform.python_version(), 'torch': torch.__version__, 'cpu_kernels': warmup.cpu_kernels(),
            'transformers': version('transformers')}


def train_code():
    return train.CODE


def git_commit():
    with contextlib.suppress(Exception):
        return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    return 'unknown'


if __name__ == '__main__':
    main()
