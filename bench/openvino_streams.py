"""OpenVINO calls side by side: densefit's session settings against OpenVINO's latency default.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/openvino_streams.py   # ~3 min, quiet CPU

A server runs OpenVINO from several threads at once: its query workers, and its writer, which
embeds documents with a second compiled model when the queries run an int8 file over an fp32
store; ``densefit index --nproc`` runs one process per core. Under OpenVINO's latency hint
(one stream of ``INFERENCE_NUM_THREADS`` threads, pinned to the first cores) each of those
lands on the same core. This script measures calls/s of all-MiniLM-L6-v2's OpenVINO files
(exported once into ``--model-dir`` as ``densefit export`` does) in each case, one fresh
process per point (two for the two-process case), for two settings:

- ``pinned``: ``PERFORMANCE_HINT=LATENCY``, ``INFERENCE_NUM_THREADS`` = torch's threads, one
  infer request behind a lock (OpenVINO's latency default);
- ``densefit``: densefit's session as it is (``Runtime.from_file``,
  :func:`~densefit.retrieval.runtimes.openvino_properties`: a stream per caller's threads,
  unpinned, an infer request per thread).

Cases (the query: 1 text of 24 tokens; documents: 8 texts of 128 tokens):
``one caller`` (queries, 1 and 2 threads), ``two callers`` (two threads on one session),
``query + writer`` (int8 queries in one thread, fp32 documents in another: the int8 server
with a writer), ``two processes`` (one caller each). Writes
bench/results/openvino_streams.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import threading
import time
from pathlib import Path

from _common import pyplot
from _runner import DATASETS, RESULTS, ROOT, command_line, environment, loadavg, start_child

sys.path.insert(0, str(ROOT))

MODEL = "all-MiniLM-L6-v2"
SETTINGS = ("pinned", "densefit")
# case -> (torch threads, [(file, shape) for each calling thread])
CASES = {
    "one caller, 1 thread": (1, [("fp32", "query")]),
    "one caller, 2 threads": (2, [("fp32", "query")]),
    "two callers, one session": (1, [("fp32", "query"), ("fp32", "query")]),
    "query + writer": (1, [("int8", "query"), ("fp32", "documents")]),
    "two processes": (1, [("fp32", "query")]),  # run twice at once
}
SHAPES = {"query": (1, 24), "documents": (8, 128)}
FILES = {"fp32": "openvino_model.xml", "int8": "openvino_model_qint8_quantized.xml"}


def prepared(model_dir: Path) -> Path:
    """``model_dir`` with its OpenVINO fp32 and int8 files (exported once)."""
    from densefit.models import load_model
    from densefit.retrieval.export import export_model

    if all((model_dir / "openvino" / f).is_file() for f in FILES.values()):
        return model_dir
    export_model(
        load_model(model_dir if model_dir.is_dir() else MODEL, device="cpu"),
        ["openvino", "openvino-int8"],
        folder=model_dir,
        calibration=DATASETS / "scifact",
        on_check_failure="warn",
    )
    return model_dir


def session(setting: str, path: Path):
    """A callable on the feature arrays: densefit's session, or the latency default."""
    import torch

    if setting == "densefit":
        from densefit.retrieval.runtimes import Runtime

        return Runtime.from_file("openvino", path).session
    import numpy as np
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(
        core.read_model(str(path)),
        "CPU",
        {
            "INFERENCE_NUM_THREADS": torch.get_num_threads(),
            "INFERENCE_PRECISION_HINT": "f32",
            "PERFORMANCE_HINT": "LATENCY",
        },
    )
    request, lock, output = compiled.create_infer_request(), threading.Lock(), compiled.output(0)

    def run(features: dict):
        with lock:
            return np.array(request.infer(features)[output], copy=True)

    return run


