"""The methods: what each one's teacher is shown, how its student learns, what it keeps.

train.py runs every method through the same steps (its docstring numbers them):

    rollout -> teacher_phase -> student_phase -> after_step
    (method.sample) method.context  method.loss     method.after_step

A method is one `Method(...)` record, registered by name in METHODS. Its block below holds
everything that is its own: the context builder (pure: evaluation calls it too, so it may
read but never change state), its loss, its state (created by `state`, saved in ckpt.pt
and restored whatever it holds), a one-time `setup`, an `after_step` hook, the flags only it
reads, and its bench entries and tuning grid. A forker adds a variant by registering one
more record, from this file or from their own (tests/test_fork.py does it from outside).

References (papers, and the public code our baselines follow): GRPO, Shao et al. 2024
(DeepSeekMath); OPSD (siyan-zhao/OPSD); SDPO (lasgroup/SDPO); SDFT (idanshen/Self-Distillation);
Skill-SD, Wang et al. 2026 (arXiv 2604.10674); LOPD, Zhang et al. 2026 (arXiv 2608.13040,
bingreeky/LOPD).
"""
import copy
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
from tqdm import tqdm

import envs
import lopd
import model as M
import retrieval
from bookkeeping import arg, die, optimizer_step


@dataclass
class Batch:
    """One step's rollouts, as every hook receives them."""
    eps: list              # B envs.Episode
    ids: torch.Tensor      # (B, T) the trajectories' tokens, right-padded
    amask: torch.Tensor    # (B, T) 1 on tokens the agent generated
    attn: torch.Tensor     # (B, T) 1 on real tokens
    reward: torch.Tensor   # (B,) graded, in [0, 1] (1 = success: every check passed)


@dataclass
class Teacher:
    """What train.teacher_phase hands the loss and the after-step hook."""
    logits: torch.Tensor   # (B, T, V) π_T(· | c, x, y<t) at every position of every trajectory (a lopd.Logits
                           # with --score_chunk: read it, as logits_s, through lopd's functions or lopd.per_position)
    keep: torch.Tensor     # (B,) bool: False where the method gave the rollout no context (masked out)
    context: list          # what method.context returned (LOPD's also carries z, z0 and what was retrieved)


class Prefixes(list):
    """A context builder's answer: one teacher context (a text or an embedded (P_i, d)) per rollout, or None for a rollout
    that gets no teacher, plus, as attributes, whatever else the same pass made that a loss or
    hook needs (LOPD: the latents z with φ's graph, their cold-start z0, what was retrieved)."""

    def __init__(self, prefixes, **extra):
        super().__init__(prefixes)
        self.__dict__.update(extra)


@dataclass
class Method:
    """One on-policy method. Every field is a keyword; only `loss` is required."""
    loss: Callable                       # (run, batch, logits_s, teacher) -> scalar loss for θ
    context: Optional[Callable] = None   # (run, episodes) -> per rollout a text, an embedded prefix, or None (no teacher); pure
    sample: Optional[Callable] = None    # (run, tasks, rollout) -> the batch's (eps, bodies, masks) (None: rollout of θ, no context)
    teacher: str = 'frozen'              # the teacher's weights: 'frozen' θ0, 'ema' of θ, 'live' θ, or 'none'
    divergence: str = 'rkl'              # D of the distillation loss, unless --divergence says otherwise
    group: int = 1                       # rollouts per task in a batch
    lr: float = 1e-3                     # student learning rate, unless --lr says otherwise
    ema_rate: float = 0.05               # rate of an EMA teacher, unless --ema_rate says otherwise
    state: Callable = lambda run: {}     # (run) -> dict of the method's own state (anything with state_dict, or plain data)
    setup: Optional[Callable] = None     # (run, rollout) -> None, once before training; cached (bookkeeping.cached_setup)
    after_step: Callable = lambda run, b, logits_s, teacher: {}  # -> dict of numbers to log
    flags: dict = field(default_factory=dict)  # name -> arg(...): the flags only this method reads
    bench: dict = field(default_factory=dict)  # bench.py entry -> dict(flags=[...], cost=seconds, quick=bool)
    tune: list = field(default_factory=lambda: [[]])  # bench.py --tune: settings (flag lists), the default first


METHODS: dict = {}


def register(name, method):
    """Add a method under a name (bench's entry of the same name is added unless it has one)."""
    method.bench = method.bench or {name: {}}
    METHODS[name] = method
    return method


def readers(flag):
    """The methods that read a method flag, e.g. 'J' -> ['lopd', 'trajtext']."""
    return [n for n, m in METHODS.items() if flag in m.flags]


# ----------------------------------------------------------------------------- shared pieces

def solution_text(task):
    return f'reference solution: {task.solution}\n'


def experiences_text(pairs):
    """Past experiences [(task prompt, trajectory text)] as one context: 'past: quandle bo: team(bo) -> red; …\n
    city of ed: city(ed) -> oslo; answer oslo\n' (each line starts with a space, so it tokenizes alone).
    Each trajectory carries its task, so that a reader can tell which of them is about this task's family."""
    return 'past:' + ''.join(experience_line(task, traj) + '\n' for task, traj in pairs)


def experience_line(task, traj):
    """One experience as a line of the context, without its newline (LOPD's reader reads the same line)."""
    return f' {task}: {traj}'


def bank_text(found):
    """Retrieved bank entries as one text context (Traj-text's, and LOPD's text-to-latent cold start's)."""
    return experiences_text([(m.task, m.text) for m in found])


def embed_context(run, ctx):
    """A context builder's answer, ready for the teacher: text becomes <|bos|><|ctx|> text embedded by
    the teacher (M.text_prefix); an embedded prefix (P, d) and None (no teacher) pass through."""
    out = [M.text_prefix(run.teacher, run.tok, [c])[0] if isinstance(c, str) else c for c in ctx]
    return Prefixes(out, **vars(ctx)) if isinstance(ctx, Prefixes) else out


def with_default(run, prefixes):
    """None (no context for this rollout) -> the context-free <|bos|> prefix."""
    return [p if p is not None else M.bos_prefix(run.teacher, run.tok, 1)[0] for p in prefixes]


