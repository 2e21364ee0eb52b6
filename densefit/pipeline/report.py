"""The report of ``densefit run``: report.json (everything), report.md (to read), report.html
(the same, with the per-query view, in one file that opens from disk), PNG plots, and
``eval/per_query.jsonl`` (base and trained lined up per query: :mod:`densefit.comparison`).

Plots (matplotlib, Agg backend) go to ``OUTPUT/plots/``:

- ``training.png``  training loss and in-batch accuracy against the step;
- ``resources.png`` peak RSS (and CUDA peak, on CUDA) against the step with the memory budget
  and the planner's predicted peak, and examples/s against the step;
- ``metrics.png``   base vs trained for every metric;
- ``eval.png``      with evaluation during training (``train.eval_every`` ...): the metrics
  on ``train.eval_split`` against the step, from step 0 (the base model), best step marked.

The report reads plain data: the output folder, the run config and the stage markers
(``OUTPUT/stages/<name>.json`` as dicts). It imports nothing from :mod:`densefit.pipeline.stages`;
the stages import it.
"""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import yaml

from densefit._version import __version__
from densefit.comparison import QueryComparison, compare_queries
from densefit.config.run import RunConfig
from densefit.config.shared import model_or_default
from densefit.data.corpus import find_beir_file, iter_corpus, read_qrels, read_queries
from densefit.evaluate import EvalResult, compare_results, format_p_value
from densefit.pipeline.report_html import write_html

__all__ = ["describe_eval", "load_eval_results", "read_eval_log", "read_train_log", "write_report"]


def describe_eval(info: dict, n_queries: int) -> str:
    """One line: which split, how many queries and documents, full corpus or subsample."""
    corpus = info.get("corpus", {})
    what = (
        f"full corpus, {corpus.get('documents')} documents"
        if corpus.get("kind") == "full"
        else f"subsample of the corpus: {corpus.get('documents')} of {corpus.get('corpus_documents')}"
        f" documents ({corpus.get('judged_documents')} judged + {corpus.get('distractors')} "
        f"random distractors, seed {corpus.get('sample_seed')})"
    )
    return (
        f"{info.get('split')} split: {n_queries} queries; {what}; "
        f"max_seq_length {info.get('max_seq_length')}"
    )


def load_eval_results(output: str | os.PathLike) -> list:
    """The base and trained :class:`~densefit.evaluate.EvalResult` saved in ``output/eval``."""

    return [
        EvalResult.from_dict(json.loads((Path(output) / "eval" / f"{name}.json").read_text()))
        for name in ("base", "trained")
    ]


def _log_records(path: str | os.PathLike) -> list[dict]:
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_train_log(path: str | os.PathLike) -> list[dict]:
    """The step records of a ``train_log.jsonl`` (a torn last line is ignored)."""
    return [r for r in _log_records(path) if "eval" not in r]


