"""Hybrid search: nDCG@10 / Recall@100 of dense, BM25 and hybrid (each fusion) on full test
corpora, with the base model and one fine-tuned here; and (``--latency``) each mode's latency.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 15 python bench/hybrid.py --datasets scifact
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/hybrid.py --latency     # a quiet machine

Quality (the default): for each dataset (SciFact, NFCorpus, manpages; BEIR test split, the
whole corpus) and each model -- the packaged all-MiniLM-L6-v2 as it is, and the same model
fine-tuned inside this run with ``densefit.training.loop.train`` on the dataset's train split
(batch 64, one epoch, 64 tokens, ``--lr auto``, MNRL with in-batch negatives, seed 42;
NFCorpus's 110,575 training pairs are a seeded sample of ``--max-train-pairs``) -- the corpus
is indexed into a densefit store at ``--max-seq-length`` tokens (manpages without its titles,
as bench/batch_size.py reads it) and searched by every mode:
``dense``, ``bm25`` (the store's BM25 index; the same for both models), ``hybrid-rrf``
(reciprocal rank fusion, k=60) and ``hybrid-weighted@A`` (min-max normalised scores, A x dense
+ (1 - A) x BM25) for A in ``--alphas``; each side of a hybrid search ranks 100 documents.
Metrics by pytrec_eval (densefit.evaluate), with a paired randomization test of each mode
against dense. Each (dataset, model) point runs in a fresh process; points already in the
JSONL are kept (rerun to add datasets or models: ``--datasets``, ``--models``). Writes bench/results/hybrid.{jsonl,json,csv,png}.

Latency (``--latency``; measure it on a quiet machine): per mode, one query at
a time (``Retriever.retrieve``: embed + search), p50/p99 over ``--latency-queries`` queries of
each dataset's base store, after warm-up; and the search alone (query embedded beforehand).
Writes bench/results/hybrid_latency.{json,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

from _common import finished, pyplot
from _runner import (
    DATASETS,
    RESULTS,
    ROOT,
    command_line,
    environment,
    loadavg,
    run_child,
    untitled_copy,
)

NAMES = {"scifact": "SciFact", "nfcorpus": "NFCorpus", "manpages": "manpages"}
METRICS = ["ndcg@10", "recall@100"]
MODELS = ("base", "fine-tuned")
CACHE = ROOT / "bench" / ".cache" / "stores"


def modes(alphas: list[float]) -> dict[str, tuple[str, dict | None]]:
    """Mode label -> (search mode, Fusion fields)."""
    out = {"dense": ("dense", None), "bm25": ("bm25", None), "hybrid-rrf": ("hybrid", {})}
    for alpha in alphas:
        out[f"hybrid-weighted@{alpha:g}"] = ("hybrid", {"method": "weighted", "alpha": alpha})
    return out


# ----------------------------------------------------------------------------- one dataset


def folder_of(dataset: str) -> Path:
    """The BEIR folder of ``dataset``; manpages untitled, as bench/batch_size.py reads it."""
    if dataset != "manpages":
        return DATASETS / dataset
    return untitled_copy(DATASETS / dataset, ROOT / "bench" / ".cache" / "manpages-notitle")


def test_split(dataset: str, sample: int):
    """``dataset``'s test split over its whole corpus (``sample``: judged + that many others,
    for smoke runs)."""
    from densefit.data.corpus import load_beir
    from densefit.evaluate import subsample_corpus

    test = load_beir(folder_of(dataset), "test")
    return subsample_corpus(test, sample or None, seed=0)[0]


def base_store(dataset: str, beir, max_seq_length: int, sample: int = 0):
    """The base model and its float32 store of ``dataset``'s corpus (kept in
    bench/.cache/stores and reused: ``index_documents`` skips what is stored)."""
    from densefit.models import load_model
    from densefit.retrieval.index import index_documents, open_store

    model = load_model("all-MiniLM-L6-v2", max_seq_length=max_seq_length)
    suffix = f"-sample{sample}" if sample else ""
    store = open_store(CACHE / f"{dataset}-base-{max_seq_length}{suffix}", model)
    index_documents(store, model, list(beir.corpus.values()))
    return model, store


def evaluate_modes(store, model, beir, alphas, name: str) -> dict:
    """Every mode's metrics and per-query scores on ``store``."""
    from densefit.evaluate import evaluate
    from densefit.retrieval.fusion import Fusion

    out = {}
    for label, (mode, fusion) in modes(alphas).items():
        started = time.perf_counter()
        result = evaluate(
            model,
            store,
            queries=beir.queries,
            qrels=beir.qrels,
            metrics=METRICS,
            mode=mode,
            fusion=None if fusion is None else Fusion(**fusion),
            name=f"{name} {label}",
        )
        out[label] = {
            "metrics": {k: round(v, 5) for k, v in result.metrics.items()},
            "per_query": {q: s["ndcg@10"] for q, s in result.per_query.items()},
            "seconds": round(time.perf_counter() - started, 2),
        }
        print(f"    {name:>5} {label:<22} {result.metrics}", flush=True)
    return out


