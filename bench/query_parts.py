"""Where the time of one search query goes: its parts in one process, then over HTTP.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/query_parts.py   # ~5 min, quiet CPU

The documents, vectors, model and exports are bench/serve.py's (its cache under
bench/.cache/serve/, made on first use: ``python bench/serve.py --prepare`` embeds the corpus,
about 10 minutes). A store of every document (15,023 documents, 384-d float32 vectors) is
built once from the cached vectors.

In one process, for each runtime (``--runtimes``) and each of ``--queries`` queries (one at
a time, the parts interleaved query by query so that drift touches every part alike):

- ``tokenize``: :func:`~densefit.retrieval.encode.tokenize_texts` (the batcher's measure);
- ``forward``: ``Runtime.embed`` on those token ids (the runtime's call, then the model's
  Pooling and Normalize), nothing else;
- ``encode``: :func:`~densefit.retrieval.encode.encode_texts` with those token ids (what a
  query worker calls); ``encode - forward`` is its own cost;
- ``vectors``: :func:`~densefit.retrieval.index.exact.exact_search` over the store's
  vectors (memory-bound: 23 MB read per query);
- ``store``: ``LocalDocumentStore.search`` (the vectors, then the hits' documents);
- ``worker``: :func:`~densefit.serve.app.search_queries` with the runtime by name, as a
  query worker runs a batch of one (it resolves the runtime, encodes, searches the store).

Over HTTP, each system served as bench/serve.py serves it (uvicorn in its own process,
``OMP_NUM_THREADS`` threads), one client sending one query at a time: p50 of ``POST /search``
and of ``GET /health``, and for densefit the server's own time per search (its
``/metrics`` request-duration sum over count, from the request's arrival to its answer):
the rest of the client's p50 is the client and the connection.

Records threads, load and the machine. Writes bench/results/query_parts.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import re
import sys
import time

import numpy as np
import serve as serve_bench
from _common import pyplot
from _runner import RESULTS, ROOT, command_line, environment, loadavg

sys.path.insert(0, str(ROOT))

PARTS = ("tokenize", "forward", "encode", "vectors", "store", "worker")


def parts_store(model, docs, embeddings):
    """The store of every document with the cached vectors (built once)."""
    path = serve_bench.CACHE / "store-parts"
    if not (path / "store.sqlite").is_file():
        documents, vectors = serve_bench.all_documents(docs, embeddings)
        serve_bench.build_store(path, model, documents, vectors)
    return path


def in_process(runtime: str, store_path, vectors, queries: list[str], warmup: int) -> dict:
    """Median milliseconds of each part for one query, over ``queries``; ``vectors``: the
    store's, as an array."""
    import torch

    from densefit.models import load_model
    from densefit.retrieval.encode import encode_texts, tokenize_texts
    from densefit.retrieval.index import LocalDocumentStore
    from densefit.retrieval.index.exact import exact_search
    from densefit.retrieval.index.request import SearchRequest
    from densefit.retrieval.runtimes import resolve_runtime
    from densefit.serve.app import PASS_COST_TOKENS, search_queries
    from densefit.serve.batcher import Query

    folder = serve_bench.runtime_model() if runtime != "torch" else serve_bench.MODEL
    model = load_model(folder, max_seq_length=serve_bench.MAX_SEQ_LENGTH)
    runner = resolve_runtime(model, runtime)
    store = LocalDocumentStore(store_path)

    def encode(text, tokens):
        return encode_texts(
            model,
            [text],
            batch_size=1,
            prompt_name="query",
            pass_cost_tokens=PASS_COST_TOKENS,
            runtime=runner,
            tokens=tokens,
        )

    times = {part: [] for part in PARTS}
    for i, text in enumerate(queries):
        clock = {}
        start = time.perf_counter()
        tokens = tokenize_texts(model, [text], prompt_name="query")
        clock["tokenize"] = time.perf_counter() - start
        features = {k: torch.tensor([v]) for k, v in tokens[0].features.items()}
        start = time.perf_counter()
        with torch.inference_mode():
            runner.embed(model, features)
        clock["forward"] = time.perf_counter() - start
        start = time.perf_counter()
        vector = encode(text, tokens)
        clock["encode"] = time.perf_counter() - start
        start = time.perf_counter()
        exact_search(vectors, vector, 10)
        clock["vectors"] = time.perf_counter() - start
        start = time.perf_counter()
        store.search(vector, top_k=10)
        clock["store"] = time.perf_counter() - start
        query = Query(text, SearchRequest(top_k=10), tokens=tokens[0])
        start = time.perf_counter()
        search_queries(store, model, [query], runtime=runtime)
        clock["worker"] = time.perf_counter() - start
        if i >= warmup:
            for part, seconds in clock.items():
                times[part].append(seconds * 1000)
    store.close()
    return {part: float(np.median(values)) for part, values in times.items()}


