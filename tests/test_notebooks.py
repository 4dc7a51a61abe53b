"""The notebooks still run (STYLE: "notebooks teach, modules run").

Every notebook in notebooks/ is executed top to bottom in a fresh `python3` kernel, with
notebooks/ as the working directory (as when a reader opens it in Jupyter); a cell that
raises fails the test. Each notebook takes about a minute on 2 CPU cores. The executed
copy stays in memory: the committed outputs are not touched. The three share one warmed-up base:
the first builds it, the others load it (so they run in order). To refresh them after a
change to the code, run

    python tests/test_notebooks.py            # every notebook, outputs written in place
    python tests/test_notebooks.py notebooks/02_on_policy_self_distillation.ipynb

A static check also holds every notebook to the house style: every figure is followed
by a one-sentence markdown caption that starts with "What to see", and the committed
file stays small enough to read on GitHub.
"""
import glob
import os
import sys
import tempfile
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
NB_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NB_DIR, "*.ipynb")))
MAX_BYTES = 500_000


RUNS = tempfile.mkdtemp(prefix="lopd-nb-")  # the caches the notebooks share (one warm-up per test run)


def execute(path):
    """Run a notebook in a fresh kernel, cwd = notebooks/; -> the executed notebook. The
    notebooks cache their shared base in LOPD_NOTEBOOK_RUNS (runs/notebooks/ for a reader):
    here a fresh temporary folder, so the first notebook builds it and the others load it."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": NB_DIR}})
    # one BLAS thread for the kernel: the models are tiny, and on a shared 2-core machine
    # extra threads only spin against each other (the notebooks also call
    # torch.set_num_threads(1)); the env goes to the kernel's start, not to this process
    client.execute(env={**os.environ, "OMP_NUM_THREADS": "1", "LOPD_NOTEBOOK_RUNS": RUNS})
    return nb


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path):
    t0 = time.time()
    nb = execute(path)  # raises CellExecutionError, naming the cell, if any cell fails
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    print(f"{os.path.basename(path)}: {time.time() - t0:.0f} s")


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
    for path in sys.argv[1:] or NOTEBOOKS:
        t0 = time.time()
        nb = execute(path)
        nbformat.write(nb, path)
        print(f"{os.path.relpath(path, ROOT)}: executed in {time.time() - t0:.0f} s, "
              f"{os.path.getsize(path) / 1e3:.0f} kB")
