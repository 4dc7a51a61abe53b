"""Seconds of a greedy rollout of N held-out tasks, the KV cache kept across turns (M.Turns) against
re-reading the whole conversation every turn, on the same model in one process (ratios, not limits).

    python bench/time_rollout.py N [train.py flags]   (e.g. 16 --model $SMOL --env tooluse ...; not part of the test suite)"""
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import model as M  # noqa: E402
import train  # noqa: E402

n, extra = int(sys.argv[1]), sys.argv[2:]
os.chdir(ROOT)
os.makedirs(os.path.join('runs', 'time-rollout'), exist_ok=True)
run = train.build(train.parse_args(['--eval_tasks', '4', '--eval_samples', '0', '--teacher_eval', '0', '--overwrite',
                                    '--name', 'time-rollout', *extra]))
tasks, cached = run.env.eval_tasks[:n], M.Turns
for name, turns in (('re-read', lambda: None), ('cached', cached), ('re-read', lambda: None), ('cached', cached)):
    M.Turns = turns
    t0 = time.time()
    eps, bodies, _ = train.rollout(run.model, run.tok, run.env, tasks, greedy=True)
    print(f'{name}: {time.time() - t0:.1f} s for {n} tasks, {sum(len(e.turns) for e in eps)} turns, '
          f'{sum(map(len, bodies))} body tokens, reward {sum(e.reward for e in eps) / n:.3f}', flush=True)
