"""What a fresh clone runs: ``scripts/setup.sh`` (which torch build it installs, and says so)
and ``scripts/test.sh`` (a suite that passes whatever ran before a test, and says why each
skipped test skipped).

setup.sh runs here against stand-ins: a ``.venv`` whose ``pip`` records its arguments and
writes the install report a real pip would, whose ``python`` imports a stand-in ``torch`` of
the build the case installs, and an ``nvidia-smi`` that lists a GPU or none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# The tests that read what the whole process holds (the planner's budget is for the whole
# process): each must pass however much memory the tests before it left behind.
READ_PROCESS_MEMORY = [
    "tests/test_planner.py",
    "tests/test_lora.py::test_planner_counts_frozen_weights_once",
    "tests/test_matryoshka.py::test_planner_counts_one_score_block_per_size_unless_blocked",
    "tests/test_cli.py::test_plan_prints_plan_and_json",
    "tests/test_pipeline.py::test_flags_alone_run_and_reuse_the_base_evaluation_of_another_folder",
    "tests/test_scripts.py::test_the_held_memory_is_resident",
]
HELD_MIB = 2048  # more than a whole suite run holds by its last test (about 1.3 GiB)


def test_the_held_memory_is_resident():
    """DENSEFIT_TEST_HELD_MIB (tests/conftest.py) holds its memory resident, as a long run's."""
    from densefit.memory.process import resident_bytes

    held = int(os.environ.get("DENSEFIT_TEST_HELD_MIB") or 0) * 2**20
    assert resident_bytes() > held


@pytest.mark.skipif(sys.platform != "linux", reason="VmRSS: the resident set as Linux reports it")
def test_tests_that_read_process_memory_pass_after_others_left_memory_behind():
    """What ran before a test cannot fail it: the tests that read process-wide memory pass in a
    process that already holds 2 GiB (a suite run's pytest process held 1.27 GiB by the
    planner's tests, and one of them failed: a fixed 1 GiB budget for the whole process)."""
    env = {**os.environ, "DENSEFIT_TEST_HELD_MIB": str(HELD_MIB)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *READ_PROCESS_MEMORY],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


def test_test_sh_says_why_each_skipped_test_skipped(tmp_path):
    """scripts/test.sh's pytest options print each skip's reason (``-rs``)."""
    script = (REPO / "scripts" / "test.sh").read_text().replace("\\\n", " ")
    line = next(line for line in script.splitlines() if line.startswith("exec .venv/bin/python"))
    command = line.replace(".venv/bin/python", sys.executable).replace('"$@"', "test_one.py")
    (tmp_path / "test_one.py").write_text(
        "import pytest\n\n\ndef test_x():\n    pytest.skip('needs the frobnicator extra')\n"
    )
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert "SKIPPED" in done.stdout and "needs the frobnicator extra" in done.stdout, done.stdout


# ----------------------------------------------------------------------------- setup.sh

STUB_PIP = r"""#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
if [ "${1:-} ${2:-}" = "install --help" ]; then echo "  --report <file>"; exit 0; fi
previous=""
for arg in "$@"; do
  if [ "$previous" = --report ] && [ -n "${STUB_TORCH_URL:-}" ]; then
    printf '{"install": [{"metadata": {"name": "torch"}, "download_info": {"url": "%s"}}]}' \
      "$STUB_TORCH_URL" > "$arg"
  fi
  previous="$arg"
done
"""
STUB_TORCH = """import os

__version__ = os.environ["STUB_TORCH_VERSION"]


class version:
    cuda = os.environ.get("STUB_TORCH_CUDA") or None
"""


