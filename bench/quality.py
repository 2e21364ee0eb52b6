"""Does a bigger batch retrieve better? Fine-tune all-MiniLM-L6-v2 at batch 16, 64, 256, 1,024.

    cd bench && OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 nice -n 10 python quality.py  # 80 min cap
    python bench/quality.py --deadline-min 180   # the whole grid: 2-3 hours on 2 shared cores
    python bench/quality.py --seeds 42,43        # add a seed: finished points are skipped
    python bench/quality.py --report-only        # rebuild table + plot from quality.jsonl

For SciFact and NFCorpus: evaluate the packaged all-MiniLM-L6-v2 once (the base), then
fine-tune it on the dataset's train qrels with MNRL (in-batch negatives, false negatives
masked) at each batch size, with the same epochs, learning rate and warm-up fraction, and
evaluate on the test split over the full corpus (densefit.evaluate.evaluate: exactly
what bench/reproduce_mteb.py runs, which reproduces the published scores).

Every point runs in a fresh process and appends one JSON line to results/quality.jsonl,
keyed by dataset, batch size, seed and every setting that changes the result; a rerun
skips the points already there. Points start in priority order (bases, then batch 16 and
1,024, then 256 and 64, then extra seeds) and a point that would end past ``--deadline-min``
(estimated from the speed of the points before it) is not started.

Defaults, sized for a shared 2-core CPU: length 64 tokens for training and evaluation (the
base is measured at 64 too; the published full-length score is a separate row), one epoch,
learning rate 2e-5, all 919 SciFact pairs, a seeded sample of 1,024 NFCorpus pairs (so batch
1,024 is a real batch of 1,024), plain MNRL below batch 1,024 and the gradient cache from it.
There, a fine-tuned point took 10-20 minutes (training 480-940 s, evaluation 135-340 s).

Writes bench/results/quality.{jsonl,json,csv,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import finished, grid_point, pyplot, run_grid_point, training_rows, write_report
from _runner import ROOT, environment, git_commit
from reproduce_mteb import REFERENCES, find_datasets

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
JSONL = RESULTS / "quality.jsonl"
METRICS = ("ndcg@10", "recall@100")
NAMES = {"scifact": "SciFact", "nfcorpus": "NFCorpus"}
# Test-corpus sizes, for the time estimate before a point's first run.
CORPUS_DOCS = {"scifact": 5183, "nfcorpus": 3633}
# Seconds per document encoded / per training pair per epoch, until a point has measured them
# (2 threads at sequence length 64 on the shared 2-core machine, load about 4).
DEFAULT_RATES = {"eval_s_per_doc": 0.05, "train_s_per_pair": 0.45}


# ----------------------------------------------------------------------------- the plan


def settings_of(args) -> dict:
    """The settings every point shares; all of them are part of each point's key."""
    return {
        "model": args.model,
        "max_seq_length": args.max_seq_length,
        "epochs": args.epochs,
        "learning_rate": args.learning_rate,
        "warmup_fraction": 0.1,  # TrainConfig's default: int(0.1 * total steps)
        "loss": "mnrl (scale 20, cosine, false negatives masked)",
        "train_pairs": {"scifact": None, "nfcorpus": args.nfcorpus_pairs},  # None: all
        "subsample_seed": 0,
        "cache_from": args.cache_from,  # batch sizes >= this use the gradient cache
    }


def point_key(dataset: str, batch_size: int, seed: int | None, settings: dict) -> str:
    """A point's identity: what it ran on and every setting that changes its metrics.

    The base (``batch_size`` 0, no training) depends only on the model and the sequence
    length; a fine-tuned point on everything that decides the training run.
    """
    if batch_size == 0:
        return f"{dataset}|base|L{settings['max_seq_length']}|{settings['model']}"
    pairs = settings["train_pairs"].get(dataset)
    return "|".join(
        [
            dataset,
            f"bs{batch_size}",
            f"seed{seed}",
            f"L{settings['max_seq_length']}",
            f"ep{settings['epochs']}",
            f"lr{settings['learning_rate']:g}",
            f"wu{settings['warmup_fraction']:g}",
            "pairs" + ("all" if pairs is None else f"{pairs}@{settings['subsample_seed']}"),
            memory_for(batch_size, settings),
            settings["model"],
        ]
    )