def fine_tuned(beir_train, spec: dict):
    """MiniLM fine-tuned on the train split: batch 64, one epoch, 64 tokens."""
    import random

    from densefit.config import TrainConfig, auto_learning_rate
    from densefit.models import load_model
    from densefit.training.loop import train

    rows = beir_train.training_pairs()
    total = len(rows)
    if spec["max_train_pairs"] and total > spec["max_train_pairs"]:
        rows = random.Random(42).sample(rows, spec["max_train_pairs"])
    model = load_model("all-MiniLM-L6-v2")
    config = TrainConfig(batch_size=64, epochs=1, max_seq_length=64, seed=42, show_progress=False)
    result = train(model, rows, config)
    model.max_seq_length = spec["max_seq_length"]  # evaluated at the same length as the base
    info = {
        "pairs": len(rows),
        "pairs_in_split": total,
        "steps": result.steps,
        "batch_size": 64,
        "epochs": 1,
        "train_max_seq_length": 64,
        "learning_rate": auto_learning_rate(64),  # --lr auto at batch 64
        "seconds": round(result.seconds, 1),
    }
    return model, info


def point(spec: dict) -> dict:
    """One dataset and one model (base or fine-tuned): index, then every mode (in this child
    process)."""
    import torch

    from densefit.data.corpus import load_beir
    from densefit.retrieval.index import index_documents, open_store

    torch.set_num_threads(spec["threads"])
    test = test_split(spec["dataset"], spec["sample"])
    out = {"documents": len(test.corpus), "queries": len(test.qrels), "train": None}
    started = time.perf_counter()
    if spec["model"] == "base":
        model, store = base_store(spec["dataset"], test, spec["max_seq_length"], spec["sample"])
    else:
        train_split = load_beir(folder_of(spec["dataset"]), "train")
        model, out["train"] = fine_tuned(train_split, spec)
        store = open_store(None, model)
        index_documents(store, model, list(test.corpus.values()))
    out["index_s"] = round(time.perf_counter() - started, 1)
    with store:
        out["modes"] = evaluate_modes(store, model, test, spec["alphas"], spec["model"])
    return out


# ----------------------------------------------------------------------------- latency


