"""Reproduce the published MTEB retrieval numbers of all-MiniLM-L6-v2 with densefit's pipeline.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/reproduce_mteb.py        # ~15 min, 1 thread
    python bench/reproduce_mteb.py --datasets scifact                        # one dataset

Each dataset goes through exactly what ``densefit eval --dataset DIR --split test --model
all-MiniLM-L6-v2`` runs: read the BEIR folder, index the corpus into a (temporary) store with
length-sorted batches, exact search for the top 100 of every test query, pytrec_eval metrics.

References (MTEB 0.0.2 results of sentence-transformers/all-MiniLM-L6-v2, quoted in
/work/shared/datasets/*/README.md) and the tolerances of the issue:

    SciFact  test  nDCG@10 0.64508 +- 0.003, Recall@100 0.925 +- 0.005
    NFCorpus test  nDCG@10 0.31594 +- 0.003   (Recall@100 0.31151 reported, not a target)

Writes bench/results/reproduce_mteb.json and .md; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from _runner import DATASETS, RESULTS, ROOT, command_line, environment

sys.path.insert(0, str(ROOT))

# dataset -> {metric: (published, tolerance or None when only reported)}
REFERENCES = {
    "scifact": {"ndcg@10": (0.64508, 0.003), "recall@100": (0.925, 0.005)},
    "nfcorpus": {"ndcg@10": (0.31594, 0.003), "recall@100": (0.31151, None)},
}
SOURCE = "embeddings-benchmark/mtebpaper results/all-MiniLM-L6-v2/{name}.json (MTEB 0.0.2)"
NAMES = {"scifact": "SciFact", "nfcorpus": "NFCorpus"}


def find_datasets(given: str | None) -> Path:
    candidates = [Path(given)] if given else [DATASETS, ROOT / "shared" / "datasets"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    sys.exit(f"no datasets folder among {[str(c) for c in candidates]}: pass --datasets-dir")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--datasets", default="scifact,nfcorpus")
    parser.add_argument("--datasets-dir", default=None)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS / "reproduce_mteb"))
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the .md from the .json, no run"
    )
    args = parser.parse_args()
    if args.report_only:
        out = Path(args.out)
        out.with_suffix(".md").write_text(
            markdown(json.loads(out.with_suffix(".json").read_text()))
        )
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from densefit.evaluate import evaluate
    from densefit.models import load_model

    root = find_datasets(args.datasets_dir)
    model = load_model(args.model)
    rows, all_ok = [], True
    for dataset in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        print(f"== {dataset}: indexing and evaluating with {args.model}", flush=True)
        started = time.perf_counter()
        result = evaluate(
            model, root / dataset, split="test", batch_size=args.batch_size, show_progress=True
        )
        seconds = time.perf_counter() - started
        checks = []
        for metric, (published, tolerance) in REFERENCES.get(dataset, {}).items():
            ours = result.metrics[metric]
            ok = None if tolerance is None else abs(ours - published) <= tolerance
            all_ok &= ok is not False
            checks.append(
                {
                    "metric": metric,
                    "densefit": round(ours, 5),
                    "published": published,
                    "tolerance": tolerance,
                    "difference": round(ours - published, 5),
                    "pass": ok,
                }
            )
        index = result.info["index"]
        rows.append(
            {
                "dataset": dataset,
                "split": "test",
                "queries": result.n_queries,
                "documents": index["added"] + index["unchanged"],
                "metrics": {k: round(v, 5) for k, v in result.metrics.items()},
                "checks": checks,
                "reference": SOURCE.format(name=NAMES.get(dataset, dataset)),
                "encode_docs_per_second": round(index["docs_per_second"], 2),
                "index_seconds": round(index["seconds"], 1),
                "search_seconds": result.info["search_seconds"],
                "total_seconds": round(seconds, 1),
            }
        )
        for check in checks:
            verdict = {True: "PASS", False: "FAIL", None: "reported"}[check["pass"]]
            print(
                f"   {check['metric']}: {check['densefit']:.5f} vs {check['published']} -> {verdict}",
                flush=True,
            )
    payload = {
        "model": args.model,
        "command": command_line("reproduce_mteb.py", sys.argv[1:]),
        "pipeline": "densefit.evaluate.evaluate: BEIR reader -> temporary LocalDocumentStore "
        "(exact backend, float32, cosine) -> top-100 search -> pytrec_eval",
        "environment": environment(),
        "results": rows,
        "all_targets_met": all_ok,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(payload))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0 if all_ok else 1


def markdown(payload: dict) -> str:
    env = payload["environment"]
    lines = [
        f"# Reproducing MTEB: {payload['model']} with densefit",
        "",
        f"`{payload['command']}` — {payload['pipeline']}.",
        "",
        "| dataset | metric | densefit | published | tolerance | result |",
        "|---|---|---|---|---|---|",
    ]
    for row in payload["results"]:
        for c in row["checks"]:
            tol = f"± {c['tolerance']}" if c["tolerance"] is not None else "—"
            verdict = {True: "pass", False: "**FAIL**", None: "reported"}[c["pass"]]
            lines.append(
                f"| {row['dataset']} ({row['queries']} queries) | {c['metric']} | {c['densefit']:.5f} "
                f"| {c['published']} | {tol} | {verdict} |"
            )
    lines += [
        "",
        "All metrics (test split):",
        "",
        "| dataset | " + " | ".join(payload["results"][0]["metrics"]) + " |",
    ]
    lines.append("|---|" + "---|" * len(payload["results"][0]["metrics"]))
    for row in payload["results"]:
        lines.append(
            f"| {row['dataset']} | "
            + " | ".join(f"{v:.5f}" for v in row["metrics"].values())
            + " |"
        )
    lines += [
        "",
        "| dataset | documents | encode docs/s | index s | search s |",
        "|---|---|---|---|---|",
    ]
    for row in payload["results"]:
        lines.append(
            f"| {row['dataset']} | {row['documents']} | {row['encode_docs_per_second']} | "
            f"{row['index_seconds']} | {row['search_seconds']} |"
        )
    lines += [
        "",
        f"References: {', '.join(sorted({r['reference'] for r in payload['results']}))}.",
        f"Environment: torch {env['torch']}, sentence-transformers {env['sentence_transformers']}, "
        f"transformers {env['transformers']}, {env['torch_threads']} torch thread(s) "
        f"(OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, MKL_NUM_THREADS={env['MKL_NUM_THREADS']}), "
        f"{env['cpu_count']} CPUs, git {env['git_commit']}. Timings were taken on a shared machine.",
        "",
        "Note: NFCorpus holds 40 documents whose text repeats another document's. densefit gives",
        "identical texts one shared vector (encoded once), so their scores tie exactly and",
        "trec_eval orders them by id, as when BEIR/MTEB encoded the corpus in one call. Encoding",
        "each copy separately (in batches of other widths) moves their scores by ~1e-7 and",
        "nDCG@10 to 0.31636 (rounding the scores to 6 decimals gives 0.31594 back).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