def memory_for(batch_size: int, settings: dict) -> str:
    """``cache`` (gradient cache, flat memory) from ``cache_from`` rows up, else ``plain``.

    The two give the same gradients (tests/test_memory.py), so the metrics do not depend
    on the choice; plain skips the cache's extra no-grad forward.
    """
    return "cache" if batch_size >= settings["cache_from"] else "plain"


def plan(
    datasets: list[str], batch_sizes: list[int], seeds: list[int], settings: dict, data_root: Path
) -> list[dict]:
    """Every point, most informative first: bases, the extremes, the middle, more seeds."""
    order = sorted(batch_sizes, key=lambda b: (b not in (min(batch_sizes), max(batch_sizes)), -b))
    order = [min(batch_sizes)] + [b for b in order if b != min(batch_sizes)]
    specs = [(d, 0, None) for d in datasets]
    specs += [(d, b, seeds[0]) for b in order for d in datasets]
    specs += [(d, b, s) for s in seeds[1:] for b in order for d in datasets]
    return [
        {
            "key": point_key(d, b, s, settings),
            "dataset": d,
            "batch_size": b,
            "seed": s,
            "memory": memory_for(b, settings) if b else None,
            "data": str(data_root / d),
            **{k: v for k, v in settings.items() if k not in ("train_pairs", "cache_from")},
            "train_pairs": settings["train_pairs"].get(d),
        }
        for d, b, s in specs
    ]


def pending(specs: list[dict], done: dict[str, dict]) -> list[dict]:
    """The specs whose key has no finished point yet."""
    return [s for s in specs if s["key"] not in done]


# ----------------------------------------------------------------------------- one point


