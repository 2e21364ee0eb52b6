"""Encoding throughput and exact-search speed, each against its peer in the same run.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/encode_search.py    # ~15 min on 1 core
    python bench/encode_search.py --docs 0 --rounds 4                    # the whole corpus

1. Encoding: documents/s of ``densefit.retrieval.encode.encode_texts`` vs
   ``SentenceTransformer.encode`` on a seeded sample of SciFact's corpus (title + text) with
   all-MiniLM-L6-v2, same batch size. The sample is split into rounds; in each round both
   encode the same documents (one call each), alternating which goes first, so drift in
   machine load hits both alike. Wall and CPU (process) time are both recorded: on a shared
   machine CPU time is the steadier of the two. Also recorded: the tokens each pushes through
   the model (densefit batches by token count, sentence-transformers by character count),
   and the largest difference between the two outputs (they must agree).
2. Search: exact top-10 inner-product search over 100k and 1M random unit 384-d vectors:
   densefit's exact backend (auto: FAISS's kernel for small query batches when faiss is
   installed, torch matmul otherwise), the pure-torch path, float16 vectors, and
   ``faiss.IndexFlatIP``. Latency: one query at a time (median and p90 of --latency-queries).
   Throughput: --batch-queries queries in one call, best of --batch-repeats, queries/s.
   Methods are interleaved (query by query, call by call) so load drift hits all alike.
   At 100k also the full store search (``LocalDocumentStore.search``, SQLite included).

Threads: torch and FAISS both use the same thread count (``--threads``, default
OMP_NUM_THREADS or 1); it is recorded in the results. Writes bench/results/encode_search.csv,
.json and .png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

import _runner
from _runner import DATASETS, RESULTS, ROOT, command_line

sys.path.insert(0, str(ROOT))


def find_scifact(given: str | None) -> Path:
    candidates = (
        [Path(given)]
        if given
        else [
            DATASETS / "scifact",
            ROOT / "examples" / "scifact",
        ]
    )
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    sys.exit(f"no SciFact folder among {[str(c) for c in candidates]}: pass --scifact")


# -- 1. encoding ---------------------------------------------------------------------------


def bench_encode(args) -> list[dict]:
    import numpy as np

    from densefit.data.corpus import read_corpus
    from densefit.models import load_model
    from densefit.retrieval.encode import encode_texts

    docs, _ = read_corpus(find_scifact(args.scifact))
    texts = [d.text for d in docs]
    if args.docs:
        rng = np.random.default_rng(0)
        texts = [texts[i] for i in sorted(rng.choice(len(texts), size=args.docs, replace=False))]
    model = load_model(args.model)
    rounds = max(1, args.rounds)
    slices = [texts[i::rounds] for i in range(rounds)]
    encoders = {
        "densefit encode_texts": lambda t: encode_texts(model, t, batch_size=args.batch_size),
        "SentenceTransformer.encode": lambda t: model.encode(
            t, batch_size=args.batch_size, convert_to_numpy=True, show_progress_bar=False
        ),
    }
    for encode in encoders.values():  # warm-up: first calls initialise the BLAS kernels
        encode(texts[:16])
    seconds = dict.fromkeys(encoders, 0.0)
    cpu_seconds = dict.fromkeys(encoders, 0.0)
    outputs: dict[str, list] = {name: [] for name in encoders}
    for r, part in enumerate(slices):
        order = list(encoders) if r % 2 == 0 else list(reversed(encoders))
        for name in order:
            started, cpu_started = time.perf_counter(), time.process_time()
            outputs[name].append(encoders[name](part))
            seconds[name] += time.perf_counter() - started
            cpu_seconds[name] += time.process_time() - cpu_started
        print(
            f"  round {r + 1}/{rounds} ({len(part)} docs): "
            + ", ".join(f"{n} {seconds[n]:.1f}s wall {cpu_seconds[n]:.1f}s cpu" for n in encoders),
            flush=True,
        )
    a, b = (np.concatenate(outputs[n]) for n in encoders)
    padded = padded_tokens(model, slices, args.batch_size)
    rows = []
    for name, key in zip(encoders, ("densefit", "st"), strict=True):
        rows.append(
            {
                "section": "encode",
                "method": name,
                "documents": len(texts),
                "rounds": rounds,
                "batch_size": args.batch_size,
                "seconds": round(seconds[name], 2),
                "cpu_seconds": round(cpu_seconds[name], 2),
                "docs_per_second": round(len(texts) / seconds[name], 2),
                "padded_tokens": padded[key],
                "real_tokens": padded["real"],
            }
        )
    rows[0]["speedup_vs_peer"] = round(rows[1]["seconds"] / rows[0]["seconds"], 3)
    rows[0]["cpu_speedup_vs_peer"] = round(rows[1]["cpu_seconds"] / rows[0]["cpu_seconds"], 3)
    rows[0]["max_abs_diff_vs_peer"] = float(np.abs(a - b).max())
    return rows


def padded_tokens(model, slices, batch_size) -> dict:
    """Tokens each encoder feeds the model: densefit sorts by tokens, ST by characters."""
    import numpy as np

    out = {"densefit": 0, "st": 0, "real": 0}
    for part in slices:
        ids = model.tokenizer(part, truncation=True)["input_ids"]
        lengths = np.array([len(x) for x in ids])
        out["real"] += int(lengths.sum())
        by_chars = np.argsort([-len(t) for t in part], kind="stable")
        by_tokens = np.argsort(-lengths, kind="stable")
        for name, order in (("st", by_chars), ("densefit", by_tokens)):
            for start in range(0, len(order), batch_size):
                batch = lengths[order[start : start + batch_size]]
                out[name] += int(batch.max() * len(batch))
    return out


# -- 2. search -----------------------------------------------------------------------------


def unit_vectors(rng, n, dim):
    import numpy as np

    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 1 << 17):
        block = rng.standard_normal((min(1 << 17, n - start), dim), dtype=np.float32)
        out[start : start + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def bench_search(args) -> list[dict]:
    import numpy as np

    try:
        import faiss
    except ImportError:
        faiss = None
        print(
            "  faiss is not installed: the FAISS rows are skipped (pip install 'densefit[index]')"
        )
    rng = np.random.default_rng(0)
    rows = []
    for n in [int(x) for x in args.rows.split(",")]:
        print(f"  {n:,} x {args.dim} vectors", flush=True)
        rows += bench_search_size(args, rng, n, faiss)
    for n in {r["rows"] for r in rows}:
        peer = next(
            (r for r in rows if r["rows"] == n and r["method"] == "faiss IndexFlatIP"), None
        )
        if peer is None:
            continue
        for r in rows:
            if r["rows"] == n and r is not peer:
                r["latency_vs_faiss"] = round(r["latency_ms_median"] / peer["latency_ms_median"], 3)
                r["throughput_vs_faiss"] = round(r["throughput_qps"] / peer["throughput_qps"], 3)
    return rows


def bench_search_size(args, rng, n: int, faiss) -> list[dict]:
    """Every method on one set of ``n`` vectors; latencies interleaved query by query."""
    import numpy as np

    from densefit.retrieval.index.exact import exact_search

    k, dim = 10, args.dim
    vectors = unit_vectors(rng, n, dim)
    queries = unit_vectors(rng, max(args.latency_queries, args.batch_queries), dim)
    lat_q, batch_q = queries[: args.latency_queries], queries[: args.batch_queries]
    methods = {
        "densefit exact": lambda q: exact_search(vectors, q, k),
        "densefit exact (torch only)": lambda q: exact_search(vectors, q, k, use_faiss=False),
    }
    if n <= args.float16_max_rows:
        half = vectors.astype(np.float16)
        methods["densefit exact float16"] = lambda q: exact_search(half, q, k)
    if faiss is not None:
        flat = faiss.IndexFlatIP(dim)
        flat.add(vectors)
        methods["faiss IndexFlatIP"] = lambda q: flat.search(q, k)
    store = build_store(vectors) if n <= args.store_max_rows else None
    if store is not None:
        methods["densefit LocalDocumentStore.search"] = lambda q: store.search(q, top_k=k)
    for search in methods.values():
        search(lat_q[:2])  # warm-up
    latencies = {name: [] for name in methods}
    for i, query in enumerate(lat_q):  # round robin: load drift hits every method alike
        names = list(methods) if i % 2 == 0 else list(reversed(methods))
        for name in names:
            started = time.perf_counter()
            methods[name](query[None, :])
            latencies[name].append((time.perf_counter() - started) * 1000)
    best_batch = {name: float("inf") for name in methods}
    for repeat in range(args.batch_repeats):  # best of N, alternating order
        names = list(methods) if repeat % 2 == 0 else list(reversed(methods))
        for name in names:
            started = time.perf_counter()
            methods[name](batch_q)
            best_batch[name] = min(best_batch[name], time.perf_counter() - started)
    reference = exact_search(vectors, batch_q[:20], k, use_faiss=False)[1]
    rows = []
    for name, search in methods.items():
        times = sorted(latencies[name])
        same = None
        if "float16" not in name and "Store" not in name:
            same = bool(np.array_equal(search(batch_q[:20])[1], reference))
        row = {
            "section": "search",
            "method": name,
            "rows": n,
            "dim": dim,
            "k": k,
            "latency_ms_median": round(statistics.median(times), 2),
            "latency_ms_p90": round(times[int(0.9 * (len(times) - 1))], 2),
            "batch_queries": len(batch_q),
            "throughput_qps": round(len(batch_q) / best_batch[name], 1),
            "same_results_as_exact": same,
        }
        rows.append(row)
        print(
            f"    {name}: {row['latency_ms_median']:.1f} ms/query, "
            f"{row['throughput_qps']:.0f} queries/s (batch {len(batch_q)})",
            flush=True,
        )
    if store is not None:
        store.close()
    return rows


def build_store(vectors):
    """A temporary store holding ``vectors`` under fake documents (no model needed)."""
    import numpy as np

    from densefit.data.types import Document
    from densefit.retrieval.index.store import LocalDocumentStore

    store = LocalDocumentStore.create(
        None,
        model_name="random",
        dim=vectors.shape[1],
        fingerprint=np.zeros((1, vectors.shape[1]), dtype=np.float32),
    )
    for start in range(0, len(vectors), 50_000):
        part = vectors[start : start + 50_000]
        docs = [Document(f"doc-{start + i}", f"document {start + i}") for i in range(len(part))]
        store.write(docs, part)
    return store


# -- output --------------------------------------------------------------------------------


def environment(threads: int) -> dict:
    """:func:`_runner.environment` under this file's names, with faiss and the load."""
    try:
        import faiss

        faiss_version = faiss.__version__
    except ImportError:
        faiss_version = None
    env = _runner.environment()
    return {
        "threads": threads,
        **{k: env[k] for k in ("torch_threads", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "cpu_count": env["cpu_count"],
        "cpu": _runner.processor(),
        "platform": env["platform"],
        "torch": env["torch"],
        "sentence_transformers": env["sentence_transformers"],
        "faiss": faiss_version,
        "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    encode = [r for r in rows if r["section"] == "encode"]
    if encode:
        table = Table(
            title=f"Encoding SciFact documents (all-MiniLM-L6-v2, batch {encode[0]['batch_size']})"
        )
        columns = ["method", "docs", "wall s", "docs/s", "vs peer", "cpu s", "cpu vs peer"]
        for column in columns + ["padded tokens"]:
            table.add_column(column, justify="left" if column == "method" else "right")
        for r in encode:
            table.add_row(
                r["method"],
                str(r["documents"]),
                f"{r['seconds']:.1f}",
                f"{r['docs_per_second']:.2f}",
                f"{r.get('speedup_vs_peer', 1.0):.3f}x",
                f"{r['cpu_seconds']:.1f}",
                f"{r.get('cpu_speedup_vs_peer', 1.0):.3f}x",
                f"{r['padded_tokens']:,}",
            )
        console.print(table)
    search = [r for r in rows if r["section"] == "search"]
    if search:
        table = Table(title="Exact top-10 search, random unit 384-d vectors")
        columns = ["rows", "method", "ms/query p50", "p90", "queries/s", "latency vs FAISS"]
        for column in columns + ["qps vs FAISS"]:
            table.add_column(column, justify="left" if column == "method" else "right")
        for r in search:
            table.add_row(
                f"{r['rows']:,}",
                r["method"],
                f"{r['latency_ms_median']:.2f}",
                f"{r['latency_ms_p90']:.2f}",
                f"{r['throughput_qps']:.0f}",
                _x(r.get("latency_vs_faiss")),
                _x(r.get("throughput_vs_faiss")),
            )
        console.print(table)


def _x(value) -> str:
    return "" if value is None else f"{value:.2f}x"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    encode = [r for r in rows if r["section"] == "encode"]
    search = [r for r in rows if r["section"] == "search"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    if encode:
        axes[0].bar(
            [r["method"].split()[0] for r in encode],
            [r["docs_per_second"] for r in encode],
            color=["tab:blue", "tab:gray"],
        )
        axes[0].set_ylabel("documents / s")
        axes[0].set_title(f"Encoding SciFact ({encode[0]['documents']} docs)")
    sizes = sorted({r["rows"] for r in search})
    methods = list(dict.fromkeys(r["method"] for r in search))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        for ax, key in ((axes[1], "latency_ms_median"), (axes[2], "throughput_qps")):
            xs, ys = [], []
            for j, n in enumerate(sizes):
                row = next((r for r in search if r["rows"] == n and r["method"] == method), None)
                if row:
                    xs.append(j + i * width)
                    ys.append(row[key])
            ax.bar(xs, ys, width=width, label=method)
    for ax, title, label in (
        (axes[1], "Latency, one query (lower is better)", "ms / query"),
        (axes[2], "Throughput, batched queries (higher is better)", "queries / s"),
    ):
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(sizes))], [f"{n:,} rows" for n in sizes]
        )
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_ylabel(label)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--section", choices=["encode", "search", "all"], default="all")
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--scifact", default=None, help="SciFact BEIR folder")
    parser.add_argument(
        "--docs", type=int, default=1024, help="documents sampled (0: the whole corpus)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="the encode sample in N parts")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rows", default="100000,1000000")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--latency-queries", type=int, default=30)
    parser.add_argument("--batch-queries", type=int, default=256)
    parser.add_argument("--batch-repeats", type=int, default=2)
    parser.add_argument("--float16-max-rows", type=int, default=1_000_000)
    parser.add_argument("--store-max-rows", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    parser.add_argument("--out", default=str(RESULTS / "encode_search"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    torch.set_num_threads(args.threads)
    try:
        import faiss

        faiss.omp_set_num_threads(args.threads)
    except ImportError:
        pass
    rows = []
    if args.section in ("encode", "all"):
        print("encoding", flush=True)
        rows += bench_encode(args)
    if args.section in ("search", "all"):
        print("search", flush=True)
        rows += bench_search(args)
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command_line("encode_search.py", sys.argv[1:]),
        "environment": environment(args.threads),
        "rows": rows,
    }
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(out.with_suffix(".csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}, .csv and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
