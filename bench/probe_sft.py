"""Learnability probe: from the warmed-up base, supervised steps on the scripted expert's demos of
training tasks (the oracle), as many steps of as many episodes as a default run trains on; the
held-out reward every 40 steps. What a student could learn in the budget if it were shown the
answer, for comparison with what on-policy distillation takes from a teacher.

    python bench/probe_sft.py LR STEPS SEED        (e.g. 1e-3 160 100; not part of the test suite)"""
import json
import os
import random
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import envs  # noqa: E402
import train  # noqa: E402
import warmup  # noqa: E402

lr, steps, seed = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
os.chdir(ROOT)
name = f'probe-sft-{lr}-s{seed}'
os.makedirs(os.path.join('runs', name), exist_ok=True)
run = train.build(train.parse_args(['--method', 'grpo', '--seed', str(seed), '--name', name, '--overwrite',
                                    '--eval_samples', '0', '--lr', str(lr)]))  # GRPO: no setup, the plain base
rng, t0 = random.Random(seed), time.time()
for step in range(1, steps + 1):
    tasks = rng.sample(run.env.train_tasks, run.args.batch)
    demos = [envs.play(run.env, t, run.env.demo(t, rng)) for t in tasks]
    loss = warmup.warmup_loss(run.model, run.tok, demos, [None] * len(demos), run.device)
    run.opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
    run.opt.step()
    if step % 40 == 0:
        run.step = step
        m = train.evaluate(run)
        print(json.dumps({'step': step, 'loss': round(loss.item(), 3), 'reward': m['reward'], 'success': m['success'],
                          'seconds': round(time.time() - t0)}), flush=True)
