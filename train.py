"""Train a small agent with on-policy self-distillation: LOPD and its baselines.

One LOPD training step (DESIGN §3; one rollout per task, G = 1):
  1. rollout         the student samples one multi-turn episode per task (KV cache)
  2. retrieve        top-J successful past trajectories of similar tasks from the bank
  3. compose         the frozen base reads each; the composer φ maps it to K latent tokens
  4. teacher_phase   the frozen teacher π_θ0(·|z, x, y<t) scores every agent token
  5. student_phase   one optimizer step of θ on L_distill = KL(π_θ ‖ sg π_T), agent tokens
  6. composer_phase  one step of φ on the privileged-margin objective; dual update of β
  7. write_back      new successful rollouts go into the bank
Before step 1, once: warm-up (supervised on noisy-expert demos, cached under runs/ and
shared by every method), and the LOPD cold start (fill the bank with base rollouts,
which count toward the episode budget, then pre-train φ by the frozen teacher's NLL of
successful trajectories given the latents of *other* tasks' experiences).

Baselines, same base and budget (DESIGN §2): grpo, opsd, sdpo, sdft, skillsd and the
trajtext ablation. A new variant is one context builder plus one entry in METHODS (the
block marked FORK HERE); the teacher's weights are frozen θ0, an EMA of θ, or θ itself.

Simplifications, said plainly: one PPO epoch per batch, so GRPO's ratio is 1 and its
clip never binds (the loss is the clipped objective all the same); the teacher forward
for LOPD is run once with φ's graph kept and reused by the student phase (detached)
and the composer phase, which gives the same numbers as two separate forwards; the latents
follow <|bos|> with no framing text (framing hurt our from-scratch base, see lopd_context).
"""
import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

import envs
import lopd
import model as M
import retrieval

MAX_OBS_CHARS = 100  # observations are cut to this many characters before tokenizing
# a fingerprint of the code that produced a run (config.json, summary.json, ckpt.pt): a
# compare reuses a finished run only if the code is the same (bench.py)
CODE = hashlib.sha1(b''.join(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f), 'rb').read()
                             for f in ['train.py', 'lopd.py', 'envs.py', 'model.py', 'retrieval.py'])).hexdigest()[:10]


def arg(default, help):
    return field(default=default, metadata={'help': help})


@dataclass
class Args:
    method: str = arg('lopd', 'method: lopd, grpo, opsd, sdpo, sdft, skillsd, trajtext')
    env: str = arg('tooluse', 'environment: ' + ', '.join(envs.ENVS))
    seed: int = arg(0, 'seed of this run (task order, sampling, init of φ)')
    episodes: int = arg(3072, 'rollout budget: episodes sampled in total (LOPD: bank filling included)')
    batch: int = arg(64, 'episodes per training step (GRPO: tasks × group)')
    lr: float = arg(0.0, 'student learning rate (0 = the method default)')
    eval_every: int = arg(8, 'steps between held-out evaluations')
    eval_tasks: int = arg(250, 'held-out tasks per evaluation (the first N of the fixed set)')
    name: str = arg('', 'run name (default: <method>-<env>-s<seed>)')
    out_dir: str = arg('runs', 'where runs/<name>/ and the warm-up cache go')
    resume: str = arg('', 'resume from a run folder or its ckpt.pt')
    model: str = arg('', 'transformers causal LM name or path (default: the offline tiny Llama)')
    d_model: int = arg(128, 'tiny Llama width')
    n_layer: int = arg(4, 'tiny Llama depth')
    warmup_steps: int = arg(250, 'supervised warm-up steps on noisy-expert demos')
    warmup_batch: int = arg(64, 'demos per warm-up step')
    warmup_lr: float = arg(3e-3, 'warm-up learning rate')
    warmup_ctx: float = arg(0.0, 'fraction of warm-up demos that teach the base to read a text context')
    divergence: str = arg('', 'distillation divergence: rkl, fkl, jsd (default: per method)')
    topk: int = arg(0, 'distil over the teacher top-k + a tail bucket (0 = full vocabulary)')
    K: int = arg(4, 'LOPD: latent tokens per retrieved experience')
    J: int = arg(3, 'LOPD: experiences retrieved per task')
    margin: float = arg(0.05, 'LOPD: privileged margin m (0 = ablation)')
    lam: float = arg(0.2, 'LOPD: anchor weight λ on ‖z − z0‖²')
    eta_beta: float = arg(0.5, 'LOPD: dual step size η_β for the margin multiplier β')
    lr_composer: float = arg(0.0, 'LOPD: composer learning rate (0 = the student lr)')
    init_episodes: int = arg(512, 'LOPD: base rollouts that fill the bank before cold start')
    cold_start_steps: int = arg(300, 'LOPD: composer pre-training steps (teacher NLL)')
    teacher: str = arg('', "the teacher's weights: frozen, ema or live (default: per method)")
    ema_rate: float = arg(0.05, 'rate of the EMA teacher: θ_T ← (1 − rate) θ_T + rate θ')
    k3_coef: float = arg(0.001, 'Skill-SD: weight λ of the importance-weighted k3 term')
    frozen_composer: bool = arg(False, 'LOPD ablation: keep φ at its cold start (no composer phase)')
    allow_same_task: bool = arg(False, 'LOPD: let retrieval return this very task instance')
    bank_capacity: int = arg(4000, 'LOPD: experience bank size (FIFO)')
    teacher_eval: int = arg(100, 'held-out tasks on which the teacher decodes with its context (0 = off)')
    device: str = arg('auto', 'auto, cpu, cuda or mps')
    dtype: str = arg('auto', 'compute dtype: fp32, bf16 (autocast), or auto = bf16 on a CUDA device that supports it, else fp32')
    max_skips: int = arg(5, 'stop the run after this many updates in a row with a non-finite loss or gradient')
    inject_nan: str = arg('', 'test hook: comma-separated steps whose student loss is made NaN (they must be skipped)')


