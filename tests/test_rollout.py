"""Plumbing with a tiny model: train.rollout / M.generate (KV cache, left padding,
teacher prefixes) and the agent-token masks they return.

A d=32 Llama is fitted for a few seconds on scripted-expert demos so that its rollouts
are a realistic mix: well-formed calls closed by <|eot|>, malformed ones, and turns cut
at max_action_tokens."""
import copy
import os
import random
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import envs  # noqa: E402
import lopd  # noqa: E402
import model as M  # noqa: E402
import tokenizer  # noqa: E402
import train  # noqa: E402
from plumbing import parallel  # noqa: E402

torch.set_num_threads(1)  # tiny matmuls: threads only add contention on a shared 2-core box


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    tok, env = tokenizer.byte_tokenizer(), envs.make_env("tooluse")
    m = M.tiny_llama(tok.vocab_size, d_model=32, n_layer=2)
    rng = random.Random(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(100):  # ~4 s: enough to emit <|eot|> and mostly well-formed calls
        demos = [envs.play(env, t, env.demo(t, rng)) for t in rng.sample(env.train_tasks, 32)]
        seqs, masks = zip(*[M.encode_episode(tok, e) for e in demos])
        ids, amask, attn = M.pad_batch(seqs, masks, tok.pad, "cpu")
        logits = M.logits_on(m, M.bos_prefix(m, tok, len(seqs)), ids, attn)
        loss = lopd.masked_mean(-lopd.token_logp(logits, ids), amask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval().requires_grad_(False)
    return tok, env, m


def runs(ids, mask):
    """Split a body into maximal runs of equal mask value -> [(mask value, ids)]."""
    out = []
    for i, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(i)
        else:
            out.append((m, [i]))
    return out


def check_episode(tok, env, ep, body, mask):
    """The body is prompt, then per turn: the generated tokens (mask 1), <|eot|> if the turn was cut
    at max_action_tokens (mask 0: nobody sampled it), and, unless the episode ended, the observation
    (mask 0). Nothing else is masked in or out."""
    assert len(body) == len(mask) and ep.done and 1 <= len(ep.turns) <= env.max_turns
    parts = runs(body, mask)
    assert parts[0] == (0, M.obs_ids(tok, ep.task.prompt))
    agent = [p for m, p in parts if m == 1]
    after = [p for m, p in parts[1:] if m == 0]  # what follows each turn, unmasked
    assert len(agent) == len(ep.turns)  # one generated run per turn
    for k, (gen, (action, o)) in enumerate(zip(agent, ep.turns)):
        assert 1 <= len(gen) <= env.max_action_tokens
        assert tok.eot not in gen[:-1]  # generation stops at the first <|eot|>
        text = tok.decode([t for t in gen if t != tok.eot])
        assert text.strip()[:2 * envs.MAX_ACTION_CHARS] == action  # what the env saw
        nxt = after[k] if k < len(after) else []
        if gen[-1] != tok.eot:  # cut: closed as a turn is closed, outside the mask
            assert len(gen) == env.max_action_tokens and nxt[:1] == [tok.eot]
            nxt = nxt[1:]
        if k < len(ep.turns) - 1:
            assert nxt == M.obs_ids(tok, o) and o  # the env's observation, unmasked
        else:
            assert nxt == []  # no observation after the last turn
    assert len(after) <= len(ep.turns)


@pytest.mark.parametrize("greedy", [True, False])
def test_rollout_masks_are_exactly_the_generated_tokens(setup, monkeypatch, greedy):
    tok, env, m = setup
    real = M.generate

    def spy(*a, **kw):  # record what generate returned, call by call
        spy.calls.append(real(*a, **kw))
        return spy.calls[-1]
    spy.calls = []
    monkeypatch.setattr(M, "generate", spy)
    torch.manual_seed(0)
    tasks = env.eval_tasks[:30]
    eps, bodies, masks = train.rollout(m, tok, env, tasks, greedy=greedy)
    assert len(eps) == len(bodies) == len(masks) == len(tasks) and len(spy.calls) <= env.max_turns
    # every token generated, and only those, carries mask 1: replay the calls row by row;
    # call k decodes turn k of every episode that was still live
    gen = [[] for _ in tasks]
    for call, outs in enumerate(spy.calls):
        live = [i for i, e in enumerate(eps) if len(e.turns) > call]
        assert len(outs) == len(live)
        for i, o in zip(live, outs):
            gen[i] += o
    for i, (ep, body, mask) in enumerate(zip(eps, bodies, masks)):
        assert [t for t, a in zip(body, mask) if a] == gen[i]
        check_episode(tok, env, ep, body, mask)
    # for episodes whose every turn ended with <|eot|> (and whose text round-trips), the
    # rollout's tokens are exactly the episode's canonical encoding (what warm-up trains on)
    same = 0
    for ep, body, mask in zip(eps, bodies, masks):
        agent = [p for a, p in runs(body, mask) if a == 1]
        if all(p[-1] == tok.eot and tok.encode(tok.decode(p[:-1])) == p[:-1] and tok.decode(p[:-1]).strip()
               == tok.decode(p[:-1]) for p in agent):
            assert M.encode_episode(tok, ep) == (body, mask)
            same += 1
    assert same >= 5  # the fitted model does close its turns


def test_rollout_padding_invariance(setup):
    """A task's greedy actions do not depend on the other rows of its batch (left padding,
    position ids from the mask, a KV cache that grows per row)."""
    tok, env, m = setup
    m = copy.deepcopy(m).double()  # no argmax near-ties from float32 round-off
    by_len = sorted(env.eval_tasks[:60], key=lambda t: len(t.prompt))
    target = by_len[30]
    alone = train.rollout(m, tok, env, [target], greedy=True)
    batch = [by_len[0], by_len[-1], target, by_len[1], by_len[-2]]  # shorter and longer rows
    mixed = train.rollout(m, tok, env, batch, greedy=True)
    assert mixed[0][2].turns == alone[0][0].turns
    assert mixed[1][2] == alone[1][0] and mixed[2][2] == alone[2][0]
    # and the whole batch agrees with each task played alone, and with its rows decoded 2 at a time (--decode_rows)
    for i, t in enumerate(batch):
        assert train.rollout(m, tok, env, [t], greedy=True)[0][0].turns == mixed[0][i].turns
    assert [e.turns for e in train.rollout(m, tok, env, batch, greedy=True, rows=2)[0]] == [e.turns for e in mixed[0]]


def test_decode_rows_on_cuda_fills_the_free_memory_and_elsewhere_keeps_each_phases_rows(setup, monkeypatch):
    """--decode_rows -1: on a CPU the phase's own rows (no sampled number changes); on CUDA as many rows as a KV-cache
    estimate fits in half the free memory; a number given is that number."""
    tok, env, m = setup
    run = types.SimpleNamespace(args=train.parse_args([]), device=torch.device("cpu"), model=m)
    assert run.args.decode_rows == -1 and parallel.decode_rows(run, 4) == 4 and parallel.decode_rows(run, 0) == 0
    run.device = torch.device("cuda", 0)
    c = m.config
    kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2
    per_row = kv_token * parallel.DECODE_TOKENS + 4 * c.vocab_size
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * 64 * per_row, 10 ** 12))
    assert parallel.decode_rows(run, 4) == 64
    run.args = train.parse_args(["--decode_rows", "16"])
    assert parallel.decode_rows(run, 4) == 16


