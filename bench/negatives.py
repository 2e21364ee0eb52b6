"""Hard negatives on SciFact: in-batch only vs BM25-mined vs dense-mined, same steps.

    taskset -c 1 env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/negatives.py \\
        --note "another benchmark pinned to CPU 0"

Fine-tunes the packaged all-MiniLM-L6-v2 on SciFact train (919 pairs) three ways with the
same batch size, steps, seed and learning rate:

1. in-batch negatives only;
2. plus one BM25-mined hard negative per row (``densefit mine --method bm25``);
3. plus one dense-mined hard negative per row (mined with the base model itself);

and evaluates each (and the untouched base model) on SciFact test: nDCG@10 and Recall@100
(exact search over the whole corpus, metrics by pytrec_eval through densefit.evaluate).
Mining uses ranks 10..100 and the 5% relative margin (NV-Retriever's TopK-PercPos) for both
methods. Every phase runs in a fresh process, so each peak RSS is that phase's own.

Writes bench/results/negatives.{json,csv,png}.
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

from _runner import DATASETS, RESULTS, ROOT, environment, run_child

DATA = DATASETS / "scifact"
METRICS = ["ndcg@10", "recall@100"]
RUNS = ["base (no fine-tuning)", "in-batch only", "+ BM25 negatives", "+ dense negatives"]


# ----------------------------------------------------------------------------- phases


def _setup(threads: int):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT))


def _peak_mb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def phase_mine(args) -> dict:
    """Mine one hard negative per training pair; write the rows for the train phase."""
    from densefit.mine import mine_files
    from densefit.models import load_model

    model = None
    if args.method == "dense":
        model = load_model("all-MiniLM-L6-v2", max_seq_length=args.max_seq_length)
    started = time.perf_counter()
    report = mine_files(
        args.data,
        args.data,
        args.output,
        method=args.method,
        model=model,
        num_negatives=1,
        range_min=10,
        range_max=100,
        relative_margin=0.05,
        show_progress=False,
    )
    return {
        "method": args.method,
        "mining_s": round(time.perf_counter() - started, 2),
        "report": report.to_dict(),
        "peak_rss_mb": _peak_mb(),
    }


def phase_train_eval(args) -> dict:
    """Fine-tune on ``args.train`` (or not at all), then evaluate on SciFact test."""
    from densefit.config.train import TrainConfig
    from densefit.data.readers import read_training_data
    from densefit.models import load_model
    from densefit.training.loop import train

    model = load_model("all-MiniLM-L6-v2", max_seq_length=args.max_seq_length)
    out: dict = {"train": None}
    if args.train:
        rows, _ = read_training_data(args.train, split="train")
        config = TrainConfig(
            batch_size=args.batch_size,
            epochs=1,
            learning_rate=2e-5,
            seed=42,
            max_seq_length=args.max_seq_length,
            show_progress=False,
        )
        log = []
        result = train(model, rows, config, on_step=log.append)
        out["train"] = {
            "rows": len(rows),
            "negatives": sum(len(r.negatives) for r in rows),
            "steps": result.steps,
            "seconds": round(result.seconds, 1),
            "final_loss": round(result.final_loss, 4),
            "masked_duplicates": sum(r.get("masked_duplicates", 0) for r in log),
            "masked_known_positives": sum(r.get("masked_known_positives", 0) for r in log),
            "mean_pos_score": _mean(r.get("pos_score") for r in log),
            "mean_hard_neg_score": _mean(r.get("hard_neg_score") for r in log),
        }
    started = time.perf_counter()
    out["metrics"] = evaluate_scifact(model, args.data)
    out["eval_s"] = round(time.perf_counter() - started, 1)
    out["peak_rss_mb"] = _peak_mb()
    return out


def _mean(values):
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


def evaluate_scifact(model, data) -> dict:
    """Exact top-100 search of the whole test corpus; metrics through pytrec_eval."""
    from densefit.data.corpus import load_beir
    from densefit.evaluate import evaluate_run
    from densefit.retrieval.encode import encode_texts
    from densefit.retrieval.index.exact import exact_search

    beir = load_beir(data, "test")
    ids = list(beir.corpus)
    docs = encode_texts(model, [beir.corpus[i].text for i in ids], batch_size=32, normalize=True)
    query_ids = list(beir.queries)
    queries = encode_texts(model, [beir.queries[q] for q in query_ids], normalize=True)
    scores, rows = exact_search(docs, queries, 100)
    run = {
        q: {ids[r]: float(s) for s, r in zip(sc, rw, strict=True) if r >= 0}
        for q, sc, rw in zip(query_ids, scores, rows, strict=True)
    }
    result = evaluate_run(run, beir.qrels, METRICS)
    return {k: round(v, 4) for k, v in result.metrics.items()}


# ----------------------------------------------------------------------------- driver


def run_phase(argv: list[str], threads: int) -> dict:
    child = run_child(__file__, "--threads", str(threads), *argv, threads=threads)
    if child.returncode or child.result is None:
        raise RuntimeError(f"phase {argv} failed:\n{child.stderr[-3000:]}")
    result = child.result
    result["wall_s"] = child.wall_s
    print(f"  {' '.join(argv[:3])}: {result['wall_s']}s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["mine", "train-eval"], default=None)
    parser.add_argument("--method", default="bm25")
    parser.add_argument("--train", default=None)
    parser.add_argument("--output", default=None)
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    if args.phase:  # a child process
        _setup(args.threads)
        result = phase_mine(args) if args.phase == "mine" else phase_train_eval(args)
        print("RESULT " + json.dumps(result), flush=True)
        return

    if not Path(args.data).is_dir():
        sys.exit(f"{args.data}: no SciFact folder; pass --data /path/to/scifact")
    started = time.perf_counter()
    machine_info = machine(args)  # at the start: start time and load before the run
    common = [
        "--data",
        args.data,
        "--batch-size",
        str(args.batch_size),
        "--max-seq-length",
        str(args.max_seq_length),
    ]
    work = Path(tempfile.mkdtemp(prefix="densefit-negatives-"))
    print(f"SciFact hard negatives, {args.threads} thread(s), files in {work}", flush=True)
    mined = {}
    for method in ("bm25", "dense"):
        path = work / f"mined_{method}.jsonl"
        mined[method] = run_phase(
            ["--phase", "mine", "--method", method, "--output", str(path), *common], args.threads
        )
        mined[method]["path"] = str(path)
    trained = {
        RUNS[0]: run_phase(["--phase", "train-eval", *common], args.threads),
        RUNS[1]: run_phase(["--phase", "train-eval", "--train", args.data, *common], args.threads),
        RUNS[2]: run_phase(
            ["--phase", "train-eval", "--train", mined["bm25"]["path"], *common], args.threads
        ),
        RUNS[3]: run_phase(
            ["--phase", "train-eval", "--train", mined["dense"]["path"], *common], args.threads
        ),
    }
    summary = {
        "machine": machine_info,
        "settings": {
            "model": "all-MiniLM-L6-v2 (packaged)",
            "dataset": "SciFact",
            "train_split": "train",
            "eval_split": "test",
            "batch_size": args.batch_size,
            "epochs": 1,
            "learning_rate": 2e-5,
            "max_seq_length": args.max_seq_length,
            "negatives_per_row": 1,
            "mining_range": "10:100",
            "relative_margin": 0.05,
            "mask_false_negatives": True,
        },
        "mining": mined,
        "runs": trained,
        "total_s": round(time.perf_counter() - started, 1),
    }
    write_outputs(summary)


def machine(args) -> dict:
    env = environment()
    return {
        "threads": args.threads,
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpus": env["cpu_count"],
        "loadavg_at_start": os.getloadavg()[0],
        "torch": env["torch"],
        "python": env["python"],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": args.note,
    }


def write_outputs(summary: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "negatives.json").write_text(json.dumps(summary, indent=2))
    table = []
    for name, run in summary["runs"].items():
        method = {"+ BM25 negatives": "bm25", "+ dense negatives": "dense"}.get(name)
        mining = summary["mining"].get(method, {}) if method else {}
        train = run["train"] or {}
        table.append(
            {
                "run": name,
                "ndcg@10": run["metrics"]["ndcg@10"],
                "recall@100": run["metrics"]["recall@100"],
                "steps": train.get("steps", 0),
                "train_s": train.get("seconds", 0),
                "hard_negatives": train.get("negatives", 0),
                "masked_known_positives": train.get("masked_known_positives", 0),
                "masked_duplicates": train.get("masked_duplicates", 0),
                "mining_s": mining.get("mining_s", ""),
                "mining_peak_rss_mb": mining.get("peak_rss_mb", ""),
                "peak_rss_mb": run["peak_rss_mb"],
            }
        )
    with open(RESULTS / "negatives.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    head = f"{'run':24} {'nDCG@10':>8} {'R@100':>7} {'steps':>5} {'train s':>8} {'negs':>5} {'mine s':>7} {'mine MB':>8}"
    print(head)
    for row in table:
        print(
            f"{row['run']:24} {row['ndcg@10']:8.4f} {row['recall@100']:7.4f} {row['steps']:5} "
            f"{row['train_s']:8} {row['hard_negatives']:5} {row['mining_s']!s:>7} "
            f"{row['mining_peak_rss_mb']!s:>8}"
        )
    m = summary["machine"]
    print(
        f"threads {m['threads']}, affinity {m['affinity']}, note: {m['note'] or '-'}; "
        f"total {summary['total_s']}s"
    )
    plot(table)


def plot(table: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install 'densefit[bench]')")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [r["run"] for r in table]
    for ax, metric in zip(axes, METRICS, strict=True):
        values = [r[metric] for r in table]
        bars = ax.bar(range(len(names)), values, color=["#999", "#4c72b0", "#dd8452", "#55a868"])
        ax.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
        ax.set_title(f"SciFact test {metric}")
        ax.set_ylim(min(values) * 0.95, max(values) * 1.03)
        for bar, value in zip(bars, values, strict=True):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                value,
                f"{value:.3f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    fig.suptitle("all-MiniLM-L6-v2 fine-tuned on SciFact train: hard negatives (same steps)")
    fig.tight_layout()
    fig.savefig(RESULTS / "negatives.png", dpi=120)


if __name__ == "__main__":
    main()