def die(msg):
    print(f'train.py: error: {msg}', file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        die(message)


def parse_args(argv=None):
    p = Parser(description=__doc__.split('\n')[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
               allow_abbrev=False)
    for f in dataclasses.fields(Args):
        if f.type is bool or f.type == 'bool':
            p.add_argument(f'--{f.name}', action='store_true', help=f.metadata['help'])
        else:
            p.add_argument(f'--{f.name}', type=type(f.default), default=f.default, help=f.metadata['help'])
    a = Args(**vars(p.parse_args(argv)))
    check_args(a)
    return a


def check_args(a):
    """Every argument checked up front: one line naming the problem, exit status 2."""
    if a.method not in METHODS:
        die(f"--method {a.method!r} is not one of {', '.join(METHODS)}")
    if a.env not in envs.ENVS:
        die(f"--env {a.env!r} is not one of {', '.join(envs.ENVS)}")
    for k in ['episodes', 'batch', 'eval_every', 'eval_tasks', 'd_model', 'n_layer', 'warmup_batch']:
        if getattr(a, k) <= 0:
            die(f'--{k} must be positive, got {getattr(a, k)}')
    for k in ['lr', 'warmup_lr', 'lr_composer', 'k3_coef', 'lam', 'eta_beta', 'margin', 'topk', 'K', 'init_episodes',
              'cold_start_steps', 'warmup_steps', 'teacher_eval']:
        if getattr(a, k) < 0:
            die(f'--{k} must be >= 0, got {getattr(a, k)}')
    if a.J <= 0 or a.bank_capacity <= 0:
        die('--J and --bank_capacity must be positive')
    if a.teacher and a.teacher not in ('frozen', 'ema', 'live'):
        die(f'--teacher {a.teacher!r} is not one of frozen, ema, live')
    if a.method == 'lopd' and a.teacher and a.teacher != 'frozen':
        die('--teacher: LOPD\'s composer is trained against the frozen base; only --teacher frozen applies')
    if not 0 <= a.warmup_ctx <= 1:
        die(f'--warmup_ctx must be in [0, 1], got {a.warmup_ctx}')
    if not 0 < a.ema_rate <= 1:
        die(f'--ema_rate must be in (0, 1], got {a.ema_rate}')
    if a.divergence and a.divergence not in ('rkl', 'fkl', 'jsd'):
        die(f'--divergence {a.divergence!r} is not one of rkl, fkl, jsd')
    if a.batch % METHODS[a.method].group:
        die(f'--batch {a.batch} must be a multiple of the group size {METHODS[a.method].group} of {a.method}')
    if a.resume and not os.path.exists(a.resume):
        die(f'--resume path does not exist: {a.resume}')
    if a.device not in ('auto', 'cpu', 'cuda', 'mps'):
        die(f'--device {a.device!r} is not one of auto, cpu, cuda, mps')
    if a.device == 'cuda' and not torch.cuda.is_available():
        die('--device cuda asked for, but torch sees no CUDA device')
    if a.dtype not in ('auto', 'fp32', 'bf16'):
        die(f'--dtype {a.dtype!r} is not one of auto, fp32, bf16 (fp16 is not offered: it needs loss scaling)')
    if a.dtype == 'bf16' and pick_device(a.device).type == 'cuda' and not torch.cuda.is_bf16_supported():
        die('--dtype bf16: this CUDA device does not support bfloat16; use --dtype fp32')
    if a.dtype == 'bf16' and pick_device(a.device).type == 'mps':
        die('--dtype bf16 is not supported on mps here; use --dtype fp32')
    if a.max_skips <= 0:
        die(f'--max_skips must be positive, got {a.max_skips}')
    if a.inject_nan and not all(x.strip().isdigit() for x in a.inject_nan.split(',')):
        die(f'--inject_nan takes comma-separated step numbers, got {a.inject_nan!r}')
    if a.method != 'lopd':
        for k in ('frozen_composer', 'lr_composer'):
            if getattr(a, k):
                die(f'--{k} applies to --method lopd only, not {a.method}')
    if a.allow_same_task and not METHODS[a.method].bank:
        die(f'--allow_same_task applies to the methods with an experience bank (lopd, trajtext), not {a.method}')
    if a.model and a.model.startswith(('.', '/', '~')) and not os.path.isdir(os.path.expanduser(a.model)):
        die(f'--model {a.model}: no such folder')
    if os.path.exists(a.out_dir) and not os.path.isdir(a.out_dir):
        die(f'--out_dir {a.out_dir} is a file, not a folder')


# ----------------------------------------------------------------------------- tokens of an episode

def obs_ids(tok, text):
    return [tok.obs] + tok.encode(text[:MAX_OBS_CHARS]) + [tok.agent]


def encode_episode(tok, ep):
    """An episode as the student sees it (no <|bos|>) and its agent-token mask.

    <|obs|> task <|agent|> a1 <|eot|> <|obs|> o1 <|agent|> a2 <|eot|> ...
    mask = 1 on action tokens and their <|eot|> (what the agent generated), 0 elsewhere."""
    ids = obs_ids(tok, ep.task.prompt)
    mask = [0] * len(ids)
    for action, obs in ep.turns:
        a = tok.encode(action) + [tok.eot]
        ids, mask = ids + a, mask + [1] * len(a)
        if obs:
            o = obs_ids(tok, obs)
            ids, mask = ids + o, mask + [0] * len(o)
    return ids, mask


def pad_batch(seqs, masks, pad, device):
    """Right-pad bodies -> ids (B, T), agent mask (B, T), attention mask (B, T)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    amask = torch.zeros(len(seqs), T)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)], amask[i, :len(s)], attn[i, :len(s)] = torch.tensor(s), torch.tensor(m, dtype=torch.float), 1
    return ids.to(device), amask.to(device), attn.to(device)


# ----------------------------------------------------------------------------- rollout (step 1)

def bos_prefix(model, tok, n):
    """The student's 'context': just <|bos|>, as (1, d) embeddings per row."""
    return [M.embed(model, torch.tensor([tok.bos], device=model.device))] * n


@torch.no_grad()
def generate(model, tok, prefixes, bodies, max_new, greedy):
    """Sample one agent turn per row, with a KV cache, until <|eot|> or max_new tokens.

    prefixes: list of (P_i, d) context embeddings; bodies: list of token lists.
    Rows are left-padded so that every row's next token is at the last position."""
    rows = [torch.cat([p, M.embed(model, torch.tensor(b, device=model.device))]) for p, b in zip(prefixes, bodies)]
    L, B = max(r.shape[0] for r in rows), len(rows)
    E = rows[0].new_zeros(B, L, rows[0].shape[1])
    mask = torch.zeros(B, L, dtype=torch.long, device=model.device)
    for i, r in enumerate(rows):
        E[i, L - r.shape[0]:], mask[i, L - r.shape[0]:] = r, 1
    logits, cache = M.forward(model, E, mask, use_cache=True)
    pos = mask.sum(-1, keepdim=True) - 1                                        # (B, 1) position of the last token
    out, done = [[] for _ in range(B)], torch.zeros(B, dtype=torch.bool, device=model.device)
    for _ in range(max_new):
        last = logits[:, -1].float()                                            # (B, V)
        nxt = last.argmax(-1) if greedy else torch.multinomial(torch.softmax(last, -1), 1).squeeze(-1)
        for i in (~done).nonzero().flatten().tolist():
            out[i].append(int(nxt[i]))
        done |= nxt == tok.eot
        if done.all():
            break
        mask, pos = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), pos + 1
        logits, cache = M.forward(model, M.embed(model, nxt[:, None]), mask, past=cache, pos=pos, use_cache=True)
    return out


@torch.no_grad()
def rollout(model, tok, env, tasks, greedy=False, prefixes=None):
    """Step 1. Play one episode per task, all rows in one batch, turn by turn.

    Within a turn the agent's tokens come from the KV cache; between turns the env's
    observation is appended and the prefix is re-read once (cheap next to decoding).
    -> episodes, bodies (token lists without <|bos|>), agent masks (1 = agent-generated)."""
    prefixes = prefixes or bos_prefix(model, tok, len(tasks))
    eps = [env.reset(t) for t in tasks]
    bodies = [obs_ids(tok, t.prompt) for t in tasks]
    masks = [[0] * len(b) for b in bodies]
    for _ in range(env.max_turns):
        live = [i for i, e in enumerate(eps) if not e.done]
        if not live:
            break
        outs = generate(model, tok, [prefixes[i] for i in live], [bodies[i] for i in live],
                        env.max_action_tokens, greedy)
        for i, out in zip(live, outs):
            bodies[i] += out
            masks[i] += [1] * len(out)                                          # only what the agent generated
            step = env.step(eps[i], tok.decode([t for t in out if t != tok.eot]))
            if not step.done:
                o = obs_ids(tok, step.obs)
                bodies[i] += o
                masks[i] += [0] * len(o)                                        # observations get no loss
    return eps, bodies, masks


def logits_on(model, prefixes, ids, attn):
    """Score every prefix of the trajectories in one forward: (B, T, V), where row i,
    position t is π(· | context_i, body_i[:t]), i.e. the distribution of body token t."""
    E, mask, P = lopd.teacher_inputs(prefixes, M.embed(model, ids), attn)
    logits, _ = M.forward(model, E, mask)
    return logits[:, P - 1:P - 1 + ids.shape[1]]


# ----------------------------------------------------------------------------- FORK HERE: teacher contexts

def text_prefix(model, tok, texts):
    """<|bos|><|ctx|> text, embedded by the teacher: a privileged context given as text."""
    return [M.embed(model, torch.tensor([tok.bos, tok.ctx] + tok.encode(t), device=model.device)) for t in texts]


def solution_text(task):
    return f'reference solution: {task.solution}\n'


def experiences_text(texts):
    return 'past: ' + '\n'.join(texts) + '\n'


def opsd_context(run, eps):
    """OPSD: the frozen base is shown this task's reference solution."""
    return text_prefix(run.teacher, run.tok, [solution_text(e.task) for e in eps])


def sdpo_context(run, eps):
    """SDPO: a successful sibling rollout of the same task (never the rollout itself), else
    the environment's feedback on this attempt; a rollout with neither gets no teacher."""
    G, texts = run.method.group, []
    for i, e in enumerate(eps):
        g = i - i % G                                                           # first rollout of i's group
        sib = next((s for j, s in enumerate(eps[g:g + G], g) if j != i and s.reward > 0), None)
        texts.append(experiences_text([run.env.trajectory_text(sib)]) if sib else
                     f'feedback: {e.feedback}\n' if e.feedback else None)
    return [text_prefix(run.teacher, run.tok, [t])[0] if t else None for t in texts]


def sdft_context(run, eps):
    """SDFT: the model shown a demonstration of this very task (the scripted expert's)."""
    demos = [envs.play(run.env, e.task, run.env.demo(e.task, random.Random(0))) for e in eps]
    return text_prefix(run.teacher, run.tok, [experiences_text([run.env.trajectory_text(d)]) for d in demos])


def trajtext_context(run, eps):
    """Traj-text (ablation): LOPD's retrieved experiences, shown to the frozen base as text."""
    found = retrieve(run, [e.task for e in eps])
    return text_prefix(run.teacher, run.tok, [experiences_text([m.text for m in f]) for f in found])


def skill_text(records):
    """Skill-SD's summariser, as a deterministic template over a family's stored trajectories
    [(text, reward, feedback)]: a success pattern, the commonest mistake, the workflow.
    e.g. 'skill: success pattern: city(bo) -> oslo; answer oslo; mistakes: none seen;
    workflow: 2 turns, the last one answers'."""
    wins = [r for r in records if r[1] > 0]
    fails = [r[2] for r in records if r[1] == 0 and r[2]]
    pattern = wins[-1][0] if wins else 'none yet'
    mistake = max(fails, key=fails.count) if fails else 'none seen'   # a tie: the earliest (set order is hash-seeded)
    turns = round(float(np.mean([r[0].count(';') + 1 for r in wins]))) if wins else '?'
    return f'skill: success pattern: {pattern}; mistakes: {mistake}; workflow: {turns} turns, the last one answers\n'


def skillsd_context(run, eps):
    """Skill-SD: a skill text for the task's family. The arms are skills built on each of the
    family's 3 latest successes; UCB1 (per family, reward = rollout success) picks one."""
    texts = []
    for e in eps:
        recs = run.skills.setdefault(e.task.family, [])
        wins = [i for i, r in enumerate(recs) if r[1] > 0][-3:] or [len(recs)]
        stats = run.ucb.setdefault(e.task.family, {})                            # arm -> [pulls, total reward]
        n = sum(v[0] for v in stats.values()) + 1
        ucb = lambda a: float('inf') if a not in stats else stats[a][1] / stats[a][0] + math.sqrt(2 * math.log(n) / stats[a][0])
        arm = max(range(len(wins)), key=ucb)
        stats.setdefault(arm, [0, 0.0])
        stats[arm][0] += 1
        stats[arm][1] += e.reward
        upto = wins[arm] + 1 if wins[arm] < len(recs) else len(recs)
        texts.append(skill_text(recs[:upto][-50:]))
    return text_prefix(run.teacher, run.tok, texts)


def lopd_context(run, eps, keep_graph=False):
    """LOPD, steps 2-3: retrieve J experiences per task and compose them into latents.

    -> prefixes <|bos|> z_1 … z_{J·K}, plus the latents z and their
    cold-start counterparts z0 (for the anchor), each (ΣN·K, d)."""
    tasks = [e.task for e in eps]
    found = retrieve(run, tasks)
    with torch.set_grad_enabled(keep_graph):
        z, z0 = compose(run, tasks, found)
    # no framing text around the latents: our base never saw text before the task, and
    # framing ("<|ctx|>past: … \n") cost the cold-started teacher 0.58 -> 0.22 held-out
    # success in our measurement, so the latents follow <|bos|> directly
    head = M.embed(run.teacher, torch.tensor([run.tok.bos], device=run.device))
    prefixes, k = [], 0
    for f in found:
        n = len(f) * run.args.K
        prefixes.append(torch.cat([head, z[k:k + n]]))
        k += n
    return prefixes, z, z0


def retrieve(run, tasks):
    """Step 2: top-J successful experiences of similar tasks (never this task, by default)."""
    found = run.bank.retrieve([t.prompt for t in tasks], [t.task_id for t in tasks], run.args.J)
    run.log['family_hit'].append(run.bank.family_hit_rate([t.family for t in tasks], found))
    return found


def compose(run, tasks, found):
    """Step 3: the frozen base reads 'task to solve: x / reference past trajectory: m_j';
    the composer maps its hidden states to K latents per experience. -> z, z0 (N·K, d)."""
    d = run.base.get_input_embeddings().weight.shape[1]
    heads = [run.tok.encode(f'task to solve: {t.prompt}\nreference past trajectory: ') for t, f in zip(tasks, found) for _ in f]
    bodies = [run.tok.encode(m.text)[:200] for f in found for m in f]
    if not heads:
        empty = torch.zeros(0, d, device=run.device)
        return empty, empty
    # we pool over the experience's own tokens only (read in the light of the task): pooled
    # over the framing too, the first segments would describe the framing, not the plan
    ids, pool, attn = pad_batch([h + b for h, b in zip(heads, bodies)],
                                [[0] * len(h) + [1] * len(b) for h, b in zip(heads, bodies)], run.tok.pad, run.device)
    with torch.no_grad():
        h = M.hidden(run.base, ids, attn)                                       # (N, L, d) frozen reading
        z0 = run.composer0(h, pool) if run.composer0 is not None else None
    z = run.composer(h, pool)                                                   # (N, K, d)
    z0 = z.detach() if z0 is None else z0
    return z.reshape(-1, d), z0.reshape(-1, d)


@dataclass
class Method:
    loss: str                 # 'distill', 'grpo', or 'grpo+k3' (Skill-SD)
    context: object = None    # (run, episodes) -> a teacher prefix per rollout (None: no teacher for it)
    divergence: str = 'rkl'   # for 'distill'
    group: int = 1            # rollouts per task
    lr: float = 1e-3
    teacher: str = 'frozen'   # the teacher's weights: 'frozen' θ0, an 'ema' of θ, or the 'live' θ
    bank: bool = False        # keeps an experience bank (filled before training, written back)


METHODS = {
    'lopd':     Method('distill', lopd_context, 'rkl', 1, 1e-3, 'frozen', bank=True),
    'grpo':     Method('grpo', None, 'rkl', 4, 1e-4),
    'opsd':     Method('distill', opsd_context, 'jsd', 1, 1e-3, 'frozen'),
    'sdpo':     Method('distill', sdpo_context, 'rkl', 4, 1e-3, 'ema'),
    'sdft':     Method('distill', sdft_context, 'rkl', 1, 1e-3, 'live'),
    'skillsd':  Method('grpo+k3', skillsd_context, 'rkl', 4, 1e-4, 'live'),
    'trajtext': Method('distill', trajtext_context, 'rkl', 1, 1e-3, 'frozen', bank=True),
}


# ----------------------------------------------------------------------------- the phases

def teacher_phase(run, eps, ids, attn):
    """Step 4: the teacher scores every agent token, with its context.
    -> logits (B, T, V), keep (B,) (False: the method gave this rollout no teacher), z, z0.
    For LOPD the graph through the latents is kept (θ0 itself is frozen), so that the
    composer phase can reuse this forward."""
    if run.args.method == 'lopd':
        prefixes, z, z0 = lopd_context(run, eps, keep_graph=not run.args.frozen_composer)
        return logits_on(run.teacher, prefixes, ids, attn), torch.ones(len(eps), dtype=torch.bool), z, z0
    with torch.no_grad():
        prefixes = run.method.context(run, eps)
        keep = torch.tensor([p is not None for p in prefixes])
        prefixes = [p if p is not None else bos_prefix(run.teacher, run.tok, 1)[0] for p in prefixes]
        return logits_on(run.teacher, prefixes, ids, attn), keep, None, None


def student_phase(run, ids, amask, attn, logits_t):
    """Step 5: one step of θ on the distillation loss (teacher detached)."""
    logits_s = logits_on(run.model, bos_prefix(run.model, run.tok, ids.shape[0]), ids, attn)
    loss = lopd.distill_loss(logits_s, logits_t, amask, run.divergence, run.args.topk)
    optimizer_step(run, run.opt, loss, run.model)
    if run.teacher_kind == 'ema':
        lopd.ema_update(run.teacher, run.model, run.args.ema_rate)
    return logits_s.detach(), loss.item()


def composer_phase(run, logits_s, logits_t, ids, amask, reward, z, z0):
    """Step 6: one step of φ on KL(sg π_θ ‖ π_T^φ) + β(m − Δ) + λ‖z − z0‖², then β's dual update."""
    a = run.args
    loss, delta, anchor = lopd.composer_loss(logits_s, logits_t, ids, amask, reward, run.beta, a.margin, a.lam, z, z0)
    optimizer_step(run, run.opt_phi, loss, run.composer)
    run.beta = lopd.dual_update(run.beta, a.margin, delta, a.eta_beta)
    return float(delta), float(anchor)


def grpo_phase(run, eps, ids, amask, attn):
    """GRPO: PPO-clip with the group-normalised advantage, one epoch (ratio = 1)."""
    reward = torch.tensor([e.reward for e in eps], device=run.device)
    logits = logits_on(run.model, bos_prefix(run.model, run.tok, ids.shape[0]), ids, attn)
    logp = lopd.token_logp(logits, ids)
    loss = lopd.ppo_clip_loss(logp, logp.detach(), lopd.group_advantage(reward, run.method.group), amask)
    optimizer_step(run, run.opt, loss, run.model)
    return loss.item()


def skillsd_phase(run, eps, ids, amask, attn):
    """Skill-SD: GRPO (PPO-clip, ε 0.2 / 0.28) + λ × importance-weighted sampled-token k3
    reverse KL toward the skill-prompted live teacher."""
    reward = torch.tensor([e.reward for e in eps], device=run.device)
    with torch.no_grad():
        logits_t, _, _, _ = teacher_phase(run, eps, ids, attn)
    logp = lopd.token_logp(logits_on(run.model, bos_prefix(run.model, run.tok, ids.shape[0]), ids, attn), ids)
    adv = lopd.group_advantage(reward, run.method.group)
    loss = (lopd.ppo_clip_loss(logp, logp.detach(), adv, amask, 0.2, 0.28)
            + run.args.k3_coef * lopd.is_k3_loss(logp, logp.detach(), lopd.token_logp(logits_t, ids), amask))
    optimizer_step(run, run.opt, loss, run.model)
    for e in eps:  # Skill-SD's store: every finished trajectory of the family, kept short
        run.skills.setdefault(e.task.family, []).append((run.env.trajectory_text(e), e.reward, e.feedback))
        del run.skills[e.task.family][:-50]
    return loss.item()


def write_back(run, eps):
    """Step 7: successful rollouts join the bank (the bank keeps only reward > 0)."""
    run.bank.add([retrieval.Experience(e.task.task_id, e.task.family, e.task.prompt, run.env.trajectory_text(e), e.reward)
                  for e in eps])


class Diverged(Exception):
    """Too many updates in a row were skipped for non-finite numbers (--max_skips)."""


def optimizer_step(run, opt, loss, module):
    """One update, skipped (counted, logged) if the loss or a gradient is not finite, so a
    NaN never reaches the weights; --max_skips skips in a row stop the run."""
    opt.zero_grad(set_to_none=True)
    if not loss.requires_grad:  # nothing this step depends on the parameters (e.g. nothing retrieved)
        return
    if module is run.model and run.step + 1 in run.nan_steps:  # test hook: --inject_nan
        loss = loss * float('nan')
    if torch.isfinite(loss):
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        if torch.isfinite(norm):
            opt.step()
            run.skips_in_a_row = 0
            return
        opt.zero_grad(set_to_none=True)
    run.log['skipped'].append(1)
    run.skips_in_a_row += 1
    print(f'step {run.step + 1}: non-finite {"loss" if not torch.isfinite(loss) else "gradient"}, update skipped', file=sys.stderr)
    if run.skips_in_a_row >= run.args.max_skips:
        raise Diverged(f'{run.skips_in_a_row} updates in a row had a non-finite loss or gradient; '
                       f'none reached the weights: lower --lr or look at the inputs of these steps')


def train_step(run):
    """One step of the chosen method on a fresh batch of episodes."""
    a, G = run.args, run.method.group
    tasks = [t for t in run.rng.sample(run.env.train_tasks, a.batch // G) for _ in range(G)]
    with run.timer('rollout'):
        eps, bodies, masks = rollout(run.model, run.tok, run.env, tasks)
        ids, amask, attn = pad_batch(bodies, masks, run.tok.pad, run.device)
    run.episodes += len(eps)
    run.log['reward'].append(float(np.mean([e.reward for e in eps])))
    if run.method.loss == 'grpo':
        with run.timer('student'):
            run.log['loss'].append(grpo_phase(run, eps, ids, amask, attn))
    elif run.method.loss == 'grpo+k3':
        with run.timer('student'):
            run.log['loss'].append(skillsd_phase(run, eps, ids, amask, attn))
    else:
        with run.timer('teacher'):
            logits_t, keep, z, z0 = teacher_phase(run, eps, ids, attn)
        with run.timer('student'):
            logits_s, loss = student_phase(run, ids, amask * keep[:, None].to(amask), attn, logits_t.detach())
            run.log['loss'].append(loss)
        if a.method == 'lopd' and not a.frozen_composer:
            with run.timer('composer'):
                reward = torch.tensor([e.reward for e in eps], device=run.device)
                delta, anchor = composer_phase(run, logits_s, logits_t, ids, amask, reward, z, z0)
                run.log['delta'].append(delta)
                run.log['anchor'].append(anchor)
    if run.method.bank:
        write_back(run, eps)
    run.step += 1


# ----------------------------------------------------------------------------- warm-up, cold start, eval

def warmup_demo(env, task, by_family, rng, p_ctx=0.0):
    """One warm-up demo -> (episode, privileged context text or None).

    Without a context (probability 1 − p_ctx): the noisy expert. With one, the demo
    teaches the base to *read* a privileged context, as an instruction-tuned LLM can (our
    tiny model starts from nothing): a reference solution (p_ctx/4) or one or two
    trajectories of other tasks that follow the same plan (p_ctx/2), each followed by a
    demo that follows that plan; or trajectories of another family (p_ctx/4), followed by
    the noisy expert (an unhelpful context is to be ignored). On opaque families the plan
    shown and followed is a random one, never the family's true plan, so that reading is
    learned but no opaque plan is: those stay learnable only from experience."""
    u = rng.random()
    if u >= p_ctx:
        return envs.play(env, task, env.demo(task, rng, noisy=True)), None
    u /= p_ctx                                                                  # uniform in [0, 1) again
    if u >= 0.75:  # an unhelpful context: another family's trajectories
        fam = rng.choice([f for f in by_family if f != task.family])
        texts = [env.trajectory_text(envs.play(env, t, env.demo(t, rng))) for t in rng.sample(by_family[fam], 2)]
        return envs.play(env, task, env.demo(task, rng, noisy=True)), experiences_text(texts[:rng.randint(1, 2)])
    kw = {'plan': envs.random_plan(rng)} if task.family in getattr(env, 'opaque', ()) else {}
    ep = envs.play(env, task, env.demo(task, rng, **kw))
    if u < 0.25:
        return ep, f'reference solution: {env.trajectory_text(ep)}\n'
    others = rng.sample(by_family[task.family], rng.randint(1, 2))
    return ep, experiences_text([env.trajectory_text(envs.play(env, t, env.demo(t, rng, **kw))) for t in others])


def warmup_loss(model, tok, demos, contexts, device):
    """NLL of the demos' agent tokens. Rows with and without a context go in two forwards,
    so the short rows do not pay for the long contexts' padding."""
    total, n = 0.0, 0
    for rows in ([i for i, c in enumerate(contexts) if c is None], [i for i, c in enumerate(contexts) if c]):
        if not rows:
            continue
        seqs, masks = zip(*[encode_episode(tok, demos[i]) for i in rows])
        ids, amask, attn = pad_batch(seqs, masks, tok.pad, device)
        prefixes = [text_prefix(model, tok, [contexts[i]])[0] if contexts[i] else bos_prefix(model, tok, 1)[0] for i in rows]
        nll = -lopd.token_logp(logits_on(model, prefixes, ids, attn), ids)         # (b, T)
        total, n = total + (nll * amask).sum(), n + amask.sum()
    return total / n


def warmup(args, tok, model, env, device):
    """Supervised warm-up on noisy-expert demos, cached under out_dir, shared by every method."""
    key = json.dumps(['v5', env.name, env.families, args.model, args.d_model, args.n_layer, args.warmup_steps, args.warmup_batch, args.warmup_ctx,
                      args.warmup_lr, M.SPECIALS, MAX_OBS_CHARS])
    path = os.path.join(args.out_dir, f'warmup-{env.name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.pt')
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location=device)['model'])
        return path, True
    rng = random.Random(1234)  # the base is the same for every run seed: one base, many methods
    torch.manual_seed(1234)
    pool = env.make_tasks(20_000, seed=30_000, families=env.warmup_families, split='warm')
    by_family = {}
    for t in pool:
        by_family.setdefault(t.family, []).append(t)
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, weight_decay=0.0)
    for step in (bar := tqdm(range(args.warmup_steps), desc='warm-up', dynamic_ncols=True)):
        for g in opt.param_groups:  # cosine decay to 10%
            g['lr'] = args.warmup_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.warmup_steps)))
        demos, contexts = zip(*[warmup_demo(env, t, by_family, rng, args.warmup_ctx) for t in rng.sample(pool, args.warmup_batch)])
        loss = warmup_loss(model, tok, demos, contexts, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f'{loss.item():.3f}')
    os.makedirs(args.out_dir, exist_ok=True)
    atomic_save({'model': model.state_dict(), 'key': key}, path)
    return path, False


