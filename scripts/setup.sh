#!/usr/bin/env bash
# Create .venv and install densefit with the given extras (default: models,eval,index,test,bench).
#
# torch comes first, pinned (DENSEFIT_TORCH, default 2.13.0), in the build for this machine:
# - no GPU (nvidia-smi lists none): the CPU build, from PyTorch's CPU wheel index
#   (https://download.pytorch.org/whl/cpu) added with pip's --extra-index-url: pip's own index
#   still serves everything else, and PyPI's torch for Linux is the CUDA build (gigabytes of
#   nvidia-* packages);
# - a GPU: PyPI's torch, the CUDA build;
# - DENSEFIT_TORCH_INDEX=URL: that wheel index instead (e.g. https://download.pytorch.org/whl/cu126
#   for another CUDA version), or DENSEFIT_TORCH_INDEX=pip for pip's own indexes only.
# An index that cannot be reached is skipped and the pinned version comes from pip's own indexes.
# The last line says which build was installed, and from where.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-models,eval,index,test,bench}"
python="${PYTHON:-python3}"
version="${DENSEFIT_TORCH:-2.13.0}"
cpu_index="https://download.pytorch.org/whl/cpu"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=".venv/bin/pip"
quiet() { grep -v -E "^WARNING: (Location|Retrying)" >&2 || true; }  # pip's noise about indexes

want=""  # the build this machine should get: cpu, cuda, or "" (the override's or the platform's)
if [ -n "${DENSEFIT_TORCH_INDEX:-}" ]; then
  index="$DENSEFIT_TORCH_INDEX" why="DENSEFIT_TORCH_INDEX=$DENSEFIT_TORCH_INDEX"
elif [ "$(uname -s)" != Linux ]; then
  index=pip why="$(uname -s): PyPI's torch has no CUDA build here"
elif nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
  index=pip want=cuda why="nvidia-smi lists a GPU"
else
  index="$cpu_index" want=cpu why="nvidia-smi lists no GPU"
fi
args=(install -q --disable-pip-version-check "torch==$version")
if [ "$index" != pip ]; then
  args+=(--extra-index-url "$index" --retries 2)  # an unreachable index: skipped soon
fi
report="$(mktemp)"
trap 'rm -f "$report"' EXIT
if "$pip" install --help 2>/dev/null | grep -q -- "--report"; then  # pip >= 22.2
  args+=(--report "$report")  # what pip installed, and from where
fi
"$pip" "${args[@]}" 2> >(quiet)
"$pip" install -q --disable-pip-version-check -e ".[${extras}]" 2> >(quiet)

# Which build is installed, from where, and whether it is the one wanted.
.venv/bin/python - "$report" "$index" "$want" "$why" <<'EOF'
import json, sys

import torch

report, index, want, why = sys.argv[1:]
try:
    installed = json.load(open(report)).get("install", [])
except ValueError:  # pip had nothing to install: no report written
    installed = []
url = next((i["download_info"]["url"] for i in installed if i["metadata"]["name"] == "torch"), None)
build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
where = f"from {url}" if url else "already installed"
line = f"torch {torch.__version__}: the {build} build ({why}; {where})"
if url and index != "pip" and not url.startswith(index):
    line += f"; {index} could not be reached, so pip's own indexes gave torch"
print(line, file=sys.stderr)
if want == "cpu" and torch.version.cuda:
    print(
        f"warning: this is the CUDA build (gigabytes) on a machine without a GPU: install the CPU "
        "build with DENSEFIT_TORCH_INDEX set to a wheel index that has it, or pip install it "
        "into .venv before running this script",
        file=sys.stderr,
    )
if want == "cuda" and not torch.version.cuda:
    print(
        "warning: this is the CPU build on a machine with a GPU: set DENSEFIT_TORCH_INDEX to "
        "PyTorch's index for your CUDA version (https://download.pytorch.org/whl/cu130 ...) "
        "and run this script again after removing .venv",
        file=sys.stderr,
    )
EOF
