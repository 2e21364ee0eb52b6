"""The PostgreSQL engine: documents, vectors and BM25 postings in tables of a PostgreSQL
database with the pgvector extension (``pip install 'densefit[postgres]'``). Its target
(``postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE/TABLE[?params]``), its tables and how it
searches, loads, swaps models and shares a table between processes: docs/search.md,
"Engines: PostgreSQL + pgvector and Qdrant".

>>> parse_target("postgresql://me:secret@db:5432/search/docs?sslmode=require")
Target(conninfo='postgresql://me:secret@db:5432/search?sslmode=require', table='docs', location='postgresql://me:***@db:5432/search/docs?sslmode=require')
>>> parse_target("postgres://me@db/search").table
'densefit'
>>> where_clause({"field": "meta.lang", "operator": "==", "value": "en"})[0].as_string()
"(fields -> 'meta.lang' ->> 's') = %s"
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import numpy as np

from densefit.data.types import Document
from densefit.retrieval.bm25 import K1, B, Tokens, tokenize
from densefit.retrieval.index.common import Fault, one_line, translated
from densefit.retrieval.index.database import DatabaseStore, StoredRow, ordered_vectors, stored_meta
from densefit.retrieval.index.filters import (
    Comparison,
    Filter,
    date_seconds,
    emit,
    json_text,
    meta_path,
    parse_filters,
    typed_fields,
)
from densefit.retrieval.index.locking import LOCK_NAME, wait_for_lock
from densefit.retrieval.index.quantized import checked_rescore
from densefit.retrieval.index.registry import capabilities_of, redacted, require, scrubbed
from densefit.retrieval.index.swap import (
    MODEL_GENERATION_KEY,
    SWAP_KEY,
    SwapCoordinator,
    switched_meta,
)
from densefit.retrieval.index.types import (
    CapabilityError,
    StoreError,
    StoreRecord,
    StoreUnavailableError,
    SwapTarget,
    VectorSettings,
)

__all__ = [
    "CAPABILITIES",
    "PostgresStore",
    "Target",
    "create",
    "open_existing",
    "parse_target",
    "where_clause",
]

CAPABILITIES = capabilities_of("postgresql")  # declared in its registry row
DEFAULT_TABLE = "densefit"
_TABLE = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")
_HALFVEC = (0, 7)  # the pgvector version that added halfvec
_HNSW_MAX_DIM = {"float32": 2000, "float16": 4000, "binary": 64000}  # pgvector's HNSW limits
_EF_SEARCH_MIN, _EF_SEARCH_MAX = 40, 1000  # pgvector's default and largest hnsw.ef_search
_CONNECT_TIMEOUT = 10  # seconds, unless the target sets connect_timeout
# libpq's TCP settings unless the target sets them: a server host that is gone (down,
# unplugged, firewalled) ends a call within about 30 s instead of the kernel's 15 minutes
_TCP_DEFAULTS = {
    "keepalives": 1,
    "keepalives_idle": 10,  # seconds without traffic before the first probe
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30000,  # ms that sent data may stay unacknowledged
}
# The record's keys beside StoreRecord.to_meta()'s (whose "generation" names the live
# vector table TABLE_v<generation>), as the embedded store keeps them in its meta table.
UNUSED_KEY = "unused_vectors"  # generations of vector tables left to drop (JSON list)
INDEX_KEY, DEFERRED = "hnsw", "deferred"  # the live table's HNSW index is not built yet
# A write of at least this many documents into a store holding no more is a load: the
# HNSW index is built after it in one pass, not kept up row by row (bench/pg_ingest.py).
BULK_MIN = 256  # 100 documents into an empty store: 0.07 s as a load, 0.42 s row by row
_BUILD_MEMORY = (64 << 20, 1 << 30)  # maintenance_work_mem of an index build: at least, at most
_DROP_WAIT = "2s"  # what dropping a vector table or index waits for searches to let go
_INSTALL = "PostgreSQL stores need psycopg and pgvector: pip install 'densefit[postgres]'"
_NUL = "document {!r}: its {} holds a NUL character, which PostgreSQL cannot store: remove it"


def _psycopg():
    try:
        import psycopg  # an optional extra: densefit[postgres]
    except ImportError:
        raise ImportError(_INSTALL) from None
    return psycopg


def _pgvector():
    """pgvector's Python types, with the registration of their psycopg adapters."""
    try:
        import pgvector.psycopg  # an optional extra: densefit[postgres]
    except ImportError:
        raise ImportError(_INSTALL) from None
    return pgvector


