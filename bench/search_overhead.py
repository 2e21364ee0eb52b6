"""Search latency of this checkout against another revision of densefit (by default the engine
layer before its redesign into one contract), on the same stores, in alternating processes.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/search_overhead.py            # ~6 min
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/search_overhead.py --baseline HEAD~3

What: one query at a time (k=10, dense, no filter) through ``store.search`` of the SciFact
stores bench/engines.py builds (run its ``--parts corpora --datasets scifact`` first: the
stores and query vectors are read from bench/.cache/engines), for the points both revisions
can open: the embedded store with its ``exact`` and ``faiss`` backends and Qdrant's local
mode. Each revision's ``densefit`` package is taken from git (``git archive``), each gets its
own copy of the stores, and each measurement is a fresh process that opens the store, warms
up on 20 queries and times ``--queries`` searches (the median is its p50); the revisions
alternate, in reverse order every other round, for ``--rounds`` rounds. A point's p50 is the
median of its rounds' p50s, its ratio this checkout's over the baseline's. Both revisions'
top 10 of the first 100 queries are compared (ids in order: the baseline orders equal scores
as its engine returns them, this checkout by document id, so a list with a tie may differ).

Writes bench/results/search_overhead.{json,csv,png}, with threads, the load before and after
each measurement, the revisions and the environment.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _runner import ROOT, environment, git_commit, loadavg

RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / "bench" / ".cache" / "engines"
BASELINE = "497690d"  # the last commit before the engine layer became one contract
POINTS = {  # name: (store folder under stores/scifact, target prefix, backend)
    "embedded-exact": ("embedded", "", "exact"),
    "embedded-faiss": ("embedded", "", "faiss"),
    "qdrant-local": ("qdrant", "qdrant:", "exact"),
}

CHILD = r"""
import json, sys, time
import numpy as np
from densefit.retrieval.index import open_store
target, backend, vectors, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
queries = np.load(vectors, allow_pickle=True)["queries"]
store = open_store(target, backend=backend, create=False)
for i in range(20):
    store.search(queries[i][None, :], 10)
times = []
for i in range(n):
    start = time.perf_counter()
    store.search(queries[i % len(queries)][None, :], 10)
    times.append(time.perf_counter() - start)
top = [[h.id for h in store.search(q[None, :], 10)[0]] for q in queries[:100]]
store.close()
print(json.dumps({"p50_ms": float(np.median(times)) * 1000, "top10": top}))
"""


def export(revision: str, into: Path) -> Path:
    """``revision``'s ``densefit`` package under ``into`` (its root, for PYTHONPATH)."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "densefit"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(code_root: Path, stores: Path, point: str, vectors: Path, n: int) -> dict:
    folder, prefix, backend = POINTS[point]
    env = {**os.environ, "PYTHONPATH": str(code_root), "HF_HUB_OFFLINE": "1"}
    before = loadavg()
    answer = subprocess.run(
        [sys.executable, "-c", CHILD, f"{prefix}{stores / folder}", backend, str(vectors), str(n)],
        capture_output=True, text=True, env=env, cwd=code_root, check=False,
    )  # fmt: skip
    if answer.returncode != 0:
        raise SystemExit(f"{point} at {code_root}: {answer.stderr.strip().splitlines()[-1]}")
    return json.loads(answer.stdout.strip().splitlines()[-1]) | {
        "load_before": before, "load_after": loadavg(),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help="the git revision to compare with")
    parser.add_argument("--points", nargs="+", choices=list(POINTS), default=list(POINTS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--queries", type=int, default=1000, help="timed searches per process")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    stores = CACHE / "stores" / "scifact"
    vectors = sorted((CACHE / "embeddings").glob("scifact-*.npz"))
    missing = [POINTS[p][0] for p in args.points if not (stores / POINTS[p][0]).exists()]
    if missing or not vectors:
        print(
            f"error: no SciFact stores ({', '.join(missing) or 'query vectors'}) under {CACHE}: "
            "run `python bench/engines.py --parts corpora --datasets scifact` first",
            file=sys.stderr,
        )
        return 2
    baseline = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    runs: dict[str, dict[str, list]] = {p: {"baseline": [], "checkout": []} for p in args.points}
    with tempfile.TemporaryDirectory(prefix="densefit-overhead-") as tmp:
        roots = {"baseline": export(baseline, Path(tmp) / "baseline"), "checkout": ROOT}
        copies = {}
        for side in roots:
            copies[side] = Path(tmp) / f"stores-{side}"
            for folder in {POINTS[p][0] for p in args.points}:
                shutil.copytree(stores / folder, copies[side] / folder)
        for round_ in range(args.rounds):
            order = ["baseline", "checkout"][:: 1 if round_ % 2 == 0 else -1]
            for point in args.points:
                for side in order:
                    got = measure(roots[side], copies[side], point, vectors[0], args.queries)
                    runs[point][side].append(got)
                    print(f"round {round_ + 1} {point:15s} {side:9s} p50 {got['p50_ms']:.3f} ms")
    rows = []
    for point, sides in runs.items():
        p50 = {side: statistics.median(r["p50_ms"] for r in got) for side, got in sides.items()}
        same = sum(
            a == b for a, b in zip(sides["baseline"][0]["top10"], sides["checkout"][0]["top10"])
        )
        rows.append({
            "point": point,
            "baseline_p50_ms": round(p50["baseline"], 3),
            "checkout_p50_ms": round(p50["checkout"], 3),
            "ratio": round(p50["checkout"] / p50["baseline"], 3),
            "baseline_rounds_ms": [round(r["p50_ms"], 3) for r in sides["baseline"]],
            "checkout_rounds_ms": [round(r["p50_ms"], 3) for r in sides["checkout"]],
            "same_top10_of_100": same,
            "load_1min": [r["load_before"][0] for side in sides.values() for r in side],
        })  # fmt: skip
        print(f"{point}: {rows[-1]['baseline_p50_ms']} -> {rows[-1]['checkout_p50_ms']} ms "
              f"(x{rows[-1]['ratio']}), same top 10: {same}/100")  # fmt: skip
    payload = {
        "what": __doc__.split("\n\n")[2].replace("\n", " "),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "baseline": baseline,
        "checkout": git_commit(),
        "rounds": args.rounds,
        "queries": args.queries,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "environment": environment(),
        "points": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "search_overhead.json").write_text(json.dumps(payload, indent=2) + "\n")
    with open(args.out / "search_overhead.csv", "w", newline="") as f:
        columns = ["point", "baseline_p50_ms", "checkout_p50_ms", "ratio", "same_top10_of_100"]
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot(payload, args.out / "search_overhead.png")
    return 0


def plot(payload: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    rows = payload["points"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, row in enumerate(rows):
        for shift, side, color in ((-0.2, "baseline", "#999999"), (0.2, "checkout", "#1f77b4")):
            rounds = row[f"{side}_rounds_ms"]
            label = f"{payload[side]} ({side})" if i == 0 else None
            ax.bar(i + shift, row[f"{side}_p50_ms"], 0.38, color=color, label=label)
            ax.plot([i + shift] * len(rounds), rounds, "k.", markersize=3)
        ax.text(i, max(row["baseline_p50_ms"], row["checkout_p50_ms"]) * 1.04,
                f"x{row['ratio']:.2f}", ha="center")  # fmt: skip
    ax.set_xticks(range(len(rows)), [r["point"] for r in rows])
    ax.set_ylabel("p50 ms per search (k=10, one query)")
    env = payload["environment"]
    ax.set_title(
        f"SciFact search latency, {payload['rounds']} alternating rounds "
        f"(OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, dots: rounds)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
