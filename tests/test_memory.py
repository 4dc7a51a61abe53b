"""--micro_batch: the same updates, and memory that does not grow with the batch beyond it.

- the warm-up's and the cold start's gradients accumulated over micro-batches equal the whole
  batch's (the mean over every agent token of the batch, not a mean of means); scoring in
  micro-batches (logits_on's rows, the body recomputed one piece at a time in the backward) gives
  the same loss and gradient, and a whole training step (LOPD's with its composer phase, SDPO's,
  GRPO's) the same update;
- measured as ratios in one run (peak RSS over the phase, VmHWM): the warm-up in a process per configuration,
  the evaluation and the training step in one process each, their configurations in turn (the step's after an
  unmeasured first one that allocates what persists: gradients, Adam's moments), on a tiny model with
  Qwen3's vocabulary (V = 151,936): a warm-up step, an evaluation and a training step's teacher and
  student phases grow by (almost) nothing when their batch triples at a fixed micro-batch, and by
  far more without one (which is what shows the measurement can see the difference). Opt-in:
  LOPD_MEMORY=1 python -m pytest tests/test_memory.py -q -k grows (CI runs it after the README's command)."""
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import envs  # noqa: E402
import lopd  # noqa: E402
import retrieval  # noqa: E402
import tiny_hf  # noqa: E402
import train  # noqa: E402
import warmup  # noqa: E402
from conftest import TINY_BASE  # noqa: E402

torch.set_num_threads(1)
V = 151_936


def grads(params):
    return torch.cat([p.grad.flatten() for p in params if p.grad is not None])


def test_the_warm_up_in_micro_batches_is_the_same_gradient():
    args = train.parse_args(["--d_model", "32", "--n_layer", "1", "--bpe_merges", "0"])
    env = envs.make_env("tooluse")
    tok, model = warmup.load_model(args, env)
    pool, by_family = warmup.warmup_pool(env)
    import random
    rng = random.Random(0)
    demos, contexts = zip(*[warmup.warmup_demo(env, t, by_family, rng, 0.6) for t in rng.sample(pool, 7)])
    out = []
    for rows, backward in [(16, False), (3, True), (1, True)]:
        model.zero_grad()
        loss = warmup.warmup_loss(model, tok, demos, contexts, "cpu", rows, backward=backward)
        if not backward:
            loss.backward()
        out.append((loss.detach(), grads(model.parameters())))
    for loss, g in out[1:]:
        assert torch.allclose(loss, out[0][0], atol=1e-6) and torch.allclose(g, out[0][1], atol=1e-6, rtol=1e-4)


