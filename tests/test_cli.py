"""The command line: bad arguments fail fast with one clear line, -h lists every flag in its
group, and tiny smoke runs of lopd (as a program, `python train.py`), grpo and opsd (in this
process, through train.main, as a notebook calls it) write everything a run promises.

A process starts by importing torch + transformers (~4 s of CPU), so only the lopd run is
one; while it builds and caches the warm-up, the bad argument and -h run in this process. OMP_NUM_THREADS=1:
these models are tiny, and on a shared 2-core machine extra BLAS threads only spin against
each other."""
import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import train  # noqa: E402
from conftest import NEEDS_CPU_BF16, TINY_BASE  # noqa: E402
from plumbing import registry  # noqa: E402

torch.set_num_threads(1)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TINY = ["--batch", "16", *TINY_BASE, "--eval_every", "2", "--eval_tasks", "24", "--teacher_eval", "8"]
OWN = {"lopd": ["--init_episodes", "16", "--cold_start_steps", "2"], "opsd": ["--pool_episodes", "16"]}  # flags only that method reads


def start(args, logs, key):
    """Start `python train.py ARGS`, its stdout and stderr going to files (no pipe can fill up
    while we wait on another process)."""
    key = key.replace(" ", "-")
    out, err = open(logs / f"{key}.out", "w"), open(logs / f"{key}.err", "w")
    p = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=ENV, text=True, stdout=out, stderr=err)
    out.close(), err.close()
    return p


def finish(p, logs, key, timeout=180):
    """-> (exit status, stdout, stderr)."""
    p.wait(timeout=timeout)
    key = key.replace(" ", "-")
    return p.returncode, (logs / f"{key}.out").read_text(), (logs / f"{key}.err").read_text()


BAD = {  # arguments -> words the one error line must contain (more cases below)
    "method": (["--method", "nope"], ["--method", "nope"]),
}


EPISODES = {"lopd": 48, "grpo": 32, "opsd": 48}  # lopd, opsd: 16 bank- or pool-filling episodes + 2 steps of 16


@pytest.fixture(scope="session")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def in_process(argv):
    """train.main(argv) in this process, as a user would see it -> (exit status, stdout, stderr)."""
    out, err, rc = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def procs(out_dir, tmp_path_factory):
    """The runs of this file -> {key: (exit status, stdout, stderr)}: the lopd smoke run as a
    program (`python train.py`, which builds and caches the warm-up), and, in this process
    (no 4 s interpreter start each) while it runs, a bad argument and -h; then grpo and opsd
    on the cached base and a resume of the finished grpo run. Also leaves a snapshot
    <method>.done of each finished run folder, before the resume touches grpo's."""
    logs = tmp_path_factory.mktemp("logs")

    def smoke(m):
        return [*TINY, *OWN.get(m, []), "--method", m, "--episodes", str(EPISODES[m]), "--out_dir", str(out_dir)]

    def snapshot(m):
        if (out_dir / f"{m}-tooluse-s0").is_dir():
            shutil.copytree(out_dir / f"{m}-tooluse-s0", out_dir / f"{m}.done")

    lopd = start(smoke("lopd"), logs, "lopd")
    res = {k: in_process(args) for k, (args, _) in BAD.items()}
    res["help"] = in_process(["-h"])
    res["lopd"] = finish(lopd, logs, "lopd")
    snapshot("lopd")
    for m in ["grpo", "opsd"]:
        res[m] = in_process(smoke(m))
        snapshot(m)
    # the finished grpo run, resumed in place with a bigger budget: one more step of 16
    res["grpo resumed"] = in_process(["--resume", str(out_dir / "grpo-tooluse-s0"), "--episodes", "48"])
    return res


@pytest.mark.parametrize("case", list(BAD))
def test_bad_argument_exits_2_with_one_line(procs, case):
    rc, out, err = procs[case]
    assert rc == 2, (out, err)
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for word in BAD[case][1]:
        assert word in lines[0], lines[0]


