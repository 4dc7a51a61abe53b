"""The pieces that give the teachers something to know: the warm-up's context demos (and what
they must never show), the BPE tokenizer, LOPD's latents in the text context's slot, the
centred margin, the trainable reader and the other-family control of retrieval."""
import os
import random
import re
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import envs  # noqa: E402
from plugins import tooluse_v1  # noqa: E402
import lopd  # noqa: E402
import model as M  # noqa: E402
import tokenizer  # noqa: E402
import retrieval  # noqa: E402
import train  # noqa: E402
from plumbing import assemble  # noqa: E402
import warmup  # noqa: E402
from plumbing import registry  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def env():
    return tooluse_v1.ToolUseV1(n_train=200, n_eval=20)


@pytest.fixture(scope="module")
def tok(env):
    return tokenizer.byte_tokenizer(tokenizer.bpe_ranks(warmup.tokenizer_texts(env, n=300), 256))


def tools(traj):
    return re.findall(r"([a-z]+)\(", traj)


def test_warmup_context_demos_never_show_an_opaque_familys_true_plan(env):
    """Over many draws, in every form: no line of a context shows an opaque family's true plan
    under that family's name, and a demo that follows a context never follows it either."""
    pool, by_family = warmup.warmup_pool(env)
    rng, forms = random.Random(0), set()
    for _ in range(3000):
        task = rng.choice(pool)
        ep, ctx = warmup.warmup_demo(env, task, by_family, rng, p_ctx=1.0)
        form = ctx.split(":")[0]
        forms.add(form)
        true = tooluse_v1.FAMILIES[task.family] if task.family in tooluse_v1.OPAQUE else None
        if form == "past":
            lines = [line.strip().partition(": ") for line in ctx.removeprefix("past:").splitlines()]
            for prompt, _, traj in lines:
                fam = prompt.replace(prompt.split()[-1], "X")
                assert fam not in tooluse_v1.OPAQUE or tools(traj) != tooluse_v1.FAMILIES[fam], ctx
            followed = any(p.replace(p.split()[-1], "X") == task.family for p, _, _ in lines)
        else:  # a reference solution, a skill, feedback: about this very task, which the demo then solves
            assert true is None or tools(ctx) != true, ctx
            followed = True
        if true and followed:
            assert tools(env.trajectory_text(ep)) != true
    assert forms == {"past", "reference solution", "skill", "feedback"}
    assert warmup.warmup_demo(env, pool[0], by_family, random.Random(0), p_ctx=0.0)[1] is None


def test_warmup_past_form_holds_this_family_and_others(env):
    """'past' contexts show 1-3 experiences, at least one of this task's family; 'unhelpful' ones none."""
    pool, by_family = warmup.warmup_pool(env)
    rng, kinds = random.Random(1), set()
    for _ in range(1000):
        task = rng.choice(pool)
        ep, ctx = warmup.warmup_demo(env, task, by_family, rng, p_ctx=1.0)
        if not ctx.startswith("past:"):
            continue
        lines = [line.strip() for line in ctx.removeprefix("past:").splitlines()]
        assert 1 <= len(lines) <= 3
        same = sum(line.split(": ")[0].replace(line.split(": ")[0].split()[-1], "X") == task.family for line in lines)
        kinds.add((same > 0, len(lines) - same > 0))
    assert kinds == {(True, False), (True, True), (False, True)}


def test_bpe_encodes_as_tiktokens_slow_reference_and_round_trips(env, tok):
    from tiktoken import _educational as edu
    ranks = {tok.enc.decode_single_token_bytes(i): i for i in range(tok.n_ordinary)}
    hostile = ["quandle bo", "manager(quin) -> ted; answer ted", "lambda x: [v+2 for v in x]",
               "<|eot|> é ☃ \x00 " * 3, "  \n\t x", "".join(chr(random.Random(s).randrange(0x20, 0x3000)) for s in range(80))]
    for text in hostile:
        got = tok.encode(text)
        want = [t for piece in re.findall(tokenizer.PAT, text)
                for t in edu.bpe_encode(ranks, piece.encode(), visualise=None)]
        assert got == want
        assert tok.decode(got) == text
        assert all(t < tok.n_ordinary for t in got)  # special-token strings stay literal text
    # deterministic, and a real saving over bytes
    again = tokenizer.byte_tokenizer(tokenizer.bpe_ranks(warmup.tokenizer_texts(env, n=300), 256))
    assert again.enc._mergeable_ranks == tok.enc._mergeable_ranks
    text = retrieval.experiences_text([("city of bo", "city(bo) -> oslo; answer oslo")])
    assert len(tok.encode(text)) * 2 < len(text.encode())


