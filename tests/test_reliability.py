"""Reliability: a run killed between checkpoints (SIGKILL) or stopped by SIGTERM and
then resumed ends with exactly the metrics of an uninterrupted run; injected NaNs are skipped
and counted and never reach the weights; repeated skips stop the run; an out-of-memory
error names the knobs; a changed flag on --resume and a mismatched checkpoint are one line.

The kills come from tests/faults.py (train.py has no test hooks): it wraps train.train_step so
that the process signals itself right after a given step, between two checkpoints, at a step
that does not depend on the machine's speed. The NaNs come from a wrapped method loss."""
import contextlib
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from plumbing import bookkeeping as bk  # noqa: E402
from conftest import NEEDS_CPU_BF16, TINY_BASE  # noqa: E402
import faults  # noqa: E402
import train  # noqa: E402
from plumbing import registry  # noqa: E402

torch.set_num_threads(1)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TINY = ["--batch", "16", *TINY_BASE, "--eval_every", "2", "--eval_tasks", "24", "--teacher_eval", "8"]
LOPD_SETUP = ["--init_episodes", "16", "--cold_start_steps", "2"]
# LOPD holds the most state (composer, φ's optimizer, β, the bank); 16 bank-filling
# episodes + 4 steps of 16, checkpoints at steps 0, 2, 4
RUN = [*TINY, *LOPD_SETUP, "--method", "lopd", "--episodes", "80"]


def launch(args, out_dir, name, signal_at=None):
    """python tests/faults.py [--signal STEP:SIG] -- ARGS: train.py with a self-signal after a step."""
    log = open(out_dir / f"{name}.log", "w")
    cmd = [sys.executable, "tests/faults.py", *(["--signal", signal_at] if signal_at else []), "--", *args]
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return p


def wait(p, out_dir, name):
    p.wait(timeout=300)
    return p.returncode, (out_dir / f"{name}.log").read_text()


