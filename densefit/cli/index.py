"""``densefit index | search | eval``: added to a Typer app by :func:`register`.

Messages and progress go to stderr; results (tables, ``--json``) go to stdout, so
``densefit search --json ... | jq`` works.
"""

from __future__ import annotations

import gzip
import json
from contextlib import contextmanager
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console

from densefit.cli.common import OnBadRow, err, fail

__all__ = ["register"]

out = Console(highlight=False)


class Dtype(str, Enum):
    float32 = "float32"
    float16 = "float16"




@contextmanager
def _clean_errors():
    """Turn the library's explained errors into one red line and exit status 2."""
    from densefit.data.types import BadRowError
    from densefit.retrieval.index.base import StoreError
    from densefit.models import ModelNotFoundError

    try:
        yield
    except (StoreError, BadRowError, ModelNotFoundError, FileNotFoundError, ImportError) as exc:
        fail(str(exc))
    except ValueError as exc:
        fail(str(exc))


def _load_model(name: str, max_seq_length: int | None = None):
    from densefit.models import load_model

    return load_model(name, max_seq_length=max_seq_length)


def _count_rows(path: Path) -> int | None:
    """Rows in a corpus file, cheaply, for the progress bar's total (None when unknown)."""
    if path.is_dir():
        for name in ("corpus.jsonl", "corpus.jsonl.gz"):
            if (path / name).is_file():
                return _count_rows(path / name)
        return None
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
        if path.name.endswith(".jsonl.gz"):
            with gzip.open(path, "rb") as fh:
                return sum(1 for line in fh if line.strip())
        if path.suffix == ".jsonl":
            with open(path, "rb") as fh:
                return sum(1 for line in fh if line.strip())
    except OSError:
        return None
    return None


