"""When step 6 helps: LOPD's composer phase against its frozen ablation, per composer, from run folders named
`<arm>-s<seed>` (one base) or `w<W>-<arm>-s<seed>` (several), each arm paired with the frozen arm of its composer.

    python bench/regime.py runs/regime --frozen copy-frozen:copy-phi3e5,rand-frozen:rand-phi3e5

A row per arm: the final held-out reward; the arm − its frozen composer, paired on the same tasks, seeds and bases
(bootstrap over bases, seeds, tasks); the teacher's greedy reward with its latents (`--teacher_eval` tasks) and its
NLL of held-out expert demos given them, first → last evaluation; Δ, β and drift (‖z − z0‖²/‖z0‖²) at the end."""
import argparse
import glob
import json
import os
import re

import numpy as np

from bench.report import bootstrap_ci, nest, paired

NAME = re.compile(r'^(?:(w\d+)-)?(.+)-s(\d+)$')


def runs(folder):
    """-> {arm: {run key ('s100' or 'w4-s100'): metrics lines}} of the finished runs in folder."""
    out = {}
    for d in sorted(glob.glob(os.path.join(folder, '*', 'summary.json'))):
        m = NAME.match(os.path.basename(os.path.dirname(d)))
        if m:
            base, arm, seed = m.groups()
            lines = [json.loads(x) for x in open(os.path.join(os.path.dirname(d), 'metrics.jsonl'))]
            out.setdefault(arm, {})[f'{base}-s{seed}' if base else seed] = lines
    return out


def ci(c, points=True):
    """(mean, lo, hi) -> 'mean [lo, hi]': in points (× 100) for a difference, as a fraction for a reward."""
    if c is None:
        return '—'
    if points:
        return f'{100 * c[0]:+.1f} [{100 * c[1]:+.1f}, {100 * c[2]:+.1f}]'.replace('-', '−')
    return f'{c[0]:.3f} [{c[1]:.3f}, {c[2]:.3f}]'


def row(arm, got, frozen):
    """One arm's markdown row; frozen: its frozen composer's runs, or None (it is the frozen arm)."""
    final = {k: ms[-1]['task_reward'] for k, ms in got.items()}
    reward = bootstrap_ci(nest(final))
    diff = paired(final, {k: ms[-1]['task_reward'] for k, ms in frozen.items()}) if frozen else None
    rise = paired({k: ms[-1]['task_teacher_reward'] for k, ms in got.items()},
                  {k: ms[0]['task_teacher_reward'] for k, ms in got.items()})
    mean = lambda key, i: np.mean([ms[i][key] for ms in got.values() if ms[i].get(key) is not None] or [np.nan])
    teacher = f"{mean('teacher_reward', 0):.3f} → {mean('teacher_reward', -1):.3f} ({ci(rise)})"
    nll = f"{mean('teacher_demo_nll', 0):.3f} → {mean('teacher_demo_nll', -1):.3f}"
    student_nll = f"{mean('student_demo_nll', 0):.3f} → {mean('student_demo_nll', -1):.3f}"
    end = lambda key: '' if np.isnan(mean(key, -1)) else f'{mean(key, -1):.3g}'
    return (f"| {arm} | {len(got)} | {ci(reward, points=False)} | {ci(diff)} | {teacher} | {nll} | {student_nll} | {end('delta')} | "
            f"{end('beta')} | {end('drift')} |")


def table(folder, pairs):
    """pairs: [(frozen arm, [arms paired with it])] -> markdown lines."""
    got = runs(folder)
    md = ['| arm | runs | final reward | − its frozen composer (points) | teacher, first → last (rise, points) | teacher NLL of expert demos, '
          'first → last | student NLL of them | Δ | β | drift |', '|' + '---|' * 10]
    for frozen, arms in pairs:
        if frozen in got:
            md.append(row(frozen, got[frozen], None))
        md += [row(a, got[a], got.get(frozen)) for a in arms if a in got]
    return md


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('folder')
    p.add_argument('--frozen', required=True, help='FROZEN:ARM[:ARM],...: each frozen arm and the arms paired with it')
    a = p.parse_args()
    pairs = [(x.split(':')[0], x.split(':')[1:]) for x in a.frozen.split(',')]
    print('\n'.join(table(a.folder, pairs)))


if __name__ == '__main__':
    main()