def cold_start(run):
    """Fill the bank with base rollouts (they count toward the budget); for LOPD, then
    pre-train φ by maximising the frozen teacher's likelihood of successful trajectories
    given the latents of their retrieved experiences."""
    a = run.args
    wins = []
    for _ in tqdm(range(math.ceil(a.init_episodes / a.batch)), desc='fill bank', dynamic_ncols=True):
        with run.timer('rollout'):
            eps, bodies, masks = rollout(run.model, run.tok, run.env, run.rng.sample(run.env.train_tasks, a.batch))
        run.episodes += len(eps)
        write_back(run, eps)
        wins += [(e, b, m) for e, b, m in zip(eps, bodies, masks) if e.reward > 0]
    if a.method != 'lopd':
        return
    opt = torch.optim.AdamW(run.composer.parameters(), lr=run.lr_phi)
    for _ in (bar := tqdm(range(a.cold_start_steps if wins else 0), desc='cold start', dynamic_ncols=True)):
        with run.timer('cold_start'):
            batch = run.rng.sample(wins, min(32, len(wins)))
            eps, bodies, masks = zip(*batch)
            ids, amask, attn = pad_batch(bodies, masks, run.tok.pad, run.device)
            prefixes, _, _ = lopd_context(run, eps, keep_graph=True)
            loss = lopd.masked_mean(-lopd.token_logp(logits_on(run.teacher, prefixes, ids, attn), ids), amask)
            optimizer_step(run, opt, loss, run.composer)
        bar.set_postfix(nll=f'{loss.item():.3f}')
    run.composer0 = copy.deepcopy(run.composer).requires_grad_(False)
    run.log['family_hit'] = []  # the training steps' retrievals only, not the cold start's


