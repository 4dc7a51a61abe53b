"""What would fail or mislead a first run on a GPU, checked on the CPU (no GPU is lent to the tests):

- the GPU check's resume row: bit for bit on CPU, within a stated tolerance on CUDA (whose attention backward sums
  in no fixed order, so a healthy resume would read FAILED bit for bit);
- a run says what it computes on: the device, the dtype and the torch, first thing and in summary.json, and why
  not CUDA where a CUDA build of torch sees no device (it would train on the CPU in silence);
- the reading of retrieved experiences runs the LM head on one position only, --micro_batch rows at a time (every
  position's logits at V = 151,936 are GiBs for an evaluation's 100 rows);
- a bf16 --model: the bench's teacher gap runs under the run's autocast (it decoded float32 latents into a bf16
  model), a trained reader is a float32 copy (master weights), and LoRA's weights stay float32 on bf16 weights."""
import contextlib
import io
import json
import os
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import model as M  # noqa: E402
import tiny_hf  # noqa: E402
import tokenizer  # noqa: E402
import train  # noqa: E402
from bench import gap, gpu_check  # noqa: E402
from conftest import NEEDS_CPU_BF16, TINY_BASE  # noqa: E402
from plumbing import parallel  # noqa: E402

torch.set_num_threads(1)


def test_resume_is_compared_bit_for_bit_on_cpu_and_within_a_tolerance_on_cuda():
    torch.manual_seed(0)
    a = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    rounding = {k: v + 1e-6 * torch.randn_like(v) for k, v in a.items()}      # what a nondeterministic backward leaves
    moved = {k: v + 1e-2 * torch.randn_like(v) for k, v in a.items()}          # a resume that lost a step's state
    assert gpu_check.same_weights(a, dict(a), exact=True)[0] and not gpu_check.same_weights(a, rounding, exact=True)[0]
    assert gpu_check.same_weights(a, rounding, exact=False)[0] and not gpu_check.same_weights(a, moved, exact=False)[0]
    assert gpu_check.same_weights(a, moved, exact=False)[1] > gpu_check.RESUME_RTOL


def test_a_run_says_what_it_computes_on(tmp_path, base_in, monkeypatch):
    base_in(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        train.main(["--method", "grpo", "--batch", "8", "--episodes", "8", "--eval_tasks", "4", "--eval_samples", "0",
                    *TINY_BASE, "--out_dir", str(tmp_path)])
    lines = out.getvalue().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("device: "))
    assert lines[first].startswith(f"device: cpu, float32, torch {torch.__version__}") and first < next(
        i for i, line in enumerate(lines) if line.startswith("warm-up"))
    summary = json.loads((tmp_path / "grpo-tooluse-s0" / "summary.json").read_text())
    assert summary["device"]["device"] == "cpu" and summary["device"]["dtype"] == "float32"
    monkeypatch.setattr(torch.version, "cuda", "12.4")                          # a CUDA wheel the driver does not run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = parallel.device_info(torch.device("cpu"), torch.float32)
    assert "built for CUDA 12.4 but sees no CUDA device" in parallel.describe_device(info)
    monkeypatch.setattr(torch.version, "cuda", None)                            # a CPU wheel: nothing to say
    assert "note" not in parallel.device_info(torch.device("cpu"), torch.float32)


def test_the_reading_runs_the_lm_head_on_one_position_in_micro_batches():
    tok = tokenizer.byte_tokenizer()
    torch.manual_seed(0)
    model = M.tiny_llama(tok.vocab_size, d_model=32, n_layer=2).eval()
    ids = torch.randint(3, tok.vocab_size, (5, 12))
    mask = torch.ones_like(ids)
    mask[3:, 9:] = 0                                                            # right padding
    seen = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape[:2])))
    try:
        with torch.no_grad():
            whole = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
            seen.clear()
            pieces = M.hidden(model, ids, mask, rows=2)
    finally:
        hook.remove()
    assert seen == [(2, 1), (2, 1), (1, 1)]                                     # 2 + 2 + 1 rows, the last position only
    torch.testing.assert_close(pieces, whole)


@pytest.fixture(scope="module")
def bf16_lopd(tmp_path_factory):
    """A LOPD run on a tiny random Qwen3 loaded in bf16, with a trained reader, its setup done."""
    out = tmp_path_factory.mktemp("bf16")
    path = tiny_hf.save(out / "qwen3", "qwen3")
    args = train.parse_args(["--model", path, "--dtype", "bf16", "--method", "lopd", "--reader", "trained", "--warmup_steps", "2",
                             "--warmup_batch", "4", "--batch", "4", "--init_episodes", "8", "--cold_start_steps", "1",
                             "--eval_tasks", "2", "--teacher_eval", "1", "--eval_samples", "0", "--out_dir", str(out / "runs"),
                             "--name", "bf16"])
    os.makedirs(out / "runs" / "bf16")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return train.build(args)


@NEEDS_CPU_BF16
@pytest.mark.slow
def test_the_teacher_gap_runs_on_a_bf16_model(bf16_lopd):
    run = bf16_lopd
    assert next(run.model.parameters()).dtype == torch.bfloat16 and run.state["composer"].parameters().__next__().dtype == torch.float32
    rows = gap.gap_rows(run, train.rollout, run.env.eval_tasks[:2])           # the latents are float32, the model bf16
    assert {"lopd", "lopd-donor", "lopd-empty", "lopd-control"} <= set(rows)


@NEEDS_CPU_BF16
@pytest.mark.slow
def test_a_bf16_model_trains_float32_weights_only(bf16_lopd):
    """LoRA's adapter (θ) and a trained reader (φ's part of the base) are float32: AdamW's small steps would round
    away in bf16 weights; the frozen base stays bf16."""
    run = bf16_lopd
    trainable = [p for p in run.model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert any(p.dtype == torch.bfloat16 for p in run.model.parameters() if not p.requires_grad)
    reader = run.state["reader"]
    assert reader is not None and all(p.dtype == torch.float32 for p in reader.parameters() if p.requires_grad)
    assert all(p.dtype == torch.float32 for p in run.opt.param_groups[0]["params"] + run.state["opt_phi"].param_groups[0]["params"])


def test_merged_lora_decodes_the_same_tokens_with_fewer_ops_and_leaves_the_weights_bit_for_bit(tmp_path):
    """--merge_lora: θ's rollouts decode with the LoRA folded into the weights, one matmul a linear layer instead of
    the LoRA's own ops (a decoding step on a GPU is bound by how many ops it launches); greedy tokens equal the
    unmerged model's (float32), and after it every weight, base and adapter, is what it was, bit for bit (restored
    from a copy, not un-merged)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    tok, model = M.load(tiny_hf.save(tmp_path / "qwen3", "qwen3"), dtype=torch.float32)
    model = M.with_lora(model, tok, 4).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)                                               # a trained adapter: B ≠ 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bodies = [tok.turn("count the letters of " + "ab" * k, first=True) for k in (1, 4, 9)]

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def decode(merge):
        Count.n = 0
        with torch.no_grad(), M.lora_merged(model, merge), Count():
            out = M.generate(model, tok, M.bos_prefix(model, tok, 3), bodies, 10, greedy=True)
        return out, Count.n
    (plain, ops_plain), (merged, ops_merged) = decode(False), decode(True)
    assert merged == plain and any(len(row) > 1 for row in plain)
    assert ops_merged < 0.7 * ops_plain, (ops_merged, ops_plain)                # measured: 2,661 against 4,201
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(getattr(m, "merged_adapters", []) for m in model.modules())  # peft sees nothing merged