def test_help_lists_every_flag_in_groups(procs):
    rc, out, err = procs["help"]
    assert rc == 0 and "Traceback" not in err
    for f in dataclasses.fields(train.config_class()):
        assert f"--{f.name}" in out, f.name
    assert all(m in out for m in registry.METHODS)
    # the run, the model and warm-up, then each set of methods' own flags, with the flags under their group
    groups = [line for line in out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert groups[1:4] == ["the run:", "the model and the warm-up:", "only for lopd, trajtext, opsd, sdpo, sdft, sod, acsd:"]
    assert "only for lopd:" in groups and "only for skillsd:" in groups and "only for acsd:" in groups
    lopd_only = out[out.index("only for lopd:"):]
    assert "--margin" in lopd_only.split("\n\n")[0] and "--k3_coef" not in lopd_only.split("\n\n")[0]


@pytest.mark.parametrize("argv,words", [
    (["--steps", "-1"], ["--steps"]),                                         # an unknown flag
    (["--episodes", "-1"], ["--episodes", "-1"]),
    (["--resume", "/no/such/path"], ["--resume", "/no/such/path"]),
    (["--batch", "6", "--method", "grpo"], ["--batch", "6", "4"]),
    (["--divergence", "foo"], ["--divergence", "foo"]),
    (["--batch", "lots"], ["--batch", "lots"]),
    (["--batch", "0"], ["--batch", "0"]),
    (["--K", "-1"], ["--K", "-1"]),
    (["--J", "0"], ["--J"]),
    (["--device", "tpu"], ["--device", "tpu"]),
    (["--topk", "-3"], ["--topk"]),
    # incompatible or malformed (issue 6)
    (["--dtype", "fp16"], ["--dtype", "fp16"]),
    (["--freeze_composer", "--method", "grpo"], ["--freeze_composer", "lopd"]),
    (["--margin", "0", "--freeze_composer"], ["--margin", "without --freeze_composer"]),  # read by nothing with φ frozen
    (["--allow_same_task", "--method", "opsd"], ["--allow_same_task", "opsd"]),
    (["--model", "./no/such/model"], ["--model", "./no/such/model"]),
    (["--model", "/no/such/model.gguf"], ["--model", "/no/such/model.gguf", "file"]),
    (["--margin", "0.1", "--method", "grpo"], ["--margin", "lopd", "grpo"]),   # a flag of another method
    (["--teacher", "ema"], ["--teacher", "lopd"]),                             # LOPD's teacher is θ0 only
    (["--ema_rate", "1.5", "--method", "sdpo"], ["--ema_rate", "1.5"]),
    (["--warmup_ctx", "1.5"], ["--warmup_ctx", "1.5"]),
    (["--max_skips", "0"], ["--max_skips"]),
])
def test_more_bad_arguments_in_process(capsys, argv, words):
    """The same check, in-process (no 4 s interpreter start each)."""
    with pytest.raises(SystemExit) as e:
        train.parse_args(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and all(w in lines[0] for w in words), err


def test_resume_from_a_corrupt_checkpoint_is_one_line(tmp_path, capsys):
    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(tmp_path)])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "resume" in lines[0] and str(bad) in lines[0], lines


# ----------------------------------------------------------------------------- smoke runs

@pytest.fixture(scope="module")
def smoke(out_dir, procs):
    return out_dir, procs


