"""Do Matryoshka embeddings survive truncation? SciFact nDCG@10 at 384, 256, 128 and 64 dims.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nohup python bench/matryoshka.py --points matryoshka &
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nohup python bench/matryoshka.py --points plain,base &
    python bench/matryoshka.py --report-only   # rebuild json/csv/png from matryoshka.jsonl
    ... the same two with --eval-docs 0 --out matryoshka_full   # the whole test corpus

Fine-tunes all-MiniLM-L6-v2 twice on SciFact's train qrels (919 pairs, one epoch) with the
same seed, batch, steps and learning rate: once with plain MNRL and once with Matryoshka MNRL
(``matryoshka_dims=[384, 256, 128, 64]``, weights 1), then evaluates each (and the untouched
base model) on the SciFact test split (300 queries) at every size with
:func:`densefit.evaluate.evaluate` with ``dims``: the corpus is embedded once, and each smaller size
cuts every vector to its first coordinates and re-normalises it (what ``densefit index
--dim`` stores).

Defaults sized for a shared, loaded 2-core CPU: 64 tokens for training and evaluation, and
the test corpus cut to its judged documents plus a seeded sample of ``--eval-docs`` others
(as ``densefit run``'s evaluation subsample does); ``--eval-docs 0`` keeps all 5,183. The
three models see the same documents, so they compare with each other; the absolute numbers
are higher than over the whole corpus.

Each model runs in its own fresh process (``--point``) and appends one line to
results/matryoshka.jsonl; a rerun skips finished points. The command, torch threads and the
machine's load are recorded beside the numbers: timings were taken on a shared 2-core
machine (other jobs running), so only the metrics compare across runs.

Writes bench/results/matryoshka.{jsonl,json,csv,png} (judged + 1,000 documents) and
matryoshka_full.* (the whole corpus, ``--eval-docs 0 --out matryoshka_full``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import sys
import time
from pathlib import Path

import _runner
from _common import fine_tune, judged_plus_others, load_point, pyplot
from _runner import DATASETS, RESULTS, ROOT

JSONL = RESULTS / "matryoshka.jsonl"  # --out NAME: RESULTS / NAME.jsonl (and .json, .csv, .png)
DIMS = (384, 256, 128, 64)
POINTS = ("base", "plain", "matryoshka")
OUT = "matryoshka"


def find_scifact() -> Path:
    """The SciFact BEIR folder: the shared copy, else the bundled example."""
    for folder in (DATASETS / "scifact", ROOT / "examples" / "scifact"):
        if folder.is_dir():
            return folder
    raise FileNotFoundError(f"no SciFact folder: expected {DATASETS / 'scifact'}")


def run_point(spec: dict) -> dict:
    """Train (unless the base) and evaluate at every size; runs in a child process."""
    from densefit.data.corpus import load_beir
    from densefit.evaluate import evaluate
    from densefit.training.loop import peak_rss_bytes

    model, out = load_point(spec)
    beir = load_beir(spec["data"], "train")
    if spec["point"] != "base":
        rows = beir.training_pairs()
        nested = spec["point"] == "matryoshka"
        dims = list(spec["dims"]) if nested else None
        result, _ = fine_tune(model, rows, spec, matryoshka_dims=dims)
        out["train"] = {
            "rows": len(rows),
            "steps": result.steps,
            "seconds": round(result.seconds, 1),
            "final_loss": round(result.final_loss, 4),
            "loss_block_size": result.plan.get("loss_block_size")
            if isinstance(result.plan, dict)
            else None,
        }
    started = time.perf_counter()
    test = subsample(load_beir(spec["data"], "test", corpus=beir.corpus), spec)
    results = evaluate(model, test, dims=spec["dims"], split="test", batch_size=64)
    out["eval_s"] = round(time.perf_counter() - started, 1)
    out["eval_corpus_docs"] = len(test.corpus)  # judged + eval_docs others (or all of them)
    out["eval_queries"] = results[0].n_queries
    out["metrics"] = {
        str(r.info["dim"]): {k: round(v, 5) for k, v in r.metrics.items()} for r in results
    }
    out["peak_rss_mb"] = round(peak_rss_bytes() / 2**20, 1)
    return out


def subsample(test, spec: dict):
    """The test split with its corpus cut to the judged documents plus ``eval_docs`` others
    (seeded); ``eval_docs`` 0: the whole corpus."""
    return judged_plus_others(test, spec["eval_docs"], spec["seed"])


def run_child(spec: dict) -> dict:
    """One point in a fresh interpreter (its own memory, its own thread setting)."""
    omp = os.environ.get("OMP_NUM_THREADS", "1")
    threads = {"OMP_NUM_THREADS": omp, "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", omp)}
    child = _runner.run_child(__file__, "--point", json.dumps(spec), env=threads)
    record = {**spec, "status": "ok" if child.ok else "failed"}
    if child.result is not None:
        record.update(child.result)
    else:
        record["stderr_tail"] = child.stderr[-2000:]
    record.update(
        wall_s=child.wall_s,
        loadavg_before=child.loadavg_before,
        loadavg_after=child.loadavg_after,
        omp_num_threads=omp,
        finished=child.finished,
    )
    return record


def read_jsonl() -> list[dict]:
    if not JSONL.is_file():
        return []
    return [json.loads(line) for line in JSONL.read_text().splitlines() if line.strip()]


def with_corpus_size(record: dict) -> dict:
    """The record with ``eval_docs`` the others asked for and ``eval_corpus_docs`` the
    documents searched. Records without ``eval_corpus_docs`` hold the corpus size in
    ``eval_docs``; the number asked for is then read back from their command."""
    if "eval_corpus_docs" in record or "eval_docs" not in record:
        return record
    words = shlex.split(record.get("command", ""))
    asked = 1000  # the default of --eval-docs
    for i, word in enumerate(words):
        if word == "--eval-docs" and i + 1 < len(words):
            asked = int(words[i + 1])
        elif word.startswith("--eval-docs="):
            asked = int(word.partition("=")[2])
    return {**record, "eval_docs": asked, "eval_corpus_docs": record["eval_docs"]}


def corpus_label(spec: dict) -> str:
    """What the test corpus was: judged + N others (M documents), or the whole corpus."""
    spec = with_corpus_size(spec)
    others, total = spec.get("eval_docs"), spec.get("eval_corpus_docs")
    if others:
        return f"{total:,} docs (judged + {others:,} others)" if total else f"judged + {others:,}"
    return f"the whole corpus ({total:,} docs)" if total else "the whole corpus"


def report(command: str) -> None:
    """matryoshka.json (everything), .csv (one row per model and size), .png (the curves)."""
    records = [with_corpus_size(r) for r in read_jsonl() if r.get("status") == "ok"]
    latest = {r["point"]: r for r in records}
    rows = []
    for point in POINTS:
        r = latest.get(point)
        if r is None:
            continue
        for dim in r["dims"]:
            m = r["metrics"][str(dim)]
            rows.append({"model": point, "dim": dim, "ndcg@10": m["ndcg@10"],
                         "recall@100": m["recall@100"]})  # fmt: skip
    made_by = [latest[p]["command"] for p in POINTS if p in latest]
    summary = {
        "commands": sorted(set(made_by)),  # the runs that made the points (each has its own)
        "report_command": command,
        "note": (
            "Timings were measured on a shared 2-core machine (other jobs running, see "
            "loadavg_*); the metrics do not depend on it."
        ),
        "points": [latest[p] for p in POINTS if p in latest],
        "ndcg@10": {
            p: {str(d): latest[p]["metrics"][str(d)]["ndcg@10"] for d in latest[p]["dims"]}
            for p in POINTS
            if p in latest
        },  # fmt: skip
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{OUT}.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (RESULTS / f"{OUT}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "dim", "ndcg@10", "recall@100"])
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, summary["points"][0] if summary["points"] else {})
    print(json.dumps(summary["ndcg@10"], indent=2))


def _plot(rows: list[dict], spec: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for point in POINTS:
        pts = sorted((r["dim"], r["ndcg@10"]) for r in rows if r["model"] == point)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=point)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(DIMS), [str(d) for d in DIMS])
    ax.set_xlabel("embedding size (first coordinates, re-normalised)")
    ax.set_ylabel("SciFact test nDCG@10")
    ax.set_title(
        f"all-MiniLM-L6-v2: Matryoshka vs plain MNRL\n({spec.get('epochs')} epoch, batch "
        f"{spec.get('batch_size')}, {spec.get('max_seq_length')} tokens)\n"
        f"test corpus: {corpus_label(spec)}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{OUT}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--point", help=argparse.SUPPRESS)
    parser.add_argument("--points", default=",".join(POINTS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--eval-docs", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--out", default="matryoshka", help="results/OUT.{jsonl,json,csv,png}")
    args = parser.parse_args()
    global JSONL, OUT
    OUT = args.out
    JSONL = RESULTS / f"{OUT}.jsonl"
    if args.point:
        print("RESULT " + json.dumps(run_point(json.loads(args.point))), flush=True)
        return
    command = "OMP_NUM_THREADS={} python bench/matryoshka.py {}".format(
        os.environ.get("OMP_NUM_THREADS", "unset"), shlex.join(sys.argv[1:])
    ).strip()
    if not args.report_only:
        done = {r["point"] for r in read_jsonl() if r.get("status") == "ok"}
        for point in args.points.split(","):
            if point in done:
                print(f"{point}: done already (in {JSONL.name})", flush=True)
                continue
            spec = {
                "point": point,
                "model": "all-MiniLM-L6-v2",
                "data": str(find_scifact()),
                "dims": list(DIMS),
                "batch_size": args.batch_size,
                "epochs": args.epochs,
                "max_seq_length": args.max_seq_length,
                "eval_docs": args.eval_docs,
                "learning_rate": args.lr,
                "seed": args.seed,
                "command": command,
            }
            print(f"{point}: running", flush=True)
            record = run_child(spec)
            RESULTS.mkdir(exist_ok=True)
            with JSONL.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{point}: {record['status']} in {record['wall_s']}s", flush=True)
            if record["status"] != "ok":
                print(record.get("stderr_tail", ""), file=sys.stderr)
    report(command)


if __name__ == "__main__":
    main()
