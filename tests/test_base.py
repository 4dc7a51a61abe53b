"""The base every method starts from: its draw (--warmup_seed), what its cache key names (the torch and
the CPU kernels that build it), the reading probe and the gate (which must leave the base as it was, and
add steps only while the base does not read), and the premise line a run prints after its setup when the
teacher knows nothing its student does not.

One opt-in tier, which CI runs beside the notebooks' (they share the base): `python train.py`'s default
base, built here with the torch and the CPU kernels of this machine, must have a teacher above its
student (LOPD_BASE=1; ~6 min on 2 cores, most of it the warm-up; LOPD_WARMUP_SEED=W builds --warmup_seed W
instead, for the notebooks too: to see a base fail)."""
import contextlib
import io
import json
import os
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import envs  # noqa: E402
import model as M  # noqa: E402
import train  # noqa: E402
import warmup  # noqa: E402
from conftest import base_flags  # noqa: E402
from plumbing import assemble, bookkeeping as bk  # noqa: E402

TINY = ["--d_model", "32", "--n_layer", "1", "--warmup_steps", "20", "--warmup_batch", "8", "--warmup_lr", "1e-2",
        "--warmup_tail", "0.5"]


def build(tmp_path, flags, probe_every, monkeypatch):
    """A tiny warm-up, built (never cached) with the probe every `probe_every` steps -> (model, its saved file)."""
    monkeypatch.setattr(warmup, "PROBE_EVERY", probe_every)
    args = train.parse_args(TINY + flags + ["--out_dir", str(tmp_path / f"p{probe_every}")])
    env = envs.make_env(args.env)
    tok, model = warmup.load_model(args, env)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        path, cached = warmup.warmup(args, tok, model, env, "cpu")
    assert not cached
    return model, torch.load(path, weights_only=False)


@pytest.mark.slow
def test_the_reading_probe_leaves_the_base_as_it_was(tmp_path, monkeypatch):
    plain, saved_plain = build(tmp_path, [], 0, monkeypatch)
    probed, saved = build(tmp_path, [], 7, monkeypatch)
    for (k, a), (_, b) in zip(plain.state_dict().items(), probed.state_dict().items()):
        assert torch.equal(a, b), k
    assert saved_plain["reading"] == []
    assert [c["step"] for c in saved["reading"]] == [0, 7, 14, 21, 28, 30]   # through the tail (10 steps), and at the end
    assert all(set(c) == {"step", *warmup.PROBE_FORMS} for c in saved["reading"])


def test_the_tail_runs_its_own_cosine_after_the_first():
    assert warmup.tail_steps(train.parse_args(TINY)) == 10 and warmup.tail_steps(train.parse_args([])) == 400
    assert warmup.lr_factor(0, 20) == 1.0 and abs(warmup.lr_factor(19, 20) - 0.1) < 0.01
    tail = [warmup.lr_factor(s, 20, 10) for s in range(20, 30)]
    assert tail[0] == warmup.TAIL_LR and abs(tail[-1] - 0.1) < 0.01 and tail == sorted(tail, reverse=True)


def test_the_gate_adds_the_reading_tail_only_where_the_base_does_not_read(tmp_path, monkeypatch):
    """Under the gate at the cosine's end: the reading tail, its --warmup_tail steps, of demos drawn at TAIL_CTX from
    TAIL_FORMS (the cosine's at --warmup_ctx from CONTEXT_FORMS), and the gate read again at its end; over it: the very
    base no gate builds (the gate's reading leaves it as it was)."""
    drawn, demo = [], warmup.warmup_demo
    record = lambda *a, **kw: drawn.append((a[4], kw["forms"])) if "forms" in kw else None   # the training loop's draws
    monkeypatch.setattr(warmup, "warmup_demo", lambda *a, **kw: record(*a, **kw) or demo(*a, **kw))
    under, saved = build(tmp_path / "under", [], 0, monkeypatch)                  # a 20-step base does not read
    assert [g["step"] for g in saved["gate"]] == [20, 30] and saved["gate"][0]["follows"] < 0.15
    per_step = drawn[::8]                                                          # --warmup_batch 8 demos a step
    assert per_step[:20] == [(0.6, warmup.CONTEXT_FORMS)] * 20 and per_step[20:] == [(warmup.TAIL_CTX, warmup.TAIL_FORMS)] * 10
    assert set(warmup.TAIL_FORMS) <= set(warmup.CONTEXT_FORMS)
    no_gate, saved = build(tmp_path / "none", ["--warmup_gate", "0"], 0, monkeypatch)
    assert saved["gate"] == []
    monkeypatch.setattr(warmup, "follows", lambda *a: 1.0)                         # it reads at once
    reads, saved = build(tmp_path / "reads", [], 0, monkeypatch)
    assert saved["gate"] == [{"step": 20, "follows": 1.0}]
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert same(reads, no_gate) and not same(under, no_gate)


