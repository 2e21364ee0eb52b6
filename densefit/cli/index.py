"""``densefit index | search`` (and ``eval``, from :mod:`densefit.cli.eval`): added to a Typer
app by :func:`register`.

Messages and progress go to stderr; results (tables, ``--json``) go to stdout, so
``densefit search --json ... | jq`` works.
"""

from __future__ import annotations

import gzip
import json
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console

from densefit.cli.common import (
    BACKEND_OPTION,
    DIM_OPTION,
    DOCUMENT_PROMPT_OPTION,
    ENCODE_BATCH_OPTION,
    ON_BAD_ROW_OPTION,
    PROGRESS_OPTION,
    QUERY_PROMPT_OPTION,
    OnBadRow,
    device_option,
    err,
    warn,
)

__all__ = ["register"]

out = Console(highlight=False)


class Dtype(str, Enum):
    float32 = "float32"
    float16 = "float16"


def _count_rows(path: Path) -> int | None:
    """Rows in a corpus file, cheaply, for the progress bar's total (None when unknown)."""
    from densefit.data.corpus import find_corpus_file

    try:
        path = find_corpus_file(path)
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
    batch_size: int = ENCODE_BATCH_OPTION,
    commit_every: int = typer.Option(
        1024, help="Documents per transaction: a crash loses at most this many."
    ),
    backend: str = BACKEND_OPTION,
    dtype: Dtype = typer.Option(Dtype.float32, help="Vector precision of a new store."),
    max_seq_length: int | None = typer.Option(None, help="Truncate documents to this many tokens."),
    reembed: bool = typer.Option(
        False,
        help="Re-embed every stored document with this run's settings (e.g. a new "
        "--max-seq-length) instead of refusing to mix vectors made two ways.",
    ),
    lock_timeout: float = typer.Option(
        3600.0, help="Seconds to wait for another process writing to the same store."
    ),
    on_bad_row: OnBadRow = ON_BAD_ROW_OPTION,
    prune: bool = typer.Option(False, help="Delete stored documents that are not in CORPUS."),
    index_fields: list[str] = typer.Option(
        [],
        "--index-field",
        help="Add an SQLite index on a metadata field (meta.NAME) that search --filter "
        "compares often; repeatable.",
    ),
    progress: bool = PROGRESS_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    query_prompt: str | None = QUERY_PROMPT_OPTION,
    document_prompt: str | None = DOCUMENT_PROMPT_OPTION,
    dim: int | None = DIM_OPTION,
    device: str = device_option(),
) -> None:
    """Embed a corpus into a store; re-running resumes and skips unchanged documents.

    Example: densefit index datasets/scifact --model all-MiniLM-L6-v2 --store stores/scifact
    """
    from densefit.data.corpus import iter_corpus
    from densefit.data.types import ReadReport
    from densefit.models import load_model, resolve_device
    from densefit.retrieval.encode import configure_model
    from densefit.retrieval.index.filters import meta_index_sql
    from densefit.retrieval.index.store import open_store

    device = resolve_device(device)
    if not corpus.exists():
        raise FileNotFoundError(f"{corpus}: no such file or folder")
    for field in index_fields:
        meta_index_sql(field)  # a bad field name fails before any work
    st_model = load_model(model, max_seq_length=max_seq_length, device=device)
    configure_model(st_model, query_prompt=query_prompt, document_prompt=document_prompt, dim=dim)
    document_store = open_store(
        store, st_model, backend=backend, vectors=dtype.value, lock_timeout=lock_timeout
    )
    if document_store.vector_kind != dtype.value and dtype != Dtype.float32:
        warn(
            f"{store} stores {document_store.vector_kind} vectors; --dtype applies to new "
            "stores only"
        )
    read_report = ReadReport(str(corpus))
    documents = iter_corpus(corpus, on_bad_row=on_bad_row.value, report=read_report)
    with document_store:
        report = _index_into(
            document_store,
            st_model,
            documents,
            prune=prune,
            total=_count_rows(corpus),
            batch_size=batch_size,
            commit_every=commit_every,
            show_progress=progress,
            reembed=reembed,
            lock_timeout=lock_timeout,
        )
        for field in index_fields:
            document_store.index_meta_field(field)
        info = document_store.info()
    if as_json:
        payload = {"report": report.to_dict(), "read": read_report.to_dict(), "store": info}
        typer.echo(json.dumps(payload, indent=2))
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


