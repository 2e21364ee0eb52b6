#!/usr/bin/env bash
# Create .venv and install densefit with the given extras (default: models,eval,index,test,bench).
# torch is pinned to the CPU build this environment provides: an unpinned torch pulls a
# multi-GB CUDA build. Set DENSEFIT_TORCH to pin another version elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-models,eval,index,test,bench}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=".venv/bin/pip"
"$pip" install -q --disable-pip-version-check "torch==${DENSEFIT_TORCH:-2.13.0}" 2> >(grep -v "^WARNING: Location" >&2)
"$pip" install -q --disable-pip-version-check -e ".[${extras}]" 2> >(grep -v "^WARNING: Location" >&2)