def index(
    corpus: Path = typer.Argument(..., help="JSONL(.gz), CSV, TSV, Parquet, or a BEIR folder."),
    model: str = typer.Option(..., "--model", "-m", help="Model folder or name."),
    store: Path = typer.Option(..., "--store", "-s", help="Store folder (created if new)."),
    batch_size: int = typer.Option(64, help="Texts per forward pass."),
    commit_every: int = typer.Option(
        1024, help="Documents per transaction: a crash loses at most this many."
    ),
    backend: str = typer.Option(
        "exact", help="exact, faiss (HNSW32) or faiss:FACTORY, e.g. faiss:IVF4096,Flat."
    ),
    dtype: Dtype = typer.Option(Dtype.float32, help="Vector precision of a new store."),
    max_seq_length: int | None = typer.Option(None, help="Truncate documents to this many tokens."),
    on_bad_row: OnBadRow = typer.Option(OnBadRow.error, help="error: stop; skip: skip and report."),
    prune: bool = typer.Option(False, help="Delete stored documents that are not in CORPUS."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Embed a corpus into a store; re-running resumes and skips unchanged documents.

    Example: densefit index datasets/scifact --model all-MiniLM-L6-v2 --store stores/scifact
    """
    from densefit.data.corpus import iter_corpus
    from densefit.data.types import ReadReport
    from densefit.retrieval.index.indexing import index_documents, prune_documents
    from densefit.retrieval.index.store import open_store

    with _clean_errors():
        if not corpus.exists():
            raise FileNotFoundError(f"{corpus}: no such file or folder")
        st_model = _load_model(model, max_seq_length)
        document_store = open_store(store, st_model, backend=backend, dtype=dtype.value)
        if document_store.dtype != dtype.value and dtype != Dtype.float32:
            err.print(
                f"[yellow]warning:[/] {store} stores {document_store.dtype} vectors; --dtype "
                "applies to new stores only",
                highlight=False,
            )
        read_report = ReadReport(str(corpus))
        documents = iter_corpus(corpus, on_bad_row=on_bad_row.value, report=read_report)
        seen: set[str] = set()

        def remember(docs):
            for doc in docs:
                seen.add(doc.id)
                yield doc

        with document_store:
            try:
                report = index_documents(
                    document_store,
                    st_model,
                    remember(documents) if prune else documents,
                    batch_size=batch_size,
                    commit_every=commit_every,
                    show_progress=progress,
                    total=_count_rows(corpus),
                )
            except KeyboardInterrupt:
                err.print(
                    f"\ninterrupted: {store} holds {document_store.count()} committed documents; "
                    "run the same command again to resume",
                    highlight=False,
                )
                raise typer.Exit(130) from None
            if prune:
                report.pruned = prune_documents(document_store, seen)
            info = document_store.info()
    if as_json:
        typer.echo(
            json.dumps(
                {"report": report.to_dict(), "read": _read_dict(read_report), "store": info},
                indent=2,
            )
        )
        return
    err.print(
        f"{store}: {info['documents']} documents ({info['model']}, {info['dim']}-d)",
        highlight=False,
    )
    err.print(report.summary(), highlight=False, soft_wrap=True)
    if read_report.n_skipped:
        err.print(
            f"[yellow]skipped rows:[/] {read_report.summary()}", highlight=False, soft_wrap=True
        )


def _read_dict(report) -> dict:
    return {"path": report.path, "rows": report.rows, "skipped": report.skipped}


def search(
    queries: list[str] = typer.Argument(..., help="One or more queries."),
    store: Path = typer.Option(
        ..., "--store", "-s", help="Store folder built by `densefit index`."
    ),
    top_k: int = typer.Option(10, "-k", "--top-k", help="Results per query."),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Query model (default: the store's model)."
    ),
    backend: str = typer.Option("exact", help="exact, faiss or faiss:FACTORY."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: [{query, hits: [...]}]."),
    width: int = typer.Option(160, help="Snippet length in characters."),
) -> None:
    """Print the best documents for each query: rank, score, id and a snippet.

    Example: densefit search --store stores/scifact "vitamin D and bone density" -k 5
    """
    from densefit.retrieval.index.searching import search_batch
    from densefit.retrieval.index.store import LocalDocumentStore

    with _clean_errors():
        document_store = LocalDocumentStore(store, backend=backend)
        with document_store:
            name = model or document_store.model_name
            try:
                st_model = _load_model(name)
            except Exception as exc:  # noqa: BLE001 - explain which model and how to fix
                if model:
                    raise
                fail(
                    f"{store} was indexed with {name!r}, which cannot be loaded here "
                    f"({exc.__class__.__name__}: {str(exc)[:200]}): pass --model PATH_TO_THAT_MODEL"
                )
            results = search_batch(document_store, st_model, queries, top_k=top_k)
    if as_json:
        payload = [
            {"query": q, "hits": [h.to_dict() for h in hits]}
            for q, hits in zip(queries, results, strict=True)
        ]
        typer.echo(json.dumps(payload, indent=2, ensure_ascii=False))
        return
    from rich.table import Table

    for query, hits in zip(queries, results, strict=True):
        table = Table(title=f"{query}", title_justify="left", show_lines=False)
        table.add_column("#", justify="right")
        table.add_column("score", justify="right")
        table.add_column("id")
        table.add_column("snippet", overflow="fold")
        for hit in hits:
            table.add_row(str(hit.rank), f"{hit.score:.4f}", hit.id, hit.snippet(width))
        if not hits:
            table.caption = "no documents in the store"
        out.print(table)


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
    metrics: str = typer.Option(
        "ndcg@10,mrr@10,recall@10,recall@100,map@100", help="Comma-separated metrics."
    ),
    top_k: int | None = typer.Option(
        None, help="Documents retrieved per query (default: largest cutoff)."
    ),
    backend: str = typer.Option("exact", help="exact, faiss or faiss:FACTORY."),
    batch_size: int = typer.Option(64, help="Texts per forward pass."),
    on_bad_row: OnBadRow = typer.Option(OnBadRow.error, help="error: stop; skip: skip and report."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Also write the JSON here."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    per_query: bool = typer.Option(False, help="Include per-query scores in the JSON."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """nDCG@10, MRR@10, Recall@10/100, MAP@100 (pytrec_eval) on a BEIR split or a store.

    Examples:

      densefit eval --dataset datasets/scifact --model all-MiniLM-L6-v2 --compare runs/tuned

      densefit eval --store stores/scifact --queries q.jsonl --qrels qrels/test.tsv
    """
    from densefit.evaluate import (
        compare_results,
        evaluate_beir,
        evaluate_store,
        format_table,
        load_queries_and_qrels,
        parse_metric,
    )

    with _clean_errors():
        metric_list = [m.strip() for m in metrics.split(",") if m.strip()]
        for metric in metric_list:
            parse_metric(metric)
        if dataset is not None:
            if queries is not None or qrels is not None:
                fail("--dataset brings its own queries and qrels: drop --queries/--qrels")
            if model is None:
                fail("--dataset needs --model (the model to evaluate)")
            if compare is not None and compare == model:
                fail("--compare names the same model as --model; give the other model")
            if compare is not None and store is not None:
                fail("--store keeps the index of one model; drop it when using --compare")
            from densefit.data.corpus import load_beir

            beir = load_beir(dataset, split, on_bad_row=on_bad_row.value)
            results = []
            labels = _labels([model] + ([compare] if compare else []))
            for name, label in labels.items():
                if progress:
                    err.print(f"evaluating {name} on {dataset} ({split})", highlight=False)
                result = evaluate_beir(
                    _load_model(name),
                    beir,
                    split,
                    store_dir=store,
                    backend=backend,
                    metrics=metric_list,
                    top_k=top_k,
                    batch_size=batch_size,
                    show_progress=progress,
                    name=label,
                )
                result.info["dataset"] = str(dataset)
                results.append(result)
            title = f"{dataset} ({split})"
        else:
            if store is None or queries is None or qrels is None:
                fail(
                    "give either --dataset BEIR_DIR --model M, or --store DIR --queries FILE "
                    "--qrels FILE"
                )
            if compare is not None:
                fail(
                    "--compare needs --dataset (each model needs its own index); or run eval "
                    "once per store"
                )
            from densefit.retrieval.index.store import LocalDocumentStore

            query_texts, judgments = load_queries_and_qrels(queries, qrels)
            with LocalDocumentStore(store, backend=backend) as document_store:
                st_model = _load_model(model or document_store.model_name)
                results = [
                    evaluate_store(
                        document_store,
                        st_model,
                        query_texts,
                        judgments,
                        metrics=metric_list,
                        top_k=top_k,
                        batch_size=batch_size,
                        show_progress=progress,
                        name=model or document_store.model_name,
                    )
                ]
            title = f"{store} ({qrels.name})"
    payload = {
        "results": [r.to_dict(per_query=per_query) for r in results],
        "comparison": compare_results(*results) if len(results) == 2 else None,
    }
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    for result in results:
        if result.missing_queries:
            err.print(
                f"[yellow]warning:[/] {len(result.missing_queries)} judged queries had no "
                f"results or no text and score 0 (e.g. {result.missing_queries[:3]})",
                highlight=False,
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


def register(app: typer.Typer) -> None:
    """Add the ``index``, ``search`` and ``eval`` commands to ``app``.

    >>> import typer
    >>> app = typer.Typer()
    >>> register(app)
    >>> sorted(c.name for c in app.registered_commands)
    ['eval', 'index', 'search']
    """
    app.command("index")(index)
    app.command("search")(search)
    app.command("eval")(evaluate)