# -- the target ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A parsed target: ``conninfo`` for libpq (the URL without the table), the ``table``,
    and the ``location`` messages show (the password redacted)."""

    conninfo: str
    table: str
    location: str


def parse_target(target: str) -> Target:
    """Split a target (see docs/search.md) into what libpq connects to and the
    table; StoreError (one line) for another form or a table name that is not 1-41
    lower-case letters, digits and ``_``."""
    location = redacted(target)
    parts = urlsplit(str(target))
    form = "write postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE/TABLE"
    if parts.scheme.lower() not in ("postgresql", "postgres"):
        raise StoreError(f"{location} is not a PostgreSQL target: {form}")
    names = [unquote(name) for name in parts.path.split("/")[1:]]
    if len(names) > 2:
        raise StoreError(f"{location}: the path names more than a database and a table: {form}")
    table = names[1] if len(names) == 2 and names[1] else DEFAULT_TABLE
    if not _TABLE.match(table):
        raise StoreError(
            f"{location}: table name {table!r} is not allowed: use 1-41 lower-case letters, "
            "digits and '_', starting with a letter or '_' (e.g. docs_v2)"
        )
    path = "/" + parts.path.split("/")[1] if names and names[0] else ""
    conninfo = urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))
    return Target(conninfo, table, location)


_CONNECT_FIXES = (  # a failed connection's message (a pattern) -> what to do
    (
        r'database "([^"]*)" does not exist',
        "create it (createdb {}) or name another database in the target",
    ),
    (
        r"password authentication failed|no password supplied",
        "check the user and password in the target (postgresql://USER:PASSWORD@...)",
    ),
    (r'role "[^"]*" does not exist', "name an existing user in the target (postgresql://USER@...)"),
    (r"", "start the server, or fix the host, port or ?host= socket folder in the target"),
)


def _faults(location: str) -> tuple[Fault, ...]:
    """PostgreSQL's error table (:func:`~densefit.retrieval.index.common.translated`): a lost
    server, or a statement it refused, one line (a failed connection: :func:`_connect`)."""
    psycopg = _psycopg()
    return (
        Fault(
            lambda exc: isinstance(exc, psycopg.OperationalError) and _lost(exc),
            f"{location}: PostgreSQL is unreachable or did not answer in time ({{detail}}): "
            "check that the server is running; the store connects again at its next call",
            error=StoreUnavailableError,
        ),
        Fault(
            psycopg.OperationalError,
            f"{location}: PostgreSQL failed ({{detail}}): check that the server is running; "
            "the store connects again at its next call",
        ),
        Fault(psycopg.Error, f"{location}: PostgreSQL refused ({{detail}})"),
    )


def _lost(exc: BaseException) -> bool:
    """Whether a failed call is the server's unavailability, not the statement's fault: the
    connection failed or was lost (no SQLSTATE, or class 08), the server is shutting down or
    starting (57P), out of resources or connections (53), or the statement timed out."""
    state = getattr(exc, "sqlstate", None)
    return state is None or state.startswith(("08", "57P", "53")) or state == "57014"


def _cannot_connect(location: str, exc: BaseException) -> StoreError:
    """What went wrong connecting and what to do (the first fix whose pattern matches): a
    wrong user, password or database is the target's fault (StoreError); anything else
    (refused, unknown host, timed out, shutting down) a StoreUnavailableError."""
    for pattern, fix in _CONNECT_FIXES:
        found = re.search(pattern, str(exc))
        if found:
            error = StoreUnavailableError if pattern == _CONNECT_FIXES[-1][0] else StoreError
            fix = fix.format(*found.groups())
            return error(f"{location}: cannot connect to PostgreSQL ({one_line(exc)}): {fix}")
    raise AssertionError("the last pattern matches everything")  # pragma: no cover


def _connect(target: Target):
    """A new autocommit connection with pgvector's types registered, or a one-line
    StoreError naming the target and the fix."""
    psycopg = _psycopg()
    options: dict[str, Any] = {"autocommit": True, "prepare_threshold": None}
    given = {name.split("=")[0] for name in urlsplit(target.conninfo).query.split("&")}
    for name, value in {"connect_timeout": _CONNECT_TIMEOUT, **_TCP_DEFAULTS}.items():
        if name not in given:  # the target's own setting wins
            options[name] = value
    failed = Fault(psycopg.OperationalError, partial(_cannot_connect, target.location))
    try:
        with translated([failed]):
            conn = psycopg.connect(target.conninfo, **options)
    except psycopg.ProgrammingError as exc:  # libpq cannot read the URL: it may quote a secret
        raise StoreError(
            f"{target.location}: not a PostgreSQL URL libpq reads "
            f"({scrubbed(one_line(exc), target.conninfo)}): write postgresql://USER[:PASSWORD]@"
            "HOST[:PORT]/DATABASE/TABLE, special characters percent-encoded (%40 for @)"
        ) from None
    # Metadata as the embedded store writes it: values JSON cannot hold as text, no NaN.
    dumps = partial(json.dumps, default=str, allow_nan=False)
    psycopg.types.json.set_json_dumps(dumps, context=conn)
    try:
        if _pgvector_version(conn) is not None:
            _pgvector().psycopg.register_vector(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _dropped(conn) -> bool:
    """Whether an idle connection was dropped by the server (it restarted, or ended the
    session) though libpq has not seen it yet: its socket is readable with nothing asked
    (the server's goodbye, or the end of the stream; the store listens for no
    notifications). One poll, no round trip."""
    if conn.info.transaction_status != _psycopg().pq.TransactionStatus.IDLE:
        return False
    try:
        return bool(select.select([conn.fileno()], [], [], 0)[0])
    except (OSError, ValueError, _psycopg().Error):
        return True


def _pgvector_version(conn) -> tuple[int, ...] | None:
    """The version of the vector extension installed in the database (None: not installed)."""
    row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    if row is None:
        return None
    return tuple(int(part) for part in re.findall(r"\d+", row[0]))


def _lock_key(*parts: str) -> int:
    """A signed 64-bit advisory-lock key for ``parts`` (stable across processes)."""
    digest = hashlib.sha256(":".join(("densefit", *parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


# -- filters: the parsed filter emitted as SQL over the typed fields -------------------------


def where_clause(filters: Filter | dict | None):
    """``(sql, params)``: a ``WHERE`` clause over the documents' ``fields`` that is true
    exactly for the documents ``filters`` (parsed, or a dict parsed for this engine) match,
    with the embedded store's semantics: values bound as parameters, field names (checked
    by the parse) quoted as literals of a JSON path. ``TRUE`` for no filter.

    >>> clause, params = where_clause({"field": "meta.n", "operator": "in", "value": [1, "a"]})
    >>> clause.as_string(), params
    ("((fields -> 'meta.n' ->> 's') = ANY(%s) OR ((fields -> 'meta.n' ->> 'n')::float8) = ANY(%s))", [['a'], [1.0]])
    """
    parsed = parse_filters(filters, CAPABILITIES)
    if parsed is None:
        return _psycopg().sql.SQL("TRUE"), []
    emitter = _Where()
    return _psycopg().sql.SQL(emit(parsed, emitter)), emitter.params


def _typed(field: str, part: str) -> str:
    """SQL of the typed value ``part`` (``s`` string, ``n`` number, ``d`` date, ``j`` JSON)
    of a document's filter field (NULL where the field has none)."""
    text = f"(fields -> {_quoted(field)} ->> '{part}')"
    return f"({text}::float8)" if part in ("n", "d") else text


def _quoted(name: str) -> str:
    """A checked field name as an SQL string literal."""
    return "'" + name.replace("'", "''") + "'"


class _Where:
    """The filter emitter (:class:`~densefit.retrieval.index.filters.Emitter`): SQL text
    over the typed fields (plain strings: psycopg's composition costs 0.2 ms a comparison),
    its parameters, bound as ``%s``, collected in ``params``."""

    def __init__(self) -> None:
        self.params: list = []

    def compare(self, c: Comparison) -> str:
        if c.operator == "==":
            return self._equal(c.field, c.value)
        return self._member(c.field, c.value) if c.operator == "in" else self._ordering(c)

    def negate(self, clause: str) -> str:
        return f"NOT COALESCE({clause}, FALSE)"  # a missing field compares as NULL: false

    def all_of(self, clauses: list[str]) -> str:
        return "(" + " AND ".join(clauses) + ")" if clauses else "TRUE"

    def any_of(self, clauses: list[str]) -> str:
        return "(" + " OR ".join(clauses) + ")" if clauses else "FALSE"

    def _bound(self, field: str, part: str, operator: str, value, param: str = "%s") -> str:
        self.params.append(value)
        return f"{_typed(field, part)} {operator} {param}"

    def _equal(self, field: str, value: Any) -> str:
        if value is None:  # a missing or null field has no entry
            return f"NOT (fields ? {_quoted(field)})"
        if isinstance(value, (list, dict)):
            return self._bound(field, "j", "=", json_text(value))
        if isinstance(value, (bool, int, float)):  # numbers and bools (1 == True), no strings
            return self._bound(field, "n", "=", float(value))
        return self._bound(field, "s", "=", value)  # a string (the parse let nothing else in)

    def _member(self, field: str, values: list) -> str:
        strings = [v for v in values if isinstance(v, str)]
        numbers = [float(v) for v in values if isinstance(v, (bool, int, float))]
        parts = [self._bound(field, "s", "=", strings, "ANY(%s)")] if strings else []
        if numbers:
            parts.append(self._bound(field, "n", "=", numbers, "ANY(%s)"))
        parts += [self._equal(field, v) for v in values if not isinstance(v, (str, int, float))]
        return self.any_of(parts) if len(parts) != 1 else parts[0]

    def _ordering(self, c: Comparison) -> str:
        if c.value is None:
            return "FALSE"  # Haystack: None is not ordered
        if isinstance(c.value, str):  # an ISO date: documents whose value is a date string
            seconds = date_seconds(c.value, f"{c.field} {c.operator}")
            return self._bound(c.field, "d", c.operator, seconds)
        return self._bound(c.field, "n", c.operator, float(c.value))  # numbers, bools (1, 0)


