"""What runs gained: each run folder's held-out greedy reward at the base and at its last evaluation,
the gain paired on the same tasks with a 95% bootstrap interval, and the curve; with two or more
runs, the first − each other at the end, paired likewise. Optionally a plot of the curves.

    python bench/gain.py RUN_DIR [RUN_DIR ...] [--plot curves.png]"""
import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
import numpy as np  # noqa: E402
from bench.report import bootstrap_ci  # noqa: E402


def evals(run_dir):
    """-> the evaluations of a run (one per step evaluated, the last line for a step wins), by episodes."""
    out = {}
    with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
        for line in f:
            m = json.loads(line)
            if 'task_reward' in m:
                out[m['step']] = m
    return [out[k] for k in sorted(out)]


def ci(values):
    m, lo, hi = bootstrap_ci([values])
    return f'{m:+.3f} [{lo:+.3f}, {hi:+.3f}]'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('runs', nargs='+')
    ap.add_argument('--plot', default='')
    a = ap.parse_args(argv)
    runs = {os.path.basename(os.path.normpath(r)): evals(r) for r in a.runs}
    print('| run | tasks | base | final (episodes) | gain, paired, 95% CI | curve (episodes: reward) |\n|---|---|---|---|---|---|')
    for name, ev in runs.items():
        base, last = np.array(ev[0]['task_reward']), np.array(ev[-1]['task_reward'])
        curve = ', '.join(f"{e['episodes']}: {e['reward']:.3f}" for e in ev)
        print(f"| {name} | {len(base)} | {base.mean():.3f} | {last.mean():.3f} ({ev[-1]['episodes']}) | {ci(last - base)} | {curve} |")
    names = list(runs)
    for other in names[1:]:
        x, y = np.array(runs[names[0]][-1]['task_reward']), np.array(runs[other][-1]['task_reward'])
        if len(x) == len(y):
            print(f'\n{names[0]} − {other} at the end, paired on the same tasks: {ci(x - y)}')
    if a.plot:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, ev in runs.items():
            ax.plot([e['episodes'] for e in ev], [e['reward'] for e in ev], marker='o', label=name)
        ax.set_xlabel('training episodes')
        ax.set_ylabel('held-out reward (greedy)')
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f'\nplot: {a.plot}')


if __name__ == '__main__':
    main()
