#!/usr/bin/env bash
# Set up (idempotent), then fine-tune all-MiniLM-L6-v2 on the bundled SciFact training pairs
# and print nDCG@10 / Recall@100 on SciFact test before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh models,eval,index
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python examples/quickstart.py "$@"
