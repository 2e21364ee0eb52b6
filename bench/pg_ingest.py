"""PostgreSQL ingest: documents per second into a store's HNSW-indexed vector table, the
index kept up row by row against built once after a load (densefit.retrieval.index.pgvector,
BULK_MIN), and the recall@10 of the index each leaves.

    nice -n 10 python bench/pg_ingest.py [--rows 10000] [--dim 384]

``--rows`` random unit vectors of ``--dim`` dimensions with short texts go into a new table
of a throwaway pgserver (or the server ``DENSEFIT_TEST_POSTGRES`` names), two ways: one
``write`` of all of them (a Haystack ``write_documents``, a server's batch), and commits of
1,024 under the writer lock then ``flush`` (as ``densefit index`` writes). "row by row" sets
BULK_MIN above ``--rows`` (every row inserted into the HNSW graph as it is written); "load"
keeps the engine's BULK_MIN. Recall@10: 100 random queries, HNSW against an exact scan.
The crossover table times one write of 100, 300 and 1,000 documents into an empty store.

Writes bench/results/pg_ingest.json.
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
    from densefit.retrieval.index.settings import StoreRecord

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=384)
    args = parser.parse_args()
    from densefit.retrieval.index import pgvector as engine
    from densefit.testing.postgres import postgres_server

    docs, vectors = corpus(args.rows, args.dim)
    queries = np.random.default_rng(1).standard_normal((100, args.dim)).astype(np.float32)
    bulk_min = engine.BULK_MIN
    runs = []
    with tempfile.TemporaryDirectory(prefix="pg-ingest-") as folder, postgres_server(folder) as uri:
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


if __name__ == "__main__":
    main()
