"""Run benchmark points, each in a fresh process, with results appended as they finish.

:func:`run_child` (or :func:`start_child`, for children that overlap) is the one way a
bench script runs a point in a fresh interpreter (:func:`child_env` its environment) and
reads its ``RESULT {json}`` line; :func:`environment` is the one record of the machine and
the software a run used, :func:`command_line` of the command; :data:`DATASETS` is where the
BEIR folders are, :func:`untitled_copy` a folder's copy without titles. :func:`run_point` /
:func:`run_all` run the memory benchmarks' points.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
# The BEIR folders (scifact, nfcorpus, manpages, pydoc): $DENSEFIT_DATASETS, else the shared
# copy beside the checkout.
DATASETS = Path(os.environ.get("DENSEFIT_DATASETS", ROOT.parent / "shared" / "datasets"))


def untitled_copy(source: Path, target: Path) -> Path:
    """A plain-JSONL copy of the BEIR folder ``source`` at ``target`` with every document's
    title left out, made once (manpages' README: its gcloud pages' titles spell out the
    command the query asks for, so the benchmarks read it untitled)."""
    import gzip
    import shutil

    from densefit.data.corpus import find_beir_file

    if (target / "corpus.jsonl").is_file():
        return target
    (target / "qrels").mkdir(parents=True, exist_ok=True)

    def read(stem: str):
        path = find_beir_file(source, stem)
        return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)

    with read("queries") as f:
        (target / "queries.jsonl").write_text(f.read())
    for split in source.glob("qrels/*.tsv"):
        shutil.copy(split, target / "qrels" / split.name)
    with read("corpus") as f, open(target / "corpus.jsonl.tmp", "w") as g:
        for line in f:
            row = json.loads(line)
            g.write(json.dumps({"_id": row["_id"], "title": "", "text": row["text"]}) + "\n")
    os.replace(target / "corpus.jsonl.tmp", target / "corpus.jsonl")
    return target


def git_commit(*, short: bool = True) -> str:
    """This checkout's commit (abbreviated unless ``short=False``); "" when git cannot say."""
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", *(["--short"] if short else []), "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return ""


def environment() -> dict:
    """Where a run ran: library versions, interpreter, machine, thread settings, commit;
    on a GPU its name, memory, CUDA and cuDNN versions too (:func:`gpu`)."""
    import sentence_transformers
    import torch
    import transformers

    return {
        **gpu(),
        "torch": torch.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
        "git_commit": git_commit(),
    }


def gpu() -> dict:
    """The CUDA GPU this process sees (device 0), its memory and the CUDA, cuDNN and driver
    versions; empty without one."""
    import torch

    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = ""
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_count": torch.cuda.device_count(),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "gpu_driver": driver,
    }


def command_line(script: str, argv: list[str]) -> str:
    """This invocation as a shell line: the thread settings it ran under, then
    ``python bench/NAME`` (``script``'s file name: a name, a relative path or ``__file__``)
    and ``argv`` (quoted as a shell needs).

    >>> command_line("/work/x/bench/serve.py", ["--seconds", "5"]).endswith(
    ...     "python bench/serve.py --seconds 5")
    True
    """
    threads = " ".join(
        f"{name}={os.environ[name]}"
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
        if name in os.environ
    )
    return " ".join(filter(None, [threads, f"python bench/{Path(script).name}", shlex.join(argv)]))