# the flags that act only after the cold start: runs differing in these share one (plus the
# bookkeeping ones); lr and lr_composer enter the key as the composer's resolved rate
AFTER_COLD_START = ('episodes', 'eval_every', 'margin', 'lam', 'eta_beta', 'frozen_composer', 'divergence', 'topk',
                    'ema_rate', 'k3_coef', 'lr', 'lr_composer', 'name', 'out_dir', 'resume', 'max_skips', 'inject_nan')


def cold_start_key(args, warm_path=''):
    """What the cold start depends on: the base, the code, every flag but AFTER_COLD_START."""
    kept = {k: v for k, v in dataclasses.asdict(args).items() if k not in AFTER_COLD_START}
    lr_phi = args.lr_composer or args.lr or METHODS[args.method].lr
    return json.dumps([kept, lr_phi, os.path.basename(warm_path), CODE], sort_keys=True)


def cold_start_cached(run, warm_path):
    """The cold start, cached under out_dir like the warm-up: LOPD and its ablations of one
    seed (--frozen_composer, --margin 0) differ only after it, so they share one. The cache
    holds everything the cold start changes, RNG states included, so a run that loads it
    continues exactly as if it had built it (tests/test_reliability.py)."""
    a = run.args
    key = cold_start_key(a, warm_path)
    path = os.path.join(a.out_dir, f'coldstart-{a.method}-{a.env}-s{a.seed}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.pt')
    if os.path.exists(path):
        state = torch.load(path, map_location=run.device, weights_only=False)
        run.bank.load_state_dict(state['bank'])
        if a.method == 'lopd':
            run.composer.load_state_dict(state['composer'])
            run.composer0 = copy.deepcopy(run.composer).requires_grad_(False)
        run.episodes, run.log, run.skips_in_a_row = state['episodes'], state['log'], state['skips_in_a_row']
        set_rng(run, state)
        print(f'cold start: cached {path}')
        return
    cold_start(run)
    atomic_save({'key': key, 'bank': run.bank.state_dict(), 'episodes': run.episodes, 'log': run.log,
                 'skips_in_a_row': run.skips_in_a_row, **get_rng(run),
                 **({'composer': run.composer.state_dict()} if a.method == 'lopd' else {})}, path)
    print(f'cold start: {path}')


