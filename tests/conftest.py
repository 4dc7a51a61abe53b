"""Test-session plumbing shared by the test files.

- The tiny warmed-up base most run tests start from (TINY_BASE), built once per test worker
  and copied into each test's run folder (`base_in`): a 60-step warm-up ends its turns with
  <|eot|> and answers, so the tests' rollouts are a few dozen tokens instead of every turn
  cut at max_action_tokens, which made decoding most of a tiny run's time.
- The longest test modules are scheduled first, so that with one worker per core
  (pytest.ini) the short ones fill in around them."""
import contextlib
import glob
import io
import os
import shutil
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TINY_BASE = ["--d_model", "32", "--n_layer", "1", "--warmup_steps", "60", "--warmup_batch", "32", "--warmup_lr", "1e-2"]
# xdist hands each worker two modules to start with; the notebooks that build their base go
# first, with a short module as their second, and the last notebook once the base is built
LONGEST_FIRST = ["test_smollm2.py", "TestNotebooksFirst", "test_real_models.py", "test_reliability.py", "test_memory.py", "test_retrieval.py", "test_cli.py", "test_bench.py",
                 "TestNotebooksRest", "test_variants.py", "test_hf_model.py", "test_methods.py", "test_rollout.py", "test_fork.py"]


def cpu_bf16_attention():
    """Does torch's CPU attention run in bf16 here? Under ATEN_CPU_CAPABILITY=default on a CPU with AVX512-BF16 or AMX,
    torch 2.14's flash-attention kernel raises ('pack_vnni2 is only supported when avx512 is supported'): a limit of
    torch's kernels forced to no SIMD, not of this repo (a bf16 run there would stop at its first forward)."""
    import torch
    q = torch.zeros(2, 4, 64, 32, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return True
    except RuntimeError:
        return False


NEEDS_CPU_BF16 = pytest.mark.skipif(not cpu_bf16_attention(), reason="torch's CPU attention cannot run in bf16 under "
                                    "these kernels (ATEN_CPU_CAPABILITY=default on an AVX512-BF16 CPU): conftest.cpu_bf16_attention")


def shared_folder(tmp_path_factory, name):
    """A folder every test worker of this session sees (under xdist each worker has a basetemp of
    its own; their parent is the session's)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    os.makedirs(folder, exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """-> the warm-up cache file of TINY_BASE, built as `python train.py ... TINY_BASE` would, once per
    test session (a file lock: the first worker to ask builds it, the others load it)."""
    import filelock
    sys.path.insert(0, ROOT)
    import torch
    import envs
    import train
    import warmup
    folder = shared_folder(tmp_path_factory, "tiny-base")
    args = train.parse_args(TINY_BASE + ["--out_dir", str(folder)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with filelock.FileLock(folder / "base.lock"):
        env = envs.make_env(args.env)
        tok, model = warmup.load_model(args, env)  # as train.build does
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            path, _ = warmup.warmup(args, tok, model, env, "cpu")
    torch.set_num_threads(threads)
    return path


@pytest.fixture(scope="session")
def base_in(tiny_base):
    """base_in(folder): put the tiny base's caches (its warm-up and its tokenizer's merges) in a run
    folder's out_dir; -> the folder."""
    def put(folder):
        os.makedirs(folder, exist_ok=True)
        for f in [tiny_base, *glob.glob(os.path.join(os.path.dirname(tiny_base), "bpe-*.json"))]:
            shutil.copy(f, folder)
        return folder
    return put


def pytest_collection_modifyitems(session, config, items):
    if not os.environ.get("LOPD_SLOW"):  # the slow tier: CI runs it after the README's command (-m slow)
        skip = pytest.mark.skip(reason="the slow tier is opt-in: LOPD_SLOW=1 python -m pytest tests -q -m slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    where = lambda item: rank.get(getattr(item.cls, "__name__", None), rank.get(item.path.name, len(rank)))
    items.sort(key=where)  # stable: the order within a module stays


def base_flags():
    """The notebooks' base and the base tier's: train.py's default, or another draw (LOPD_WARMUP_SEED=W), as the
    notebooks read it."""
    return ["--warmup_seed", os.environ["LOPD_WARMUP_SEED"]] if "LOPD_WARMUP_SEED" in os.environ else []


def shared_base(runs):
    """The notebooks' one base in `runs`: train.py's default, the shipped one, which needs no building; another
    draw (LOPD_WARMUP_SEED) built once (a file lock: the notebooks may run on several test workers at once), exactly
    as `python train.py` would. -> runs."""
    import filelock
    import torch
    sys.path.insert(0, ROOT)
    import envs
    import train
    import warmup
    os.makedirs(runs, exist_ok=True)
    with filelock.FileLock(os.path.join(runs, "base.lock")):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        args = train.parse_args(["--out_dir", runs, *base_flags()])
        env = envs.make_env(args.env)
        tok, model = warmup.load_model(args, env)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            warmup.warmup(args, tok, model, env, "cpu")
        torch.set_num_threads(threads)
    return runs


@pytest.fixture(scope="session")
def default_base(tmp_path_factory):
    """A folder every test worker of this session sees, with `python train.py`'s default base built in it once:
    the notebooks' caches (tests/test_notebooks.py) and the base tier's (tests/test_base.py)."""
    return shared_base(str(shared_folder(tmp_path_factory, "notebook-runs")))


# the base tier's run (tests/test_base.py), whose teacher gap notebook 4 must find too: train.py from the notebooks' base,
# evaluated at the base after LOPD's setup (one training step follows, which nothing reads)
BASE_GAP = ["--method", "lopd", "--setup_free", "--episodes", "16", "--eval_tasks", "500", "--teacher_eval", "100",
            "--eval_samples", "0", "--overwrite"]


@pytest.fixture(scope="session")
def base_gap(default_base):
    """-> (summary.json, stdout) of the base tier's run in the notebooks' runs folder, run once per test session (a
    file lock: the base tier and notebook 4 may ask on two workers)."""
    import filelock
    import json
    import subprocess
    name = f"base-gap-w{base_flags()[1] if base_flags() else 'shipped'}"
    with filelock.FileLock(os.path.join(default_base, "base-gap.lock")):
        log = os.path.join(default_base, name + ".log")
        if not os.path.exists(log):
            out = subprocess.run([sys.executable, "train.py", *base_flags(), *BASE_GAP, "--out_dir", default_base,
                                  "--name", name], cwd=ROOT, capture_output=True, text=True, timeout=1800)
            assert out.returncode == 0, out.stderr[-2000:]
            with open(log, "w") as f:
                f.write(out.stdout)
    with open(os.path.join(default_base, name, "summary.json")) as f, open(log) as g:
        return json.load(f), g.read()
