"""Several sources: do same-source batches beat mixed batches? (densefit's source_batches)

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nohup nice -n 15 python bench/sources.py --deadline-min 200 &
    python bench/sources.py --report-only     # rebuild the table and plot from sources.jsonl

all-MiniLM-L6-v2 fine-tuned with MNRL (in-batch negatives, false negatives masked, lr auto,
one epoch) on the union of four training sets: SciFact train (919 pairs), a seeded sample of
NFCorpus train (``--nfcorpus-pairs``), manpages train (3,739, WITHOUT titles, as in
bench/batch_size.py) and pydoc (968) -- passed to ``densefit.train`` as four sources, with

- ``same``: every optimizer step's rows from one source (``source_batches="same"``,
  ``source_sampling="proportional"``): its in-batch negatives from its own domain;
- ``mixed``: the rows of all four shuffled together (``source_batches="mixed"``),

at batch 128, 512 and 2,048; each model is evaluated on the test splits of SciFact, NFCorpus
and manpages over their full corpora (densefit.evaluate), and the mean of the three is the
headline. Peers measured in the same run: the base model, and each dataset trained alone
(its own training rows only, evaluated on its own test split) at the same batch sizes.

Points run in priority order (the base, same and mixed at 512 and 2,048, the alone models at
512, batch 128, a second seed at 512 and 2,048, the other alone models), each in a fresh
process (bench/_runner.py via bench/_common.py), appended to results/sources.jsonl keyed by
every setting that changes its metrics; a rerun skips finished points; a point that would end
past ``--deadline-min`` (estimated from the finished ones) is not started and the report
says so.

Writes bench/results/sources.{jsonl,json,csv,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import (
    evaluate_test,
    fine_tune,
    finished,
    load_point,
    pyplot,
    run_grid_point,
    training_rows,
    write_report,
)
from _runner import DATASETS, RESULTS, ROOT, environment
from batch_size import dataset_folder

JSONL = RESULTS / "sources.jsonl"
METRICS = ("ndcg@10", "recall@100")
TRAIN_SETS = ("scifact", "nfcorpus", "manpages", "pydoc")
TEST_SETS = ("scifact", "nfcorpus", "manpages")
MODES = ("same", "mixed")
TRAIN_ROWS = {"scifact": 919, "manpages": 3739, "pydoc": 968}  # nfcorpus: --nfcorpus-pairs
CORPUS_DOCS = {"manpages": 5239, "scifact": 5183, "nfcorpus": 3633}
# Until a point has measured them: seconds per document encoded / per training row.
DEFAULT_RATES = {"eval_s_per_doc": 0.02, "train_s_per_row": 0.08}


# ----------------------------------------------------------------------------- the plan


def point(train, batch_size, mode=None, *, seed=42, args) -> dict:
    """One point's spec: ``train`` the training sets (empty: the base model), evaluated on
    the test sets among them (every test set for the union and the base); its key holds
    every setting that changes its metrics."""
    train = list(train)
    evaluate = [d for d in TEST_SETS if d in train] if len(train) == 1 else list(TEST_SETS)
    spec = {
        "train_sets": train,
        "eval_sets": evaluate,
        "batch_size": batch_size,
        "source_batches": mode,
        "kind": "base" if not train else ("alone" if len(train) == 1 else "union"),
        "epochs": 1 if train else 0,
        "seed": seed if train else None,
        "learning_rate": "auto" if train else None,
        "max_seq_length": args.max_seq_length,
        "memory": args.memory,
        "nfcorpus_pairs": args.nfcorpus_pairs if "nfcorpus" in train else None,
        "model": args.model,
    }
    parts = [
        "+".join(train) or "base",
        f"bs{batch_size}",
        mode or "-",
        f"seed{seed}" if train else "-",
        f"L{args.max_seq_length}",
        f"nf{spec['nfcorpus_pairs'] or '-'}",
        args.model,
    ]
    spec["key"] = "|".join(parts) if train else f"base|L{args.max_seq_length}|{args.model}"
    return spec


def plan(args) -> list[dict]:
    """Every point, in priority order (identical keys once)."""
    P = lambda *a, **k: point(*a, args=args, **k)  # noqa: E731
    union = TRAIN_SETS
    specs = [P((), 0)]
    specs += [P(union, b, m) for b in (512, 2048) for m in MODES]
    specs += [P((d,), 512) for d in TEST_SETS]
    specs += [P(union, 128, m) for m in MODES]
    specs += [P(union, 512, m, seed=43) for m in MODES]
    specs += [P(union, 2048, m, seed=43) for m in MODES]
    specs += [P((d,), b) for b in (128, 2048) for d in TEST_SETS]
    seen, out = set(), []
    for spec in specs:
        if spec["key"] not in seen:
            seen.add(spec["key"])
            out.append(spec)
    return out


# ----------------------------------------------------------------------------- one point


def training_sources(spec: dict, folders: dict[str, str]) -> tuple[dict, dict]:
    """The point's training rows by source name, and the train splits' corpora (the test
    splits reuse them)."""
    from densefit.data.corpus import load_beir
    from densefit.data.readers import read_training_data

    sources, corpora = {}, {}
    for name in spec["train_sets"]:
        if name == "pydoc":
            sources[name], _ = read_training_data(Path(folders[name]) / "train.jsonl")
            continue
        beir = load_beir(folders[name], "train")
        corpora[name] = beir.corpus
        pairs = spec["nfcorpus_pairs"] if name == "nfcorpus" else None
        sources[name] = training_rows(beir, pairs, 0)
    return sources, corpora


def run_point(spec: dict) -> dict:
    """Fine-tune on the point's sources (unless the base) and evaluate each test set; runs in
    the point's child process."""
    model, out = load_point(spec)
    folders = spec["folders"]
    corpora: dict = {}
    if spec["train_sets"]:
        sources, corpora = training_sources(spec, folders)
        data = sources if len(sources) > 1 else next(iter(sources.values()))
        fit = {**spec, "learning_rate": "auto"}
        result, log = fine_tune(
            model, data, fit, memory=spec["memory"], source_batches=spec["source_batches"] or "same"
        )
        out["train"] = {
            "rows": sum(len(rows) for rows in sources.values()),
            "rows_by_source": {name: len(rows) for name, rows in sources.items()},
            "steps": result.steps,
            "rows_per_step_max": max(r["examples"] for r in log),
            "steps_by_source": _steps_by_source(log),
            "learning_rate": result.plan.get("learning_rate"),
            "seconds": round(result.seconds, 1),
            "first_loss": round(log[0]["loss"], 4),
            "final_loss": round(result.final_loss, 4),
            "sources": result.sources,
            "plan": result.plan,
        }
    out["eval"] = {}
    for name in spec["eval_sets"]:
        one = evaluate_test(model, {**spec, "data": folders[name]}, corpora.get(name), {})
        out["eval"][name] = {k: one[k] for k in ("metrics", "eval_s", "eval_docs", "eval_queries")}
    evals = out["eval"].values()
    out["metrics"] = {
        m: round(statistics.fmean(e["metrics"][m] for e in evals), 5) for m in METRICS
    }
    out["eval_s"] = round(sum(e["eval_s"] for e in evals), 1)
    out["eval_docs"] = sum(e["eval_docs"] for e in evals)
    out["peak_rss_mb"] = one["peak_rss_mb"]
    return out