DISTILL_FLAGS = {  # read by every method whose loss is the distillation loss
    'divergence': arg('', "distillation divergence D ('' = the method's)", choices=['rkl', 'fkl', 'jsd'], after_setup=True),
    'topk': arg(0, 'distil over the teacher top-k + one tail bucket (0 = full vocabulary)', lo=0, after_setup=True),
}
TEACHER_FLAGS = {  # the baselines' teacher may be swapped (LOPD's composer is trained against θ0 only)
    'teacher': arg('', "the teacher's weights ('' = the method's)", choices=['frozen', 'ema', 'live'], after_setup=True),
    'ema_rate': arg(0.0, "rate of an EMA teacher: θ_T ← (1 − rate) θ_T + rate θ (0 = the method's: SDPO 0.05, SDFT 0.01)",
                    lo=0, hi=1, after_setup=True),
}
DISTILL_LR = [[], ['--lr', '3e-4'], ['--lr', '3e-3']]


def distill(run, b, logits_s, teacher):
    """L_distill = Σ_{t∈A} D(π_θ(·|x,y<t) ‖ sg π_T(·|c,x,y<t)) / |A| over the rollouts that got a teacher."""
    mask = b.amask * teacher.keep[:, None].to(b.amask)
    return lopd.distill_loss(logits_s, teacher.logits, mask, run.args.divergence or run.method.divergence, run.args.topk)


def grpo_loss(run, b, logits_s, teacher=None, eps_hi=0.2):
    """PPO-clip with the group advantage (r − mean)/std, one epoch (so the ratio is 1)."""
    logp = lopd.token_logp(logits_s, b.ids)
    return lopd.ppo_clip_loss(logp, logp.detach(), lopd.group_advantage(b.reward, run.method.group), b.amask, 0.2, eps_hi)


# ----------------------------------------------------------------------------- LOPD (Zhang et al. 2026)
# One step: retrieve -> compose -> teacher phase -> student phase -> composer phase -> write back.
# Steps 2-3 are the teacher's context (lopd_context); 4-5 are train.teacher_phase and
# train.student_phase on it, as for every method; 6-7 are the after-step hook.

BANK_FLAGS = {  # an experience bank, filled with base rollouts before training, written back as we go
    'J': arg(3, 'experiences retrieved per task', lo=1),
    'bank_capacity': arg(4000, 'experience bank size (FIFO)', lo=1),
    'allow_same_task': arg(False, 'let retrieval return this very task instance (the paper allows it)'),
    'init_episodes': arg(512, 'base rollouts that fill the bank before training (they count toward --episodes)', lo=0),
    'embedder': arg('', "the retriever's embedder ('' = the environment's: char n-grams for tool use, the tests of "
                    "each example's input->output relation for code generation)", choices=['', *retrieval.EMBEDDERS]),
    'rerank': arg('', "re-sort the embedder's top 32 ('' = the environment's: none for tool use; for code generation, "
                  "by how many of the task's examples each stored program reproduces)", choices=['', *retrieval.RERANKERS]),
    'bank_source': arg('rollouts', "what fills the bank before training: the base's rollouts (the method), or the scripted "
                       "expert's demos (a diagnostic upper bound: what the teacher could know)", choices=['rollouts', 'expert']),
}

READING_FRAME = 'task to solve: {task}\nreference past trajectory: '  # how the composer's reader sees one experience


def lopd_state(run):
    """φ (the composer, and with --reader trained the reader too), its cold-start copy φ0 (for the
    anchor), φ's optimizer, the multiplier β, the bank."""
    emb = run.model.get_input_embeddings().weight
    composer = lopd.COMPOSERS[run.args.composer](emb.shape[1], run.args.K, scale=emb.std().item()).to(run.device)
    # the paper's code trains a LoRA on the encoder that reads the experiences; our reader is a
    # trainable copy of θ0 (the tiny model is small enough to copy whole)
    reader = copy.deepcopy(run.model).train().requires_grad_(True) if run.args.reader == 'trained' else None
    frozen = lambda m: copy.deepcopy(m).requires_grad_(False) if m is not None else None
    return {'bank': new_bank(run), 'composer': composer, 'composer0': frozen(composer), 'reader': reader,
            'reader0': frozen(reader), 'opt_phi': torch.optim.AdamW(phi_params(composer, reader), lr=lr_phi(run),
                                                                  weight_decay=0.0), 'beta': 0.0}


def phi_params(composer, reader):
    """φ: the composer's parameters, and the reader's when it trains."""
    return list(composer.parameters()) + (list(reader.parameters()) if reader is not None else [])


def lr_phi(run):
    return run.args.lr_composer or run.args.lr or run.method.lr


def retrieve(run, tasks, other_family=False):
    """Step 2: top-J successful experiences of similar tasks (never this task, by default).
    other_family=True: only experiences of other families (the teacher-gap report's control)."""
    return run.state['bank'].retrieve([t.prompt for t in tasks], [t.task_id for t in tasks], run.args.J,
                                      exclude_families=[t.family for t in tasks] if other_family else None)


def compose(run, tasks, found, grad, read0=None):
    """Step 3: the reader (the frozen base, or with --reader trained its trainable copy) reads
    'task to solve: x / reference past trajectory: m_j'; the composer maps its hidden states to K
    latents per experience. read0: the frozen reading of these experiences, already pooled
    (reading(); the cold start reuses it). -> z with φ's graph if grad, z0 from φ0 (ΣN·K, d)."""
    d = run.teacher.get_input_embeddings().weight.shape[1]
    if not any(found):
        empty = torch.zeros(0, d, device=run.device)
        return empty, empty
    s = run.state
    with torch.no_grad():
        read0 = reading(run, tasks, found, s['reader0'] or run.teacher) if read0 is None else read0  # (N, K, d)
        z0 = s['composer0'].from_pooled(read0)                                  # (N, K, d) the anchor's target
    with torch.set_grad_enabled(torch.is_grad_enabled() and grad):
        read = reading(run, tasks, found, s['reader']) if s['reader'] is not None else read0
        z = s['composer'].from_pooled(read)                                     # (N, K, d)
    return z.reshape(-1, d), z0.reshape(-1, d)


