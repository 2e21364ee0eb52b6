"""``densefit serve``: argument parsing (:class:`~densefit.serve.config.ServeJob`), one call
(:func:`densefit.serve.server.serve_job`): an HTTP search service over a store."""

from __future__ import annotations

import typer

from densefit.cli.common import quiet_libraries
from densefit.cli.options import options_command
from densefit.serve.config import ServeJob

__all__ = ["register", "serve"]


@options_command(ServeJob)
def serve(options: ServeJob) -> None:
    """Serve search, upserts and deletes over HTTP until SIGTERM or Ctrl-C.

    Example: densefit serve --store stores/scifact --port 8000   (docs at http://127.0.0.1:8000/docs)
    """
    quiet_libraries()  # a service logs requests, not loading bars
    from densefit.serve.server import serve_job  # FastAPI, the framework: only when serving

    serve_job(options)


def register(app: typer.Typer) -> None:
    """Add ``densefit serve`` to ``app``."""
    app.command(name="serve")(serve)
