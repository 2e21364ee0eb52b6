"""Bigger batch, better model? Batch size x learning-rate rule x epochs on real data.

    OMP_NUM_THREADS=1 nohup nice -n 5 python bench/batch_size.py --deadline-min 90 &
    python bench/batch_size.py --report-only     # rebuild table + plot from batch_size.jsonl

all-MiniLM-L6-v2 fine-tuned with MNRL (in-batch negatives, false negatives masked) on a BEIR
train split, evaluated on the test split over the full corpus (densefit.evaluate.evaluate),
at batch 32, 128, 512 and 2,048, with three learning-rate rules from a base of 2e-5 at batch 32:

- ``const``: 2e-5 at every batch size (a fixed rate);
- ``sqrt``: 2e-5 x sqrt(batch / 32);
- ``linear``: 2e-5 x batch / 32, capped at 2e-4 (so 512 and 2,048 both get 2e-4);
- ``auto``: whatever :func:`densefit.config.auto_learning_rate` gives (the default).

Then more epochs for the big batches, extra seeds at two points (the noise), SciFact /
NFCorpus small cases and BM25-mined hard negatives at one batch size, in that priority order;
a point that would end past ``--deadline-min`` (estimated from the points before it) is not
started and the report says so.

Data: manpages is read WITHOUT titles (its README: gcloud titles spell out the command and
overlap the query), from a plain-JSONL copy made once under ``--work-dir``. Documents are the
README's 300-word DESCRIPTION cut; training and evaluation use ``--max-seq-length`` tokens.

Every point runs in a fresh process and appends one JSON line to results/batch_size.jsonl
(keyed by every setting that changes its metrics); a rerun skips finished points. Each line
records wall time, the memory plan, threads and the load average before/after: the machine
was shared, so times are indicative only; metrics do not depend on them.

Writes bench/results/batch_size.{jsonl,json,csv,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from _common import finished, grid_point, pyplot, run_grid_point, training_rows, write_report
from _runner import DATASETS, RESULTS, ROOT, environment, untitled_copy

JSONL = RESULTS / "batch_size.jsonl"
METRICS = ("ndcg@10", "recall@100")
BASE_LR, BASE_BATCH, LR_CAP = 2e-5, 32, 2e-4
RULES = ("const", "sqrt", "linear", "auto")
LABELS = {
    "const": "const 2e-5",
    "sqrt": "sqrt rule",
    "linear": "linear rule, cap 2e-4 (= auto, the default)",
}
CORPUS_DOCS = {"manpages": 5239, "scifact": 5183, "nfcorpus": 3633}
TRAIN_ROWS = {"manpages": 3739, "scifact": 919, "nfcorpus": 1024}
# Until a point has measured them: seconds per document encoded / per training row.
DEFAULT_RATES = {"eval_s_per_doc": 0.02, "train_s_per_row": 0.08}


def learning_rate(rule: str, batch_size: int) -> float:
    """The peak learning rate of ``rule`` at ``batch_size`` (base 2e-5 at batch 32)."""
    if rule == "const":
        return BASE_LR
    if rule == "sqrt":
        return BASE_LR * math.sqrt(batch_size / BASE_BATCH)
    if rule == "linear":
        return min(LR_CAP, BASE_LR * batch_size / BASE_BATCH)
    if rule == "auto":
        sys.path.insert(0, str(ROOT))
        from densefit.config.train import auto_learning_rate

        return auto_learning_rate(batch_size)
    raise ValueError(f"unknown rule {rule!r}: one of {RULES}")


# ----------------------------------------------------------------------------- data


def dataset_folder(name: str, datasets: Path, work: Path) -> Path:
    """manpages: its untitled copy; the others as they are (titles kept, as in BEIR)."""
    if name == "manpages":
        return untitled_copy(datasets / name, work / "manpages-notitle")
    return datasets / name


# ----------------------------------------------------------------------------- the plan


def point(dataset, batch_size, rule="const", *, epochs=1, seed=42, negatives="in-batch", args):
    """One point's spec; its key holds every setting that changes its metrics."""
    lr = learning_rate(rule, batch_size) if batch_size else None
    pairs = args.nfcorpus_pairs if dataset == "nfcorpus" else None
    spec = {
        "dataset": dataset,
        "batch_size": batch_size,
        "rule": rule if batch_size else None,
        "learning_rate": lr,
        "epochs": epochs if batch_size else 0,
        "seed": seed if batch_size else None,
        "negatives": negatives if batch_size else None,
        "max_seq_length": args.max_seq_length,
        "memory": args.memory,
        "train_pairs": pairs,
        "titles": dataset != "manpages",
        "model": args.model,
        "warmup_fraction": 0.1,
    }
    if not batch_size:
        spec["key"] = f"{dataset}|base|L{args.max_seq_length}|{args.model}"
    else:
        spec["key"] = "|".join(
            [
                dataset,
                f"bs{batch_size}",
                f"lr{lr:.3g}",
                f"ep{epochs}",
                f"seed{seed}",
                negatives,
                f"L{args.max_seq_length}",
                f"pairs{pairs or 'all'}",
                "titles" if spec["titles"] else "notitles",
                args.model,
            ]
        )
    return spec


