"""Tests for lopd.py: every loss against a slow, obviously-correct reference (a per-prefix
loop with plain sums), hand-computed examples, and the gradient / mask plumbing.

The central one is test_distill_loss_matches_per_prefix_loop: distill_loss computed from
ONE forward pass per role (M.logits_on over left-padded teacher contexts and right-
padded bodies) equals feeding every prefix separately to the model."""
import math
import os
import random
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import envs  # noqa: E402
import lopd  # noqa: E402
import model as M  # noqa: E402
import tokenizer  # noqa: E402

torch.set_num_threads(1)  # tiny matmuls: threads only add contention on a shared 2-core box
LN2 = math.log(2)


def as_logits(p):
    """Probabilities (…, V) -> logits (1, 1, V) whose softmax is exactly p."""
    return torch.tensor(p, dtype=torch.float64).log().view(1, 1, -1)


def tiny(seed, vocab):
    torch.manual_seed(seed)
    return M.tiny_llama(vocab, d_model=32, n_layer=2).double().eval()


@pytest.fixture(scope="module")
def tok():
    return tokenizer.byte_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    """Student and teacher (different weights), three right-padded bodies of different
    lengths, and teacher contexts of different lengths (text + latents, text, nothing)."""
    student, teacher = tiny(0, tok.vocab_size), tiny(1, tok.vocab_size)
    torch.manual_seed(2)
    d = 32
    bodies = [[tok.obs] + tok.encode("city of bo") + [tok.agent] + tok.encode("city(bo)") + [tok.eot],
              [tok.obs] + tok.encode("q2 ed") + [tok.agent] + tok.encode("team(ed)") + [tok.eot]
              + [tok.obs] + tok.encode("red") + [tok.agent] + tok.encode("lead(red)") + [tok.eot],
              [tok.obs] + tok.encode("x") + [tok.agent] + tok.encode("ans") + [tok.eot]]
    masks = [[0] * 12 + [1] * 9,
             [0] * 7 + [1] * 9 + [0] * 5 + [1] * 10,
             [0] * 3 + [1] * 4]
    assert [len(b) for b in bodies] == [len(m) for m in masks]
    ids, amask, attn = M.pad_batch(bodies, masks, tok.pad, "cpu")
    text = M.text_prefix(teacher, tok, ["reference solution: city(bo) -> rome\n", "hi"])
    latents = torch.randn(5, d, dtype=torch.float64)
    contexts = [torch.cat([text[0][:4], latents, text[0][4:]]),  # 38 + 5 rows: text with latents spliced in
                text[1],                                           # 4 rows
                M.embed(teacher, torch.tensor([tok.bos]))]         # 1 row: no privileged context
    assert len({c.shape[0] for c in contexts}) == 3
    return dict(student=student, teacher=teacher, bodies=bodies, masks=masks, ids=ids, amask=amask,
                attn=attn, contexts=contexts)


def last_logp(model, embeds):
    """log π(· | the whole sequence), by a plain forward of one unpadded sequence. (L, d) -> (V,)"""
    out = model(inputs_embeds=embeds.unsqueeze(0)).logits[0, -1]
    return torch.log_softmax(out, -1)


def slow_divergence(logp_s, logp_t, kind, beta=0.5):
    """The divergences written out term by term over the vocabulary with python sums."""
    p_s, p_t = logp_s.exp().tolist(), logp_t.exp().tolist()
    ls, lt = logp_s.tolist(), logp_t.tolist()
    if kind == "rkl":
        return sum(a * (x - y) for a, x, y in zip(p_s, ls, lt) if a > 0)
    if kind == "fkl":
        return sum(b * (y - x) for b, x, y in zip(p_t, ls, lt) if b > 0)
    m = [beta * b + (1 - beta) * a for a, b in zip(p_s, p_t)]
    kl_tm = sum(b * math.log(b / c) for b, c in zip(p_t, m) if b > 0)
    kl_sm = sum(a * math.log(a / c) for a, c in zip(p_s, m) if a > 0)
    return beta * kl_tm + (1 - beta) * kl_sm


@torch.no_grad()
def per_prefix_reference(b, kind, tok):
    """O(T²) reference: feed EACH prefix separately (student: [bos] + body[:t]; teacher:
    context + body[:t]) and take the divergence at its last position; mean over agent tokens."""
    S, T_ = b["student"], b["teacher"]
    vals = []
    for body, mask, ctx in zip(b["bodies"], b["masks"], b["contexts"]):
        for t, on in enumerate(mask):
            if not on:
                continue
            prefix = torch.tensor([tok.bos] + body[:t])
            logp_s = last_logp(S, M.embed(S, prefix))
            logp_t = last_logp(T_, torch.cat([ctx, M.embed(T_, torch.tensor(body[:t], dtype=torch.long))]))
            vals.append(slow_divergence(logp_s, logp_t, kind))
    return sum(vals) / len(vals)


