"""Does the student move toward its teacher? On a fixed batch of the student's own rollouts of
training tasks, STEPS student steps of the method's loss at LR, and the same number of supervised
steps on the teacher's greedy episodes of those tasks (an upper bound: the teacher's answer shown
outright). Prints, per step: the loss the student is trained on, the gradient's norm at θ's
trainable weights (before clipping at 1), the update's size relative to the weights it moves
(LoRA: ‖ΔW‖/‖W‖ over the adapted layers), and every EVERY steps the student's greedy reward on the
tasks, how many of its greedy episodes changed, and at the first token where the student's greedy
action leaves the teacher's (tasks the teacher solves), the teacher's and the student's log-prob of
the teacher's token.

    python bench/probe_student.py STEPS LR TASKS EVERY [train.py flags]
    (e.g. 24 3e-4 8 8 --model $SMOL --env tooluse --method lopd ...; not part of the test suite)"""
import contextlib
import copy
import json
import os
import random
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import lopd  # noqa: E402
import model as M  # noqa: E402
import train  # noqa: E402
import warmup  # noqa: E402
from plumbing.registry import Batch  # noqa: E402

steps, lr, n_tasks, every, extra = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
os.chdir(ROOT)
name = extra[extra.index('--name') + 1] if '--name' in extra else f'probe-student-{lr}'
out_dir = extra[extra.index('--out_dir') + 1] if '--out_dir' in extra else 'runs'
os.makedirs(os.path.join(out_dir, name), exist_ok=True)
run = train.build(train.parse_args(['--eval_tasks', '4', '--eval_samples', '0', '--teacher_eval', '0', '--overwrite',
                                    '--lr', '3e-4', '--name', name, *extra]))   # LR acts in the probe's own optimizer: the run (and its cached setup) is the same
tok, env, model = run.tok, run.env, run.model
held = contextlib.ExitStack()
held.enter_context(run.autocast())   # all below under the run's autocast, as train.py's loop runs
tasks = random.Random(7).sample(env.train_tasks, n_tasks)
trainable = [p for p in model.parameters() if p.requires_grad]
lora = [m for m in model.modules() if hasattr(m, 'get_delta_weight') and hasattr(m, 'base_layer')]
start = copy.deepcopy(model.state_dict())
out = {'args': sys.argv[1:], 'rows': []}


def teacher_prefixes(eps):
    return train.with_default(run, train.embed_context(run, run.method.context(run, eps)))


with torch.no_grad():
    teps, tb, tm = train.rollout(run.teacher, tok, env, tasks, greedy=True, prefixes=teacher_prefixes([env.reset(t) for t in tasks]))
    torch.manual_seed(0)
    eps, bodies, masks = train.rollout(model, tok, env, tasks, temperature=run.args.temperature)
b = Batch(eps, *M.pad_batch(bodies, masks, tok.pad, run.device), torch.tensor([e.reward for e in eps], device=run.device))
with torch.no_grad():
    teacher = train.teacher_phase(run, b)
ctx = teacher_prefixes([env.reset(t) for t in tasks])
t_ids, t_amask, t_attn = M.pad_batch(tb, tm, tok.pad, run.device)
with torch.no_grad():   # the teacher's log-probs of its own greedy tokens, with its context
    t_logp = lopd.token_logp(M.logits_on(run.teacher, ctx, t_ids, t_attn, run.args.score_chunk), t_ids)
print(f'teacher greedy reward {sum(e.reward for e in teps) / len(teps):.3f}; student sampled {b.reward.mean():.3f}', flush=True)


def greedy_state(ref=None):
    """-> student greedy reward, its bodies, changed vs ref, [(teacher logp, student logp)] at the first divergence."""
    with torch.no_grad():
        geps, gb, _ = train.rollout(model, tok, env, tasks, greedy=True)
        s_logp = lopd.token_logp(M.logits_on(model, M.bos_prefix(model, tok, len(tasks)), t_ids, t_attn, run.args.score_chunk), t_ids)
    firsts = []
    for i, (g, t) in enumerate(zip(gb, tb)):
        if teps[i].success and not geps[i].success:
            k = next((k for k in range(min(len(g), len(t))) if g[k] != t[k]), None)
            if k is not None and tm[i][k]:
                firsts.append((round(t_logp[i, k].item(), 3), round(s_logp[i, k].item(), 3)))
    changed = None if ref is None else sum(x != y for x, y in zip(gb, ref))
    return sum(e.reward for e in geps) / len(geps), gb, changed, firsts


def delta_ratio():
    if not lora:
        return sum((p - start[n]).norm() ** 2 for n, p in model.named_parameters() if p.requires_grad).sqrt().item() / \
            sum(start[n].norm() ** 2 for n, p in model.named_parameters() if p.requires_grad).sqrt().item()
    with torch.no_grad():
        d = sum(m.get_delta_weight('default').float().norm() ** 2 for m in lora if 'default' in m.lora_A)
        w = sum(m.base_layer.weight.float().norm() ** 2 for m in lora if 'default' in m.lora_A)
    return (d / w).sqrt().item()


def train_loop(name, loss_fn):
    model.load_state_dict(start)
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    r0, ref, _, first0 = greedy_state()
    print(f'[{name}] step 0: greedy reward {r0:.3f}; first divergence (teacher, student logp) {first0}', flush=True)
    for step in range(1, steps + 1):
        t0 = time.time()
        with M.train_mode(model):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn()
            loss.backward()
            g = torch.nn.utils.clip_grad_norm_(trainable, 1.0).item()
            opt.step()
        row = {'probe': name, 'step': step, 'loss': round(loss.item(), 4), 'grad_norm': round(g, 4),
               'update': f'{delta_ratio():.2e}', 's': round(time.time() - t0, 1)}
        if step % every == 0 or step == steps:
            r, _, changed, first = greedy_state(ref)
            row.update(greedy_reward=round(r, 3), changed=changed, first=first)
        out['rows'].append(row)
        print(row, flush=True)


def distill():
    logits_s = M.logits_on(model, M.bos_prefix(model, tok, len(tasks)), b.ids, b.attn, run.args.score_chunk)
    return run.method.loss(run, b, logits_s, teacher)


train_loop('distill', distill)
train_loop('sft-on-teacher', lambda: warmup.warmup_loss(model, tok, teps, [None] * len(teps), run.device,
                                                         chunk=run.args.score_chunk))
json.dump(out, open(os.path.join(out_dir, name, 'probe.json'), 'w'), indent=1)
