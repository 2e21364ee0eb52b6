"""The PostgreSQL engine: documents, vectors and BM25 postings in tables of a PostgreSQL
database with the pgvector extension (``pip install 'densefit[postgres]'``).

A target names the server, the database and the table::

    postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE/TABLE[?params]

(``postgres://`` too; libpq's query parameters such as ``?host=/run/postgresql`` or
``?sslmode=require`` pass through; TABLE defaults to ``densefit``, and names 1-41 lower-case
letters, digits and ``_``). A store is these tables, named after TABLE:

==================  ===========================================================================
table               holds
==================  ===========================================================================
``TABLE``           one row per document: id, ``seq`` (write order: a new value on every
                    write, the key of rankings), text, title, ``meta`` (JSONB, as given),
                    ``fields`` (JSONB: its filter fields split by type,
                    :func:`~densefit.retrieval.index.filters.typed_fields`), the hashes
                    indexing skips by, the stale mark of ``--reembed`` and its BM25 length
``TABLE_v<g>``      the vectors, one row per document (``seq``): ``vector(dim)`` (float32)
                    or ``halfvec(dim)`` (float16, pgvector >= 0.7) under an HNSW index
                    (``vector_ip_ops``); a binary store keeps float32 vectors and ``code``,
                    their sign bits as ``bit(dim)`` (HNSW ``bit_hamming_ops`` from pgvector
                    0.7). ``g`` is the record's ``generation``; a model swap builds the
                    next generation's table beside it
``TABLE_postings``  BM25: one row per (token, document) with the term frequency
``TABLE_stats``     the number of documents and of their tokens (BM25's N and avgdl)
``TABLE_record``    the model and settings (:meth:`StoreRecord.to_meta
                    <densefit.retrieval.index.types.StoreRecord.to_meta>`, as the
                    embedded store's meta table), the live vector table's generation, the
                    model swaps so far and the swap under way
==================  ===========================================================================

Every write (documents, vectors, postings and the counts) is one transaction, taken under a
transaction-level advisory lock of the table, so a process killed at any point leaves the
last commit and indexing resumes from it. Every search reads the database in one snapshot,
taken after a share lock on the record table: several processes or servers on one table
see each other's writes, and a search never meets a vector table half switched or dropped
(what drops one holds the record table exclusively, for milliseconds).

A load skips the HNSW index's upkeep: a write of at least :data:`BULK_MIN` (256) documents
into a store holding no more than it writes drops the index (recorded: ``hnsw =
deferred``), the rows go in by COPY alone, and the index is built afterwards in one pass
(``CREATE INDEX CONCURRENTLY`` on a connection of its own, ``maintenance_work_mem`` raised
to fit the graph) and recorded built: at the end of that write, or, for writes made under
the store's writer lock (``densefit index``, ``index --from-store``), at
:meth:`PostgresStore.flush`. Until then searches scan exactly. A process killed anywhere in
a load leaves a store that answers correctly; the next flush or write outside a load builds
the index. 10,000 random 384-d vectors went in at about 1,500-1,650 documents/s this way,
160 row by row (``bench/pg_ingest.py``).

A model swap (``densefit reembed``, :mod:`densefit.retrieval.index.swap`) writes the new
model's vectors into the next generation's table (no index while it fills), while
searches keep reading the live one; writes and deletes reach both tables (a rewritten
document loses its next vector unless the writer gives the new model's vector of its new
text). When every document has a next vector, the next table's HNSW index is built
(concurrently: writes go on), and one transaction switches the record to the new model,
its settings and the next generation, and counts the model swap (``model_generation``);
the old table is dropped after. Searches prepared for the old model get
:class:`~densefit.retrieval.index.types.ModelSwappedError`, writes too.

Searches: ``backend="hnsw"`` (the default) walks the HNSW index with ``hnsw.ef_search`` at
least ``k``; ``"exact"`` scans every row. A filtered search always scans exactly the rows
the filter matches (filters are emitted as a ``WHERE`` clause over ``fields`` with bound
parameters: :func:`where_clause`), so the top ``k`` of the matches come back, not the top
``k`` filtered afterwards. Scores are inner products (``<#>``; cosine stores hold unit
vectors). A binary store takes ``rescore x k`` candidates by the Hamming distance of the
codes (through its index, or a scan: ``bit_count(code # query)`` before pgvector 0.7) and
ranks them by their float32 vectors, as the embedded store's binary vectors do. BM25 (``mode="bm25"``) is
computed in one SQL query per query text from the postings: bm25s's tokens
(:func:`~densefit.retrieval.bm25.tokenize`) and its "lucene" scores
(:mod:`densefit.retrieval.bm25`), N and avgdl over all documents, among the filter's
matches.

>>> parse_target("postgresql://me:secret@db:5432/search/docs?sslmode=require")
Target(conninfo='postgresql://me:secret@db:5432/search?sslmode=require', table='docs', location='postgresql://me:***@db:5432/search/docs?sslmode=require')
>>> parse_target("postgres://me@db/search").table
'densefit'
>>> sql_text(where_clause({"field": "meta.lang", "operator": "==", "value": "en"})[0])
"(fields -> 'meta.lang' ->> 's') = %s"
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import numpy as np

from densefit.data.types import Document
from densefit.retrieval.bm25 import K1, B, Tokens, tokenize
from densefit.retrieval.index.common import Fault, one_line, translated
from densefit.retrieval.index.database import DatabaseStore, StoredRow
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
from densefit.retrieval.index.locking import LOCK_NAME, StoreLockedError
from densefit.retrieval.index.quantized import DEFAULT_RESCORE
from densefit.retrieval.index.registry import capabilities_of, redacted, scrubbed
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
    "sql_text",
    "where_clause",
]

CAPABILITIES = capabilities_of("postgresql")  # declared in its registry row
DEFAULT_TABLE = "densefit"
_TABLE = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")
_HALFVEC = (0, 7)  # the pgvector version that added halfvec
_HNSW_MAX_DIM = {"float32": 2000, "float16": 4000, "binary": 64000}  # pgvector's HNSW limits
_EF_SEARCH_MIN, _EF_SEARCH_MAX = 40, 1000  # pgvector's default and largest hnsw.ef_search
_RESET = {
    "enable_indexscan": "RESET enable_indexscan",
    "enable_seqscan": "RESET enable_seqscan",
    "hnsw.ef_search": "RESET hnsw.ef_search",
}
_CONNECT_TIMEOUT = 10  # seconds, unless the target sets connect_timeout
# The record's keys beside StoreRecord.to_meta()'s (whose "generation" names the live
# vector table TABLE_v<generation>), as the embedded store keeps them in its meta table.
UNUSED_KEY = "unused_vectors"  # generations of vector tables left to drop (JSON list)
INDEX_KEY, DEFERRED = "hnsw", "deferred"  # the live table's HNSW index is not built yet
# A write of at least this many documents into a store holding no more is a load: the
# HNSW index is built after it in one pass, not kept up row by row (bench/pg_ingest.py).
BULK_MIN = 256  # 100 documents into an empty store: 0.07 s as a load, 0.42 s row by row
_BUILD_MEMORY = (64 << 20, 1 << 30)  # maintenance_work_mem of an index build: at least, at most
_DROP_WAIT = "2s"  # what dropping a vector table or index waits for searches to let go
_INSTALL = "pip install 'densefit[postgres]'"


def _psycopg():
    """``import psycopg``, or an ImportError that says what to install."""
    try:
        import psycopg  # an optional extra: densefit[postgres]
    except ImportError:
        raise ImportError(f"PostgreSQL stores need psycopg and pgvector: {_INSTALL}") from None
    return psycopg


def _pgvector():
    """pgvector's Python types and their psycopg adapters, or an ImportError saying what to
    install."""
    try:
        import pgvector  # an optional extra: densefit[postgres]
        from pgvector.psycopg import register_vector  # the same extra
    except ImportError:
        raise ImportError(f"PostgreSQL stores need psycopg and pgvector: {_INSTALL}") from None
    return pgvector, register_vector


def _sql():
    return _psycopg().sql


# -- the target ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A parsed target: ``conninfo`` for libpq (the URL without the table), the ``table``,
    and the ``location`` messages show (the password redacted)."""

    conninfo: str
    table: str
    location: str


