"""LOPD's composer phase over training, from run folders: the margin Δ (eq. 2) against m, its
multiplier β, how far the latents moved from their cold start (‖z − z0‖²) and the teacher's and the
student's held-out reward, one line per run.

    python bench/phase_plot.py runs/lopd-tooluse-s0 runs/lopd-tooluse-s1 ... --png assets/composer-phase.png
"""
import argparse
import json
import os

from matplotlib.figure import Figure


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('runs', nargs='+')
    p.add_argument('--png', default='composer-phase.png')
    a = p.parse_args()
    fig = Figure(figsize=(13, 3))
    axes = fig.subplots(1, 4)
    for d in a.runs:
        ms = [json.loads(line) for line in open(os.path.join(d, 'metrics.jsonl'))]
        margin = json.load(open(os.path.join(d, 'config.json'))).get('margin', 0.05)
        x = [m['training_episodes'] for m in ms]
        label = os.path.basename(d.rstrip('/'))
        axes[0].plot(x[1:], [m.get('delta') for m in ms[1:]], marker='o', label=label)
        axes[1].plot(x, [m.get('beta', 0.0) for m in ms], marker='o')
        axes[2].plot(x[1:], [m.get('anchor') for m in ms[1:]], marker='o')
        axes[3].plot(x[1:], [m.get('teacher_reward') for m in ms[1:]], marker='o', color='tab:red', alpha=0.5)
        axes[3].plot(x[1:], [m.get('student_reward_same_tasks') for m in ms[1:]], marker='o', color='tab:blue', alpha=0.5)
    axes[0].axhline(margin, color='k', ls='--', lw=0.8)
    titles = ['Δ (eq. 2; dashed: m)', 'β', '‖z − z0‖²', 'teacher (red), student (blue)']
    for ax, t in zip(axes, titles):
        ax.set(title=t, xlabel='training episodes')
        ax.grid(alpha=0.3)
    axes[2].set_yscale('log')
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(a.png, dpi=80)
    print(a.png)


if __name__ == '__main__':
    main()
