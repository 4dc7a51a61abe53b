"""Held-out evaluation, every --eval_every steps and at the base: what metrics.jsonl's lines hold (docs/metrics.md).
Sampled evaluation draws from a generator of its own, so training never depends on how often it evaluates."""
import random

import numpy as np
import torch

import envs
import lopd
import model as M
from plumbing import bookkeeping as bk
from plumbing import parallel
from plumbing.registry import embed_context, with_default

EVAL_TEMPERATURE = 0.7  # the paper's evaluation temperature


@torch.no_grad()
def evaluate(run, rollout):
    """Held-out graded reward and success: greedy, and sampled at temperature 0.7 as the paper
    evaluates (--eval_samples per task), the student alone, no privileged context; per family, and
    per task (for intervals over tasks). Plus the teacher's own reward when it decodes with its
    context (does the context carry information?). rollout: train.rollout (step 1), as the run plays."""
    a, tasks = run.args, run.env.eval_tasks[:run.args.eval_tasks]
    rows = parallel.decode_rows(run, a.micro_batch or 128)                      # decoded at once: the KV cache's rows

    def play(ts, **kw):  # the student decodes alone (--merge_lora: its LoRA merged meanwhile)
        with M.lora_merged(run.model, a.merge_lora):
            return parallel.shared(run, lambda ts: rollout(run.model, run.tok, run.env, ts, rows=rows, **kw)[0], ts)
    run.lap()
    eps = play(tasks, greedy=True)
    out = {'reward': float(np.mean([e.reward for e in eps])), 'success': float(np.mean([e.success for e in eps]))}
    out['family'], out['actions'] = envs.by_family(eps), envs.action_stats(run.env, eps)
    out['task_reward'] = [round(e.reward, 4) for e in eps]
    if a.eval_samples:  # from a generator of its own: training never depends on how often or how much it evaluates
        with torch.random.fork_rng(devices=[run.device] if run.device.type == 'cuda' else []):
            torch.manual_seed(10_000 * a.seed + run.step)
            sampled = play([t for t in tasks for _ in range(a.eval_samples)], temperature=EVAL_TEMPERATURE)
        r = np.array([e.reward for e in sampled]).reshape(len(tasks), a.eval_samples)
        out.update(reward_sampled=float(r.mean()), success_sampled=float(np.mean([e.success for e in sampled])),
                   task_reward_sampled=[round(float(x), 4) for x in r.mean(1)])
    if run.method.context and a.teacher_eval:
        tasks = tasks[:a.teacher_eval]  # families cycle, so the first N are balanced
        out['student_reward_same_tasks'] = float(np.mean([e.reward for e in eps[:len(tasks)]]))
        out['student_success_same_tasks'] = float(np.mean([e.success for e in eps[:len(tasks)]]))
        prefixes = with_default(run, embed_context(run, run.method.context(run, [run.env.reset(t) for t in tasks])))
        teps = parallel.shared(run, lambda ix: rollout(run.teacher, run.tok, run.env, [tasks[i] for i in ix], greedy=True,
                                                       prefixes=[prefixes[i] for i in ix], rows=rows)[0], list(range(len(tasks))))
        out['teacher_reward'] = float(np.mean([e.reward for e in teps]))
        out['task_teacher_reward'] = [round(e.reward, 4) for e in teps]
        out['teacher_success'] = float(np.mean([e.success for e in teps]))
        demos = expert_demos(run.env, tasks)                     # the same demos at every evaluation
        out['teacher_demo_nll'] = demo_nll(run, run.teacher, prefixes, demos)
        out['student_demo_nll'] = demo_nll(run, run.model, M.bos_prefix(run.model, run.tok, len(demos)), demos)
    run.lap('eval')
    return bk.log_eval(run, out)


def expert_demos(env, tasks):
    """One expert demo per task (env.demo, not noisy), seeded by its place in the list: held-out
    trajectories that neither the student nor the teacher generated."""
    return [envs.play(env, t, env.demo(t, random.Random(i))) for i, t in enumerate(tasks)]


def demo_nll(run, model, prefixes, demos, rows=32):
    """The mean over demos of −log π(a_t | context, x, a<t) per agent token: how likely `model`, reading
    `prefixes`, finds an expert's actions. A continuous "knows more" beside the teacher's greedy reward."""
    nll = []
    for i in range(0, len(demos), rows):
        enc = [M.encode_episode(run.tok, e) for e in demos[i:i + rows]]
        ids, amask, attn = M.pad_batch([e[0] for e in enc], [e[1] for e in enc], run.tok.pad, run.device)
        logits = M.logits_on(model, prefixes[i:i + rows], ids, attn, run.args.score_chunk, run.args.micro_batch)
        logp = lopd.token_logp(logits, ids, amask)                                    # (rows, T), 0 off the mask
        nll += (-(logp * amask).sum(1) / amask.sum(1).clamp(min=1)).tolist()
    return float(np.mean(nll))