@pytest.mark.parametrize("kind", ["rkl", "fkl", "jsd"])
def test_distill_loss_matches_per_prefix_loop(batch, tok, kind):
    b = batch
    with torch.no_grad():
        logits_s = M.logits_on(b["student"], M.bos_prefix(b["student"], tok, 3), b["ids"], b["attn"])
        logits_t = M.logits_on(b["teacher"], b["contexts"], b["ids"], b["attn"])
        assert logits_s.shape == logits_t.shape == (3, b["ids"].shape[1], tok.vocab_size)
        fast = lopd.distill_loss(logits_s, logits_t, b["amask"], kind)
    slow = per_prefix_reference(b, kind, tok)
    assert slow > 1e-3  # the two models really differ
    assert float(fast) == pytest.approx(slow, abs=1e-5, rel=1e-5)


def test_teacher_inputs_left_pads_contexts(batch):
    """Each row's trajectory starts at index P; the context sits right before it."""
    b = batch
    body = M.embed(b["teacher"], b["ids"])
    E, mask, P = lopd.teacher_inputs(b["contexts"], body, b["attn"])
    assert P == max(c.shape[0] for c in b["contexts"])
    assert torch.equal(E[:, P:], body) and torch.equal(mask[:, P:], b["attn"])
    for i, c in enumerate(b["contexts"]):
        n = c.shape[0]
        assert torch.equal(E[i, P - n:P], c)
        assert mask[i, :P].tolist() == [0] * (P - n) + [1] * n
        assert torch.all(E[i, :P - n] == 0)


# ----------------------------------------------------------------------------- hand-computed divergences

def test_divergences_by_hand_on_three_tokens():
    # student p, teacher q
    p, q = as_logits([0.5, 0.25, 0.25]), as_logits([0.25, 0.5, 0.25])
    # KL(p‖q) = 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) + 0 = 0.25 ln2 = 0.173287; symmetric pair
    assert lopd.divergence(p, q, "rkl").item() == pytest.approx(0.25 * LN2, abs=1e-6)
    assert lopd.divergence(p, q, "fkl").item() == pytest.approx(0.25 * LN2, abs=1e-6)
    # JSD(0.5): M = [0.375, 0.375, 0.25];
    # 0.5 KL(q‖M) + 0.5 KL(p‖M) = 0.5 ln(4/3) + 0.25 ln(2/3) = 0.143841 − 0.101366 = 0.042475
    jsd = 0.5 * math.log(4 / 3) + 0.25 * math.log(2 / 3)
    assert jsd == pytest.approx(0.042475, abs=1e-6)
    assert lopd.divergence(p, q, "jsd", beta=0.5).item() == pytest.approx(jsd, abs=1e-6)
    # an asymmetric pair tells reverse from forward KL: q = [1/8, 3/8, 1/2]
    q = as_logits([1 / 8, 3 / 8, 1 / 2])
    # KL(p‖q) = 0.5 ln4 + 0.25 ln(2/3) + 0.25 ln(1/2) = 0.75 ln2 + 0.25 ln(2/3) = 0.418494
    assert lopd.divergence(p, q, "rkl").item() == pytest.approx(0.75 * LN2 + 0.25 * math.log(2 / 3), abs=1e-6)
    assert lopd.divergence(p, q, "rkl").item() == pytest.approx(0.418494, abs=1e-6)
    # KL(q‖p) = 1/8 ln(1/4) + 3/8 ln(3/2) + 1/2 ln2 = 0.25 ln2 + 0.375 ln1.5 = 0.325336
    assert lopd.divergence(p, q, "fkl").item() == pytest.approx(0.25 * LN2 + 0.375 * math.log(1.5), abs=1e-6)
    assert lopd.divergence(p, q, "fkl").item() == pytest.approx(0.325336, abs=1e-6)


def test_entropy_by_hand_and_through_per_position():
    """H([1/2, 1/4, 1/4]) = 1.5 ln 2; a one-hot is 0 (0·log 0 = 0); per_position maps it over (B, T)."""
    h = lopd.per_position(lopd.entropy, torch.cat([as_logits([0.5, 0.25, 0.25]), as_logits([1.0, 0.0, 0.0])], 1))
    assert h.shape == (1, 2) and h[0, 0].item() == pytest.approx(1.5 * LN2) and h[0, 1].item() == 0.0