# -- the store ------------------------------------------------------------------------------


class _Names:
    """The tables, sequence and indexes of one store, as SQL identifiers."""

    def __init__(self, table: str):
        identifier = _psycopg().sql.Identifier
        self.table, self.seq_name = table, f"{table}_seq"
        self.docs, self.seq = identifier(table), identifier(self.seq_name)
        self.postings = identifier(f"{table}_postings")
        self.stats = identifier(f"{table}_stats")
        self.record = identifier(f"{table}_record")

    def sql(self, template: str, *args, **parts):
        """``template`` as SQL: ``{docs}``, ``{postings}``, ``{stats}``, ``{record}`` and
        ``{seq}`` name this store's tables and sequence, other fields are filled from
        ``args`` and ``parts`` (composed SQL)."""
        names = {"docs": self.docs, "postings": self.postings, "stats": self.stats}
        names.update(record=self.record, seq=self.seq, **parts)
        return _psycopg().sql.SQL(template).format(*args, **names)

    def index(self, suffix: str):
        return _psycopg().sql.Identifier(f"{self.table}_{suffix}")

    def vectors_name(self, generation: int) -> str:
        return f"{self.table}_v{int(generation)}"

    def vectors(self, generation: int):
        return _psycopg().sql.Identifier(self.vectors_name(generation))

    def hnsw_name(self, generation: int) -> str:
        return f"{self.vectors_name(generation)}_hnsw"

    def hnsw(self, generation: int):
        return _psycopg().sql.Identifier(self.hnsw_name(generation))


def _hnsw_spec(record: StoreRecord, version: tuple[int, ...]) -> tuple[str, str] | None:
    """``(column, operator class)`` of the HNSW index of ``record``'s vectors on pgvector
    ``version``; None where pgvector has none."""
    kind = record.vector_kind
    if record.dim > _HNSW_MAX_DIM[kind] or (kind == "binary" and version < _HALFVEC):
        return None
    return {
        "float32": ("embedding", "vector_ip_ops"),
        "float16": ("embedding", "halfvec_ip_ops"),
        "binary": ("code", "bit_hamming_ops"),  # pgvector >= 0.7
    }[kind]


def _vector_table_sql(names: _Names, generation: int, record: StoreRecord):
    """``CREATE TABLE`` of a vector table of ``record``'s vectors: ``seq``, the vector and a
    binary store's code."""
    kind, dim = record.vector_kind, int(record.dim)
    vector = f"{'halfvec' if kind == 'float16' else 'vector'}({dim})"
    code = f", code bit({dim}) NOT NULL" if kind == "binary" else ""
    return names.sql(
        f"CREATE TABLE {{}} (seq int8 PRIMARY KEY, embedding {vector} NOT NULL{code})",
        names.vectors(generation),
    )


def _hnsw_sql(names: _Names, generation: int, spec: tuple[str, str], *, concurrently: bool):
    column, ops = spec
    return names.sql(
        f"CREATE INDEX {'CONCURRENTLY ' if concurrently else ''}{{}} ON {{}} "
        f"USING hnsw ({column} {ops})",
        names.hnsw(generation),
        names.vectors(generation),
    )


