#!/usr/bin/env bash
# Set up (idempotent), then `densefit run examples/scifact.yaml`: fine-tune all-MiniLM-L6-v2
# on the bundled SciFact training pairs, evaluate base and trained on SciFact test, write
# runs/scifact/report.md (+ report.html, report.json, plots/) and print the before/after table.
# Extra arguments go to `densefit run`, for example:
#   bash scripts/demo.sh --eval-distractors null --eval-max-seq-length 256 --output runs/scifact-full
#   bash scripts/demo.sh --force
# (the first evaluates on the whole corpus at 256 tokens; the second redoes every stage).
# A second run skips the finished stages and prints the table again.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh models,eval,index,mine,report
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/densefit run examples/scifact.yaml "$@"
