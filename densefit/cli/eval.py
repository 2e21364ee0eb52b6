"""``densefit eval``: nDCG, MRR, Recall and MAP of one model, or two side by side.

Two ways in: ``--dataset BEIR_DIR --model M [--compare M2]`` indexes the corpus with each
model and scores its split; ``--store DIR --queries FILE --qrels FILE`` scores an existing
store. Rows skipped with ``--on-bad-row skip`` are listed by ``file:line`` on stderr, in the
table's caption and under ``skipped_rows`` in ``--json``, as ``train``, ``mine`` and
``index`` list theirs.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from densefit.cli.common import (
    BACKEND_OPTION,
    DOCUMENT_PROMPT_OPTION,
    ENCODE_BATCH_OPTION,
    ON_BAD_ROW_OPTION,
    PROGRESS_OPTION,
    QUERY_PROMPT_OPTION,
    OnBadRow,
    device_option,
    err,
    fail,
    warn,
)
from densefit.evaluate import DEFAULT_METRICS

__all__ = ["evaluate"]

out = Console(highlight=False)


def evaluate(
    dataset: Path | None = typer.Option(
        None, "--dataset", "-d", help="BEIR folder to index and evaluate."
    ),
    split: str = typer.Option("test", help="qrels split of the BEIR folder."),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Model (required with --dataset)."
    ),
    compare: str | None = typer.Option(
        None, "--compare", help="A second model (e.g. the fine-tuned one) evaluated side by side."
    ),
    store: Path | None = typer.Option(
        None,
        "--store",
        "-s",
        help="With --queries/--qrels: the store to search. With --dataset: keep the index here.",
    ),
    queries: Path | None = typer.Option(None, "--queries", help="queries.jsonl (_id, text)."),
    qrels: Path | None = typer.Option(
        None, "--qrels", help="qrels TSV (query-id, corpus-id, score)."
    ),
    metrics: str = typer.Option(",".join(DEFAULT_METRICS), help="Comma-separated metrics."),
    top_k: int | None = typer.Option(
        None, help="Documents retrieved per query (default: largest cutoff)."
    ),
    backend: str = BACKEND_OPTION,
    batch_size: int = ENCODE_BATCH_OPTION,
    on_bad_row: OnBadRow = ON_BAD_ROW_OPTION,
    output: Path | None = typer.Option(None, "--output", "-o", help="Also write the JSON here."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    per_query: bool = typer.Option(False, help="Include per-query scores in the JSON."),
    progress: bool = PROGRESS_OPTION,
    query_prompt: str | None = QUERY_PROMPT_OPTION,
    document_prompt: str | None = DOCUMENT_PROMPT_OPTION,
    dims: str | None = typer.Option(
        None,
        "--dims",
        metavar="D1,D2,...",
        help="Matryoshka: report the metrics at each of these sizes (every vector cut to its "
        "first D coordinates, re-normalised), e.g. 384,256,128,64; the corpus is embedded once.",
        rich_help_panel="Embedding",
    ),
    device: str = device_option(),
) -> None:
    """nDCG@10, MRR@10, Recall@10/100, MAP@100 (pytrec_eval) on a BEIR split or a store.

    Examples:

      densefit eval --dataset datasets/scifact --model all-MiniLM-L6-v2 --compare runs/tuned

      densefit eval --store stores/scifact --queries q.jsonl --qrels qrels/test.tsv

      densefit eval --dataset datasets/scifact --model runs/mrl --dims 384,256,128,64
    """
    from densefit.losses.matryoshka import check_dims
    from densefit.models import resolve_device

    metric_list = _metric_list(metrics)
    options = dict(metrics=metric_list, top_k=top_k, backend=backend, batch_size=batch_size)
    try:
        options["dims"] = None if dims is None else check_dims(dims)
    except ValueError as exc:
        raise ValueError(f"--dims {exc}") from None
    options["prompts"] = {"query_prompt": query_prompt, "document_prompt": document_prompt}
    options["device"] = resolve_device(device)
    if dataset is not None:
        _check_dataset_options(queries, qrels, model, compare, store)
        results = _evaluate_dataset(
            dataset,
            split,
            [model] + ([compare] if compare else []),
            store,
            on_bad_row=on_bad_row.value,
            progress=progress,
            **options,
        )
        title = f"{dataset} ({split})"
    else:
        _check_store_options(store, queries, qrels, compare)
        results = _evaluate_store(
            store,
            queries,
            qrels,
            model,
            on_bad_row=on_bad_row.value,
            progress=progress,
            **options,
        )
        title = f"{store} ({qrels.name})"
    _print_results(results, title, as_json=as_json, per_query=per_query, output=output)


def _metric_list(metrics: str) -> list[str]:
    """The comma-separated metrics, each checked (ValueError naming the supported ones)."""
    from densefit.evaluate import parse_metric

    metric_list = [m.strip() for m in metrics.split(",") if m.strip()]
    for metric in metric_list:
        parse_metric(metric)
    return metric_list


def _check_dataset_options(queries, qrels, model, compare, store) -> None:
    if queries is not None or qrels is not None:
        fail("--dataset brings its own queries and qrels: drop --queries/--qrels")
    if model is None:
        fail("--dataset needs --model (the model to evaluate)")
    if compare is not None and compare == model:
        fail("--compare names the same model as --model; give the other model")
    if compare is not None and store is not None:
        fail("--store keeps the index of one model; drop it when using --compare")


def _check_store_options(store, queries, qrels, compare) -> None:
    if store is None or queries is None or qrels is None:
        fail("give either --dataset BEIR_DIR --model M, or --store DIR --queries FILE --qrels FILE")
    if compare is not None:
        fail(
            "--compare needs --dataset (each model needs its own index); or run eval once per store"
        )


def _evaluate_dataset(
    dataset: Path,
    split: str,
    models: list[str],
    store: Path | None,
    *,
    on_bad_row: str,
    progress: bool,
    metrics,
    top_k,
    backend,
    batch_size,
    dims,
    prompts,
    device,
) -> list:
    """Index the BEIR corpus with each model (into ``store`` if given) and score ``split``
    (at each Matryoshka size of ``dims``, when given)."""
    from densefit.data.corpus import load_beir
    from densefit.evaluate import evaluate_beir, evaluate_dims
    from densefit.models import load_model
    from densefit.retrieval.encode import configure_model

    beir = load_beir(dataset, split, on_bad_row=on_bad_row)
    _warn_skipped(beir.report)
    results = []
    for name, label in _labels(models).items():
        if progress:
            err.print(f"evaluating {name} on {dataset} ({split})", highlight=False)
        model = configure_model(load_model(name, device=device), **prompts)
        options = dict(metrics=metrics, top_k=top_k, batch_size=batch_size, name=label)
        options.update(store_dir=store, backend=backend, show_progress=progress)
        if dims:
            found = evaluate_dims(model, beir, dims, split, **options)
        else:
            found = [evaluate_beir(model, beir, split, **options)]
        for result in found:
            result.info["dataset"] = str(dataset)
        results += found
    return results


def _evaluate_store(
    store: Path,
    queries: Path,
    qrels: Path,
    model: str | None,
    *,
    on_bad_row: str,
    progress: bool,
    metrics,
    top_k,
    backend,
    batch_size,
    dims,
    prompts,
    device,
) -> list:
    """Score an existing store with the queries and qrels files (at each size of ``dims``)."""
    from densefit.data.types import ReadReport
    from densefit.evaluate import evaluate_store, evaluate_store_at, load_queries_and_qrels
    from densefit.retrieval.index.searching import model_for_store
    from densefit.retrieval.index.store import LocalDocumentStore

    report = ReadReport(f"{queries}, {qrels}")
    query_texts, judgments = load_queries_and_qrels(
        queries, qrels, on_bad_row=on_bad_row, report=report
    )
    _warn_skipped(report)
    with LocalDocumentStore(store, backend=backend) as document_store:
        name = model or document_store.model_name
        st_model = model_for_store(document_store, model, device=device, **prompts)
        options = dict(
            metrics=metrics, top_k=top_k, batch_size=batch_size, show_progress=progress, name=name
        )
        if dims:
            results = [
                evaluate_store_at(document_store, st_model, d, query_texts, judgments, **options)
                for d in dims
            ]
        else:
            results = [evaluate_store(document_store, st_model, query_texts, judgments, **options)]
    for result in results:
        result.skipped_rows = list(report.skipped)
    return results


def _warn_skipped(report) -> None:
    if report.n_skipped:
        err.print(
            f"[yellow]skipped rows:[/] {report.summary(limit=report.n_skipped)}",
            highlight=False,
            soft_wrap=True,
        )


def _print_results(results: list, title: str, *, as_json: bool, per_query: bool, output) -> None:
    """The table (or JSON) on stdout, the JSON file, and warnings about unscored queries."""
    from densefit.evaluate import compare_results, format_table

    payload = {
        "results": [r.to_dict(per_query=per_query) for r in results],
        "comparison": compare_results(*results) if len(results) == 2 else None,
    }
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    for result in results:
        if result.missing_queries:
            warn(
                f"{len(result.missing_queries)} judged queries had no "
                f"results or no text and score 0 (e.g. {result.missing_queries[:3]})"
            )
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
    else:
        out.print(format_table(results, title=title))


def _labels(names: list[str]) -> dict[str, str]:
    """Short column labels: a model folder's name, unless two models would share it."""
    short = {name: Path(name).name or name for name in names}
    if len(set(short.values())) < len(names):
        return {name: name for name in names}
    return short
