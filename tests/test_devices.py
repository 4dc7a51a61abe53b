"""A CPU test that catches device mistakes: with torch's default device set to `meta`, any tensor made
without an explicit device is a meta tensor, and the first time it meets a real one (an index, a copy,
an arithmetic op) torch raises. Two steps and an evaluation of LOPD and two baselines run so, on CPU:
what passes here puts every tensor where the model is, as a CUDA run needs."""
import contextlib
import io
import os
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import train  # noqa: E402
from conftest import TINY_BASE  # noqa: E402

OWN = {"lopd": ["--init_episodes", "8", "--cold_start_steps", "1"], "grpo": [], "sdpo": []}


@pytest.mark.parametrize("method", list(OWN))
def test_no_tensor_is_made_without_a_device(method, base_in, tmp_path):
    out = base_in(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run = train.build(train.parse_args(["--method", method, "--batch", "8", "--eval_tasks", "4", "--teacher_eval", "2",
                                            "--eval_samples", "1", *OWN[method], *TINY_BASE, "--out_dir", str(out)]))
    torch.set_default_device("meta")
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            for _ in range(2):
                train.take_step(run)
            train.evaluate(run)
    finally:
        torch.set_default_device(None)
    assert run.step == 2 and all(p.device.type == "cpu" for p in run.model.parameters())


def test_the_trick_catches_a_tensor_made_without_a_device():
    torch.set_default_device("meta")
    try:
        stray = torch.tensor([True, False])
        with pytest.raises((NotImplementedError, RuntimeError)):
            torch.ones(2, 3, device="cpu") * stray[:, None].to(torch.ones(1, device="cpu"))
    finally:
        torch.set_default_device(None)
