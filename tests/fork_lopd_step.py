"""A forker's variant of LOPD's own step, in a file of its own: train.lopd_step copied whole, block 6 changed
(φ graded against the student after its update, θ', not θ as it sampled: no flag does this), registered with
`step=` and LOPD's state, setup and flags. Its diff against train.lopd_step is the idea alone (tests/test_fork.py).

    python train.py --plugin tests/fork_lopd_step.py --method lopd-kl-after          # a whole run, as train.py runs lopd
    python -m bench --plugin tests/fork_lopd_step.py --methods lopd-kl-after,lopd    # against LOPD, seeds 1-3, paired
    python tests/fork_lopd_step.py --compare runs/lopd-tooluse-s0                     # 32 steps of each from a checkpoint

--compare takes notebook 4's pattern: the same checkpoint loaded twice, every RNG as it was saved, N steps of lopd
and N of the variant, both students evaluated greedily on the same held-out tasks every few steps; it prints the
paired difference at the end with a 95% interval over tasks (notebook 5 plots the curves)."""
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))  # the repo, for `python tests/...`
import lopd  # noqa: E402
import model as M  # noqa: E402
import retrieval  # noqa: E402
import train  # noqa: E402
from plumbing import bookkeeping as bk  # noqa: E402
from plumbing.registry import METHODS, register  # noqa: E402
from train import sample_batch, student_logits, teacher_logits  # noqa: E402  lopd_step's own helpers, imported


def lopd_kl_after_step(run):
    """train.lopd_step, but step 6 grades φ against the student after its update: KL(sg π_θ' ‖ π_T^φ) and the margin's
    log π_θ' (the paper's: θ as it sampled), so φ chases the student it will teach next. -> the episodes it played."""
    a, s = run.args, run.state
    tasks = run.rng.sample(run.env.train_tasks, a.batch)
    train_phi = not a.freeze_composer                               # step 6 on (the ablation: off)
    # 1. rollout: the student π_θ samples one episode per task; A marks the tokens it generated
    b = sample_batch(run, tasks)                                    # b.ids, b.amask = A (B, T); b.reward (B,)
    run.lap('rollout')
    # 2. retrieve: the top-J successful past trajectories of similar tasks (never this task itself)
    found = retrieval.retrieve(run, tasks, other_family=a.retrieval == 'other')  # B lists of ≤ J
    # 3. compose: φ maps the frozen base's reading of each experience to K latents z (φ0's: z0)
    z, z0 = retrieval.compose(run, tasks, found, grad=train_phi)    # (ΣN·K, d) each
    prefixes = retrieval.latent_prefixes(run, z, found)             # B × <|bos|><|ctx|>past: z_1 \n … z_J \n
    has_z = torch.tensor([p is not None for p in prefixes], device=run.device)  # no latents: no teacher
    # 4. teacher phase: the frozen teacher π_θ0(·|z, x, y<t) scores every agent token in one forward
    with torch.no_grad():                                           # eq. (1)'s sg: step 5 needs no graph
        logits_t = teacher_logits(run, prefixes, b)                 # (B, T, V)
    run.lap('teacher')
    # 5. student phase, eq. (1): L_distill = mean_{t∈A} KL(π_θ(·|x, y<t) ‖ sg π_T(·|z, x, y<t)), a step of θ
    A, D = b.amask * has_z[:, None], a.divergence or run.method.divergence   # D: reverse KL by default
    with M.train_mode(run.model):
        logits_s = student_logits(run, b)                           # (B, T, V)
        loss_distill = lopd.distill_loss(logits_s, logits_t, A, D, a.topk)
        bk.optimizer_step(run, run.opt, loss_distill, run.model)
        for _ in range(a.epochs - 1):                               # --epochs: more steps toward one π_T
            loss = lopd.distill_loss(student_logits(run, b), logits_t, A, D, a.topk)
            bk.optimizer_step(run, run.opt, loss, run.model)
    logits_s, logs = logits_s.detach(), {}                          # π_θ before its step, for step 6
    run.lap('student')
    # 6. composer phase, eq. (3): a step of φ on KL(sg π_θ ‖ π_T^φ) + β(m − Δ) + λ‖z − sg z0‖², Δ eq. (2)
    if train_phi:
        with torch.no_grad():                                       # the fork: π_θ' = θ after its step
            s_ = student_logits(run, b)[has_z]
        t_ = teacher_logits(run, prefixes, b)[has_z]                # π_T^φ again, with φ's graph
        y, mask, w = b.ids[has_z], b.amask[has_z], lopd.margin_weight(b.reward[has_z], a.advantage)
        logp_t, logp_s = lopd.token_logp(t_, y, mask), lopd.token_logp(s_, y, mask)  # log π_T^φ, log π_θ
        kl_term = a.kl_weight * lopd.composer_kl(s_, t_, mask)      # KL(sg π_θ ‖ π_T^φ)
        margin_term = s['beta'] * (a.margin - lopd.privileged_margin(logp_t, logp_s, mask, w))  # β(m − Δ)
        dist = lopd.anchor(z, z0, relative=a.anchor == 'relative')  # ‖z − sg z0‖²
        anchor_term = a.lam * dist
        bk.optimizer_step(run, s['opt_phi'], kl_term + margin_term + anchor_term, retrieval.phi(run))
        delta = lopd.privileged_margin(logp_t.detach(), logp_s, mask, w, by_tokens=True)  # Δ, by tokens
        s['beta'] = lopd.dual_update(s['beta'], a.margin, delta, a.eta_beta)   # β ← max(0, β + η_β(m − Δ))
        logs = dict(delta=delta.item(), anchor=dist.item(), drift=lopd.drift(z, z0).item())
        run.lap('composer')
    # 7. write back: the successful rollouts join the bank
    retrieval.write_back(run, b.eps)
    entropy = lopd.mean_entropy(logits_s, b.amask).item()
    run.record(loss=loss_distill.item(), reward=b.reward.mean().item(), entropy=entropy,
               family_hit=retrieval.family_hit(run, b.eps, found), **logs)
    return b.eps