def parse_target(target: str) -> Target:
    """Split ``postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE/TABLE[?params]`` into what
    libpq connects to and the table; StoreError (one line) for another form or a table name
    that is not 1-41 lower-case letters, digits and ``_``."""
    location = redacted(target)
    parts = urlsplit(str(target))
    if parts.scheme.lower() not in ("postgresql", "postgres"):
        raise StoreError(
            f"{location} is not a PostgreSQL target: write "
            "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE/TABLE"
        )
    names = [unquote(name) for name in parts.path.split("/")[1:]]
    if len(names) > 2:
        raise StoreError(
            f"{location}: the path names more than a database and a table: write "
            "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE/TABLE"
        )
    database = names[0] if names else ""
    table = names[1] if len(names) == 2 and names[1] else DEFAULT_TABLE
    if not _TABLE.match(table):
        raise StoreError(
            f"{location}: table name {table!r} is not allowed: use 1-41 lower-case letters, "
            "digits and '_', starting with a letter or '_' (e.g. docs_v2)"
        )
    path = "/" + parts.path.split("/")[1] if database else ""
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


def _faults(location: str, *, connecting: bool = False) -> tuple[Fault, ...]:
    """PostgreSQL's error table (:func:`~densefit.retrieval.index.common.translated`): a
    failed connection says what to fix; a lost server, or a statement it refused, one line."""
    psycopg = _psycopg()
    if connecting:
        return (Fault(psycopg.OperationalError, lambda exc: _cannot_connect(location, exc)),)
    return (
        Fault(
            psycopg.OperationalError,
            f"{location}: PostgreSQL failed ({{detail}}): check that the server is running; "
            "the store connects again at its next call",
        ),
        Fault(psycopg.Error, f"{location}: PostgreSQL refused ({{detail}})"),
    )


def _cannot_connect(location: str, exc: BaseException) -> str:
    """What went wrong connecting and what to do (the first fix whose pattern matches)."""
    for pattern, fix in _CONNECT_FIXES:
        found = re.search(pattern, str(exc))
        if found:
            fix = fix.format(*found.groups())
            return f"{location}: cannot connect to PostgreSQL ({one_line(exc)}): {fix}"
    raise AssertionError("the last pattern matches everything")  # pragma: no cover


