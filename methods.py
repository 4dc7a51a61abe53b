"""The methods: what each one's teacher is shown, how its student learns, what it keeps.

train.py runs every method through the same steps (its docstring numbers them):

    rollout -> teacher_phase -> student_phase -> after_step
    (method.sample) method.context  method.loss     method.after_step

A method is one `Method(...)` record, registered by name in METHODS. Its block holds
everything that is its own: the context builder (pure: evaluation calls it too, so it may
read but never change state), its loss, its state (created by `state`, saved in ckpt.pt
and restored whatever it holds), a one-time `setup`, an `after_step` hook, the flags only it
reads, and its bench entries and tuning grid. This file holds the registry, the pieces the
methods share and the baselines (GRPO, OPSD, SDPO, SDFT, Skill-SD); LOPD and its ablation
Traj-text are in lopd_method.py, the four variants in variants.py. A forker adds a method by
registering one more record from a file of their own (tests/fork_variant.py does).

References (papers, and the public code our baselines follow): GRPO, Shao et al. 2024
(DeepSeekMath); OPSD (siyan-zhao/OPSD); SDPO (lasgroup/SDPO); SDFT (idanshen/Self-Distillation);
Skill-SD, Wang et al. 2026 (arXiv 2604.10674); LOPD, Zhang et al. 2026 (arXiv 2608.13040,
bingreeky/LOPD).
"""
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
from tqdm import tqdm

import lopd
import model as M
from bookkeeping import arg


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
    bench: dict = field(default_factory=dict)  # bench.py entry -> dict(flags=[...], cost=seconds, quick=bool, and on the
    #                                            method's own entry knob=[flags]: another setting of its key knob, which
    #                                            bench.py --tune tries beside the learning rate ×1/3, ×1, ×3


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
    'epochs': arg(1, 'student updates on each batch of rollouts, all toward the teacher scores computed once '
                  '(a fixed target: no ratio to correct, unlike a policy gradient)', lo=1, after_setup=True),
}
TEACHER_FLAGS = {  # the baselines' teacher may be swapped (LOPD's composer is trained against θ0 only)
    'teacher': arg('', "the teacher's weights ('' = the method's)", choices=['frozen', 'ema', 'live'], after_setup=True),
    'ema_rate': arg(0.0, "rate of an EMA teacher: θ_T ← (1 − rate) θ_T + rate θ (0 = the method's: SDPO 0.05, SDFT 0.01)",
                    lo=0, hi=1, after_setup=True),
}
def distill(run, b, logits_s, teacher):
    """L_distill = Σ_{t∈A} D(π_θ(·|x,y<t) ‖ sg π_T(·|c,x,y<t)) / |A| over the rollouts that got a teacher."""
    mask = b.amask * teacher.keep[:, None].to(b.amask)
    return lopd.distill_loss(logits_s, teacher.logits, mask, run.args.divergence or run.method.divergence, run.args.topk)


def grpo_loss(run, b, logits_s, teacher=None, eps_hi=0.2):
    """PPO-clip with the group advantage (r − mean)/std, one epoch (so the ratio is 1)."""
    logp = lopd.token_logp(logits_s, b.ids)
    return lopd.ppo_clip_loss(logp, logp.detach(), lopd.group_advantage(b.reward, run.method.group), b.amask, 0.2, eps_hi)


# ----------------------------------------------------------------------------- LOPD (Zhang et al. 2026)
# LOPD's steps, and its ablation Traj-text, are in lopd_method.py, in the paper's step order;
# imported here, so that it is the first method registered (and listed).
import lopd_method  # noqa: E402,F401


# ----------------------------------------------------------------------------- GRPO (Shao et al. 2024)

register('grpo', Method(grpo_loss, teacher='none', group=4, lr=1e-4,
                        bench={'grpo': dict(knob=['--batch', '32'], cost=160, quick=True)}))


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
    (--opsd_context answer: this task's reference solution, plan and answer, the OPSD code's form;
    family: the oracle trajectory of another training task of the same family, OP²SD's donor; the two
    controls: other = of a task of another family, none = an empty context, the frozen base anchoring θ)."""
    c = run.args.opsd_context
    if c == 'answer':
        return [solution_text(e.task) for e in eps]
    if c == 'none':
        return ['' for _ in eps]
    return [oracle_text(run, donor(run, e.task, same_family=c == 'family') if c in ('family', 'other') else e.task)
            for e in eps]


def donor(run, task, same_family):
    """Another training task of task's family (or, same_family=False, of another family), the same one
    every time it is asked (drawn by task id): its oracle trajectory shows that family's plan in another
    world, as a retrieved experience would."""
    pick = [t for t in run.env.train_tasks if (t.family == task.family) == same_family and t.task_id != task.task_id]
    return random.Random(task.task_id).choice(pick)


OPSD_FLAGS = {**POOL_FLAGS,
              'opsd_context': arg('pool', "what OPSD's teacher is shown: pool = an oracle trajectory of the task from the "
                                  "shared pool (the LOPD paper's runs); answer = this task's reference solution, its plan and "
                                  "answer (the OPSD code's 'reference solution'); family = the oracle trajectory of another training task of the "
                                  "same family (OP²SD's donor); controls: other = of a task of another family, none = an empty context",
                                  choices=['pool', 'answer', 'family', 'other', 'none'])}


register('opsd', Method(distill, context=opsd_context, teacher='frozen', divergence='fkl', group=1, lr=1e-3,
                        state=pool_state, setup=build_pool,
                        flags={**DISTILL_FLAGS, **TEACHER_FLAGS, **OPSD_FLAGS},
                        bench={'opsd': dict(knob=['--divergence', 'rkl'], cost=550, quick=True),
                               'opsd-rkl': dict(flags=['--divergence', 'rkl', '--lr', '3e-4'], cost=550, quick=True),
                               'opsd-family': dict(flags=['--opsd_context', 'family', '--divergence', 'rkl', '--lr', '3e-4'], cost=550),
                               'opsd-answer': dict(flags=['--opsd_context', 'answer', '--divergence', 'jsd', '--pool_episodes', '0'],
                                                   cost=550, quick=True),
                               'opsd-other': dict(flags=['--opsd_context', 'other'], cost=550),  # the controls
                               'opsd-none': dict(flags=['--opsd_context', 'none'], cost=550)}))


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
                        flags={**DISTILL_FLAGS, **TEACHER_FLAGS},
                        bench={'sdpo': dict(knob=['--ema_rate', '0.01'], cost=220)}))


# ----------------------------------------------------------------------------- SDFT (as the LOPD paper ran it)

def sdft_context(run, eps):
    """SDFT: an EMA of the student shown the pool's oracle trajectory of this task as a demonstration."""
    return [oracle_text(run, e.task) for e in eps]


register('sdft', Method(distill, context=sdft_context, teacher='ema', divergence='fkl', group=1, lr=1e-3,
                        state=pool_state, setup=build_pool,
                        ema_rate=0.01, flags={**DISTILL_FLAGS, **TEACHER_FLAGS, **POOL_FLAGS},
                        bench={'sdft': dict(knob=['--ema_rate', '0.05'], cost=630, quick=True)}))


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
    bench={'skillsd': dict(knob=['--k3_coef', '0.01'], cost=290)}))


# ----------------------------------------------------------------------------- the variants
# PSP, SOD, ACSD and VASPO are registered from a file of their own, as a forker's file would be.
import variants  # noqa: E402,F401
