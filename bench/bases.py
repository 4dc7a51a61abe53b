"""Bases, side by side: per warm-up seed, the base's held-out reward, whether its teachers know more than
their student at step 0 (paired on the same tasks: LOPD's latents after the cold start, OPSD's text),
and its reading curve over the warm-up (the probe's NLL drop when a context is shown).

    python bench/bases.py runs/bases --md docs/bases.md --png assets/bases.png

reads the run folders `<folder>/gap-<recipe>-<method>-w<seed>/` that

    python train.py --method {lopd,opsd} --warmup_seed W --setup_free --episodes 16 --eval_tasks 100 \\
        --teacher_eval 100 --eval_samples 0 --out_dir <folder> --name gap-<recipe>-<method>-w<W>

writes (the base's first evaluation is after the setup, so its teacher reads its context)."""
import argparse
import glob
import json
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing.bookkeeping import paired_gap  # noqa: E402


def gap_of(run_dir):
    """A gap run's base line -> (student reward, (teacher − student, lo, hi)); the interval is None for a run
    that kept no per-task teacher rewards."""
    m = json.loads(open(os.path.join(run_dir, 'metrics.jsonl')).readline())
    gap = paired_gap(m.get('task_teacher_reward'), m['task_reward'])
    return m['reward'], gap or (m['teacher_reward'] - m['student_reward_same_tasks'], None, None)


def rows(folder):
    """-> {(recipe, seed): {'reward', 'lopd', 'opsd', 'reading', 'kernels'}} from the folder's gap runs."""
    out = {}
    for d in sorted(glob.glob(os.path.join(folder, 'gap-*-w*'))):
        hit = re.fullmatch(r'gap-(.+)-(lopd|opsd)-w(\d+)', os.path.basename(d))
        if not hit or not os.path.exists(os.path.join(d, 'summary.json')):
            continue
        recipe, method, seed = hit[1], hit[2], int(hit[3])
        summary = json.load(open(os.path.join(d, 'summary.json')))
        reward, gap = gap_of(d)
        row = out.setdefault((recipe, seed), {})
        row.update({'reward': reward, method: gap})
        if summary.get('base'):
            row.update(reading=summary['base']['reading'], kernels=f"torch {summary['base']['torch']}, "
                                                                   f"{summary['base']['cpu_kernels']}")
    return out


def table(found):
    pm = lambda g: '—' if g is None else f'{g[0]:+.3f}' + (f' [{g[1]:+.3f}, {g[2]:+.3f}]' if g[1] is not None else '')
    md = ['| recipe | warm-up seed | base reward (100 tasks) | LOPD teacher − student | OPSD teacher − student | '
          'reading at the end: past, solution |', '|---|---|---|---|---|---|']
    for (recipe, seed), r in sorted(found.items()):
        last = r.get('reading', [{}])[-1]
        md.append(f"| {recipe} | {seed} | {r['reward']:.3f} | {pm(r.get('lopd'))} | {pm(r.get('opsd'))} | "
                  f"{last.get('past', float('nan')):+.3f}, {last.get('solution', float('nan')):+.3f} |")
    return md


def plot(found, png):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 3.6))
    ax, bx = fig.subplots(1, 2)
    recipes = sorted({k[0] for k in found})
    for (recipe, seed), r in sorted(found.items()):
        if not r.get('reading'):
            continue
        style = ['-', '--', ':', '-.'][recipes.index(recipe) % 4]
        ax.plot([c['step'] for c in r['reading']], [c['past'] for c in r['reading']], style, marker='.',
                label=f'{recipe} w{seed}')
        if r.get('lopd'):
            bx.scatter(r['reading'][-1]['past'], r['lopd'][0], marker='os^D'[recipes.index(recipe) % 4])
            bx.annotate(f'{recipe} w{seed}', (r['reading'][-1]['past'], r['lopd'][0]), fontsize=6)
    ax.set(title="reading over the warm-up ('past' context)", xlabel='warm-up step', ylabel='NLL drop per token (nats)')
    bx.set(title='reading at the end vs the step-0 gap', xlabel='NLL drop, past', ylabel='LOPD teacher − student')
    ax.axhline(0, color='k', lw=0.6)
    bx.axhline(0.10, color='k', ls='--', lw=0.6)
    ax.legend(fontsize=6, ncol=2)
    for a in (ax, bx):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('folder')
    p.add_argument('--md', default='')
    p.add_argument('--png', default='')
    a = p.parse_args()
    found = rows(a.folder)
    md = table(found)
    if a.md:
        open(a.md, 'w').write('\n'.join(md) + '\n')
    if a.png:
        plot(found, a.png)
    print('\n'.join(md))
    ok = [r['lopd'][0] for r in found.values() if r.get('lopd')]
    print(f'{len(ok)} bases; LOPD teacher − student: mean {np.mean(ok):+.3f}, min {min(ok):+.3f}' if ok else 'no bases')


if __name__ == '__main__':
    main()