def test_rkl_ignores_zero_student_mass():
    # 0·log 0 = 0: p = [1/2, 1/2, 0], q uniform -> KL(p‖q) = ln(3/2) = 0.405465
    p, q = as_logits([0.5, 0.5, 0.0]), as_logits([1 / 3] * 3)
    assert lopd.divergence(p, q, "rkl").item() == pytest.approx(math.log(1.5), abs=1e-6)


def test_generalized_jsd_beta_0_1_direct_formula():
    torch.manual_seed(0)
    ls, lt = torch.randn(4, 5, 7, dtype=torch.float64), torch.randn(4, 5, 7, dtype=torch.float64) * 2
    s, t = ls.softmax(-1), lt.softmax(-1)
    beta = 0.1
    m = beta * t + (1 - beta) * s  # the mixture, directly
    want = beta * (t * (t / m).log()).sum(-1) + (1 - beta) * (s * (s / m).log()).sum(-1)
    got = lopd.divergence(ls, lt, "jsd", beta=beta)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, lopd.divergence(ls, lt, "jsd", beta=0.5))


def test_generalized_jsd_limits_are_forward_and_reverse_kl():
    """As GKD: JSD(β)/β -> KL(T‖S) as β -> 0 and JSD(β)/(1−β) -> KL(S‖T) as β -> 1, so β = 0 and
    β = 1 give those limits (the mixture formula itself would give 0 there)."""
    torch.manual_seed(0)
    ls, lt = torch.randn(4, 5, 7, dtype=torch.float64), torch.randn(4, 5, 7, dtype=torch.float64) * 2
    fkl, rkl = lopd.divergence(ls, lt, "fkl"), lopd.divergence(ls, lt, "rkl")
    assert torch.equal(lopd.divergence(ls, lt, "jsd", beta=0.0), fkl)
    assert torch.equal(lopd.divergence(ls, lt, "jsd", beta=1.0), rkl)
    eps = 1e-6
    torch.testing.assert_close(lopd.divergence(ls, lt, "jsd", beta=eps) / eps, fkl, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(lopd.divergence(ls, lt, "jsd", beta=1 - eps) / eps, rkl, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError):
        lopd.divergence(ls, lt, "jsd", beta=1.5)


@pytest.mark.parametrize("kind", ["rkl", "fkl", "jsd"])
def test_divergence_zero_when_teacher_equals_student(kind):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 11)
    assert torch.allclose(lopd.divergence(x, x.clone(), kind), torch.zeros(3, 4), atol=1e-6)
    assert torch.allclose(lopd.topk_divergence(x, x.clone(), 3, kind), torch.zeros(3, 4), atol=1e-6)
    assert lopd.distill_loss(x, x.clone(), torch.ones(3, 4), kind).abs().item() < 1e-6
    assert torch.all(lopd.divergence(x, torch.randn(3, 4, 11), kind) > 0)


@pytest.mark.parametrize("kind", ["rkl", "fkl", "jsd"])
def test_topk_with_k_equal_V_is_full_divergence(kind):
    torch.manual_seed(0)
    ls, lt = torch.randn(2, 6, 9), torch.randn(2, 6, 9)
    torch.testing.assert_close(lopd.topk_divergence(ls, lt, 9, kind), lopd.divergence(ls, lt, kind),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lopd.topk_divergence(ls, lt, 50, kind), lopd.divergence(ls, lt, kind),
                               atol=1e-5, rtol=1e-5)  # k > V is clamped to V


@pytest.mark.parametrize("kind", ["rkl", "fkl", "jsd"])
def test_topk_with_k_below_V_is_the_tail_bucket_divergence(kind):
    torch.manual_seed(0)
    ls, lt = torch.randn(3, 4, 6, dtype=torch.float64), torch.randn(3, 4, 6, dtype=torch.float64)
    k = 2
    got = lopd.topk_divergence(ls, lt, k, kind)
    for b in range(3):
        for t in range(4):
            ps, pt = ls[b, t].softmax(-1).tolist(), lt[b, t].softmax(-1).tolist()
            top = sorted(range(6), key=lambda v: -pt[v])[:k]  # the TEACHER's top-k ids
            bs = [ps[v] for v in top] + [1 - sum(ps[v] for v in top)]  # k buckets + the tail
            bt = [pt[v] for v in top] + [1 - sum(pt[v] for v in top)]
            want = slow_divergence(torch.tensor(bs).log(), torch.tensor(bt).log(), kind)
            assert got[b, t].item() == pytest.approx(want, abs=1e-5)
    # with k < V it is a different (coarser) number than the full divergence
    assert not torch.allclose(got, lopd.divergence(ls, lt, kind).to(got.dtype), atol=1e-3)


