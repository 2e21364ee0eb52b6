"""The CPU allocator: when training re-runs under mimalloc, and that it really does."""

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
    assert allocator.preload_env({allocator._PRELOADED: "1"}) is None  # already re-run: no loop
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
    assert env[allocator._PRELOADED] == "1" and env["KEEP"] == "me"
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
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator._PRELOADED)}
    out = subprocess.run([sys.executable, "-c", code, "arg"], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    # the same process (same PID) ran twice: the second time under mimalloc, same arguments
    assert out[0] == "start" and out[2] == "start" and out[1] == out[3]
    assert out[4:] == ["end", out[1], "mimalloc", "['arg']"]
    off = subprocess.run([sys.executable, "-c", code], env={**env, "DENSEFIT_ALLOCATOR": "system"},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert off.count("start") == 1 and "system" in off


def test_training_records_the_allocator(tiny):
    from densefit import TrainConfig, TrainingExample, train

    rows = [TrainingExample(f"query {i}", f"the cell protein {i}") for i in range(8)]
    result = train(tiny, rows, TrainConfig(batch_size=4, max_steps=1, show_progress=False))
    assert result.plan["cpu_allocator"] == allocator.allocator_in_use()