def test_bpe_ranks_by_hand():
    # 'ab' is the commonest pair (4), then 'abc' (ab+c, 3) beats 'xy' (2)
    # pieces 'abc' ' abc' ' abc' ' ab' ' xy' ' xy': 'ab' is the commonest pair (4); then 'ab'+'c' and
    # ' '+'ab' tie at 3 and the larger pair wins ('ab' > ' '); then three pairs tie at 2 and 'x'+'y' wins
    ranks = tokenizer.bpe_ranks(["abc abc abc ab xy xy"], 3)
    assert [k for k, v in sorted(ranks.items(), key=lambda kv: kv[1])][256:] == [b"ab", b"abc", b"xy"]
    assert len(tokenizer.bpe_ranks(["ab"], 50)) == 257  # stops when nothing is left to merge


def lopd_run(tok, model, K=3, reader="frozen", composer="mlp"):
    run = types.SimpleNamespace(teacher=model, model=model, tok=tok, device=torch.device("cpu"), rng=random.Random(0),
                                method=registry.METHODS["lopd"],
                                args=types.SimpleNamespace(K=K, J=3, composer=composer, lr=0.0, lr_composer=1e-3, reader=reader,
                                                           bank_capacity=100, allow_same_task=False, embedder="ngram",
                                                           rerank="none", micro_batch=0))
    run.state = train.lopd_state(run)
    return run


def test_latent_frame_puts_latents_where_the_text_context_puts_each_experience(tok):
    """Slow reference: if each experience's K latents were the embeddings of its own text line,
    the latent frame would be exactly the text context of those experiences."""
    torch.manual_seed(0)
    model = M.tiny_llama(tok.vocab_size, d_model=16, n_layer=1).eval()
    exps = [retrieval.Experience("a", "city of X", "city of bo", "city(bo) -> oslo; answer oslo", 1.0),
            retrieval.Experience("b", "quandle X", "quandle ed", "team(ed) -> red; lead(red) -> cy; answer cy", 1.0)]
    run = lopd_run(tok, model)
    zs = [M.embed(model, torch.tensor(tok.encode(retrieval.experience_line(m.task, m.text)))) for m in exps]
    frame = retrieval.latent_frame(run, zs)
    text = M.text_prefix(model, tok, [retrieval.experiences_text([(m.task, m.text) for m in exps])])[0]
    assert torch.equal(frame, text)
    # and with K latents each: 4 framing tokens, then K + 1 per experience (its latents and a '\n')
    K = 3
    frame = retrieval.latent_frame(run, [torch.randn(K, 16) for _ in exps])
    head = len([tok.bos, tok.ctx] + tok.encode("past:"))
    assert frame.shape[0] == head + len(exps) * (K + 1)
    nl = M.embed(model, torch.tensor(tok.encode("\n")))[0]
    for j in range(len(exps)):
        assert torch.equal(frame[head + j * (K + 1) + K], nl)


def test_centered_margin_by_hand():
    # two rows, one agent token each: δ = [0.5, −0.25]; r = [1, 0], mean r = 0.5 -> w = [0.5, −0.5]
    lt, ls = torch.tensor([[-1.0], [-2.25]]), torch.tensor([[-1.5], [-2.0]])
    mask, r = torch.ones(2, 1), torch.tensor([1.0, 0.0])
    assert lopd.privileged_margin(lt, ls, mask, lopd.margin_weight(r, 'centered')).item() == pytest.approx((0.5 * 0.5 + 0.5 * 0.25) / 2)
    assert lopd.privileged_margin(lt, ls, mask, lopd.margin_weight(r)).item() == pytest.approx((0.5 + 0.25) / 2)  # w = 2r − 1
    # a batch of equal rewards: the centred margin is 0 whatever the teacher does
    assert lopd.privileged_margin(lt, ls, mask, lopd.margin_weight(torch.ones(2), 'centered')).item() == 0.0