def reading(run, tasks, found, reader):
    """The reader's hidden states over each retrieved experience, pooled into K segments. We pool
    over the experience's own tokens only (read in the light of the task): pooled over the framing
    too, the first segments would describe the framing, not the plan. -> (N, K, d), N = Σ_i |found_i|."""
    heads = [run.tok.encode(READING_FRAME.format(task=t.prompt)) for t, f in zip(tasks, found) for _ in f]
    bodies = [run.tok.encode(experience_line(m.task, m.text))[:200] for f in found for m in f]
    ids, pool, attn = M.pad_batch([h + b for h, b in zip(heads, bodies)],
                                  [[0] * len(h) + [1] * len(b) for h, b in zip(heads, bodies)], run.tok.pad, run.device)
    return run.state['composer'].read(M.hidden(reader, ids, attn), M.embed(reader, ids), pool)


def latent_frame(run, zs):
    """<|bos|><|ctx|>past: z_1 \n z_2 \n … z_J \n — each experience's K latents exactly where
    experiences_text puts its text line, i.e. in the slot the base learned to read (the paper's
    code frames its latents the same way: "reference example … end of reference example").
    zs: J tensors (K, d) -> (P, d)."""
    E = lambda ids: M.embed(run.teacher, torch.tensor(ids, device=run.device))
    head, sep = E(run.tok.context_head() + run.tok.encode('past:')), E(run.tok.encode('\n'))
    return torch.cat([head] + [x for z in zs for x in (z, sep)])


def latents(run, eps, grad, found=None, read0=None):
    """Steps 2-3 -> Prefixes, latent_frame per rollout (None: nothing was retrieved)."""
    tasks, K = [e.task for e in eps], run.args.K
    found = retrieve(run, tasks) if found is None else found
    z, z0 = compose(run, tasks, found, grad, read0)
    prefixes, k = [], 0
    for f in found:
        prefixes.append(latent_frame(run, [z[k + j * K:k + (j + 1) * K] for j in range(len(f))]) if f else None)
        k += len(f) * K
    return Prefixes(prefixes, z=z, z0=z0, found=found)


def lopd_context(run, eps):
    """LOPD's teacher context: latents composed from retrieved experiences (φ's graph kept for the composer phase)."""
    return latents(run, eps, grad=not run.args.frozen_composer)


def composer_phase(run, b, logits_s, teacher):
    """Step 6: one step of φ on KL(sg π_θ ‖ π_T^φ) + β(m − Δ) + λ‖z − sg z0‖², then β ← max(0, β + η_β(m − Δ)).
    Rollouts without retrieved experiences carry no latents and are left out, as in the student phase."""
    a, s, keep = run.args, run.state, teacher.keep.to(run.device)
    loss, delta, anchor = lopd.composer_loss(logits_s[keep], teacher.logits[keep], b.ids[keep], b.amask[keep],
                                             b.reward[keep], s['beta'], a.margin, a.lam, teacher.context.z, teacher.context.z0,
                                             centered=a.advantage == 'centered', relative=a.anchor == 'relative')
    for g in s['opt_phi'].param_groups:  # --lr_composer acts after the setup (a cached one holds the lr it was built with)
        g['lr'] = lr_phi(run)
    optimizer_step(run, s['opt_phi'], loss, phi_params(s['composer'], s['reader']))
    s['beta'] = lopd.dual_update(s['beta'], a.margin, delta, a.eta_beta)
    return {'delta': float(delta), 'anchor': float(anchor)}


def write_back(run, eps):
    """Step 7: successful rollouts join the bank (the bank keeps only successes)."""
    run.state['bank'].add([retrieval.Experience(e.task.task_id, e.task.family, e.task.prompt,
                                                run.env.trajectory_text(e), e.reward) for e in eps])


def lopd_after_step(run, b, logits_s, teacher):
    logs = {'family_hit': family_hit(run, b.eps, teacher.context.found)}
    if not run.args.frozen_composer:  # the ablation keeps φ at its cold start
        with run.timer('composer'):
            logs.update(composer_phase(run, b, logits_s, teacher))
    write_back(run, b.eps)
    return logs


def new_bank(run):
    embed = retrieval.EMBEDDERS[run.args.embedder or run.env.embedder]()
    rerank = retrieval.RERANKERS[run.args.rerank or run.env.rerank]
    return retrieval.ExperienceBank(embed, run.args.bank_capacity, run.args.allow_same_task, rerank=rerank)


def fill_bank(run, rollout):
    """Before training: base rollouts fill the bank (they count toward the budget). -> all of them,
    as (episode, body, agent mask)."""
    a, rows = run.args, []
    n = max(a.batch, 64)  # no gradient here: a bigger batch only decodes faster
    for i in tqdm(range(0, a.init_episodes, n), desc='fill bank', dynamic_ncols=True):
        with run.timer('rollout'):
            tasks = run.rng.sample(run.env.train_tasks, min(n, a.init_episodes - i))
            if a.bank_source == 'expert':  # the diagnostic upper bound: the scripted expert's demos, not the base's own
                eps = [envs.play(run.env, t, run.env.demo(t, random.Random(0))) for t in tasks]
                bodies, masks = zip(*[M.encode_episode(run.tok, e) for e in eps])
            else:
                eps, bodies, masks = rollout(run.model, run.tok, run.env, tasks)
        run.episodes += len(eps)
        write_back(run, eps)
        rows += list(zip(eps, bodies, masks))
    return rows


def family_hit(run, eps, found):
    """Diagnostic: the fraction of retrieved experiences from the query's own family (training only)."""
    return run.state['bank'].family_hit_rate([e.task.family for e in eps], found)


def balanced_sample(rng, rows, n):
    """n rows drawn family first (uniform over the families present), then a row of that family:
    the base's successes are mostly families it already solves, and the rare ones must not drown."""
    by = {}
    for r in rows:
        by.setdefault(r[0].task.family, []).append(r)
    fams = sorted(by)
    return [rng.choice(by[rng.choice(fams)]) for _ in range(n)]


def cold_start_nll(run, ctx, ids, amask, attn):
    """The paper's cold start: the frozen teacher's NLL of successful trajectories given the latents
    composed from their retrieved experiences."""
    keep = torch.tensor([p is not None for p in ctx], device=run.device)
    logits_t = M.logits_on(run.teacher, with_default(run, ctx), ids, attn)
    return lopd.masked_mean(-lopd.token_logp(logits_t, ids), amask * keep[:, None].to(amask))