def test_the_cold_start_in_micro_batches_is_the_same_gradient(base_in, tmp_path):
    out = base_in(tmp_path)
    run = train.build(train.parse_args(["--method", "lopd", "--init_episodes", "16", "--cold_start_steps", "0",
                                        "--cold_start", "text", "--eval_tasks", "4", "--teacher_eval", "0", "--eval_samples", "0",
                                        *TINY_BASE, "--out_dir", str(out)]))
    tasks = run.env.train_tasks[100:107]
    eps, bodies, masks = train.rollout(run.model, run.tok, run.env, tasks)
    rows = list(zip(eps, bodies, masks))
    rows = [r + read for r, read in zip(rows, retrieval.frozen_reading(run, rows))]
    assert sum(len(r[3]) > 0 for r in rows) >= 2                               # rows that retrieve, and their mean
    phi = list(run.state["composer"].parameters())
    for p in phi:
        p.grad = None
    whole = lopd.masked_mean(*retrieval.cold_start_loss(run, rows))
    whole.backward()
    want = grads(phi)
    for p in phi:
        p.grad = None
    got = retrieval.cold_start_micro(run, rows, 2)
    assert torch.allclose(got, whole.detach(), atol=1e-6) and torch.allclose(grads(phi), want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("chunk,grad_ckpt", [(0, False), (16, False), (16, True)])
def test_scoring_in_micro_batches_is_the_same_gradient(chunk, grad_ckpt):
    """logits_on(rows=2): the body two rows at a time, recomputed in the backward; the loss over the
    whole batch gets the same value and gradient, the model's and a context's that carries one (φ's latents)."""
    import model as M
    args = train.parse_args(["--d_model", "32", "--n_layer", "2", "--bpe_merges", "0"])
    env = envs.make_env("tooluse")
    tok, model = warmup.load_model(args, env)
    if grad_ckpt:
        M.checkpoint_activations(model)
    torch.manual_seed(0)
    lens = [9, 4, 12, 7, 5]
    ids, amask, attn = M.pad_batch([torch.randint(0, 200, (n,)).tolist() for n in lens], [[1] * n for n in lens], tok.pad, "cpu")
    z = torch.randn(3, 32, requires_grad=True)                                  # a context with a graph, on rows 1 and 3
    out = []
    for rows in (0, 2):
        model.zero_grad()
        z.grad = None
        prefixes = [M.bos_prefix(model, tok, 1)[0] if i not in (1, 3) else torch.cat([M.bos_prefix(model, tok, 1)[0], z * (i - 0.5)])
                    for i in range(len(lens))]
        with M.train_mode(model):
            loss = lopd.masked_mean(-lopd.token_logp(M.logits_on(model, prefixes, ids, attn, chunk, rows), ids), amask)
            loss.backward()
        out.append((loss.detach(), grads(model.parameters()), z.grad.clone()))
    (l0, g0, z0), (l1, g1, z1) = out
    assert torch.allclose(l0, l1, atol=1e-6) and torch.allclose(g0, g1, atol=1e-6, rtol=1e-4)
    assert torch.allclose(z0, z1, atol=1e-6, rtol=1e-4) and z0.abs().sum() > 0


def saved_bytes(fn):
    """The bytes autograd saves for the backward while fn runs (what a graph holds between forward and backward)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


@pytest.mark.parametrize("rows", [0, 2])
@pytest.mark.parametrize("lora", [False, True])
def test_a_frozen_teacher_holding_phis_graph_is_checkpointed_per_layer(rows, lora):
    """--grad_ckpt outside train mode: the frozen teacher's scoring that keeps φ's graph (steps 4 and 6, the
    cold start) checkpoints each layer, as θ's does in train mode (transformers does only there): the same
    values and gradient into the latents, a fraction of the saved activations (4 layers here: 0.08), and every
    module back in eval mode. With LoRA the teacher θ0 is θ's model with its adapter off, and the backward
    recomputes each layer outside that call: with the adapter off again (θ's adapter is made non-zero here, so
    a recompute with it on would give another gradient)."""
    import copy
    import model as M
    args = train.parse_args(["--d_model", "32", "--n_layer", "4", "--bpe_merges", "0"])
    tok, plain = warmup.load_model(args, envs.make_env("tooluse"))
    if lora:
        plain = M.with_lora(plain, tok, 4)
        torch.manual_seed(1)
        for n, p in plain.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.1)                                           # θ ≠ θ0
    plain.eval().requires_grad_(False)
    ckpt = M.checkpoint_activations(copy.deepcopy(plain))
    torch.manual_seed(0)
    lens = [30, 22, 41, 17]
    ids, amask, attn = M.pad_batch([torch.randint(0, 200, (n,)).tolist() for n in lens], [[1] * n for n in lens], tok.pad, "cpu")
    z_start, out = torch.randn(4, 8, 32).mul(0.05), []                         # K = 8 latents per row
    for net in (plain, ckpt):
        teacher = M.Adapter(net) if lora else net                               # θ0
        z = z_start.clone().requires_grad_(True)                                # φ's graph
        prefixes = [torch.cat([M.bos_prefix(net, tok, 1)[0], z[i]]) for i in range(len(lens))]
        logits, held = saved_bytes(lambda: M.logits_on(teacher, prefixes, ids, attn, 0, rows))
        lopd.masked_mean(-lopd.token_logp(logits, ids), amask).backward()
        out.append((logits.detach(), z.grad.clone(), held))
        assert not any(m.training for m in net.modules())
    (l0, g0, held0), (l1, g1, held1) = out
    assert torch.allclose(l0, l1, atol=1e-5) and torch.allclose(g0, g1, atol=1e-6, rtol=1e-4) and g0.abs().sum() > 0
    if not rows:  # (rows > 0: the pieces are checkpointed already, and what a piece recomputes is rows = 0's case)
        assert held1 < 0.3 * held0, (held1, held0)
    if lora:  # and the adapter off is not the adapter on
        with torch.no_grad():
            assert not torch.allclose(M.logits_on(plain, prefixes, ids, attn), l0, atol=1e-3)


@pytest.mark.parametrize("method", ["lopd", pytest.param("sdpo", marks=pytest.mark.slow), pytest.param("grpo", marks=pytest.mark.slow)])
def test_a_training_step_in_micro_batches_is_the_same_update(method, base_in, tmp_path, monkeypatch):
    """A whole step (LOPD's with its composer phase; a baseline's generic one) at --micro_batch 3 moves θ, φ
    and β as the whole batch does, from the same rollouts."""
    out = base_in(tmp_path)
    flags = ["--method", method, "--batch", "16" if method == "grpo" else "8",   # GRPO: 4 groups, not all of equal rewards "--eval_tasks", "2", "--teacher_eval", "0", "--eval_samples", "0",
             *TINY_BASE, "--out_dir", str(out)] + (["--init_episodes", "16", "--cold_start_steps", "0"] if method == "lopd" else [])
    for m in ("0", "3"):
        (out / f"mb{m}").mkdir()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        runs = [train.build(train.parse_args(flags + ["--micro_batch", m, "--name", f"mb{m}"])) for m in ("0", "3")]
    real = train.rollout
    monkeypatch.setattr(train, "rollout", lambda *a, rows=0, **k: real(*a, **k))   # the same episodes for both
    rng, before = torch.get_rng_state(), [p.detach().clone() for p in runs[0].model.parameters()]
    for run in runs:
        torch.set_rng_state(rng)
        (run.method.step or train.train_step)(run)
    a, b = runs
    assert a.log["loss"][-1] == pytest.approx(b.log["loss"][-1], abs=1e-6) and a.log["reward"] == b.log["reward"]
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6)
    assert any(not torch.equal(p, q) for p, q in zip(a.model.parameters(), before))    # the step moved θ
    if method == "lopd":
        assert a.state["beta"] == pytest.approx(b.state["beta"], abs=1e-6) and a.log["delta"][-1] != 0
        for pa, pb in zip(a.state["composer"].parameters(), b.state["composer"].parameters()):
            assert torch.allclose(pa, pb, atol=1e-6)


# ----------------------------------------------------------------------------- memory, as ratios

PROBE = r"""
import contextlib, dataclasses, io, json, os, sys
sys.path[:0] = [os.environ['ROOT']]
import torch
torch.set_num_threads(1)
import envs, train, warmup
phase, folder, out, argv, configs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:-1], json.loads(sys.argv[-1])
args = train.parse_args(['--model', folder, '--out_dir', out, '--lora_r', '0'] + argv)

