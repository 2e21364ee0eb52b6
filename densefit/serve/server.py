"""Running the app with uvicorn: loopback by default, graceful shutdown on SIGTERM.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections, lets in-flight requests finish
(up to ``graceful_seconds``), then the app's lifespan ends: queued queries are answered,
queued writes committed and the store closed.
"""

from __future__ import annotations

import signal
import socket
import sys
import warnings

from densefit.config.shared import model_or_default
from densefit.jobs import discard_if_empty
from densefit.models import load_model, resolve_device
from densefit.retrieval.index.engines import open_store
from densefit.retrieval.index.searching import model_for_store
from densefit.retrieval.index.types import NoStoreError
from densefit.serve.app import create_app
from densefit.serve.config import DEFAULT_HOST, DEFAULT_PORT, is_local_host

__all__ = ["run_server", "runtime_line"]


def run_server(
    app,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    graceful_seconds: float = 30.0,
    log_level: str = "warning",
) -> None:
    """Serve ``app`` on ``host:port`` until SIGTERM or SIGINT."""
    import uvicorn  # the optional extra `serve`

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=graceful_seconds,
        access_log=False,
    )
    server = uvicorn.Server(config)
    print(
        f"densefit serve: http://{host}:{port} ({_pages(app)}); SIGTERM or Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn re-raises SIGTERM after its graceful shutdown; by then the store is closed, so
    # the signal ends the process with status 0 instead of "killed by SIGTERM".
    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_cleanly(signum, frame) -> None:
    print("densefit serve: stopped (SIGTERM); the store is closed", file=sys.stderr, flush=True)
    raise SystemExit(0)


def serve_job(job) -> None:  # noqa: ANN001 - a densefit.serve.config.ServeJob
    """Open ``job.store`` (or create it for ``job.model`` with ``job.create``) with the model
    that searches it, and serve it until SIGTERM or Ctrl-C. A non-local address without an
    API key serves read-only (writes get 403) and says so."""

    job = job.replace(device=resolve_device(job.device))
    opening = {"backend": job.backend, "rescore": job.rescore}
    created = False  # a store this command makes is dropped again if the start fails
    try:
        store = open_store(job.store, create=False, **opening)
    except NoStoreError:
        if not job.create:
            raise
        _check_port_free(
            job.host, job.port
        )  # before a store is made for a server that cannot start
        model = load_model(model_or_default(job.model), device=job.device)
        store = open_store(job.store, model, vectors=job.vectors, **opening)
        created = True
    else:
        # the store's model (or --model), embedding as the store was indexed, as search does
        try:
            model = model_for_store(store, job.model, device=job.device)
            store.check_model(model)
        except BaseException:
            store.close()
            raise
    local = is_local_host(job.host)
    if not local and not job.serve.api_key:
        warnings.warn(
            f"{job.host} is not a local address and no --api-key is set: serving read-only "
            "(writes get 403)",
            UserWarning,
            stacklevel=2,
        )
    config = job.serve.replace(allow_writes=local or bool(job.serve.api_key))
    try:
        app = create_app(store, model, config)
    except BaseException:
        if created:
            discard_if_empty(store)
        raise
    print(f"densefit serve: {runtime_line(app.state.served.state)}", file=sys.stderr, flush=True)
    run_server(app, host=job.host, port=job.port)


def _check_port_free(host: str, port: int) -> None:
    """ValueError (one line) when ``host:port`` cannot be listened on (another server has
    it, or the address is not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(
                f"cannot listen on {host}:{port} ({exc.strerror}): stop what uses the port "
                "or choose another with --port"
            ) from None


def _pages(app) -> str:
    """The pages a person opens: the search page (unless ``--no-ui``) and the API docs."""
    has_ui = any(getattr(route, "path", None) == "/" for route in app.routes)
    return "search page at /, API docs at /docs" if has_ui else "API docs at /docs"


def runtime_line(state) -> str:
    """What embeds the queries, and (``auto``) how fast each candidate was.

    >>> from types import SimpleNamespace
    >>> runtime_line(SimpleNamespace(runtime="onnx", runtime_ms={"onnx": 6.61, "torch": 17.3}))
    'queries embedded by onnx (auto: 6.6 ms per query; torch 17.3 ms)'
    """
    if not state.runtime_ms:
        return f"queries embedded by {state.runtime}"
    others = "; ".join(
        f"{name} {ms:.1f} ms" for name, ms in state.runtime_ms.items() if name != state.runtime
    )
    return (
        f"queries embedded by {state.runtime} (auto: "
        f"{state.runtime_ms[state.runtime]:.1f} ms per query; {others})"
    )