def plan(args) -> list[dict]:
    """Every point, in the brief's priority order (identical keys are run once)."""
    P = lambda *a, **k: point(*a, args=args, **k)  # noqa: E731
    specs = [P("manpages", 0), P("manpages", 32)]  # (1) the base, batch 32 (every rule)
    specs += [P("manpages", 512, rule) for rule in ("sqrt", "linear")]
    specs += [P("manpages", 128, "sqrt")]
    specs += [P("manpages", 32, seed=43), P("manpages", 512, "linear", seed=43)]  # (3) noise
    specs += [P("manpages", 128, "linear"), P("manpages", 2048, "linear")]
    specs += [P("manpages", 2048, "sqrt"), P("manpages", 512, "const")]
    specs += [P("manpages", 2048, "const"), P("manpages", 128, "const")]
    specs += [P("manpages", 512, "linear", epochs=2), P("manpages", 2048, "linear", epochs=4)]
    specs += [P("scifact", 0), P("scifact", 32), P("scifact", 512, "linear")]  # (4)
    specs += [P("manpages", 512, "linear", negatives="bm25")]  # (5)
    specs += [P("nfcorpus", 0), P("nfcorpus", 32), P("nfcorpus", 512, "linear")]
    seen, out = set(), []
    for s in specs:
        if s["key"] not in seen:
            seen.add(s["key"])
            out.append(s)
    return out


# ----------------------------------------------------------------------------- one point


def run_point(spec: dict) -> dict:
    """Fine-tune (unless the base) and evaluate on the test split; runs in a child process."""
    return grid_point(spec, lambda beir, out: training_rows_of(spec, beir, out))


def training_rows_of(spec: dict, beir, out: dict) -> list:
    """The point's training rows: its pairs (a seeded sample of ``train_pairs``), with one
    BM25-mined hard negative each for ``negatives: bm25`` (recorded in ``out["mining"]``)."""
    rows = training_rows(beir, spec["train_pairs"], 0)
    if spec["negatives"] == "bm25":
        from densefit.mine import mine_hard_negatives

        started = time.perf_counter()
        train_docs = [beir.corpus[d] for d in {r.positive_id for r in rows}]
        rows, mined = mine_hard_negatives(
            rows, train_docs, method="bm25", num_negatives=1, show_progress=False
        )
        out["mining"] = {"seconds": round(time.perf_counter() - started, 1), **mined.to_dict()}
    return rows


def estimate_s(spec: dict, done: list[dict]) -> float:
    """Seconds the point should take, from the speed of the finished ones."""
    evals = [r["eval_s"] / r["eval_docs"] for r in done if r.get("eval_docs")]
    trains = [
        r["train"]["seconds"] / (r["train"]["rows"] * r["epochs"]) for r in done if r.get("train")
    ]
    per_doc = max(evals[-3:]) if evals else DEFAULT_RATES["eval_s_per_doc"]
    per_row = max(trains[-3:]) if trains else DEFAULT_RATES["train_s_per_row"]
    seconds = 20 + CORPUS_DOCS.get(spec["dataset"], 5000) * per_doc
    if spec["batch_size"]:
        rows = spec["train_pairs"] or TRAIN_ROWS.get(spec["dataset"], 1000)
        seconds += rows * spec["epochs"] * per_row * (1.5 if spec["negatives"] == "bm25" else 1)
    return seconds


