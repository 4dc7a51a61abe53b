"""train.lopd_step is LOPD's Algorithm 1 and nothing else: its seven blocks, called one by one as
notebook 4 calls them, give the same θ, φ, β and bank as the function, from the same checkpoint."""
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import lopd  # noqa: E402
import model as M  # noqa: E402
import retrieval  # noqa: E402
import train  # noqa: E402
from conftest import NEEDS_CPU_BF16, TINY_BASE  # noqa: E402
from plumbing import bookkeeping as bk  # noqa: E402
from plumbing import parallel  # noqa: E402
from plumbing.registry import with_default  # noqa: E402

torch.set_num_threads(1)
ARGS = ["--method", "lopd", "--batch", "8", "--eval_tasks", "8", "--teacher_eval", "8", "--init_episodes", "32",
        "--cold_start_steps", "2", "--lr_composer", "1e-3", *TINY_BASE]


def by_hand(run):
    """LOPD's step, block by block, as notebook 4 writes it (no timers, no logs)."""
    a, s, tok = run.args, run.state, run.tok
    tasks = run.rng.sample(run.env.train_tasks, a.batch)
    # 1. rollout
    eps, bodies, masks = parallel.shared(run, lambda ts: train.rollout(run.model, tok, run.env, ts, temperature=a.temperature), tasks)
    ids, amask, attn = M.pad_batch(bodies, masks, tok.pad, run.device)
    reward = torch.tensor([e.reward for e in eps])
    run.episodes += len(eps)
    # 2. retrieve
    found = retrieval.retrieve(run, tasks)
    # 3. compose
    z, z0 = retrieval.compose(run, tasks, found, grad=True)
    prefixes = retrieval.latent_prefixes(run, z, found)
    keep = torch.tensor([p is not None for p in prefixes])
    # 4. teacher phase
    logits_t = M.logits_on(run.teacher, with_default(run, prefixes), ids, attn)
    # 5. student phase, eq. (1)
    logits_s = M.logits_on(run.model, M.bos_prefix(run.model, tok, len(eps)), ids, attn)
    loss_distill = lopd.distill_loss(logits_s, logits_t, amask * keep[:, None], "rkl")
    logits_s = logits_s.detach()
    bk.optimizer_step(run, run.opt, loss_distill, run.model)
    # 6. composer phase, eq. (3) with the margin (2), then the dual step on β
    loss_phi, delta, anchor = lopd.composer_loss(logits_s[keep], logits_t[keep], ids[keep], amask[keep], reward[keep],
                                                 s["beta"], a.margin, a.lam, z, z0)
    bk.optimizer_step(run, s["opt_phi"], loss_phi, retrieval.phi_params(s["composer"], s["reader"]))
    s["beta"] = lopd.dual_update(s["beta"], a.margin, delta, a.eta_beta)
    # 7. write back
    retrieval.write_back(run, eps)
    run.step += 1
    return delta


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, base_in):
    """A LOPD run after its setup, as train.build leaves it (its first checkpoint)."""
    out = base_in(tmp_path_factory.mktemp("runs"))
    os.makedirs(out / "step")
    train.build(train.parse_args([*ARGS, "--out_dir", str(out), "--name", "step"]))
    return str(out / "step")


def state(run):
    return {"theta": {k: v.clone() for k, v in M.trainable_state(run.model).items()},
            "phi": {k: v.clone() for k, v in run.state["composer"].state_dict().items()},
            "beta": run.state["beta"], "bank": [e.task_id for e in run.state["bank"].exps], "episodes": run.episodes}


def test_the_blocks_one_by_one_are_the_step(checkpoint):
    before = state(train.load_run(checkpoint))
    run = train.load_run(checkpoint)
    for _ in range(2):
        train.take_step(run)                                                    # lopd_step, counted by the loop
    fn = state(run)
    run = train.load_run(checkpoint)  # the same checkpoint, every RNG as it was
    deltas = [by_hand(run) for _ in range(2)]
    hand = state(run)
    assert fn["beta"] == hand["beta"] and fn["bank"] == hand["bank"] and fn["episodes"] == hand["episodes"]
    assert all(torch.equal(fn["theta"][k], hand["theta"][k]) for k in fn["theta"])
    assert all(torch.equal(fn["phi"][k], hand["phi"][k]) for k in fn["phi"])
    # and the step did something: θ and φ moved, β moved with Δ, the bank grew
    assert any(not torch.equal(fn["theta"][k], before["theta"][k]) for k in fn["theta"])
    assert any(not torch.equal(fn["phi"][k], before["phi"][k]) for k in fn["phi"])
    want_beta = before["beta"]
    for d in deltas:
        want_beta = max(0.0, want_beta + run.args.eta_beta * (run.args.margin - float(d)))
    assert fn["beta"] == pytest.approx(want_beta) and np.isfinite(fn["beta"])