def latency(args) -> dict:
    """Per mode and dataset: one query at a time, end to end and search alone (child)."""
    import numpy as np
    import torch

    from densefit.retrieval.encode import encode_texts

    torch.set_num_threads(args.threads)
    out = {}
    for dataset in args.datasets:
        test = test_split(dataset, args.sample)
        model, store = base_store(dataset, test, args.max_seq_length, args.sample)
        queries = list(test.queries.values())[: args.latency_queries]
        embedded = encode_texts(model, queries, prompt_name="query")
        store.update_bm25()  # built before timing: it is kept with the store
        rows = {}
        for label, (mode, _) in modes([0.5]).items():
            if label.startswith("hybrid-weighted"):
                continue
            end_to_end, search_only = [], []
            for i, query in enumerate([*queries[:5], *queries]):  # 5 warm-up queries
                started = time.perf_counter()
                store_search_batch(store, model, [query], mode)
                elapsed = time.perf_counter() - started
                started = time.perf_counter()
                vector = None if mode == "bm25" else embedded[max(i - 5, 0) : max(i - 5, 0) + 1]
                store.search(vector, 10, mode=mode, query_texts=[query])
                alone = time.perf_counter() - started
                if i >= 5:
                    end_to_end.append(elapsed)
                    search_only.append(alone)
            rows[label] = {
                name: {
                    "p50_ms": round(1000 * float(np.percentile(values, 50)), 3),
                    "p99_ms": round(1000 * float(np.percentile(values, 99)), 3),
                }
                for name, values in (("end_to_end", end_to_end), ("search_only", search_only))
            }
            print(f"  {dataset} {label}: {rows[label]}", flush=True)
        out[dataset] = {"documents": len(test.corpus), "queries": len(queries), "modes": rows}
        store.close()
    return out


def store_search_batch(store, model, queries, mode):
    from densefit.retrieval.index.searching import search_batch

    return search_batch(store, model, queries, top_k=10, mode=mode)


# ----------------------------------------------------------------------------- report


def p_value(base: dict, other: dict) -> float:
    from densefit.evaluate import paired_randomization_test

    queries = sorted(base)
    return paired_randomization_test([base[q] for q in queries], [other[q] for q in queries])


