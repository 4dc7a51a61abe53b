"""Where the distillation signal goes: at the base, on 256 of the student's own rollouts of
training tasks, the KL between the method's teacher (with its context) and the student at each
agent token, by class of token: the first token of the first turn (the first decision: which
tool), the first token of a later turn (a later decision), any other token (arguments,
punctuation); split by family (opaque or transparent) and outcome. Prints each class's share
of the tokens and of the forward KL, the KL per token, and how often the two argmaxes agree.

    python bench/probe_signal.py METHOD SEED [train.py flags]   (e.g. opsd 100; not part of the test suite)"""
import os
import random
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import lopd  # noqa: E402
import model as M  # noqa: E402
import train  # noqa: E402
from plumbing import registry  # noqa: E402

method, seed, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
os.chdir(ROOT)
name = f'probe-signal-{method}-s{seed}'
os.makedirs(os.path.join('runs', name), exist_ok=True)
run = train.build(train.parse_args(['--method', method, '--seed', str(seed), '--name', name, '--overwrite',
                                    '--eval_tasks', '8', '--eval_samples', '0', '--teacher_eval', '0', *extra]))
env, opaque, stats = run.env, set(run.env.opaque), {}
tasks = random.Random(5).sample(env.train_tasks, 256)
with torch.no_grad():
    for i in range(0, len(tasks), 32):
        eps, bodies, masks = train.rollout(run.model, run.tok, env, tasks[i:i + 32])
        b = registry.Batch(eps, *M.pad_batch(bodies, masks, run.tok.pad, run.device), torch.tensor([e.reward for e in eps]))
        teacher = train.teacher_phase(run, b)
        ls = M.logits_on(run.model, M.bos_prefix(run.model, run.tok, len(eps)), b.ids, b.attn, 0)
        fkl, rkl = lopd.divergence(ls, teacher.logits, 'fkl'), lopd.divergence(ls, teacher.logits, 'rkl')  # (B, T)
        agree = (ls.argmax(-1) == teacher.logits.argmax(-1)).float()
        for r, e in enumerate(eps):
            if not teacher.keep[r]:
                continue
            pos, turn = b.amask[r].nonzero().flatten().tolist(), 0
            for j, t in enumerate(pos):
                first = j == 0 or pos[j - 1] != t - 1   # an agent turn is a run of consecutive agent tokens
                turn += first and j > 0
                cls = ('first token, turn 1' if turn == 0 else 'first token, later') if first else 'other'
                group = ('opaque' if e.task.family in opaque else 'transp', 'win' if e.success else 'fail')
                for key in [(*group, cls), ('all', 'all', cls)]:
                    s = stats.setdefault(key, [0, 0.0, 0.0, 0.0])
                    s[0] += 1
                    s[1] += fkl[r, t].item()
                    s[2] += rkl[r, t].item()
                    s[3] += agree[r, t].item()
n_all = sum(v[0] for k, v in stats.items() if k[0] == 'all')
f_all = sum(v[1] for k, v in stats.items() if k[0] == 'all')
print(f'{method}, seed {seed} {" ".join(extra)}: {n_all} agent tokens of {len(tasks)} rollouts')
print('| family | outcome | token | tokens | % tokens | % fKL | fKL/token | rKL/token | argmax agree |\n|---|---|---|---|---|---|---|---|---|')
for k in sorted(stats):
    n, f, r, a = stats[k]
    print(f'| {k[0]} | {k[1]} | {k[2]} | {n} | {100 * n / n_all:.1f} | {100 * f / f_all:.1f} | {f / n:.3f} | {r / n:.3f} | {a / n:.3f} |')
