"""The notebooks still run (STYLE: "notebooks teach, modules run").

Every notebook in notebooks/ is executed top to bottom in a fresh `python3` kernel, with
notebooks/ as the working directory (as when a reader opens it in Jupyter); a cell that
raises fails the test. Each notebook takes about a minute on 2 CPU cores. The executed
copy stays in memory: the committed outputs are not touched. The three share one warmed-up base,
built once per test session before the first of them runs (a file lock guards it, should
they ever run on several test workers at once). To refresh them after a change to the code, run

    python tests/test_notebooks.py            # every notebook, outputs written in place
    python tests/test_notebooks.py notebooks/02_on_policy_self_distillation.ipynb

A static check also holds every notebook to the house style: every figure is followed
by a one-sentence markdown caption that starts with "What to see", and the committed
file stays small enough to read on GitHub.
"""
import glob
import os
import re
import sys
import tempfile
import time

import pytest
from conftest import shared_folder

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
NB_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NB_DIR, "*.ipynb")))
MAX_BYTES = 500_000


BASE = dict(d_model=64, n_layer=2, warmup_steps=300, warmup_batch=64, warmup_lr=4e-3, warmup_ctx=0.4)  # as they say


def shared_base(runs):
    """Build the notebooks' one warmed-up base into `runs` once (a file lock: the notebooks may
    run on several test workers at once), exactly as the first notebook would: torch's seed
    1234 before the model's init, one thread. -> runs."""
    import contextlib
    import io

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
        args, env = train.Args(**BASE, out_dir=runs), envs.make_env("tooluse-v1")
        tok, model = warmup.load_model(args, env)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            warmup.warmup(args, tok, model, env, "cpu")
        torch.set_num_threads(threads)
    return runs


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """The caches the notebooks share (LOPD_NOTEBOOK_RUNS; runs/notebooks/ for a reader), in a
    folder every test worker of this session sees, with the base built in it once."""
    return shared_base(str(shared_folder(tmp_path_factory, "notebook-runs")))


def execute(path, runs):
    """Run a notebook in a fresh kernel, cwd = notebooks/; -> the executed notebook. The
    notebooks cache their shared base in LOPD_NOTEBOOK_RUNS; here it is already built, so
    each loads it and the three can run side by side."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": NB_DIR}})
    # one BLAS thread for the kernel: the models are tiny, and on a shared 2-core machine
    # extra threads only spin against each other (the notebooks also call
    # torch.set_num_threads(1)); the env goes to the kernel's start, not to this process
    client.execute(env={**os.environ, "OMP_NUM_THREADS": "1", "LOPD_NOTEBOOK_RUNS": runs})
    return nb


def facts_02(out):
    """The distillation loss of one forward per role equals the per-prefix loop, for each divergence."""
    rows = re.findall(r"(\w+): one forward per role ([\d.]+)\s+per-prefix loop ([\d.]+)", out)
    assert {k for k, _, _ in rows} == {"rkl", "fkl", "jsd"} and all(a == b for _, a, b in rows), rows


def facts_03(out):
    """LOPD's teacher prefix: <|bos|><|ctx|>past: and J·(K latents + a newline), J = 3, K = 4."""
    assert "teacher prefix: (19, 64) = <|bos|><|ctx|>past: (4 tokens) + J*(K + 1)" in out


def facts_04(out):
    """The step by hand: its shapes, Δ by hand = lopd.composer_loss's, and the same θ, φ, β, bank as train_step."""
    n, k = map(int, re.search(r"z \((\d+), 64\) = \(Σ_i J_i · K, d\) = \((\d+) · 4, 64\)", out).groups())
    assert n == 4 * k
    assert "teacher prefix (19, 64) = 4 framing tokens + J·(K + 1) = 3·(4 + 1)" in out
    by_hand, by_loss = re.search(r"Δ by hand ([-+\d.]+), lopd.composer_loss's Δ ([-+\d.]+)", out).groups()
    assert by_hand == by_loss
    assert "student θ identical: True; composer φ identical: True" in out


FACTS = {"02_on_policy_self_distillation.ipynb": facts_02, "03_latent_privileged_context.ipynb": facts_03,
         "04_one_lopd_step_by_hand.ipynb": facts_04}  # what each notebook shows, checked on what it printed


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


def runs_top_to_bottom(path, runs):
    t0 = time.time()
    nb = execute(path, runs)  # raises CellExecutionError, naming the cell, if any cell fails
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    FACTS.get(os.path.basename(path), lambda out: None)(printed)
    print(f"{os.path.basename(path)}: {time.time() - t0:.0f} s")


# Two classes, i.e. two units of work under pytest-xdist (--dist loadscope): the first notebooks
# on one worker, which builds their shared base first; the rest later, on whichever worker is
# free by then (tests/conftest.py orders them), when the base is built.
class TestNotebooksFirst:
    @pytest.mark.parametrize("path", NOTEBOOKS[:2], ids=os.path.basename)
    def test_runs(self, path, runs):
        runs_top_to_bottom(path, runs)


class TestNotebooksRest:
    @pytest.mark.parametrize("path", NOTEBOOKS[2:], ids=os.path.basename)
    def test_runs(self, path, runs):
        runs_top_to_bottom(path, runs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_style(path):
    """Committed outputs: every figure captioned right after its cell, no error outputs,
    modules imported rather than copied, and a modest file size."""
    nb = nbformat.read(path, as_version=4)
    cells = nb.cells
    n_figures = 0
    for i, c in enumerate(cells):
        if c.cell_type != "code":
            continue
        outs = c.get("outputs", [])
        assert all(o.output_type != "error" for o in outs), f"cell {i} was committed with an error"
        if any("image/png" in o.get("data", {}) for o in outs):
            n_figures += 1
            nxt = cells[i + 1] if i + 1 < len(cells) else None
            assert nxt is not None and nxt.cell_type == "markdown" and nxt.source.lstrip().startswith("What to see"), \
                f"the figure of cell {i} needs a 'What to see: ...' markdown caption right after it"
    assert n_figures > 0, "no executed figures: run python tests/test_notebooks.py to refresh the outputs"
    source = "\n".join(c.source for c in cells if c.cell_type == "code")
    assert "import train" in source and "import envs" in source
    assert os.path.getsize(path) < MAX_BYTES, f"{path} is {os.path.getsize(path):,} bytes"


if __name__ == "__main__":  # refresh the committed outputs in place
    runs = shared_base(tempfile.mkdtemp(prefix="lopd-nb-"))
    for path in sys.argv[1:] or NOTEBOOKS:
        t0 = time.time()
        nb = execute(path, runs)
        nbformat.write(nb, path)
        print(f"{os.path.relpath(path, ROOT)}: executed in {time.time() - t0:.0f} s, "
              f"{os.path.getsize(path) / 1e3:.0f} kB")