@pytest.mark.parametrize("method", ["lopd", "grpo", "opsd"])
def test_smoke_run_writes_the_run_folder(smoke, method):
    out_dir, res = smoke
    rc, out, err = res[method]
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err
    name = f"{method}-tooluse-s0"
    run = out_dir / f"{method}.done"
    for f in ["config.json", "metrics.jsonl", "summary.json", "curve.png", "ckpt.pt"]:
        assert (run / f).is_file(), f
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["method"] == method and cfg["episodes"] == EPISODES[method] and cfg["d_model"] == 32 and cfg["name"] == name
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) >= 2
    for m in metrics:
        assert 0.0 <= m["success"] <= 1.0 and isinstance(m["episodes"], int)
    assert [m["episodes"] for m in metrics] == sorted(m["episodes"] for m in metrics)
    summary = json.loads((run / "summary.json").read_text())
    for k in ["method", "env", "seed", "episodes", "base_success", "final_success", "wall_seconds"]:
        assert k in summary, k
    assert summary["method"] == method and summary["env"] == "tooluse" and summary["seed"] == 0
    assert summary["episodes"] == metrics[-1]["episodes"] == EPISODES[method]
    assert summary["base_success"] == metrics[0]["success"]
    assert summary["final_success"] == metrics[-1]["success"]
    assert summary["wall_seconds"] > 0
    assert (run / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = torch.load(run / "ckpt.pt", map_location="cpu", weights_only=False)
    assert ckpt["episodes"] == summary["episodes"] and "model" in ckpt
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"{name}: held-out reward") and f"after {summary['episodes']} episodes" in last
    assert str(out_dir / name) in last
    if method != "lopd":
        assert "warm-up: cached" in out  # every method starts from the same cached base
    if method in ("lopd", "opsd"):
        assert "teacher_reward" in metrics[-1] and "teacher_success" in metrics[-1]  # --teacher_eval 8
        # the base is evaluated after the setup, so its teacher reads the context the setup built (a bank, a pool)
        assert out.index("setup: ") < out.index("base model: ") and "teacher_reward" in metrics[0]
        assert metrics[0]["episodes"] == summary["setup_episodes"] > 0 and metrics[0]["training_episodes"] == 0
    if method == "lopd":
        assert {"bank", "composer", "composer0", "opt_phi", "beta"} <= set(ckpt["state"])


def test_resume_continues_the_run(smoke):
    out_dir, res = smoke
    rc, out, err = res["grpo resumed"]
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert "resumed at step 2, 32 episodes" in out
    run = out_dir / "grpo-tooluse-s0"  # the saved config wins (name, method, ...) except the budget
    before = [json.loads(x) for x in (out_dir / "grpo.done" / "metrics.jsonl").read_text().splitlines()]
    after = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert after[:len(before)] == before and len(after) == len(before) + 1
    assert after[-1]["episodes"] == 48 and after[-1]["step"] == 3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["method"] == "grpo" and summary["episodes"] == 48
    assert summary["base_success"] == before[0]["success"]
    assert torch.load(run / "ckpt.pt", map_location="cpu", weights_only=False)["episodes"] == 48


def test_smoke_runs_share_one_base(smoke):
    """The warm-up cache is the same file for every method, and every run's first eval
    (the base model) is the same number."""
    out_dir, res = smoke
    assert len(list(out_dir.glob("warmup-*.pt"))) == 1
    base = {m: json.loads((out_dir / f"{m}.done" / "summary.json").read_text())["base_success"]
            for m in EPISODES}
    assert len(set(base.values())) == 1