# ----------------------------------------------------------------------------- report


def summarise(records: list[dict]) -> dict:
    """Per dataset: the base and one row per (batch, rule, epochs, negatives), seeds pooled."""
    summary: dict[str, dict] = {}
    for dataset in sorted({r["dataset"] for r in records}):
        mine = [r for r in records if r["dataset"] == dataset]
        base = next((r for r in mine if not r["batch_size"]), None)
        groups: dict[tuple, list[dict]] = {}
        for r in mine:
            if r["batch_size"]:
                key = (r["batch_size"], r["rule"], r["epochs"], r["negatives"])
                groups.setdefault(key, []).append(r)
        rows = []
        for (batch, rule, epochs, negatives), runs in sorted(groups.items()):
            row = {
                "batch_size": batch,
                "rule": rule,
                "learning_rate": runs[0]["learning_rate"],
                "epochs": epochs,
                "negatives": negatives,
                "seeds": sorted(r["seed"] for r in runs),
                "steps": runs[0]["train"]["steps"],
                "train_s": round(statistics.fmean(r["train"]["seconds"] for r in runs), 1),
                "wall_s": round(statistics.fmean(r["wall_s"] for r in runs), 1),
                "memory": (runs[0]["train"].get("plan") or {}).get("strategy"),
                "final_loss": runs[0]["train"]["final_loss"],
            }
            for m in METRICS:
                values = [r["metrics"][m] for r in runs]
                row[m] = round(statistics.fmean(values), 5)
                row[f"{m}_values"] = values
                if base:
                    row[f"{m}_vs_base"] = round(row[m] - base["metrics"][m], 5)
            rows.append(row)
        summary[dataset] = {
            "base": base and {m: base["metrics"][m] for m in METRICS},
            "rows": rows,
            "noise": noise(rows),
        }
    return summary


def noise(rows: list[dict]) -> dict:
    """Seed spread (max - min) of nDCG@10 at the points run with more than one seed."""
    spreads = {
        f"bs{r['batch_size']} {r['rule']}": round(
            max(r["ndcg@10_values"]) - min(r["ndcg@10_values"]), 5
        )
        for r in rows
        if len(r["seeds"]) > 1
    }
    return {"ndcg@10_seed_range": spreads, "max": max(spreads.values()) if spreads else None}