@pytest.mark.slow
def test_played_is_what_greedy_decoding_plays(tmp_path, monkeypatch):
    """played (teacher-forced: every agent token the argmax) against the slow reference, greedy decoding itself:
    the base's own greedy episodes, behind their contexts, are played; with one action changed, they are not."""
    model, _ = build(tmp_path, ["--warmup_steps", "60"], 0, monkeypatch)
    args = train.parse_args(TINY)
    env = envs.make_env(args.env)
    tok = warmup.load_model(args, env)[0]
    pool, by_family = warmup.warmup_pool(env)
    demos, contexts = warmup.gate_demos(env, pool, by_family, 24)
    prefixes = M.text_prefix(model, tok, list(contexts))
    with torch.no_grad():
        eps, _, _ = train.rollout(model, tok, env, [d.task for d in demos], greedy=True, prefixes=prefixes)
    assert all(warmup.played(model, tok, eps, contexts, "cpu"))
    changed = [envs.play(env, e.task, [a for a, _ in e.turns][:-1] + ["zzz(q)"]) for e in eps]
    assert not any(warmup.played(model, tok, changed, contexts, "cpu"))
    assert warmup.played(model, tok, demos, contexts, "cpu") == [[a for a, _ in e.turns] == [a for a, _ in d.turns]
                                                                  for e, d in zip(eps, demos)]


@pytest.mark.slow
def test_warmup_seed_is_another_draw_and_the_default_is_the_shipped_bases(tmp_path, monkeypatch):
    assert train.parse_args([]).warmup_seed == warmup.manifest()["recipe"]["warmup_seed"] == 4
    a, _ = build(tmp_path / "a", [], 0, monkeypatch)
    b, _ = build(tmp_path / "b", ["--warmup_seed", "4"], 0, monkeypatch)
    c, _ = build(tmp_path / "c", ["--warmup_seed", "5"], 0, monkeypatch)
    emb = lambda m: m.get_input_embeddings().weight
    assert torch.equal(emb(a), emb(b)) and not torch.equal(emb(a), emb(c))


def test_the_cache_key_names_the_seed_the_torch_and_the_cpu_kernels(tmp_path, monkeypatch):
    """A base built by other kernels (or another torch) is another draw: its cache is never reused."""
    args = train.parse_args(TINY + ["--warmup_steps", "0", "--out_dir", str(tmp_path)])
    env = envs.make_env(args.env)
    tok, model = warmup.load_model(args, env)
    path = lambda a: warmup.warmup(a, tok, model, env, "cpu")[0]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        here = path(args)
        other_seed = path(train.parse_args(TINY + ["--warmup_steps", "0", "--warmup_seed", "1", "--out_dir", str(tmp_path)]))
        monkeypatch.setattr(warmup, "cpu_kernels", lambda: "SOME_OTHER_ISA")
        other_kernels = path(args)
        monkeypatch.setattr(torch, "__version__", "0.0.0")
        other_torch = path(args)
    assert len({here, other_seed, other_kernels, other_torch}) == 4


# ----------------------------------------------------------------------------- the shipped base

def test_the_default_path_starts_from_the_shipped_base(tmp_path, capsys):
    """python train.py's flags are the shipped base's recipe: its files' hashes are the manifest's, this code's recipe
    is the one that built it, and the warm-up loads it (no build, nothing cached under runs/) and names it in one line
    with its facts; the tokenizer is the shipped one."""
    man = warmup.manifest()
    args = train.parse_args(["--out_dir", str(tmp_path)])
    assert warmup.recipe(args) == man["recipe"] and warmup.shipped(args)
    for name, digest in man["files"].items():
        assert warmup.sha256(os.path.join(warmup.SHIPPED, name)) == digest, name
    env = envs.make_env(args.env)
    tok, model = warmup.load_model(args, env)
    assert sorted(tok.enc._mergeable_ranks.items()) == sorted(warmup.shipped_ranks().items())
    assert warmup.recipe_digest(args, tok, env) == man["recipe_digest"]
    path, cached = warmup.warmup(args, tok, model, env, "cpu")
    assert cached and path == os.path.join(warmup.SHIPPED, warmup.WEIGHTS) and not os.listdir(tmp_path)
    from safetensors.torch import load_file
    weights = load_file(path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights.get(k, weights["lm_head.weight"])), k   # the embedding is tied to the head
    out = capsys.readouterr().out
    assert f"warm-up: shipped base/tooluse/{warmup.WEIGHTS}" in out and "base: the shipped one" in out
    assert f"held-out reward {man['facts']['reward']:.3f}" in out
    info = warmup.base_info(path)
    assert info["shipped"] == "base/tooluse" and info["id"] == f"shipped-{man['files'][warmup.WEIGHTS][:12]}"


