"""``densefit serve``: an HTTP search service over a document store (FastAPI + uvicorn).

:func:`~densefit.serve.app.create_app` builds the app from an open store and its model;
:func:`~densefit.serve.server.run_server` serves it with uvicorn until SIGTERM/SIGINT.
Needs the ``serve`` extra: ``pip install 'densefit[serve]'``.
"""

from densefit.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app", "run_server"]


def __getattr__(name: str):
    # Lazy: importing densefit.serve must not need FastAPI until the app is built.
    if name == "create_app":
        from densefit.serve import app

        return getattr(app, name)
    if name == "run_server":
        from densefit.serve.server import run_server

        return run_server
    raise AttributeError(name)
