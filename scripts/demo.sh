#!/usr/bin/env bash
# Set up (idempotent), then `densefit run examples/scifact.yaml`: fine-tune all-MiniLM-L6-v2
# on the bundled SciFact training pairs, evaluate base and trained on SciFact test, write
# runs/scifact/report.md (+ report.json, plots/) and print the before/after table.
# Extra arguments go to `densefit run` (e.g. --output DIR, --force, --distractors -1).
# A second run skips the finished stages and prints the table again.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh models,eval,index,mine,report
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/densefit run examples/scifact.yaml "$@"