def test_ship_base_writes_what_the_default_path_loads(tmp_path, monkeypatch):
    """bench.ship_base's files, written from a tiny base built here: a run of that recipe then loads them (nothing
    built, the same weights and tokenizer), and the manifest names the recipe, the hashes and who built it."""
    from bench import ship_base
    monkeypatch.setattr(warmup, "SHIPPED", str(tmp_path / "tooluse"))
    args = train.parse_args(TINY + ["--build_base", "--out_dir", str(tmp_path / "built")])
    env = envs.make_env(args.env)
    tok, model = warmup.load_model(args, env)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        path, _ = warmup.warmup(args, tok, model, env, "cpu")
    man = ship_base.write(args, tok, model, torch.load(path, weights_only=False), "python -m bench.ship_base ...")
    man["facts"] = {"reward": 0.1, "success": 0.0, "eval_tasks": 500, "teacher_eval": 100,
                    **{g: {"mean": 0.0, "lo": 0.0, "hi": 0.0} for g in ("gap_lopd", "gap_opsd")}}
    bk.atomic_json(man, str(tmp_path / "tooluse" / "manifest.json"))
    assert man["recipe"]["warmup_steps"] == 20 and man["built"]["cpu_kernels"] == warmup.cpu_kernels()
    again = train.parse_args(TINY + ["--out_dir", str(tmp_path / "runs")])
    assert warmup.shipped(again) and not warmup.shipped(args)                     # --build_base: built here
    tok2, model2 = warmup.load_model(again, env)
    with contextlib.redirect_stdout(io.StringIO()):
        assert warmup.warmup(again, tok2, model2, env, "cpu")[1]
    assert not (tmp_path / "runs").exists() and tok2.digest() == tok.digest()
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("flags", [["--warmup_seed", "5"], ["--build_base"], ["--d_model", "32"], ["--env", "codegen"],
                                   ["--warmup_steps", "100"]])
def test_another_recipe_is_built_here(flags):
    assert not warmup.shipped(train.parse_args(flags))


def test_no_shipped_file_is_unpickled(monkeypatch, tmp_path):
    """The shipped base is safetensors and JSON: loading it, and describing it, never calls torch.load."""
    def refuse(*a, **kw):
        raise AssertionError("torch.load of a shipped file")
    monkeypatch.setattr(torch, "load", refuse)
    args = train.parse_args(["--out_dir", str(tmp_path)])
    env = envs.make_env(args.env)
    tok, model = warmup.load_model(args, env)
    with contextlib.redirect_stdout(io.StringIO()):
        path, _ = warmup.warmup(args, tok, model, env, "cpu")
    assert warmup.base_info(path)["shipped"]


def shipped_copy(tmp_path, monkeypatch):
    """The shipped folder copied to tmp_path, and warmup pointed at the copy."""
    import shutil
    folder = tmp_path / "tooluse"
    shutil.copytree(warmup.SHIPPED, folder)
    monkeypatch.setattr(warmup, "SHIPPED", str(folder))
    return folder


def refused(capsys, fn):
    with pytest.raises(SystemExit) as e:
        fn()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_a_shipped_file_that_differs_from_its_hash_is_refused_in_one_line(tmp_path, monkeypatch, capsys, name):
    folder = shipped_copy(tmp_path, monkeypatch)
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2] ^= 1                                                     # one bit
    (folder / name).write_bytes(bytes(data))
    args = train.parse_args(["--out_dir", str(tmp_path / "runs")])
    env = envs.make_env(args.env)

    def load():
        tok, model = warmup.load_model(args, env)
        warmup.warmup(args, tok, model, env, "cpu")
    err = refused(capsys, load)
    assert name in err and "sha256" in err and "git checkout base/" in err