def test_distill_loss_topk_switch():
    torch.manual_seed(0)
    ls, lt, mask = torch.randn(2, 5, 8), torch.randn(2, 5, 8), (torch.rand(2, 5) > 0.3).float()
    d = lopd.topk_divergence(ls, lt, 3, "rkl")
    assert lopd.distill_loss(ls, lt, mask, "rkl", topk=3).item() == pytest.approx(
        ((d * mask).sum() / mask.sum()).item(), abs=1e-6)


def test_unknown_divergence_raises():
    with pytest.raises(ValueError):
        lopd.divergence(torch.zeros(1, 1, 3), torch.zeros(1, 1, 3), "tvd")


# ----------------------------------------------------------------------------- gradients and the mask

@pytest.mark.parametrize("kind", ["rkl", "fkl", "jsd"])
def test_distill_loss_gradients_reach_student_only(batch, tok, kind):
    b = batch
    S, T_ = tiny(0, tok.vocab_size), tiny(1, tok.vocab_size)  # fresh copies with grads on
    logits_s = M.logits_on(S, M.bos_prefix(S, tok, 3), b["ids"], b["attn"])
    logits_t = M.logits_on(T_, [c.detach() for c in b["contexts"]], b["ids"], b["attn"])
    leaf_t = logits_t.detach().requires_grad_(True)  # a teacher-logits tensor that asks for grads
    lopd.distill_loss(logits_s, leaf_t, b["amask"], kind).backward()
    assert leaf_t.grad is None or torch.all(leaf_t.grad == 0)
    grads = [p.grad for p in S.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    # through the teacher's own graph: nothing reaches the teacher's parameters either
    lopd.distill_loss(logits_s.detach().requires_grad_(True), logits_t, b["amask"], kind).backward()
    assert all(p.grad is None or torch.all(p.grad == 0) for p in T_.parameters())


def tool_episode(env):
    """A real multi-turn tool-use episode: two calls, a malformed call, the answer."""
    task = next(t for t in env.eval_tasks if t.family == "city of manager of X")
    good = env.demo(task, random.Random(0))
    ep = envs.play(env, task, good[:1] + ["lookup bo"] + good[1:])
    assert ep.done and ep.reward == 1.0 and len(ep.turns) == 4
    return ep


def test_encode_episode_mask_is_exactly_the_agent_tokens(tok):
    env = envs.make_env("tooluse-v1")
    ep = tool_episode(env)
    ids, mask = M.encode_episode(tok, ep)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    # the masked tokens, split at <|eot|>, are exactly the actions, each closed by <|eot|>
    agent = [i for i, m in zip(ids, mask) if m]
    assert agent[-1] == tok.eot and agent.count(tok.eot) == len(ep.turns)
    actions, cur = [], []
    for i in agent:
        if i == tok.eot:
            actions.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    assert actions == [a for a, _ in ep.turns]
    # every masked run is one action + <|eot|>; nothing else (prompt, observations, specials) is masked
    assert sum(mask) == sum(len(tok.encode(a)) + 1 for a, _ in ep.turns)
    for i, m in zip(ids, mask):
        if i in (tok.obs, tok.agent, tok.bos, tok.pad, tok.ctx):
            assert m == 0
    # the unmasked tokens hold the prompt and the observations
    rest = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert rest == ep.task.prompt + "".join(o for _, o in ep.turns)


@pytest.mark.parametrize("kind", ["rkl", "jsd"])
def test_distill_loss_ignores_logits_where_mask_is_zero(tok, kind):
    env = envs.make_env("tooluse-v1")
    ep, ep2 = tool_episode(env), envs.play(env, env.eval_tasks[0], ["answer bo"])
    seqs, masks = zip(*[M.encode_episode(tok, e) for e in (ep, ep2)])
    ids, amask, attn = M.pad_batch(seqs, masks, tok.pad, "cpu")
    assert (attn == 0).any()  # the second row is padded
    torch.manual_seed(0)
    ls, lt = torch.randn(2, ids.shape[1], tok.vocab_size), torch.randn(2, ids.shape[1], tok.vocab_size)
    base = lopd.distill_loss(ls, lt, amask, kind)
    off = (amask == 0).unsqueeze(-1)  # prompt, observation and padding positions
    ls2 = torch.where(off, torch.randn_like(ls) * 10, ls)
    lt2 = torch.where(off, torch.randn_like(lt) * 10, lt)
    assert lopd.distill_loss(ls2, lt2, amask, kind).item() == pytest.approx(base.item(), abs=1e-6)
    # ... and changing an agent position does change it
    on = amask.bool().nonzero()[0]
    ls2[on[0], on[1]] += torch.randn(tok.vocab_size) * 10
    assert lopd.distill_loss(ls2, lt2, amask, kind).item() != pytest.approx(base.item(), abs=1e-4)


def test_masked_mean_empty_mask_is_zero():
    assert lopd.masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


# ----------------------------------------------------------------------------- LOPD: margin, composer, dual update

def test_privileged_margin_matches_loop():
    torch.manual_seed(0)
    B, T = 4, 6
    lt, ls = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    mask = (torch.rand(B, T) > 0.4).double()
    mask[3] = 0  # a row without agent tokens contributes 0 to the mean over rows
    reward = torch.tensor([1.0, 0.0, 1.0, 0.0])
    want = 0.0
    for b in range(B):
        n = sum(mask[b].tolist())
        mean_delta = sum((lt[b, t] - ls[b, t]).item() for t in range(T) if mask[b, t]) / n if n else 0.0
        want += (2 * reward[b].item() - 1) * mean_delta
    want /= B
    assert lopd.privileged_margin(lt, ls, mask, lopd.margin_weight(reward)).item() == pytest.approx(want, abs=1e-9)


def test_privileged_margin_sign_follows_reward():
    ls = torch.full((2, 3), -2.0)
    lt = torch.full((2, 3), -1.0)  # the teacher is more likely than the student
    mask = torch.ones(2, 3)
    assert lopd.privileged_margin(lt, ls, mask, lopd.margin_weight(torch.tensor([1.0, 1.0]))).item() == pytest.approx(1.0)
    assert lopd.privileged_margin(lt, ls, mask, lopd.margin_weight(torch.tensor([0.0, 0.0]))).item() == pytest.approx(-1.0)
    assert lopd.privileged_margin(lt, ls, mask, lopd.margin_weight(torch.tensor([1.0, 0.0]))).item() == pytest.approx(0.0)
    # teacher less likely than the student: a failure gives a positive margin
    assert lopd.privileged_margin(ls, lt, mask, lopd.margin_weight(torch.tensor([0.0, 0.0]))).item() == pytest.approx(1.0)


def test_dual_update():
    assert lopd.dual_update(0.0, 0.05, 0.0, 0.5) == pytest.approx(0.025)   # Δ < m: rises
    assert lopd.dual_update(1.0, 0.05, 0.25, 0.5) == pytest.approx(0.9)    # Δ > m: falls
    assert lopd.dual_update(0.01, 0.05, 3.0, 0.5) == 0.0                   # never below 0
    assert lopd.dual_update(0.3, 0.05, torch.tensor(0.05), 0.5) == pytest.approx(0.3)  # met exactly: stays


def test_composer_loss_gradients_reach_the_composer_only(tok):
    torch.manual_seed(0)
    d, K, N, B = 32, 3, 2, 2
    frozen = M.tiny_llama(tok.vocab_size, d_model=d, n_layer=2).double().eval().requires_grad_(False)
    composer = lopd.Composer(d, K).double()
    # the frozen base reads two experiences; the composer turns each into K latents
    exp = [tok.encode("task to solve: q1 bo\nreference past trajectory: team(bo) -> red"),
           tok.encode("task to solve: q2 ed\nreference: lead(red)")]
    eids, _, eattn = M.pad_batch(exp, [[0] * len(e) for e in exp], tok.pad, "cpu")
    h = M.hidden(frozen, eids, eattn)
    z = composer(h, eattn)                                                  # (N, K, d)
    assert z.shape == (N, K, d)
    bos = M.embed(frozen, torch.tensor([tok.bos]))
    prefixes = [torch.cat([bos, z[i]]) for i in range(B)]
    bodies = [[tok.obs, 65, tok.agent, 66, 67, tok.eot], [tok.obs, 68, tok.agent, 69, tok.eot]]
    masks = [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    ids, amask, attn = M.pad_batch(bodies, masks, tok.pad, "cpu")
    logits_t = M.logits_on(frozen, prefixes, ids, attn)
    logits_s = torch.randn(B, ids.shape[1], tok.vocab_size, dtype=torch.float64, requires_grad=True)
    z0 = (z + 0.1 * torch.randn_like(z)).detach()
    reward = torch.tensor([1.0, 0.0])
    beta, margin, lam = 0.7, 0.05, 0.2
    loss, delta, anchor = lopd.composer_loss(logits_s, logits_t, ids, amask, reward, beta, margin, lam, z, z0)
    # the value, rollout by rollout as the authors' code sums it: each rollout's KL and A·δ are means over
    # its own agent tokens, the loss is their mean over rollouts, and the Δ for β is weighted by tokens
    kl_tok = lopd.divergence(logits_s, logits_t, "rkl")
    d_tok = lopd.token_logp(logits_t, ids) - lopd.token_logp(logits_s, ids)
    per_loss, d_sum, n_sum = [], 0.0, 0
    for i in range(B):
        agent = [t for t in range(ids.shape[1]) if amask[i, t]]
        kl_i = sum(kl_tok[i, t] for t in agent) / len(agent)
        delta_i = (2 * reward[i] - 1) * sum(d_tok[i, t] for t in agent) / len(agent)
        per_loss.append(kl_i + beta * (margin - delta_i))
        d_sum, n_sum = d_sum + delta_i * len(agent), n_sum + len(agent)
    want_anchor = ((z - z0) ** 2).mean()
    assert delta.item() == pytest.approx((d_sum / n_sum).item(), abs=1e-9)
    assert anchor.item() == pytest.approx(want_anchor.item(), abs=1e-9)
    assert loss.item() == pytest.approx((sum(per_loss) / B + lam * want_anchor).item(), abs=1e-9)
    assert not delta.requires_grad and not anchor.requires_grad
    loss.backward()
    assert all(p.grad is not None for p in composer.parameters())
    assert all(p.grad.abs().sum() > 0 for p in composer.parameters() if p.dim() > 1)  # every matrix of φ learns
    assert logits_s.grad is None                       # the student is detached
    assert all(p.grad is None for p in frozen.parameters())  # the frozen base gets nothing
    # the anchor is 0 when z == z0
    _, _, anchor0 = lopd.composer_loss(logits_s, logits_t, ids, amask, reward, beta, margin, lam, z, z.detach())
    assert anchor0.item() == 0.0


def test_composer_loss_without_latents_is_finite():
    torch.manual_seed(0)
    logits_s, logits_t = torch.randn(2, 4, 7), torch.randn(2, 4, 7)
    y, mask, reward = torch.randint(0, 7, (2, 4)), torch.ones(2, 4), torch.tensor([1.0, 0.0])
    z = torch.zeros(0, 32)
    loss, delta, anchor = lopd.composer_loss(logits_s, logits_t, y, mask, reward, 0.5, 0.05, 0.2, z, z)
    assert torch.isfinite(loss) and anchor.item() == 0.0


def test_segment_pool_docstring_example():
    # 6 real tokens, K = 3 -> segments {0,1} {2,3} {4,5}; 2 padding tokens ignored
    h = torch.arange(8, dtype=torch.float64).view(1, 8, 1)          # h_t = t
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    out = lopd.segment_pool(h, mask, 3)
    assert out.shape == (1, 3, 1)
    assert out.flatten().tolist() == [0.5, 2.5, 4.5]


def test_segment_pool_matches_loop():
    torch.manual_seed(0)
    N, L, d, K = 5, 11, 4, 3
    h = torch.randn(N, L, d, dtype=torch.float64)
    lengths = [11, 7, 3, 2, 6]  # 2 < K: one segment is left empty
    mask = torch.tensor([[1] * n + [0] * (L - n) for n in lengths])
    got = lopd.segment_pool(h, mask, K)
    for i, n in enumerate(lengths):
        for k in range(K):
            members = [j for j in range(n) if j * K // n == k]  # contiguous, near-equal segments
            want = sum(h[i, j] for j in members) / len(members) if members else torch.zeros(d, dtype=h.dtype)
            torch.testing.assert_close(got[i, k], want)
    # padding is ignored: garbage in the padded positions changes nothing
    h2 = torch.where(mask.unsqueeze(-1).bool(), h, torch.randn_like(h) * 100)
    torch.testing.assert_close(lopd.segment_pool(h2, mask, K), got)


def test_qformer_matches_a_loop_and_a_sharp_query_copies_one_token():
    """z_k = Σ_l softmax_l(q_k · key(h_l) / √d) e_l + MLP(Σ_l a_kl h_l), over the experience's tokens only."""
    torch.manual_seed(0)
    N, L, d, K = 3, 9, 8, 2
    c = lopd.QFormer(d, K).double()
    h, e = torch.randn(N, L, d, dtype=torch.float64), torch.randn(N, L, d, dtype=torch.float64)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0], [1] * 9, [0, 1, 0, 0, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        c.mlp[-1].weight.normal_()  # the MLP starts at zero; check its part too
    z = c.from_reading(c.read(h, e, mask))
    for i in range(N):
        idx = [j for j in range(L) if mask[i, j]]
        for k in range(K):
            a = torch.softmax(torch.stack([c.q[k] @ c.key(h[i, j]) for j in idx]) / d ** 0.5, 0)
            want = sum(w * e[i, j] for w, j in zip(a, idx)) + c.mlp(sum(w * h[i, j] for w, j in zip(a, idx)))
            torch.testing.assert_close(z[i, k], want)
    # a query that attends to one position hands the teacher that token's own embedding
    with torch.no_grad():
        c.mlp[-1].weight.zero_()
        c.q.copy_(torch.zeros(K, d, dtype=torch.float64))
        c.q[0] = 1e4 * c.key(h[1, 5]) / c.key(h[1, 5]).norm()
    z = c.from_reading(c.read(h, e, mask))
    torch.testing.assert_close(z[1, 0], e[1, 5])
    torch.testing.assert_close(z[1, 1], e[1].mean(0))                    # a flat query: the mean of the tokens


def test_qformer_copy_starts_as_the_experiences_own_embeddings_and_learns_its_position_bias():
    """--composer qformer-copy: query k starts on the experience's k-th token, so z_k = e_k (the text
    the teacher would read); the bias is a parameter the cold start trains."""
    torch.manual_seed(0)
    N, L, d, K = 2, 9, 8, 4
    c = lopd.COMPOSERS["qformer-copy"](d, K).double()
    h, e = torch.randn(N, L, d, dtype=torch.float64), torch.randn(N, L, d, dtype=torch.float64)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0], [1] * 9])
    z = c.from_reading(c.read(h, e, mask))
    torch.testing.assert_close(z[0], e[0, 2:6], atol=5e-3, rtol=0)        # the first K of its tokens, in order
    torch.testing.assert_close(z[1], e[1, :4], atol=5e-3, rtol=0)
    z.sum().backward()
    assert c.pos.grad is not None and c.pos.grad.abs().sum() > 0
    assert lopd.COMPOSERS["qformer"](d, K).pos is None                    # the plain Q-Former has no such bias