def run_setup(tmp_path: Path, *, gpu: bool, version: str, cuda: str = "", url: str = "",
              env: dict | None = None) -> tuple[str, list[str]]:  # fmt: skip
    """Run a copy of scripts/setup.sh over the stand-ins; its stderr and pip's command lines."""
    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (tmp_path / "fake" / "torch").mkdir(parents=True)
    (tmp_path / "fake" / "torch" / "__init__.py").write_text(STUB_TORCH)
    tools = tmp_path / "tools"
    tools.mkdir()
    scripts = {
        venv_bin / "pip": STUB_PIP,
        venv_bin / "python": (
            f'#!/bin/sh\nPYTHONPATH="{tmp_path / "fake"}" exec "{sys.executable}" "$@"\n'
        ),
        tools / "nvidia-smi": (
            "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n"
            if gpu
            else "#!/bin/sh\necho 'NVIDIA-SMI has failed: no devices were found'\nexit 6\n"
        ),
    }  # fmt: skip
    for path, text in scripts.items():
        path.write_text(text)
        path.chmod(0o755)
    log = tmp_path / "pip.log"
    run_env = {
        "PATH": f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(tmp_path),
        "STUB_LOG": str(log),
        "STUB_TORCH_VERSION": version,
        "STUB_TORCH_CUDA": cuda,
        "STUB_TORCH_URL": url,
        **(env or {}),
    }
    done = subprocess.run(
        ["bash", str(root / "scripts" / "setup.sh"), "models"],
        env=run_env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    return done.stderr, [c for c in calls if c.startswith("install") and "--help" not in c]


needs_linux = pytest.mark.skipif(sys.platform != "linux", reason="the GPU check runs on Linux")


@needs_linux
def test_setup_installs_the_cpu_build_from_pytorchs_index_without_a_gpu(tmp_path):
    said, calls = run_setup(
        tmp_path, gpu=False, version="2.13.0+cpu", url=f"{CPU_INDEX}/torch-2.13.0%2Bcpu.whl"
    )
    torch_call, densefit_call = calls
    assert "torch==2.13.0" in torch_call and f"--extra-index-url {CPU_INDEX}" in torch_call
    assert "--extra-index-url" not in densefit_call and "-e .[models]" in densefit_call
    assert "torch 2.13.0+cpu: the CPU build (nvidia-smi lists no GPU; from " + CPU_INDEX in said
    assert "could not be reached" not in said and "warning" not in said


@needs_linux
def test_setup_falls_back_to_the_pinned_version_when_the_cpu_index_is_unreachable(tmp_path):
    """This machine's CI: no route to PyTorch's index; pip's own index (a local wheel) serves."""
    said, _ = run_setup(
        tmp_path, gpu=False, version="2.13.0+cpu", url="file:///opt/wheels/torch-2.13.0+cpu.whl"
    )
    assert "torch 2.13.0+cpu: the CPU build" in said
    assert f"{CPU_INDEX} could not be reached, so pip's own indexes gave torch" in said


@needs_linux
def test_setup_says_when_the_fallback_is_the_cuda_build(tmp_path):
    said, _ = run_setup(
        tmp_path,
        gpu=False,
        version="2.13.0",
        cuda="13.0",
        url="https://files.pythonhosted.org/torch-2.13.0.whl",
    )
    assert "torch 2.13.0: the CUDA 13.0 build" in said
    assert "warning: this is the CUDA build (gigabytes) on a machine without a GPU" in said
    assert "DENSEFIT_TORCH_INDEX" in said


@needs_linux
def test_setup_installs_pypis_cuda_build_with_a_gpu(tmp_path):
    said, calls = run_setup(
        tmp_path,
        gpu=True,
        version="2.13.0+cu130",
        cuda="13.0",
        url="https://files.pythonhosted.org/torch-2.13.0.whl",
    )
    assert "torch==2.13.0" in calls[0] and "--extra-index-url" not in calls[0]
    assert "torch 2.13.0+cu130: the CUDA 13.0 build (nvidia-smi lists a GPU; from " in said
    assert "warning" not in said


@needs_linux
def test_setup_takes_the_index_and_version_from_the_environment(tmp_path):
    index = "https://download.pytorch.org/whl/cu126"
    said, calls = run_setup(
        tmp_path,
        gpu=False,
        version="2.12.0+cu126",
        cuda="12.6",
        env={"DENSEFIT_TORCH_INDEX": index, "DENSEFIT_TORCH": "2.12.0"},
    )
    assert "torch==2.12.0" in calls[0] and f"--extra-index-url {index}" in calls[0]
    assert f"(DENSEFIT_TORCH_INDEX={index}; already installed)" in said
    pip_only, calls = run_setup(
        tmp_path / "pip", gpu=False, version="2.13.0+cpu", env={"DENSEFIT_TORCH_INDEX": "pip"}
    )
    assert "--extra-index-url" not in calls[0] and "torch 2.13.0+cpu: the CPU build" in pip_only
