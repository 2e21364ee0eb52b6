"""How long a command takes before it does anything: `densefit --help`, `densefit train
--help`, a bad option, and `densefit search` on a small store, for this checkout and for an
earlier revision (the baseline, default: the last commit before the layers work), measured
in the same run, alternating, each in a fresh process.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/startup.py [--baseline REV] [--repeats 7]

The baseline is checked out with `git worktree add --detach` into a temporary folder and run
with the same interpreter (this checkout's .venv), its checkout first on PYTHONPATH, so the
two differ only in densefit's own code. The store (20 SciFact documents, all-MiniLM-L6-v2)
is built by each revision for itself, in its own store format. Writes
bench/results/startup.{json,csv,png}: the median wall time and CPU time (user + system) of
each command, the load average before and after, the threads.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import pyplot
from _runner import DATASETS, RESULTS, ROOT, child_env, command_line, git_commit, loadavg

# The last commit before the package loaded lazily and the CLI was generated from declarations.
BASELINE = "2081048"


def commands(store: Path) -> dict[str, list[str]]:
    return {
        "densefit --help": ["--help"],
        "densefit train --help": ["train", "--help"],
        "densefit train: a bad option": ["train", "data.jsonl", "-o", "out", "--batch-size", "0"],
        "densefit search (small store)": ["search", "--store", str(store), "vitamin D", "-k", "3"],
    }


def timed(checkout: Path, args: list[str], cwd: Path) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the child, exit status) of `densefit ARGS`."""
    env = child_env(extra={"PYTHONPATH": str(checkout), "DENSEFIT_ALLOCATOR": "system"})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "densefit", *args], cwd=cwd, env=env, capture_output=True
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def build_store(folder: Path, checkout: Path) -> Path:
    """20 SciFact abstracts indexed with all-MiniLM-L6-v2 by ``checkout`` (each revision
    searches a store in its own format)."""
    source = DATASETS / "scifact" / "corpus.jsonl.gz"
    import gzip

    with gzip.open(source, "rt", encoding="utf-8") as fh:
        rows = [next(fh) for _ in range(20)]
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(rows), encoding="utf-8")
    store = folder / "store"
    env = child_env(extra={"PYTHONPATH": str(checkout)})
    subprocess.run(
        [sys.executable, "-m", "densefit", "index", str(corpus), "--store", str(store),
         "--model", "all-MiniLM-L6-v2", "--no-progress"],
        check=True, env=env, capture_output=True,
    )  # fmt: skip
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help="git revision to compare with")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="densefit-startup-") as tmp:
        tmp = Path(tmp)
        old = tmp / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.baseline],
            check=True, capture_output=True,
        )  # fmt: skip
        try:
            versions = {"baseline": old, "this checkout": ROOT}
            stores = {
                v: build_store(tmp / f"store-{i}", c) for i, (v, c) in enumerate(versions.items())
            }
            samples: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
            for _ in range(args.repeats):
                for name in commands(tmp):
                    for version, checkout in versions.items():  # alternating, same conditions
                        argv = commands(stores[version])[name]
                        samples.setdefault((name, version), []).append(timed(checkout, argv, tmp))
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                capture_output=True,
            )
    rows = []
    for (name, version), runs in samples.items():
        rows.append(
            {
                "command": name,
                "version": version,
                "median_wall_s": round(statistics.median(r[0] for r in runs), 3),
                "median_cpu_s": round(statistics.median(r[1] for r in runs), 3),
                "min_wall_s": round(min(r[0] for r in runs), 3),
                "exit_codes": sorted({r[2] for r in runs}),
                "repeats": len(runs),
            }
        )
    for row in rows:
        base = next(
            r for r in rows if r["command"] == row["command"] and r["version"] == "baseline"
        )
        row["wall_vs_baseline"] = round(row["median_wall_s"] / base["median_wall_s"], 3)
    payload = {
        "what": "wall and CPU time of densefit commands that do no work (help, a bad option) "
        "and of a search on a 20-document store, fresh process each, medians",
        "command": command_line("startup.py", sys.argv[1:]),
        "baseline": args.baseline,
        "this_checkout": git_commit(),
        "load_before": load_before,
        "load_after": loadavg(),
        "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps(payload, indent=2) + "\n")
    with open(RESULTS / "startup.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(
            f"{row['command']:32s} {row['version']:14s} wall {row['median_wall_s']:.3f}s "
            f"cpu {row['median_cpu_s']:.3f}s ({row['wall_vs_baseline']:.2f}x baseline)"
        )
    plot(rows)


def plot(rows: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(dict.fromkeys(r["command"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, version in enumerate(("baseline", "this checkout")):
        values = [
            next(r["median_wall_s"] for r in rows if r["command"] == n and r["version"] == version)
            for n in names
        ]
        ax.barh([j + i * 0.4 for j in range(len(names))], values, height=0.4, label=version)
    ax.set_yticks([j + 0.2 for j in range(len(names))], names)
    ax.set_xlabel("median wall time (s), fresh process")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "startup.png", dpi=120)


if __name__ == "__main__":
    main()