def _build_memory(rows: int, dim: int, kind: str) -> int:
    """Bytes of ``maintenance_work_mem`` that hold the HNSW graph of ``rows`` vectors (the
    vector or code, and pgvector's element with its neighbour lists at m = 16), within
    :data:`_BUILD_MEMORY`: a graph that fits is built several times faster."""
    vector = dim // 8 + 8 if kind == "binary" else dim * (2 if kind == "float16" else 4) + 8
    low, high = _BUILD_MEMORY
    return int(min(high, max(low, rows * (vector + 1024) * 5 // 4)))


def _copy(cur, into, types: list[str], rows) -> None:
    """COPY ``rows`` (of the PostgreSQL ``types``) into ``into`` (a table and its columns)."""
    with cur.copy(_psycopg().sql.SQL("COPY {} FROM STDIN (FORMAT BINARY)").format(into)) as writer:
        writer.set_types(types)
        for row in rows:
            writer.write_row(row)


class PostgresStore(SwapCoordinator, DatabaseStore):
    """A densefit store in a PostgreSQL table (see the module docstring); get one from
    :func:`~densefit.retrieval.index.engines.open_store` with a ``postgresql://`` target."""

    capabilities = CAPABILITIES

    def __init__(self, target: Target, conn, *, backend: str, rescore: int | None = None):
        super().__init__()
        self.location, self._target, self._conn = target.location, target, conn
        self._faults = _faults(target.location)
        self._names, self.backend_name = _Names(target.table), backend
        self._write_key = _lock_key(target.table, "write")
        self._build_key = _lock_key(target.table, "build")  # held while an index is built
        self._meta: dict[str, str] = {}
        self._loading = 0  # writer locks this object holds: its writes are a load's
        self.pgvector_version = _pgvector_version(conn)
        self._read_record()
        kind = self._record.vector_kind  # a table another densefit may have written
        require(CAPABILITIES, "vector_kinds", f"read {kind} vectors", kind, self.location)
        self.rescore = checked_rescore(rescore, kind, self.location)
        if self._unused:
            self._drop_unused()

    # -- connection and transactions ------------------------------------------------------

    def _connection(self):
        if self._conn is None:
            raise StoreError(f"{self.location}: the store is closed")
        if self._conn.closed or _dropped(self._conn):  # lost (the server restarted)
            self._conn.close()
            self._conn = _connect(self._target)
        return self._conn

    @contextmanager
    def _snapshot(self) -> Iterator:
        """A cursor reading one consistent snapshot (REPEATABLE READ), or in the transaction
        already open (a search's parts read the same state), holding the object's lock (its
        connection is shared by a server's threads). The snapshot is taken after a share
        lock on the record table: what drops a vector table holds that table exclusively, so
        a snapshot never names a table that is gone."""
        with self._lock:
            conn = self._connection()
            if conn.info.transaction_status != _psycopg().pq.TransactionStatus.IDLE:
                with conn.cursor(binary=True) as cur:
                    yield cur
                return
            with self._errors(), conn.transaction(), conn.cursor(binary=True) as cur:
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                cur.execute(self._names.sql("LOCK TABLE {record} IN ACCESS SHARE MODE"))
                yield cur

    def _rows(self, template: str, params: Sequence = (), *, live: bool = False, **parts):
        """The rows of the query ``template`` (:meth:`_Names.sql`, ``parts`` filling its other
        fields) read in a snapshot; ``live``: with the record read, ``{vectors}`` is the live
        vector table, ``{embedding}`` its vectors as float32 and ``{pending}`` true for a
        document ``d`` the swap under way has no vector of (:meth:`_without_next`)."""
        with self._snapshot() as cur:
            if live:
                self._load(cur)
                embedding = _psycopg().sql.SQL(self._float32_embedding())
                pending = self._without_next(self._swap)
                parts.update(vectors=self._vectors(), embedding=embedding, pending=pending)
            return cur.execute(self._names.sql(template, **parts), params).fetchall()

    @contextmanager
    def _writing(self) -> Iterator:
        """A cursor in a write transaction holding the table's write lock (writers one at a
        time, so the counts stay exact); committed when the block ends, else rolled back."""
        with self._lock:
            conn = self._connection()
            with self._errors(), conn.transaction(), conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_xact_lock(%s)", (self._write_key,))
                yield cur

    def _exclusive(self, work: Callable[[Any], bool]) -> bool:
        """Whether ``work(cursor)`` did something, run in a write transaction that also holds
        the record table exclusively (every read waits until it commits): what dropping a
        vector table or index needs. Skipped (False) while an index is being built (its
        build must not wait on a drop), or when searches hold the record longer than
        :data:`_DROP_WAIT`."""
        with self._writing() as cur:
            if not _try_lock(cur, self._build_key, xact=True):
                return False
            try:
                with cur.connection.transaction():  # a savepoint: a wait given up rolls back to it
                    cur.execute("SELECT set_config('lock_timeout', %s, TRUE)", (_DROP_WAIT,))
                    cur.execute(self._names.sql("LOCK TABLE {record} IN ACCESS EXCLUSIVE MODE"))
                    self._load(cur)
                    return bool(work(cur))
            except _psycopg().errors.LockNotAvailable:
                return False

    # -- the record ------------------------------------------------------------------------

    def _load(self, cur) -> None:
        """Read the record in ``cur``'s transaction and make this object's view of it
        current: the model, the live vector table, the swap under way."""
        meta = dict(cur.execute(self._names.sql("SELECT key, value FROM {record}")).fetchall())
        if meta == self._meta:
            return
        self._take_record(meta)
        self._meta = meta
        self._generation = int(meta.get("generation", "0"))
        self._unused = [int(g) for g in json.loads(meta.get(UNUSED_KEY, "[]"))]
        self._deferred = meta.get(INDEX_KEY) == DEFERRED

    def _read_record(self) -> None:
        with self._snapshot() as cur:
            self._load(cur)

    def _set_meta(self, cur, values: dict[str, str], drop: Sequence[str] = ()) -> None:
        """Write ``values`` into the record and remove the keys ``drop`` (in ``cur``'s
        transaction)."""
        if values:
            cur.executemany(
                self._names.sql(
                    "INSERT INTO {record} (key, value) VALUES (%s, %s) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
                ),
                [(k, str(v)) for k, v in values.items()],
            )
        if drop:
            cur.execute(self._names.sql("DELETE FROM {record} WHERE key = ANY(%s)"), (list(drop),))

    def _save_settings(self, settings: VectorSettings) -> None:
        with self._writing() as cur:
            self._set_meta(cur, settings.to_meta())
        self._read_record()

    def _vectors(self):
        """The live vector table (of the record last read)."""
        return self._names.vectors(self._generation)

    def _float32_embedding(self) -> str:
        """SQL for a row's embedding as float32 (``vector``)."""
        if self._record.vector_kind == "float16":
            return f"embedding::vector({int(self._record.dim)})"
        return "embedding"

    # -- reading ---------------------------------------------------------------------------

    def count(self) -> int:
        return int(self._rows("SELECT documents FROM {stats}")[0][0])

    def count_matching(self, filters: Filter | dict | None = None) -> int:
        where, params = where_clause(filters)
        query = "SELECT count(*) FROM {docs} WHERE {where}"
        return int(self._rows(query, params, where=where)[0][0])

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        ids = list(ids)
        rows = self._rows("SELECT id, text, title, meta FROM {docs} WHERE id = ANY(%s)", (ids,))
        found = {row[0]: Document(*row) for row in rows}
        return [found.get(i) for i in ids]

    def hashes(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        query = "SELECT id, text_hash, meta_hash FROM {docs} WHERE id = ANY(%s)"
        return {i: (th, mh) for i, th, mh in self._rows(query, (list(ids),))}

    def _ids_after(self, last: str, limit: int) -> list[str]:
        query = "SELECT id FROM {docs} WHERE id > %s ORDER BY id LIMIT %s"
        return [i for (i,) in self._rows(query, (last, limit))]

    def vectors(self, ids: Sequence[str]) -> np.ndarray:
        ids = list(ids)
        query = "SELECT d.id, {embedding} FROM {docs} d JOIN {vectors} USING (seq) "
        with self._lock:  # the dimension of the record the rows were read with
            rows = self._rows(query + "WHERE d.id = ANY(%s)", (ids,), live=True)
            return ordered_vectors(ids, {i: v.to_numpy() for i, v in rows}, self.dim)

    def vectors_for_texts(self, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """A current (not stale) stored vector per text hash, the earliest written."""
        query = (
            "SELECT DISTINCT ON (d.text_hash) d.text_hash, {embedding} FROM {docs} d JOIN "
            "{vectors} USING (seq) WHERE d.text_hash = ANY(%s) AND NOT d.stale "
            "ORDER BY d.text_hash, seq"
        )
        rows = self._rows(query, (list(set(hashes)),), live=True)
        return {h: v.to_numpy().astype(np.float32) for h, v in rows}

    def filter_documents(self, filters: Filter | dict | None = None) -> list[Document]:
        """The matches in write order (an updated document counts as written last)."""
        where, params = where_clause(filters)
        query = "SELECT id, text, title, meta FROM {docs} WHERE {where} ORDER BY seq"
        return [Document(*row) for row in self._rows(query, params, where=where)]

    def index_meta_field(self, field: str) -> None:
        """Expression indexes on the metadata field ``field`` (``"meta.lang"``): its string
        and its number, which ``==``, ``in`` and ``>``-style filters compare. Idempotent."""
        meta_path(field)  # the name checked as filters check theirs
        name = hashlib.sha256(field.encode("utf-8")).hexdigest()[:12]
        with self._writing() as cur:
            for part in ("s", "n"):
                index = self._names.index(f"f{name}{part}")
                typed = _psycopg().sql.SQL(_typed(field, part))
                cur.execute(
                    self._names.sql("CREATE INDEX IF NOT EXISTS {} ON {docs} (({}))", index, typed)
                )

    def _info_extra(self) -> dict:
        return {"hnsw_deferred": self._deferred}  # whether the index waits for a load to end

    # -- stale vectors (--reembed) -----------------------------------------------------------

    def _mark_stale(self) -> None:
        with self._writing() as cur:
            cur.execute(self._names.sql("UPDATE {docs} SET stale = TRUE"))

    def _stale(self, ids: list[str] | None) -> list[str]:
        among = "" if ids is None else " AND id = ANY(%s)"
        query = f"SELECT id FROM {{docs}} WHERE stale{among} ORDER BY seq"
        return [i for (i,) in self._rows(query, [] if ids is None else [list(ids)])]

    # -- writing ---------------------------------------------------------------------------

    def _before_write(self, rows: list[StoredRow], prepared_for: int) -> None:
        if len(rows) >= BULK_MIN:  # a load, if the store holds no more: the index waits
            self._defer_index(len(rows), prepared_for)

    def _upsert(
        self, cur, rows: list[StoredRow], vectors: np.ndarray, next_vectors: np.ndarray | None
    ) -> set[str]:
        """Delete the documents' old rows, vectors (current and next) and postings, COPY
        the new ones in with new ``seq`` values, update the counts."""
        names = self._names
        texts = [_checked_text(r.document) for r in rows]
        metas = [_checked_meta(r.document) for r in rows]
        tokens = Tokens.of(texts)  # BM25's postings: (document, token, tf) and lengths
        (positions, ids, tfs), lengths = tokens.pairs(), np.diff(tokens.indptr)
        old = self._drop_rows(cur, [r.document.id for r in rows])
        cur.execute(
            "SELECT nextval(%s::regclass) FROM generate_series(1, %s)",
            (names.seq_name, len(rows)),
        )
        seqs = sorted(s for (s,) in cur.fetchall())
        _copy(
            cur,
            names.sql("{docs} (id, seq, text, title, meta, fields, text_hash, meta_hash, length)"),
            ["text", "int8", "text", "text", "jsonb", "jsonb", "text", "text", "int4"],
            [
                (r.document.id, seq, text, r.document.title or "", meta, r.fields)
                + (r.text_hash, r.meta_hash, int(n))
                for r, seq, text, meta, n in zip(rows, seqs, texts, metas, lengths)
            ],
        )
        self._copy_vectors(cur, self._vectors(), seqs, vectors)
        if next_vectors is not None:
            self._copy_vectors(cur, names.vectors(self._swap.generation), seqs, next_vectors)
        if len(ids):
            words = np.array(tokens.vocab, dtype=object)[ids].tolist()
            doc_seqs = np.asarray(seqs, dtype=np.int64)[positions].tolist()
            postings = zip(words, doc_seqs, tfs.tolist(), lengths[positions].tolist())
            types = ["text", "int8", "int4", "int4"]
            _copy(cur, names.sql("{postings} (token, seq, tf, length)"), types, postings)
        self._count(cur, len(rows) - len(old), int(lengths.sum()) - sum(n for _, _, n in old))
        return {doc_id for doc_id, _, _ in old}

    def _count(self, cur, documents: int, tokens: int) -> None:
        """Add ``documents`` and ``tokens`` (negative: take away) to BM25's counts."""
        query = "UPDATE {stats} SET documents = documents + %s, tokens = tokens + %s"
        cur.execute(self._names.sql(query), (documents, tokens))

    def _after_write(self) -> None:
        """The HNSW index a write deferred, built now unless a load (a writer lock) goes on."""
        if self._deferred and not self._loading:
            self.flush()

    def _copy_vectors(self, cur, table, seqs: Sequence[int], vectors: np.ndarray) -> None:
        """COPY ``(seq, vector[, code])`` rows into the vector table ``table`` (this store's
        vector kind: a model swap keeps it)."""
        pgvector = _pgvector()
        kind = self._record.vector_kind
        half = kind == "float16"
        vector = pgvector.HalfVector if half else pgvector.Vector
        rows = [(int(seq), vector(v)) for seq, v in zip(seqs, vectors)]
        columns, types = "seq, embedding", ["int8", "halfvec" if half else "vector"]
        if kind == "binary":
            rows = [(*row, code) for row, code in zip(rows, _codes(vectors))]
            columns, types = columns + ", code", [*types, "bit"]
        _copy(cur, self._names.sql(f"{{}} ({columns})", table), types, rows)

    def _set_metadata(self, cur, documents: list[Document]) -> int:
        jsonb, changed = _psycopg().types.json.Jsonb, 0
        query = self._names.sql(
            "UPDATE {docs} SET title = %s, meta = %s, meta_hash = %s, "
            "fields = jsonb_build_object('content', fields -> 'content') || %s WHERE id = %s"
        )
        for doc in documents:
            fields = typed_fields(doc.id, "", doc.title or "", doc.meta or {})
            del fields["content"]  # the stored text's entry stays
            meta, meta_hash = jsonb(_checked_meta(doc)), StoredRow.of(doc).meta_hash
            row = (doc.title or "", meta, meta_hash, jsonb(fields), doc.id)
            changed += cur.execute(query, row).rowcount
        return changed

    def _remove(self, cur, ids: list[str]) -> int:
        gone = self._drop_rows(cur, ids)
        if gone:
            self._count(cur, -len(gone), -sum(n for _, _, n in gone))
        return len(gone)

    def _drop_rows(self, cur, ids: list[str]) -> list[tuple[str, int, int]]:
        """Delete the documents ``ids`` with their postings and vectors (current and next);
        ``(id, seq, length)`` of those that were stored."""
        names = self._names
        query = names.sql("DELETE FROM {docs} WHERE id = ANY(%s) RETURNING id, seq, length")
        gone = cur.execute(query, (ids,)).fetchall()
        if gone:
            seqs = [seq for _, seq, _ in gone]
            tables = [names.postings, self._vectors()]
            if self._swap is not None:  # a rewritten document's next vector is its old text's
                tables.append(names.vectors(self._swap.generation))
            for table in tables:
                cur.execute(names.sql("DELETE FROM {} WHERE seq = ANY(%s)", table), (seqs,))
        return gone

    @contextmanager
    def writer_lock(
        self, timeout: float | None = None, *, name: str | None = None, doing: str | None = None
    ) -> Iterator[None]:
        """Hold the store's lock ``name`` (the writer lock by default) across processes: a
        session-level advisory lock keyed by the table and ``name``, on a connection of its
        own whose application name says who holds it, which the server drops when its holder
        exits, killed or not. While this object holds the writer lock its writes are a
        load's (:meth:`flush` builds the index)."""
        name = name or LOCK_NAME
        key = _lock_key(self._target.table, name)
        load = int(name == LOCK_NAME)  # 1: while it is held, this object's writes are a load's
        conn = _connect(self._target)
        try:
            since = time.strftime("%H:%M:%S")
            me = f"densefit pid {os.getpid()} on {socket.gethostname()} since {since}"[:63]
            conn.execute("SELECT set_config('application_name', %s, FALSE)", (me,))
            lock, holder = partial(_try_lock, conn, key), partial(_holder, conn, key)
            wait_for_lock(lock, holder, self.location, doing or "writing to this store", timeout)
            with self._lock:
                self._loading += load
            try:
                yield
            finally:
                with self._lock:
                    self._loading -= load
        finally:
            conn.close()  # the server drops the lock with the session

    # -- the HNSW index: deferred by a load, built in one pass ------------------------------

    def _defer_index(self, n: int, prepared_for: int) -> None:
        """Drop the live table's HNSW index when ``n`` documents are at least as many as the
        store holds (a load), and record it deferred, in one transaction."""
        if _hnsw_spec(self._record, self.pgvector_version) is None:
            return

        def drop(cur) -> bool:
            if self._deferred or self.model_generation != prepared_for:
                return False
            cur.execute(self._names.sql("SELECT documents FROM {stats}"))
            if n < int(cur.fetchone()[0]):
                return False
            cur.execute(
                self._names.sql("DROP INDEX IF EXISTS {}", self._names.hnsw(self._generation))
            )
            self._set_meta(cur, {INDEX_KEY: DEFERRED})
            return True

        self._exclusive(drop)

    def flush(self) -> None:
        """Build the live table's HNSW index if a load deferred it, then record it built
        (documents are durable once written)."""
        with self._lock:
            self._read_record()
            deferred, generation, record = self._deferred, self._generation, self._record
        if not deferred or not self._build_index(generation, record):
            return
        with self._writing() as cur:
            self._load(cur)
            name = self._names.hnsw_name(generation)
            if self._generation == generation and _index_valid(cur.connection, name):
                self._set_meta(cur, {}, drop=[INDEX_KEY])
        self._read_record()

    def _build_index(self, generation: int, record: StoreRecord) -> bool:
        """Build the HNSW index of vector table ``generation`` (of ``record``'s vectors)
        unless it is built: ``CREATE INDEX CONCURRENTLY`` (searches and writes go on) on a
        connection of its own, under the table's build lock, ``maintenance_work_mem`` raised
        to hold the graph. Whether the index exists (False: pgvector has none for these
        vectors, or the table is gone)."""
        spec = _hnsw_spec(record, self.pgvector_version)
        if spec is None:
            return False
        names = self._names
        conn = _connect(self._target)
        try:
            with self._errors():
                while not _try_lock(conn, self._build_key):  # another process builds
                    time.sleep(0.05)
                if not _exists(conn, names.vectors_name(generation)):
                    return False
                valid = _index_valid(conn, names.hnsw_name(generation))
                if valid:
                    return True
                if valid is False:  # a build that was killed leaves an invalid index
                    conn.execute(
                        names.sql("DROP INDEX CONCURRENTLY IF EXISTS {}", names.hnsw(generation))
                    )
                query = names.sql("SELECT count(*) FROM {}", names.vectors(generation))
                rows = conn.execute(query).fetchone()[0]
                conn.execute(  # kB, as pg_settings gives it; raised, never lowered
                    "SELECT set_config(name, GREATEST(%s, setting::int8) || 'kB', FALSE) "
                    "FROM pg_settings WHERE name = 'maintenance_work_mem'",
                    (_build_memory(rows, record.dim, record.vector_kind) // 1024,),
                )
                conn.execute(_hnsw_sql(names, generation, spec, concurrently=True))
                return True
        finally:
            conn.close()  # the build lock goes with the session

    # -- a model swap: the next generation's vector table -----------------------------------
    # SwapCoordinator (densefit.retrieval.index.swap) runs the swap over these primitives: the
    # new model's vectors fill the next generation's table (no index while it fills), and the
    # switch points the record at it in one transaction; unused tables are dropped after.

    @contextmanager
    def _swap_transaction(self) -> Iterator:
        try:
            with self._writing() as cur:
                self._load(cur)
                yield cur
        except BaseException:
            self._meta = {}  # what this object noted in a rolled-back transaction: read again
            raise

    def _save_swap(self, cur, swap: SwapTarget | None) -> None:
        if swap is None:
            self._set_meta(cur, {}, drop=[SWAP_KEY])
        else:
            self._set_meta(cur, {SWAP_KEY: swap.to_json()})

    def _create_generation(self, cur, record: StoreRecord, generation: int | None) -> int:
        names = self._names
        if generation is None:
            generation = 1 + max([self._generation, *self._unused])
            while _exists(cur.connection, names.vectors_name(generation)):  # not ours
                generation += 1
        elif _exists(cur.connection, names.vectors_name(generation)):
            return generation
        cur.execute(_vector_table_sql(names, generation, record))
        return generation

    def _drop_generation(self, cur, swap: SwapTarget) -> None:
        self._unused = [*self._unused, swap.generation]  # dropped by _swap_changed
        self._set_meta(cur, {UNUSED_KEY: json.dumps(self._unused)})

    def _without_next(self, swap: SwapTarget | None):
        """SQL true for a document ``d`` with no vector in ``swap``'s table (None: false)."""
        if swap is None:
            return _psycopg().sql.SQL("FALSE")
        query = "NOT EXISTS (SELECT 1 FROM {} n WHERE n.seq = d.seq)"
        return self._names.sql(query, self._names.vectors(swap.generation))

    # {pending}: for the swap that the record read in the open transaction (or a snapshot) names
    def _pending_rows(self, swap: SwapTarget, after_row: int, limit: int) -> list:
        query = "SELECT d.seq, d.id, d.text FROM {docs} d WHERE d.seq > %s AND {pending} "
        rows = self._rows(query + "ORDER BY d.seq LIMIT %s", (after_row, limit), live=True)
        return [(int(s), i, t) for s, i, t in rows]

    def _count_pending(self, swap: SwapTarget) -> int:
        return int(self._rows("SELECT count(*) FROM {docs} d WHERE {pending}", live=True)[0][0])

    def _put_next(self, cur, swap: SwapTarget, pending: list, vectors: np.ndarray) -> int:
        query = "SELECT d.seq, d.id FROM {docs} d WHERE d.seq = ANY(%s) AND {pending}"
        current = dict(self._rows(query, ([row for row, _ in pending],), live=True))
        keep = [k for k, (row, i) in enumerate(pending) if current.get(row) == i]
        if keep:
            next_table = self._names.vectors(swap.generation)
            self._copy_vectors(cur, next_table, [pending[k][0] for k in keep], vectors[keep])
        return len(keep)

    def _before_switch(self, swap: SwapTarget) -> bool:
        """Build the next table's HNSW index before the switch (writes and searches go on)."""
        if self._count_pending(swap):
            return False
        self._build_index(swap.generation, swap.record)
        return True

    def _switch(self, cur, swap: SwapTarget) -> None:
        values = switched_meta(swap, self.model_generation)
        values[UNUSED_KEY] = json.dumps([*self._unused, self._generation])
        self._set_meta(cur, values, drop=[SWAP_KEY, INDEX_KEY])  # its index: built before
        cur.execute(self._names.sql("UPDATE {docs} SET stale = FALSE WHERE stale"))

    def _swap_changed(self) -> None:
        self._read_record()
        self._drop_unused()

    def _drop_unused(self) -> None:
        """Drop the vector tables the record lists as unused (a switched or cancelled
        swap's); left for the next time when an index build or a long search is in the way."""

        def drop(cur) -> bool:
            if not self._unused:
                return False
            for generation in self._unused:
                table = self._names.vectors(generation)
                cur.execute(self._names.sql("DROP TABLE IF EXISTS {}", table))
            self._set_meta(cur, {}, drop=[UNUSED_KEY])
            return True

        if self._exclusive(drop):
            self._read_record()

    # -- searching -------------------------------------------------------------------------

    _reading = _snapshot  # a search's parts read one snapshot

    _where = staticmethod(where_clause)

    def _dense(self, queries: np.ndarray, k: int, where) -> list[tuple[np.ndarray, np.ndarray]]:
        """The best ``k`` rows per query by inner product: through the HNSW index
        (``backend="hnsw"``, no filter, within ``hnsw.ef_search``'s range, the index built)
        or a scan of the (matching) rows. A binary store takes ``rescore x k`` candidates
        by the Hamming distance of the codes (its HNSW index on pgvector >= 0.7, else a
        scan) and ranks them by their float32 vectors."""
        pgvector = _pgvector()
        kind = self._record.vector_kind
        depth = k * self.rescore if kind == "binary" else k  # what the index must find
        exact = (
            self.backend_name == "exact"
            or where is not None
            or depth > _EF_SEARCH_MAX
            or _hnsw_spec(self._record, self.pgvector_version) is None
            or self._deferred  # a load has not built it yet
        )
        clause, params = where if where is not None else (_psycopg().sql.SQL("TRUE"), [])
        source = self._vectors()
        if where is not None:  # the filter's fields are the documents'
            source = self._names.sql("{} JOIN {docs} USING (seq)", source)
        if kind == "binary":
            hamming = "code <~> %s" if self.pgvector_version >= _HALFVEC else "bit_count(code # %s)"
            query = (
                "SELECT seq, embedding <#> %s FROM (SELECT seq, embedding FROM {} WHERE {} "
                f"ORDER BY {hamming}{', seq' if exact else ''} LIMIT %s) candidates "
                "ORDER BY embedding <#> %s, seq LIMIT %s"
            )
        else:  # a float16 index compares halfvec with halfvec
            score = f"{self._float32_embedding()} <#> %s"
            order = f"{score}, seq" if exact else "embedding <#> %s"
            query = f"SELECT seq, {score} FROM {{}} WHERE {{}} ORDER BY {order} LIMIT %s"
        query = self._names.sql(query, source, clause)
        settings = {"enable_indexscan": "off"}
        if not exact:
            settings = {"enable_seqscan": "off", "hnsw.ef_search": str(max(depth, _EF_SEARCH_MIN))}
        results = []
        with self._snapshot() as cur:
            for name, value in settings.items():
                cur.execute("SELECT set_config(%s, %s, TRUE)", (name, value))
            for q in queries:
                vector = pgvector.Vector(q)
                if kind == "binary":
                    values = [vector, *params, _codes(q[None, :])[0], depth, vector, k]
                else:
                    second = pgvector.HalfVector(q) if kind == "float16" and not exact else vector
                    values = [vector, *params, second, k]
                rows = cur.execute(query, values).fetchall()
                rows.sort(key=lambda row: (row[1], row[0]))  # ties in write order
                keys = np.array([seq for seq, _ in rows], dtype=np.int64)
                scores = -np.array([d for _, d in rows], dtype=np.float64)
                results.append((keys, scores.astype(np.float32)))
            for name in settings:  # BM25 and the hits read on in this transaction
                cur.execute(_psycopg().sql.SQL(f"RESET {name}"))
        return results

    def _lexical(self, texts: list[str], k: int, where) -> list[tuple[np.ndarray, np.ndarray]]:
        """BM25 of each text among the (matching) documents, computed from the postings in
        one query: bm25s's "lucene" scores, each (document, token) score rounded to float32
        as bm25s stores it, ties in write order; documents sharing no token are left out."""
        names = self._names
        source = names.sql("{postings} p")
        if where is not None:
            source = names.sql("{postings} p JOIN {docs} d ON d.seq = p.seq AND {}", where[0])
        query = names.sql(
            "WITH q(token, n) AS (SELECT * FROM unnest(%s::text[], %s::int4[])), "
            "s AS (SELECT documents::float8 AS n, tokens::float8 / NULLIF(documents, 0) AS avgdl "
            "FROM {stats}), "
            "w AS (SELECT q.token, q.n, ln(1 + (s.n - df.df + 0.5) / (df.df + 0.5))::float4 AS idf "
            "FROM q JOIN (SELECT token, count(*)::float8 AS df FROM {postings} "
            "WHERE token = ANY(%s::text[]) GROUP BY token) df USING (token) CROSS JOIN s) "
            "SELECT p.seq, sum(w.n * (w.idf::float8 * (p.tf / "
            "(p.tf + %s * (1 - %s + %s * p.length / s.avgdl))))::float4::float8)::float4 AS score "
            "FROM {source} JOIN w ON w.token = p.token CROSS JOIN s "
            "GROUP BY p.seq ORDER BY score DESC, p.seq LIMIT %s",
            source=source,
        )
        where_params = [] if where is None else where[1]
        results = []
        with self._snapshot() as cur:
            for tokens in tokenize(texts):
                counts = Counter(tokens)  # in the order of first occurrence
                if not counts:
                    results.append((np.zeros(0, np.int64), np.zeros(0, np.float32)))
                    continue
                unique = list(counts)
                params = [unique, [counts[t] for t in unique], unique, K1, B, B]
                rows = cur.execute(query, [*params, *where_params, k]).fetchall()
                keys = np.array([seq for seq, _ in rows], dtype=np.int64)
                results.append((keys, np.array([s for _, s in rows], dtype=np.float32)))
        return results

    def _documents_at(self, seqs: list[int]) -> dict[int, tuple[str, str, str, dict]]:
        query = "SELECT seq, id, text, title, meta FROM {docs} WHERE seq = ANY(%s)"
        return {seq: tuple(rest) for seq, *rest in self._rows(query, (seqs,))}

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent); documents are durable once written."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def drop(self) -> None:
        """Drop the store's tables (every generation's vectors too) and its sequence in one
        transaction, then close it."""
        names = self._names
        with self._writing() as cur:
            cur.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname ~ %s",
                (f"^{names.table}_v[0-9]+$",),
            )
            tables = [names.docs, names.postings, names.stats, names.record]
            tables += [_psycopg().sql.Identifier(name) for (name,) in cur.fetchall()]  # the vectors
            query = "DROP TABLE IF EXISTS {}; DROP SEQUENCE IF EXISTS {seq}"
            cur.execute(names.sql(query, _psycopg().sql.SQL(", ").join(tables)))
        self.close()


def _checked_text(document: Document) -> str:
    """The document's text, or a ValueError naming it where it holds a NUL character."""
    for name, value in (("id", document.id), ("text", document.text), ("title", document.title)):
        if value and "\x00" in value:
            raise ValueError(_NUL.format(document.id, name))
    return document.text


def _checked_meta(document: Document) -> dict:
    """The metadata as stored (:func:`~densefit.retrieval.index.database.stored_meta`), or a
    ValueError naming the document where it holds a NUL character (NaN and infinities:
    refused before, by every engine)."""
    meta = stored_meta(document.meta)
    if "\\u0000" in json.dumps(meta):
        raise ValueError(_NUL.format(document.id, "metadata"))
    return meta


def _codes(vectors: np.ndarray) -> list:
    """Each vector's sign bits (``x > 0``, as the embedded store's binary codes) as
    pgvector's ``Bit``."""
    pgvector = _pgvector()
    return [pgvector.Bit(row) for row in np.asarray(vectors) > 0]


def _try_lock(conn, key: int, *, xact: bool = False) -> bool:
    """Whether the advisory lock ``key`` was free and is now held: until the transaction
    ends (``xact``) or the session does."""
    function = "pg_try_advisory_xact_lock" if xact else "pg_try_advisory_lock"
    return bool(conn.execute(f"SELECT {function}(%s)", (key,)).fetchone()[0])


def _holder(conn, key: int) -> str:
    """Who holds the advisory lock ``key``: its connection's application name."""
    row = conn.execute(
        "SELECT a.application_name, a.client_addr::text, a.pid FROM pg_locks l "
        "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted "
        "AND l.classid::int8 = %s AND l.objid::int8 = %s AND l.objsubid = 1",
        ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
    ).fetchone()
    if row is None:
        return "unknown"
    application, address, pid = row
    return application or f"server process {pid}" + (f" for {address}" if address else "")


# -- the engine's functions (densefit.retrieval.index.engines) ---------------------------------


def open_existing(target: str, *, backend=None, rescore=None, **_) -> PostgresStore | None:
    """The store in the target's table; None when the database holds none there;
    StoreError when the table exists but is not a densefit store, or the server cannot be
    reached. ``lock_timeout`` does not apply."""
    return _open(target, None, backend, rescore, None)


def create(
    target: str,
    record: StoreRecord,
    *,
    backend: str | None = None,
    rescore: int | None = None,
    lock_timeout: float | None = None,
) -> PostgresStore:
    """A new store in the target's table for ``record``'s vectors (a kind ``open_store``
    checked), made in one transaction under a database-wide advisory lock (waiting up to
    ``lock_timeout`` seconds): concurrent creators make it once, the others open it."""
    return _open(target, record, backend, rescore, lock_timeout)


def _open(target, record: StoreRecord | None, backend, rescore, lock_timeout):
    parsed = parse_target(target)  # the backend: checked by open_store
    if record is not None:
        checked_rescore(rescore, record.vector_kind, parsed.location)
    conn = _connect(parsed)
    try:
        if record is not None:
            registered = _pgvector_version(conn) is not None  # _connect registered its types
            with conn.transaction():  # one creator at a time in the database
                key = _lock_key("create")
                lock, holder = partial(_try_lock, conn, key, xact=True), partial(_holder, conn, key)
                wait_for_lock(lock, holder, parsed.location, "creating a store", lock_timeout)
                _create_tables(conn, parsed, record)
            if not registered:  # the extension is new: register its types on a new connection
                conn.close()
                conn = _connect(parsed)
        elif not _exists(conn, f"{parsed.table}_record"):
            _check_free(conn, parsed, parsed.table)
            conn.close()
            return None
        backend = backend or CAPABILITIES.backends[0]
        return PostgresStore(parsed, conn, backend=backend, rescore=rescore)
    except BaseException:
        conn.close()
        raise


def _exists(conn, relation: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (relation,)).fetchone()[0]


def _check_free(conn, target: Target, table: str) -> None:
    """StoreError when ``table`` exists (not as part of a densefit store)."""
    if _exists(conn, table):
        raise StoreError(
            f"{target.location}: table {table} exists and is not a densefit store: "
            "name another table in the target (postgresql://.../DATABASE/TABLE)"
        )


def _index_valid(conn, index: str) -> bool | None:
    """Whether the index ``index`` is valid (usable by searches); None when there is none."""
    row = conn.execute(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", (index,)
    ).fetchone()
    return None if row is None else bool(row[0])


def _create_tables(conn, target: Target, record: StoreRecord) -> None:
    """Create the store's tables inside the caller's transaction (nothing when another
    process created them first)."""
    names = _Names(target.table)
    if _exists(conn, f"{target.table}_record"):
        return
    _check_free(conn, target, target.table)
    version = _pgvector_version(conn)
    if version is None:
        no_pgvector = Fault(
            _psycopg().Error,
            f"{target.location}: the database has no pgvector and this user cannot add it "
            "({detail}): install pgvector on the server and run CREATE EXTENSION vector in "
            "the database as its owner",
        )
        with translated([no_pgvector]), conn.transaction():
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        version = _pgvector_version(conn)
    if record.vector_kind == "float16" and version < _HALFVEC:
        raise CapabilityError(
            f"{target.location}: the server's pgvector {'.'.join(map(str, version))} has no "
            "halfvec type (0.7 added it): store float32 vectors, or upgrade pgvector"
        )
    _check_free(conn, target, names.vectors_name(0))
    conn.execute(
        names.sql(
            "CREATE SEQUENCE {seq}; "
            'CREATE TABLE {docs} (id text COLLATE "C" PRIMARY KEY, seq int8 NOT NULL, '
            "text text NOT NULL, title text NOT NULL, meta jsonb NOT NULL, "
            "fields jsonb NOT NULL, text_hash text NOT NULL, meta_hash text NOT NULL, "
            "stale boolean NOT NULL DEFAULT FALSE, length int4 NOT NULL); "
            "CREATE UNIQUE INDEX {by_seq} ON {docs} (seq); "
            "CREATE INDEX {text_hash} ON {docs} (text_hash); "
            'CREATE TABLE {postings} (token text COLLATE "C" NOT NULL, seq int8 NOT NULL, '
            "tf int4 NOT NULL, length int4 NOT NULL, PRIMARY KEY (token, seq)); "
            "CREATE INDEX {postings_seq} ON {postings} (seq); "
            "CREATE TABLE {stats} (one boolean PRIMARY KEY DEFAULT TRUE CHECK (one), "
            "documents int8 NOT NULL, tokens int8 NOT NULL); "
            "INSERT INTO {stats} (documents, tokens) VALUES (0, 0); "
            "CREATE TABLE {record} (key text PRIMARY KEY, value text NOT NULL)",
            **{part: names.index(part) for part in ("by_seq", "text_hash", "postings_seq")},
        )
    )
    conn.execute(_vector_table_sql(names, 0, record))
    spec = _hnsw_spec(record, version)
    if spec is not None:
        conn.execute(_hnsw_sql(names, 0, spec, concurrently=False))
    with conn.cursor() as cur:
        cur.executemany(
            names.sql("INSERT INTO {record} (key, value) VALUES (%s, %s)"),
            list({**record.to_meta(), MODEL_GENERATION_KEY: "0"}.items()),
        )
