"""PostgreSQL ingest: documents per second into a store's HNSW-indexed vector table, the
index kept up row by row against built once after a load (densefit.retrieval.index.pgvector,
BULK_MIN), and the recall@10 of the index each leaves.

    nice -n 10 python bench/pg_ingest.py --wheel pgserver [--rows 10000] [--dim 384]
    python bench/pg_ingest.py --plot-only                  # redraw from the JSON

``--rows`` random unit vectors of ``--dim`` dimensions with short texts go into a new table
of a throwaway server (``--wheel``'s, the committed results pgserver's PostgreSQL 16.2 with
pgvector 0.6.2; or the server ``DENSEFIT_TEST_POSTGRES`` names), two ways: one
``write`` of all of them (a Haystack ``write_documents``, a server's batch), and commits of
1,024 under the writer lock then ``flush`` (as ``densefit index`` writes). "row by row" sets
BULK_MIN above ``--rows`` (every row inserted into the HNSW graph as it is written); "load"
keeps the engine's BULK_MIN. Recall@10: 100 random queries, HNSW against an exact scan.
The crossover table times one write of 100, 300 and 1,000 documents into an empty store.

Writes bench/results/pg_ingest.json and pg_ingest.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def ingest(uri: str, docs, vectors, *, chunked: bool) -> tuple[float, str]:
    """``(seconds, target)``: the time to write ``docs`` into a new store, building what a
    load defers, and the store's target."""
    from densefit.retrieval.index.engines import open_store
    from densefit.testing.postgres import postgres_target

    target = postgres_target(uri, f"bench_{uuid.uuid4().hex[:12]}")
    with open_store(target, record=_record(vectors)) as store:
        started = time.perf_counter()
        if chunked:
            with store.writer_lock():
                for start in range(0, len(docs), 1024):
                    store.write(docs[start : start + 1024], vectors[start : start + 1024])
                store.flush()
        else:
            store.write(docs, vectors)
            store.flush()
        return time.perf_counter() - started, target


def recall(target: str, queries: np.ndarray) -> float:
    """Recall@10 of the store's HNSW search against its exact scan."""
    from densefit.retrieval.index.engines import open_store

    with open_store(target) as hnsw, open_store(target, backend="exact") as exact:
        found, truth = hnsw.search(queries, 10), exact.search(queries, 10)
    return float(np.mean([len({h.id for h in a} & {h.id for h in e}) / 10
                          for a, e in zip(found, truth)]))  # fmt: skip


def _record(vectors: np.ndarray):
    from densefit.retrieval.index.types import StoreRecord

    dim = vectors.shape[1]
    return StoreRecord("random", dim, "cosine", "float32", np.zeros((3, dim), np.float32), None)


def corpus(n: int, dim: int, seed: int = 0):
    from densefit.data.types import Document

    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    words = "cell protein python kernel socket river bread music zebra vitamin bone".split()
    docs = [Document(f"d{i:07d}", " ".join(rng.choice(words, 6))) for i in range(n)]
    return docs, vectors


def plot(result: dict) -> None:
    """pg_ingest.png: documents/s of each way, and the seconds of one small write."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    runs = result["runs"]
    left.barh([f"{r['index']}, {r['writes']}" for r in runs], [r["docs_per_s"] for r in runs])
    for k, r in enumerate(runs):
        left.annotate(f"{r['docs_per_s']:,.0f}/s, recall@10 {r['recall@10']}", (r["docs_per_s"], k),
                      xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)  # fmt: skip
    left.set_xlabel(f"documents/s into a new store ({result['rows']:,} x {result['dim']}-d)")
    left.set_xlim(0, max(r["docs_per_s"] for r in runs) * 1.6)
    rows = result["crossover_seconds"]
    for how in ("row by row", "load"):
        right.plot([r["documents"] for r in rows], [r[how] for r in rows], marker="o", label=how)
    right.set_xlabel("documents in one write into an empty store")
    right.set_ylabel("seconds")
    right.legend()
    fig.suptitle(f"PostgreSQL {result['postgresql']} + pgvector {result['pgvector']}: the HNSW "
                 "index kept row by row, or built once after a load", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(RESULTS / "pg_ingest.png", dpi=130)


def main() -> None:
    from densefit.testing.postgres import WHEELS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--wheel", choices=list(WHEELS),
                        help="the server's wheel (default: DENSEFIT_TEST_POSTGRES, else the "
                        "first installed; the committed results: pgserver)")  # fmt: skip
    parser.add_argument("--plot-only", action="store_true", help="redraw from the JSON")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads((RESULTS / "pg_ingest.json").read_text()))
        return
    from densefit.retrieval.index import pgvector as engine
    from densefit.testing.postgres import postgres_server

    docs, vectors = corpus(args.rows, args.dim)
    queries = np.random.default_rng(1).standard_normal((100, args.dim)).astype(np.float32)
    bulk_min = engine.BULK_MIN
    runs = []
    with (
        tempfile.TemporaryDirectory(prefix="pg-ingest-") as folder,
        postgres_server(folder, args.wheel) as uri,
    ):
        for how, threshold in (("row by row", args.rows + 1), ("load", bulk_min)):
            engine.BULK_MIN = threshold
            for chunked in (False, True):
                seconds, target = ingest(uri, docs, vectors, chunked=chunked)
                run = {
                    "index": how,
                    "writes": "commits of 1024 + flush" if chunked else "one write",
                    "seconds": round(seconds, 2),
                    "docs_per_s": round(len(docs) / seconds, 1),
                    "recall@10": round(recall(target, queries), 3),
                }
                print(json.dumps(run), flush=True)
                runs.append(run)
        crossover = []
        for n in (100, 300, 1000):
            small_docs, small_vectors = docs[:n], vectors[:n]
            row = {"documents": n}
            for how, threshold in (("row by row", n + 1), ("load", 1)):
                engine.BULK_MIN = threshold
                row[how] = round(ingest(uri, small_docs, small_vectors, chunked=False)[0], 3)
            print(json.dumps(row), flush=True)
            crossover.append(row)
        engine.BULK_MIN = bulk_min
        import psycopg

        with psycopg.connect(uri) as conn:
            server = conn.execute("SHOW server_version").fetchone()[0]
            pgvector = conn.execute(
                "SELECT extversion FROM pg_extension WHERE extname = 'vector'"
            ).fetchone()[0]

    result = {
        "rows": args.rows,
        "dim": args.dim,
        "bulk_min": bulk_min,
        "runs": runs,
        "crossover_seconds": crossover,
        "loadavg": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "postgresql": server,
        "pgvector": pgvector,
        "psycopg": psycopg.__version__,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pg_ingest.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result)


if __name__ == "__main__":
    main()
