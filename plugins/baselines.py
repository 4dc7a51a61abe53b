"""The baselines LOPD is compared against, one block each, registered by name.

GRPO, OPSD, SDPO, SDFT and Skill-SD, each as the LOPD paper ran it (its App. B), and Traj-text,
LOPD's ablation that shows the same retrieved experiences as text. Each block holds what the
method owns: what its teacher is shown (a context builder), its loss, its state and setup, its own
flags and its bench entries. They run through train.train_step (plumbing/registry.py says how);
LOPD's own step is train.lopd_step. train.py imports this file, which registers them.

References (papers, and the public code our baselines follow): GRPO, Shao et al. 2024
(DeepSeekMath); OPSD (siyan-zhao/OPSD); SDPO (lasgroup/SDPO); SDFT (idanshen/Self-Distillation);
Skill-SD, Wang et al. 2026 (arXiv 2604.10674); LOPD, Zhang et al. 2026 (arXiv 2608.13040).
"""
import math
import random

import numpy as np
from tqdm import tqdm

import lopd
import retrieval
from plumbing import parallel
from plumbing.bookkeeping import arg
from plumbing.registry import DISTILL_FLAGS, TEACHER_FLAGS, Method, Prefixes, distill, register
from retrieval import experiences_text
from warmup import skill_text, solution_text


def grpo_loss(run, b, logits_s, teacher=None, eps_hi=0.2):
    """PPO-clip with the group advantage (r − mean)/std, one epoch (so the ratio is 1)."""
    logp = lopd.token_logp(logits_s, b.ids, b.amask)                          # the head on agent tokens only
    return lopd.ppo_clip_loss(logp, logp.detach(), lopd.group_advantage(b.reward, run.method.group), b.amask, 0.2, eps_hi)


# ----------------------------------------------------------------------------- Traj-text (LOPD ablation)

def trajtext_context(run, eps):
    """Traj-text: LOPD's retrieved experiences, shown to the frozen base as text."""
    found = retrieval.retrieve(run, [e.task for e in eps], other_family=run.args.retrieval == 'other')
    return Prefixes([retrieval.bank_text(f) for f in found], found=found)


def trajtext_after_step(run, b, logits_s, teacher):
    logs = {'family_hit': retrieval.family_hit(run, b.eps, teacher.context.found)}
    retrieval.write_back(run, b.eps)
    return logs


register('trajtext', Method(distill, context=trajtext_context, teacher='frozen', group=1, lr=1e-3,
                            state=lambda run: {'bank': retrieval.new_bank(run)}, setup=retrieval.fill_bank, after_step=trajtext_after_step,
                            flags={**DISTILL_FLAGS, **TEACHER_FLAGS, **retrieval.BANK_FLAGS},
                            bench={'trajtext': dict(knob=['--J', '3'], cost=430)}))


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
        run.lap()
        eps, _, _ = rollout(run.model, run.tok, run.env, run.rng.sample(run.env.train_tasks, min(n, run.args.pool_episodes - i)),
                            rows=parallel.decode_rows(run, 0))
        run.lap('fill')
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
# family's success in the rollouts of its next appearance, sampled after that update. Its summariser,
# skill_text, is in warmup.py: the warm-up teaches the base to read a skill, as it reads every context form.

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
    logp = lopd.token_logp(logits_s, b.ids, b.amask)
    k3 = lopd.is_k3_loss(logp, logp.detach(), lopd.token_logp(teacher.logits, b.ids, b.amask), b.amask)
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

