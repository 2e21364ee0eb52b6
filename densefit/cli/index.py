"""``densefit index`` and ``densefit search``: argument parsing (from
:class:`~densefit.config.commands.IndexJob` and ``SearchJob``), one job call, printing.

Messages and progress go to stderr; results (tables, ``--json``) go to stdout, so
``densefit search --json ... | jq`` works.
"""

from __future__ import annotations

import json

import typer
from rich.table import Table

from densefit.cli.common import err, launch_torchrun, out, progress_of, quiet_libraries
from densefit.cli.options import options_command
from densefit.config.commands import IndexJob, SearchJob

__all__ = ["index", "register", "search"]


@options_command(IndexJob)
def index(options: IndexJob) -> None:
    """Embed a corpus into a store; re-running resumes and skips unchanged documents.

    The model defaults to the store's own (a new store: all-MiniLM-L6-v2).

    Example: densefit index datasets/scifact --model all-MiniLM-L6-v2 --store stores/scifact

    Several processes (each GPU embeds a share, one process writes): densefit index ...
    --device cuda --nproc 4, or torchrun --nproc-per-node 4 -m densefit index ...
    """
    job = options.replace(show_progress=progress_of(options))
    from densefit.jobs import check_index_job, index_job  # the framework: only when indexing
    from densefit.retrieval.index.registry import redacted  # the target as messages show it
    from densefit.retrieval.index.types import StoreUnavailableError  # the store's fault
    from densefit.training import distributed  # torch.distributed: only when indexing

    check_index_job(job)  # with --nproc: one error line, before any process starts
    launch_torchrun("index", job.nproc)
    try:
        outcome = index_job(job)
    except KeyboardInterrupt:
        if distributed.is_main_process():
            err.print(
                f"\ninterrupted: {redacted(job.store)} keeps every committed document; run the same "
                "command again to resume"
            )
        raise typer.Exit(130) from None
    except StoreUnavailableError as exc:  # the engine went away mid-run: exit 3, one line
        raise StoreUnavailableError(
            f"{exc}; the store keeps every document committed before it: run the same command "
            "again to resume"
        ) from None
    if not outcome.main:
        return  # rank 0 reports
    if job.json:
        payload = {
            "report": outcome.report.to_dict(),
            "read": outcome.read.to_dict(),
            "store": outcome.store,
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    info = outcome.store
    err.print(f"{info['path']}: {info['documents']:,} documents ({info['model']}, {info['dim']}-d)")
    err.print(outcome.report.summary())
    if outcome.read.n_skipped:
        err.print(f"[yellow]skipped rows:[/] {outcome.read.summary()}")


@options_command(SearchJob)
def search(options: SearchJob) -> None:
    """Print the best documents for each query: rank, score, id and a snippet.

    Example: densefit search --store stores/scifact "vitamin D and bone density" -k 5
    """
    quiet_libraries()  # a search draws no progress bars
    from densefit.jobs import search_job  # the framework: only when searching

    results = search_job(options)
    if options.json:
        payload = [
            {"query": q, "hits": [h.to_dict() for h in hits]}
            for q, hits in zip(options.queries, results, strict=True)
        ]
        typer.echo(json.dumps(payload, indent=2, ensure_ascii=False))
        return

    for query, hits in zip(options.queries, results, strict=True):
        table = Table(title=query, title_justify="left", show_lines=False)
        table.add_column("#", justify="right")
        table.add_column("score", justify="right")
        table.add_column("id")
        table.add_column("snippet", overflow="fold")
        for hit in hits:
            table.add_row(str(hit.rank), f"{hit.score:.4f}", hit.id, hit.snippet(options.width))
        if not hits:
            table.caption = (
                "no documents match the filter" if options.filter else "no documents in the store"
            )
        out.print(table)


def register(app: typer.Typer) -> None:
    """Add the ``index`` and ``search`` commands to ``app``.

    >>> import typer
    >>> app = typer.Typer()
    >>> register(app)
    >>> sorted(c.name for c in app.registered_commands)
    ['index', 'search']
    """
    app.command("index")(index)
    app.command("search")(search)