@torch.no_grad()
def evaluate(run):
    """Held-out success: greedy, the student alone, no privileged context. Plus the
    teacher's own success when it decodes with its context (does the context carry
    information?)."""
    tasks = run.env.eval_tasks[:run.args.eval_tasks]
    eps = []
    for i in range(0, len(tasks), 128):
        eps += rollout(run.model, run.tok, run.env, tasks[i:i + 128], greedy=True)[0]
    out = {'success': float(np.mean([e.reward for e in eps]))}
    fam = {}
    for e in eps:
        fam.setdefault(e.task.family, []).append(e.reward)
    out['family'] = {f: float(np.mean(v)) for f, v in fam.items()}
    if run.method.context is not None and run.args.teacher_eval:
        tasks = tasks[:run.args.teacher_eval]  # families cycle, so the first N are balanced
        out['student_success_same_tasks'] = float(np.mean([e.reward for e in eps[:len(tasks)]]))
        probe = [run.env.reset(t) for t in tasks]
        prefixes = run.method.context(run, probe)
        prefixes = prefixes[0] if isinstance(prefixes, tuple) else prefixes
        prefixes = [p if p is not None else bos_prefix(run.teacher, run.tok, 1)[0] for p in prefixes]
        teps = rollout(run.teacher, run.tok, run.env, tasks, greedy=True, prefixes=prefixes)[0]
        out['teacher_success'] = float(np.mean([e.reward for e in teps]))
    return out