# ----------------------------------------------------------------------------- latents via inputs_embeds

def test_bos_prefix_equals_plain_model_and_latents_change_logits(tok):
    m = tiny(3, tok.vocab_size)
    bodies = [[tok.obs] + tok.encode("city of bo") + [tok.agent] + tok.encode("city(bo)"),
              [tok.obs] + tok.encode("q1 ed") + [tok.agent]]
    ids, _, attn = M.pad_batch(bodies, [[0] * len(b) for b in bodies], tok.pad, "cpu")
    with torch.no_grad():
        fast = M.logits_on(m, M.bos_prefix(m, tok, 2), ids, attn)    # (B, T, V)
        for i, b in enumerate(bodies):
            plain = m(input_ids=torch.tensor([[tok.bos] + b])).logits[0, :len(b)]  # no latents, K = 0
            torch.testing.assert_close(fast[i, :len(b)], plain, atol=1e-9, rtol=1e-9)
        # K latents after <|bos|> change the distribution of every body token
        torch.manual_seed(0)
        bos = M.embed(m, torch.tensor([tok.bos]))
        pref = [torch.cat([bos, torch.randn(4, 32, dtype=torch.float64)]) for _ in bodies]
        lat = M.logits_on(m, pref, ids, attn)
    assert lat.shape == fast.shape
    for i, b in enumerate(bodies):
        assert (lat[i, :len(b)] - fast[i, :len(b)]).abs().amax(-1).min() > 1e-4