def read_eval_log(path: str | os.PathLike) -> list[dict]:
    """The evaluation records of a ``train_log.jsonl``: ``{"step", "eval": {metric: value},
    "best_step", ...}`` (see :mod:`densefit.training.evaluation`)."""
    return [r for r in _log_records(path) if isinstance(r.get("eval"), dict)]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _train_summary(result: dict, log: list[dict]) -> dict:
    # The last 10% of the steps (at least 3), weighted by rows: the last batch may be small.
    tail = log[-max(3, len(log) // 10) :] if log else []
    rows = sum(r.get("examples") or 0 for r in tail)
    final_accuracy = None
    if rows and all(r.get("in_batch_accuracy") is not None for r in tail):
        final_accuracy = sum(r["in_batch_accuracy"] * r["examples"] for r in tail) / rows
    return {
        "rows": result.get("rows"),
        "steps": result.get("steps"),
        "examples": result.get("examples"),
        "final_loss": result.get("final_loss"),
        "last_step_rows": log[-1].get("examples") if log else None,
        "train_seconds": result.get("train_seconds"),
        "resumed_from_step": result.get("resumed_from_step"),
        "skipped_nonfinite": result.get("skipped_nonfinite"),
        "mean_examples_per_s": _round(_mean(r.get("examples_per_s") for r in log)),
        "peak_rss_mb": max((r.get("peak_rss_mb") or 0 for r in log), default=None),
        "cuda_peak_mb": max((r.get("cuda_peak_mb") or 0 for r in log), default=None) or None,
        "first_in_batch_accuracy": log[0].get("in_batch_accuracy") if log else None,
        "final_in_batch_accuracy": _round(final_accuracy),
        "final_in_batch_accuracy_steps": len(tail),
        "mean_padding_efficiency": _round(_mean(r.get("padding_efficiency") for r in log)),
    }


def _round(value, digits: int = 4):
    return None if value is None else round(value, digits)


def _memory_plan(plan: dict) -> dict:
    mib = 2**20
    out = {
        "strategy": plan.get("strategy"),
        "chosen_by": plan.get("chosen_by"),
        "chunk_size": plan.get("chunk_size"),
        "token_budget": plan.get("token_budget"),
        "loss_block_size": plan.get("loss_block_size"),
        "keep_graphs": plan.get("keep_graphs"),
        "cpu_allocator": plan.get("cpu_allocator"),
        "reason": plan.get("reason"),
    }
    for key in ("budget_bytes", "predicted_peak_bytes", "static_bytes"):
        if plan.get(key) is not None:
            out[key.replace("_bytes", "_mib")] = round(plan[key] / mib, 1)
    return out


def _data_counts(config: RunConfig, markers: dict) -> dict:

    base = markers["eval_base"]["result"]
    corpus = base["info"]["corpus"]
    out = {
        "train_rows": markers["train"]["result"]["rows"],
        "train_source": markers["train"]["result"]["source"],
        "eval_split": config.eval.split_name,
        "eval_queries": base["n_queries"],
        "eval_queries_without_results": len(base.get("missing_queries", [])),
        "eval_documents_searched": corpus["documents"],
        "corpus_documents": corpus["corpus_documents"],
        "eval_corpus": corpus["kind"],
    }
    if corpus["kind"] == "subsample":
        out.update(
            judged_documents=corpus["judged_documents"],
            distractors=corpus["distractors"],
            sample_seed=corpus["sample_seed"],
        )
    if "mine" in markers:
        mined = markers["mine"]["result"]
        out.update(
            mined_rows=mined["rows"],
            mined_negatives=mined["negatives"],
            mined_rows_short=mined["rows_short"],
            mining_method=mined["method"],
        )
    if config.train_data is None:  # a held-out split of the same folder: any query in both?
        folder = Path(config.data) / "qrels"
        try:
            train_q = set(read_qrels(folder / f"{config.train_split}.tsv"))
            eval_q = set(read_qrels(folder / f"{config.eval.split_name}.tsv"))
            out["eval_queries_also_in_training"] = len(train_q & eval_q)
        except (ValueError, OSError):  # bad rows were skipped by the stages (on_bad_row: skip)
            out["eval_queries_also_in_training"] = None
    return out


def _environment() -> dict:

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "densefit": __version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_at_report": load,
    }


# ----------------------------------------------------------------------------- plots


def _save_step_plots(fig, axes, path: Path) -> None:
    """Grid, integer step ticks, tight layout; save and close."""
    import matplotlib.pyplot as plt  # the optional extra `report`
    from matplotlib.ticker import MaxNLocator  # the optional extra `report`

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_memory(ax, log: list[dict], plan: dict) -> None:
    """The memory panel: peak RSS (and CUDA's peak) per step under the budget the planner
    planned for, with its predicted peak (``plan``: :func:`_memory_plan`'s, in MiB)."""

    def series(key):
        pairs = [(r["step"], r[key]) for r in log if r.get(key) is not None]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    ax.plot(*series("peak_rss_mb"), marker=".", label="peak RSS (process)")
    if any(r.get("cuda_peak_mb") is not None for r in log):
        ax.plot(*series("cuda_peak_mb"), marker=".", label="CUDA peak allocated")
    if plan.get("budget_mib"):
        ax.axhline(plan["budget_mib"], color="tab:red", linestyle="--",
                   label=f"budget {plan['budget_mib']:,.0f} MiB")  # fmt: skip
    if plan.get("predicted_peak_mib"):
        ax.axhline(plan["predicted_peak_mib"], color="tab:gray", linestyle=":",
                   label=f"predicted peak {plan['predicted_peak_mib']:,.0f} MiB")  # fmt: skip
    ax.set(title="memory", xlabel="step", ylabel="MiB")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def _plots(
    out: Path, log: list[dict], metrics: dict, names: tuple[str, str], caption: str, plan: dict
) -> dict:
    import matplotlib  # the optional extra `report`

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # the optional extra `report`

    folder = out / "plots"
    folder.mkdir(parents=True, exist_ok=True)

    def series(key):
        pairs = [(r["step"], r[key]) for r in log if r.get(key) is not None]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(*series("loss"), marker=".", color="tab:blue")
    ax1.set(title="training loss", xlabel="step", ylabel="loss")
    ax2.plot(*series("in_batch_accuracy"), marker=".", color="tab:green")
    ax2.set(
        title="in-batch accuracy (own positive ranked first)",
        xlabel="step",
        ylabel="accuracy",
        ylim=(0, 1.02),
    )
    _save_step_plots(fig, (ax1, ax2), folder / "training.png")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    _draw_memory(ax1, log, plan)
    ax2.plot(*series("examples_per_s"), marker=".", color="tab:orange")
    ax2.set(title="throughput", xlabel="step", ylabel="examples / s")
    _save_step_plots(fig, (ax1, ax2), folder / "resources.png")

    labels = list(metrics)
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(labels) + 2), 3.8))
    width = 0.38
    x = range(len(labels))
    for offset, name, color in (
        (-width / 2, names[0], "tab:gray"),
        (width / 2, names[1], "tab:blue"),
    ):
        values = [metrics[m][name] for m in labels]
        bars = ax.bar([i + offset for i in x], values, width, label=name, color=color)
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set(title="base vs trained", ylabel="score", ylim=(0, 1.22))
    fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=7, wrap=True)
    ax.legend(loc="upper center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(folder / "metrics.png", dpi=110)
    plt.close(fig)
    return {
        "training": "plots/training.png",
        "resources": "plots/resources.png",
        "metrics": "plots/metrics.png",
    }


def _eval_plot(out: Path, evals: list[dict], metric: str | None) -> str | None:
    """plots/eval.png: each metric against the step; the best step of ``metric`` marked."""
    if not evals:
        return None
    import matplotlib  # the optional extra `report`

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # the optional extra `report`

    fig, ax = plt.subplots(figsize=(7, 3.8))
    steps = [r["step"] for r in evals]
    for name in evals[0]["eval"]:
        ax.plot(steps, [r["eval"].get(name) for r in evals], marker=".", label=name,
                linewidth=2.2 if name == metric else 1.0)  # fmt: skip
    best = _best(evals, metric)
    if best is not None:
        ax.axvline(best["step"], color="gray", linestyle="--", linewidth=0.8)
        ax.annotate(f"best {metric} (step {best['step']})", (best["step"], 0.02), fontsize=8)
    ax.set(title="evaluation during training", xlabel="step", ylabel="score", ylim=(0, 1.02))
    ax.legend(fontsize=7, loc="lower right")
    _save_step_plots(fig, (ax,), out / "plots" / "eval.png")
    return "plots/eval.png"


def _best(evals: list[dict], metric: str | None) -> dict | None:
    """The evaluation the run picked as best (its last record's ``best_step``)."""
    step = evals[-1].get("best_step") if evals else None
    return next((r for r in evals if r["step"] == step), None) if metric else None


def _during_training(evals: list[dict], metric: str, kept: bool) -> dict | None:
    """report.json's summary of the evaluations during training: base, best, final."""
    if not evals:
        return None
    best = _best(evals, metric)
    return {
        "metric": metric,
        "evaluations": len(evals),
        "base": evals[0] if evals[0]["step"] == 0 else None,
        "best": best,
        "final": evals[-1],
        "kept_best": kept,
        "stopped_early": bool(evals[-1].get("stop")),
    }


# ----------------------------------------------------------------------------- report


def write_report(
    out: str | os.PathLike,
    config: RunConfig,
    markers: dict[str, dict],
    *,
    ran: Sequence[str],
    stages: Sequence[str],
) -> dict:
    """Write report.json, report.md and the plots from the stage markers; return the JSON.

    ``markers`` maps a stage name to its marker dict; ``stages`` lists the stages before the
    report in run order (a stage without a marker is reported as off); ``ran`` names those
    that ran in this invocation (the others were skipped as finished).
    """

    out = Path(out)
    evals = dict(zip(("base", "trained"), load_eval_results(out)))
    metrics = _metrics(compare_results(evals["base"], evals["trained"]))
    log = read_train_log(out / "model" / "train_log.jsonl")
    evals_during = read_eval_log(out / "model" / "train_log.jsonl")
    train_config = config.train
    train_result = markers["train"]["result"]
    stage_rows = _stage_rows(markers, ran, stages)
    evaluated = describe_eval(evals["base"].info, evals["base"].n_queries)
    report = {
        "created_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "output": str(out),
        "base_model": model_or_default(config.model),
        "config": config.to_dict(),
        "stages": stage_rows,
        "stage_seconds_total": round(sum(s.get("seconds", 0) for s in stage_rows.values()), 1),
        "data": _data_counts(config, markers),
        "memory_plan": _memory_plan(train_result.get("plan", {})),
        "train": _train_summary(train_result, log),
        "evaluated_on": evaluated,
        "eval": {name: r.to_dict() for name, r in evals.items()},
        "metrics": metrics,
        "eval_during_training": _during_training(
            evals_during, train_config.eval_metric, train_config.keep_best
        ),
        "environment": _environment(),
    }
    report["plots"] = _plots(
        out, log, metrics, ("base", "trained"), evaluated, report["memory_plan"]
    )
    eval_plot = _eval_plot(out, evals_during, train_config.eval_metric)
    if eval_plot:
        report["plots"]["eval"] = eval_plot
    comparison = _per_query(config, evals["base"], evals["trained"])
    texts = {}
    if comparison is not None:
        comparison.write_jsonl(out / "eval" / "per_query.jsonl")
        report["per_query"] = {**comparison.summary, "file": "eval/per_query.jsonl"}
        texts = comparison.texts
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    markdown = _markdown(report, yaml.safe_dump(report["config"], sort_keys=False), texts)
    (out / "report.md").write_text(markdown)
    write_html(out / "report.html", markdown, comparison, folder=out)
    return report


def _per_query(config: RunConfig, base: EvalResult, trained: EvalResult) -> QueryComparison | None:
    """Base and trained lined up per query, with the query and document texts of the data
    folder; None for evaluations saved without their rankings."""
    if not (base.rankings and trained.rankings):
        return None
    with warnings.catch_warnings():  # the evaluation warned about the files already
        warnings.simplefilter("ignore")
        try:
            queries = read_queries(find_beir_file(config.data, "queries"), on_bad_row="skip")
        except (OSError, ValueError):
            queries = {}
        comparison = compare_queries(
            base, trained, metric=next(iter(base.metrics)), queries=queries
        )
        wanted = comparison.document_ids()
        try:
            corpus = iter_corpus(config.data, on_bad_row="skip")
            comparison.add_texts({doc.id: doc.text for doc in corpus if doc.id in wanted})
        except (OSError, ValueError):
            pass  # the report names the documents by id
    return comparison


def _metrics(comparison: dict) -> dict:
    """The paired comparison of every metric, rounded for the report."""
    return {
        m: {
            "base": round(c["base"], 6),
            "trained": round(c["trained"], 6),
            "delta": round(c["delta"], 6),
            "wins": c["wins"],
            "losses": c["losses"],
            "ties": c["ties"],
            "p_value": c["p_value"],  # unrounded: printed by format_p_value, as the console does
        }
        for m, c in comparison.items()
    }


def _stage_rows(markers: dict, ran: Sequence[str], stages: Sequence[str]) -> dict:
    """One row per stage: off, ran, skipped or reused, with its times."""
    rows = {}
    for name in stages:
        if name not in markers:
            rows[name] = {"status": "off"}
            continue
        m = markers[name]
        status = "ran" if name in ran else "skipped (finished earlier, inputs unchanged)"
        if m["result"].get("reused_from"):
            status = f"reused from {m['result']['reused_from']}"
        rows[name] = {
            "status": status,
            "seconds": m["seconds"],
            "started_at": m["started_at"],
            "finished_at": m["finished_at"],
            "load_average": m.get("load_average"),
        }
    return rows


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _markdown(r: dict, config_yaml: str, texts: Mapping[str, str]) -> str:
    """report.md: one section per piece, in reading order."""
    pieces = (
        _md_summary(r),
        _md_results(r),
        _md_per_query(r.get("per_query"), texts),
        _md_training(r),
        _md_during_training(r.get("eval_during_training")),
        _md_memory_plan(r["memory_plan"]),
        _md_stages(r),
        _md_data(r["data"]),
        _md_environment(r["environment"]),
        ["## Config", "", "```yaml", config_yaml.rstrip(), "```"],
    )
    return "\n\n".join("\n".join(lines) for lines in pieces) + "\n"


def _md_summary(r: dict) -> list[str]:
    """Title, what was trained on, what was evaluated, and the warnings that qualify it."""
    d = r["data"]
    negatives = (
        f", with {d['mined_negatives']} hard negatives mined by {d['mining_method']}"
        if "mined_rows" in d
        else ", in-batch negatives only"
    )
    lines = [
        f"# densefit run: {Path(r['config']['data']).name}",
        "",
        f"Base model `{r['base_model']}`, fine-tuned on {d['train_rows']} training rows "
        f"({d['train_source']}){negatives}.",
        "",
        f"Evaluated on: {r['evaluated_on']}.",
    ]
    if d["eval_corpus"] == "subsample":
        lines += [
            "",
            f"**Subsample**: the search ran over {d['eval_documents_searched']} of the "
            f"{d['corpus_documents']} documents (every judged document + {d['distractors']} random "
            "distractors), so the numbers are higher than on the full corpus and do not compare "
            "with published results; base and trained saw exactly the same documents.",
        ]
    if d.get("eval_queries_also_in_training"):
        lines += [
            "",
            f"**Warning**: {d['eval_queries_also_in_training']} evaluation queries are also in "
            f"the training split `{r['config']['train_split']}`: the split is not held out.",
        ]
    return lines


def _md_results(r: dict) -> list[str]:
    """The base / trained / delta table with the paired test, and the metrics plot."""
    lines = [
        "## Results",
        "",
        "| metric | base | trained | delta | wins / losses / ties | p (paired) |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in r["metrics"].items():
        lines.append(
            f"| {name} | {m['base']:.4f} | {m['trained']:.4f} | {m['delta']:+.4f} | "
            f"{m['wins']} / {m['losses']} / {m['ties']} | {format_p_value(m['p_value'])} |"
        )
    return lines + ["", "![base vs trained](plots/metrics.png)"]


def _md_per_query(s: dict | None, texts: Mapping[str, str], top: int = 5) -> list[str]:
    """Queries better / same / worse, the rank-change counts, the largest wins and losses
    and the trained model's top hits to review (:mod:`densefit.comparison`)."""
    if not s:
        return []
    lines = [
        "## Per query",
        "",
        f"On {s['metric']}, {s['better']} of {s['queries']} queries got better, {s['same']} "
        f"stayed the same and {s['worse']} got worse. Every query (ranks, scores and top hits "
        f"of both models) is in `{s['file']}`; `report.html` shows them.",
        "",
        "Rank of the best relevant document, base -> trained (k = "
        f"{s['depth']} retrieved per query):",
        "",
        "| " + " | ".join(s["rank_changes"]) + " |",
        "|" + "---|" * len(s["rank_changes"]),
        "| " + " | ".join(str(n) for n in s["rank_changes"].values()) + " |",
    ]
    for title, rows in (("Largest wins", s["wins"]), ("Largest losses", s["losses"])):
        if not rows:
            continue
        lines += [
            "",
            f"### {title}",
            "",
            "| query | base | trained | delta | best rank (base -> trained) | trained's top hit |",
            "|---|---|---|---|---|---|",
        ]
        for row in rows[:top]:
            hit = row["new_top"]
            lines.append(
                f"| {_md_query(row)} | {row['base']:.4f} | {row['new']:.4f} | "
                f"{row['delta']:+.4f} | {_fmt(row['base_best_rank'])} -> "
                f"{_fmt(row['new_best_rank'])} | {_md_doc(hit, texts)} |"
            )
    review = s["possible_missing_labels"]
    if review:
        lines += [
            "",
            "### Top hits to review (possible missing labels)",
            "",
            f"The trained model's top hit is unjudged and scores within {s['close']:.0%} of the "
            "best judged relevant document: often a relevant document nobody labelled.",
            "",
            "| query | unjudged top hit (score) | best judged (rank, score) |",
            "|---|---|---|",
        ]
        for row in review[:top]:
            best = row["relevant"]
            lines.append(
                f"| {_md_query(row)} | {_md_doc(row['hit'], texts)} ({row['hit']['score']:.4f}) | "
                f"`{best['id']}` ({best['new_rank']}, {best['new_score']:.4f}) |"
            )
        if len(review) > top:
            more = len(review) - top
            lines += ["", f'{more} more: `{s["file"]}`, or report.html\'s "to review" filter.']
    return lines


def _md_query(row: dict) -> str:
    return f"`{row['query_id']}` {_md_cell(row.get('query') or '')}".strip()


def _md_doc(hit: dict | None, texts: Mapping[str, str]) -> str:
    if hit is None:
        return "-"
    return f"`{hit['id']}` {_md_cell(texts.get(hit['id'], ''))}".strip()


def _md_cell(text: str, width: int = 90) -> str:
    """``text`` fit for a markdown table cell: one line, pipes escaped, cut at ``width``."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def _md_training(r: dict) -> list[str]:
    """The training summary row, the resume note and the two step plots."""
    t = r["train"]
    lines = [
        "## Training",
        "",
        "| steps | examples | final loss (last step) | in-batch accuracy (first step -> "
        f"last {t['final_in_batch_accuracy_steps']} steps) | "
        "mean examples/s | peak RSS MiB | train seconds |",
        "|---|---|---|---|---|---|---|",
        f"| {t['steps']} | {t['examples']} | {_fmt(t['final_loss'])} "
        f"({t['last_step_rows']} rows) | "
        f"{_fmt(t['first_in_batch_accuracy'], 3)} -> {_fmt(t['final_in_batch_accuracy'], 3)} | "
        f"{_fmt(t['mean_examples_per_s'], 1)} | {_fmt(t['peak_rss_mb'], 0)} | "
        f"{_fmt(t['train_seconds'], 1)} |",
    ]
    if t.get("resumed_from_step"):
        lines += [
            "",
            f"Resumed after an interruption from the checkpoint of step {t['resumed_from_step']}.",
        ]
    return lines + [
        "",
        "![loss and in-batch accuracy](plots/training.png)",
        "",
        "![memory and throughput](plots/resources.png)",
    ]


def _md_during_training(d: dict | None) -> list[str]:
    """Evaluation during training: base, best and final step, and the curve."""
    if not d:
        return []
    columns = [("base (step 0)", d["base"]), (f"best (step {d['best']['step']})", d["best"])]
    columns = [c for c in columns if c[1] is not None]
    columns.append((f"final (step {d['final']['step']})", d["final"]))
    lines = [
        "## Evaluation during training",
        "",
        f"{d['evaluations']} evaluations on `train.eval_split`; the best step is picked by "
        f"{d['metric']}"
        + (", and the saved model is that step's (`keep_best`)" if d["kept_best"] else "")
        + ("; training stopped early (patience)" if d["stopped_early"] else "")
        + ".",
        "",
        "| metric | " + " | ".join(name for name, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for metric in d["final"]["eval"]:
        values = " | ".join(_fmt(rec["eval"].get(metric)) for _, rec in columns)
        lines.append(f"| {metric} | {values} |")
    return lines + ["", "![evaluation during training](plots/eval.png)"]


def _md_memory_plan(p: dict) -> list[str]:
    """One sentence: the strategy, its chunking, and the planner's prediction and reason."""
    parts = [f"Strategy **{p['strategy']}** (chosen by {p['chosen_by']})"]
    if p.get("chunk_size"):
        parts.append(f", chunks of {p['chunk_size']} rows")
    if p.get("token_budget"):
        parts.append(f" / {p['token_budget']} padded tokens")
    if str(p["strategy"]).startswith("cache") and p.get("keep_graphs"):
        parts.append(f", {p['keep_graphs']} chunk graph(s) kept from the first pass")
    if p.get("cpu_allocator"):
        parts.append(f", CPU memory from {p['cpu_allocator']}'s malloc")
    if p.get("predicted_peak_mib"):
        parts.append(
            f"; predicted peak {p['predicted_peak_mib']:.0f} MiB of a {p['budget_mib']:.0f} MiB "
            f"budget (static: {p['static_mib']:.0f} MiB)"
        )
    if p.get("reason"):
        parts.append(f": {p['reason']}")
    return ["### Memory plan", "", "".join(parts) + "."]


def _md_stages(r: dict) -> list[str]:
    """Each stage's status, time and load average, and the total."""
    lines = [
        "## Stages",
        "",
        "| stage | status | seconds | finished | load average (start/end) |",
        "|---|---|---|---|---|",
    ]
    for name, s in r["stages"].items():
        load = s.get("load_average") or {}
        lines.append(
            f"| {name} | {s['status']} | {_fmt(s.get('seconds'), 1)} | "
            f"{s.get('finished_at', '-')} | {load.get('start', '-')} / {load.get('end', '-')} |"
        )
    return lines + ["", f"Stage time in all: {r['stage_seconds_total']:.0f} s."]


def _md_data(d: dict) -> list[str]:
    """The data counts as a two-column table."""
    return ["## Data", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in d.items()]


def _md_environment(env: dict) -> list[str]:
    """Versions, threads, CPUs, GPU and the load average when the report was written."""
    return [
        "## Environment",
        "",
        f"densefit {env['densefit']}, torch {env['torch']} ({env['torch_threads']} thread(s), "
        f"{env['cpus']} CPUs{', ' + env['cuda'] if env['cuda'] else ''}), Python {env['python']}; "
        f"load average at the report: {env['load_average_at_report']}.",
    ]