def _connect(target: Target):
    """A new autocommit connection with pgvector's types registered, or a one-line
    StoreError naming the target and the fix."""
    psycopg = _psycopg()
    _, register_vector = _pgvector()
    options: dict[str, Any] = {"autocommit": True, "prepare_threshold": None}
    if "connect_timeout" not in target.conninfo:
        options["connect_timeout"] = _CONNECT_TIMEOUT
    try:
        with translated(_faults(target.location, connecting=True)):
            conn = psycopg.connect(target.conninfo, **options)
    except psycopg.ProgrammingError as exc:  # libpq cannot read the URL: it may quote a secret
        raise StoreError(
            f"{target.location}: not a PostgreSQL URL libpq reads "
            f"({scrubbed(one_line(exc), target.conninfo)}): write postgresql://USER[:PASSWORD]@"
            "HOST[:PORT]/DATABASE/TABLE, special characters percent-encoded (%40 for @)"
        ) from None
    # Metadata as the embedded store writes it: values JSON cannot hold as text, no NaN.
    psycopg.types.json.set_json_dumps(_json_dumps, context=conn)
    try:
        if _pgvector_version(conn) is not None:
            register_vector(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _json_dumps(value) -> str:
    return json.dumps(value, default=str, allow_nan=False)


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


def where_clause(filters: Filter | dict):
    """``(sql, params)``: a ``WHERE`` clause over the documents table's ``fields`` column
    that is true exactly for the documents ``filters`` (parsed, :class:`~densefit.retrieval.
    index.filters.Filter`; a dict is parsed for this engine) match, with the embedded
    store's semantics; values are bound parameters, and field names (checked by the parse:
    letters, digits, ``_ - .`` and spaces) are quoted literals of a JSON path. ``TRUE`` for
    no filter.

    >>> clause, params = where_clause({"field": "meta.n", "operator": "in", "value": [1, "a"]})
    >>> sql_text(clause), params
    ("((fields -> 'meta.n' ->> 's') = ANY(%s) OR ((fields -> 'meta.n' ->> 'n')::float8) = ANY(%s))", [['a'], [1.0]])
    """
    parsed = parse_filters(filters, CAPABILITIES)
    if parsed is None:
        return _sql().SQL("TRUE"), []
    emitter = _Where()
    return _sql().SQL(emit(parsed, emitter)), emitter.params


def sql_text(clause) -> str:
    """The SQL text of a composed clause (identifiers and literals quoted; no connection
    needed), for messages and doctests."""
    return clause.as_string()


def _typed(field: str, part: str):
    """The typed value ``part`` (``s`` string, ``n`` number, ``d`` date, ``j`` JSON) of a
    document's filter field, as SQL (NULL where the field has none)."""
    return _sql().SQL(_typed_text(field, part))


def _typed_text(field: str, part: str) -> str:
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
        if c.operator == "in":
            return self._member(c.field, c.value)
        return self._ordering(c)

    def negate(self, clause: str) -> str:
        """NOT of a clause whose NULLs mean false (a missing field compares as NULL)."""
        return f"NOT COALESCE({clause}, FALSE)"

    def all_of(self, clauses: list[str]) -> str:
        return "(" + " AND ".join(clauses) + ")" if clauses else "TRUE"

    def any_of(self, clauses: list[str]) -> str:
        return "(" + " OR ".join(clauses) + ")" if clauses else "FALSE"

    def _equal(self, field: str, value: Any) -> str:
        if value is None:  # a missing or null field has no entry
            return f"NOT (fields ? {_quoted(field)})"
        if isinstance(value, (list, dict)):
            self.params.append(json_text(value))
            return f"{_typed_text(field, 'j')} = %s"
        if isinstance(value, (bool, int, float)):  # numbers and bools (1 == True), no strings
            self.params.append(float(value))
            return f"{_typed_text(field, 'n')} = %s"
        self.params.append(value)  # a string (the parse let nothing else through)
        return f"{_typed_text(field, 's')} = %s"

    def _member(self, field: str, values: list) -> str:
        strings = [v for v in values if isinstance(v, str)]
        numbers = [float(v) for v in values if isinstance(v, (bool, int, float))]
        others = [v for v in values if not isinstance(v, (str, bool, int, float))]
        parts = []
        if strings:
            self.params.append(strings)
            parts.append(f"{_typed_text(field, 's')} = ANY(%s)")
        if numbers:
            self.params.append(numbers)
            parts.append(f"{_typed_text(field, 'n')} = ANY(%s)")
        parts += [self._equal(field, v) for v in others]
        return self.any_of(parts) if len(parts) != 1 else parts[0]

    def _ordering(self, c: Comparison) -> str:
        if c.value is None:
            return "FALSE"  # Haystack: None is not ordered
        if isinstance(c.value, str):  # an ISO date: documents whose value is a date string
            self.params.append(date_seconds(c.value, f"{c.field} {c.operator}"))
            part = "d"
        else:
            self.params.append(float(c.value))  # numbers and bools (1 and 0)
            part = "n"
        return f"{_typed_text(c.field, part)} {c.operator} %s"


# -- the store ------------------------------------------------------------------------------


def _locked(method):
    """Serialise calls on one store object (its connection is shared by a server's threads)."""

    @wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class _Names:
    """The tables, sequence and indexes of one store, as SQL identifiers."""

    def __init__(self, table: str):
        sql = _sql()
        self.table = table
        self.docs = sql.Identifier(table)
        self.postings = sql.Identifier(f"{table}_postings")
        self.stats = sql.Identifier(f"{table}_stats")
        self.record = sql.Identifier(f"{table}_record")
        self.seq_name = f"{table}_seq"
        self.seq = sql.Identifier(self.seq_name)

    def index(self, suffix: str):
        return _sql().Identifier(f"{self.table}_{suffix}")

    def vectors_name(self, generation: int) -> str:
        """The name of generation ``generation``'s vector table."""
        return f"{self.table}_v{int(generation)}"

    def vectors(self, generation: int):
        return _sql().Identifier(self.vectors_name(generation))

    def hnsw_name(self, generation: int) -> str:
        """The name of the HNSW index of generation ``generation``'s vector table."""
        return f"{self.vectors_name(generation)}_hnsw"


def _hnsw_spec(kind: str, dim: int, version: tuple[int, ...]) -> tuple[str, str] | None:
    """``(column, operator class)`` of the HNSW index of ``kind`` vectors of ``dim``
    dimensions on pgvector ``version``; None where pgvector has none."""
    if dim > _HNSW_MAX_DIM[kind] or (kind == "binary" and version < _HALFVEC):
        return None
    return {
        "float32": ("embedding", "vector_ip_ops"),
        "float16": ("embedding", "halfvec_ip_ops"),
        "binary": ("code", "bit_hamming_ops"),  # pgvector >= 0.7
    }[kind]


def _vector_table_sql(names: _Names, generation: int, kind: str, dim: int):
    """``CREATE TABLE`` of a vector table: ``seq`` (the document's), the vector and, for a
    binary store, its sign code."""
    sql = _sql()
    vector_type = sql.SQL("{}({})").format(
        sql.SQL("halfvec" if kind == "float16" else "vector"), sql.Literal(int(dim))
    )
    code_column = sql.SQL("")
    if kind == "binary":
        code_column = sql.SQL(", code bit({}) NOT NULL").format(sql.Literal(int(dim)))
    return sql.SQL("CREATE TABLE {} (seq int8 PRIMARY KEY, embedding {} NOT NULL{})").format(
        names.vectors(generation), vector_type, code_column
    )


def _hnsw_sql(names: _Names, generation: int, spec: tuple[str, str], *, concurrently: bool):
    sql = _sql()
    column, ops = spec
    return sql.SQL("CREATE INDEX {}{} ON {} USING hnsw ({} {})").format(
        sql.SQL("CONCURRENTLY " if concurrently else ""),
        sql.Identifier(names.hnsw_name(generation)),
        names.vectors(generation),
        sql.Identifier(column),
        sql.SQL(ops),
    )


def _build_memory(rows: int, dim: int, kind: str) -> int:
    """Bytes of ``maintenance_work_mem`` that hold the HNSW graph of ``rows`` vectors (the
    vector or code, and pgvector's element with its neighbour lists at m = 16), within
    :data:`_BUILD_MEMORY`: a graph that fits is built several times faster."""
    vector = dim // 8 + 8 if kind == "binary" else dim * (2 if kind == "float16" else 4) + 8
    low, high = _BUILD_MEMORY
    return int(min(high, max(low, rows * (vector + 1024) * 5 // 4)))


class PostgresStore(SwapCoordinator, DatabaseStore):
    """A densefit store in a PostgreSQL table (see the module docstring); get one from
    :func:`~densefit.retrieval.index.engines.open_store` with a ``postgresql://`` target.

    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.index.engines import open_store
    >>> store = open_store("postgresql://me@db/search/docs", tiny_model())  # doctest: +SKIP
    >>> store.capabilities.engine  # doctest: +SKIP
    'postgresql'
    """

    capabilities = CAPABILITIES

    def __init__(self, target: Target, conn, *, backend: str, rescore: int | None = None):
        super().__init__()
        self.location = target.location
        self._target = target
        self._faults = _faults(target.location)
        self._conn = conn
        self._names = _Names(target.table)
        self.backend_name = backend
        self._write_key = _lock_key(target.table, "write")
        self._build_key = _lock_key(target.table, "build")  # held while an index is built
        self._meta: dict[str, str] = {}
        self._loading = 0  # writer locks this object holds: its writes are a load's
        self.pgvector_version = _pgvector_version(conn)
        self._read_record()
        kind = self._record.vector_kind
        if kind not in CAPABILITIES.vector_kinds:
            raise StoreError(
                f"{self.location}: the table holds {kind} vectors, which this densefit does "
                f"not read from PostgreSQL ({', '.join(CAPABILITIES.vector_kinds)})"
            )
        self.rescore = _check_rescore(rescore, kind, self.location)
        self._move_vectors_out()
        if self._unused:
            self._drop_unused()

    # -- connection and transactions ------------------------------------------------------

    def _connection(self):
        if self._conn is None:
            raise StoreError(f"{self.location}: the store is closed")
        if self._conn.closed:  # lost (the server restarted): connect again
            self._conn = _connect(self._target)
        return self._conn

    @contextmanager
    def _snapshot(self) -> Iterator:
        """A cursor reading one consistent snapshot (REPEATABLE READ), or in the transaction
        already open (a search's parts read the same state). The snapshot is taken after a
        share lock on the record table: what drops a vector table holds that table
        exclusively, so a snapshot never names a table that is gone."""
        psycopg = _psycopg()
        conn = self._connection()
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            with conn.cursor(binary=True) as cur:
                yield cur
            return
        with self._errors(), conn.transaction(), conn.cursor(binary=True) as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            cur.execute(_sql().SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(self._names.record))
            yield cur

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
        """Run ``work(cursor)`` in a write transaction that also holds the record table
        exclusively (every read waits until it commits): what dropping a vector table or
        index needs. Nothing happens, and False comes back, while an index is being built
        (its build must not wait on a drop), or when searches hold the record longer than
        :data:`_DROP_WAIT`; else whether ``work`` did something."""
        psycopg = _psycopg()
        sql = _sql()
        with self._lock:
            conn = self._connection()
            with self._errors():
                try:
                    with conn.transaction(), conn.cursor() as cur:
                        cur.execute("SELECT pg_advisory_xact_lock(%s)", (self._write_key,))
                        cur.execute("SELECT pg_try_advisory_xact_lock(%s)", (self._build_key,))
                        if not cur.fetchone()[0]:
                            return False
                        cur.execute("SELECT set_config('lock_timeout', %s, TRUE)", (_DROP_WAIT,))
                        cur.execute(
                            sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(
                                self._names.record
                            )
                        )
                        self._load(cur)
                        return bool(work(cur))
                except psycopg.errors.LockNotAvailable:
                    return False

    # -- the record ------------------------------------------------------------------------

    def _load(self, cur) -> None:
        """Read the record with ``cur`` (in its transaction) and make this object's view of
        it current: the model, the live vector table, the swap under way."""
        cur.execute(_sql().SQL("SELECT key, value FROM {}").format(self._names.record))
        meta = dict(cur.fetchall())
        if meta == self._meta:
            return
        self._take_record(meta)
        self._meta = meta
        self._generation = int(meta.get("generation", "0"))
        self._unused = [int(g) for g in json.loads(meta.get(UNUSED_KEY, "[]"))]
        self._deferred = meta.get(INDEX_KEY) == DEFERRED

    def _read_record(self) -> None:
        with self._lock, self._snapshot() as cur:
            self._load(cur)

    def _set_meta(self, cur, values: dict[str, str], drop: Sequence[str] = ()) -> None:
        """Write ``values`` into the record and remove the keys ``drop``, in ``cur``'s
        transaction."""
        sql = _sql()
        if values:
            cur.executemany(
                sql.SQL(
                    "INSERT INTO {} (key, value) VALUES (%s, %s) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
                ).format(self._names.record),
                [(k, str(v)) for k, v in values.items()],
            )
        if drop:
            cur.execute(
                sql.SQL("DELETE FROM {} WHERE key = ANY(%s)").format(self._names.record),
                (list(drop),),
            )

    def _save_settings(self, settings: VectorSettings) -> None:
        with self._writing() as cur:
            self._set_meta(cur, settings.to_meta())
        self._read_record()

    def _vectors(self):
        """The live vector table (of the record last read)."""
        return self._names.vectors(self._generation)

    def _index_spec(self, record: StoreRecord | None = None) -> tuple[str, str] | None:
        record = record or self._record
        return _hnsw_spec(record.vector_kind, record.dim, self.pgvector_version)

    def _move_vectors_out(self) -> None:
        """Give a store whose documents table holds the vectors (as densefit made them
        before vector tables) its vector table ``TABLE_v0``, in one transaction; nothing
        for the others."""
        with self._lock, self._snapshot() as cur:
            if _exists(cur.connection, self._names.vectors_name(self._generation)):
                return
        sql, names = _sql(), self._names
        kind = self._record.vector_kind
        moved = ["embedding", "code"] if kind == "binary" else ["embedding"]
        columns = sql.SQL(", ").join(map(sql.Identifier, ["seq", *moved]))
        with self._writing() as cur:
            cur.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(names.record))
            self._load(cur)
            generation = self._generation
            if _exists(cur.connection, names.vectors_name(generation)):
                return
            if not _has_column(cur.connection, names.table, "embedding"):
                raise StoreError(
                    f"{self.location}: the vector table {names.vectors_name(generation)} is "
                    "missing: the store cannot be searched; index it again into a new table"
                )
            cur.execute(_vector_table_sql(names, generation, kind, self._record.dim))
            cur.execute(
                sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(
                    names.vectors(generation), columns, columns, names.docs
                )
            )
            drops = sql.SQL(", ").join(
                sql.SQL("DROP COLUMN {}").format(sql.Identifier(c)) for c in moved
            )
            cur.execute(sql.SQL("ALTER TABLE {} {}").format(names.docs, drops))
            if self._index_spec() is not None:
                self._set_meta(cur, {INDEX_KEY: DEFERRED})
        self._read_record()
        self._build_deferred_index()

    # -- reading ---------------------------------------------------------------------------

    @_locked
    def count(self) -> int:
        """The number of documents."""
        with self._snapshot() as cur:
            cur.execute(_sql().SQL("SELECT documents FROM {}").format(self._names.stats))
            return int(cur.fetchone()[0])

    @_locked
    def count_matching(self, filters: Filter | dict | None = None) -> int:
        """How many documents match ``filters`` (all of them for None or ``{}``)."""
        where, params = self._where_or_all(filters)
        query = _sql().SQL("SELECT count(*) FROM {} WHERE {}").format(self._names.docs, where)
        with self._snapshot() as cur:
            return int(cur.execute(query, params).fetchone()[0])

    @_locked
    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """The documents with these ids, None where an id is unknown."""
        ids = list(ids)
        query = _sql().SQL("SELECT id, text, title, meta FROM {} WHERE id = ANY(%s)")
        with self._snapshot() as cur:
            rows = cur.execute(query.format(self._names.docs), (ids,)).fetchall()
        found = {i: Document(i, text, title, meta) for i, text, title, meta in rows}
        return [found.get(i) for i in ids]

    @_locked
    def hashes(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """``{id: (text hash, meta hash)}`` of the stored ids."""
        query = _sql().SQL("SELECT id, text_hash, meta_hash FROM {} WHERE id = ANY(%s)")
        with self._snapshot() as cur:
            rows = cur.execute(query.format(self._names.docs), (list(ids),)).fetchall()
        return {i: (th, mh) for i, th, mh in rows}

    @_locked
    def _ids_after(self, last: str, limit: int) -> list[str]:
        query = _sql().SQL("SELECT id FROM {} WHERE id > %s ORDER BY id LIMIT %s")
        with self._snapshot() as cur:
            return [i for (i,) in cur.execute(query.format(self._names.docs), (last, limit))]

    def _float32_embedding(self):
        """SQL for a row's embedding as float32 (``vector``)."""
        sql = _sql()
        if self._record.vector_kind == "float16":
            return sql.SQL("embedding::vector({})").format(sql.Literal(self._record.dim))
        return sql.SQL("embedding")

    @_locked
    def vectors(self, ids: Sequence[str]) -> np.ndarray:
        """The stored float32 embeddings of ``ids`` (KeyError for an unknown id)."""
        ids = list(ids)
        query = _sql().SQL("SELECT d.id, {} FROM {} d JOIN {} USING (seq) WHERE d.id = ANY(%s)")
        with self._snapshot() as cur:
            self._load(cur)
            query = query.format(self._float32_embedding(), self._names.docs, self._vectors())
            found = {i: v.to_numpy() for i, v in cur.execute(query, (ids,))}
        missing = [i for i in ids if i not in found]
        if missing:
            raise KeyError(f"{len(missing)} ids are not in the store, e.g. {missing[:3]}")
        if not ids:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([found[i] for i in ids]).astype(np.float32)

    @_locked
    def vectors_for_texts(self, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """A current (not stale) stored vector per text hash, the earliest written."""
        query = _sql().SQL(
            "SELECT DISTINCT ON (d.text_hash) d.text_hash, {} FROM {} d JOIN {} USING (seq) "
            "WHERE d.text_hash = ANY(%s) AND NOT d.stale ORDER BY d.text_hash, seq"
        )
        with self._snapshot() as cur:
            self._load(cur)
            query = query.format(self._float32_embedding(), self._names.docs, self._vectors())
            rows = cur.execute(query, (list(set(hashes)),)).fetchall()
        return {h: v.to_numpy().astype(np.float32) for h, v in rows}

    @_locked
    def filter_documents(self, filters: Filter | dict | None = None) -> list[Document]:
        """The documents matching ``filters``, in the order they were written (an updated
        document counts as written last)."""
        where, params = self._where_or_all(filters)
        query = _sql().SQL("SELECT id, text, title, meta FROM {} WHERE {} ORDER BY seq")
        with self._snapshot() as cur:
            rows = cur.execute(query.format(self._names.docs, where), params).fetchall()
        return [Document(i, text, title, meta) for i, text, title, meta in rows]

    @_locked
    def index_meta_field(self, field: str) -> None:
        """Expression indexes on the metadata field ``field`` (``"meta.lang"``): its string
        and its number, which ``==``, ``in`` and ``>``-style filters compare. Idempotent."""
        meta_path(field)  # the name checked as filters check theirs
        sql = _sql()
        name = hashlib.sha256(field.encode("utf-8")).hexdigest()[:12]
        with self._writing() as cur:
            for part in ("s", "n"):
                cur.execute(
                    sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (({}))").format(
                        self._names.index(f"f{name}{part}"), self._names.docs, _typed(field, part)
                    )
                )

    def _info_extra(self) -> dict:
        return {"hnsw_deferred": self._deferred}  # whether the index waits for a load to end

    # -- stale vectors (--reembed) -----------------------------------------------------------

    def _mark_stale(self) -> None:
        with self._writing() as cur:
            cur.execute(_sql().SQL("UPDATE {} SET stale = TRUE").format(self._names.docs))

    @_locked
    def _stale(self, ids: list[str] | None) -> list[str]:
        sql = _sql()
        query = sql.SQL("SELECT id FROM {} WHERE stale").format(self._names.docs)
        params: list = []
        if ids is not None:
            query = sql.SQL("{} AND id = ANY(%s)").format(query)
            params.append(list(ids))
        with self._snapshot() as cur:
            rows = cur.execute(sql.SQL("{} ORDER BY seq").format(query), params).fetchall()
        return [i for (i,) in rows]

    # -- writing ---------------------------------------------------------------------------

    def _before_write(self, rows: list[StoredRow], prepared_for: int) -> None:
        """A load (at least :data:`BULK_MIN` documents into a store holding no more) drops
        the HNSW index, built once at its end (see the module docstring)."""
        if len(rows) >= BULK_MIN:
            self._defer_index(len(rows), prepared_for)

    def _upsert(
        self, cur, rows: list[StoredRow], vectors: np.ndarray, next_vectors: np.ndarray | None
    ) -> set[str]:
        """Delete the documents' old rows, vectors (current and next) and postings, COPY
        the new ones in with new ``seq`` values, update the counts."""
        sql, names = _sql(), self._names
        documents = [r.document for r in rows]
        ids = [d.id for d in documents]
        texts = [_checked_text(d) for d in documents]
        metas = [_checked_meta(d) for d in documents]
        postings, lengths = _postings(texts)
        swap = self._swap
        old = self._drop_rows(cur, ids)
        cur.execute(
            "SELECT nextval(%s::regclass) FROM generate_series(1, %s)",
            (names.seq_name, len(rows)),
        )
        seqs = sorted(s for (s,) in cur.fetchall())
        copy = sql.SQL(
            "COPY {} (id, seq, text, title, meta, fields, text_hash, meta_hash, length) "
            "FROM STDIN (FORMAT BINARY)"
        ).format(names.docs)
        with cur.copy(copy) as writer:
            writer.set_types(
                ["text", "int8", "text", "text", "jsonb", "jsonb", "text", "text", "int4"]
            )
            for i, row in enumerate(rows):
                writer.write_row(
                    (
                        row.document.id,
                        seqs[i],
                        texts[i],
                        row.document.title or "",
                        metas[i],
                        row.fields,
                        row.text_hash,
                        row.meta_hash,
                        int(lengths[i]),
                    )
                )
        self._copy_vectors(cur, self._vectors(), seqs, vectors)
        if next_vectors is not None:
            self._copy_vectors(cur, names.vectors(swap.generation), seqs, next_vectors)
        positions, tokens, tfs = postings
        if tokens:
            doc_seqs = np.asarray(seqs, dtype=np.int64)[positions].tolist()
            doc_lengths = lengths[positions].tolist()
            copy = sql.SQL("COPY {} (token, seq, tf, length) FROM STDIN (FORMAT BINARY)").format(
                names.postings
            )
            with cur.copy(copy) as writer:
                writer.set_types(["text", "int8", "int4", "int4"])
                for posting in zip(tokens, doc_seqs, tfs, doc_lengths):
                    writer.write_row(posting)
        cur.execute(
            sql.SQL("UPDATE {} SET documents = documents + %s, tokens = tokens + %s").format(
                names.stats
            ),
            (len(rows) - len(old), int(lengths.sum()) - sum(n for _, _, n in old)),
        )
        return {doc_id for doc_id, _, _ in old}

    def _after_write(self) -> None:
        """The HNSW index a write deferred, built now unless a load (a writer lock) goes on."""
        if self._deferred and not self._loading:
            self._build_deferred_index()

    def _copy_vectors(self, cur, table, seqs: Sequence[int], vectors: np.ndarray) -> None:
        """COPY ``(seq, vector[, code])`` rows into the vector table ``table`` (this store's
        vector kind: a model swap keeps it)."""
        pgvector, _ = _pgvector()
        sql = _sql()
        kind = self._record.vector_kind
        binary = kind == "binary"
        if kind == "float16":
            values = [pgvector.HalfVector(v) for v in vectors]
        else:
            values = [pgvector.Vector(v) for v in vectors]
        codes = _codes(vectors) if binary else None
        copy = sql.SQL("COPY {} (seq, embedding{}) FROM STDIN (FORMAT BINARY)").format(
            table, sql.SQL(", code" if binary else "")
        )
        with cur.copy(copy) as writer:
            writer.set_types(
                ["int8", "halfvec" if kind == "float16" else "vector"] + (["bit"] if binary else [])
            )
            for i, seq in enumerate(seqs):
                writer.write_row((int(seq), values[i], *([codes[i]] if binary else [])))

    def _set_metadata(self, cur, documents: list[Document]) -> int:
        psycopg = _psycopg()
        rows = []
        for doc in documents:
            fields = typed_fields(doc.id, "", doc.title or "", doc.meta or {})
            del fields["content"]  # the stored text's entry stays
            rows.append(
                (
                    doc.title or "",
                    psycopg.types.json.Jsonb(_checked_meta(doc)),
                    StoredRow.of(doc).meta_hash,
                    psycopg.types.json.Jsonb(fields),
                    doc.id,
                )
            )
        query = _sql().SQL(
            "UPDATE {} SET title = %s, meta = %s, meta_hash = %s, "
            "fields = jsonb_build_object('content', fields -> 'content') || %s WHERE id = %s"
        )
        changed = 0
        for row in rows:
            cur.execute(query.format(self._names.docs), row)
            changed += cur.rowcount
        return changed

    def _remove(self, cur, ids: list[str]) -> int:
        sql, names = _sql(), self._names
        gone = self._drop_rows(cur, ids)
        if gone:
            cur.execute(
                sql.SQL("UPDATE {} SET documents = documents - %s, tokens = tokens - %s").format(
                    names.stats
                ),
                (len(gone), sum(n for _, _, n in gone)),
            )
        return len(gone)

    def _drop_rows(self, cur, ids: list[str]) -> list[tuple[str, int, int]]:
        """Delete the documents ``ids`` with their postings and vectors (current and next);
        ``(id, seq, length)`` of those that were stored."""
        sql, names = _sql(), self._names
        query = sql.SQL("DELETE FROM {} WHERE id = ANY(%s) RETURNING id, seq, length")
        gone = cur.execute(query.format(names.docs), (ids,)).fetchall()
        if gone:
            seqs = [seq for _, seq, _ in gone]
            tables = [names.postings, self._vectors()]
            if self._swap is not None:  # a rewritten document's next vector is its old text's
                tables.append(names.vectors(self._swap.generation))
            for table in tables:
                cur.execute(sql.SQL("DELETE FROM {} WHERE seq = ANY(%s)").format(table), (seqs,))
        return gone

    def writer_lock(
        self, timeout: float | None = None, *, name: str | None = None, doing: str | None = None
    ) -> AbstractContextManager:
        """Hold the store's lock ``name`` (the writer lock by default) across processes and
        servers: a PostgreSQL advisory lock on a connection of its own, dropped by the
        server when its holder exits, killed or not. Waits up to ``timeout`` seconds (None:
        for ever), saying once for whom; :class:`~densefit.retrieval.index.locking.
        StoreLockedError` after that. While this object holds the writer lock its writes
        are a load's: an HNSW index they defer is built by :meth:`flush`."""
        lock = _advisory_lock(
            self._target,
            timeout=timeout,
            name=name or LOCK_NAME,
            doing=doing or "writing to this store",
        )
        return lock if (name or LOCK_NAME) != LOCK_NAME else self._loading_under(lock)

    @contextmanager
    def _loading_under(self, lock: AbstractContextManager) -> Iterator[None]:
        with lock:
            with self._lock:
                self._loading += 1
            try:
                yield
            finally:
                with self._lock:
                    self._loading -= 1

    # -- the HNSW index: deferred by a load, built in one pass ------------------------------

    def flush(self) -> None:
        """Build the HNSW index a load deferred (documents are durable once written)."""
        self._build_deferred_index()

    def _defer_index(self, n: int, prepared_for: int) -> None:
        """Drop the live table's HNSW index when ``n`` documents are at least as many as the
        store holds (a load), and record it deferred, in one transaction."""
        if self._index_spec() is None:
            return
        sql, names = _sql(), self._names

        def drop(cur) -> bool:
            if self._deferred or self.model_generation != prepared_for:
                return False
            cur.execute(sql.SQL("SELECT documents FROM {}").format(names.stats))
            if n < int(cur.fetchone()[0]):
                return False
            cur.execute(
                sql.SQL("DROP INDEX IF EXISTS {}").format(
                    sql.Identifier(names.hnsw_name(self._generation))
                )
            )
            self._set_meta(cur, {INDEX_KEY: DEFERRED})
            return True

        self._exclusive(drop)

    def _build_deferred_index(self) -> None:
        """Build the live table's HNSW index if a load deferred it, then record it built."""
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
        """Build the HNSW index of vector table ``generation`` (holding ``record``'s
        vectors) unless it is built: ``CREATE INDEX CONCURRENTLY`` on a connection of its
        own, under the table's build lock, with ``maintenance_work_mem`` raised to hold
        the graph. Searches and writes go on meanwhile. Returns whether the index exists
        (False: pgvector has none for these vectors, or the table is gone)."""
        spec = self._index_spec(record)
        if spec is None:
            return False
        sql, names = _sql(), self._names
        name = names.hnsw_name(generation)
        conn = _connect(self._target)
        try:
            with self._errors():
                while not _try_lock(conn, self._build_key):  # another process builds
                    time.sleep(0.05)
                if not _exists(conn, names.vectors_name(generation)):
                    return False
                valid = _index_valid(conn, name)
                if valid:
                    return True
                if valid is False:  # a build that was killed leaves an invalid index
                    conn.execute(
                        sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(sql.Identifier(name))
                    )
                rows = conn.execute(
                    sql.SQL("SELECT count(*) FROM {}").format(names.vectors(generation))
                ).fetchone()[0]
                memory = _build_memory(int(rows), record.dim, record.vector_kind)
                current = conn.execute(
                    "SELECT setting::int8 * 1024 FROM pg_settings "
                    "WHERE name = 'maintenance_work_mem'"
                ).fetchone()[0]
                if memory > current:
                    conn.execute(
                        "SELECT set_config('maintenance_work_mem', %s, FALSE)",
                        (f"{memory // (1 << 20)}MB",),
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
        cur.execute(_vector_table_sql(names, generation, record.vector_kind, record.dim))
        return generation

    def _drop_generation(self, cur, swap: SwapTarget) -> None:
        self._unused = [*self._unused, swap.generation]  # dropped by _swap_changed
        self._set_meta(cur, {UNUSED_KEY: json.dumps(self._unused)})

    def _pending_rows(self, swap: SwapTarget, after_row: int, limit: int) -> list:
        query = _sql().SQL(
            "SELECT d.seq, d.id, d.text FROM {} d WHERE d.seq > %s AND NOT EXISTS "
            "(SELECT 1 FROM {} n WHERE n.seq = d.seq) ORDER BY d.seq LIMIT %s"
        )
        with self._lock, self._snapshot() as cur:
            self._load(cur)
            if self._swap is None:
                return []
            query = query.format(self._names.docs, self._names.vectors(self._swap.generation))
            return [(int(s), i, t) for s, i, t in cur.execute(query, (after_row, limit))]

    def _count_pending(self, swap: SwapTarget) -> int:
        query = _sql().SQL(
            "SELECT count(*) FROM {} d WHERE NOT EXISTS (SELECT 1 FROM {} n WHERE n.seq = d.seq)"
        )
        with self._lock, self._snapshot() as cur:  # in the swap's transaction when one is open
            self._load(cur)
            if self._swap is None:
                return 0
            query = query.format(self._names.docs, self._names.vectors(self._swap.generation))
            return int(cur.execute(query).fetchone()[0])

    def _put_next(self, cur, swap: SwapTarget, pending: list, vectors: np.ndarray) -> int:
        next_table = self._names.vectors(swap.generation)
        cur.execute(
            _sql()
            .SQL(
                "SELECT d.seq, d.id FROM {} d WHERE d.seq = ANY(%s) AND NOT EXISTS "
                "(SELECT 1 FROM {} n WHERE n.seq = d.seq)"
            )
            .format(self._names.docs, next_table),
            ([row for row, _ in pending],),
        )
        current = dict(cur.fetchall())
        keep = [k for k, (row, i) in enumerate(pending) if current.get(row) == i]
        if keep:
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
        cur.execute(_sql().SQL("UPDATE {} SET stale = FALSE WHERE stale").format(self._names.docs))

    def _swap_changed(self) -> None:
        self._read_record()
        self._drop_unused()

    def _drop_unused(self) -> None:
        """Drop the vector tables the record lists as unused (a switched or cancelled
        swap's); left for the next time when an index build or a long search is in the way."""
        sql, names = _sql(), self._names

        def drop(cur) -> bool:
            if not self._unused:
                return False
            for generation in self._unused:
                cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(names.vectors(generation)))
            self._set_meta(cur, {}, drop=[UNUSED_KEY])
            return True

        if self._exclusive(drop):
            self._read_record()

    # -- searching -------------------------------------------------------------------------

    @contextmanager
    def _reading(self) -> Iterator[None]:
        with self._lock, self._snapshot():  # a search's parts read one snapshot
            yield

    def _where(self, filters: Filter):
        return where_clause(filters)

    def _where_or_all(self, filters: Filter | dict | None):
        return where_clause(parse_filters(filters, self.capabilities))  # TRUE for no filter

    def _dense(self, queries: np.ndarray, k: int, where) -> list[tuple[np.ndarray, np.ndarray]]:
        """The best ``k`` rows per query by inner product: through the HNSW index
        (``backend="hnsw"``, no filter, within ``hnsw.ef_search``'s range, the index built)
        or a scan of the (matching) rows. A binary store takes ``rescore x k`` candidates
        by the Hamming distance of the codes (its HNSW index on pgvector >= 0.7, else a
        scan) and ranks them by their float32 vectors."""
        sql = _sql()
        pgvector, _ = _pgvector()
        kind = self._record.vector_kind
        depth = k * self.rescore if kind == "binary" else k  # what the index must find
        exact = (
            self.backend_name == "exact"
            or where is not None
            or depth > _EF_SEARCH_MAX
            or self._index_spec() is None
            or self._deferred  # a load has not built it yet
        )
        clause, params = where if where is not None else (sql.SQL("TRUE"), [])
        source = self._vectors()
        if where is not None:  # the filter's fields are the documents'
            source = sql.SQL("{} JOIN {} USING (seq)").format(source, self._names.docs)
        score = sql.SQL("{} <#> %s").format(self._float32_embedding())
        if kind == "binary":
            hamming = "code <~> %s" if self.pgvector_version >= _HALFVEC else "bit_count(code # %s)"
            query = sql.SQL(
                "SELECT seq, embedding <#> %s FROM (SELECT seq, embedding FROM {} WHERE {} "
                "ORDER BY {} LIMIT %s) candidates ORDER BY embedding <#> %s, seq LIMIT %s"
            ).format(source, clause, sql.SQL(hamming + (", seq" if exact else "")))
        else:
            if exact:
                order = sql.SQL("{}, seq").format(score)
            elif kind == "float16":  # the index's operator: halfvec with halfvec
                order = sql.SQL("embedding <#> %s")
            else:
                order = score
            query = sql.SQL("SELECT seq, {} FROM {} WHERE {} ORDER BY {} LIMIT %s").format(
                score, source, clause, order
            )
        settings = [("enable_indexscan", "off")]
        if not exact:
            settings = [
                ("enable_seqscan", "off"),
                ("hnsw.ef_search", str(max(depth, _EF_SEARCH_MIN))),
            ]
        results = []
        with self._snapshot() as cur:
            for name, value in settings:
                cur.execute("SELECT set_config(%s, %s, TRUE)", (name, value))
            for q in queries:
                vector = pgvector.Vector(q)
                if kind == "binary":
                    bits = _codes(q[None, :])[0]
                    values = [vector, *params, bits, depth, vector, k]
                elif kind == "float16" and not exact:
                    values = [vector, *params, pgvector.HalfVector(q), k]
                else:
                    values = [vector, *params, vector, k]
                rows = cur.execute(query, values).fetchall()
                rows.sort(key=lambda row: (row[1], row[0]))  # ties in write order
                keys = np.array([seq for seq, _ in rows], dtype=np.int64)
                scores = -np.array([d for _, d in rows], dtype=np.float64)
                results.append((keys, scores.astype(np.float32)))
            for name, _ in settings:  # BM25 and the hits read on in this transaction
                cur.execute(_RESET[name])
        return results

    def _lexical(self, texts: list[str], k: int, where) -> list[tuple[np.ndarray, np.ndarray]]:
        """BM25 of each text among the (matching) documents, computed from the postings in
        one query: bm25s's "lucene" scores, each (document, token) score rounded to float32
        as bm25s stores it, ties in write order; documents sharing no token are left out."""
        sql, names = _sql(), self._names
        if where is None:
            source = sql.SQL("{} p").format(names.postings)
        else:
            clause, _ = where
            source = sql.SQL("{} p JOIN {} d ON d.seq = p.seq AND {}").format(
                names.postings, names.docs, clause
            )
        query = sql.SQL(
            "WITH q(token, n) AS (SELECT * FROM unnest(%s::text[], %s::int4[])), "
            "s AS (SELECT documents::float8 AS n, tokens::float8 / NULLIF(documents, 0) AS avgdl "
            "FROM {stats}), "
            "w AS (SELECT q.token, q.n, ln(1 + (s.n - df.df + 0.5) / (df.df + 0.5))::float4 AS idf "
            "FROM q JOIN (SELECT token, count(*)::float8 AS df FROM {postings} "
            "WHERE token = ANY(%s::text[]) GROUP BY token) df USING (token) CROSS JOIN s) "
            "SELECT p.seq, sum(w.n * (w.idf::float8 * (p.tf / "
            "(p.tf + %s * (1 - %s + %s * p.length / s.avgdl))))::float4::float8)::float4 AS score "
            "FROM {source} JOIN w ON w.token = p.token CROSS JOIN s "
            "GROUP BY p.seq ORDER BY score DESC, p.seq LIMIT %s"
        ).format(stats=names.stats, postings=names.postings, source=source)
        where_params = [] if where is None else where[1]
        results = []
        with self._snapshot() as cur:
            for tokens in tokenize(texts):
                counts: dict[str, int] = {}
                for token in tokens:
                    counts[token] = counts.get(token, 0) + 1
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
        query = _sql().SQL("SELECT seq, id, text, title, meta FROM {} WHERE seq = ANY(%s)")
        with self._snapshot() as cur:
            rows = cur.execute(query.format(self._names.docs), (seqs,)).fetchall()
        return {seq: tuple(rest) for seq, *rest in rows}

    # -- closing ---------------------------------------------------------------------------

    @_locked
    def close(self) -> None:
        """Close the connection (idempotent); documents are durable once written."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def drop(self) -> None:
        """Drop the store in one transaction: its tables (documents, every generation's
        vectors, postings, statistics, the record) with their indexes, and its sequence;
        the store is closed after."""
        sql, names = _sql(), self._names
        with self._writing() as cur:
            cur.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname ~ %s",
                (f"^{names.table}_v[0-9]+$",),
            )
            vectors = [sql.Identifier(name) for (name,) in cur.fetchall()]
            tables = [names.docs, names.postings, names.stats, names.record, *vectors]
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.SQL(", ").join(tables)))
            cur.execute(sql.SQL("DROP SEQUENCE IF EXISTS {}").format(names.seq))
        self.close()

    def __repr__(self) -> str:
        return (
            f"PostgresStore({self.location!r}, model={self.model_name!r}, dim={self.dim}, "
            f"backend={self.backend_name!r})"
        )


def _checked_text(document: Document) -> str:
    """The document's text, or an error naming it where PostgreSQL cannot store it."""
    for name, value in (("id", document.id), ("text", document.text), ("title", document.title)):
        if value and "\x00" in value:
            raise ValueError(
                f"document {document.id!r}: its {name} holds a NUL character, which "
                "PostgreSQL text cannot store: remove it"
            )
    return document.text


def _checked_meta(document: Document) -> dict:
    """The metadata as the embedded store keeps it (values JSON cannot hold as text), or an
    error naming the document where JSONB cannot store it (NaN, infinities, NUL)."""
    try:
        text = _json_dumps(document.meta or {})
    except ValueError:
        raise ValueError(
            f"document {document.id!r}: its metadata holds NaN or an infinite number, which "
            "JSON cannot store: use null or a finite number"
        ) from None
    if "\\u0000" in text:
        raise ValueError(
            f"document {document.id!r}: its metadata holds a NUL character, which PostgreSQL "
            "JSONB cannot store: remove it"
        )
    return json.loads(text)


def _codes(vectors: np.ndarray) -> list:
    """Each vector's sign bits (``x > 0``, as the embedded store's binary codes) as
    pgvector's ``Bit``."""
    pgvector, _ = _pgvector()
    return [pgvector.Bit(row) for row in np.asarray(vectors) > 0]


def _postings(texts: list[str]) -> tuple[tuple[np.ndarray, list[str], list[int]], np.ndarray]:
    """``((document positions, tokens, term frequencies), lengths)``: one posting per
    (document, token) of ``texts`` with bm25s's tokens, and each text's token count."""
    tokens = Tokens.of(texts)
    lengths = np.diff(tokens.indptr)
    if len(tokens.ids) == 0:
        return (np.zeros(0, np.int64), [], []), lengths
    vocab = len(tokens.vocab)
    docs = np.repeat(np.arange(len(texts), dtype=np.int64), lengths)
    pairs, tf = np.unique(docs * vocab + tokens.ids, return_counts=True)
    words = np.array(tokens.vocab, dtype=object)[pairs % vocab].tolist()
    return (pairs // vocab, words, tf.tolist()), lengths


def _check_rescore(rescore: int | None, kind: str, location: str) -> int | None:
    """The candidates per result a binary store rescores (None for other kinds)."""
    if kind != "binary":
        if rescore is not None:
            raise StoreError(
                f"{location}: rescore applies to int8 and binary stores; this store holds "
                f"{kind} vectors, searched as they are: leave --rescore out"
            )
        return None
    rescore = DEFAULT_RESCORE if rescore is None else rescore
    if isinstance(rescore, bool) or not isinstance(rescore, int) or rescore < 1:
        raise StoreError(
            f"{location}: rescore must be an integer >= 1 (candidates per result), got {rescore!r}"
        )
    return rescore


def _check_backend(backend, location: str) -> str:
    if backend is None:
        return CAPABILITIES.backends[0]
    if backend not in CAPABILITIES.backends:
        raise CapabilityError(
            f"{location}: PostgreSQL searches by backend 'hnsw' (its HNSW index) or 'exact' "
            f"(a scan of every row), not {backend!r}"
        )
    return backend


@contextmanager
def _advisory_lock(target: Target, *, timeout: float | None, name: str, doing: str):
    """A session-level advisory lock keyed by the table and ``name``, on a connection of
    its own whose application name says who holds it."""
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"lock_timeout must be >= 0 seconds (None: no limit), got {timeout!r}")
    key = _lock_key(target.table, name)
    conn = _connect(target)
    try:
        holder_name = (
            f"densefit pid {os.getpid()} on {socket.gethostname()} since "
            f"{time.strftime('%H:%M:%S')}"
        )[:63]
        conn.execute("SELECT set_config('application_name', %s, FALSE)", (holder_name,))
        if not _try_lock(conn, key):
            holder = _holder(conn, key)
            limit = "" if timeout is None else f" (up to {timeout:g}s)"
            print(
                f"{target.location}: another process is {doing} ({holder}); "
                f"waiting for it to finish{limit}",
                file=sys.stderr,
                flush=True,
            )
            deadline = None if timeout is None else time.monotonic() + timeout
            while not _try_lock(conn, key):
                if deadline is not None and time.monotonic() >= deadline:
                    raise StoreLockedError(
                        f"{target.location}: another process ({holder}) is still {doing} "
                        f"after {timeout:g}s: wait for it to finish, or raise --lock-timeout"
                    )
                time.sleep(0.1)
        yield
    finally:
        conn.close()  # the server drops the lock with the session


def _try_lock(conn, key: int) -> bool:
    return bool(conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0])


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


def open_existing(
    target: str,
    *,
    backend: str | None = None,
    rescore: int | None = None,
    lock_timeout: float | None = None,
) -> PostgresStore | None:
    """The store in the target's table; None when the database holds none there;
    StoreError when the table exists but is not a densefit store, or the server cannot be
    reached."""
    parsed = parse_target(target)
    backend = _check_backend(backend, parsed.location)
    conn = _connect(parsed)
    try:
        names = _Names(parsed.table)
        if _exists(conn, f"{parsed.table}_record"):
            return PostgresStore(parsed, conn, backend=backend, rescore=rescore)
        if _exists(conn, parsed.table):
            raise StoreError(
                f"{parsed.location}: table {names.table} exists and is not a densefit store: "
                "name another table in the target (postgresql://.../DATABASE/TABLE)"
            )
    except BaseException:
        conn.close()
        raise
    conn.close()
    return None


def _exists(conn, relation: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (relation,)).fetchone()[0]


def _index_valid(conn, index: str) -> bool | None:
    """Whether the index ``index`` is valid (usable by searches); None when there is none."""
    row = conn.execute(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", (index,)
    ).fetchone()
    return None if row is None else bool(row[0])


def _has_column(conn, table: str, column: str) -> bool:
    row = conn.execute(
        "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s "
        "AND NOT attisdropped",
        (table, column),
    ).fetchone()
    return row is not None


def create(
    target: str,
    record: StoreRecord,
    *,
    backend: str | None = None,
    rescore: int | None = None,
    lock_timeout: float | None = None,
) -> PostgresStore:
    """A new store in the target's table for ``record``'s vectors: the tables, the HNSW
    index and the record made in one transaction under a database-wide advisory lock
    (waiting up to ``lock_timeout`` seconds), so that concurrent creators make it once; a
    store another process created meanwhile is opened instead."""
    parsed = parse_target(target)
    backend = _check_backend(backend, parsed.location)
    _check_rescore(rescore, record.vector_kind, parsed.location)
    if record.vector_kind not in CAPABILITIES.vector_kinds:
        raise CapabilityError(
            f"{parsed.location}: PostgreSQL stores hold {' or '.join(CAPABILITIES.vector_kinds)} "
            f"vectors, not {record.vector_kind}"
        )
    psycopg = _psycopg()
    conn = _connect(parsed)
    try:
        registered = _pgvector_version(conn) is not None  # _connect registered its types
        try:
            with conn.transaction():
                if lock_timeout is not None:
                    conn.execute(
                        "SELECT set_config('lock_timeout', %s, TRUE)",
                        (f"{max(1, int(lock_timeout * 1000))}ms",),
                    )
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key("create"),))
                _create_tables(conn, parsed, record)
        except psycopg.errors.LockNotAvailable:
            raise StoreLockedError(
                f"{parsed.location}: another process is still creating a store after "
                f"{lock_timeout:g}s: wait for it to finish, or raise --lock-timeout"
            ) from None
        if not registered:  # the extension is new: register its types on a new connection
            conn.close()
            conn = _connect(parsed)
        return PostgresStore(parsed, conn, backend=backend, rescore=rescore)
    except BaseException:
        conn.close()
        raise


def _create_tables(conn, target: Target, record: StoreRecord) -> None:
    """Create the store's tables inside the caller's transaction (nothing when another
    process created them first)."""
    psycopg = _psycopg()
    sql = psycopg.sql
    names = _Names(target.table)
    if _exists(conn, f"{target.table}_record"):
        return
    if _exists(conn, target.table):
        raise StoreError(
            f"{target.location}: table {target.table} exists and is not a densefit store: "
            "name another table in the target (postgresql://.../DATABASE/TABLE)"
        )
    version = _pgvector_version(conn)
    if version is None:
        no_pgvector = Fault(
            psycopg.Error,
            f"{target.location}: the database has no pgvector and this user cannot add it "
            "({detail}): install pgvector on the server and run CREATE EXTENSION vector in "
            "the database as its owner",
        )
        with translated([no_pgvector]), conn.transaction():
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        version = _pgvector_version(conn)
    kind, dim = record.vector_kind, int(record.dim)
    if kind == "float16" and version < _HALFVEC:
        raise CapabilityError(
            f"{target.location}: the server's pgvector {'.'.join(map(str, version))} has no "
            "halfvec type (0.7 added it): store float32 vectors, or upgrade pgvector"
        )
    if _exists(conn, names.vectors_name(0)):
        raise StoreError(
            f"{target.location}: table {names.vectors_name(0)} exists and is not this store's "
            "vector table: name another table in the target (postgresql://.../DATABASE/TABLE)"
        )
    statements = [
        sql.SQL("CREATE SEQUENCE {}").format(names.seq),
        sql.SQL(
            'CREATE TABLE {} (id text COLLATE "C" PRIMARY KEY, seq int8 NOT NULL, '
            "text text NOT NULL, title text NOT NULL, meta jsonb NOT NULL, "
            "fields jsonb NOT NULL, text_hash text NOT NULL, meta_hash text NOT NULL, "
            "stale boolean NOT NULL DEFAULT FALSE, length int4 NOT NULL)"
        ).format(names.docs),
        sql.SQL("CREATE UNIQUE INDEX {} ON {} (seq)").format(names.index("by_seq"), names.docs),
        sql.SQL("CREATE INDEX {} ON {} (text_hash)").format(names.index("text_hash"), names.docs),
        _vector_table_sql(names, 0, kind, dim),
        sql.SQL(
            'CREATE TABLE {} (token text COLLATE "C" NOT NULL, seq int8 NOT NULL, '
            "tf int4 NOT NULL, length int4 NOT NULL, PRIMARY KEY (token, seq))"
        ).format(names.postings),
        sql.SQL("CREATE INDEX {} ON {} (seq)").format(names.index("postings_seq"), names.postings),
        sql.SQL(
            "CREATE TABLE {} (one boolean PRIMARY KEY DEFAULT TRUE CHECK (one), "
            "documents int8 NOT NULL, tokens int8 NOT NULL)"
        ).format(names.stats),
        sql.SQL("INSERT INTO {} (documents, tokens) VALUES (0, 0)").format(names.stats),
        sql.SQL("CREATE TABLE {} (key text PRIMARY KEY, value text NOT NULL)").format(names.record),
    ]
    spec = _hnsw_spec(kind, dim, version)
    if spec is not None:
        statements.append(_hnsw_sql(names, 0, spec, concurrently=False))
    for statement in statements:
        conn.execute(statement)
    with conn.cursor() as cur:
        cur.executemany(
            sql.SQL("INSERT INTO {} (key, value) VALUES (%s, %s)").format(names.record),
            list({**record.to_meta(), MODEL_GENERATION_KEY: "0"}.items()),
        )
