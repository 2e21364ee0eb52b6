"""Vector kinds: what float16, int8 and binary (with rescoring) cost in ranking on full test
corpora, and what they save in memory, against float32 in the same run.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 15 python bench/vectors.py

Ranking: for each dataset (SciFact, NFCorpus, manpages; BEIR test split over the whole
corpus) the packaged all-MiniLM-L6-v2 embeds the corpus once into a float32 store (shared
with bench/hybrid.py through bench/.cache/stores); its vectors are copied, in commits of
1,024 as ``densefit index`` makes them, into a store of each other kind, which is then
reopened (as a server opens it: int8 calibrates from every stored vector) and searched
(dense mode) for every test query: nDCG@10 and Recall@100 (pytrec_eval), and the overlap
of each query's top 10 with float32's, for int8 at rescore 1, 2, 4 and binary at 1, 2, 4,
10 (candidates per result).

Memory: bytes per vector that each kind keeps in memory to search, and the resident memory
of a search process (a fresh one per kind: it opens the store without a model, searches
100 pre-embedded queries, and reports ``/proc/self/status``: anonymous and file-backed
resident memory after its imports and after the searches) on a synthetic store of
``--rows`` random unit vectors of 384 dimensions, where the vectors dominate the process.

Writes bench/results/vectors.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _common import pyplot
from _runner import RESULTS, command_line, environment, loadavg, run_child, status
from hybrid import NAMES, base_store, test_split

METRICS = ["ndcg@10", "recall@100"]
RESCORES = {"float32": [None], "float16": [None], "int8": [1, 2, 4], "binary": [1, 2, 4, 10]}


# ----------------------------------------------------------------------------- ranking


def copy_into(source, target, chunk: int = 1024) -> None:
    """Every document and vector of ``source`` written to ``target``, ``chunk`` at a time."""
    ids = sorted(source.ids())
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        target.write(source.get(part), source.vectors(part))


def ranking(spec: dict) -> dict:
    """One dataset: every kind and rescore against float32 (in this child process)."""
    import numpy as np
    import torch

    from densefit.evaluate import evaluate_run, retrieve_run
    from densefit.retrieval.index import LocalDocumentStore, open_store

    torch.set_num_threads(spec["threads"])
    test = test_split(spec["dataset"], spec["sample"])
    model, base = base_store(spec["dataset"], test, spec["max_seq_length"], spec["sample"])
    out = {"documents": len(test.corpus), "queries": len(test.qrels), "kinds": []}
    judged = {q: test.queries[q] for q in test.qrels if q in test.queries}
    reference = None
    with base:
        for kind, rescores in RESCORES.items():
            folder = None
            if kind != "float32":
                folder = Path(tempfile.mkdtemp(prefix=f"densefit-{kind}-")) / "store"
                with open_store(folder, model, vectors=kind) as target:
                    copy_into(base, target)
            for rescore in rescores:
                store = base if folder is None else LocalDocumentStore(folder, rescore=rescore)
                started = time.perf_counter()
                run = retrieve_run(store, model, judged, top_k=100)
                seconds = time.perf_counter() - started
                result = evaluate_run(run, test.qrels, METRICS)
                top10 = {q: set(sorted(d, key=d.get, reverse=True)[:10]) for q, d in run.items()}
                if reference is None:
                    reference = top10
                overlap = np.mean(
                    [len(top10[q] & reference[q]) / max(1, len(reference[q])) for q in top10]
                )
                row = {
                    "kind": kind,
                    "rescore": rescore,
                    **{k: round(v, 5) for k, v in result.metrics.items()},
                    "top10_overlap_with_float32": round(float(overlap), 4),
                    "search_s": round(seconds, 2),
                }
                out["kinds"].append(row)
                print(f"  {spec['dataset']} {kind} rescore={rescore}: {row}", flush=True)
                if folder is not None:
                    store.close()
    return out


# ----------------------------------------------------------------------------- memory


def build_synthetic(folder: Path, rows: int, dim: int, kind: str) -> None:
    """A store of ``rows`` random unit vectors (seeded, the same for every kind)."""
    import numpy as np

    from densefit.data.types import Document
    from densefit.retrieval.index import LocalDocumentStore

    store = LocalDocumentStore.create(
        folder,
        model_name="synthetic",
        dim=dim,
        fingerprint=np.zeros((3, dim), dtype=np.float32),
        vectors=kind,
    )
    rng = np.random.default_rng(0)
    with store:
        for start in range(0, rows, 65536):
            n = min(65536, rows - start)
            vectors = rng.standard_normal((n, dim)).astype(np.float32)
            docs = [Document(f"d{i}", f"synthetic document {i}") for i in range(start, start + n)]
            store.write(docs, vectors)


def memory_point(spec: dict) -> dict:
    """Open the synthetic store of one kind, search 100 queries: resident memory (child)."""
    import numpy as np
    import torch

    from densefit.retrieval.index import LocalDocumentStore

    torch.set_num_threads(1)
    queries = np.load(spec["queries"])
    before = status()
    started = time.perf_counter()
    with LocalDocumentStore(spec["folder"]) as store:
        opened = time.perf_counter() - started
        for start in range(0, len(queries), 10):
            store.search(queries[start : start + 10], 10)
        after = status()
        backend = store.backend
        in_memory = getattr(backend, "memory_bytes", None)
        held = (
            in_memory()
            if in_memory
            else store.count() * store.dim * (2 if store.vector_kind == "float16" else 4)
        )
        return {
            "kind": spec["kind"],
            "rows": store.count(),
            "dim": store.dim,
            "bytes_per_vector_in_memory": round(held / store.count(), 2),
            "open_s": round(opened, 2),
            "after_imports_mib": before,
            "after_search_mib": after,
            "store_rss_mib": round(
                (after["RssAnon"] + after["RssFile"]) - (before["RssAnon"] + before["RssFile"]), 1
            ),
            "store_anon_mib": round(after["RssAnon"] - before["RssAnon"], 1),
            "store_file_mib": round(after["RssFile"] - before["RssFile"], 1),
        }


def memory(args) -> list[dict]:
    import numpy as np

    work = Path(tempfile.mkdtemp(prefix="densefit-vectors-mem-"))
    rng = np.random.default_rng(1)
    queries = rng.standard_normal((100, args.dim)).astype(np.float32)
    np.save(work / "queries.npy", queries / np.linalg.norm(queries, axis=1, keepdims=True))
    out = []
    for kind in RESCORES:
        folder = work / kind
        print(f"  memory: building a {args.rows:,}-vector {kind} store", flush=True)
        build_synthetic(folder, args.rows, args.dim, kind)
        spec = {"kind": kind, "folder": str(folder), "queries": str(work / "queries.npy")}
        child = run_child(__file__, "--memory-point", json.dumps(spec), threads=1)
        if not child.ok:
            raise RuntimeError(f"memory point {kind} failed:\n{child.stderr[-3000:]}")
        out.append({**child.result, "loadavg_before": child.loadavg_before})
        print(f"    {child.result}", flush=True)
        import shutil

        shutil.rmtree(folder)
    return out


# ----------------------------------------------------------------------------- report


def plot(payload: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for dataset, record in payload["ranking"].items():
        base = next(r for r in record["kinds"] if r["kind"] == "float32")["ndcg@10"]
        labels = [
            f"{r['kind']}" + (f" x{r['rescore']}" if r["rescore"] else "") for r in record["kinds"]
        ]
        deltas = [r["ndcg@10"] - base for r in record["kinds"]]
        ax.plot(labels, deltas, marker="o", label=NAMES[dataset])
    ax.axhline(-0.002, color="grey", linestyle=":", label="int8 target (-0.002)")
    ax.axhline(-0.01, color="grey", linestyle="--", label="binary target (-0.01)")
    ax.set_ylabel("nDCG@10 minus float32's")
    ax.tick_params(axis="x", rotation=40)
    ax.legend(fontsize=8)
    ax.set_title("Ranking cost (all-MiniLM-L6-v2, full test corpora)")
    ax = axes[1]
    if payload.get("memory"):
        kinds = [m["kind"] for m in payload["memory"]]
        ax.bar(kinds, [m["store_rss_mib"] for m in payload["memory"]])
        rows = payload["memory"][0]["rows"]
        ax.set_ylabel(f"resident MiB for the store ({rows:,} x {payload['memory'][0]['dim']})")
        ax.set_title("Search process memory beyond its imports")
    fig.tight_layout()
    fig.savefig(out / "vectors.png", dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(NAMES), choices=list(NAMES))
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument("--rows", type=int, default=1_000_000, help="synthetic store size")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory part")
    parser.add_argument("--no-ranking", action="store_true", help="skip the ranking part")
    parser.add_argument("--sample", type=int, default=0, help="judged + N others (smoke runs)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--point", help=argparse.SUPPRESS)
    parser.add_argument("--memory-point", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        print("RESULT " + json.dumps(ranking(json.loads(args.point))), flush=True)
        return 0
    if args.memory_point:
        print("RESULT " + json.dumps(memory_point(json.loads(args.memory_point))), flush=True)
        return 0
    started, before = time.perf_counter(), loadavg()
    path = args.out / "vectors.json"
    payload = json.loads(path.read_text()) if path.exists() else {}
    payload.setdefault("ranking", {})
    command = command_line("vectors.py", sys.argv[1:])
    commands = payload.setdefault("commands", {})  # the runs that made each part
    environments = payload.setdefault("environments", {})
    for part, skipped in (("ranking", args.no_ranking), ("memory", args.no_memory)):
        if not skipped:
            commands[part], environments[part] = command, environment()
    if not args.no_ranking:
        for dataset in args.datasets:
            spec = {
                "dataset": dataset,
                "max_seq_length": args.max_seq_length,
                "sample": args.sample,
                "threads": args.threads,
            }
            print(f"{dataset}: ranking by vector kind in a fresh process", flush=True)
            child = run_child(__file__, "--point", json.dumps(spec), threads=args.threads)
            if not child.ok:
                print(child.stderr[-3000:])
                return 1
            payload["ranking"][dataset] = {
                **spec,
                **child.result,
                "wall_s": child.wall_s,
                "loadavg_before": child.loadavg_before,
            }
    if not args.no_memory:
        payload["memory"] = memory(args)
        payload["memory_settings"] = {
            "rows": args.rows,
            "dim": args.dim,
            "vectors": "random unit vectors (seeded); 100 random unit queries, top 10",
            "rss": "/proc/self/status of a fresh search process: after its imports, and after "
            "opening the store and searching; store_* is the difference",
        }
    payload["settings"] = {
        "model": "all-MiniLM-L6-v2 (packaged)",
        "corpus": "the whole corpus, BEIR test split queries"
        if not args.sample
        else f"judged documents + {args.sample} others (a smoke run)",
        "copies": "the float32 store's vectors written to each kind in commits of 1,024, "
        "then the store reopened",
        "rescore": "candidates per result read back as float32 and ranked exactly",
    }
    runs = payload.setdefault("runs", [])
    runs.append(
        {"command": command, "loadavg": [before, loadavg()],
         "wall_s": round(time.perf_counter() - started, 1)}
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    with open(args.out / "vectors.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["dataset", "kind", "rescore", *METRICS, "delta_ndcg@10", "top10_overlap"])
        for dataset, record in payload["ranking"].items():
            base = next(r for r in record["kinds"] if r["kind"] == "float32")["ndcg@10"]
            for r in record["kinds"]:
                writer.writerow(
                    [NAMES[dataset], r["kind"], r["rescore"] or "", r["ndcg@10"], r["recall@100"],
                     round(r["ndcg@10"] - base, 5), r["top10_overlap_with_float32"]]
                )  # fmt: skip
    plot(payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