def test_a_margin_on_successes_only_by_hand():
    # δ = [0.5, −0.25, 0.1]; r = [1, 0, 0.75] -> w⁺ = max(0, 2r − 1) = [1, 0, 0.5]: the failure carries no weight
    lt, ls = torch.tensor([[-1.0], [-2.25], [-1.0]]), torch.tensor([[-1.5], [-2.0], [-1.1]])
    mask, r = torch.ones(3, 1), torch.tensor([1.0, 0.0, 0.75])
    assert lopd.privileged_margin(lt, ls, mask, lopd.margin_weight(r, 'successes')).item() == pytest.approx((0.5 + 0.5 * 0.1) / 3)
    assert lopd.margin_weight(r, 'successes').tolist() == [1.0, 0.0, 0.5]


def test_the_kl_weight_scales_the_kl_term_only():
    """kl_weight 0 leaves the margin and the anchor: the loss is the paper's minus its KL term, exactly."""
    torch.manual_seed(0)
    ls, lt, y = torch.randn(3, 4, 7), torch.randn(3, 4, 7), torch.randint(0, 7, (3, 4))
    mask, r, z, z0 = torch.ones(3, 4), torch.tensor([1.0, 0.0, 0.5]), torch.randn(5, 2), torch.randn(5, 2)
    full, d1, a1 = lopd.composer_loss(ls, lt, y, mask, r, 0.7, 0.05, 0.2, z, z0)
    none, d0, a0 = lopd.composer_loss(ls, lt, y, mask, r, 0.7, 0.05, 0.2, z, z0, kl_weight=0.0)
    kl = (lopd.divergence(ls, lt, "rkl", where=mask) * mask).sum(-1).div(4).mean()
    assert full.item() - none.item() == pytest.approx(kl.item(), rel=1e-5) and d1 == d0 and a1 == a0


def test_trained_reader_gradients_reach_only_the_reader_and_the_composer(env, tok):
    torch.manual_seed(0)
    model = M.tiny_llama(tok.vocab_size, d_model=16, n_layer=1)
    teacher = assemble.frozen_copy(model)
    run = lopd_run(tok, teacher, reader="trained")
    run.model = model
    tasks = env.train_tasks[:4]
    run.state["bank"].add([retrieval.Experience(t.task_id, t.family, t.prompt, t.solution, 1.0) for t in env.train_tasks[4:40]])
    eps = [envs.play(env, t, env.demo(t, random.Random(0))) for t in tasks]
    ctx = retrieval.latents(run, eps, grad=True)
    bodies, masks = zip(*[M.encode_episode(tok, e) for e in eps])
    ids, amask, attn = M.pad_batch(bodies, masks, tok.pad, "cpu")
    logits_t = M.logits_on(teacher, registry.with_default(run, ctx), ids, attn)
    logits_s = M.logits_on(model, M.bos_prefix(model, tok, len(eps)), ids, attn)
    loss, _, _ = lopd.composer_loss(logits_s, logits_t, ids, amask, torch.tensor([1.0, 0, 1, 0]), 0.5, 0.05, 0.2,
                                    ctx.z, ctx.z0)
    loss.backward()
    s = run.state
    assert all(p.grad is not None for p in s["composer"].parameters())
    assert sum(p.grad.abs().sum() for p in s["reader"].parameters() if p.grad is not None) > 0
    for m in (teacher, model, s["composer0"], s["reader0"]):
        assert all(p.grad is None for p in m.parameters())
    assert {id(p) for g in s["opt_phi"].param_groups for p in g["params"]} == \
        {id(p) for p in retrieval.phi_params(s["composer"], s["reader"])}


def test_retrieval_can_exclude_the_querys_family():
    bank = retrieval.ExperienceBank(retrieval.hashing_embedder())
    bank.add([retrieval.Experience(f"t{i}", f, f"{f} bo", "x", 1.0) for i, f in enumerate(["quandle", "quandle", "zorbify"])])
    got = bank.retrieve(["quandle ed"], ["q"], 3, exclude_families=["quandle"])
    assert [e.family for e in got[0]] == ["zorbify"]
    assert [e.family for e in bank.retrieve(["quandle ed"], ["q"], 3)[0]][:2] == ["quandle", "quandle"]