def _index_into(document_store, st_model, documents, *, prune: bool, **options):
    """:func:`index_documents`, then ``--prune``; Ctrl-C says how to resume (exit 130)."""
    from densefit.retrieval.index.indexing import index_documents, prune_documents

    seen: set[str] = set()

    def remember(docs):
        for doc in docs:
            seen.add(doc.id)
            yield doc

    try:
        report = index_documents(
            document_store, st_model, remember(documents) if prune else documents, **options
        )
    except KeyboardInterrupt:
        err.print(
            f"\ninterrupted: {document_store.path} holds {document_store.count()} committed "
            "documents; run the same command again to resume",
            highlight=False,
        )
        raise typer.Exit(130) from None
    if prune:
        report.pruned = prune_documents(document_store, seen)
    return report


def search(
    queries: list[str] = typer.Argument(..., help="One or more queries."),
    store: Path = typer.Option(
        ..., "--store", "-s", help="Store folder built by `densefit index`."
    ),
    top_k: int = typer.Option(10, "-k", "--top-k", help="Results per query."),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Query model (default: the store's model)."
    ),
    backend: str = BACKEND_OPTION,
    filter_: str | None = typer.Option(
        None,
        "--filter",
        help="Metadata filter, Haystack syntax as JSON (or @FILE.json), e.g. "
        '\'{"field": "meta.lang", "operator": "==", "value": "en"}\': the best k that match.',
    ),
    scale_score: bool = typer.Option(
        False, "--scale-score", help="Scores in [0, 1]: cosine (s+1)/2, dot expit(s/100)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: [{query, hits: [...]}]."),
    width: int = typer.Option(160, help="Snippet length in characters."),
    query_prompt: str | None = QUERY_PROMPT_OPTION,
    document_prompt: str | None = DOCUMENT_PROMPT_OPTION,
    dim: int | None = DIM_OPTION,
    device: str = device_option(),
) -> None:
    """Print the best documents for each query: rank, score, id and a snippet.

    Example: densefit search --store stores/scifact "vitamin D and bone density" -k 5
    """
    from densefit.models import resolve_device
    from densefit.retrieval.index.searching import model_for_store, search_batch
    from densefit.retrieval.index.store import LocalDocumentStore

    filters = parse_filter_option(filter_)
    device = resolve_device(device)
    with LocalDocumentStore(store, backend=backend) as document_store:
        st_model = model_for_store(
            document_store,
            model,
            device=device,
            query_prompt=query_prompt,
            document_prompt=document_prompt,
            dim=dim,
        )
        results = search_batch(
            document_store, st_model, queries, top_k=top_k, filters=filters, scale_score=scale_score
        )
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
            table.caption = (
                "no documents match the filter" if filters else "no documents in the store"
            )
        out.print(table)


def parse_filter_option(text: str | None) -> dict | None:
    """The ``--filter`` value: JSON text, or ``@PATH`` of a JSON file; checked, or ValueError.

    >>> parse_filter_option('{"field": "meta.lang", "operator": "==", "value": "en"}')
    {'field': 'meta.lang', 'operator': '==', 'value': 'en'}
    """
    from densefit.retrieval.index.filters import validate_filters

    if text is None:
        return None
    source = "--filter"
    if text.startswith("@"):
        source = text[1:]
        text = Path(source).read_text(encoding="utf-8")
    try:
        filters = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{source} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): "
            'pass e.g. \'{"field": "meta.lang", "operator": "==", "value": "en"}\''
        ) from None
    validate_filters(filters)
    return filters


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
    from densefit.cli.eval import evaluate

    app.command("eval")(evaluate)