def metrics(run_dir):
    """Every eval record minus its wall-clock times (the only thing a resume may change)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("times")
    return rows


def in_process(argv):
    """train.main(argv) in this process -> (exit status, stdout + stderr)."""
    log, rc = io.StringIO(), 0
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            train.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, log.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base_in):
    """One run SIGKILLed after step 3 and one SIGTERMed after step 3 (programs, side by side),
    while an uninterrupted one runs in this process; then each interrupted one resumed (here:
    a resume reads everything from the checkpoint, so the process it runs in does not matter).
    -> (out_dir, {name: (exit status, log)})."""
    out = base_in(tmp_path_factory.mktemp("resume"))
    res = {"whole": in_process([*RUN, "--out_dir", str(out), "--name", "whole"])}  # builds the setup cache
    cut = {n: launch([*RUN, "--out_dir", str(out), "--name", n], out, n, f"3:{n.upper()}") for n in ("kill", "term")}
    for n, p in cut.items():
        res[n] = wait(p, out, n)
    for n in ("kill", "term"):
        res[n + "-resumed"] = in_process(["--resume", str(out / n)])
    return out, res


def test_the_interruptions_happened_where_asked(runs):
    out, res = runs
    assert res["whole"][0] == 0, res["whole"][1][-3000:]
    assert res["kill"][0] == -signal.SIGKILL
    assert res["term"][0] == 130 and "interrupted at step 3; checkpoint saved" in res["term"][1]
    # SIGKILL saves nothing: the last checkpoint is step 2's; SIGTERM saved step 3 first
    assert "resumed at step 2, 48 episodes" in res["kill-resumed"][1], res["kill-resumed"][1][-3000:]
    assert "resumed at step 3, 64 episodes" in res["term-resumed"][1], res["term-resumed"][1][-3000:]
    # the first run built the cold start, the others loaded it: the equalities below cover the cache too
    assert "setup: cached" not in res["whole"][1] and "\nsetup: " in res["whole"][1]
    assert "setup: cached" in res["kill"][1] and "setup: cached" in res["term"][1]


@pytest.mark.parametrize("name", ["kill", "term"])
def test_a_resumed_run_ends_with_the_metrics_of_an_uninterrupted_one(runs, name):
    out, res = runs
    rc, log = res[name + "-resumed"]
    assert rc == 0, log[-3000:]
    whole, resumed = metrics(out / "whole"), metrics(out / name)
    assert [m["step"] for m in whole] == [0, 2, 4]
    assert resumed == whole  # success, teacher success, loss, β, Δ, anchor, ... to the last digit
    s_whole = json.loads((out / "whole" / "summary.json").read_text())
    s_resumed = json.loads((out / name / "summary.json").read_text())
    for k in ["final_success", "best_success", "teacher_success", "episodes", "skipped_updates"]:
        assert s_resumed[k] == s_whole[k], k
    a = torch.load(out / "whole" / "ckpt.pt", map_location="cpu", weights_only=False)
    b = torch.load(out / name / "ckpt.pt", map_location="cpu", weights_only=False)
    for x, y in [(a["model"], b["model"]), (a["state"]["composer"], b["state"]["composer"]),
                 (a["state"]["composer0"], b["state"]["composer0"])]:
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert a["state"]["beta"] == b["state"]["beta"] and a["state"]["bank"] == b["state"]["bank"]


def test_an_ablation_that_loads_the_cold_start_equals_one_that_builds_it(runs, tmp_path, capsys):
    """--margin 0 differs from LOPD only after the cold start, so it loads the one LOPD built;
    run again where no cache exists (same warm-up), it builds its own: same numbers."""
    out, _ = runs
    ablation = [*TINY, *LOPD_SETUP, "--method", "lopd", "--margin", "0", "--episodes", "48"]
    train.main([*ablation, "--out_dir", str(out), "--name", "m0-cached"])
    assert "setup: cached" in capsys.readouterr().out
    for f in out.glob("warmup-*.pt"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    train.main([*ablation, "--out_dir", str(tmp_path), "--name", "m0-built"])
    assert "setup: cached" not in capsys.readouterr().out
    assert metrics(out / "m0-cached") == metrics(tmp_path / "m0-built")
    # a knob the cold start reads is part of the key: a new cold start, not the cached one
    train.main([*TINY, "--init_episodes", "16", "--method", "lopd", "--cold_start_steps", "3", "--episodes", "16",
                "--out_dir", str(out), "--name", "other-cold-start"])
    assert "setup: cached" not in capsys.readouterr().out


def test_a_setup_is_built_on_the_same_threads_whatever_the_process_runs_on(tmp_path, monkeypatch):
    """A setup's sums round by the threads they are split over: the setup is built on bk.BUILD_THREADS whatever the
    process's own count (a notebook on one thread, the bench's runs, train.py on two share one cold start), its cache
    key does not hold the process's count, and the process gets its own count back, after a setup that raised too."""
    args, seen, threads = train.Args(out_dir=str(tmp_path)), [], torch.get_num_threads()
    run = types.SimpleNamespace(args=args, code="code", state={}, episodes=0, log={}, skips_in_a_row=0, rng=random.Random(0),
                                device=torch.device("cpu"))
    try:
        keys = []
        for n in (1, 2):
            torch.set_num_threads(n)
            keys.append(bk.setup_key(args, "warmup-x.pt", "code"))
            with contextlib.redirect_stdout(io.StringIO()):
                bk.cached_setup(run, lambda run: seen.append(torch.get_num_threads()), f"base-{n}")
            assert torch.get_num_threads() == n
        with pytest.raises(RuntimeError):
            bk.cached_setup(run, lambda run: (_ for _ in ()).throw(RuntimeError("boom")), "base-raises")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert keys[0] == keys[1] and seen == [bk.BUILD_THREADS] * 2