def peak():  # the peak resident memory since the last reset (Linux: VmHWM), MiB
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024

def reset():
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    return peak()

grew = []
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    if phase == 'warmup':
        env = envs.make_env(args.env)
        tok, model = warmup.load_model(args, env)
        once = lambda: warmup.warmup(args, tok, model, env, 'cpu')
    else:  # the evaluation, or one training step, once the run is built (evaluated on one task, so that it costs little)
        args.eval_tasks = 1
        run = train.build(args)
        args = run.args
        if phase == 'step':  # the teacher and student phases on episodes of 1,024 tokens, every 16th the agent's, each
            def fixed(model, tok, env, tasks, **kw):  # feedback for SDPO's teacher (the rollout's memory is the evaluation's)
                g, T = torch.Generator().manual_seed(0), 1024
                eps = [dataclasses.replace(env.reset(t), feedback='the wrong tool was called', done=True) for t in tasks]
                return eps, [torch.randint(0, 1000, (T,), generator=g).tolist() for _ in tasks], [[int(k % 16 == 0) for k in range(T)]
                                                                                                 for _ in tasks]
            train.rollout = fixed
        once = (lambda: train.evaluate(run)) if phase == 'eval' else (lambda: (run.method.step or train.train_step)(run))
    # each configuration in turn in one process; a training step's first, unmeasured pass allocates what persists
    # (gradients, Adam's moments), so each measured one counts what its phase holds while it runs. The warm-up
    # leaves its heap resident for the next one, so it runs one configuration per process, from the load
    warm = [configs[0]] if phase == 'step' else []
    for i, config in enumerate(warm + configs, start=1 - len(warm)):
        for k, v in config.items():
            setattr(args, k, v)
        before = reset()
        once()
        if i > 0:
            grew.append(peak() - before)