def cold_start_text(run, ctx, ids, amask, attn):
    """Text-to-latent distillation: the latents must make the teacher act as the same retrieved
    experiences shown as text do, KL(π_θ0(·|experiences as text) ‖ π_θ0(·|latents)) on every
    agent token of any stored rollout, success or failure (the text teacher knows the right
    next call after a wrong one too)."""
    keep = torch.tensor([p is not None for p in ctx], device=run.device)
    with torch.no_grad():
        text = M.text_prefix(run.teacher, run.tok, [bank_text(f) for f in ctx.found])
        logits_text = M.logits_on(run.teacher, text, ids, attn)
    logits_z = M.logits_on(run.teacher, with_default(run, ctx), ids, attn)
    return lopd.masked_mean(lopd.divergence(logits_z, logits_text, 'fkl'), amask * keep[:, None].to(amask))


COLD_STARTS = {'nll': cold_start_nll, 'text': cold_start_text}


def cold_start(run, rollout):
    """Fill the bank with base rollouts, then pre-train φ (COLD_STARTS: the paper's NLL of the
    successes, or text-to-latent distillation on every rollout), family-balanced by default.
    The bank does not change during the cold start, so each row's retrieval and its frozen
    reading are made once, not at every step (the reading was half of a step's time)."""
    a, s = run.args, run.state
    rows = fill_bank(run, rollout)
    rows = [r for r in rows if r[0].success] if a.cold_start == 'nll' else rows
    with run.timer('cold_start'):
        rows = [r + read for i in range(0, len(rows), 32) for r, read in zip(rows[i:i + 32], frozen_reading(run, rows[i:i + 32]))]
    opt = torch.optim.AdamW(phi_params(s['composer'], s['reader']), lr=a.lr_cold_start or a.lr or run.method.lr)  # its own stage
    for _ in (bar := tqdm(range(a.cold_start_steps if rows else 0), desc='cold start', dynamic_ncols=True)):
        with run.timer('cold_start'):
            pick = balanced_sample(run.rng, rows, 32) if a.cold_start_sample == 'balanced' else \
                run.rng.sample(rows, min(32, len(rows)))
            eps, bodies, masks, found, read0 = zip(*pick)
            ctx = latents(run, eps, grad=True, found=list(found), read0=torch.cat(read0))
            loss = COLD_STARTS[a.cold_start](run, ctx, *M.pad_batch(bodies, masks, run.tok.pad, run.device))
            optimizer_step(run, opt, loss, phi_params(s['composer'], s['reader']))
        bar.set_postfix(loss=f'{loss.item():.3f}')
    s['composer0'].load_state_dict(s['composer'].state_dict())  # z0: the anchor from here on
    if s['reader'] is not None:
        s['reader0'].load_state_dict(s['reader'].state_dict())


@torch.no_grad()
def frozen_reading(run, rows):
    """-> per row (what it retrieves, its frozen reading pooled (J_i, K, d)), as compose would make them."""
    tasks = [r[0].task for r in rows]
    found = retrieve(run, tasks)
    if not any(found):
        return [(f, torch.zeros(0, run.args.K, run.model.get_input_embeddings().weight.shape[1], device=run.device))
                for f in found]
    read0 = reading(run, tasks, found, run.state['reader0'] or run.teacher).split([len(f) for f in found])
    return list(zip(found, read0))


register('lopd', Method(
    distill, context=lopd_context, teacher='frozen', group=1, lr=1e-3,
    state=lopd_state, setup=cold_start, after_step=lopd_after_step,
    flags={**DISTILL_FLAGS, **BANK_FLAGS,
           'K': arg(4, 'latent tokens per retrieved experience', lo=1),
           'composer': arg('mlp', "φ: mlp = an MLP on the means of K segments of the reader's states; qformer = K learned "
                           "queries attending over them (the paper's)", choices=list(lopd.COMPOSERS)),
           'margin': arg(0.05, 'privileged margin m (0 = ablation)', lo=0, after_setup=True),
           'lam': arg(0.2, 'anchor weight λ on ‖z − z0‖²', lo=0, after_setup=True),
           'anchor': arg('absolute', "‖z − z0‖² as the paper's (absolute), or relative to ‖z0‖²", choices=['absolute', 'relative'],
                         after_setup=True),
           'eta_beta': arg(0.5, 'dual step size η_β for the margin multiplier β', lo=0, after_setup=True),
           'lr_composer': arg(1e-5, "composer-phase learning rate (the paper's lr_φ; at the student's 1e-3 the KL term "
                              "pulls the teacher onto the student within 16 steps; 0 = the student's)", lo=0,
                              after_setup=True),
           'lr_cold_start': arg(0.0, "cold-start learning rate (0 = the student's)", lo=0),
           'cold_start_steps': arg(100, 'composer pre-training steps (tool use: 100, teacher gap +16, 300: +23; codegen: 300, +18.5)', lo=0),
           'cold_start': arg('text', "cold start objective: text = the teacher reading the latents matches it reading "
                             "the same experiences as text (the default: its other-family control stays flat); nll = the "
                             "paper's, the teacher's NLL of successes given their latents", choices=list(COLD_STARTS)),
           'cold_start_sample': arg('balanced', "cold start: draw the bank's rollouts family-balanced, or as stored",
                                    choices=['balanced', 'stored']),
           'reader': arg('frozen', 'who reads the experiences for the composer: the frozen base, or a trainable copy',
                         choices=['frozen', 'trained']),
           'advantage': arg('paper', "the margin's A(τ): paper = 2r − 1, centered = r − mean r over the batch",
                            choices=['paper', 'centered'], after_setup=True),
           'frozen_composer': arg(False, 'ablation: keep φ at its cold start (no composer phase)', after_setup=True)},
    bench={'lopd': dict(cost=670, quick=True),
           'lopd-frozen': dict(flags=['--frozen_composer'], cost=280, quick=True),
           'lopd-m0': dict(flags=['--margin', '0'], cost=350, quick=True)},
    tune=DISTILL_LR))


# ----------------------------------------------------------------------------- GRPO (Shao et al. 2024)

