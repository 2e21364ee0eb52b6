"""``densefit serve``: an HTTP search service over a document store (FastAPI + uvicorn).

:func:`~densefit.serve.app.create_app` builds the app from an open store and its model;
:func:`~densefit.serve.server.run_server` serves it with uvicorn until SIGTERM/SIGINT.
Needs the ``serve`` extra: ``pip install 'densefit[serve]'``.
"""

from __future__ import annotations

from densefit._lazy import lazy_exports

_EXPORTS = {
    "ServeConfig": "densefit.serve.config",
    "create_app": "densefit.serve.app",
    "run_server": "densefit.serve.server",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