# LOPD's state, setup, context and flags; only the step is the fork's own
register('lopd-kl-after', dataclasses.replace(METHODS['lopd'], step=lopd_kl_after_step, bench={}))


def compare(checkpoint, steps=32, every=8, tasks=100, methods=('lopd', 'lopd-kl-after'), quiet=False):
    """From one checkpoint, `steps` steps of each method (every RNG as the checkpoint left it), both students played
    greedily on the first `tasks` held-out tasks at step 0 and every `every` steps -> (the runs, {method: [(step,
    per-task rewards), ...]}, (mean, lo, hi) of the second method's final reward minus the first's, paired over tasks)."""
    runs, curves = [], {}
    for name in methods:
        run = train.load_run(checkpoint)
        run.method = METHODS[name]
        curve = curves[name] = []
        for i in range(steps + 1):
            if i % every == 0 or i == steps:
                eps = train.rollout(run.model, run.tok, run.env, run.env.eval_tasks[:tasks], greedy=True)[0]
                curve.append((i, [e.reward for e in eps]))
            if i < steps:
                train.take_step(run)
        runs.append(run)
    gap = bk.paired_gap(curves[methods[1]][-1][1], curves[methods[0]][-1][1])
    if not quiet:
        print(f'{methods[1]} − {methods[0]} after {steps} steps from {os.path.basename(checkpoint.rstrip(os.sep))}, paired '
              f'on {tasks} held-out tasks: {gap[0]:+.3f} [{gap[1]:+.3f}, {gap[2]:+.3f}]')
    return runs, curves, gap


if __name__ == '__main__':
    if sys.argv[1:2] == ['--compare']:
        compare(sys.argv[2])
    else:
        train.main()