def naive_greedy(model, prefix, body, max_new, eot):
    """Reference decoder: re-run the whole unpadded sequence for every token, no cache."""
    seq = torch.cat([prefix, M.embed(model, torch.tensor(body, dtype=torch.long))])
    out = []
    for _ in range(max_new):
        nxt = int(model(inputs_embeds=seq.unsqueeze(0)).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eot:
            break
        seq = torch.cat([seq, M.embed(model, torch.tensor([nxt]))])
    return out


@torch.no_grad()
def test_generate_with_teacher_prefixes_matches_naive_decoding(setup):
    tok, env, m = setup
    m = copy.deepcopy(m).double()
    tasks = env.eval_tasks[:4]
    texts = [f"reference solution: {t.solution}\n" for t in tasks[:3]] + [""]
    prefixes = M.text_prefix(m, tok, texts)                       # <|bos|><|ctx|> text, lengths differ
    bodies = [M.obs_ids(tok, t.prompt) for t in tasks]
    bodies[1] = bodies[1] + tok.encode("city(bo)") + [tok.eot] + M.obs_ids(tok, "rome")  # a later turn
    assert len({p.shape[0] + len(b) for p, b in zip(prefixes, bodies)}) == 4
    outs = M.generate(m, tok, prefixes, bodies, env.max_action_tokens, greedy=True)
    for p, b, o in zip(prefixes, bodies, outs):
        assert o == naive_greedy(m, p, b, env.max_action_tokens, tok.eot)
    # the context matters: without it the same bodies decode differently somewhere
    plain = M.generate(m, tok, M.bos_prefix(m, tok, 4), bodies, env.max_action_tokens, greedy=True)
    for b, o in zip(bodies, plain):
        assert o == naive_greedy(m, M.embed(m, torch.tensor([tok.bos])), b, env.max_action_tokens, tok.eot)
    assert plain != outs


@pytest.mark.parametrize("fitted,greedy", [(True, True), (True, False), (False, False)])
def test_the_kv_cache_across_turns_reads_as_the_whole_conversation_again(setup, monkeypatch, greedy, fitted):
    """rollout keeps one KV cache per episode batch (a turn reads only its observation): the
    episodes, bodies and masks are those of re-reading the whole conversation every turn, with
    episodes that end early leaving the batch, cut turns, and contexts of different lengths."""
    tok, env, m = setup
    m = copy.deepcopy(m).double()  # no argmax near-ties from round-off
    if not fitted:  # short turns: sampled actions cut at max_action_tokens whatever the kernels draw
        monkeypatch.setattr(env, "max_action_tokens", 4)
    tasks = env.eval_tasks[:10]
    prefixes = M.text_prefix(m, tok, [f"reference solution: {t.solution}\n" if i % 3 else "" for i, t in enumerate(tasks)]) \
        if fitted else None
    played = {}
    for name, turns in (("cached", M.Turns), ("re-read", lambda: None)):
        monkeypatch.setattr(M, "Turns", turns)
        torch.manual_seed(3)
        eps, bodies, masks = train.rollout(m, tok, env, tasks, greedy=greedy, prefixes=prefixes)
        played[name] = ([e.turns for e in eps], bodies, masks)
    assert played["cached"] == played["re-read"]
    turns = [len(t) for t in played["cached"][0]]
    cut = sum(t == tok.eot and k == 0 for b, mk in zip(*played["cached"][1:]) for t, k in zip(b, mk))
    assert len(set(turns)) > 1 and max(turns) > 2 if fitted else cut    # episodes end at different turns; cut turns


def test_teacher_rollout_with_latent_prefixes(setup):
    """The teacher decodes whole episodes with a context that holds latent vectors (as
    train.evaluate does for LOPD); the same rows with the same prefixes reproduce."""
    tok, env, m = setup
    torch.manual_seed(0)
    bos_ctx = M.embed(m, torch.tensor([tok.bos, tok.ctx]))
    prefixes = [torch.cat([bos_ctx, torch.randn(k, 32) * 0.1]) for k in (0, 3, 8, 12)]
    tasks = env.eval_tasks[10:14]
    eps, bodies, masks = train.rollout(m, tok, env, tasks, greedy=True, prefixes=prefixes)
    for ep, b, mk in zip(eps, bodies, masks):
        check_episode(tok, env, ep, b, mk)
    again = train.rollout(m, tok, env, tasks[::-1], greedy=True, prefixes=prefixes[::-1])[0][::-1]
    assert [e.turns for e in again] == [e.turns for e in eps]


def test_sampled_rollout_follows_the_seed(setup):
    tok, env, m = setup
    tasks = env.eval_tasks[:8]
    torch.manual_seed(5)
    a = train.rollout(m, tok, env, tasks)[1]
    torch.manual_seed(5)
    b = train.rollout(m, tok, env, tasks)[1]
    assert a == b


def test_untrained_model_turns_are_cut_at_max_action_tokens(setup):
    """A random model rarely says <|eot|>: its turns stop at max_action_tokens, the env
    still ends every episode within max_turns, and the masks still hold."""
    tok, env, _ = setup
    torch.manual_seed(0)
    m = M.tiny_llama(tok.vocab_size, d_model=32, n_layer=1).eval()
    tasks = env.eval_tasks[:6]
    eps, bodies, masks = train.rollout(m, tok, env, tasks, greedy=True)
    for ep, b, mk in zip(eps, bodies, masks):
        check_episode(tok, env, ep, b, mk)
        assert len(ep.turns) == env.max_turns and ep.reward == 0.0
    assert sum(sum(mk) for mk in masks) == sum(len(ep.turns) for ep in eps) * env.max_action_tokens


def test_top_k_and_top_p_keep_what_transformers_keeps():
    """M.filtered against transformers' own TopK and TopP logits processors, by hand on a small case too."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    torch.manual_seed(0)
    x = torch.randn(6, 50)
    for k, p in ((1, 1.0), (20, 1.0), (0, 0.95), (20, 0.95), (0, 0.3)):
        ref = x.clone()
        ref = TopKLogitsWarper(k)(None, ref) if k else ref
        ref = TopPLogitsWarper(p)(None, ref) if p < 1 else ref
        assert torch.equal(torch.isinf(M.filtered(x, k, p)), torch.isinf(ref)), (k, p)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.isinf(M.filtered(probs, 0, 0.8)).tolist() == [[False, False, True, True]]   # 0.5 + 0.3 reaches 0.8
    assert torch.equal(M.filtered(x), x)


def test_sampling_from_the_top_token_only_is_greedy(setup):
    tok, env, m = setup
    tasks = env.eval_tasks[:6]
    greedy = train.rollout(m, tok, env, tasks, greedy=True)[0]
    torch.manual_seed(3)
    top1 = train.rollout(m, tok, env, tasks, temperature=0.7, top_k=1)[0]
    assert [e.turns for e in top1] == [e.turns for e in greedy]