# ----------------------------------------------------------------------------- plumbing: run state, checkpoints, plots

class Run:
    """Everything a training run holds; saved whole in ckpt.pt."""

    def __init__(self, args):
        self.args, self.method = args, METHODS[args.method]
        self.divergence = args.divergence or self.method.divergence
        self.teacher_kind = args.teacher or self.method.teacher
        self.device = pick_device(args.device)
        self.step, self.episodes, self.beta, self.metrics, self.wall = 0, 0, 0.0, [], 0.0
        self.times = {k: 0.0 for k in ['warmup', 'rollout', 'teacher', 'student', 'composer', 'cold_start', 'eval']}
        self.log = {k: [] for k in ['loss', 'reward', 'delta', 'anchor', 'family_hit', 'skipped']}
        self.skips_in_a_row = 0
        self.nan_steps = {int(x) for x in args.inject_nan.split(',') if x.strip()}
        # bf16 autocast only where the device supports it; the losses are computed in fp32 (lopd._f32)
        bf16 = args.dtype == 'bf16' or (args.dtype == 'auto' and self.device.type == 'cuda' and torch.cuda.is_bf16_supported())
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.rng = random.Random(args.seed)
        self.dir = os.path.join(args.out_dir, args.name)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)

    @contextlib.contextmanager
    def timer(self, key):
        t = time.time()
        yield
        self.times[key] += time.time() - t


