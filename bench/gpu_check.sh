#!/usr/bin/env bash
# The GPU check of issue 14, as one short run on a machine with a GPU and toolcollapse[smol] installed:
# SmolLM2-135M SFT (the smol recipe, 40 steps) and 5 RL steps in bfloat16 on the GPU (sampled tokens/s, step time,
# peak GPU memory), then the first RL step in float32 on the GPU and on the CPU (rewards equal; loss, entropy, probe close).
# Prints its figures and writes runs/gpu_check/summary.json; then bench/group_share.py on BFCL prompts, rollouts and
# the update (where bfcl-eval is installed). About 6 minutes on one H200 (estimate).
#   bash bench/gpu_check.sh                 # the check
#   bash bench/gpu_check.sh --device cpu --tiny   # a dry run of the script on a CPU
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
PYTHONUNBUFFERED=1 python bench/gpu_check.py "$@"
# BFCL prompts (each task its own 2-5 k-token system prompt), a copy per row vs one per group: where bfcl-eval is installed
if [[ " $* " != *" cpu "* ]] && python -c "import bfcl_eval" 2>/dev/null; then
  PYTHONUNBUFFERED=1 python bench/group_share.py --device cuda --dtype bfloat16 --tasks 12 --group-size 8 --rounds 2
  PYTHONUNBUFFERED=1 python bench/group_share.py --update --device cuda --dtype bfloat16 --tasks 4 --group-size 8 \
    --max-new-tokens 16 --rounds 2
fi