# ----------------------------------------------------------------------------- GRPO

def test_group_advantage_docstring_example():
    adv = lopd.group_advantage(torch.tensor([1.0, 0, 0, 0]), 4)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-3, rtol=0)
    # two groups, each normalised on its own; a group of equal rewards gets 0
    adv = lopd.group_advantage(torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1]), 4)
    assert adv[:4].tolist() == [0.0] * 4
    s = math.sqrt(1 / 3)  # unbiased std of [0, 1, 0, 1]
    torch.testing.assert_close(adv[4:], torch.tensor([-0.5, 0.5, -0.5, 0.5]) / s, atol=1e-3, rtol=0)
    assert lopd.group_advantage(torch.zeros(4), 4).tolist() == [0.0] * 4


def test_ppo_clip_loss_matches_loop():
    # ratios inside and outside [1 − ε, 1 + ε], for positive and negative advantages
    ratio = torch.tensor([[0.5, 0.9, 1.0, 1.1, 1.5, 3.0]] * 2, dtype=torch.float64)
    logp_old = torch.log(torch.tensor([[0.3] * 6] * 2, dtype=torch.float64))
    logp = (logp_old + ratio.log()).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1]], dtype=torch.float64)
    loss = lopd.ppo_clip_loss(logp, logp_old, adv, mask)
    tot, n = 0.0, 0
    for b in range(2):
        for t in range(6):
            if mask[b, t]:
                r, A = ratio[b, t].item(), adv[b].item()
                tot += min(r * A, min(max(r, 0.8), 1.2) * A)
                n += 1
    assert loss.item() == pytest.approx(-tot / n, abs=1e-9)
    # by hand: A = 2, ratio 1.5 is clipped to 1.2 (2.4); ratio 0.5 keeps 1.0 (the min is unclipped)
    # A = −1, ratio 1.5 keeps −1.5; ratio 0.5 is clipped to 0.8 (−0.8)
    loss.backward()
    g = logp.grad
    # the clip binds (zero gradient) where it helps the objective: A > 0 and ratio > 1.2, A < 0 and ratio < 0.8
    assert g[0, 4] == 0 and g[1, 0] == 0
    assert g[0, 0] != 0 and g[1, 4] != 0 and g[0, 5] == 0  # masked position: no gradient
    # at ratio 1 (one PPO epoch, as train.py does) the gradient is −A·mask/|A|
    logp = logp_old.clone().requires_grad_(True)
    lopd.ppo_clip_loss(logp, logp_old, adv, mask).backward()
    torch.testing.assert_close(logp.grad, -adv.unsqueeze(-1) * mask / mask.sum())


