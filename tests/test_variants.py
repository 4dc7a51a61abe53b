"""The OPSD variants added as forks of the registry (PSP, SOD, ACSD, VASPO): each one's
distinctive piece against a slow or hand-computed reference, and each one through train.py
on both environments, resumed exactly."""
import json
import os
import random
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import envs  # noqa: E402
from plugins import tooluse_v1  # noqa: E402
import lopd  # noqa: E402
import model as M  # noqa: E402
from plugins import variants  # noqa: E402
import train  # noqa: E402
from plumbing import assemble  # noqa: E402
from conftest import TINY_BASE  # noqa: E402
from plugins import baselines  # noqa: E402
from plumbing import registry  # noqa: E402

torch.set_num_threads(1)
VARIANTS = ["psp", "sod", "acsd", "vaspo"]


# ----------------------------------------------------------------------------- PSP

def test_psp_resamples_only_the_tasks_whose_rollouts_all_failed_with_their_feedback():
    """Group 0 (task a) all fail, group 1 (task b) has a success: only a's 4 rollouts are sampled
    again, with the feedback of a's first rollout in the student's context; both samplings count."""
    env = tooluse_v1.ToolUseV1(n_train=20, n_eval=4)
    a, b = env.train_tasks[:2]
    calls = []

    def rollout(model, tok, env_, tasks, greedy=False, prefixes=None):
        calls.append(([t.task_id for t in tasks], prefixes))
        wins = [prefixes is not None or (t is b and i == 6) for i, t in enumerate(tasks)]
        eps = [envs.play(env, t, env.demo(t, random.Random(0)) if w else [f"answer wrong{i}"])
               for i, (t, w) in enumerate(zip(tasks, wins))]
        return eps, [[i] for i in range(len(tasks))], [[1] for _ in tasks]

    run = types.SimpleNamespace(model="θ", tok=None, env=env, method=registry.METHODS["psp"], episodes=0, log={})
    texts = lambda model, tok, t: [("hint", x) for x in t]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(M, "text_prefix", texts)
        eps, bodies, masks = variants.psp_sample(run, [a] * 4 + [b] * 4, rollout)
    assert len(calls) == 2 and calls[0][1] is None
    assert calls[1][0] == [a.task_id] * 4
    assert calls[1][1] == [("hint", "feedback: the answer 'wrong0' is wrong\n")] * 4
    assert [e.reward for e in eps] == [1, 1, 1, 1, 0, 0, 1, 0]       # a's hinted rollouts replaced its failed group
    assert bodies == [[0], [1], [2], [3], [4], [5], [6], [7]] and run.episodes == 4 and run.log["resampled"] == [0.5]
    assert registry.METHODS["psp"].loss is baselines.grpo_loss and registry.METHODS["psp"].context is None


# ----------------------------------------------------------------------------- SOD

def test_turn_ids_number_the_runs_of_agent_tokens():
    amask = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0]])
    assert variants.turn_ids(amask).tolist() == [[0, 1, 1, 0, 0, 2, 0, 3], [1, 1, 1, 1, 0, 0, 0, 0]]


def slow_sod_weights(d, amask, tau):
    """One walk over each row: a token's turn is the count of agent runs started so far."""
    turn_of, turns = {}, {}
    for i in range(d.shape[0]):
        k, prev = 0, 0
        for t in range(d.shape[1]):
            if amask[i, t] and not prev:
                k += 1
            if amask[i, t]:
                turn_of[(i, t)] = (i, k)
                turns.setdefault((i, k), []).append(float(d[i, t]))
            prev = amask[i, t]
    means = {key: sum(v) / len(v) for key, v in turns.items()}
    tau = tau or sum(means.values()) / len(means)
    w = torch.zeros_like(d)
    for (i, t), key in turn_of.items():
        w[i, t] = torch.exp(torch.tensor(-means[key] / tau, dtype=d.dtype))
    return w


@pytest.mark.parametrize("tau", [0.0, 0.3])
def test_sod_weights_match_a_loop_over_turns(tau):
    torch.manual_seed(0)
    d = torch.rand(3, 9, dtype=torch.float64) * 2
    amask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0, 0], [1, 0, 1, 0, 1, 0, 1, 0, 1], [0, 0, 0, 1, 1, 1, 1, 1, 0]])
    torch.testing.assert_close(variants.sod_weights(d, amask, tau), slow_sod_weights(d, amask, tau))