def child(spec: dict) -> dict:
    """Run one point: each calling thread loops on its session for ``seconds``."""
    import numpy as np
    import torch

    threads, callers = CASES[spec["case"]]
    torch.set_num_threads(threads)
    folder = Path(spec["model_dir"]) / "openvino"
    sessions = {f: session(spec["setting"], folder / FILES[f]) for f in {f for f, _ in callers}}
    feeds = {}
    for name, (rows, length) in SHAPES.items():
        ones = np.ones((rows, length), dtype=np.int64)
        feeds[name] = {"input_ids": ones, "attention_mask": ones, "token_type_ids": 0 * ones}
    for f, shape in callers:  # warm: compile the shapes
        sessions[f](feeds[shape])
    time.sleep(max(0.0, spec["start_at"] - time.time()))  # two processes start together
    calls = [0] * len(callers)
    start = threading.Barrier(len(callers) + 1)

    def loop(i: int, f: str, shape: str):
        start.wait()
        stop = time.perf_counter() + spec["seconds"]
        while time.perf_counter() < stop:
            sessions[f](feeds[shape])
            calls[i] += 1

    workers = [threading.Thread(target=loop, args=(i, f, s)) for i, (f, s) in enumerate(callers)]
    for w in workers:
        w.start()
    cpu0, t0 = os.times(), time.perf_counter()
    start.wait()
    for w in workers:
        w.join()
    wall, cpu1 = time.perf_counter() - t0, os.times()
    cpu = cpu1.user + cpu1.system - cpu0.user - cpu0.system
    return {
        "calls_per_second": [c / wall for c in calls],
        "callers": [f"{f} {s}" for f, s in callers],
        "cores_busy": cpu / wall,
    }


def point(spec: dict, threads: int) -> dict:
    """One point in fresh processes (two at once for ``two processes``)."""
    before = loadavg()
    spec = {**spec, "start_at": time.time() + 10}  # after both children compiled their files
    runs = [
        start_child(__file__, "--child", json.dumps(spec), threads=threads)
        for _ in range(2 if spec["case"] == "two processes" else 1)
    ]
    done = [r.wait(300) for r in runs]
    for child_run in done:
        if not child_run.ok:
            raise RuntimeError(f"{spec['case']} / {spec['setting']}: {child_run.stderr[-2000:]}")
    outs = [child_run.result for child_run in done]
    if len(outs) == 2:
        result = {
            "calls_per_second": [o["calls_per_second"][0] for o in outs],
            "callers": [f"process {i + 1}: {o['callers'][0]}" for i, o in enumerate(outs)],
            "cores_busy": sum(o["cores_busy"] for o in outs),
        }
    else:
        result = outs[0]
    return {**spec, **result, "loadavg_before": before, "loadavg_after": loadavg()}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.38
    for j, setting in enumerate(SETTINGS):
        for i, case in enumerate(cases):
            row = next(r for r in rows if r["case"] == case and r["setting"] == setting)
            bottom = 0.0
            for k, value in enumerate(row["calls_per_second"]):
                ax.bar(
                    i + (j - 0.5) * width,
                    value,
                    width,
                    bottom=bottom,
                    color=("#9aa5b1", "#2a6f97")[j],
                    edgecolor="white",
                    label=setting if i == 0 and k == 0 else None,
                )
                bottom += value
            ax.text(i + (j - 0.5) * width, bottom, f"{row['cores_busy']:.1f}", ha="center",
                    va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(cases)), cases, fontsize=8)
    ax.set_ylabel("calls/s (stacked over callers)")
    ax.set_title("OpenVINO, all-MiniLM-L6-v2, calls side by side (label: cores busy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "bench/.cache/openvino-model")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--name", default="openvino_streams")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    model_dir = prepared(args.model_dir)
    rows = []
    for case, (threads, _) in CASES.items():
        for setting in SETTINGS:
            spec = {"case": case, "setting": setting, "seconds": args.seconds}
            row = point({**spec, "model_dir": str(model_dir)}, threads)
            row.pop("model_dir")
            row.pop("start_at")
            row["threads"] = threads
            rows.append(row)
            print(json.dumps(row), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "what": "calls/s of OpenVINO sessions called side by side, densefit's settings vs "
        "OpenVINO's latency default (pinned); one row per case and setting",
        "command": command_line(__file__, sys.argv[1:]),
        "environment": environment(),
        "model": MODEL,
        "shapes": {k: {"texts": r, "tokens": t} for k, (r, t) in SHAPES.items()},
        "rows": rows,
    }
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=2) + "\n")
    with open(RESULTS / f"{args.name}.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["case", "setting", "threads", "caller", "calls_per_second",
                         "cores_busy", "loadavg_before"])  # fmt: skip
        for r in rows:
            for caller, value in zip(r["callers"], r["calls_per_second"], strict=True):
                writer.writerow([r["case"], r["setting"], r["threads"], caller, f"{value:.2f}",
                                 f"{r['cores_busy']:.2f}", r["loadavg_before"][0]])  # fmt: skip
    plot(rows, RESULTS / f"{args.name}.png")
    print(f"wrote {RESULTS / args.name}.{{json,csv,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
