"""Tests for retrieval.py: cosine_topk against scikit-learn's brute-force neighbours, the
docstring's worked example, and the bank's plumbing (exclusion, FIFO, save/load)."""
import io
import os
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from sklearn.neighbors import NearestNeighbors

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from plugins.codegen import RELATION_DIM, CodeGen, parse_examples, relation_embedder, relation_tests  # noqa: E402
from retrieval import Experience, ExperienceBank, cosine_topk, hashing_embedder  # noqa: E402


# ---- cosine_topk -------------------------------------------------------------------

# Q, N, D, J; J > N in two of them
SHAPES = [(1, 1, 3, 1), (5, 40, 8, 3), (7, 12, 16, 12), (4, 5, 6, 9), (3, 200, 32, 10)]


@pytest.mark.parametrize("Q,N,D,J", SHAPES)
def test_cosine_topk_matches_sklearn(Q, N, D, J):
    rng = np.random.default_rng(Q * 1000 + N)
    queries, docs = rng.normal(size=(Q, D)), rng.normal(size=(N, D))
    idx, sim = cosine_topk(queries, docs, J)
    Jp = min(J, N)
    assert idx.shape == sim.shape == (Q, Jp) and idx.dtype == np.int64 and sim.dtype == np.float32
    nn = NearestNeighbors(n_neighbors=Jp, metric="cosine", algorithm="brute").fit(docs)
    dist, ref = nn.kneighbors(queries)
    np.testing.assert_allclose(sim, 1 - dist, atol=1e-5)
    np.testing.assert_array_equal(idx, ref)  # continuous random data: no ties
    assert np.all(np.diff(sim, axis=1) <= 0)  # descending


def test_cosine_topk_worked_example_from_docstring():
    q, d = np.array([[1.0, 0.0]]), np.array([[0.0, 1.0], [2.0, 0.0], [1.0, 1.0]])
    idx, sim = cosine_topk(q, d, 2)
    assert idx.tolist() == [[1, 2]]
    np.testing.assert_allclose(sim, [[1.0, 0.70710677]], rtol=1e-6)
    idx, sim = cosine_topk(q, d, 2, forbid=np.array([[False, True, False]]))
    assert idx.tolist() == [[2, 0]]
    np.testing.assert_allclose(sim, [[0.70710677, 0.0]], rtol=1e-6)


def test_cosine_topk_forbid_and_padding():
    rng = np.random.default_rng(0)
    queries, docs = rng.normal(size=(6, 5)), rng.normal(size=(10, 5))
    forbid = rng.random((6, 10)) < 0.5
    forbid[0] = True  # nothing allowed
    forbid[1] = True
    forbid[1, 7] = False  # exactly one allowed
    idx, sim = cosine_topk(queries, docs, 4, forbid)
    assert idx[0].tolist() == [-1] * 4 and np.all(np.isneginf(sim[0]))
    assert idx[1].tolist() == [7, -1, -1, -1]
    for q in range(6):
        allowed = np.flatnonzero(~forbid[q])
        got = idx[q][idx[q] >= 0]
        assert len(got) == min(4, len(allowed)) and not forbid[q, got].any()
        # the allowed ones come out in the same order as an unrestricted search over them
        sub_idx, _ = cosine_topk(queries[q:q + 1], docs[allowed], 4)
        assert got.tolist() == allowed[sub_idx[0]].tolist()


def test_cosine_topk_ties_zero_vectors_and_empty():
    docs = np.array([[1.0, 0.0], [0.0, 0.0], [3.0, 0.0], [1.0, 0.0]])
    idx, sim = cosine_topk(np.array([[2.0, 0.0], [0.0, 0.0]]), docs, 4)
    assert idx[0].tolist() == [0, 2, 3, 1]  # three exact ties -> lower index first
    assert idx[1].tolist() == [0, 1, 2, 3] and np.all(sim[1] == 0)  # zero query: all 0, no NaN
    # many docs in a few groups of exact duplicates: within a group, indices must ascend
    rng = np.random.default_rng(0)
    docs = np.eye(4)[rng.integers(0, 4, size=200)] * rng.integers(1, 5, size=(200, 1))  # (200, 4)
    idx, sim = cosine_topk(np.array([[4.0, 3.0, 2.0, 1.0]]), docs, 200)
    ref = np.lexsort((np.arange(200), -docs.argmax(1).choose([4, 3, 2, 1])))  # by group, then index
    assert idx[0].tolist() == ref.tolist()
    idx, sim = cosine_topk(np.ones((2, 3)), np.zeros((0, 3)), 3)
    assert idx.shape == (2, 0) and sim.shape == (2, 0)
    with pytest.raises(ValueError):
        cosine_topk(np.ones((2, 3)), np.ones((4, 2)), 1)


# ---- ExperienceBank ----------------------------------------------------------------

