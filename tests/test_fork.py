"""A variant registered from outside the repo's modules (tests/fork_variant.py, a forker's own
file: "the teacher is shown the student's own best earlier attempt at this task", with a
per-task memory) runs through train.py with no edit to any module, for a few steps and through
a crash between two checkpoints and a resume that ends with exactly the uninterrupted metrics.

The crash is in-process: an exception out of train_step after step 3, which leaves the run as
a SIGKILL would (no handler runs, nothing is saved); tests/test_reliability.py does the same
with real signals in a subprocess."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
import envs  # noqa: E402
import train  # noqa: E402
from conftest import TINY_BASE  # noqa: E402
from plumbing import registry  # noqa: E402

torch.set_num_threads(1)
ARGS = ["--method", "best-attempt", "--batch", "16", "--episodes", "64", "--eval_every", "2", "--eval_tasks", "8",
        "--teacher_eval", "8", *TINY_BASE]


class Crash(BaseException):
    """Stands for a SIGKILL: nothing catches it, nothing is saved."""


@pytest.fixture
def variant(monkeypatch):
    """Import the forker's file (it registers 'best-attempt'); unregistered afterwards, so that
    the other test files see the repo's methods only."""
    import importlib
    import fork_variant
    importlib.reload(fork_variant)
    yield
    monkeypatch.delitem(registry.METHODS, "best-attempt")


@pytest.fixture
def four_tasks(monkeypatch):
    """A training pool of 4 tasks, so that every step meets tasks the memory holds."""
    real = envs.make_env

    def small(name, seed=0):
        env = real(name, seed)
        env.train_tasks = env.train_tasks[:4]
        return env
    monkeypatch.setattr(envs, "make_env", small)


def metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "times"} for r in rows]


def test_a_variant_from_outside_trains_checkpoints_and_resumes(tmp_path, base_in, variant, four_tasks, monkeypatch, capsys):
    base_in(tmp_path)
    assert "best-attempt" in registry.METHODS and train.parse_args(["--method", "best-attempt"]).method == "best-attempt"
    train.main([*ARGS, "--out_dir", str(tmp_path), "--name", "whole"])
    real_step = train.train_step

    def crash_after_3(run):
        eps = real_step(run)
        if run.step + 1 == 3:                                                   # the loop counts this step after it
            raise Crash
        return eps
    monkeypatch.setattr(train, "train_step", crash_after_3)
    with pytest.raises(Crash):
        train.main([*ARGS, "--out_dir", str(tmp_path), "--name", "cut"])
    monkeypatch.setattr(train, "train_step", real_step)
    train.main(["--resume", str(tmp_path / "cut")])
    assert "resumed at step 2, 32 episodes" in capsys.readouterr().out
    whole = metrics(tmp_path / "whole")
    assert [m["step"] for m in whole] == [0, 2, 4] and metrics(tmp_path / "cut") == whole
    # the memory is the method's state: checkpointed, restored, and used by the teacher
    a = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "cut" / "ckpt.pt", weights_only=False)
    assert a["state"] == b["state"] and len(a["state"]["best"]) == 4
    assert whole[-1]["remembered"] == 4.0 and whole[-1]["loss"] > 0  # the teacher had a context to distil
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    # the run's code fingerprint covers the forker's file too
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["code"] != train.CODE


