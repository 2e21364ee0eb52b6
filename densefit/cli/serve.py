"""``densefit serve``: an HTTP search service over a store (see :mod:`densefit.serve`).

Registered on the Typer app by :func:`register`. Options take their defaults from
:class:`densefit.serve.app.ServeConfig`'s fields (declared once).
"""

from __future__ import annotations

from pathlib import Path

import typer

from densefit.cli.common import (
    BACKEND_OPTION,
    device_option,
    warn,
)
from densefit.serve.config import ServeConfig, is_local_host
from densefit.serve.server import DEFAULT_HOST, DEFAULT_PORT

__all__ = ["API_KEY_ENV", "register"]

API_KEY_ENV = "DENSEFIT_API_KEY"


_D = ServeConfig  # option defaults come from its fields


def serve(
    store: Path = typer.Option(
        ..., "--store", "-s", help="Store folder built by `densefit index`."
    ),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Model (default: the store's); must be the one that built it."
    ),
    device: str = device_option(),
    host: str = typer.Option(DEFAULT_HOST, help="Address to bind (loopback by default)."),
    port: int = typer.Option(DEFAULT_PORT, help="TCP port."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar=API_KEY_ENV,
        help=f"Required on every request when set (header X-API-Key); or ${API_KEY_ENV}. "
        "Without it a server on a non-local address is read-only.",
    ),
    create: bool = typer.Option(
        False, help="Create an empty store for --model when --store holds none."
    ),
    backend: str = BACKEND_OPTION,
    max_k: int = typer.Option(_D.max_k, help="Largest k a search may ask for."),
    max_queries: int = typer.Option(_D.max_queries, help="Queries per request."),
    max_documents: int = typer.Option(_D.max_documents, help="Documents per write."),
    max_body_bytes: int = typer.Option(_D.max_body_bytes, help="Larger bodies: 413."),
    max_batch: int = typer.Option(_D.max_batch, help="Queries per forward pass."),
    query_workers: int = typer.Option(
        _D.query_workers,
        help="Query batches encoded at the same time, each with its share of the torch threads.",
    ),
    threads_per_worker: int = typer.Option(
        _D.threads_per_worker,
        help="Torch threads per query worker (0: torch's threads, i.e. the cores or "
        "OMP_NUM_THREADS, divided among the workers).",
    ),
    max_wait_ms: float = typer.Option(
        _D.max_wait_ms,
        help="How long a batch waits for more queries (not on an idle server with none coming).",
    ),
) -> None:
    """Serve search, upserts and deletes over HTTP until SIGTERM or Ctrl-C.

    Example: densefit serve --store stores/scifact --port 8000   (docs at http://127.0.0.1:8000/docs)
    """
    from densefit.models import load_model, resolve_device
    from densefit.retrieval.index.documents import DB_NAME
    from densefit.retrieval.index.searching import model_for_store
    from densefit.retrieval.index.store import LocalDocumentStore, open_store
    from densefit.serve.app import create_app
    from densefit.serve.server import run_server

    device = resolve_device(device)
    if not create or (store / DB_NAME).is_file():
        # the store's model (or --model), embedding as the store was indexed, as search does
        with LocalDocumentStore(store) as probe:  # StoreError (one line) when not a store
            st_model = model_for_store(probe, model, device=device)
    elif model is None:
        raise ValueError("--create needs --model: the model the new store is for")
    else:
        st_model = load_model(model, device=device)
    document_store = open_store(store, st_model, backend=backend, create=create)
    local = is_local_host(host)
    if not local and not api_key:
        warn(
            f"{host} is not a local address and no --api-key is set: "
            "serving read-only (writes get 403)"
        )
    config = ServeConfig(
        max_k=max_k,
        max_queries=max_queries,
        max_documents=max_documents,
        max_body_bytes=max_body_bytes,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        query_workers=query_workers,
        threads_per_worker=threads_per_worker,
        api_key=api_key or None,
        allow_writes=local or bool(api_key),
    )
    app = create_app(document_store, st_model, config)
    run_server(app, host=host, port=port)


def register(app: typer.Typer) -> None:
    """Add ``densefit serve`` to ``app``."""
    app.command(name="serve")(serve)
