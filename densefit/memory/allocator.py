"""Keep CPU memory at what is live: return freed activation buffers to the OS promptly.

glibc raises its mmap threshold each time a large block is freed, so later activations are
served from the heap, where blocks of varying sizes (chunks padded to different lengths)
fragment it. A fixed threshold serves every block above it with mmap and unmaps it when
freed; a ``malloc_trim`` after each chunk returns what the small blocks left in the heap.
Measured on a quiet machine (bench/results/allocator.md: gradient cache, batch 128, chunks of
32): 23-33% less activation memory, +26% step time on SciFact, -10% on pydoc; training applies
it only with
``TrainConfig(release_cpu_memory=True)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from importlib.metadata import PackageNotFoundError, files

__all__ = [
    "release_freed_memory_promptly",
    "trim",
    "enable_trim",
    "mimalloc_library",
    "allocator_in_use",
    "PRELOADED",
    "preload_env",
    "rerun_with_mimalloc",
    "returning_freed_memory",
]

_M_MMAP_THRESHOLD = -3
_done: set[int] = set()
_trim = {"on": False}


def release_freed_memory_promptly(threshold_bytes: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold for this process (Linux/glibc only; else a no-op).

    Returns True when the setting was applied. Affects the whole process: blocks above
    ``threshold_bytes`` are mapped fresh and returned to the OS when freed.

    >>> release_freed_memory_promptly() in (True, False)
    True
    """
    if not sys.platform.startswith("linux"):
        return False
    if threshold_bytes in _done:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))
    except (OSError, AttributeError):  # musl or another libc: nothing to tune
        return False
    if ok:
        _done.add(threshold_bytes)
    return ok


def trim() -> bool:
    """Return free heap pages to the OS now (glibc ``malloc_trim``), once release is on.

    A no-op unless :func:`release_freed_memory_promptly` or :func:`enable_trim` was applied
    (training does with ``release_cpu_memory=True``).
    """
    if not (_done or _trim["on"]):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def enable_trim(on: bool = True) -> None:
    """Let :func:`trim` work without fixing the mmap threshold (glibc's default kept)."""
    _trim["on"] = on


# --- mimalloc -------------------------------------------------------------------------
# glibc's malloc keeps the heap it grew for freed activations and fragments it as chunks of
# different sizes come and go: on CPU a gradient-cache step's RSS then grows with the number
# of chunks. mimalloc (Microsoft, MIT; the cmeel-mimalloc wheel) reuses freed memory for the
# next chunk instead, at glibc's speed (bench/results/allocator.md). malloc can only be
# replaced when a process starts, so the CLI re-runs its training commands with the library
# preloaded; DENSEFIT_ALLOCATOR=system keeps the system's malloc.
# Set in the re-run's environment (so it never re-runs again); callers that start their own
# processes drop it to let the child choose its allocator afresh.
PRELOADED = "DENSEFIT_ALLOCATOR_PRELOADED"
_OFF = ("system", "glibc", "off", "none", "0", "false")


def mimalloc_library() -> str | None:
    """Path of ``libmimalloc.so`` from the cmeel-mimalloc wheel, or None when not installed."""

    try:
        found = files("cmeel-mimalloc") or []
    except PackageNotFoundError:
        return None
    for f in sorted(found, key=lambda f: len(f.name)):  # libmimalloc.so before .so.3.x
        if f.name.startswith("libmimalloc.so"):
            path = str(f.locate())
            if os.path.exists(path):
                return path
    return None


def allocator_in_use() -> str:
    """``mimalloc`` when it serves this process's malloc (preloaded), else ``system``."""
    if "libmimalloc" not in os.environ.get("LD_PRELOAD", ""):
        return "system"
    try:
        with open("/proc/self/maps") as maps:
            return "mimalloc" if "libmimalloc" in maps.read() else "system"
    except OSError:
        return "system"


def preload_env(env: dict | None = None) -> dict | None:
    """The environment that re-runs this process under mimalloc; None when it should not.

    Not when: not Linux, ``DENSEFIT_ALLOCATOR=system``, mimalloc already serves this
    process, this process is already the re-run (no loop), or the wheel is not installed.

    >>> preload_env({"DENSEFIT_ALLOCATOR": "system"}) is None
    True
    """
    env = dict(os.environ if env is None else env)
    if not sys.platform.startswith("linux"):
        return None
    if env.get("DENSEFIT_ALLOCATOR", "mimalloc").strip().lower() in _OFF:
        return None
    if env.get(PRELOADED) or allocator_in_use() == "mimalloc":
        return None
    library = mimalloc_library()
    if library is None:
        return None
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    env[PRELOADED] = "1"
    # Never hand freed pages back to the OS: re-faulting them made cache steps 1.1-1.2x
    # slower (bench/results/allocator.md); kept, they serve the next chunk's activations.
    env.setdefault("MIMALLOC_PURGE_DELAY", "-1")
    return env


def rerun_with_mimalloc() -> None:
    """Replace this process by the same command with mimalloc preloaded (same PID).

    Returns (doing nothing) when :func:`preload_env` says no. Call it before any work.
    """
    env = preload_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # sys.orig_argv: the interpreter's own options too (``-m densefit``, ``-c ...``)
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # cannot re-run: carry on with the system allocator
        return


_MI_OPTION_PURGE_DELAY = 15  # mi_option_purge_delay in mimalloc.h (2.x and 3.x)


@contextlib.contextmanager
def returning_freed_memory():
    """Inside, memory freed goes back to the OS, so that the resident set after is what is live.

    Under mimalloc (whose purging the CLI turns off) purging is on at once inside and the
    freed pages are collected on the way out; under glibc the heap is trimmed on the way
    out. The planner probes the model inside, so the process's resident set measured after
    it does not count the probe's freed buffers (:mod:`densefit.memory.process`).
    """
    lib = None
    if allocator_in_use() == "mimalloc":
        lib = ctypes.CDLL(None)  # the preloaded library's symbols
        lib.mi_option_get.restype = ctypes.c_long
        previous = lib.mi_option_get(_MI_OPTION_PURGE_DELAY)
        lib.mi_option_set(_MI_OPTION_PURGE_DELAY, ctypes.c_long(0))
    try:
        yield
    finally:
        gc.collect()
        if lib is not None:
            lib.mi_collect(True)
            lib.mi_option_set(_MI_OPTION_PURGE_DELAY, ctypes.c_long(previous))
        else:
            with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
                ctypes.CDLL("libc.so.6").malloc_trim(0)


if __name__ == "__main__":  # `LD_PRELOAD=$(python -m densefit.memory.allocator) python train.py`
    print(mimalloc_library() or "")