async def _over_http(url: str, queries: list[str], warmup: int) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def server_seconds() -> tuple[float, float] | None:
            """The densefit server's (sum, count) of its /search request durations."""
            response = await client.get("/metrics")
            if response.status_code != 200:
                return None
            pattern = r'densefit_request_seconds_(sum|count)\{route="/search"[^}]*\} (\S+)'
            found = dict(re.findall(pattern, response.text))
            return (float(found.get("sum", 0)), float(found.get("count", 0)))

        out = {}
        for label, call in (
            ("health", lambda q: client.get("/health")),
            ("search", lambda q: client.post("/search", json={"query": q, "k": 10})),
        ):
            latencies = []
            for i, q in enumerate(queries):
                if i == warmup:
                    before = await server_seconds()
                start = time.perf_counter()
                response = await call(q)
                if response.status_code != 200:
                    raise RuntimeError(f"{url}: {label} answered {response.status_code}")
                if i >= warmup:
                    latencies.append((time.perf_counter() - start) * 1000)
            out[f"{label}_p50_ms"] = float(np.median(latencies))
        after = await server_seconds()
    if before is not None and after is not None and after[1] > before[1]:
        out["server_search_mean_ms"] = (after[0] - before[0]) / (after[1] - before[1]) * 1000
        out["client_search_mean_ms"] = float(np.mean(latencies))
    return out


def over_http(system: str, store_path, queries: list[str], warmup: int, threads: int) -> dict:
    server = serve_bench.Server(system, store_path, threads)
    try:
        return asyncio.run(_over_http(server.url, queries, warmup))
    finally:
        server.stop()


def plot(result: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["in_process"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(rows)
    bottoms = np.zeros(len(names))
    shares = {
        "forward": [rows[n]["forward"] for n in names],
        "encode_texts' own": [rows[n]["encode"] - rows[n]["forward"] for n in names],
        "store search": [rows[n]["store"] for n in names],
        "worker's rest": [rows[n]["worker"] - rows[n]["encode"] - rows[n]["store"] for n in names],
    }
    for label, values in shares.items():
        left.bar(names, values, bottom=bottoms, label=label)
        bottoms += np.asarray(values)
    left.set_ylabel("ms per query (median)")
    left.set_title("One query in one process, by part")
    left.set_ylim(top=1.3 * max(bottoms))
    left.legend(fontsize=8, loc="upper center", ncol=2)
    http = result["http"]
    systems = list(http)
    x = np.arange(len(systems))
    right.bar(x - 0.2, [http[s]["search_p50_ms"] for s in systems], 0.4, label="client p50")
    server = [http[s].get("server_search_mean_ms", 0) for s in systems]
    right.bar(x + 0.2, server, 0.4, label="server's own time (mean)")
    right.set_xticks(x, systems, rotation=15, fontsize=8)
    right.set_ylabel("ms per search")
    right.set_title("POST /search, one client")
    right.set_ylim(top=1.3 * max(h["search_p50_ms"] for h in http.values()))
    right.legend(fontsize=8, loc="upper center", ncol=2)
    fig.suptitle(f"{result['machine']['cpu']}, {result['threads']} thread(s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "query_parts.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtimes", default="torch,onnx,openvino,openvino-int8")
    parser.add_argument(
        "--systems", default="densefit:onnx,densefit:openvino,densefit:openvino-int8,handwritten"
    )
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    model, docs, queries, embeddings = serve_bench.prepare(serve_bench.DATASETS, serve_bench.CACHE)
    runtimes = [r for r in args.runtimes.split(",") if r]
    serve_bench.prepare_runtimes([r for r in runtimes if r != "torch"])
    store_path = parts_store(model, docs, embeddings)
    vectors = serve_bench.all_documents(docs, embeddings)[1]
    texts = serve_bench.query_list(queries, args.queries + args.warmup, seed=1)
    result = {
        "command": command_line(__file__, sys.argv[1:]),
        "environment": environment(),
        "machine": serve_bench.machine(threads),
        "threads": threads,
        "queries": args.queries,
        "load_before": loadavg(),
        "in_process": {},
        "http": {},
    }
    for runtime in runtimes:
        result["in_process"][runtime] = in_process(runtime, store_path, vectors, texts, args.warmup)
        print(
            runtime, json.dumps({k: round(v, 3) for k, v in result["in_process"][runtime].items()})
        )
    for system in [s for s in args.systems.split(",") if s]:
        result["http"][system] = over_http(system, store_path, texts, args.warmup, threads)
        print(system, json.dumps({k: round(v, 3) for k, v in result["http"][system].items()}))
    result["load_after"] = loadavg()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "query_parts.json").write_text(json.dumps(result, indent=2) + "\n")
    with open(RESULTS / "query_parts.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["where", "name", "measure", "ms"])
        for runtime, parts in result["in_process"].items():
            writer.writerows(
                ["in_process", runtime, part, f"{ms:.3f}"] for part, ms in parts.items()
            )
        for system, measures in result["http"].items():
            writer.writerows(["http", system, m, f"{ms:.3f}"] for m, ms in measures.items())
    plot(result)


if __name__ == "__main__":
    main()