def exp(task_id, family, task, text="lookup(x) -> y", reward=1.0):
    return Experience(task_id, family, task, text, reward)


@pytest.fixture(scope="module")
def embed():
    return hashing_embedder(1024)


def family_bank(embed, **kw):
    bank = ExperienceBank(embed, **kw)
    people = ["bob", "carol", "dave", "erin"]
    plans = {"q3": ("q3 {}", "team -> lead -> city"),  # an opaque alias: the name says nothing
             "city_of_manager": ("city of manager of {}", "manager -> city"),
             "team_of_lead": ("team of lead of {}", "lead -> team")}
    for fam, (template, plan) in plans.items():
        text = " ; ".join(f"lookup({step}) -> x" for step in plan.split(" -> "))
        bank.add([exp(f"{fam}-{p}", fam, template.format(p), text) for p in people])
    return bank


def test_family_keyword_retrieves_its_family(embed):
    bank = family_bank(embed)
    tasks = ["q3 alice", "city of manager of alice", "team of lead of alice"]
    families = ["q3", "city_of_manager", "team_of_lead"]
    got = bank.retrieve(tasks, ["a1", "a2", "a3"], J=3)
    assert [[e.family for e in row] for row in got] == [[f] * 3 for f in families]
    assert bank.family_hit_rate(families, got) == 1.0
    assert bank.family_hit_rate(families[::-1], got) == pytest.approx(1 / 3)
    assert np.isnan(bank.family_hit_rate(["q3"], [[]]))


def test_same_task_excluded_or_included(embed):
    exps = [exp("t0", "f", "city of manager of bob"), exp("t1", "f", "q3 carol")]
    strict, loose = ExperienceBank(embed), ExperienceBank(embed, allow_same_task=True)
    strict.add(exps)
    loose.add(exps)
    query = ["city of manager of bob"]
    assert [e.task_id for e in loose.retrieve(query, ["t0"], J=2)[0]] == ["t0", "t1"]
    assert [e.task_id for e in strict.retrieve(query, ["t0"], J=2)[0]] == ["t1"]
    # every stored entry is this task -> nothing comes back, without error
    only = ExperienceBank(embed)
    only.add([exp("t0", "f", "q3 bob", "a -> b"), exp("t0", "f", "q3 bob", "c -> d")])
    assert [len(r) for r in only.retrieve(["q3 bob", "q3 dave"], ["t0", "t9"], J=3)] == [0, 2]


def test_failures_not_stored_and_empty_bank(embed):
    bank = ExperienceBank(embed)
    assert bank.retrieve(["q3 bob"], ["t0"], J=3) == [[]]
    bank.add([exp("t0", "f", "q3 bob", reward=0.0), exp("t1", "f", "q3 bob", reward=0)])
    assert len(bank) == 0 and bank.retrieve(["q3 bob"], ["x"], J=3) == [[]]
    bank.add([exp("t2", "f", "q3 bob", reward=1.0), exp("t3", "f", "q3 bob", reward=0.0)])
    assert [e.task_id for e in bank.exps] == ["t2"] and bank.emb.shape == (1, 1024)
    assert bank.retrieve([], [], J=3) == []


def test_capacity_fifo_keeps_newest(embed):
    bank = ExperienceBank(embed, capacity=5)
    for k in range(3):  # three batches of 3 -> 9 added, 5 kept
        bank.add([exp(f"t{3 * k + i}", "f", f"task number {3 * k + i}") for i in range(3)])
    assert len(bank) == 5 and bank.emb.shape[0] == 5
    assert [e.task_id for e in bank.exps] == [f"t{i}" for i in range(4, 9)]
    # the surviving rows are still the embeddings of the surviving experiences
    np.testing.assert_allclose(bank.emb, embed([bank.document(e) for e in bank.exps]))


def test_state_dict_is_weights_only_safe(embed):
    torch = pytest.importorskip("torch")
    bank = family_bank(embed)
    buf = io.BytesIO()
    torch.save({"bank": bank.state_dict()}, buf)
    buf.seek(0)
    other = ExperienceBank(embed)
    other.load_state_dict(torch.load(buf, weights_only=True)["bank"])
    assert other.exps == bank.exps and np.array_equal(other.emb, bank.emb)


def test_save_load_round_trip(embed, tmp_path):
    bank = family_bank(embed, capacity=50, allow_same_task=True)
    path = str(tmp_path / "bank.npz")
    bank.save(path)
    assert os.listdir(tmp_path) == ["bank.npz"]  # no .tmp left behind
    loaded = ExperienceBank.load(path, embed)
    assert loaded.capacity == 50 and loaded.allow_same_task is True
    assert loaded.exps == bank.exps and np.array_equal(loaded.emb, bank.emb)
    tasks, ids = ["q3 alice", "city of manager of bob"], ["q3-bob", "city_of_manager-bob"]
    assert loaded.retrieve(tasks, ids, J=4) == bank.retrieve(tasks, ids, J=4)
    bank.save(path)  # overwriting an existing file works too
    assert ExperienceBank.load(path, embed).exps == bank.exps


