#!/usr/bin/env bash
# Set up (idempotent) and run the test suite, offline. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh models,eval,index,test,onnx,openvino,datasets,tensorboard,mlflow,wandb
# The browser tests' headless Chromium, where this machine lets us install it (root and
# apt-get); elsewhere they skip, naming the packages.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends chromium chromium-driver; } >/dev/null 2>&1 \
      || echo "apt-get could not install chromium chromium-driver: the browser tests skip" >&2
  fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Lint and format first: a style slip fails in seconds, with the command that fixes it.
.venv/bin/ruff check . || { echo "fix: .venv/bin/ruff check --fix ." >&2; exit 1; }
.venv/bin/ruff format --check . || { echo "fix: .venv/bin/ruff format ." >&2; exit 1; }
# The layers (docs/architecture.md): no module imports a layer above its own, even in a function.
.venv/bin/lint-imports --no-cache || { echo "fix the import named above (docs/architecture.md)" >&2; exit 1; }
# One OpenMP/MKL thread per process unless set: two workers of two threads each on two cores
# spin against each other (a 2-thread torch step runs ~4x slower beside a busy process).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
# -rs: each skipped test with its reason (a missing extra, dataset or device says which).
# Two worker processes (pytest-xdist), a test file's tests in one worker: the suite's time
# halves on 2 cores; DENSEFIT_TEST_WORKERS=0 runs it in one process.
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider \
  -n "${DENSEFIT_TEST_WORKERS:-2}" --dist loadfile "$@"