def test_ppo_clip_asymmetric_eps():
    logp_old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.25, 1.5]]))
    loss = lopd.ppo_clip_loss(logp, logp_old, torch.tensor([1.0]), torch.ones(1, 2), eps_lo=0.2, eps_hi=0.28)
    assert loss.item() == pytest.approx(-(1.25 + 1.28) / 2, abs=1e-6)


def test_token_logp():
    logits = torch.randn(2, 3, 5)
    y = torch.tensor([[0, 4, 2], [1, 1, 3]])
    want = torch.stack([torch.stack([F.log_softmax(logits[b, t], -1)[y[b, t]] for t in range(3)]) for b in range(2)])
    torch.testing.assert_close(lopd.token_logp(logits, y), want)


def test_relative_anchor_by_hand():
    """relative: mean (z − z0)² / mean z0², so scaling both latents leaves it unchanged."""
    logits = torch.zeros(1, 2, 5)
    y, mask, reward = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.tensor([1.0])
    z0 = torch.tensor([[1.0, -1.0], [2.0, 0.0]])        # mean z0² = (1 + 1 + 4 + 0) / 4 = 1.5
    z = torch.tensor([[1.0, 0.0], [2.0, 1.0]])          # mean (z − z0)² = (0 + 1 + 0 + 1) / 4 = 0.5
    for scale in (1.0, 0.01):
        _, _, rel = lopd.composer_loss(logits, logits, y, mask, reward, 0.0, 0.05, 0.2, scale * z, scale * z0, relative=True)
        assert rel.item() == pytest.approx(0.5 / 1.5, rel=1e-6)
    _, _, absolute = lopd.composer_loss(logits, logits, y, mask, reward, 0.0, 0.05, 0.2, 0.01 * z, 0.01 * z0)
    assert absolute.item() == pytest.approx(0.5e-4, rel=1e-6)


def test_ppo_clip_loss_with_per_token_advantages_matches_loop():
    """(B, T) advantages (VASPO's critic): each token's own A in the clipped objective; A gets no gradient."""
    torch.manual_seed(3)
    logp_old = torch.log(torch.rand(2, 5, dtype=torch.float64))
    logp = (logp_old + torch.randn(2, 5, dtype=torch.float64) * 0.4).requires_grad_(True)
    adv = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float64)
    loss = lopd.ppo_clip_loss(logp, logp_old, adv, mask, eps_lo=0.2, eps_hi=0.28)
    tot, n = 0.0, 0
    for b in range(2):
        for t in range(5):
            if mask[b, t]:
                r, A = math.exp(logp[b, t].item() - logp_old[b, t].item()), adv[b, t].item()
                tot += min(r * A, min(max(r, 0.8), 1.28) * A)
                n += 1
    assert loss.item() == pytest.approx(-tot / n, abs=1e-9)
    loss.backward()
    assert adv.grad is None and logp.grad is not None
