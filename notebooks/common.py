"""What every notebook's first cell shares: the repo on the path, the caches `python train.py` and the notebooks
share (RUNS), which base (BASE: train.py's, or LOPD_WARMUP_SEED's draw), small PNG figures, and paired()."""
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..'))                                    # the repo root: train.py, envs.py, ...
warnings.filterwarnings('ignore', message='IProgress not found')               # tqdm.auto, imported by transformers

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

RUNS = os.path.abspath(os.environ.get('LOPD_NOTEBOOK_RUNS') or os.path.join(HERE, '..', 'runs'))
BASE = ['--warmup_seed', os.environ['LOPD_WARMUP_SEED']] if 'LOPD_WARMUP_SEED' in os.environ else []
plt.rcParams.update({'figure.dpi': 80, 'savefig.dpi': 80})
try:
    get_ipython().run_line_magic('config', "InlineBackend.figure_formats = ['png']")  # noqa: F821 (in a kernel)
except NameError:
    pass


def paired(a, b, n=2000, seed=0):
    """mean(a − b) over the same tasks and its 95% bootstrap interval (tasks resampled with replacement)."""
    d = np.asarray(a, float) - np.asarray(b, float)
    boots = d[np.random.default_rng(seed).integers(0, len(d), (n, len(d)))].mean(1)
    return d.mean(), np.quantile(boots, 0.025), np.quantile(boots, 0.975)