def report(records: list[dict], args, out: Path) -> None:
    rows = []
    for record in records:
        dense = record["modes"]["dense"]
        for label, found in record["modes"].items():
            rows.append(
                {
                    "dataset": NAMES[record["dataset"]],
                    "model": record["model"],
                    "mode": label,
                    **found["metrics"],
                    "delta_ndcg@10_vs_dense": round(
                        found["metrics"]["ndcg@10"] - dense["metrics"]["ndcg@10"], 5
                    ),
                    "p_value_vs_dense": round(p_value(dense["per_query"], found["per_query"]), 4),
                    "documents": record["documents"],
                    "queries": record["queries"],
                }
            )
    payload = {
        "command": command_line("hybrid.py", sys.argv[1:]),
        "environment": environment(),
        "settings": {
            "model": "all-MiniLM-L6-v2 (packaged)",
            "fine_tuned": "densefit train on the dataset's train split: batch 64, 1 epoch, "
            "64 tokens, learning rate auto, MNRL in-batch negatives, seed 42",
            "max_seq_length": args.max_seq_length,
            "corpus": "the whole corpus, BEIR test split queries"
            if not args.sample
            else f"judged documents + {args.sample} others (a smoke run)",
            "fusion": "rrf k=60; weighted: min-max normalised per list, alpha x dense + "
            "(1 - alpha) x bm25; each side ranks 100 documents",
            "bm25": "densefit.retrieval.bm25 (bm25s tokens and Lucene BM25, k1 1.5, b 0.75)",
        },
        "points": [
            {**r, "modes": {m: {k: v for k, v in f.items() if k != "per_query"}
                            for m, f in r["modes"].items()}}
            for r in records
        ],
        "table": rows,
    }  # fmt: skip
    (out / "hybrid.json").write_text(json.dumps(payload, indent=2) + "\n")
    with open(out / "hybrid.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out)


def plot(rows: list[dict], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    labels = list(dict.fromkeys(r["mode"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(datasets), figsize=(4.6 * len(datasets), 6.5), squeeze=False)
    for column, dataset in enumerate(datasets):
        for line, metric in enumerate(METRICS):
            ax = axes[line][column]
            for offset, model in enumerate(models):
                values = [
                    next((r[metric] for r in rows if (r["dataset"], r["model"], r["mode"]) ==
                          (dataset, model, label)), 0.0)
                    for label in labels
                ]  # fmt: skip
                ax.bar([i + 0.4 * offset for i in range(len(labels))], values, 0.4, label=model)
            ax.set_xticks([i + 0.2 for i in range(len(labels))], labels, rotation=40, ha="right")
            ax.set_title(f"{dataset}: {metric}")
            low = min(r[metric] for r in rows if r["dataset"] == dataset)
            ax.set_ylim(max(0.0, low - 0.1), None)
    axes[0][0].legend()
    fig.suptitle("Dense vs BM25 vs hybrid, full test corpora (all-MiniLM-L6-v2)")
    fig.tight_layout()
    fig.savefig(out / "hybrid.png", dpi=110)


def plot_latency(result: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    datasets = list(result["datasets"])
    labels = list(next(iter(result["datasets"].values()))["modes"])
    for offset, label in enumerate(labels):
        values = [result["datasets"][d]["modes"][label]["end_to_end"]["p50_ms"] for d in datasets]
        ax.bar([i + 0.25 * offset for i in range(len(datasets))], values, 0.25, label=label)
    ax.set_xticks([i + 0.25 for i in range(len(datasets))], [NAMES[d] for d in datasets])
    ax.set_ylabel("p50 latency, one query (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "hybrid_latency.png", dpi=110)


# ----------------------------------------------------------------------------- driver


def spec_of(dataset: str, model: str, args) -> dict:
    """What a point depends on (its key in the JSONL); threads do not count."""
    return {
        "dataset": dataset,
        "model": model,
        "max_seq_length": args.max_seq_length,
        "max_train_pairs": args.max_train_pairs,
        "alphas": args.alphas,
        "sample": args.sample,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(NAMES), choices=list(NAMES))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument("--max-train-pairs", type=int, default=4096)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)))
    parser.add_argument("--latency", action="store_true", help="measure latency instead")
    parser.add_argument("--latency-queries", type=int, default=200)
    parser.add_argument("--sample", type=int, default=0, help="judged + N others (smoke runs)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go")
    parser.add_argument("--point", help=argparse.SUPPRESS)
    parser.add_argument("--force", action="store_true", help="redo datasets already measured")
    args = parser.parse_args()
    if args.point:
        print("RESULT " + json.dumps(point(json.loads(args.point))), flush=True)
        return 0
    if args.latency:
        started, before = time.perf_counter(), loadavg()
        result = {
            "command": command_line("hybrid.py", sys.argv[1:]),
            "environment": environment(),
            "loadavg_before": before,
            "datasets": latency(args),
            "loadavg_after": loadavg(),
            "wall_s": round(time.perf_counter() - started, 1),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hybrid_latency.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_latency(result, args.out)
        return 0
    jsonl = args.out / "hybrid.jsonl"
    done = {} if args.force else finished(jsonl)
    for dataset, model in [(d, m) for d in args.datasets for m in args.models]:
        spec = spec_of(dataset, model, args)
        key = json.dumps(spec, sort_keys=True)
        if key in done:
            print(f"{dataset} {model}: measured already (--force redoes it)", flush=True)
            continue
        print(
            f"{dataset} {model}: (training,) indexing and searching in a fresh process", flush=True
        )
        child = run_child(
            __file__, "--point", json.dumps({**spec, "threads": args.threads}), threads=args.threads
        )
        record = {**spec, "threads": args.threads, "key": key}
        record["status"] = "ok" if child.ok else "failed"
        record.update(child.result or {"error": (child.stderr or child.stdout)[-3000:]})
        record.update(
            wall_s=child.wall_s,
            loadavg_before=child.loadavg_before,
            loadavg_after=child.loadavg_after,
            finished=child.finished,
        )
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        with jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if not child.ok:
            print(f"  FAILED:\n{record['error']}", flush=True)
            return 1
    # Every dataset measured with these settings (by this run or an earlier one).
    measured = finished(jsonl)
    keys = [json.dumps(spec_of(d, m, args), sort_keys=True) for d in NAMES for m in MODELS]
    records = [measured[k] for k in keys if k in measured]
    report(records, args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
