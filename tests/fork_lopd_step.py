"""A forker's variant of LOPD's own step, in a file of its own: train.lopd_step copied whole, one line of
block 6 changed (the margin's weight w centred on the batch, w = r − mean r, so that successes and failures
count by how rare they are and a batch of equal rewards pushes φ nowhere), registered with `step=`.

    python tests/fork_lopd_step.py --method lopd-centred-w            # a whole run, as train.py runs lopd
    python tests/fork_lopd_step.py --compare runs/lopd-tooluse-s0     # 8 steps of each from its last checkpoint

--compare takes notebook 4's pattern: the same checkpoint loaded twice, every RNG as it was saved, N steps of
lopd and N of the variant, then both students play the same held-out tasks greedily; it prints the paired
difference with a 95% interval over tasks (tests/test_fork.py runs both)."""
import dataclasses
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))  # the repo: a fork beside train.py needs no such line
import lopd  # noqa: E402
import model as M  # noqa: E402
import retrieval  # noqa: E402
import train  # noqa: E402
from plumbing import bookkeeping as bk  # noqa: E402
from plumbing.registry import METHODS, register, with_default  # noqa: E402


def lopd_centred_w_step(run):
    """train.lopd_step, but block 6's w = r − mean r (LOPD's: --advantage, the paper's 2r − 1)."""
    a, s, tok = run.args, run.state, run.tok
    tasks = run.rng.sample(run.env.train_tasks, a.batch)
    train_phi = not a.freeze_composer
    # 1. rollout
    eps, bodies, masks = train.play(run, tasks)
    ids, A, attn = M.pad_batch(bodies, masks, tok.pad, run.device)
    r = torch.tensor([e.reward for e in eps], device=run.device)
    run.episodes += len(eps)
    run.lap('rollout')
    # 2. retrieve, 3. compose
    found = retrieval.retrieve(run, tasks, other_family=a.retrieval == 'other')
    z, z0 = retrieval.compose(run, tasks, found, grad=train_phi)
    prefixes = retrieval.latent_prefixes(run, z, found)
    has_z = torch.tensor([p is not None for p in prefixes], device=run.device)
    # 4. teacher phase
    teacher_scores = lambda: train.logits_of(run, run.teacher, with_default(run, prefixes), ids, attn)
    with torch.set_grad_enabled(train_phi and not M.is_lora(run.model)):
        logits_t = teacher_scores()
    run.lap('teacher')
    # 5. student phase, eq. (1)
    with M.train_mode(run.model):
        student_scores = lambda: train.logits_of(run, run.model, M.bos_prefix(run.model, tok, len(eps)), ids, attn)
        L_distill = lambda logits_s: lopd.distill_loss(logits_s, logits_t, A * has_z[:, None], a.divergence or 'rkl', a.topk)
        logits_s = student_scores()
        loss_distill = L_distill(logits_s)
        train.update(run, run.opt, loss_distill, run.model.parameters())
        for _ in range(a.epochs - 1):
            train.update(run, run.opt, L_distill(student_scores()), run.model.parameters())
    logits_s, logs = logits_s.detach(), {}
    run.lap('student')
    # 6. composer phase, eq. (3)
    if train_phi:
        logits_t = teacher_scores() if M.is_lora(run.model) else logits_t
        s_, t_, y, mask = logits_s[has_z], logits_t[has_z], ids[has_z], A[has_z]
        w = r[has_z] - r[has_z].mean()                                          # the fork: w centred on the batch
        logp_t, logp_s = lopd.token_logp(t_, y, mask), lopd.token_logp(s_, y, mask)
        kl_term = a.kl_weight * lopd.composer_kl(s_, t_, mask)
        margin_term = s['beta'] * (a.margin - lopd.privileged_margin(logp_t, logp_s, mask, w))
        anchor_term = a.lam * (dist := lopd.anchor(z, z0, relative=a.anchor == 'relative'))
        delta = lopd.privileged_margin(logp_t.detach(), logp_s, mask, w, by_tokens=True)
        bk.set_lr(s['opt_phi'], train.lr_phi(run))
        train.update(run, s['opt_phi'], kl_term + margin_term + anchor_term, retrieval.phi_params(s['composer'], s['reader']))
        s['beta'] = lopd.dual_update(s['beta'], a.margin, delta, a.eta_beta)
        logs = dict(delta=delta.item(), anchor=dist.item(), drift=lopd.drift(z, z0).item())
        run.lap('composer')
    # 7. write back
    retrieval.write_back(run, eps)
    run.record(loss=loss_distill.item(), reward=float(np.mean([e.reward for e in eps])),
               entropy=lopd.mean_entropy(logits_s, A).item(), family_hit=retrieval.family_hit(run, eps, found), **logs)
    run.step += 1


# LOPD's state, setup, context and flags; only the step is the fork's own
register('lopd-centred-w', dataclasses.replace(METHODS['lopd'], step=lopd_centred_w_step, bench={}))


def compare(checkpoint, steps=8, tasks=100, methods=('lopd', 'lopd-centred-w'), quiet=False):
    """From one checkpoint, `steps` steps of each method (every RNG as the checkpoint left it), then the two
    students' greedy rewards on the first `tasks` held-out tasks -> (each run, (mean, lo, hi) of the second
    method's reward minus the first's, paired over tasks)."""
    runs, rewards = [], []
    for name in methods:
        run = train.load_run(checkpoint)
        run.method = METHODS[name]
        for _ in range(steps):
            run.lap()
            run.method.step(run)
        eps = train.rollout(run.model, run.tok, run.env, run.env.eval_tasks[:tasks], greedy=True)[0]
        runs.append(run)
        rewards.append([e.reward for e in eps])
    gap = bk.paired_gap(rewards[1], rewards[0])
    if not quiet:
        print(f'{methods[1]} − {methods[0]} after {steps} steps from {os.path.basename(checkpoint.rstrip(os.sep))}, paired on {tasks} held-out tasks: '
              f'{gap[0]:+.3f} [{gap[1]:+.3f}, {gap[2]:+.3f}]')
    return runs, gap


if __name__ == '__main__':
    if sys.argv[1:2] == ['--compare']:
        compare(sys.argv[2])
    else:
        train.main()
