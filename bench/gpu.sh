#!/usr/bin/env bash
# densefit on one CUDA GPU, in one go, in under 8 minutes, on a machine without network access:
# nothing is installed. Its python3 has torch with CUDA, transformers and sentence-transformers;
# the rest (the project's missing packages, all-MiniLM-L6-v2, SciFact) comes in .gpu/, built
# beforehand from the project root with `bash ../shared/gpu/pack.sh`, unpacked here by
# `source .gpu/unpack.sh`.
#
#   bash bench/gpu.sh        # from anywhere; with $OUT set, every result is copied there too
#
# Parts, each under its own time limit (a part that fails or runs out of time is recorded in
# bench/results/gpu_parts.tsv and the next one runs); results as they come, with the GPU's name
# and the versions, in bench/results (and $OUT):
#   inference  densefit fp32 / fp16 / bf16 against SentenceTransformer.encode fp32 / fp16:
#              documents/s, cosine and top-10 agreement, a profile (inference_gpu.json,
#              inference_gpu_profile.txt; bench/gpu_inference.py)
#   steps      step time and peak memory of densefit plain / checkpoint / cache / auto against
#              sentence-transformers MNRL and CachedMNRL at batch 512 and 4,096, sequence length
#              128 (gpu_train_steps.{jsonl,json,md}; bench/gpu_train.py --part steps)
#   tests      tests/test_cuda.py: a real out-of-memory error redone with half the chunk, the
#              planner's budget and probe against measured peaks, mixed precision through every
#              strategy, the encode pipeline and half precision, the device by default
#              (gpu_tests.log)
#   converge   bf16 and fp16 training runs of 50 steps against fp32 (gpu_train_converge.json)
#   device     densefit train with no --device (auto says "on cuda"), and with LoRA
#              (gpu_options.log)
# and the whole log, gpu_run.log.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=bench/results
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/gpu_run.log") 2>&1
[ -f .gpu/unpack.sh ] || { echo "gpu.sh: no .gpu/ here: build it with bash ../shared/gpu/pack.sh"; exit 2; }
# shellcheck disable=SC1091  # built by ../shared/gpu/pack.sh
source .gpu/unpack.sh || { echo "gpu.sh: .gpu/unpack.sh failed"; exit 2; }
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
printf 'part\texit\tseconds\tlimit_s\n' > "$RESULTS/gpu_parts.tsv"

publish() {  # copy every GPU result so far to $OUT, where the device runner collects them
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT" && cp -f "$RESULTS"/*gpu* "$OUT"/ 2>/dev/null
  fi
  return 0
}

part() {  # NAME LIMIT_S COMMAND...: run under a time limit, record its exit status, publish
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name (at most ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$RESULTS/gpu_parts.tsv"
  [ "$rc" -eq 0 ] || echo "== $name: exit $rc$([ "$rc" -eq 124 ] && echo ' (ran out of time)')"
  publish
}

# Tokenizing runs on every core for both sides, as a trainer's or an encoder's user gets it.
part inference 90 env TOKENIZERS_PARALLELISM=true python3 bench/gpu_inference.py
part steps 140 env TOKENIZERS_PARALLELISM=true python3 bench/gpu_train.py --part steps
part tests 100 bash -c "python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py 2>&1 | tee $RESULTS/gpu_tests.log; exit \${PIPESTATUS[0]}"
part converge 45 python3 bench/gpu_train.py --part converge

# The device by default (no --device: auto picks the GPU and the summary says "on cuda"),
# then LoRA r=16 at the same batch: the summary lines give time and plan.
DATA=$DENSEFIT_DATASETS
OPTIONS_LOG=$RESULTS/gpu_options.log
: > "$OPTIONS_LOG"
for LORA in "" "--lora-r 16"; do
  # shellcheck disable=SC2086  # $LORA is two words or none
  part "device${LORA:+-lora}" 25 bash -c "python3 -m densefit train $DATA/scifact --output /tmp/densefit-gpu-options \
    --overwrite --max-steps 10 --batch-size 256 --max-seq-length 128 --memory auto \
    --keep-checkpoints 0 --no-progress $LORA 2>&1 | tee -a $OPTIONS_LOG"
done
grep -q " on cuda" "$OPTIONS_LOG" && echo "== the default device: cuda" \
  || echo "== the default device was not cuda: see $OPTIONS_LOG"
echo "== done in ${SECONDS} s"
column -t "$RESULTS/gpu_parts.tsv"
publish