def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it, with its family and model numbers (two CPUs
    of one name can differ a lot, int8 kernels above all), and the matrix instructions
    that int8 and bf16 inference use where it has them."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return processor()
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip():
            break  # the first processor is enough
    flags = set(fields.get("flags", "").split())
    isa = [
        f for f in ("avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if f in flags
    ]
    name = fields.get("model name") or processor()
    return f"{name} (family {fields.get('cpu family')}, model {fields.get('model')}; {' '.join(isa) or 'no VNNI/AMX'})"


def processor() -> str:
    """The CPU's name, or the machine type where the platform does not say."""
    return platform.processor() or platform.machine()


def machine_note(threads: int) -> dict:
    """:func:`environment`'s facts under the names the memory benchmarks record."""
    env = environment()
    return {
        "threads": threads,
        "cpus": env["cpu_count"],
        "torch": env["torch"],
        "python": env["python"],
        "processor": processor(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "pinned_cpus": os.environ.get("DENSEFIT_BENCH_CPUS", "none"),
        "note": os.environ.get("DENSEFIT_BENCH_NOTE", ""),
    }


# ----------------------------------------------------------------------------- one child


def status() -> dict:
    """Resident memory of this process from /proc/self/status, MiB."""
    wanted = {"VmRSS", "RssAnon", "RssFile", "VmHWM"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in wanted:
                out[name] = round(int(value.split()[0]) / 1024, 1)
    return out


def loadavg() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded to 2 places."""
    return [round(x, 2) for x in os.getloadavg()]


def child_env(threads: int | str | None = None, extra: dict | None = None) -> dict:
    """The environment of a point's child: this one, offline, with this checkout first on
    PYTHONPATH; ``threads`` sets OMP_NUM_THREADS and MKL_NUM_THREADS (None: as they are
    here); ``extra`` sets more (a value None unsets its name)."""
    env = dict(os.environ)
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


@dataclass
class Child:
    """What one point's child left: its result, exit status, output, timing and load."""

    result: dict | None  # the JSON of its last ``RESULT `` line; None when it printed none
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    wall_s: float
    loadavg_before: list[float]  # 1, 5 and 15 minutes, at the start
    loadavg_after: list[float]
    finished: str  # local time at the end, "%Y-%m-%d %H:%M:%S"

    @property
    def ok(self) -> bool:
        """It printed a result and exited 0."""
        return self.result is not None and self.returncode == 0

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


class Running:
    """A point's child started by :func:`start_child`; :meth:`wait` collects it."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.loadavg_before = loadavg()
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def wait(self, timeout: float | None = None) -> Child:
        """Wait for the child (killed after ``timeout`` seconds; None: no limit)."""
        try:
            stdout, stderr = self.proc.communicate(timeout=timeout)
            returncode = self.proc.returncode
        except subprocess.TimeoutExpired:
            self.proc.kill()
            stdout, stderr = self.proc.communicate()
            returncode = None
        lines = [x for x in (stdout or "").splitlines() if x.startswith("RESULT ")]
        return Child(
            result=json.loads(lines[-1][len("RESULT ") :]) if lines else None,
            returncode=returncode,
            stdout=stdout or "",
            stderr=stderr or "",
            wall_s=round(time.perf_counter() - self.started, 1),
            loadavg_before=self.loadavg_before,
            loadavg_after=loadavg(),
            finished=time.strftime("%Y-%m-%d %H:%M:%S"),
        )


def start_child(
    script: str | Path,
    *args: str,
    threads: int | str | None = None,
    env: dict | None = None,
    prefix: list[str] | tuple[str, ...] = (),
) -> Running:
    """Start ``python script *args`` in a fresh interpreter (its own memory and threads);
    :meth:`Running.wait` reads the ``RESULT {json}`` line it prints last, with its wall
    time and the load before/after. ``threads`` and ``env``: as :func:`child_env`;
    ``prefix``: a command to run it under (``taskset -c 0``)."""
    return Running([*prefix, sys.executable, str(script), *args], child_env(threads, env))


def run_child(
    script: str | Path,
    *args: str,
    threads: int | str | None = None,
    env: dict | None = None,
    timeout: float | None = None,
    prefix: list[str] | tuple[str, ...] = (),
) -> Child:
    """Run one point in a fresh interpreter and wait for it: :func:`start_child`, then
    :meth:`Running.wait` with ``timeout`` (seconds before the child is killed)."""
    return start_child(script, *args, threads=threads, env=env, prefix=prefix).wait(timeout)


# ----------------------------------------------------------------------------- memory points


def run_point(spec: dict, *, timeout: float = 1800) -> dict:
    """Run one point in a fresh interpreter; returns its result (status 'crashed' on failure)."""
    # The allocator: densefit's points run under mimalloc as its CLI does (see
    # densefit.memory.allocator), peers under the system's malloc as their users run them;
    # "allocator" in a spec overrides. The worker records which one served the point.
    from densefit.memory.allocator import PRELOADED, preload_env

    threads = spec.get("threads", 1)
    extra: dict = {"LD_PRELOAD": None, PRELOADED: None}
    wanted = spec.get("allocator") or ("mimalloc" if spec.get("impl") == "densefit" else "system")
    if wanted == "mimalloc":
        base = child_env(threads, extra)
        preloaded = preload_env({**base, "DENSEFIT_ALLOCATOR": "mimalloc"}) or base
        extra.update({k: v for k, v in preloaded.items() if base.get(k) != v})
    extra.update(spec.get("env") or {})  # per-point settings; None unsets
    # DENSEFIT_BENCH_CPUS=0 pins points to CPU 0 (other work goes to the other core).
    pin = os.environ.get("DENSEFIT_BENCH_CPUS")
    child = run_child(
        HERE / "_step_worker.py",
        json.dumps(spec),
        threads=threads,
        env=extra,
        timeout=timeout,
        prefix=["taskset", "-c", pin] if pin else [],
    )
    if child.timed_out:
        result = {**spec, "status": "timeout"}
    elif child.result is not None:
        result = child.result
    else:
        killed = child.returncode in (-9, 137)
        tail = child.stderr.strip().splitlines()[-3:]
        result = {
            **spec,
            "status": "oom-killed" if killed else "crashed",
            "error": " | ".join(tail)[:300],
        }
    result["wall_s"] = child.wall_s
    result["loadavg_before"] = child.loadavg_before[0]
    result["loadavg_after"] = child.loadavg_after[0]
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
