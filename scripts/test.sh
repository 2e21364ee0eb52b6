#!/usr/bin/env bash
# Set up (idempotent) and run the test suite, offline. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh models,eval,index,test,onnx,openvino,datasets,tensorboard,mlflow,wandb
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Lint and format first: a style slip fails in seconds, with the command that fixes it.
.venv/bin/ruff check . || { echo "fix: .venv/bin/ruff check --fix ." >&2; exit 1; }
.venv/bin/ruff format --check . || { echo "fix: .venv/bin/ruff format ." >&2; exit 1; }
# The layers (docs/architecture.md): no module imports a layer above its own, even in a function.
.venv/bin/lint-imports --no-cache || { echo "fix the import named above (docs/architecture.md)" >&2; exit 1; }
# -rs: each skipped test with its reason (a missing extra, dataset or device says which).
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider "$@"