print(json.dumps(grew))
"""


# opt-in (~3 min of a core): the README's test command stays a few minutes; CI runs this tier after it
ratios = pytest.mark.skipif(not os.environ.get("LOPD_MEMORY"), reason="memory ratios: set LOPD_MEMORY=1")


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    """A 2-layer Qwen3 of width 128 with Qwen3's vocabulary and a ChatML byte tokenizer."""
    from transformers import AutoModelForCausalLM
    folder = tmp_path_factory.mktemp("qwen3-v151936")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_hf.config("qwen3", V, d=128, layers=2)).save_pretrained(folder)
    tiny_hf.tokenizer(True).save_pretrained(folder)
    return str(folder)


def grew(phase, folder, tmp_path, argv, configs):
    """MiB the peak resident memory grew by over the phase, in each configuration (a dict of flags), in one
    fresh process."""
    r = subprocess.run([sys.executable, "-c", PROBE, phase, folder, tempfile.mkdtemp(dir=tmp_path), *argv, json.dumps(configs)],
                       capture_output=True, text=True,
                       timeout=600, env={**os.environ, "ROOT": ROOT, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                            # glibc otherwise raises its mmap threshold after the first big free and keeps later
                            # tensors' freed memory resident: the peak would count what is no longer alive
                            "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@ratios
def test_a_warm_up_step_grows_with_the_micro_batch_not_the_batch(big_vocab, tmp_path):
    # a process each, measured from the model's load (loading is cheap): in one process each warm-up reuses the
    # heap an earlier one left resident (measured: 149 / 447 / 149 MiB); the run-building probes below share one
    w = lambda batch, micro: grew("warmup", big_vocab, tmp_path, ["--warmup_steps", "1"],
                                  [dict(warmup_batch=batch, micro_batch=micro)])[0]
    small, big, whole = w(4, 1), w(12, 1), w(12, 0)
    print(f"warm-up step, peak RSS growth: batch 4 / 12 at micro-batch 1, 12 whole: {small:.0f} / {big:.0f} / {whole:.0f} MiB")
    assert big - small < 0.25 * (whole - small)


@ratios
def test_an_evaluation_grows_with_the_micro_batch_not_the_tasks(big_vocab, tmp_path):
    small, big, whole = grew("eval", big_vocab, tmp_path, ["--method", "grpo", "--warmup_steps", "0", "--eval_samples", "0"],
                             [dict(eval_tasks=2, micro_batch=1), dict(eval_tasks=6, micro_batch=1),
                              dict(eval_tasks=6, micro_batch=0)])
    print(f"evaluation, peak RSS growth: 2 / 6 tasks at micro-batch 1, 6 at once: {small:.0f} / {big:.0f} / {whole:.0f} MiB")
    assert big - small < 0.25 * (whole - small)


@ratios
def test_a_training_step_grows_with_the_micro_batch_not_the_batch(big_vocab, tmp_path):
    """Rollout, teacher and student phases (SDPO: a teacher that scores every token, a student that backpropagates)."""
    small, big, whole = grew("step", big_vocab, tmp_path, ["--method", "sdpo", "--warmup_steps", "0", "--eval_samples", "0",
                                                           "--seed", "1", "--score_chunk", "64"],
                             [dict(batch=4, micro_batch=1), dict(batch=12, micro_batch=1), dict(batch=12, micro_batch=0)])
    print(f"training step, peak RSS growth: batch 4 / 12 at micro-batch 1, 12 at once: {small:.0f} / {big:.0f} / {whole:.0f} MiB")
    assert big - small < 0.25 * (whole - small)