def test_load_run_gives_back_the_run_at_its_checkpoint_and_writes_nothing(runs):
    """train.load_run(folder) -> the live run: θ, φ, β, the bank, the counters, as ckpt.pt holds them."""
    out, _ = runs
    before = {f: (out / "whole" / f).read_bytes() for f in ("metrics.jsonl", "ckpt.pt", "summary.json")}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run = train.load_run(str(out / "whole"))
    ckpt = torch.load(out / "whole" / "ckpt.pt", map_location="cpu", weights_only=False)
    assert (run.step, run.episodes, run.args.method) == (4, 80, "lopd")
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in run.model.state_dict().items())
    assert all(torch.equal(v, ckpt["state"]["composer"][k]) for k, v in run.state["composer"].state_dict().items())
    assert run.state["beta"] == ckpt["state"]["beta"] and run.state["bank"].state_dict() == ckpt["state"]["bank"]
    assert {f: (out / "whole" / f).read_bytes() for f in before} == before


def test_resume_refuses_a_changed_flag(runs, capsys):
    out, _ = runs
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(out / "whole"), "--lr", "0.1"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--lr" in lines[0] and "--resume" in lines[0], lines


def test_a_mismatched_checkpoint_is_one_line_naming_file_and_mismatch(runs, tmp_path, capsys):
    out, _ = runs
    state = torch.load(out / "whole" / "ckpt.pt", map_location="cpu", weights_only=False)
    name = next(k for k, v in state["model"].items() if v.dim() == 2)
    state["model"][name] = torch.zeros(state["model"][name].shape[0] + 1, state["model"][name].shape[1])  # one row too many
    (tmp_path / "r").mkdir()
    torch.save(state, tmp_path / "r" / "ckpt.pt")
    for f in out.glob("warmup-*.pt"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(tmp_path / "r")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and str(tmp_path / "r" / "ckpt.pt") in last and "size mismatch" in last, last


# ----------------------------------------------------------------------------- numerical guards

GRPO = [*TINY, "--method", "grpo", "--episodes", "64"]  # 4 steps of 16


def finite(run_dir):
    state = torch.load(run_dir / "ckpt.pt", map_location="cpu", weights_only=False)
    return all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def nan_at(monkeypatch, steps):
    """GRPO's loss, made NaN in those steps (from outside: train.py has no test hook)."""
    grpo = registry.METHODS["grpo"]
    monkeypatch.setattr(grpo, "loss", faults.nan_loss(grpo.loss, steps))


def test_injected_nans_are_skipped_and_counted(tmp_path, base_in, capsys, monkeypatch):
    base_in(tmp_path)
    nan_at(monkeypatch, {2, 3})
    train.main([*GRPO, "--out_dir", str(tmp_path)])
    run = tmp_path / "grpo-tooluse-s0"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["skipped_updates"] == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [0, 1, 2]  # cumulative, at steps 0, 2, 4
    assert finite(run)
    assert capsys.readouterr().err.count("non-finite loss, update skipped") == 2


def test_repeated_skips_stop_the_run(tmp_path, base_in, capsys, monkeypatch):
    base_in(tmp_path)
    nan_at(monkeypatch, {2, 3, 4})
    with pytest.raises(SystemExit) as e:
        train.main([*GRPO, "--out_dir", str(tmp_path), "--max_skips", "3"])
    assert e.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stopped in step 4" in last and "3 updates in a row" in last and "--lr" in last, last
    assert finite(tmp_path / "grpo-tooluse-s0")  # the checkpoint it leaves holds the last finite weights


class FakeRun:
    def __init__(self, model):
        self.model, self.step, self.skips_in_a_row = model, 0, 0
        self.log = {"skipped": []}
        self.args = train.parse_args([])


def test_a_non_finite_gradient_with_a_finite_loss_is_skipped():
    """bookkeeping.optimizer_step, the one update of θ and φ (every method's step and LOPD's)."""
    step = bk.optimizer_step
    model = torch.nn.Linear(2, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = FakeRun(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.zeros(1, 2)
    loss = torch.sqrt(model(x).abs() * 0)[0, 0]  # = 0, but d sqrt(u)/du at 0 is inf
    assert math.isfinite(loss.item())
    step(run, opt, loss, model)
    assert run.log["skipped"] == [1]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    step(run, opt, loss * float("nan"), model)                                  # a non-finite loss: skipped too
    assert run.log["skipped"] == [1, 1] and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    step(run, opt, (model(x + 1) ** 2).sum(), model)  # a good step goes through
    assert run.log["skipped"] == [1, 1] and run.skips_in_a_row == 0
    assert not torch.equal(before["bias"], model.state_dict()["bias"])


def test_out_of_memory_names_the_knobs(tmp_path, base_in, capsys, monkeypatch):
    base_in(tmp_path)
    def oom(run):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(train, "train_step", oom)
    with pytest.raises(SystemExit) as e:
        train.main([*GRPO, "--out_dir", str(tmp_path)])
    assert e.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert "out of memory" in lines[-1] and "--batch" in lines[-1] and "Traceback" not in "\n".join(lines)


@NEEDS_CPU_BF16
def test_bf16_autocast_runs_and_stays_finite(tmp_path, base_in):
    """--dtype bf16 exercises the autocast path (CPU supports bf16 autocast); the losses are fp32."""
    base_in(tmp_path)
    train.main([*GRPO, "--out_dir", str(tmp_path), "--dtype", "bf16", "--episodes", "32"])
    summary = json.loads((tmp_path / "grpo-tooluse-s0" / "summary.json").read_text())
    assert summary["skipped_updates"] == 0 and 0 <= summary["final_success"] <= 1
    assert finite(tmp_path / "grpo-tooluse-s0")


# ----------------------------------------------------------------------------- run folders and caches

GRPO16 = [*TINY, "--method", "grpo", "--episodes", "16"]


def test_a_new_run_never_replaces_a_finished_or_resumable_one(tmp_path, base_in, capsys):
    base_in(tmp_path)
    train.main([*GRPO16, "--out_dir", str(tmp_path)])
    run = tmp_path / "grpo-tooluse-s0"
    first = (run / "summary.json").read_text()
    capsys.readouterr()
    for state in ["finished", "resumable"]:
        with pytest.raises(SystemExit) as e:
            train.main([*GRPO16, "--out_dir", str(tmp_path), "--lr", "3e-4"])
        assert e.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"holds a {state} run" in lines[0], lines
        assert all(w in lines[0] for w in ["--resume", "--name", "--overwrite"]), lines[0]
        assert (run / "summary.json").read_text() == first if state == "finished" else True
        (run / "summary.json").unlink(missing_ok=True)  # next: a run stopped before its end (a checkpoint, no summary)
    train.main([*GRPO16, "--out_dir", str(tmp_path), "--lr", "3e-4", "--overwrite"])
    assert json.loads((run / "config.json").read_text())["lr"] == 3e-4
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2  # the old run's lines are gone


@pytest.mark.slow
def test_a_corrupt_cache_is_reported_in_one_line_and_rebuilt(runs, tmp_path, capsys):
    """Torn or garbage cache files (the warm-up and a method's setup): one line each on stderr,
    then they are rebuilt, and the run's numbers are those of a run that built them from nothing."""
    out, _ = runs
    args = [*TINY, *LOPD_SETUP, "--method", "lopd", "--margin", "0", "--episodes", "32", "--out_dir", str(tmp_path)]
    for f in out.glob("warmup-*.pt"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    train.main([*args, "--name", "clean"])
    caches = {what: next(tmp_path.glob(pattern)) for what, pattern in [("warm-up", "warmup-*.pt"), ("setup", "setup-*.pt")]}
    good = {what: torch.load(path, weights_only=False) for what, path in caches.items()}
    for path in caches.values():
        path.write_bytes(b"not a cache" + path.read_bytes()[:100])
    capsys.readouterr()
    train.main([*args, "--name", "again"])
    out_, err = capsys.readouterr()
    assert "Traceback" not in err
    for what, path in caches.items():
        broken = [line for line in err.splitlines() if "unreadable" in line and str(path) in line]
        assert len(broken) == 1 and broken[0].startswith(f"train.py: {what} cache") and "rebuilding" in broken[0]
        assert f"{what}: {path}" in out_  # rebuilt, not loaded
        key = "model" if what == "warm-up" else "state"
        assert repr(torch.load(path, weights_only=False)[key].keys()) == repr(good[what][key].keys())
    assert metrics(tmp_path / "again") == metrics(tmp_path / "clean")
