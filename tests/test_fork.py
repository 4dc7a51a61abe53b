"""A variant registered from outside the repo's modules (tests/fork_variant.py, a forker's own
file: "the teacher is shown the student's own best earlier attempt at this task", with a
per-task memory) runs through train.py with no edit to any module, for a few steps and through
a crash between two checkpoints and a resume that ends with exactly the uninterrupted metrics.

The crash is in-process: an exception out of train_step after step 3, which leaves the run as
a SIGKILL would (no handler runs, nothing is saved); tests/test_reliability.py does the same
with real signals in a subprocess."""
import json
import os
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
        real_step(run)
        if run.step == 3:
            raise Crash
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


def test_a_forkers_file_runs_with_one_command(tmp_path, base_in):
    """`python my_variant.py --method best-attempt`, the README's command for a file of one's own (next to
    train.py; here PYTHONPATH stands for that), trains and ends with the summary line."""
    base_in(tmp_path)
    shutil.copy(os.path.join(ROOT, "tests", "fork_variant.py"), tmp_path / "my_variant.py")
    cmd = [sys.executable, str(tmp_path / "my_variant.py"), "--method", "best-attempt", "--episodes", "32", "--eval_every", "2",
           "--eval_tasks", "8", "--teacher_eval", "8", *TINY_BASE, "--out_dir", str(tmp_path)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "best-attempt-tooluse-s0: held-out reward" in out.stdout.splitlines()[-1]


def test_the_readme_fork_example_is_the_tested_variant():
    """The code a forker copies first (README, "Your own method") is tests/fork_variant.py's, line for line."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    readme = open(os.path.join(root, "README.md")).read()
    block = readme.split("## Your own method", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    variant = open(os.path.join(root, "tests", "fork_variant.py")).read()
    assert block.strip() == variant[variant.index("import train"):].strip()
    assert len(variant.splitlines()) <= 25


def test_a_fork_of_lopds_own_step(tmp_path, base_in, capsys):
    """tests/fork_lopd_step.py copies train.lopd_step whole, changes one line of block 6 (w centred on the batch)
    and registers it with `step=`. The copy is faithful: with LOPD's own w centred too (--advantage centered) both
    take the same two steps from one checkpoint, θ, φ and β bit for bit; with the paper's w, φ's second step
    differs (β is 0 at the first, and above 0 at the second: m = 1 > Δ); --compare's paired interval is printed."""
    import importlib
    import fork_lopd_step
    importlib.reload(fork_lopd_step)                                            # registers lopd-centred-w
    try:
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
        same = []
        for name in ("lopd", "lopd-centred-w"):
            run = train.load_run(ck)
            run.args.advantage = "centered"
            for _ in range(2):
                run.lap()
                registry.METHODS[name].step(run)
            same.append(state(run))
        (t0, f0, b0), (t1, f1, b1) = same
        assert all(torch.equal(p, q) for p, q in zip(t0, t1)) and all(torch.equal(p, q) for p, q in zip(f0, f1)) and b0 == b1
        runs, gap = fork_lopd_step.compare(ck, steps=2, tasks=8)
        f0, f1 = ([p.detach() for p in r.state["composer"].parameters()] for r in runs)
        assert not all(torch.equal(p, q) for p, q in zip(f0, f1))
        printed = capsys.readouterr().out
        assert "lopd-centred-w − lopd after 2 steps" in printed and gap[1] <= gap[0] <= gap[2], printed
    finally:
        registry.METHODS.pop("lopd-centred-w", None)
