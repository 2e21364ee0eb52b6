"""The CPU allocator: when training re-runs under mimalloc, and that it really does."""

import json
import os
import subprocess
import sys

import pytest

from densefit.memory import allocator


def test_preload_env_says_no_when_it_should(monkeypatch):
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: "/opt/lib/libmimalloc.so")
    monkeypatch.setattr(allocator, "allocator_in_use", lambda: "system")
    assert allocator.preload_env({"DENSEFIT_ALLOCATOR": "system"}) is None
    assert allocator.preload_env({"DENSEFIT_ALLOCATOR": "GLIBC"}) is None
    assert allocator.preload_env({allocator.PRELOADED: "1"}) is None  # already re-run: no loop
    monkeypatch.setattr(allocator, "allocator_in_use", lambda: "mimalloc")
    assert allocator.preload_env({}) is None  # already serving this process
    monkeypatch.setattr(allocator, "allocator_in_use", lambda: "system")
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
    assert allocator.preload_env({}) is None  # wheel not installed
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: "/opt/lib/libmimalloc.so")
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.preload_env({}) is None


def test_preload_env_prepends_mimalloc_and_keeps_other_preloads(monkeypatch):
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: "/opt/lib/libmimalloc.so")
    monkeypatch.setattr(allocator, "allocator_in_use", lambda: "system")
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    env = allocator.preload_env({"LD_PRELOAD": "/x/libfoo.so", "KEEP": "me"})
    assert env["LD_PRELOAD"] == "/opt/lib/libmimalloc.so:/x/libfoo.so"
    assert env[allocator.PRELOADED] == "1" and env["KEEP"] == "me"
    assert allocator.preload_env({})["LD_PRELOAD"] == "/opt/lib/libmimalloc.so"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux only")
def test_rerun_really_serves_malloc_from_mimalloc():
    if allocator.mimalloc_library() is None:
        pytest.skip("cmeel-mimalloc is not installed")
    code = (
        "import os, sys\n"
        "from densefit.memory.allocator import allocator_in_use, rerun_with_mimalloc\n"
        "print('start', os.getpid(), flush=True)\n"
        "rerun_with_mimalloc()\n"
        "print('end', os.getpid(), allocator_in_use(), sys.argv[1:], flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.PRELOADED)}
    out = subprocess.run(
        [sys.executable, "-c", code, "arg"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    # the same process (same PID) ran twice: the second time under mimalloc, same arguments
    assert out[0] == "start" and out[2] == "start" and out[1] == out[3]
    assert out[4:] == ["end", out[1], "mimalloc", "['arg']"]
    off = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "DENSEFIT_ALLOCATOR": "system"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    assert off.count("start") == 1 and "system" in off


CHILD = r"""
import json, sys
from densefit import TrainConfig, TrainingExample, train
from densefit.testing import tiny_model

rows = [TrainingExample(f"query {i}", f"the cell protein {i}") for i in range(8)]
result = train(tiny_model(), rows, TrainConfig(batch_size=4, max_steps=1, show_progress=False))
print(json.dumps(result.plan["cpu_allocator"]), flush=True)
sys.stdin.read()  # stay alive until the parent has read this process's memory map
"""


def recorded_and_mapped(env: dict) -> tuple[str, bool]:
    """(allocator the child's training recorded, libmimalloc mapped in the child, read by us)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-2000:]
        with open(f"/proc/{proc.pid}/maps") as maps:  # from outside the child
            mapped = any("libmimalloc" in row for row in maps)
    finally:
        proc.communicate("", timeout=120)
    return json.loads(line), mapped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux only")
def test_training_records_the_allocator_its_process_really_has_loaded():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", allocator.PRELOADED, "DENSEFIT_ALLOCATOR")
    }
    env.update(OMP_NUM_THREADS="1")
    assert recorded_and_mapped(env) == ("system", False)
    # a preload naming mimalloc that the loader cannot load: the system's malloc serves
    missing = {**env, "LD_PRELOAD": "/nonexistent/libmimalloc.so"}
    assert recorded_and_mapped(missing) == ("system", False)
    if allocator.mimalloc_library() is None:
        pytest.skip("cmeel-mimalloc is not installed")
    assert recorded_and_mapped(allocator.preload_env(env)) == ("mimalloc", True)
