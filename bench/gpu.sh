#!/usr/bin/env bash
# The memory/speed comparison on one CUDA GPU, in under 8 minutes on a current GPU; with
# two or more GPUs also 1 vs all GPUs on one global batch (bench/results/distributed_gpu.*).
# Run from the repository root on a machine with a GPU and ../shared/datasets (or set
# DENSEFIT_DATASETS). Results: bench/results/memory_speed_gpu.{jsonl,csv,md,json,png},
# bench/results/inference_gpu.json (torch fp16 vs fp32 inference) and
# bench/results/gpu_options.log (the device by default; LoRA vs full fine-tuning).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q "torch==${DENSEFIT_TORCH:-2.13.0}" || .venv/bin/pip install -q torch
  .venv/bin/pip install -q -e ".[models,eval,bench,lora]"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
cd bench
timeout 200 ../.venv/bin/python memory_speed.py --device cuda --name memory_speed_gpu --fresh \
  --section speed --batches 64 256
# Inference: torch fp16 against fp32 (and the unpadded flash-attention path when flash_attn is
# installed) through densefit's encoder; exits non-zero, saying why, when fp16 drifts or fails.
timeout 60 ../.venv/bin/python gpu_inference.py --docs 4096 \
  || { echo "gpu_inference.py failed or ran past 60 s: see its output above" >&2; exit 1; }
GPUS=$(../.venv/bin/python -c "import torch; print(torch.cuda.device_count())")
# Several GPUs: 1 vs all of them on the same global batch (bench/distributed.py, nccl);
# the scaling section then gets less time so the whole script stays under 8 minutes.
SCALING_S=$([ "$GPUS" -ge 2 ] && echo 45 || echo 90)
timeout "$SCALING_S" ../.venv/bin/python memory_speed.py --device cuda --name memory_speed_gpu \
  --section scaling --batches 1024 8192 65536 || true
if [ "$GPUS" -ge 2 ]; then
  timeout 60 ../.venv/bin/python distributed.py --device cuda --nproc 1 "$GPUS" \
    --batch-size 1024 --chunk-size 64 --steps 2 --timeout 40 --name distributed_gpu || true
fi
# The device by default (no --device: auto picks the GPU, the summary says "on cuda"), then
# LoRA r=16 against full fine-tuning at the same batch: the summary lines give time and plan.
DATA="${DENSEFIT_DATASETS:-$(cd ../.. && pwd)/shared/datasets}"
LOG=results/gpu_options.log
: > "$LOG"
for LORA in "" "--lora-r 16"; do
  # shellcheck disable=SC2086  # $LORA is two words or none
  timeout 45 ../.venv/bin/python -m densefit train "$DATA/scifact" --output /tmp/densefit-gpu-options \
    --overwrite --max-steps 20 --batch-size 256 --max-seq-length 128 --memory auto \
    --keep-checkpoints 0 --no-progress $LORA 2>&1 | tee -a "$LOG" || true
done
grep -q " on cuda" "$LOG" || { echo "the default device was not cuda: see $LOG"; exit 1; }