def test_sod_weights_by_hand():
    """Two turns with mean divergences 0.1 and 0.3: τ = 0.2, weights e^{-1/2} and e^{-3/2};
    the loss keeps the low-divergence turn's tokens and attenuates the other's."""
    d = torch.tensor([[0.1, 0.1, 0.0, 0.2, 0.4]])
    amask = torch.tensor([[1, 1, 0, 1, 1]])
    w = variants.sod_weights(d, amask)
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5, 0, 1.5, 1.5]]).neg().exp() * amask)


def test_sod_weights_without_any_agent_token_are_zero():
    assert variants.sod_weights(torch.rand(2, 4), torch.zeros(2, 4)).tolist() == [[0.0] * 4] * 2


def test_sod_loss_is_the_turn_weighted_distillation_loss():
    torch.manual_seed(1)
    logits_s, logits_t = torch.randn(2, 6, 7, requires_grad=True), torch.randn(2, 6, 7)
    amask = torch.tensor([[1., 1, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0]])
    run = types.SimpleNamespace(args=types.SimpleNamespace(divergence="", topk=0, sod_tau=0.0), method=registry.METHODS["sod"])
    b = types.SimpleNamespace(amask=amask)
    teacher = registry.Teacher(logits_t, torch.tensor([True, True]), None)
    loss = variants.sod_loss(run, b, logits_s, teacher)
    d = lopd.divergence(logits_s, logits_t, "rkl")
    want = (slow_sod_weights(d.detach(), amask.long(), 0.0) * d * amask).sum() / amask.sum()
    torch.testing.assert_close(loss, want)
    g, = torch.autograd.grad(loss, logits_s)  # the weights carry no graph: the gradient of Σ w·D with w held fixed
    torch.testing.assert_close(g, torch.autograd.grad((slow_sod_weights(d.detach(), amask.long(), 0.0) * d * amask).sum()
                                                      / amask.sum(), logits_s)[0])
    assert g[0, 2].abs().sum() == 0 and g[1, 4:].abs().sum() == 0      # no gradient off the agent mask


# ----------------------------------------------------------------------------- ACSD