def _steps_by_source(log: list[dict]) -> dict | None:
    """How many steps each source gave (same-source runs; None for mixed or one source)."""
    counts: dict[str, int] = {}
    for record in log:
        if "source" in record:
            counts[record["source"]] = counts.get(record["source"], 0) + 1
    return counts or None


def estimate_s(spec: dict, done: list[dict], args) -> float:
    """Seconds the point should take, from the speed of the finished ones."""
    evals = [r["eval_s"] / r["eval_docs"] for r in done if r.get("eval_docs")]
    trains = [r["train"]["seconds"] / r["train"]["rows"] for r in done if r.get("train")]
    per_doc = max(evals[-3:]) if evals else DEFAULT_RATES["eval_s_per_doc"]
    per_row = max(trains[-3:]) if trains else DEFAULT_RATES["train_s_per_row"]
    seconds = 30 + sum(CORPUS_DOCS[d] for d in spec["eval_sets"]) * per_doc
    rows = {**TRAIN_ROWS, "nfcorpus": args.nfcorpus_pairs}
    return seconds + sum(rows[d] for d in spec["train_sets"]) * per_row


# ----------------------------------------------------------------------------- report


def summarise(records: list[dict]) -> dict:
    """The base, the union runs (seeds pooled) and the alone runs; per test set and mean."""
    base = next((r for r in records if r["kind"] == "base"), None)
    per_set = lambda r, m: {d: r["eval"][d]["metrics"][m] for d in r["eval"]}  # noqa: E731
    out = {"base": base and {m: {**per_set(base, m), "mean": base["metrics"][m]} for m in METRICS}}
    union: dict[tuple, list[dict]] = {}
    for r in records:
        if r["kind"] == "union":
            union.setdefault((r["batch_size"], r["source_batches"]), []).append(r)
    rows = []
    for (batch, mode), runs in sorted(union.items()):
        row = {
            "batch_size": batch,
            "source_batches": mode,
            "seeds": sorted(r["seed"] for r in runs),
        }
        row["steps"] = runs[0]["train"]["steps"]
        row["learning_rate"] = runs[0]["train"]["learning_rate"]
        row["train_s"] = round(statistics.fmean(r["train"]["seconds"] for r in runs), 1)
        for m in METRICS:
            sets = {d: statistics.fmean(per_set(r, m)[d] for r in runs) for d in TEST_SETS}
            row[m] = {d: round(v, 5) for d, v in sets.items()}
            row[m]["mean"] = round(statistics.fmean(r["metrics"][m] for r in runs), 5)
            row[f"{m}_mean_values"] = [r["metrics"][m] for r in runs]
            if base:
                row[f"{m}_vs_base"] = {
                    k: round(v - out["base"][m][k], 5) for k, v in row[m].items()
                }
        rows.append(row)
    out["union"] = rows
    alone: dict[tuple, dict] = {}
    for r in records:
        if r["kind"] == "alone":
            (name,) = r["train_sets"]
            alone[(name, r["batch_size"])] = {m: r["eval"][name]["metrics"][m] for m in METRICS}
    out["alone"] = [{"dataset": d, "batch_size": b, **v} for (d, b), v in sorted(alone.items())]
    out["same_minus_mixed"] = {
        str(batch): round(
            _row(rows, batch, "same")["ndcg@10"]["mean"]
            - _row(rows, batch, "mixed")["ndcg@10"]["mean"],
            5,
        )
        for batch in sorted({r["batch_size"] for r in rows})
        if _row(rows, batch, "same") and _row(rows, batch, "mixed")
    }
    out["target"] = {
        "claim": "same-source >= mixed + 0.01 mean nDCG@10 at batch 512 and above",
        "holds": {b: d >= 0.01 for b, d in out["same_minus_mixed"].items() if int(b) >= 512},
    }
    return out