def test_corrupt_or_mismatched_file_raises(embed, tmp_path):
    bank = family_bank(embed)
    good = tmp_path / "good.npz"
    bank.save(str(good))
    data = good.read_bytes()
    rng = np.random.default_rng(0)
    cases = {"random.npz": rng.bytes(500), "truncated.npz": data[: len(data) // 2],
             "empty.npz": b"", "not_npz.npz": b"hello"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=name) as info:
            ExperienceBank.load(str(tmp_path / name), embed)
        assert "\n" not in str(info.value)
    meta = np.load(good)["meta"]  # valid JSON, but one row of embeddings too few
    with open(tmp_path / "short.npz", "wb") as f:
        np.savez(f, embeddings=bank.emb[1:], meta=meta)
    with pytest.raises(ValueError, match="short.npz"):
        ExperienceBank.load(str(tmp_path / "short.npz"), embed)
    with pytest.raises(ValueError, match="good.npz"):  # a different embedder than the one saved
        ExperienceBank.load(str(good), hashing_embedder(256))
    with pytest.raises(FileNotFoundError):
        ExperienceBank.load(str(tmp_path / "missing.npz"), embed)


def fake_embed(texts):
    """A cheap embedder for the property test: any unicode, deterministic, 16-d."""
    out = np.zeros((len(texts), 16), dtype=np.float32)
    for i, t in enumerate(texts):
        for ch in t:
            out[i, ord(ch) % 16] += 1.0
    return out


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=20), st.text(max_size=40), st.text(max_size=5)),
                min_size=0, max_size=6),
       st.lists(st.text(max_size=20), min_size=1, max_size=3))
def test_save_load_round_trip_any_unicode(rows, queries):
    bank = ExperienceBank(fake_embed, capacity=4)
    bank.add([Experience(tid, tid + "-fam", task, text, 1.0) for task, text, tid in rows])
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "b.npz")
        bank.save(path)
        loaded = ExperienceBank.load(path, fake_embed)
    assert loaded.exps == bank.exps and np.array_equal(loaded.emb, bank.emb)
    ids = [q[:3] for q in queries]
    assert loaded.retrieve(queries, ids, J=3) == bank.retrieve(queries, ids, J=3)


# ---- the relation embedder (code generation) ------------------------------------------

def test_parse_examples_reads_data_and_never_code():
    assert parse_examples("[3,1]->[4,2]; 'ab'->'abab'; [0]->3") == [([3, 1], [4, 2]), ("ab", "abab"), ([0], 3)]
    hostile = ["__import__('os').system('echo hi')->1", "[1]->[2]; [x for x in ()]->[]", "->", "; ; ;", "",
               "[" * 5000 + "]" * 5000 + "->[1]", "'a'*10**9->1", "(lambda: 1)()->2", "[1]->[2]->[3]", "\x00->\x00",
               "[1," + "9" * 100000 + "]->1"]
    for text in hostile:  # odd text: only the literal->literal parts come back, never an exception
        got = parse_examples(text)
        assert all(type(x) in (list, str, int, tuple) for pair in got for x in pair)
    assert parse_examples("[1]->[2]; [x for x in ()]->[]") == [([1], [2])]
    assert parse_examples("[1]->" + "[2]" * 1000, max_chars=10) == []  # a bounded prefix is read


def slow_relation_similarities(stored, query):
    """The reference: each example's tests as Python bools, averaged by hand, cosine by hand,
    against every stored entry but the query's own task -> {index: similarity}."""
    def vec(text):
        rows = [relation_tests(x, y) for x, y in parse_examples(text)]
        return [sum(float(r[i]) for r in rows) / len(rows) for i in range(RELATION_DIM)] if rows else [0.0] * RELATION_DIM

    def cos(u, v):
        nu, nv = sum(a * a for a in u) ** 0.5, sum(b * b for b in v) ** 0.5
        return sum(a * b for a, b in zip(u, v)) / (max(nu, 1e-12) * max(nv, 1e-12))

    return {i: cos(vec(query.prompt), vec(e.task)) for i, e in enumerate(stored) if e.task_id != query.task_id}