def test_a_recipe_that_no_longer_matches_the_shipped_files_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """The code's recipe changed (here: the forms of context the warm-up teaches) but the flags did not: the shipped
    files are not this recipe's base, and mixing them in silently would be wrong."""
    monkeypatch.setattr(warmup, "CONTEXT_FORMS", {**warmup.CONTEXT_FORMS, "solution": 0.5})
    args = train.parse_args(["--out_dir", str(tmp_path)])
    env = envs.make_env(args.env)
    tok, model = warmup.load_model(args, env)
    err = refused(capsys, lambda: warmup.warmup(args, tok, model, env, "cpu"))
    assert "another recipe" in err and "python -m bench.ship_base" in err and "--build_base" in err


def test_the_gate_on_acting_names_a_base_that_cannot_act(capsys):
    """A base built here under ACT_FLOOR of the shipped base's held-out reward says so (stderr, one line) and in
    summary.json's base; one that acts, the shipped base and other models say nothing."""
    ref = warmup.manifest()["facts"]["reward"]
    run = lambda base, **kw: types.SimpleNamespace(base=base, args=train.parse_args([f"--{k}={v}" for k, v in kw.items()]))
    weak, fine, shipped = run({}, warmup_seed=5), run({}, warmup_seed=6), run({"shipped": "base/tooluse"})
    assemble.acts(weak, 0.3 * ref)
    out = capsys.readouterr()
    assert weak.base["acts"] is False and out.err.count("\n") == 1 and "cannot act" in out.err and "shipped" in out.err
    assemble.acts(fine, 0.9 * ref)
    assemble.acts(shipped, 0.0)
    assert fine.base["acts"] is True and "acts" not in shipped.base and capsys.readouterr().err == ""


def test_paired_gap_by_hand():
    mean, lo, hi = bk.paired_gap([1.0, 0.5, 0.0], [0.0, 0.5, 0.0, 1.0])   # b's extra task is not the teacher's
    assert mean == pytest.approx(1 / 3) and lo <= mean <= hi and lo >= 0 and hi <= 1
    assert bk.paired_gap([0.5] * 4, [0.5] * 9) == (0.0, 0.0, 0.0)
    assert bk.paired_gap(None, [0.1]) is None


def test_the_premise_line_only_when_the_teacher_knows_no_more(capsys):
    assemble.premise({"task_reward": [0.2] * 10})                      # no teacher: nothing to say
    assert capsys.readouterr().out == ""
    assemble.premise({"task_teacher_reward": [0.6] * 10, "task_reward": [0.3] * 10})
    out = capsys.readouterr()
    assert "+0.300" in out.out and out.err == ""
    assemble.premise({"task_teacher_reward": [0.31] * 10, "task_reward": [0.3] * 10})
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and "knows nothing its student does not" in out.err and "--warmup_seed" in out.err


REWARD_TOLERANCE = 0.01  # greedy decoding from one set of weights: the held-out reward, 500 of 500 tasks, has been
# the same to the last task under AVX2, AVX-512 and no-SIMD kernels; 0.01 is five tasks of 500 flipped


@pytest.mark.skipif(not os.environ.get("LOPD_BASE"), reason="opt-in: LOPD_BASE=1 (the base's evaluation and a cold start, ~2 min)")
def test_the_shipped_base_measures_here_what_its_manifest_says(base_gap):
    """The base tier, on whatever machine runs it: train.py from the shipped base evaluates it at its manifest's held-out
    reward (within REWARD_TOLERANCE), and LOPD's teacher, its latents composed after this machine's cold start, is at
    least 15 points over its student on the same 100 held-out tasks, its interval's lower end above 0 (the run prints
    the gap). The run is the notebooks' (conftest.base_gap: notebook 4 must find the same gap). LOPD_WARMUP_SEED=W:
    a base built here instead, held to the teacher's gap only."""
    summary, stdout = base_gap
    gap, facts = summary["teacher_gap_base"], warmup.manifest()["facts"]
    print(f"{summary['base']}: base reward {summary['base_reward']:.3f}, teacher - student {gap[0]:+.3f} [{gap[1]:+.3f}, {gap[2]:+.3f}]")
    assert "teacher - student at the base" in stdout
    if summary["base"].get("shipped"):
        assert "base: the shipped one" in stdout
        assert abs(summary["base_reward"] - facts["reward"]) <= REWARD_TOLERANCE, (summary["base_reward"], facts["reward"])
    assert gap[0] >= 0.15 and gap[1] > 0, f"the teacher is {gap[0]:+.3f} [{gap[1]:+.3f}, {gap[2]:+.3f}] over its student"