def strict_json(line):
    def refuse(c):
        raise ValueError(f"{c} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_metrics_are_strict_json(smoke):
    out_dir, _ = smoke
    for m in [f"{m}.done" for m in EPISODES] + ["grpo-tooluse-s0"]:
        for line in (out_dir / m / "metrics.jsonl").read_text().splitlines():
            strict_json(line)
        strict_json((out_dir / m / "summary.json").read_text())


def test_lopd_smoke_run_skips_no_update(smoke):
    out_dir, _ = smoke
    summary = json.loads((out_dir / "lopd.done" / "summary.json").read_text())
    assert summary["skipped_updates"] == 0


def test_resume_a_moved_run_writes_into_that_folder(smoke, tmp_path, capsys):
    """In-process (no interpreter start): resume a copy of the finished grpo run elsewhere.
    Runs last in this file: the bug it shows writes into the session's grpo folder."""
    out_dir, _ = smoke
    moved = tmp_path / "moved"
    shutil.copytree(out_dir / "grpo-tooluse-s0", moved / "grpo-tooluse-s0")
    shutil.copy(next(out_dir.glob("warmup-*.pt")), moved)
    old = signal.getsignal(signal.SIGTERM)
    try:
        train.main(["--resume", str(moved / "grpo-tooluse-s0"), "--episodes", "64"])
    finally:
        signal.signal(signal.SIGTERM, old)
    summary = json.loads((moved / "grpo-tooluse-s0" / "summary.json").read_text())
    assert summary["episodes"] == 64


def test_an_environments_own_defaults_apply_unless_the_flag_is_given(monkeypatch):
    import envs
    assert envs.ENVS["codegen"].defaults == {"cold_start": "text", "cold_start_steps": 300, "warmup_steps": 500, "warmup_batch": 64}
    assert envs.ENVS["tooluse-v1"].defaults == {"cold_start": "text", "cold_start_steps": 0, "warmup_steps": 500, "warmup_batch": 64}
    assert envs.ToolUse.defaults == {}
    plain = train.parse_args([])
    a = train.parse_args(["--env", "codegen"])
    assert (a.cold_start, a.cold_start_steps) == ("text", 300) and (plain.cold_start, plain.cold_start_steps) == ("nll", 150)
    assert train.parse_args(["--env", "tooluse-v1"]).cold_start_steps == 0  # their numbers: measured before the NLL default
    assert (a.warmup_batch, plain.warmup_batch) == (64, 32)  # codegen's numbers were measured on 64 demos a step
    assert train.parse_args(["--env", "tooluse-v1", "--warmup_batch", "8"]).warmup_batch == 8
    assert train.parse_args(["--env", "codegen", "--cold_start_steps", "7"]).cold_start_steps == 7
    monkeypatch.setattr(envs.ENVS["codegen"], "defaults", {"episodes": 99, "cold_start_steps": 5})
    a = train.parse_args(["--env", "codegen", "--episodes=12"])
    assert (a.episodes, a.cold_start_steps) == (12, 5)
    assert dataclasses.asdict(train.parse_args(["--env", "codegen", "--episodes", "99", "--cold_start_steps", "5"])) == \
        dataclasses.asdict(train.parse_args(["--env", "codegen"]))  # the saved config holds the values used


@NEEDS_CPU_BF16
@pytest.mark.slow
def test_the_gpu_check_script_runs_on_cpu(tmp_path):
    """scripts/gpu_check.sh, the script a GPU machine runs, with small shapes on CPU: every check that
    needs no GPU passes (bf16 log-probs, cached decoding, tokens/s reported, 2 steps of LOPD, SDPO, GRPO with
    --grad_ckpt, φ moving under bf16 and the bf16 teacher reading it moved, resume equal to a run in one go), and the
    GPU-only rows (memory, each of LOPD's phases' peak, NCCL) say they were skipped."""
    from bench import gpu_check
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--quick", "--out", str(tmp_path)], cwd=ROOT, env=ENV, text=True,
                       capture_output=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    table = {line.split(" | ")[0].strip("| "): line.split(" | ")[1] for line in p.stdout.splitlines() if line.startswith("| ")}
    for check in ("logprobs", "decoding", "tokens/s", "tokens/s lora", "train lopd", "phi", "teacher reads", "train sdpo", "train grpo", "resume"):
        assert table[check] == "ok", p.stdout
    assert table["memory lopd"] == table["torchrun"] == "skipped" and "the GPU parts are skipped" in p.stdout
    assert all(table[f"peak {phase}"] == "skipped" for phase in gpu_check.PHASES), p.stdout   # every phase, reported


def test_a_gguf_file_given_by_its_path_passes_the_checks(tmp_path):
    """--model /path/to/model.gguf names a file, not a folder: the check accepts it (loading is transformers')."""
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert train.parse_args(["--model", str(f)]).model == str(f)


@pytest.mark.parametrize("argv,words", [
    (["--method", "opsd", "--episodes", "96"], ["--episodes 96", "512", "--pool_episodes", "--setup_free"]),
    (["--episodes", "100", "--init_episodes", "128"], ["--episodes 100", "--init_episodes 128"]),
])
def test_a_budget_the_setup_spends_whole_is_refused_before_anything_runs(argv, words):
    """It would train nothing and end with the usual summary line: one line, exit 2 (issue 52)."""
    rc, out, err = in_process(argv)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and all(w in err for w in words), err