def acsd_run(layer, scale=1.0, rate=0.1):
    """A fake run around an untrained 2-layer tiny Llama (θ) and its frozen copy (the teacher)."""
    torch.manual_seed(0)
    model = M.tiny_llama(40, d_model=16, n_layer=2, n_head=2)
    run = types.SimpleNamespace(model=model, teacher=assemble.frozen_copy(model), device="cpu", tok=types.SimpleNamespace(bos=1, head=lambda: [1]),
                                args=types.SimpleNamespace(steer_layer=layer, steer_scale=scale, steer_rate=rate,
                                                            score_chunk=0))
    run.state = variants.acsd_state(run)
    ids = torch.randint(2, 40, (4, 7))
    amask = torch.tensor([[0, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1, 0]], dtype=torch.float)
    b = registry.Batch([None] * 4, ids, amask, torch.ones(4, 7, dtype=torch.long), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    return run, b


@pytest.mark.parametrize("layer", [0, 1, -1])
def test_acsd_steering_adds_the_vector_to_the_input_of_its_layer(layer):
    """The teacher steered at layer L equals the base with α·v added to the output of layer L − 1
    (to every input embedding for L = 0); −1 is the middle layer (1 of 2); v = 0 leaves the
    teacher as the base, and θ is never steered."""
    run, b = acsd_run(layer, scale=2.0)
    bos = M.bos_prefix(run.teacher, run.tok, 4)
    base = M.logits_on(run.model, bos, b.ids, b.attn)
    torch.testing.assert_close(M.logits_on(run.teacher, bos, b.ids, b.attn), base)
    run.state["steer"] = torch.randn(16)
    steered = M.logits_on(run.teacher, bos, b.ids, b.attn)
    if layer == 0:  # every input position shifted, <|bos|> and the padding included
        E, mask, P = lopd.teacher_inputs(bos, M.embed(run.model, b.ids), b.attn)
        want = M.forward(run.model, E + 2.0 * run.state["steer"], mask)[0][:, P - 1:P - 1 + b.ids.shape[1]]
    else:
        shift = lambda module, args, out: out + 2.0 * run.state["steer"]
        hook = run.model.model.layers[0].register_forward_hook(shift)
        want = M.logits_on(run.model, bos, b.ids, b.attn)
        hook.remove()
    torch.testing.assert_close(steered, want)
    assert not torch.allclose(steered, base)
    torch.testing.assert_close(M.logits_on(run.model, bos, b.ids, b.attn), base)   # θ: no hook


def test_acsd_steering_vector_is_the_difference_of_the_running_class_means():
    """The activations are the base's unsteered input to layer L (hidden_states[L]) averaged over each
    rollout's agent tokens, whatever v the teacher is steered by; the first batch of a class sets its
    mean, the next moves it by the rate; v = mean of successes − mean of the others."""
    run, b = acsd_run(1, rate=0.25)
    run.state["steer"] = torch.randn(16)
    h = run.model(input_ids=torch.cat([torch.ones(4, 1, dtype=torch.long), b.ids], 1),
                  output_hidden_states=True).hidden_states[1][:, 1:]
    per_rollout = torch.stack([h[i][b.amask[i] > 0].mean(0) for i in range(4)])
    torch.testing.assert_close(variants.rollout_activations(run, b), per_rollout)
    run.state["steer"] = torch.zeros(16)
    variants.update_steer(run, b)
    win, other = per_rollout[[0, 2]].mean(0), per_rollout[[1, 3]].mean(0)
    torch.testing.assert_close(run.state["steer"], win - other)
    b.reward = torch.tensor([1.0, 1.0, 1.0, 0.0])
    variants.update_steer(run, b)
    win2, other2 = 0.75 * win + 0.25 * per_rollout[:3].mean(0), 0.75 * other + 0.25 * per_rollout[3]
    torch.testing.assert_close(run.state["steer"], win2 - other2)
    assert run.state["seen"] == [5, 3]


def test_acsd_steer_layer_out_of_range_is_one_line(capsys):
    with pytest.raises(SystemExit):
        acsd_run(2)
    assert "--steer_layer must be below the model's 2 layers, got 2" in capsys.readouterr().err


# ----------------------------------------------------------------------------- VASPO, on a tiny real run

TINY = ["--batch", "8", "--eval_tasks", "8", "--teacher_eval", "8", "--eval_every", "1", *TINY_BASE]


@pytest.fixture(scope="module")
def out(tmp_path_factory, base_in):
    return base_in(tmp_path_factory.mktemp("variants"))


def tiny_run(out, name, *extra):
    args = train.parse_args([*TINY, "--method", name, "--out_dir", str(out), "--name", name, "--overwrite", *extra])
    os.makedirs(out / name, exist_ok=True)
    return train.build(args)


def batch_of(run, n=4):
    torch.manual_seed(0)
    eps, bodies, masks = train.rollout(run.model, run.tok, run.env, run.env.train_tasks[:n])
    return registry.Batch(eps, *M.pad_batch(bodies, masks, run.tok.pad, "cpu"), torch.tensor([1.0, 0.0, 1.0, 0.0][:n]))


def slow_gae(values, reward, mask, lam):
    adv = torch.zeros_like(values)
    for i in range(values.shape[0]):
        ts = [t for t in range(values.shape[1]) if mask[i, t]]
        deltas = [(values[i, ts[k + 1]] if k + 1 < len(ts) else reward[i]) - values[i, t] for k, t in enumerate(ts)]
        for k, t in enumerate(ts):
            adv[i, t] = sum(lam ** (j - k) * deltas[j] for j in range(k, len(ts)))
    return adv


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_vaspo_gae_matches_a_loop(lam):
    torch.manual_seed(2)
    values = torch.rand(3, 8, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1]])
    reward = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    adv = variants.gae(values, reward, mask, lam)
    torch.testing.assert_close(adv, slow_gae(values, reward, mask, lam))
    if lam == 1.0:  # the Monte Carlo advantage r − V_t
        torch.testing.assert_close(adv, (reward[:, None] - values) * mask)


