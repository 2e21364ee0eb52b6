"""Running the app with uvicorn: loopback by default, graceful shutdown on SIGTERM.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections, lets in-flight requests finish
(up to ``graceful_seconds``), then the app's lifespan ends: queued queries are answered,
queued writes committed and the store closed.
"""

from __future__ import annotations

import signal
import sys

from densefit.errors import OptionError

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "run_server"]

DEFAULT_HOST = "127.0.0.1"  # loopback: nothing outside this machine reaches the server
DEFAULT_PORT = 8000


def run_server(
    app,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    graceful_seconds: float = 30.0,
    log_level: str = "warning",
) -> None:
    """Serve ``app`` on ``host:port`` until SIGTERM or SIGINT (port 0: any free port)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise OptionError("port", f"{{option}} must be a TCP port, 0 to 65535, got {port!r}")
    import uvicorn

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
        f"densefit serve: http://{host}:{port} (API docs at /docs); SIGTERM or Ctrl-C stops",
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