register('grpo', Method(grpo_loss, teacher='none', group=4, lr=1e-4, bench={'grpo': dict(cost=160, quick=True)},
                        tune=[[], ['--lr', '3e-5'], ['--lr', '3e-4']]))


# ----------------------------------------------------------------------------- the shared pool of verified successes
# OPSD's and SDFT's teachers are shown "oracle trajectories from the shared pool" (LOPD paper, App. B):
# verified-successful trajectories from base rollouts, and from stronger models where coverage is
# lacking. Ours: --pool_episodes base rollouts of training tasks (they count toward --episodes, as
# LOPD's bank fill does), their successes kept by task; a task the pool does not cover is shown the
# scripted expert's trajectory (our "stronger model"; in tool use it takes a random valid order of
# the sub-goals, so it can disagree with the student's prefix). A held-out task is never in the pool.

POOL_FLAGS = {
    'pool_episodes': arg(512, 'base rollouts whose successes fill the shared pool of oracle trajectories before training '
                         '(they count toward --episodes; the scripted expert covers the other tasks)', lo=0),
}


def pool_state(run):
    """The shared pool: task id -> the trajectory text of a verified success (filled by build_pool)."""
    return {'pool': {}}


def build_pool(run, rollout):
    """Before training: the base's successes on --pool_episodes training tasks, by task."""
    n, pool = 64, run.state['pool']
    for i in tqdm(range(0, run.args.pool_episodes, n), desc='pool', dynamic_ncols=True):
        with run.timer('rollout'):
            eps, _, _ = rollout(run.model, run.tok, run.env, run.rng.sample(run.env.train_tasks, min(n, run.args.pool_episodes - i)))
        run.episodes += len(eps)
        for e in eps:
            if e.success:
                pool.setdefault(e.task.task_id, run.env.trajectory_text(e))


def oracle_text(run, task):
    """The pool's trajectory of this task (the expert's where the pool has none), as a past experience."""
    return experiences_text([(task.prompt, run.state['pool'].get(task.task_id) or task.solution)])


# ----------------------------------------------------------------------------- OPSD (as the LOPD paper ran it)

def opsd_context(run, eps):
    """OPSD: the frozen base is shown an oracle trajectory of this task from the shared pool
    (--opsd_context answer: this task's reference solution, plan and answer, the OPSD code's form)."""
    texts = [solution_text(e.task) if run.args.opsd_context == 'answer' else oracle_text(run, e.task) for e in eps]
    return texts


OPSD_FLAGS = {**POOL_FLAGS,
              'opsd_context': arg('pool', "what OPSD's teacher is shown: pool = an oracle trajectory of the task from the "
                                  "shared pool (the LOPD paper's runs); answer = this task's reference solution, its plan and "
                                  "answer (the OPSD code's 'reference solution')", choices=['pool', 'answer'])}


register('opsd', Method(distill, context=opsd_context, teacher='frozen', divergence='fkl', group=1, lr=1e-3,
                        state=pool_state, setup=build_pool,
                        flags={**DISTILL_FLAGS, **TEACHER_FLAGS, **OPSD_FLAGS},
                        bench={'opsd': dict(cost=550, quick=True),
                               'opsd-answer': dict(flags=['--opsd_context', 'answer', '--divergence', 'jsd', '--pool_episodes', '0'],
                                                   cost=550, quick=True)},
                        tune=DISTILL_LR))


# ----------------------------------------------------------------------------- SDPO (lasgroup/SDPO)

def sdpo_context(run, eps):
    """SDPO: a successful sibling rollout of the same task (never the rollout itself), else
    the environment's feedback on this attempt; a rollout with neither gets no teacher."""
    G, texts = run.method.group, []
    for i, e in enumerate(eps):
        g = i - i % G                                                           # first rollout of i's group
        sib = next((s for j, s in enumerate(eps[g:g + G], g) if j != i and s.success), None)
        texts.append(experiences_text([(sib.task.prompt, run.env.trajectory_text(sib))]) if sib else
                     f'feedback: {e.feedback}\n' if e.feedback else None)
    return texts


register('sdpo', Method(distill, context=sdpo_context, teacher='ema', group=4, lr=1e-3,
                        flags={**DISTILL_FLAGS, **TEACHER_FLAGS}, bench={'sdpo': dict(cost=220)},
                        tune=[[], ['--lr', '3e-4'], ['--ema_rate', '0.01']]))


# ----------------------------------------------------------------------------- SDFT (as the LOPD paper ran it)

def sdft_context(run, eps):
    """SDFT: an EMA of the student shown the pool's oracle trajectory of this task as a demonstration."""
    return [oracle_text(run, e.task) for e in eps]


register('sdft', Method(distill, context=sdft_context, teacher='ema', divergence='fkl', group=1, lr=1e-3,
                        state=pool_state, setup=build_pool,
                        ema_rate=0.01, flags={**DISTILL_FLAGS, **TEACHER_FLAGS, **POOL_FLAGS},
                        bench={'sdft': dict(cost=630, quick=True)}, tune=DISTILL_LR))


# ----------------------------------------------------------------------------- Skill-SD (Wang et al. 2026)
# The teacher (synced to the student) reads a "skill" summarised from the agent's own finished
# trajectories of the task's family. A family's arms are skills built on its 3 latest
# successes; UCB1 picks one per family. The student's rollouts never see a skill, so an arm can
# only be judged by what it did: the arm that shaped step t's update is credited with the
# family's success in the rollouts of its next appearance, sampled after that update.

def skill_text(records):
    """Skill-SD's summariser, as a deterministic template over a family's stored trajectories
    [(text, reward, feedback)]: a success pattern, the commonest mistake, the workflow.
    e.g. 'skill: success pattern: city(bo) -> oslo; answer oslo; mistakes: none seen;
    workflow: 2 turns, the last one answers'."""
    wins = [r for r in records if r[1] >= 1]
    fails = [r[2] for r in records if r[1] < 1 and r[2]]
    pattern = wins[-1][0] if wins else 'none yet'
    mistake = max(fails, key=fails.count) if fails else 'none seen'   # a tie: the earliest (set order is hash-seeded)
    turns = round(float(np.mean([r[0].count(';') + 1 for r in wins]))) if wins else '?'
    return f'skill: success pattern: {pattern}; mistakes: {mistake}; workflow: {turns} turns, the last one answers\n'