def run_point(spec: dict) -> dict:
    """Fine-tune (unless the base) and evaluate on the test split; runs in a child process."""
    return grid_point(
        spec,
        lambda beir, out: training_rows(beir, spec["train_pairs"], spec["subsample_seed"]),
        lambda result, log: {
            "warmup_steps": int(0.1 * result.steps),
            "mean_loss_last_10pct": round(
                statistics.fmean(result.losses[-max(1, len(result.losses) // 10) :]), 4
            ),
            "masked_duplicates": sum(r.get("masked_duplicates", 0) for r in log),
            "masked_known_positives": sum(r.get("masked_known_positives", 0) for r in log),
        },
    )


# ----------------------------------------------------------------------------- time estimate


def rates(done: list[dict]) -> dict:
    """Seconds per test document and per training pair-epoch, from finished points."""
    evals = [r["eval_s"] / r["eval_docs"] for r in done if r.get("eval_docs")]
    trains = [
        r["train"]["seconds"] / (r["train"]["rows"] * r["epochs"]) for r in done if r.get("train")
    ]
    return {
        "eval_s_per_doc": max(evals[-3:]) if evals else DEFAULT_RATES["eval_s_per_doc"],
        "train_s_per_pair": max(trains[-3:]) if trains else DEFAULT_RATES["train_s_per_pair"],
    }


def estimate_s(spec: dict, rate: dict, train_rows: dict[str, int]) -> float:
    seconds = 30 + CORPUS_DOCS.get(spec["dataset"], 5000) * rate["eval_s_per_doc"]
    if spec["batch_size"]:
        rows = spec["train_pairs"] or train_rows.get(spec["dataset"], 1000)
        seconds += rows * spec["epochs"] * rate["train_s_per_pair"]
    return seconds


# ----------------------------------------------------------------------------- report


def summarise(
    records: list[dict], settings: dict, datasets: list[str], batch_sizes: list[int] = ()
) -> dict:
    """Per dataset: the reference, the base and each batch size (mean, spread over seeds).

    A batch size of ``batch_sizes`` without a finished point gets a row saying so.
    """
    summary = {}
    for dataset in datasets:
        base_key = point_key(dataset, 0, None, settings)
        mine = [r for r in records if r["dataset"] == dataset]
        rows = []
        reference = REFERENCES.get(dataset, {})
        if reference:
            rows.append(
                {
                    "run": "published (MTEB, full length 256)",
                    "batch_size": None,
                    **{m: reference[m][0] for m in METRICS if m in reference},
                }
            )
        base = next((r for r in mine if r["key"] == base_key), None)
        if base:
            rows.append(
                {
                    "run": f"base, measured at length {settings['max_seq_length']}",
                    "batch_size": 0,
                    "seeds": 0,
                    **{m: base["metrics"][m] for m in METRICS},
                    "wall_s": base["wall_s"],
                }
            )
        by_batch: dict[int, list[dict]] = {}
        for r in mine:
            if r["batch_size"] and r["key"] == point_key(
                dataset, r["batch_size"], r["seed"], settings
            ):
                by_batch.setdefault(r["batch_size"], []).append(r)
        for batch_size in sorted(by_batch):
            runs = sorted(by_batch[batch_size], key=lambda r: r["seed"])
            row = {"run": f"batch {batch_size:,}", "batch_size": batch_size, "seeds": len(runs)}
            for m in METRICS:
                values = [r["metrics"][m] for r in runs]
                row[m] = round(statistics.fmean(values), 5)
                row[f"{m}_min"], row[f"{m}_max"] = min(values), max(values)
                row[f"{m}_std"] = round(statistics.stdev(values), 5) if len(values) > 1 else None
                if base:
                    row[f"{m}_vs_base"] = round(row[m] - base["metrics"][m], 5)
            row["steps"] = runs[0]["train"]["steps"]
            row["rows_per_step"] = runs[0]["train"]["rows_per_step_max"]
            row["memory"] = runs[0]["memory"]
            row["train_rows"] = runs[0]["train"]["rows"]
            row["train_s"] = round(statistics.fmean(r["train"]["seconds"] for r in runs), 1)
            row["wall_s"] = round(statistics.fmean(r["wall_s"] for r in runs), 1)
            row["final_loss"] = round(
                statistics.fmean(r["train"]["mean_loss_last_10pct"] for r in runs), 4
            )
            rows.append(row)
        for batch_size in sorted(set(batch_sizes) - set(by_batch)):
            rows.append(
                {"run": f"batch {batch_size:,}: not run", "batch_size": batch_size, "not_run": True}
            )
        rows.sort(key=lambda r: -1 if r["batch_size"] is None else r["batch_size"])
        summary[dataset] = rows
    return summary


def _cell(row: dict, metric: str) -> str:
    if metric not in row:
        return "—"
    text = f"{row[metric]:.4f}"
    if row.get(f"{metric}_std") is not None:
        text += f" ± {row[f'{metric}_std']:.4f}"
    if f"{metric}_vs_base" in row:
        text += f" ({row[f'{metric}_vs_base']:+.4f})"
    return text


def markdown(summary: dict, settings: dict, meta: dict) -> str:
    lines = [
        "# Does a bigger batch retrieve better?",
        "",
        f"all-MiniLM-L6-v2 fine-tuned with MNRL on each dataset's train qrels, evaluated on its "
        f"test split over the full corpus (densefit.evaluate.evaluate). Same epochs "
        f"({settings['epochs']}), learning rate ({settings['learning_rate']:g}, linear decay, "
        f"{settings['warmup_fraction']:.0%} warm-up) and sequence length "
        f"({settings['max_seq_length']} tokens, training and evaluation) at every batch size, "
        "so a bigger batch takes fewer optimizer steps. Metrics: mean ± std over seeds "
        "(no ± with one seed), (change vs the base at the same length).",
        "",
    ]
    for dataset, rows in summary.items():
        pairs = settings["train_pairs"].get(dataset)
        trained = [r for r in rows if r.get("batch_size") and not r.get("not_run")]
        n_rows = trained[0]["train_rows"] if trained else None
        lines += [
            f"## {NAMES.get(dataset, dataset)}"
            + (
                f" (train: {'all' if pairs is None else 'a seeded sample of'}"
                f"{'' if n_rows is None else f' {n_rows:,}'} pairs)"
            ),
            "",
            "| run | nDCG@10 | Recall@100 | seeds | steps | rows/step | memory | train s | point wall s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r.get("not_run"):
                lines.append(f"| batch {r['batch_size']:,} | not run (time budget) | | | | | | | |")
                continue
            lines.append(
                f"| {r['run']} | {_cell(r, 'ndcg@10')} | {_cell(r, 'recall@100')} | "
                f"{r.get('seeds', '—') if r.get('batch_size') else '—'} | {r.get('steps', '—')} | "
                f"{r.get('rows_per_step', '—')} | {r.get('memory', '—')} | {r.get('train_s', '—')} | "
                f"{r.get('wall_s', '—')} |"
            )
        if any(r.get("not_run") for r in rows):
            lines += [
                "",
                "Not run: the run was cut to fit its time budget. `python bench/quality.py` "
                "adds the missing points (finished ones are skipped).",
            ]
        if n_rows is not None and any(
            r.get("batch_size", 0) > r.get("rows_per_step", 0) for r in trained
        ):
            lines.append("")
            lines.append(
                "A batch size above the number of training pairs takes all of them in one step "
                "(rows/step)."
            )
        lines.append("")
    lines += [
        f"Environment: {meta.get('environment_line', '')}",
        "",
    ]
    return "\n".join(lines)


def plot(summary: dict, settings: dict, path: Path) -> None:
    plt = pyplot("matplotlib not installed: no PNG (pip install 'densefit[bench]')")
    if plt is None:
        return
    datasets = list(summary)
    fig, axes = plt.subplots(len(datasets), 2, figsize=(10, 3.6 * len(datasets)), squeeze=False)
    for i, dataset in enumerate(datasets):
        rows = summary[dataset]
        trained = [r for r in rows if r.get("batch_size") and not r.get("not_run")]
        base = next((r for r in rows if r.get("batch_size") == 0), None)
        published = next((r for r in rows if r.get("batch_size") is None), None)
        for ax, metric in zip(axes[i], METRICS, strict=True):
            if trained:
                xs = [r["batch_size"] for r in trained]
                ys = [r[metric] for r in trained]
                low = [r[metric] - r[f"{metric}_min"] for r in trained]
                high = [r[f"{metric}_max"] - r[metric] for r in trained]
                ax.errorbar(
                    xs,
                    ys,
                    yerr=[low, high],
                    marker="o",
                    capsize=4,
                    color="#4c72b0",
                    label="fine-tuned (mean, min-max over seeds)",
                )
                for r in trained:
                    ax.annotate(
                        f"{r['steps']} step{'s' if r['steps'] != 1 else ''}"
                        + (
                            f" of {r['rows_per_step']}"
                            if r["rows_per_step"] < r["batch_size"]
                            else ""
                        ),
                        (r["batch_size"], r[metric]),
                        textcoords="offset points",
                        xytext=(0, 8),
                        ha="center",
                        fontsize=7,
                    )
            if base:
                ax.axhline(
                    base[metric],
                    color="#999",
                    ls="--",
                    label=f"base at length {settings['max_seq_length']}",
                )
            if published and metric in published:
                ax.axhline(
                    published[metric], color="#dd8452", ls=":", label="published (MTEB, length 256)"
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks([16, 64, 256, 1024], ["16", "64", "256", "1,024"])
            ax.set_xlim(11, 1500)
            ax.set_xlabel("batch size (in-batch negatives per query = batch - 1)")
            ax.set_title(f"{NAMES.get(dataset, dataset)} test {metric}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(
        f"all-MiniLM-L6-v2 + MNRL: same epochs ({settings['epochs']}) and learning rate at every "
        f"batch size, length {settings['max_seq_length']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(settings: dict, datasets: list[str], meta: dict, batch_sizes: list[int] = ()) -> dict:
    records = list(finished(JSONL).values())
    summary = summarise(records, settings, datasets, batch_sizes)
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = meta.get("environment", {})
    threads = sorted({r.get("threads") for r in records if r.get("threads")})
    meta["environment_line"] = (
        f"torch {env.get('torch')}, {threads} thread(s) per point on a {env.get('cpu_count')}-CPU "
        f"machine shared with other jobs (load average per point in quality.json), "
        f"git {sorted({r.get('commit') for r in records if r.get('commit')})}. Timings are not "
        "the point of this benchmark; metrics do not depend on them."
    )
    payload = {"settings": settings, "meta": meta, "summary": summary, "points": records}
    text = markdown(summary, settings, meta)
    fields = ["dataset", "batch_size", "seed", "memory", "ndcg@10", "recall@100", "steps"]
    fields += ["rows_per_step", "train_s", "eval_s", "wall_s", "threads", "load_1min_before"]
    fields += ["commit", "key"]
    by_point = sorted(records, key=lambda r: (r["dataset"], r["batch_size"], r["seed"] or 0))
    write_report(RESULTS, "quality", payload, text, fields, by_point)
    plot(summary, settings, RESULTS / "quality.png")
    print(text, flush=True)
    return summary


# ----------------------------------------------------------------------------- driver


def _commit() -> str:
    """The commit, with ``+dirty`` when densefit/ has uncommitted changes."""
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "densefit"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return git_commit() + ("+dirty" if dirty else "")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    global RESULTS, JSONL
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--datasets", default="scifact,nfcorpus")
    parser.add_argument("--datasets-dir", default=None)
    parser.add_argument("--batch-sizes", default="16,64,256,1024")
    parser.add_argument("--seeds", default="42")
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--nfcorpus-pairs", type=int, default=1024)
    parser.add_argument(
        "--cache-from",
        type=int,
        default=1024,
        help="batch sizes from this one up use the gradient cache",
    )
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    parser.add_argument(
        "--deadline-min",
        type=float,
        default=80.0,
        help="start no point that would end after this many minutes",
    )
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--results-dir", default=str(RESULTS), help="where quality.* go")
    parser.add_argument("--point", default=None, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()

    if args.point:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        sys.path.insert(0, str(ROOT))
        print("RESULT " + json.dumps(run_point(json.loads(args.point))), flush=True)
        return 0

    RESULTS = Path(args.results_dir)
    JSONL = RESULTS / "quality.jsonl"
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    settings = settings_of(args)
    meta = {"command": " ".join(sys.argv), "environment": environment()}
    if args.report_only:
        report(settings, datasets, meta, _ints(args.batch_sizes))
        return 0

    root = find_datasets(args.datasets_dir)
    specs = plan(datasets, _ints(args.batch_sizes), _ints(args.seeds), settings, root)
    done = finished(JSONL)
    todo = pending(specs, done)
    print(
        f"{len(specs) - len(todo)} of {len(specs)} points already in {JSONL}; "
        f"{len(todo)} to run, {args.threads} thread(s)",
        flush=True,
    )
    commit = _commit()
    train_rows = {"scifact": 919}
    started = time.perf_counter()
    run_now: list[dict] = list(done.values())
    for spec in todo:
        rate = rates(run_now)
        estimate = estimate_s(spec, rate, train_rows)
        elapsed = time.perf_counter() - started
        if elapsed + estimate > args.deadline_min * 60:
            print(
                f"skip {spec['key']}: ~{estimate / 60:.0f} min would end past the "
                f"{args.deadline_min:g}-minute deadline ({elapsed / 60:.0f} min used)",
                flush=True,
            )
            continue
        print(
            f"run  {spec['key']} (~{estimate / 60:.0f} min, load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
        record = run_grid_point(__file__, spec, args.threads, JSONL, commit=commit)
        if record["status"] == "ok":
            run_now.append(record)
    print(f"total {round(time.perf_counter() - started)}s", flush=True)
    report(settings, datasets, meta, _ints(args.batch_sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
