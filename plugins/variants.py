"""Four variants, added as forks: each block is what a forker's own file would hold, registered
from outside the baselines' file (train.py lists this file among the plugins it imports).

PSP (Privileged Self-Practice), SOD (Zhong et al. 2026, arXiv 2605.07725), ACSD
(activation-conditioned self-distillation), VASPO (privileged value estimation with PPO). Where a
paper's detail was not available to us, the block's comment says what we chose.
"""
import torch
from tqdm import tqdm

import lopd
import model as M
from plugins.baselines import OPSD_FLAGS, build_pool, grpo_loss, opsd_context, pool_state
from plumbing.bookkeeping import arg, die, optimizer_step
from plumbing.registry import DISTILL_FLAGS, TEACHER_FLAGS, Batch, Method, distill, register


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
                       bench={'psp': dict(knob=['--batch', '32'], cost=200, quick=True)}))


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
    mask = b.amask * teacher.keep[:, None].to(b.amask)
    d = lopd.topk_divergence(logits_s, teacher.logits.detach(), a.topk, kind, where=mask) if a.topk else \
        lopd.divergence(logits_s, teacher.logits.detach(), kind, where=mask)
    return lopd.masked_mean(sod_weights(d, mask, a.sod_tau) * d, mask)


register('sod', Method(sod_loss, context=opsd_context, teacher='frozen', divergence='rkl', group=1, lr=1e-3,
                       state=pool_state, setup=build_pool,
                       flags={**DISTILL_FLAGS, **TEACHER_FLAGS, **OPSD_FLAGS,
                              'sod_tau': arg(0.0, "SOD's temperature τ of w_k = exp(−D̄_k/τ) (0 = the batch's mean D̄_k)", lo=0,
                                             after_setup=True)},
                       bench={'sod': dict(knob=['--divergence', 'fkl'], cost=550, quick=True)}))


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
    M.logits_on(run.teacher, M.bos_prefix(run.teacher, run.tok, len(b.eps)), b.ids, b.attn, run.args.score_chunk)
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
                        bench={'acsd': dict(knob=['--steer_scale', '2'], cost=400, quick=True)}))


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
    logp, eps_t = lopd.token_logp(logits_s, b.ids, b.amask), run.args.vaspo_eps
    with torch.no_grad():
        adv = gae(critic_values(run, teacher.context, b), b.reward, b.amask, run.args.gae_lambda)
        ratio_t = torch.exp(lopd.token_logp(teacher.logits, b.ids, b.amask) - logp).clamp(1 - eps_t, 1 + eps_t)
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
                         bench={'vaspo': dict(knob=['--gae_lambda', '1'], cost=300, quick=True)}))