def pick_device(name):
    if name != 'auto':
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device('cuda')
    if getattr(torch.backends, 'mps', None) and torch.backends.mps.is_available():
        return torch.device('mps')
    return torch.device('cpu')


def atomic_save(obj, path):
    """Write to a temp file and rename: a kill mid-write never leaves a corrupt file (the
    temp name is per process, so two runs building the same warm-up cannot tear it)."""
    tmp = f'{path}.{os.getpid()}.tmp'
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_json(obj, path):
    tmp = f'{path}.{os.getpid()}.tmp'
    with open(tmp, 'w') as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def get_rng(run):
    state = {'rng': run.rng.getstate(), 'torch_rng': torch.get_rng_state(), 'np_rng': np.random.get_state()}
    if run.device.type == 'cuda':
        state.update(cuda_rng=torch.cuda.get_rng_state(run.device))
    return state


def set_rng(run, state):
    run.rng.setstate(state['rng'])
    torch.set_rng_state(state['torch_rng'].cpu())
    np.random.set_state(state['np_rng'])
    if 'cuda_rng' in state and run.device.type == 'cuda':
        torch.cuda.set_rng_state(state['cuda_rng'].cpu(), run.device)


def save_checkpoint(run):
    state = {'args': dataclasses.asdict(run.args), 'step': run.step, 'episodes': run.episodes, 'beta': run.beta,
             'metrics': run.metrics, 'times': run.times, 'model': run.model.state_dict(),
             'opt': run.opt.state_dict(), 'wall': run.wall + time.time() - run.t0,
             'log': run.log, 'skips_in_a_row': run.skips_in_a_row, 'code': CODE, **get_rng(run)}
    state.update(skills=run.skills, ucb=run.ucb)
    if run.teacher_kind == 'ema':
        state.update(ema=run.teacher.state_dict())
    if run.method.bank:
        state.update(bank=run.bank.state_dict())
    if run.args.method == 'lopd':
        state.update(composer=run.composer.state_dict(), composer0=run.composer0.state_dict(),
                     opt_phi=run.opt_phi.state_dict())
    atomic_save(state, os.path.join(run.dir, 'ckpt.pt'))


def load_checkpoint(run, path):
    try:
        state = torch.load(path, map_location=run.device, weights_only=False)
        run.model.load_state_dict(state['model'])
        run.opt.load_state_dict(state['opt'])
        run.skills, run.ucb = state['skills'], state['ucb']
        if run.teacher_kind == 'ema':
            run.teacher.load_state_dict(state['ema'])
        if run.method.bank:
            run.bank.load_state_dict(state['bank'])
        if run.args.method == 'lopd':
            run.composer.load_state_dict(state['composer'])
            run.composer0 = copy.deepcopy(run.composer).requires_grad_(False)
            run.composer0.load_state_dict(state['composer0'])
            run.opt_phi.load_state_dict(state['opt_phi'])
        run.step, run.episodes, run.beta = state['step'], state['episodes'], state['beta']
        run.metrics, run.times, run.wall = state['metrics'], state['times'], state['wall']
        run.log, run.skips_in_a_row = state['log'], state['skips_in_a_row']
        set_rng(run, state)
    except Exception as e:  # corrupt file, a missing entry, or weights of another shape
        msg = ' '.join(str(e).split())  # load_state_dict says what mismatches on its 2nd line
        die(f'cannot resume from {path}: {type(e).__name__}: {msg[:300]}')
    # the metrics log is rewritten from the checkpoint: evals written after it (a run
    # killed between an eval and its checkpoint) are dropped, as they will be redone
    with open(os.path.join(run.dir, 'metrics.jsonl.tmp'), 'w') as f:
        f.writelines(json.dumps(m) + '\n' for m in run.metrics)
    os.replace(os.path.join(run.dir, 'metrics.jsonl.tmp'), os.path.join(run.dir, 'metrics.jsonl'))


def plot(run):
    from matplotlib.figure import Figure  # no pyplot: the caller's plotting backend is left alone
    x = [m['episodes'] for m in run.metrics]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(x, [m['success'] for m in run.metrics], 'o-', label=f'{run.args.method} student (greedy)')
    if any('teacher_success' in m for m in run.metrics):
        ax.plot(x, [m.get('teacher_success', np.nan) for m in run.metrics], 's--', alpha=0.6, label='teacher with context')
    ax.set(xlabel='episodes sampled', ylabel='held-out success', ylim=(0, 1), title=f'{run.args.name}')
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(run.dir, 'curve.png.tmp'), dpi=100, format='png')
    os.replace(os.path.join(run.dir, 'curve.png.tmp'), os.path.join(run.dir, 'curve.png'))


def record_eval(run):
    with run.timer('eval'):
        m = evaluate(run)
    def mean(k):  # None, not NaN, so that metrics.jsonl stays strict JSON
        v = [x for x in run.log[k] if not math.isnan(x)]
        return float(np.mean(v)) if v else None
    m.update(step=run.step, episodes=run.episodes, beta=run.beta, loss=mean('loss'), train_reward=mean('reward'),
             delta=mean('delta'), anchor=mean('anchor'), family_hit=mean('family_hit'),
             skipped=sum(run.log['skipped']), times={k: round(v, 2) for k, v in run.times.items()})
    run.metrics.append(m)
    for k in run.log:
        if k != 'skipped':
            run.log[k] = []
    with open(os.path.join(run.dir, 'metrics.jsonl'), 'a') as f:
        f.write(json.dumps(m) + '\n')
    return m


# ----------------------------------------------------------------------------- main

RESUMABLE = ('resume', 'episodes', 'device', 'dtype', 'max_skips')  # what --resume may change


def fail(msg):
    """A run that cannot go on (not a bad argument): one line, exit status 1."""
    print(f'train.py: {msg}', file=sys.stderr)
    sys.exit(1)