def test_vaspo_advantages_the_bounded_teacher_ratio_and_where_gradients_go(out, monkeypatch):
    """θ's loss is PPO-clip on GAE(V_ψ) with positive advantages times clip(π_T/π_θ, 1 ± ε_T);
    it sends nothing to ψ; ψ's step is the MSE to the return and sends nothing to θ."""
    run = tiny_run(out, "vaspo", "--vaspo_eps", "0.2", "--gae_lambda", "0.9")
    with torch.no_grad():
        run.state["critic"].weight.normal_(0, 0.3)
    b = batch_of(run)
    teacher = train.teacher_phase(run, b)
    logits_s = M.logits_on(run.model, M.bos_prefix(run.model, run.tok, 4), b.ids, b.attn)
    loss = variants.vaspo_loss(run, b, logits_s, teacher)
    V = variants.critic_values(run, teacher.context, b).detach()
    adv = slow_gae(V.double(), b.reward.double(), b.amask, 0.9).float()
    logp_s, logp_t = lopd.token_logp(logits_s, b.ids).detach(), lopd.token_logp(teacher.logits, b.ids)
    ratio = torch.exp(logp_t - logp_s).clamp(0.8, 1.2)
    assert ((ratio > 0.8) & (ratio < 1.2)).any() and ((ratio == 0.8) | (ratio == 1.2)).any()  # both regimes occur
    want = -(torch.where(adv > 0, adv * ratio, adv) * b.amask).sum() / b.amask.sum()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-4)
    loss.backward()
    assert run.state["critic"].weight.grad is None and any(p.grad is not None for p in run.model.parameters())
    run.model.zero_grad(set_to_none=True)
    seen = []
    monkeypatch.setattr(variants, "optimizer_step", lambda run, opt, loss, module: seen.append((loss, module)))
    variants.vaspo_after_step(run, b, logits_s.detach(), teacher)
    (value_loss, module), = seen
    V = variants.critic_values(run, teacher.context, b)
    torch.testing.assert_close(value_loss, ((V - b.reward[:, None]) ** 2 * b.amask).sum() / b.amask.sum())
    value_loss.backward()
    assert module is run.state["critic"] and run.state["critic"].weight.grad is not None
    assert all(p.grad is None for p in run.model.parameters()) and all(p.grad is None for p in run.teacher.parameters())


# ----------------------------------------------------------------------------- each variant, both environments, resumed

@pytest.fixture(scope="module")
def codegen_out(tmp_path_factory):
    """Where the code-generation runs build their own 10-step base (conftest's is tool use's)."""
    return tmp_path_factory.mktemp("variants-codegen")


def in_process(argv):
    import contextlib
    import io
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        train.main(argv)
    return log.getvalue()


def metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("times")
    return rows


@pytest.mark.parametrize("env", ["tooluse", "codegen"])
@pytest.mark.parametrize("name", VARIANTS)
def test_variant_runs_and_resumes_exactly(out, codegen_out, env, name):
    """3 steps in one go == 1 step, then --resume to the same budget: every metric to the last digit."""
    where = out if env == "tooluse" else codegen_out
    own = ["--steer_episodes", "16"] if name == "acsd" else ["--pool_episodes", "0"] if name in ("sod", "vaspo") else []
    start = 16 if name == "acsd" else 0
    # any base will do for a resume; this one builds in seconds, and its programs run to the token limit: fewer
    # evaluation tasks, greedy only (the sampled evaluation's resume is checked on tool use)
    quick = ["--warmup_steps", "10", "--eval_tasks", "4", "--teacher_eval", "2", "--eval_samples", "0"] if env == "codegen" else []
    base = [*TINY, *quick, *own, "--method", name, "--env", env, "--out_dir", str(where), "--eval_every", "1"]
    in_process([*base, "--episodes", str(start + 24), "--name", f"{name}-{env}-whole"])
    in_process([*base, "--episodes", str(start + 8), "--name", f"{name}-{env}-cut"])
    in_process(["--resume", str(where / f"{name}-{env}-cut"), "--episodes", str(start + 24)])
    whole, resumed = metrics(where / f"{name}-{env}-whole"), metrics(where / f"{name}-{env}-cut")
    assert [m["step"] for m in whole] == [0, 1, 2, 3] or name == "psp"   # PSP's resampling spends more episodes per step
    assert resumed == whole