def _row(rows: list[dict], batch: int, mode: str) -> dict | None:
    return next((r for r in rows if r["batch_size"] == batch and r["source_batches"] == mode), None)


def markdown(summary: dict, meta: dict, skipped: list[str]) -> str:
    base = summary["base"]
    alone = {(a["dataset"], a["batch_size"]): a for a in summary["alone"]}
    lines = [
        "# Same-source vs mixed batches (four training sources)",
        "",
        "all-MiniLM-L6-v2 + MNRL (in-batch negatives, false negatives masked), AdamW, lr "
        "auto (2e-5 x batch / 32, at most 2e-4), 10% warm-up then linear decay, one epoch over "
        f"the union of SciFact train, NFCorpus train ({meta['nfcorpus_pairs']} seeded pairs), "
        "manpages train (no titles) and pydoc; `same` = each step's rows from one source "
        "(proportional interleaving), `mixed` = all rows shuffled together. Evaluated on the "
        "SciFact, NFCorpus and manpages test splits over their full corpora; mean = the mean "
        f"of the three. {meta['max_seq_length']} tokens in training and evaluation. nDCG@10 "
        "(seed 42, or the mean of the seeds listed).",
        "",
        f"Written by `{meta['command']}`.",
        "",
        "| batch | batches | seeds | steps | SciFact | NFCorpus | manpages | mean | mean vs base |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if base:
        b = base["ndcg@10"]
        lines.append(
            f"| - | base model | - | 0 | {b['scifact']:.4f} | {b['nfcorpus']:.4f} | "
            f"{b['manpages']:.4f} | {b['mean']:.4f} | |"
        )
    for r in summary["union"]:
        n = r["ndcg@10"]
        mean = f"{n['mean']:.4f}"
        if len(r["seeds"]) > 1:
            values = r["ndcg@10_mean_values"]
            mean += f" [{min(values):.4f}-{max(values):.4f}]"
        versus = r.get("ndcg@10_vs_base", {}).get("mean")
        lines.append(
            f"| {r['batch_size']:,} | {r['source_batches']} | {','.join(map(str, r['seeds']))} "
            f"| {r['steps']} | {n['scifact']:.4f} | {n['nfcorpus']:.4f} | {n['manpages']:.4f} "
            f"| {mean} | {'' if versus is None else f'{versus:+.4f}'} |"
        )
    lines += ["", "Each dataset trained alone (its own train split), on its own test split:", ""]
    lines += ["| batch | SciFact | NFCorpus | manpages |", "|---|---|---|---|"]
    for batch in sorted({b for _, b in alone}):
        cells = [
            f"{alone[(d, batch)]['ndcg@10']:.4f}" if (d, batch) in alone else "-" for d in TEST_SETS
        ]
        lines.append(f"| {batch:,} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Same minus mixed, mean nDCG@10, by batch: "
        + (
            ", ".join(f"{int(b):,}: {d:+.4f}" for b, d in summary["same_minus_mixed"].items())
            or "not measured"
        )
        + ".",
        "",
        f"Target ({summary['target']['claim']}): "
        + (
            "; ".join(
                f"batch {int(b):,} {'holds' if ok else 'does NOT hold'}"
                for b, ok in summary["target"]["holds"].items()
            )
            or "not measured"
        )
        + ".",
        "",
    ]
    if skipped:
        lines += ["## Not run (time budget)", ""] + [f"- `{k}`" for k in skipped] + [""]
    lines += [f"Environment: {meta.get('environment_line', '')}", ""]
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    panels = ("mean", *TEST_SETS)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    colours = {"same": "#55a868", "mixed": "#c44e52"}
    for ax, panel in zip(axes[0], panels):
        for mode in MODES:
            pts = [r for r in summary["union"] if r["source_batches"] == mode]
            if not pts:
                continue
            xs = [r["batch_size"] for r in pts]
            ys = [r["ndcg@10"][panel] for r in pts]
            ax.plot(xs, ys, marker="o", color=colours[mode], label=f"union, {mode} batches")
            if panel == "mean":
                for r in pts:
                    values = r["ndcg@10_mean_values"]
                    if len(values) > 1:
                        ax.vlines(r["batch_size"], min(values), max(values), color=colours[mode])
        if panel != "mean":
            alone = sorted(
                (a["batch_size"], a["ndcg@10"]) for a in summary["alone"] if a["dataset"] == panel
            )
            if alone:
                ax.plot(*zip(*alone), marker="s", ls="--", color="#4c72b0", label="alone")
        if summary["base"]:
            ax.axhline(summary["base"]["ndcg@10"][panel], color="#999", ls=":", label="base")
        ax.set_xscale("log", base=2)
        ax.set_xticks([128, 512, 2048], ["128", "512", "2,048"])
        ax.set_xlim(90, 2900)
        ax.set_xlabel("batch size")
        ax.set_title(f"{panel} nDCG@10" if panel != "mean" else "mean of 3 test sets, nDCG@10")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("all-MiniLM-L6-v2, 4 training sources: same-source vs mixed batches (lr auto)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(meta: dict, skipped: list[str]) -> dict:
    records = list(finished(JSONL).values())
    summary = summarise(records)
    env = meta.get("environment", {})
    loads = [r["loadavg_before"][0] for r in records if r.get("loadavg_before")]
    meta["environment_line"] = (
        f"torch {env.get('torch')}, {sorted({r.get('threads') for r in records})} torch "
        f"thread(s) per point, {env.get('cpu_count')}-CPU machine shared with other jobs "
        f"(1-min load average at point start {min(loads, default=0):.1f}-"
        f"{max(loads, default=0):.1f}): times are indicative only; metrics do not depend on them."
    )
    payload = {"meta": meta, "summary": summary, "skipped": skipped, "points": records}
    text = markdown(summary, meta, skipped)
    fields = ["kind", "train_sets", "source_batches", "batch_size", "seed", "steps"]
    fields += [f"{d}_{m}" for d in TEST_SETS for m in METRICS]
    fields += ["ndcg@10", "recall@100", "learning_rate", "train_s", "eval_s", "wall_s"]
    fields += ["peak_rss_mb", "threads", "load_1min_before", "key"]
    write_report(
        RESULTS,
        "sources",
        payload,
        text,
        fields,
        sorted(records, key=lambda r: r["key"]),
        lambda r: {
            "kind": r["kind"],
            "train_sets": "+".join(r["train_sets"]),
            "source_batches": r["source_batches"],
            "learning_rate": (r.get("train") or {}).get("learning_rate"),
            **{f"{d}_{m}": r["eval"][d]["metrics"][m] for d in r["eval"] for m in METRICS},
        },
    )
    plot(summary, RESULTS / "sources.png")
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
    parser.add_argument("--deadline-min", type=float, default=200.0)
    parser.add_argument("--only", default=None, help="run only keys containing this text")
    parser.add_argument("--max-points", type=int, default=None, help="stop after N points")
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
        "nfcorpus_pairs": args.nfcorpus_pairs,
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
    folders = {d: str(dataset_folder(d, datasets, work)) for d in TEST_SETS}
    folders["pydoc"] = str(datasets / "pydoc")
    print(f"{len(specs) - len(todo)} of {len(specs)} points done; {len(todo)} to run", flush=True)
    started = time.perf_counter()
    run_now, skipped, ran = list(done.values()), [], 0
    for spec in todo:
        estimate = estimate_s(spec, run_now, args)
        if time.perf_counter() - started + estimate > args.deadline_min * 60 or (
            args.max_points is not None and ran >= args.max_points
        ):
            print(f"skip {spec['key']}: ~{estimate / 60:.0f} min would pass the deadline")
            skipped.append(spec["key"])
            continue
        print(
            f"run  {spec['key']} (~{estimate / 60:.1f} min, load {os.getloadavg()[0]:.1f}, "
            f"{time.strftime('%H:%M:%S')})",
            flush=True,
        )
        record = run_grid_point(
            __file__, {**spec, "folders": folders}, args.threads, JSONL,
            env={"TRANSFORMERS_OFFLINE": "1"},
        )  # fmt: skip
        ran += 1
        if record["status"] == "ok":
            run_now.append(record)
    print(f"total {round(time.perf_counter() - started)}s", flush=True)
    report(meta, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