def self_signal(run):
    """Test hook for the resume tests: TRAIN_SELF_SIGNAL=<step>:<KILL|TERM> sends this process
    that signal right after that step, i.e. between two checkpoints."""
    at = os.environ.get('TRAIN_SELF_SIGNAL', '')
    if at and at.split(':')[0] == str(run.step):
        os.kill(os.getpid(), getattr(signal, 'SIG' + at.split(':')[1]))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.resume:  # the saved config wins; only the budget (and where it runs) may change
        path = os.path.join(args.resume, 'ckpt.pt') if os.path.isdir(args.resume) else args.resume
        if not os.path.isfile(path):
            die(f'--resume: no checkpoint at {path}')
        try:
            saved = torch.load(path, map_location='cpu', weights_only=False)['args']
            saved = {k: v for k, v in saved.items() if k in {f.name for f in dataclasses.fields(Args)}}
        except Exception as e:
            die(f'cannot resume from {path}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ""}')
        given = {a[2:].split('=')[0] for a in argv if a.startswith('--')}
        changed = [k for k in given if k not in RESUMABLE + ('out_dir', 'name') and getattr(args, k) != saved.get(k)]
        if changed:
            die(f'--resume continues the saved config; --{changed[0]} cannot be changed (only --{", --".join(RESUMABLE[1:])})')
        run_dir = os.path.dirname(os.path.abspath(path))  # the folder resumed is the one written, even if moved
        args = Args(**{**saved, 'resume': path, 'out_dir': os.path.dirname(run_dir), 'name': os.path.basename(run_dir),
                       **{k: getattr(args, k) for k in RESUMABLE[2:] if k in given},
                       'episodes': max(saved['episodes'], args.episodes) if 'episodes' in given else saved['episodes']})
    args.name = args.name or f'{args.method}-{args.env}-s{args.seed}'
    print(json.dumps(dataclasses.asdict(args)))
    random.seed(args.seed)
    np.random.seed(args.seed)
    t0 = time.time()
    run = Run(args)
    run.t0 = t0
    # SIGTERM and a first Ctrl-C finish the current step, save a checkpoint and exit; a
    # second Ctrl-C leaves at once (the last checkpoint stays)
    stop = {'now': False}
    def on_signal(sig, frame):
        if not stop.get('training') or (stop['now'] and sig == signal.SIGINT):
            raise KeyboardInterrupt  # warm-up, cold start (nothing to save yet) or a second Ctrl-C
        stop['now'] = True
        print('\nstopping after this step (Ctrl-C again: at once, without saving)', file=sys.stderr)
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        train(run, stop)
    except KeyboardInterrupt:
        if not os.path.isfile(os.path.join(run.dir, 'ckpt.pt')):
            fail('interrupted before the first checkpoint (written once the cold start is done); nothing to resume')
        fail(f'interrupted; the last checkpoint is in {run.dir}/ (continue with --resume {run.dir})')
    except Diverged as e:
        fail(f'stopped in step {run.step + 1}: {e}; the last checkpoint is in {run.dir}/')
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        if 'out of memory' not in str(e).lower():
            raise
        fail(f'out of memory on {run.device}: lower --batch (now {args.batch}) or --eval_tasks (now {args.eval_tasks}), '
             f'or pick a smaller --model; the last checkpoint is in {run.dir}/')
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    if stop['now']:
        print(f'interrupted at step {run.step}; checkpoint saved; continue with --resume {run.dir}')
        sys.exit(130)
    base, final = run.metrics[0]['success'], run.metrics[-1]['success']
    wall = run.wall + time.time() - t0
    summary = {'method': args.method, 'env': args.env, 'seed': args.seed, 'episodes': run.episodes,
               'base_success': base, 'final_success': final, 'best_success': max(m['success'] for m in run.metrics),
               'teacher_success': run.metrics[-1].get('teacher_success'), 'wall_seconds': round(wall, 1),
               'time_split': {k: round(v, 1) for k, v in run.times.items()}, 'skipped_updates': sum(run.log['skipped']),
               'code': CODE}
    atomic_json(summary, os.path.join(run.dir, 'summary.json'))
    split = ', '.join(f'{k} {v:.0f}s' for k, v in run.times.items() if v >= 0.5)
    print(f"{args.name}: held-out success {base:.3f} -> {final:.3f} after {run.episodes} episodes "
          f"in {wall:.0f}s ({split}); outputs in {run.dir}/")


def train(run, stop):
    """Build (or resume) everything, then train until the budget is spent or stop['now']."""
    args = run.args
    os.makedirs(run.dir, exist_ok=True)
    run.env = envs.make_env(args.env)
    torch.manual_seed(1234)  # the tiny model's init, so that a warm-up built anywhere is the same base
    run.tok, run.model = M.load(args.model or None, args.d_model, args.n_layer)
    run.model.to(run.device)
    with run.timer('warmup'):
        wpath, cached = warmup(args, run.tok, run.model, run.env, run.device)
    print(f'warm-up: {"cached " if cached else ""}{wpath}')
    torch.manual_seed(args.seed)
    run.base = copy.deepcopy(run.model).eval().requires_grad_(False)           # frozen θ0
    run.teacher = {'frozen': run.base, 'live': run.model,                       # live: the student itself, no grad
                   'ema': copy.deepcopy(run.base)}[run.teacher_kind]
    run.opt = torch.optim.AdamW(run.model.parameters(), lr=args.lr or run.method.lr, weight_decay=0.0)
    run.lr_phi = args.lr_composer or args.lr or run.method.lr
    run.skills, run.ucb = {}, {}                                                # Skill-SD's store and bandit
    if run.method.bank:
        run.bank = retrieval.ExperienceBank(retrieval.hashing_embedder(), args.bank_capacity, args.allow_same_task)
    if args.method == 'lopd':
        d = run.model.get_input_embeddings().weight.shape[1]
        emb_std = run.model.get_input_embeddings().weight.std().item()
        run.composer = lopd.Composer(d, args.K, scale=emb_std).to(run.device)
        run.composer0 = None
        run.opt_phi = torch.optim.AdamW(run.composer.parameters(), lr=run.lr_phi, weight_decay=0.0)
    if args.resume:
        load_checkpoint(run, args.resume)
        print(f'resumed at step {run.step}, {run.episodes} episodes')
    else:
        open(os.path.join(run.dir, 'metrics.jsonl'), 'w').close()
        atomic_json({**dataclasses.asdict(args), 'code': CODE}, os.path.join(run.dir, 'config.json'))
        with run.autocast():
            m = record_eval(run)
            print(f"base model: held-out success {m['success']:.3f}" + (f", teacher {m['teacher_success']:.3f}" if 'teacher_success' in m else ''))
            if run.method.bank:
                cold_start_cached(run, wpath)
        save_checkpoint(run)  # a run killed from here on can be resumed
    stop['training'] = True
    bar = tqdm(total=args.episodes, initial=min(run.episodes, args.episodes), desc=f'{args.method} episodes', dynamic_ncols=True)
    while run.episodes < args.episodes and not stop['now']:
        before = run.episodes
        with run.autocast():
            train_step(run)
        bar.update(run.episodes - before)
        if run.step % args.eval_every == 0 or run.episodes >= args.episodes:
            with run.autocast():
                m = record_eval(run)
            bar.set_postfix(success=f"{m['success']:.3f}", **({'beta': f'{run.beta:.2f}'} if args.method == 'lopd' else {}))
            save_checkpoint(run)
            plot(run)
        self_signal(run)
    bar.close()
    if stop['now']:
        save_checkpoint(run)
        return
    if run.metrics[-1]['step'] != run.step:
        with run.autocast():
            record_eval(run)
    save_checkpoint(run)
    plot(run)


if __name__ == '__main__':
    main()