@NEEDS_CPU_BF16
def test_one_phi_step_at_the_papers_lr_moves_the_latents_under_bf16(checkpoint):
    """φ runs in float32 outside autocast: under bf16 autocast (a CUDA run's default; CPU runs it too), one
    composer-phase step at lr_φ 1e-5 changes the latents the teacher reads, not only the anchor's target."""
    run = train.load_run(checkpoint)
    s, tasks = run.state, run.env.train_tasks[:8]
    found = retrieval.retrieve(run, tasks)
    assert any(found)
    for g in s["opt_phi"].param_groups:
        g["lr"] = 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z, z0 = retrieval.compose(run, tasks, found, grad=True)
        assert z.dtype == torch.float32 and z0.dtype == torch.float32
        before = [p.detach().clone() for p in retrieval.latent_prefixes(run, z, found) if p is not None]
        loss = (z * torch.randn_like(z)).sum() + ((z - z0) ** 2).mean()
        s["opt_phi"].zero_grad()
        loss.backward()
        s["opt_phi"].step()
        with torch.no_grad():
            z1, _ = retrieval.compose(run, tasks, found, grad=False)
        after = [p for p in retrieval.latent_prefixes(run, z1, found) if p is not None]
    assert (z1 != z.detach()).float().mean() > 0.5                             # most of the latents' entries moved
    assert any((a != b).any() for a, b in zip(after, before))                  # and the teacher reads them


def test_the_step_reads_in_fifty_lines_with_eq_3_as_three_terms():
    """lopd_step is the algorithm: its body (docstring aside, blank lines aside) is at most 50 lines of at most 110
    characters, with no walrus and no counter (the loop owns them), and eq. (3) is written in it as three named
    terms summed in one line, beside the margin Δ that β moves on."""
    import ast
    import inspect
    src = inspect.getsource(train.lopd_step)
    fn = ast.parse(src).body[0]
    lines = src.splitlines()[fn.body[1].lineno - 1:]
    assert len([l for l in lines if l.strip()]) <= 50
    assert max(len(line) for line in src.splitlines()) <= 110
    assert not any(isinstance(n, ast.NamedExpr) for n in ast.walk(fn))
    assert "run.step" not in src and "run.episodes" not in src and "set_lr" not in src
    assert "kl_term + margin_term + anchor_term" in src and "lopd.dual_update" in src
    assert "lopd.privileged_margin" in src and "lopd.composer_loss" not in src


def test_replay_grades_phi_on_past_successes_with_the_cold_starts_loss(checkpoint):
    """--replay R (a departure): step 6 adds the cold start's NLL of R successes drawn from those the run played,
    equal to a slow reference (the teacher's NLL of each drawn demo's agent tokens behind the latents of what it
    retrieves); its gradient reaches φ and nothing of θ; only successes are kept, at most the bank's capacity; a step
    with it moves φ otherwise than one without, from the same checkpoint, and θ the same."""
    import random
    import envs
    run = train.load_run(checkpoint)
    assert all(e.success for e in run.state["wins"])                            # the fill's successes, kept by the setup
    run.args.replay = 3
    demos = [envs.play(run.env, t, run.env.demo(t, random.Random(i))) for i, t in enumerate(run.env.train_tasks[:6])]
    fails = [envs.play(run.env, t, ["answer nobody"]) for t in run.env.train_tasks[6:9]]
    run.state["wins"] = []
    retrieval.write_back(run, demos + fails)
    assert run.state["wins"] == demos
    run.args.bank_capacity, saved = 4, run.args.bank_capacity
    retrieval.keep_wins(run, [])
    assert run.state["wins"] == demos[-4:]
    run.args.bank_capacity = saved
    rng = run.rng.getstate()
    loss = retrieval.replay_loss(run)
    run.rng.setstate(rng)
    drawn = run.rng.sample(run.state["wins"], 3)
    with torch.no_grad():
        z = retrieval.latents(run, drawn, grad=False)
        nll, n = 0.0, 0
        for e, p in zip(drawn, z):
            ids, mask = M.encode_episode(run.tok, e)
            logits = M.logits_on(run.teacher, with_default(run, [p]), torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
            logp = torch.log_softmax(logits.float(), -1)
            nll -= sum(logp[t, ids[t]].item() for t in range(len(ids)) if mask[t] and p is not None)
            n += sum(mask) if p is not None else 0
    assert n and loss.item() == pytest.approx(nll / n, rel=1e-4)
    run.model.zero_grad(set_to_none=True)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in run.state["composer"].parameters())
    assert all(p.grad is None for p in run.model.parameters())
    run.args.replay = 0
    assert retrieval.replay_loss(run) == 0.0
    after = {}
    for replay in (0, 3):
        run = train.load_run(checkpoint)
        run.args.replay = replay
        run.state["wins"] = demos
        train.take_step(run)
        after[replay] = state(run)
    assert all(torch.equal(after[0]["theta"][k], after[3]["theta"][k]) for k in after[0]["theta"])
    assert any(not torch.equal(after[0]["phi"][k], after[3]["phi"][k]) for k in after[0]["phi"])
