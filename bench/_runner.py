"""Run benchmark points, each in a fresh process, with results appended as they finish."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def machine_note(threads: int) -> dict:
    import platform

    import torch

    return {
        "threads": threads,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "pinned_cpus": os.environ.get("DENSEFIT_BENCH_CPUS", "none"),
        "note": os.environ.get("DENSEFIT_BENCH_NOTE", ""),
    }


def run_point(spec: dict, *, timeout: float = 1800) -> dict:
    """Run one point in a fresh interpreter; returns its result (status 'crashed' on failure)."""
    env = dict(os.environ)
    threads = str(spec.get("threads", 1))
    env.update(
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    # The allocator: densefit's points run under mimalloc as its CLI does (see
    # densefit.memory.allocator), peers under the system's malloc as their users run them;
    # "allocator" in a spec overrides. The worker records which one served the point.
    from densefit.memory.allocator import PRELOADED, preload_env

    env.pop("LD_PRELOAD", None)
    env.pop(PRELOADED, None)
    wanted = spec.get("allocator") or ("mimalloc" if spec.get("impl") == "densefit" else "system")
    if wanted == "mimalloc":
        env = preload_env({**env, "DENSEFIT_ALLOCATOR": "mimalloc"}) or env
    for key, value in (spec.get("env") or {}).items():  # per-point settings; None unsets
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    try:
        # DENSEFIT_BENCH_CPUS=0 pins points to CPU 0 (other work goes to the other core).
        pin = os.environ.get("DENSEFIT_BENCH_CPUS")
        prefix = ["taskset", "-c", pin] if pin else []
        proc = subprocess.run(
            [*prefix, sys.executable, str(HERE / "_step_worker.py"), json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if lines:
            result = json.loads(lines[-1][len("RESULT ") :])
        else:
            killed = proc.returncode in (-9, 137)
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            result = {
                **spec,
                "status": "oom-killed" if killed else "crashed",
                "error": " | ".join(tail)[:300],
            }
    except subprocess.TimeoutExpired:
        result = {**spec, "status": "timeout"}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["loadavg_before"] = round(load_before, 2)
    result["loadavg_after"] = round(os.getloadavg()[0], 2)
    return result


def run_all(specs: list[dict], out_jsonl: Path, *, resume: bool = True) -> list[dict]:
    """Run every spec not already in ``out_jsonl``; print one line per point."""
    done = {}
    if resume and out_jsonl.exists():
        for line in out_jsonl.read_text().splitlines():
            r = json.loads(line)
            done[r["key"]] = r
    results = []
    for spec in specs:
        if spec["key"] in done:
            results.append(done[spec["key"]])
            continue
        if spec.get("skip_reason"):
            result = {**spec, "status": spec["skip_reason"]}
        else:
            result = run_point(spec)
        results.append(result)
        with out_jsonl.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(
            f"{spec['key']:<48} {result.get('status'):<10} step {result.get('step_time_s')}s "
            f"act {result.get('activation_mb')} MiB peak {result.get('peak_rss_mb')} MiB "
            f"pad {result.get('padding_efficiency')} load {result.get('loadavg_before')}",
            flush=True,
        )
    return results