def arms(records):
    """A family's arms: the indices of its 3 latest successes (one arm, all records, before any)."""
    return [i for i, r in enumerate(records) if r[1] >= 1][-3:] or [len(records)]


def skill_of(records, arm):
    """The skill of one arm: the summary of the records up to that arm's success (the last 50)."""
    wins = arms(records)
    upto = wins[min(arm, len(wins) - 1)] + 1
    return skill_text(records[:upto][-50:])


def ucb1(stats, n_arms):
    """UCB1: the arm maximising mean reward + sqrt(2 ln n / pulls); an unpulled arm first, ties to the lowest."""
    n = sum(v[0] for v in stats.values()) + 1
    return max(range(n_arms), key=lambda a: float('inf') if a not in stats else
               stats[a][1] / stats[a][0] + math.sqrt(2 * math.log(n) / stats[a][0]))


def skillsd_context(run, eps):
    """Skill-SD: the skill text of the task's family, from the arm its bandit chose last."""
    s = run.state
    return [skill_of(s['skills'].get(e.task.family, []), s['arm'].get(e.task.family, 0)) for e in eps]


def skillsd_loss(run, b, logits_s, teacher):
    """GRPO (PPO-clip, ε 0.2 / 0.28) + λ × importance-weighted sampled-token k3 reverse KL
    toward the skill-prompted teacher."""
    logp = lopd.token_logp(logits_s, b.ids)
    k3 = lopd.is_k3_loss(logp, logp.detach(), lopd.token_logp(teacher.logits, b.ids), b.amask)
    return grpo_loss(run, b, logits_s, eps_hi=0.28) + run.args.k3_coef * k3


def skillsd_after_step(run, b, logits_s, teacher):
    """Credit each family's last arm with its success now, store the trajectories, pick the next arm."""
    s, rewards = run.state, {}
    for e in b.eps:
        rewards.setdefault(e.task.family, []).append(e.reward)
    for e in b.eps:  # Skill-SD's store: every finished trajectory of the family, kept short
        s['skills'].setdefault(e.task.family, []).append((run.env.trajectory_text(e), e.reward, e.feedback))
        del s['skills'][e.task.family][:-50]
    for f, r in rewards.items():
        stats = s['ucb'].setdefault(f, {})                                     # arm -> [pulls, total reward]
        if f in s['shaped']:                                                   # these rollouts followed its update
            pulls, total = stats.get(s['shaped'][f], [0, 0.0])
            stats[s['shaped'][f]] = [pulls + 1, total + float(np.mean(r))]
        s['shaped'][f] = s['arm'].get(f, 0)                                    # the arm this step's update used
        s['arm'][f] = ucb1(stats, len(arms(s['skills'][f])))
    return {}


register('skillsd', Method(
    skillsd_loss, context=skillsd_context, teacher='live', group=4, lr=1e-4, after_step=skillsd_after_step,
    state=lambda run: {'skills': {}, 'ucb': {}, 'arm': {}, 'shaped': {}},
    flags={**TEACHER_FLAGS, 'k3_coef': arg(0.001, 'weight λ of the importance-weighted k3 term', lo=0, after_setup=True)},
    bench={'skillsd': dict(cost=290)}, tune=[[], ['--lr', '3e-4'], ['--k3_coef', '0.01']]))


# ----------------------------------------------------------------------------- Traj-text (LOPD ablation)

def trajtext_context(run, eps):
    """Traj-text: LOPD's retrieved experiences, shown to the frozen base as text."""
    found = retrieve(run, [e.task for e in eps])
    return Prefixes([bank_text(f) for f in found], found=found)


def trajtext_after_step(run, b, logits_s, teacher):
    logs = {'family_hit': family_hit(run, b.eps, teacher.context.found)}
    write_back(run, b.eps)
    return logs


register('trajtext', Method(distill, context=trajtext_context, teacher='frozen', group=1, lr=1e-3,
                            state=lambda run: {'bank': new_bank(run)}, setup=fill_bank, after_step=trajtext_after_step,
                            flags={**DISTILL_FLAGS, **TEACHER_FLAGS, **BANK_FLAGS},
                            bench={'trajtext': dict(cost=430)}, tune=DISTILL_LR))


# ----------------------------------------------------------------------------- PSP (Privileged Self-Practice)
# The privileged information goes into the *sampling* prompt, never into a loss: a task whose G
# rollouts all failed is sampled G times again with a hint in the student's own context, and the
# loss is GRPO's, unchanged. The loss conditions on the plain prompt (<|bos|>, no hint): at test
# time there is no hint, so the update must teach the hinted behaviour to the unhinted policy
# (scored under the plain prompt, the ratio of our one PPO epoch is 1, as for GRPO).

def psp_hint(ep):
    """PSP's analyzer, as a template: the environment's verdict on the task's first failed rollout,
    in the 'feedback: …' form the warm-up taught the model to read (the paper's is an LLM-written
    instruction, which a tiny model cannot write)."""
    return f'feedback: {ep.feedback}\n'


def psp_sample(run, tasks, rollout):
    """G plain rollouts per task; the groups without a success are replaced by G rollouts sampled
    with the hint (their GRPO advantage was 0: no signal). Both samplings count toward --episodes."""
    G = run.method.group
    eps, bodies, masks = rollout(run.model, run.tok, run.env, tasks)
    again = [i for g in range(0, len(eps), G) if not any(e.success for e in eps[g:g + G]) for i in range(g, g + G)]
    if again:
        hints = M.text_prefix(run.model, run.tok, [psp_hint(eps[i - i % G]) for i in again])
        for i, e, body, mask in zip(again, *rollout(run.model, run.tok, run.env, [tasks[i] for i in again], prefixes=hints)):
            eps[i], bodies[i], masks[i] = e, body, mask
        run.episodes += len(again)
    run.log.setdefault('resampled', []).append(len(again) / len(eps))
    return eps, bodies, masks


register('psp', Method(grpo_loss, sample=psp_sample, teacher='none', group=4, lr=1e-4,
                       bench={'psp': dict(cost=200, quick=True)}, tune=[[], ['--lr', '3e-5'], ['--lr', '3e-4']]))


