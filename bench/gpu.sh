#!/usr/bin/env bash
# The memory/speed comparison on one CUDA GPU, in under 8 minutes on a current GPU.
# Run from the repository root on a machine with a GPU and ../shared/datasets (or set
# DENSEFIT_DATASETS). Results: bench/results/memory_speed_gpu.{jsonl,csv,md,json,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q "torch==${DENSEFIT_TORCH:-2.13.0}" || .venv/bin/pip install -q torch
  .venv/bin/pip install -q -e ".[models,eval,bench]"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
cd bench
timeout 280 ../.venv/bin/python memory_speed.py --device cuda --name memory_speed_gpu --fresh \
  --section speed --batches 64 256
timeout 180 ../.venv/bin/python memory_speed.py --device cuda --name memory_speed_gpu \
  --section scaling --batches 1024 8192 65536 || true
