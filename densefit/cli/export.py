"""``densefit export``: argument parsing (from :class:`~densefit.config.commands.ExportJob`),
one job call, printing.

The files go into the model folder (or ``--output``) in sentence-transformers' layout; the
summary, each file with its check's numbers, goes to stderr, ``--json`` to stdout.
"""

from __future__ import annotations

import json

import typer

from densefit.cli.common import err, progress_of
from densefit.cli.options import options_command
from densefit.config.commands import ExportJob

__all__ = ["export", "register"]


@options_command(ExportJob)
def export(options: ExportJob) -> None:
    """Export a model for ONNX Runtime or OpenVINO, each file checked against it before kept.

    The files go into the model folder in sentence-transformers' layout; --runtime auto (index,
    search, eval, mine, serve) then picks the fastest whose check passed.

    Example: densefit export runs/m --to onnx-int8 --calibration datasets/scifact
    """
    job = options.replace(show_progress=progress_of(options))
    from densefit.jobs import export_job  # the framework: only when exporting

    report = export_job(job)
    if job.json:
        payload = {"folder": report.folder, "seconds": round(report.seconds, 1)}
        typer.echo(json.dumps({**payload, "exports": report.exports}, indent=2))
        return
    err.print(report.summary(), markup=False)


def register(app: typer.Typer) -> None:
    """Add the ``export`` command to ``app``.

    >>> import typer
    >>> app = typer.Typer()
    >>> register(app)
    >>> [c.name for c in app.registered_commands]
    ['export']
    """
    app.command("export")(export)