# ----------------------------------------------------------------------------- SOD (Zhong et al. 2026, arXiv 2605.07725)
# OPSD's teacher (the frozen base shown an oracle trajectory of the task), with the distillation strength
# of each agent turn reweighted by that turn's teacher–student divergence: where they diverge
# strongly (a wrong tool call, then observations the teacher never saw) the teacher's advice is
# attenuated; where they agree it is kept. The paper's exact weight map is not available to us:
# we use w_k = exp(−D̄_k / τ), D̄_k the mean divergence over turn k's tokens, τ the batch's mean
# D̄_k unless --sod_tau is set, so the weight is 1 at no divergence and e^{-1} at a typical one.

def turn_ids(amask):
    """1, 2, … on the tokens of each row's k-th agent turn (a run of agent tokens), 0 elsewhere. (B, T) -> (B, T)."""
    a = amask > 0
    start = a & ~torch.cat([a.new_zeros(a.shape[0], 1), a[:, :-1]], 1)
    return torch.cumsum(start.long(), 1) * a


def sod_weights(d, amask, tau=0.0):
    """The weight of each agent token's turn, w_k = exp(−D̄_k / τ) (0 off the mask). d, amask (B, T) -> (B, T), no graph."""
    d, ids = d.detach(), turn_ids(amask)
    K = int(ids.max()) + 1
    cell = (ids + K * torch.arange(ids.shape[0], device=ids.device)[:, None]).flatten()   # one cell per (row, turn)
    total = torch.zeros(ids.shape[0] * K, dtype=d.dtype, device=d.device)
    n = total.index_add(0, cell, (amask > 0).flatten().to(d.dtype))
    mean = total.index_add(0, cell, (d * (amask > 0)).flatten()) / n.clamp(min=1)
    turns = (n > 0) & (torch.arange(len(n), device=d.device) % K != 0)
    tau = tau or (mean[turns].mean().clamp(min=1e-8) if turns.any() else 1.0)  # no agent token: any τ gives 0
    return (torch.exp(-mean / tau)[cell].view_as(d)) * (ids > 0)


def sod_loss(run, b, logits_s, teacher):
    """L = Σ_{t∈A} w_{k(t)} D_t / |A|: the distillation loss with each token weighted by its turn's w_k."""
    a, kind = run.args, run.args.divergence or run.method.divergence
    d = lopd.topk_divergence(logits_s, teacher.logits.detach(), a.topk, kind) if a.topk else \
        lopd.divergence(logits_s, teacher.logits.detach(), kind)
    mask = b.amask * teacher.keep[:, None].to(b.amask)
    return lopd.masked_mean(sod_weights(d, mask, a.sod_tau) * d, mask)


register('sod', Method(sod_loss, context=opsd_context, teacher='frozen', divergence='rkl', group=1, lr=1e-3,
                       state=pool_state, setup=build_pool,
                       flags={**DISTILL_FLAGS, **TEACHER_FLAGS, **OPSD_FLAGS,
                              'sod_tau': arg(0.0, "SOD's temperature τ of w_k = exp(−D̄_k/τ) (0 = the batch's mean D̄_k)", lo=0,
                                             after_setup=True)},
                       bench={'sod': dict(cost=550, quick=True)}, tune=DISTILL_LR))


# ----------------------------------------------------------------------------- ACSD (activation-conditioned self-distillation)
# The teacher is the frozen base with a steering vector v added to the residual stream entering
# its layer L, at every position; no text context. v = mean hidden state of the student's rollouts
# that succeeded − that of the others (each rollout: the mean over its agent tokens of the base's
# own, unsteered, activations), each class mean a running mean refreshed by every batch (rate
# --steer_rate), started from base rollouts before training. The student distils on its own prefixes.