def test_relation_retrieval_matches_a_slow_reference_and_finds_the_family():
    import envs
    env = CodeGen(n_train=300, n_eval=120)
    stored = [exp(t.task_id, t.family, t.prompt, t.solution) for t in env.train_tasks]
    bank = ExperienceBank(relation_embedder())
    bank.add(stored)
    queries = env.eval_tasks + env.train_tasks[:20]  # train queries: their own entry must never come back
    got = bank.retrieve([q.prompt for q in queries], [q.task_id for q in queries], J=3)
    index = {id(e): i for i, e in enumerate(stored)}
    for q, row in zip(queries, got):
        sim = slow_relation_similarities(stored, q)
        best = sorted(sim.values(), reverse=True)[:3]
        assert len(row) == 3 and all(index[id(e)] in sim for e in row)      # never the query's own task
        # the same top similarities (many entries tie exactly, and float32 means vs float64 ones
        # may order a tie differently, so the similarities are compared, not the indices)
        np.testing.assert_allclose([sim[index[id(e)]] for e in row], best, atol=1e-6)
    hit = bank.family_hit_rate([q.family for q in env.eval_tasks], got[:len(env.eval_tasks)])
    ngram = ExperienceBank(hashing_embedder())
    ngram.add(stored)
    hit_ngram = ngram.family_hit_rate([q.family for q in env.eval_tasks],
                                      ngram.retrieve([q.prompt for q in env.eval_tasks], [q.task_id for q in env.eval_tasks], 3))
    assert hit >= 0.9 and hit_ngram < 0.7  # measured: 0.98 and 0.54 on 250 queries against 600 tasks


def test_relation_tests_of_each_family_hold_for_its_reference_function():
    import envs
    env = CodeGen(n_train=120, n_eval=12)
    embed = relation_embedder()
    names = {"reverse": 13, "sort": 11, "take": 14, "repeat": 19, "mirror": 20, "rotate": 18, "every2": 22, "sum": 27}
    for t in env.train_tasks:  # the tests each family's function passes on every example it shows
        if t.family in names:
            assert embed([t.prompt])[0, names[t.family]] == 1.0, (t.family, t.prompt)
    assert embed(["no examples here", ""]).tolist() == [[0.0] * RELATION_DIM] * 2


def test_execution_rerank_scores_what_each_program_reproduces_and_survives_hostile_programs():
    import time
    from plugins.codegen import execution_rerank
    task = "[3,1]->[5,3]; [0,7]->[2,9]; [4]->[6]"  # add 2
    progs = {"lambda x: [v+2 for v in x]": 1.0, "lambda x: [v+3 for v in x]": 0.0,
             "lambda x: [v+2 if v < 5 else v for v in x]": 2 / 3,           # right on two of the three
             "lambda x: x": 0.0, "not a program": 0.0, "__import__('os').system('echo hi')": 0.0,
             "lambda x: [v for v in range(10**9)]": 0.0, "lambda x: 'a'*10**9": 0.0,
             "lambda x: [[[v for v in range(99)] for w in range(99)] for u in range(99)]": 0.0,
             "lambda x: x.__class__": 0.0, "lambda x: 1//0": 0.0, "": 0.0}
    cands = [exp(f"t{i}", "f", "q", p) for i, p in enumerate(progs)]
    t0 = time.monotonic()
    assert execution_rerank(task, cands) == pytest.approx(list(progs.values()))
    assert time.monotonic() - t0 < 30  # bounded by the evaluator's budgets (a backstop, not a timing test)
    assert execution_rerank("no examples", cands) == [0.0] * len(cands)


def test_rerank_sorts_the_cosine_shortlist_stably_and_keeps_the_exclusions():
    """Reference: the top rerank_pool by cosine (ties to the lower index), stably sorted by the score."""
    import envs
    from plugins.codegen import execution_rerank
    env = CodeGen(n_train=300, n_eval=40)
    stored = [exp(t.task_id, t.family, t.prompt, t.solution) for t in env.train_tasks]
    plain, reranked = ExperienceBank(relation_embedder()), ExperienceBank(relation_embedder(), rerank=execution_rerank, rerank_pool=8)
    plain.add(stored)
    reranked.add(stored)
    queries = env.eval_tasks + env.train_tasks[:10]
    short = plain.retrieve([q.prompt for q in queries], [q.task_id for q in queries], J=8)
    got = reranked.retrieve([q.prompt for q in queries], [q.task_id for q in queries], J=3)
    for q, row, pool in zip(queries, got, short):
        scores = execution_rerank(q.prompt, pool)
        ref = [pool[k] for k in sorted(range(len(pool)), key=lambda k: (-scores[k], k))][:3]
        assert row == ref and all(e.task_id != q.task_id for e in row)
    same = np.mean([e.text == q.solution for q, row in zip(env.eval_tasks, got) for e in row])  # the very function
    assert same > np.mean([e.text == q.solution for q, row in zip(env.eval_tasks, short) for e in row[:3]])
    other = reranked.retrieve([q.prompt for q in queries], [q.task_id for q in queries], J=3,
                              exclude_families=[q.family for q in queries])
    assert all(e.family != q.family for q, row in zip(queries, other) for e in row)