def markdown(summary: dict, meta: dict, skipped: list[str]) -> str:
    lines = [
        "# Bigger batch, better model?",
        "",
        "all-MiniLM-L6-v2 + MNRL (in-batch negatives, false negatives masked), AdamW, 10% "
        "warm-up then linear decay, evaluated on the test split over the full corpus. "
        f"Sequence length {meta['max_seq_length']} tokens (training and evaluation). "
        "manpages: 3,739 train pairs, 1,000 test queries over 5,239 documents, text WITHOUT "
        "titles. Learning-rate rules from 2e-5 at batch 32: const = 2e-5; sqrt = "
        "2e-5 x sqrt(batch/32); linear = 2e-5 x batch/32 capped at 2e-4. One seed (42) unless "
        "the seeds column says more (then mean, and every value in the JSON).",
        "",
        "Reproduce: `OMP_NUM_THREADS=1 nice -n 5 python bench/batch_size.py --deadline-min 90` "
        "(points run in the plan's priority order; finished ones are skipped, so reruns add "
        f"the rest). This file was written by `{meta['command']}`.",
        "",
    ]
    for dataset, s in summary.items():
        base = s["base"]
        lines += [f"## {dataset}", ""]
        if base:
            lines.append(
                f"Base model (no training): nDCG@10 {base['ndcg@10']:.4f}, "
                f"Recall@100 {base['recall@100']:.4f}."
            )
            lines.append("")
        lines += [
            "| batch | rule | lr | epochs | negatives | steps | seeds | nDCG@10 (vs base) "
            "| Recall@100 | train s | point wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in s["rows"]:
            nd = f"{r['ndcg@10']:.4f}"
            if len(r["seeds"]) > 1:
                nd += f" [{min(r['ndcg@10_values']):.4f}-{max(r['ndcg@10_values']):.4f}]"
            if "ndcg@10_vs_base" in r:
                nd += f" ({r['ndcg@10_vs_base']:+.4f})"
            lines.append(
                f"| {r['batch_size']:,} | {r['rule']} | {r['learning_rate']:.2g} | {r['epochs']} "
                f"| {r['negatives']} | {r['steps']} | {','.join(map(str, r['seeds']))} | {nd} "
                f"| {r['recall@100']:.4f} | {r['train_s']} | {r['wall_s']} |"
            )
        auto = [r for r in s["rows"] if r["rule"] in ("linear", "const") and r["epochs"] == 1]
        auto = [r for r in auto if r["rule"] == "linear" or r["batch_size"] == BASE_BATCH]
        if s["base"] and len(auto) > 1:
            path = ", ".join(
                f"{r['batch_size']:,}: {r['ndcg@10']:.4f}"
                for r in sorted(auto, key=lambda r: r["batch_size"])
                if r["negatives"] == "in-batch"
            )
            lines += [
                "",
                f"At the default (auto = linear rule, 1 epoch), nDCG@10 by batch: "
                f"{path} (base {s['base']['ndcg@10']:.4f}).",
            ]
        if s["noise"]["ndcg@10_seed_range"]:
            lines += ["", f"Seed noise (nDCG@10 max - min): {s['noise']['ndcg@10_seed_range']}."]
        lines.append("")
    if skipped:
        lines += ["## Not run (time budget)", ""] + [f"- `{k}`" for k in skipped] + [""]
    lines += [f"Environment: {meta.get('environment_line', '')}", ""]
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    datasets = list(summary)
    fig, axes = plt.subplots(len(datasets), 2, figsize=(11, 3.8 * len(datasets)), squeeze=False)
    colours = {"const": "#c44e52", "sqrt": "#4c72b0", "linear": "#55a868", "auto": "#8172b2"}
    for i, dataset in enumerate(datasets):
        s = summary[dataset]
        for ax, metric in zip(axes[i], METRICS, strict=True):
            for rule in RULES:
                for epochs in sorted({r["epochs"] for r in s["rows"]}):
                    pts = [
                        r
                        for r in s["rows"]
                        if r["rule"] == rule
                        and r["epochs"] == epochs
                        and r["negatives"] == "in-batch"
                    ]
                    if rule != "const":  # batch 32 is the same point for every rule
                        pts += [
                            r
                            for r in s["rows"]
                            if r["batch_size"] == BASE_BATCH
                            and r["epochs"] == epochs
                            and r["negatives"] == "in-batch"
                            and r["rule"] == "const"
                            and epochs == 1
                        ]
                    pts.sort(key=lambda r: r["batch_size"])
                    if not pts or (len(pts) == 1 and pts[0]["batch_size"] == BASE_BATCH):
                        continue
                    xs = [r["batch_size"] for r in pts]
                    ys = [r[metric] for r in pts]
                    err = [
                        [r[metric] - min(r[f"{metric}_values"]) for r in pts],
                        [max(r[f"{metric}_values"]) - r[metric] for r in pts],
                    ]
                    ax.errorbar(
                        xs,
                        ys,
                        yerr=err,
                        marker="o" if epochs == 1 else "s",
                        ls="-" if epochs == 1 else "--",
                        capsize=3,
                        color=colours[rule],
                        label=f"{LABELS.get(rule, rule)}, {epochs} epoch{'s' if epochs > 1 else ''}",
                    )
            hard = [r for r in s["rows"] if r["negatives"] != "in-batch"]
            for r in hard:
                ax.plot(
                    r["batch_size"],
                    r[metric],
                    "*",
                    ms=11,
                    color="k",
                    label=f"{r['rule']} + {r['negatives']} hard negative",
                )
            if s["base"]:
                ax.axhline(s["base"][metric], color="#999", ls=":", label="base model")
            ax.set_xscale("log", base=2)
            ax.set_xticks([32, 128, 512, 2048], ["32", "128", "512", "2,048"])
            ax.set_xlim(22, 2900)
            ax.set_xlabel("batch size")
            ax.set_title(f"{dataset} test {metric}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("all-MiniLM-L6-v2 + MNRL: quality vs batch size, one line per learning-rate rule")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(meta: dict, skipped: list[str]) -> dict:
    records = list(finished(JSONL).values())
    summary = summarise(records)
    env = meta.get("environment", {})
    loads = [r["loadavg_before"][0] for r in records if r.get("loadavg_before")]
    meta["environment_line"] = (
        f"torch {env.get('torch')}, {sorted({r.get('threads') for r in records})} torch thread(s) "
        f"per point, {env.get('cpu_count')}-CPU machine shared with other jobs (1-min load "
        f"average at point start {min(loads, default=0):.1f}-{max(loads, default=0):.1f}): "
        "times are indicative only; metrics do not depend on them."
    )
    payload = {"meta": meta, "summary": summary, "skipped": skipped, "points": records}
    text = markdown(summary, meta, skipped)
    fields = ["dataset", "batch_size", "rule", "learning_rate", "epochs", "negatives", "seed"]
    fields += ["ndcg@10", "recall@100", "steps", "train_s", "eval_s", "wall_s", "memory"]
    fields += ["peak_rss_mb", "threads", "load_1min_before", "key"]
    write_report(
        RESULTS,
        "batch_size",
        payload,
        text,
        fields,
        sorted(records, key=lambda r: r["key"]),
        lambda r: {"memory": ((r.get("train") or {}).get("plan") or {}).get("strategy")},
    )
    plot(summary, RESULTS / "batch_size.png")
    print(text, flush=True)
    return summary


# ----------------------------------------------------------------------------- driver


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--datasets-dir", default=str(DATASETS))
    parser.add_argument("--work-dir", default="/tmp/densefit-bench-data")
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--memory", default="cache", help="same gradients as plain, less memory")
    parser.add_argument("--nfcorpus-pairs", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)))
    parser.add_argument("--deadline-min", type=float, default=90.0)
    parser.add_argument("--only", default=None, help="run only keys containing this text")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--point", default=None, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()

    if args.point:
        sys.path.insert(0, str(ROOT))
        print("RESULT " + json.dumps(run_point(json.loads(args.point))), flush=True)
        return 0

    meta = {
        "command": "python bench/" + " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "max_seq_length": args.max_seq_length,
        "environment": environment(),
    }
    specs = plan(args)
    done = finished(JSONL)
    todo = [s for s in specs if s["key"] not in done]
    if args.only:
        todo = [s for s in todo if args.only in s["key"]]
    if args.report_only:
        report(meta, [s["key"] for s in todo])
        return 0
    datasets, work = Path(args.datasets_dir), Path(args.work_dir)
    print(f"{len(specs) - len(todo)} of {len(specs)} points done; {len(todo)} to run", flush=True)
    started = time.perf_counter()
    run_now, skipped = list(done.values()), []
    for spec in todo:
        estimate = estimate_s(spec, run_now)
        elapsed = time.perf_counter() - started
        if elapsed + estimate > args.deadline_min * 60:
            print(f"skip {spec['key']}: ~{estimate / 60:.0f} min would pass the deadline")
            skipped.append(spec["key"])
            continue
        spec = {**spec, "data": str(dataset_folder(spec["dataset"], datasets, work))}
        print(
            f"run  {spec['key']} (~{estimate / 60:.1f} min, load {os.getloadavg()[0]:.1f}, "
            f"{time.strftime('%H:%M:%S')})",
            flush=True,
        )
        env = {"TRANSFORMERS_OFFLINE": "1"}
        record = run_grid_point(__file__, spec, args.threads, JSONL, env=env)
        if record["status"] == "ok":
            run_now.append(record)
    print(f"total {round(time.perf_counter() - started)}s", flush=True)
    report(meta, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