def readme_fork():
    """The README's "Your own method": its variant's code and its commands."""
    section = open(os.path.join(ROOT, "README.md")).read().split("## Your own method", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    cmds = [line.split("  #")[0].strip() for block in section.split("```bash\n")[1:]
            for line in block.split("```", 1)[0].splitlines() if line.startswith("python")]
    return code, cmds


def test_a_variant_from_the_readme_alone_trains_resumes_and_is_benchmarked(tmp_path, base_in):
    """The README's fork section, as a newcomer takes it: its code saved in a folder outside the repo, its two
    commands run from the repo (tiny flags added): the variant trains, resumes from its run folder, and the bench
    compares it with lopd, paired on the same tasks."""
    code, cmds = readme_fork()
    variant = tmp_path / "elsewhere" / "my_variant.py"
    variant.parent.mkdir()
    variant.write_text(code)
    out = base_in(tmp_path / "runs")
    tiny = ["--batch", "16", "--eval_every", "2", "--eval_tasks", "8", "--teacher_eval", "8", *TINY_BASE, "--out_dir", str(out)]
    run = lambda argv: subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
    as_typed = lambda cmd: [str(variant) if t == "my_variant.py" else t for t in cmd.split()[1:]]
    train_cmd, bench_cmd = (next(c for c in cmds if c.startswith(p)) for p in ("python train.py", "python -m bench"))
    r = run([*as_typed(train_cmd), *tiny, "--episodes", "32"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "best-attempt-tooluse-s0: held-out reward" in r.stdout.splitlines()[-1]
    r = run(["train.py", "--resume", str(out / "best-attempt-tooluse-s0"), "--episodes", "64"])   # the plugin: from its config
    assert r.returncode == 0 and "resumed at step 2, 32 episodes" in r.stdout, r.stderr[-3000:]
    assert json.loads((out / "best-attempt-tooluse-s0" / "summary.json").read_text())["episodes"] == 64
    r = run([*as_typed(bench_cmd), "--seeds", "1", *tiny, "--episodes", "32", "--init_episodes", "16", "--cold_start_steps", "2"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    md = (out / "compare-tooluse" / "results.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| best-attempt | +"))   # the paired table's row
    assert re.search(r"\| [+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\] \|$", row), row   # lopd − best-attempt


def test_a_forkers_file_runs_with_one_command(tmp_path, base_in):
    """`python my_variant.py --method best-attempt`, for a file of one's own next to train.py (here PYTHONPATH
    stands for that), trains and ends with the summary line."""
    base_in(tmp_path)
    shutil.copy(os.path.join(ROOT, "tests", "fork_variant.py"), tmp_path / "my_variant.py")
    cmd = [sys.executable, str(tmp_path / "my_variant.py"), "--method", "best-attempt", "--episodes", "32", "--eval_every", "2",
           "--eval_tasks", "8", "--teacher_eval", "8", *TINY_BASE, "--out_dir", str(tmp_path)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "best-attempt-tooluse-s0: held-out reward" in out.stdout.splitlines()[-1]
    assert json.loads((tmp_path / "best-attempt-tooluse-s0" / "config.json").read_text())["plugin"] == str(tmp_path / "my_variant.py")


def test_the_readme_fork_example_is_the_tested_variant_and_takes_every_flag_it_reads(variant):
    """The code a forker copies first (README, "Your own method") is tests/fork_variant.py's, line for line, and
    train.py accepts each flag its method reads (its loss's, distill's, and its teacher's) with that method;
    another method's flag is still refused."""
    code, _ = readme_fork()
    source = open(os.path.join(ROOT, "tests", "fork_variant.py")).read()
    assert code.strip() == source[source.index("import train"):].strip() and len(source.splitlines()) <= 25
    flags = registry.METHODS["best-attempt"].flags
    assert {"divergence", "topk", "epochs", "teacher", "ema_rate"} <= set(flags)
    for name, f in flags.items():
        choices = f.metadata["choices"]
        value = [] if f.type is bool else [str(choices[-1] if choices else f.default)]
        assert getattr(train.parse_args(["--method", "best-attempt", f"--{name}", *value]), name) is not None
    with pytest.raises(SystemExit):
        train.parse_args(["--method", "best-attempt", "--margin", "0.1"])                  # LOPD's, not read here


def test_a_step_that_touches_no_counter_trains_to_the_end(tmp_path, base_in, monkeypatch, capsys):
    """The loop owns the counters: a step written from scratch that only plays a batch and returns it (no
    run.episodes, no run.step) ends at the budget, with an evaluation every --eval_every steps; a step that
    returns nothing is one line, exit status 2."""
    def play_only(run):
        return train.sample_batch(run, run.rng.sample(run.env.train_tasks, run.args.batch)).eps
    monkeypatch.setitem(registry.METHODS, "play-only", registry.Method(registry.distill, step=play_only))
    base_in(tmp_path)
    flags = ["--method", "play-only", "--batch", "8", "--episodes", "48", "--eval_every", "2", "--eval_tasks", "8",
             "--teacher_eval", "0", *TINY_BASE, "--out_dir", str(tmp_path)]
    train.main(flags)
    rows = metrics(tmp_path / "play-only-tooluse-s0")
    assert [(m["step"], m["episodes"]) for m in rows] == [(0, 0), (2, 16), (4, 32), (6, 48)]
    monkeypatch.setitem(registry.METHODS, "play-only", registry.Method(registry.distill, step=lambda run: None))
    with pytest.raises(SystemExit) as e:
        train.main([*flags, "--overwrite"])
    assert e.value.code == 2 and "returned None" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_fork_of_lopds_own_step(tmp_path, base_in, capsys):
    """tests/fork_lopd_step.py copies train.lopd_step whole and grades step 6 against θ after its update; its diff
    against lopd_step is the idea alone (≤ 15 lines). The copy is faithful: where θ's step is a no-op (lr 0) both take
    the same two steps from one checkpoint, θ, φ and β bit for bit; where θ moves, φ's steps differ, which no flag
    does; --compare plays both students every few steps and prints the paired interval."""
    import difflib
    import importlib
    import inspect
    import fork_lopd_step
    importlib.reload(fork_lopd_step)                                            # registers lopd-kl-after
    try:
        a, b = (inspect.getsource(f).splitlines() for f in (train.lopd_step, fork_lopd_step.lopd_kl_after_step))
        diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
        assert len(diff) <= 15, "\n".join(diff)
        out = base_in(tmp_path)
        os.makedirs(out / "ck")
        flags = ["--method", "lopd", "--batch", "8", "--eval_tasks", "8", "--teacher_eval", "8", "--init_episodes", "32",
                 "--cold_start_steps", "2", "--lr_composer", "1e-3", "--margin", "1", *TINY_BASE, "--out_dir", str(out),
                 "--name", "ck"]   # m = 1: Δ < m, so β > 0 from the second step, whatever the cold start's draw
        train.build(train.parse_args(flags))
        capsys.readouterr()
        ck = str(out / "ck")
        state = lambda run: ([p.detach().clone() for p in run.model.parameters()],
                             [p.detach().clone() for p in run.state["composer"].parameters()], run.state["beta"])
        for lr, steps, equal in ((0.0, 2, True), (None, 1, False)):   # θ frozen: 2 steps; θ moving: its first step
            after = []
            for name in ("lopd", "lopd-kl-after"):
                run = train.load_run(ck)
                run.method = registry.METHODS[name]
                for g in run.opt.param_groups:
                    g["lr"] = g["lr"] if lr is None else lr
                for _ in range(steps):
                    train.take_step(run)
                after.append(state(run))
            (t0, f0, b0), (t1, f1, b1) = after
            assert all(torch.equal(p, q) for p, q in zip(t0, t1))                   # the same students (step 5 comes first)
            assert all(torch.equal(p, q) for p, q in zip(f0, f1)) == equal and (b0 == b1 or not equal)
        runs, curves, gap = fork_lopd_step.compare(ck, steps=2, every=1, tasks=8)
        assert [s for s, _ in curves["lopd-kl-after"]] == [0, 1, 2] and runs[1].step == 2
        printed = capsys.readouterr().out
        assert "lopd-kl-after − lopd after 2 steps" in printed and gap[1] <= gap[0] <= gap[2], printed
    finally:
        registry.METHODS.pop("lopd-kl-after", None)
