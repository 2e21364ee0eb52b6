"""``densefit reembed``: argument parsing (:class:`~densefit.config.commands.ReembedJob`),
one job call (:func:`densefit.jobs.reembed_job`), printing."""

from __future__ import annotations

import json

import typer

from densefit.cli.common import err, progress_of
from densefit.cli.options import options_command
from densefit.config.commands import ReembedJob

__all__ = ["reembed", "register"]


@options_command(ReembedJob)
def reembed(options: ReembedJob) -> None:
    """Swap a store to another model with no downtime: embed every document again beside the
    current vectors (searches and writes go on), then switch in one commit.

    A killed run leaves the current model serving; the same command resumes it.

    Example: densefit reembed --store stores/scifact --model runs/scifact/model
    """
    job = options.replace(show_progress=progress_of(options))
    from densefit.jobs import reembed_job  # the framework: only when re-embedding
    from densefit.retrieval.index.registry import redacted  # the target as messages show it

    try:
        report = reembed_job(job)
    except KeyboardInterrupt:
        err.print(
            f"\ninterrupted: {redacted(job.store)} still serves its current model and keeps the new "
            "vectors made so far; run the same command again to resume"
        )
        raise typer.Exit(130) from None
    if report is None:
        err.print(
            f"{redacted(job.store)}: no model swap under way any more; it serves its current model"
        )
        return
    if job.json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    err.print(report.summary())


def register(app: typer.Typer) -> None:
    """Add ``densefit reembed`` to ``app``."""
    app.command("reembed")(reembed)