def steered_layer(run):
    layers, L = M.blocks(run.teacher), run.args.steer_layer
    if L >= len(layers):
        die(f'--steer_layer must be below the model\'s {len(layers)} layers, got {L}')
    return layers[L if L >= 0 else len(layers) // 2]


def acsd_state(run):
    """v and its two class means; the hook that adds α·v (run.teacher is θ0's copy: θ is never steered)."""
    d = run.model.get_input_embeddings().weight.shape[1]
    zero = lambda: torch.zeros(d, device=run.device)
    # with LoRA, θ0 is θ's own layers with the adapter off: only a pass of the teacher's view is steered
    steer = lambda module, args: (args[0] + run.args.steer_scale * run.state['steer'].to(args[0]),) + args[1:] \
        if getattr(run.teacher, 'on', True) else None
    steered_layer(run).register_forward_pre_hook(steer)
    return {'steer': zero(), 'mean_win': zero(), 'mean_other': zero(), 'seen': [0, 0]}


@torch.no_grad()
def rollout_activations(run, b):
    """Each rollout's mean over its agent tokens of the residual stream entering layer L, read
    before the steering hook adds v (prepend=True) -> (B, d)."""
    seen = []
    hook = steered_layer(run).register_forward_pre_hook(lambda module, args: seen.append(args[0]), prepend=True)
    M.logits_on(run.teacher, M.bos_prefix(run.teacher, run.tok, len(b.eps)), b.ids, b.attn)
    hook.remove()
    m = b.amask[..., None].to(seen[0])
    return (seen[0][:, len(run.tok.head()):] * m).sum(1) / m.sum(1).clamp(min=1)   # after the head (<|bos|>)


def update_steer(run, b):
    """Each class mean ← (1 − rate)·mean + rate·(this batch's mean), the first batch of a class
    taken as is; v = mean_win − mean_other once both classes were seen."""
    s, h, won = run.state, rollout_activations(run, b), b.reward >= 1
    for k, (name, rows) in enumerate([('mean_win', won), ('mean_other', ~won)]):
        if rows.any():
            rate = 1.0 if s['seen'][k] == 0 else run.args.steer_rate
            s[name] = (1 - rate) * s[name] + rate * h[rows].mean(0)
            s['seen'][k] += int(rows.sum())
    if all(s['seen']):
        s['steer'] = s['mean_win'] - s['mean_other']
    return {'steer_norm': float(s['steer'].norm())}


def acsd_setup(run, rollout):
    """Before training: --steer_episodes base rollouts make the first v (they count toward the budget)."""
    for i in tqdm(range(0, run.args.steer_episodes, 64), desc='steering vector', dynamic_ncols=True):
        eps, bodies, masks = rollout(run.model, run.tok, run.env, run.rng.sample(run.env.train_tasks, min(64, run.args.steer_episodes - i)))
        run.episodes += len(eps)
        update_steer(run, Batch(eps, *M.pad_batch(bodies, masks, run.tok.pad, run.device),
                                torch.tensor([e.reward for e in eps], device=run.device)))


register('acsd', Method(distill, context=lambda run, eps: M.bos_prefix(run.teacher, run.tok, len(eps)), teacher='frozen',
                        divergence='rkl', group=1, lr=1e-3, state=acsd_state, setup=acsd_setup,
                        after_step=lambda run, b, logits_s, teacher: update_steer(run, b),
                        flags={**DISTILL_FLAGS,
                               'steer_layer': arg(-1, 'the teacher layer whose input residual stream is steered (-1 = the middle one)', lo=-1),
                               'steer_scale': arg(1.0, 'α: the teacher adds α·v', after_setup=True),
                               'steer_rate': arg(0.1, 'running-mean rate of the class means v is made of', lo=0, hi=1, after_setup=True),
                               'steer_episodes': arg(256, 'base rollouts that make the first v (they count toward --episodes)', lo=0)},
                        bench={'acsd': dict(cost=400, quick=True)}, tune=DISTILL_LR))


# ----------------------------------------------------------------------------- VASPO (privileged value estimation with PPO)
# A critic and a teacher both see the privileged context (OPSD's: an oracle trajectory) on the
# student's prefixes. The critic V_ψ, a linear head on the frozen teacher's last hidden state,
# predicts the continuation return; its GAE advantages (γ = 1, the 0/1 reward at the end) drive
# PPO-clip, and on positive advantages the teacher's probability ratio π_T(y_t)/π_θ(y_t), bounded
# to [1 − ε_T, 1 + ε_T], scales A_t up where the teacher endorses the token and down where it does
# not. ψ learns after θ's update, on the same batch (MSE to the return). This block also needs
# token-level advantages in lopd.ppo_clip_loss (one line there).

def vaspo_state(run):
    critic = torch.nn.Linear(run.model.get_input_embeddings().weight.shape[1], 1).to(run.device)
    torch.nn.init.zeros_(critic.weight)  # V starts at its bias, 0: no advantage is made up before ψ learns
    return {'critic': critic, 'opt_v': torch.optim.AdamW(critic.parameters(), lr=run.args.lr_critic, weight_decay=0.0)}


def critic_values(run, prefixes, b):
    """V_ψ(c, x, y<t) at every body position t, as logits_on lays the context out -> (B, T);
    the teacher's features carry no graph, only ψ does. They are read once per batch (the loss
    and ψ's step share them), kept on the batch, which lives for one step."""
    if getattr(b, 'critic_features', None) is None:
        with torch.no_grad():
            E, mask, P = lopd.teacher_inputs(prefixes, M.embed(run.teacher, b.ids), b.attn)
            pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
            h = run.teacher(inputs_embeds=E, attention_mask=mask, position_ids=pos, output_hidden_states=True).hidden_states[-1]
            b.critic_features = h[:, P - 1:P - 1 + b.ids.shape[1]].float()
    return run.state['critic'](b.critic_features).squeeze(-1)


def gae(values, reward, mask, lam):
    """A_t = δ_t + λ A_t', over each row's agent tokens t < t' (the next one): δ_t = V_t' − V_t,
    and r − V_t at the last one (γ = 1). (B, T), (B,) -> (B, T), 0 off the mask."""
    adv, next_v, next_a = torch.zeros_like(values), reward.to(values), torch.zeros_like(reward, dtype=values.dtype)
    for t in reversed(range(values.shape[1])):
        on = mask[:, t] > 0
        a = next_v - values[:, t] + lam * next_a
        adv[:, t] = torch.where(on, a, 0.0)
        next_v, next_a = torch.where(on, values[:, t], next_v), torch.where(on, a, next_a)
    return adv


def vaspo_loss(run, b, logits_s, teacher):
    """PPO-clip with A_t = GAE(V_ψ) and, where A_t > 0, A_t · clip(π_T(y_t)/π_θ(y_t), 1 − ε_T, 1 + ε_T)."""
    logp, eps_t = lopd.token_logp(logits_s, b.ids), run.args.vaspo_eps
    with torch.no_grad():
        adv = gae(critic_values(run, teacher.context, b), b.reward, b.amask, run.args.gae_lambda)
        ratio_t = torch.exp(lopd.token_logp(teacher.logits, b.ids) - logp).clamp(1 - eps_t, 1 + eps_t)
        adv = torch.where(adv > 0, adv * ratio_t, adv)
    return lopd.ppo_clip_loss(logp, logp.detach(), adv, b.amask)


def vaspo_after_step(run, b, logits_s, teacher):
    """ψ: one step on the MSE between V_ψ and the return r at every agent token."""
    loss = lopd.masked_mean((critic_values(run, teacher.context, b) - b.reward[:, None]) ** 2, b.amask)
    optimizer_step(run, run.state['opt_v'], loss, run.state['critic'])
    return {'value_loss': loss.item()}


register('vaspo', Method(vaspo_loss, context=opsd_context, teacher='frozen', group=1, lr=1e-4,
                         state=lambda run: {**pool_state(run), **vaspo_state(run)}, setup=build_pool, after_step=vaspo_after_step,
                         flags={**TEACHER_FLAGS, **OPSD_FLAGS,
                                'gae_lambda': arg(0.95, "GAE's λ over the agent tokens (1 = the Monte Carlo return − V)", lo=0, hi=1,
                                                  after_setup=True),
                                'vaspo_eps': arg(0.2, "ε_T: the teacher's ratio on positive advantages is bounded to [1 − ε_T, 1 + ε_T]",
                                                 lo=0, hi=1, after_setup=True),
                                'lr_critic': arg(1e-3, "the critic's learning rate", lo=0, open_lo=True)},
                         bench={'vaspo': dict(cost=300, quick=True)}, tune=[[], ['--lr', '3e-5'], ['--lr', '3e-4']]))