def test_the_copy_composer_starts_as_the_text_context_and_shows_no_latent_past_an_experiences_end(env, tok):
    """--composer qformer-copy, K longer than every experience: each experience is shown one latent per
    token (a query past its end would start on no token: a mean of them all, a vector the base never
    read), so LOPD's first teacher context is Traj-text's, up to the copy's softness. The MLP composer
    shows all K."""
    torch.manual_seed(0)
    model = M.tiny_llama(tok.vocab_size, d_model=16, n_layer=1).eval()
    bank = [retrieval.Experience(t.task_id, t.family, t.prompt, t.solution, 1.0) for t in env.train_tasks[4:12]]
    eps = [env.reset(t) for t in env.train_tasks[:3]]
    run = lopd_run(tok, model, K=120, composer="qformer-copy")
    run.state["bank"].add(bank)
    ctx = retrieval.latents(run, eps, grad=False)
    assert all(len(f) == 3 for f in ctx.found) and max(len(retrieval.experience_tokens(run, m)) for m in bank) < 120
    for latent, f in zip(ctx, ctx.found):
        text = M.text_prefix(model, tok, [retrieval.bank_text(f)])[0]
        assert latent.shape == text.shape
        torch.testing.assert_close(latent, text, atol=5e-3, rtol=0)
    run = lopd_run(tok, model, K=120)
    run.state["bank"].add(bank)
    ctx = retrieval.latents(run, eps, grad=False)
    head = len([tok.bos, tok.ctx] + tok.encode("past:"))
    assert [p.shape[0] for p in ctx] == [head + 3 * (120 + 1)] * 3


@pytest.mark.parametrize("reader", ["frozen", "trained"])
def test_cold_start_reading_made_once_gives_the_latents_compose_makes(env, tok, reader):
    """The cold start reads each row's experiences once (retrieval.frozen_reading) and reuses the
    pooled reading at every step: the latents, z0 and their gradients must be what compose makes
    reading afresh; with an empty bank there is nothing to read."""
    torch.manual_seed(0)
    model = M.tiny_llama(tok.vocab_size, d_model=16, n_layer=1).eval()
    run = lopd_run(tok, model, reader=reader)
    run.state["bank"].add([retrieval.Experience(t.task_id, t.family, t.prompt, t.solution, 1.0) for t in env.train_tasks[4:12]])
    eps = [envs.play(env, t, env.demo(t, random.Random(0))) for t in env.train_tasks[:4]]
    rows = [(e, None, None) for e in eps]
    cached = retrieval.frozen_reading(run, rows)
    assert [f for f, _ in cached] == retrieval.retrieve(run, [e.task for e in eps])
    assert [r.shape[0] for _, r in cached] == [len(f) for f, _ in cached]
    fresh = retrieval.latents(run, eps, grad=True)
    reused = retrieval.latents(run, eps, grad=True, found=[f for f, _ in cached], read0=torch.cat([r for _, r in cached]))
    torch.testing.assert_close(reused.z, fresh.z)
    torch.testing.assert_close(reused.z0, fresh.z0)
    g_fresh = torch.autograd.grad(fresh.z.square().sum(), retrieval.phi_params(run.state["composer"], run.state["reader"]),
                                  allow_unused=True)
    g_reused = torch.autograd.grad(reused.z.square().sum(), retrieval.phi_params(run.state["composer"], run.state["reader"]),
                                   allow_unused=True)
    for a, b in zip(g_fresh, g_reused):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
    empty = retrieval.frozen_reading(lopd_run(tok, model), rows)  # an empty bank: nothing to read
    assert all(f == [] and r.shape == (0, 3, 16) for f, r in empty)


def test_the_merges_cache_holds_what_the_text_teaches(tmp_path, monkeypatch):
    """warmup.merges: learned once per out_dir, read back equal; a corrupt file, or one of other
    code (another bk.CODE), is learned anew, never trusted."""
    env = envs.make_env("codegen")
    args = train.Args(out_dir=str(tmp_path))
    learned = tokenizer.bpe_ranks(warmup.tokenizer_texts(env), args.bpe_merges)
    assert warmup.merges(args, env) == learned
    (path,) = tmp_path.glob("bpe-codegen-*.json")
    calls = []
    monkeypatch.setattr(warmup, "tokenizer_texts", lambda env: calls.append(1) or [])  # no text: bytes only
    assert warmup.merges(args, env) == learned and not calls                  # read back, not learned
    path.write_text(path.read_text()[:-20])                                   # cut short
    assert len(warmup.merges(args, env)) == 256 and calls == [1]              # learned anew (from no text)
    monkeypatch.setattr(warmup.bk, "CODE", "other code")
    assert len(warmup.merges(args, env)) == 256 and calls == [1, 1]
    assert len(list(tmp_path.glob("bpe-codegen-*.json"))) == 2 and not list(tmp_path.glob("*.tmp"))
