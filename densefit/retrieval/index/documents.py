"""The SQLite half of a store: the document table, the meta table, and write transactions.

``store.sqlite`` holds one row per document (id, text, title, metadata, the hashes that
decide whether it must be re-embedded, and its row in the vector file) and a ``meta`` table of
``key -> value`` strings (format, model, settings, row count, generation). One connection is
shared by a store's threads; the store serialises calls on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import numpy as np

from densefit.data.types import Document
from densefit.errors import (
    RESTORE,
    DamagedFileError,
    DiskFullError,
    ReadOnlyStoreError,
    storage_fault,
)

__all__ = ["DB_NAME", "DocumentTable", "meta_hash", "parts", "text_hash"]

DB_NAME = "store.sqlite"
_SQLITE_READONLY, _SQLITE_IOERR, _SQLITE_CANTOPEN = 8, 10, 14  # SQLite's primary result codes
SQL_VARS = 900  # stay under SQLite's default limit on bound parameters

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY,
    row INTEGER NOT NULL UNIQUE,
    text TEXT NOT NULL,
    title TEXT NOT NULL DEFAULT '',
    meta TEXT NOT NULL DEFAULT '{}',
    text_hash TEXT NOT NULL,
    meta_hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS documents_text_hash ON documents(text_hash);
"""

_UPSERT = (
    "INSERT INTO documents(id, row, text, title, meta, text_hash, meta_hash) "
    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET row=excluded.row, "
    "text=excluded.text, title=excluded.title, meta=excluded.meta, "
    "text_hash=excluded.text_hash, meta_hash=excluded.meta_hash"
)
# While a model swap is under way (densefit.retrieval.index.swap) each document also has its
# row in the next generation's vector file, NULL until the new model embedded its text.
_UPSERT_SWAPPING = (
    "INSERT INTO documents(id, row, text, title, meta, text_hash, meta_hash, next_row) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET row=excluded.row, "
    "text=excluded.text, title=excluded.title, meta=excluded.meta, "
    "text_hash=excluded.text_hash, meta_hash=excluded.meta_hash, next_row=excluded.next_row"
)


def text_hash(text: str) -> str:
    """The hash that decides whether a document must be re-embedded."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def meta_hash(document: Document) -> str:
    """The hash of what is stored but not embedded: title and metadata."""
    payload = json.dumps([document.title, document.meta], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


def parts(items: list, size: int = SQL_VARS) -> Iterator[list]:
    """``items`` in slices small enough for one SQL ``IN (...)``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _read_only_connection(db: Path) -> sqlite3.Connection:
    """A connection that never writes: ``mode=ro``, or, where SQLite cannot make the files a
    WAL database's readers share (a read-only folder, a full disk), ``immutable`` (it reads
    the database file alone, which no one can change there)."""
    uri = f"file:{quote(str(db.resolve()))}?mode=ro"
    try:
        return _connect(uri, uri=True)
    except sqlite3.OperationalError as exc:
        if exc.sqlite_errorcode & 0xFF not in (_SQLITE_READONLY, _SQLITE_CANTOPEN, _SQLITE_IOERR):
            raise
    return _connect(uri + "&immutable=1", uri=True)


def _connect(target: str | Path, *pragmas: str, uri: bool = False) -> sqlite3.Connection:
    """A connection to the database ``target`` that ran ``pragmas`` and has read it (opening
    alone reads nothing; a writer's first read makes the WAL's files)."""
    options = {"isolation_level": None, "timeout": 60.0, "check_same_thread": False}
    conn = sqlite3.connect(target, uri=uri, **options)
    try:
        for pragma in pragmas:
            conn.execute(f"PRAGMA {pragma}")
        conn.execute("SELECT COUNT(*) FROM meta").fetchone()
    except BaseException:
        conn.close()
        raise
    return conn


def write_new_database(path: Path, meta: dict[str, str]) -> None:
    """Create ``path`` with the schema and ``meta``, built in a side file and renamed into
    place, so that a crash during creation leaves no half-made database."""

    tmp_db = path.with_name(path.name + ".creating")
    tmp_db.unlink(missing_ok=True)
    conn = sqlite3.connect(tmp_db, isolation_level=None)
    try:
        conn.executescript(SCHEMA)
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", meta.items())
        conn.execute("COMMIT")
    finally:
        conn.close()
    os.replace(tmp_db, path)


class DocumentTable:
    """Queries on one store's ``store.sqlite``; the caller holds the store's thread lock.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> write_new_database(folder / DB_NAME, {"n_rows": "0"})
    >>> table = DocumentTable(folder / DB_NAME)
    >>> with table.transaction():
    ...     table.upsert([Document("a", "cells divide")], start=0)
    >>> table.count(), table.rows_of(["a"])
    (1, {'a': 0})
    """

    def __init__(self, db: Path, *, read_only: bool = False):
        self.db = db
        self.conn: sqlite3.Connection | None = None
        self.read_only: str | None = None  # why this connection may not write (None: it may)
        self.full_disk = False  # it may not for want of space
        if not read_only:
            try:
                self.conn = _connect(db, "journal_mode=WAL", "synchronous=FULL")
                return
            except sqlite3.OperationalError as exc:
                # SQLite may not write here, or has no room for the files a writer shares
                # (a WAL database's shared memory): a reader needs neither
                fault = storage_fault(exc, db)
                if not isinstance(fault, (ReadOnlyStoreError, DiskFullError)):
                    raise
                self.close()
                self.full_disk = isinstance(fault, DiskFullError)
                self.read_only = f"SQLite cannot write {db.name}: {exc}"
        self.read_only = self.read_only or "opened read-only"
        self.conn = _read_only_connection(db)

    def check(self) -> None:
        """Raise :class:`~densefit.errors.DamagedFileError` unless SQLite finds the database
        whole (``PRAGMA quick_check``: every page and record readable; a few ms for 5,000
        documents, bench/results/faults.json)."""
        found = [row[0] for row in self.conn.execute("PRAGMA quick_check(3)")]
        if found != ["ok"]:
            raise DamagedFileError(
                f"{self.db}: the database is damaged (SQLite's quick_check: "
                f"{'; '.join(' '.join(f.split()) for f in found)[:300]}): {RESTORE}"
            )

    def unmerged_wal(self) -> bool:
        """Whether the write-ahead log holds writes a read-only connection cannot see."""
        wal = self.db.with_name(self.db.name + "-wal")
        return self.read_only is not None and wal.is_file() and wal.stat().st_size > 0

    def invalid_meta_ids(self, limit: int = 10) -> list[str]:
        """Ids of documents whose metadata is not valid JSON (none is written so now)."""
        if self.conn is None:
            return []
        query = "SELECT id FROM documents WHERE NOT json_valid(meta) LIMIT ?"
        try:
            return [doc_id for (doc_id,) in self.conn.execute(query, (limit,))]
        except sqlite3.Error:
            return []

    # -- meta ------------------------------------------------------------------------------

    def read_meta(self) -> dict[str, str]:
        """Every ``key -> value`` of the meta table."""
        return dict(self.conn.execute("SELECT key, value FROM meta"))

    def meta_value(self, key: str, default: str | None = None) -> str | None:
        """One meta value (``default`` when the key is not recorded)."""
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else row[0]

    def set_meta(self, key: str, value) -> None:
        """Record ``key = str(value)``, inside the caller's transaction."""
        self.conn.execute(
            "INSERT INTO meta(key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, str(value)),
        )

    def data_version(self) -> int:
        """Changes whenever another connection commits."""
        return self.conn.execute("PRAGMA data_version").fetchone()[0]

    @contextmanager
    def transaction(self) -> Iterator[DocumentTable]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on an exception): SQLite's write
        lock is held inside the block."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # -- documents -------------------------------------------------------------------------

    def count(self) -> int:
        """The number of documents."""
        return int(self.conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0])

    def _where_in(self, columns: str, key: str, values: Sequence, rest: str = "") -> Iterator:
        """The rows ``SELECT columns FROM documents WHERE key IN (values) rest``, asked in
        parts of at most :data:`SQL_VARS` values."""
        for part in parts(list(values)):
            marks = ",".join("?" * len(part))
            query = f"SELECT {columns} FROM documents WHERE {key} IN ({marks}) {rest}"
            yield from self.conn.execute(query, part)

    def get(self, ids: Sequence[str]) -> dict[str, Document]:
        """``{id: Document}`` for the ids that are stored."""
        rows = self._where_in("id, text, title, meta", "id", ids)
        return {i: Document(i, text, title, json.loads(meta)) for i, text, title, meta in rows}

    def hashes(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """``{id: (text_hash, meta_hash)}`` for the ids that are stored."""
        return {i: (th, mh) for i, th, mh in self._where_in("id, text_hash, meta_hash", "id", ids)}

    def ids_after(self, last: str, limit: int = 10000) -> list[str]:
        """Up to ``limit`` ids greater than ``last``, in id order (for paging)."""
        query = "SELECT id FROM documents WHERE id > ? ORDER BY id LIMIT ?"
        return [row[0] for row in self.conn.execute(query, (last, limit))]

    def rows_of(self, ids: list[str]) -> dict[str, int]:
        """``{id: vector row}`` for the ids that are stored."""
        return dict(self._where_in("id, row", "id", ids))

    def all_rows(self) -> np.ndarray:
        """The vector row of every document (int64; no Python list of a million ints)."""
        return np.fromiter((r for (r,) in self.conn.execute("SELECT row FROM documents")), np.int64)

    def first_rows_of_texts(self, hashes: list[str]) -> dict[str, int]:
        """``{text_hash: the lowest row holding that text}`` for the hashes that are stored."""
        return dict(
            self._where_in("text_hash, MIN(row)", "text_hash", set(hashes), "GROUP BY text_hash")
        )

    def documents_at(self, rows: list[int]) -> dict[int, tuple[str, str, str, dict]]:
        """``{row: (id, text, title, meta)}`` of the documents at these vector rows."""
        found = self._where_in("row, id, text, title, meta", "row", rows)
        return {row: (i, text, title, json.loads(meta)) for row, i, text, title, meta in found}

    def ids_at(self, rows: list[int]) -> dict[int, str]:
        """``{row: id}`` of the documents at these vector rows."""
        return dict(self._where_in("row, id", "row", rows))

    def texts_at(self, rows: Sequence[int]) -> list[str]:
        """The texts of the documents at these vector rows, in that order (each must exist)."""
        found = dict(self._where_in("row, text", "row", [int(r) for r in rows]))
        return [found[int(r)] for r in rows]

    def rows_matching(self, where: str, params: Sequence) -> list[int]:
        """The vector rows of the documents satisfying the SQL clause ``where`` (a compiled
        filter, :func:`~densefit.retrieval.index.sqlite_filters.compile_filters`), in row order."""
        query = f"SELECT row FROM documents WHERE {where} ORDER BY row"
        return [r for (r,) in self.conn.execute(query, list(params))]

    def documents_matching(self, where: str, params: Sequence) -> list[Document]:
        """The documents satisfying ``where``, in row (write) order."""
        query = f"SELECT id, text, title, meta FROM documents WHERE {where} ORDER BY row"
        return [
            Document(doc_id, text, title, json.loads(meta))
            for doc_id, text, title, meta in self.conn.execute(query, list(params))
        ]

    def count_matching(self, where: str, params: Sequence) -> int:
        """How many documents satisfy ``where``."""
        query = f"SELECT COUNT(*) FROM documents WHERE {where}"
        return int(self.conn.execute(query, list(params)).fetchone()[0])

    # -- metadata statistics ----------------------------------------------------------------
    # ``field_sql`` and ``type_sql`` come from sqlite_filters.meta_field_sql (a checked JSON path);
    # ``where`` from compile_filters (bound parameters).

    def meta_values(
        self, field_sql: str, type_sql: str, where: str, params: Sequence
    ) -> list[tuple[str, object, int]]:
        """``(JSON type, SQL value, documents)`` of each distinct non-null value of a
        metadata field among the documents satisfying ``where``."""
        query = (
            f"SELECT t, v, COUNT(*) FROM (SELECT {type_sql} AS t, {field_sql} AS v "
            f"FROM documents WHERE {where}) WHERE t IS NOT NULL AND t != 'null' "
            "GROUP BY t, v ORDER BY t, v"
        )
        return list(self.conn.execute(query, list(params)))

    def meta_range(
        self, field_sql: str, type_sql: str, types: tuple[str, ...], where: str, params: Sequence
    ) -> tuple[object, object]:
        """``(MIN, MAX)`` of a metadata field's values of the JSON ``types`` among the
        documents satisfying ``where`` (``(None, None)`` when there are none)."""
        marks = ",".join("?" * len(types))
        query = (
            f"SELECT MIN(v), MAX(v) FROM (SELECT {type_sql} AS t, {field_sql} AS v "
            f"FROM documents WHERE {where}) WHERE t IN ({marks})"
        )
        low, high = self.conn.execute(query, [*params, *types]).fetchone()
        return low, high

    def meta_keys(self) -> list[tuple[str, str, int]]:
        """``(key, JSON type, documents)`` of the top-level metadata keys (null values left
        out)."""
        query = (
            "SELECT j.key, j.type, COUNT(*) FROM documents, json_each(documents.meta) AS j "
            "WHERE j.type != 'null' GROUP BY j.key, j.type ORDER BY j.key, j.type"
        )
        return list(self.conn.execute(query))

    def upsert(
        self,
        documents: Sequence[Document],
        *,
        start: int,
        swapping: bool = False,
        next_start: int | None = None,
    ) -> None:
        """Insert or replace ``documents``, the i-th at vector row ``start + i``. While a
        model swap is under way (``swapping``) the i-th gets next-generation row
        ``next_start + i``, or none (the swap embeds it) when ``next_start`` is None."""
        rows = [
            (
                d.id,
                start + i,
                d.text,
                d.title or "",
                json.dumps(d.meta or {}, default=str),
                text_hash(d.text),
                meta_hash(d),
            )
            for i, d in enumerate(documents)
        ]
        if not swapping:
            self.conn.executemany(_UPSERT, rows)
            return
        self.conn.executemany(
            _UPSERT_SWAPPING,
            [(*row, None if next_start is None else next_start + i) for i, row in enumerate(rows)],
        )

    # -- the next generation of a model swap -------------------------------------------------

    def add_next_rows(self) -> None:
        """Give every document an empty next-generation row (adding the column to stores
        that never swapped), inside the caller's transaction."""
        columns = {name for _, name, *_ in self.conn.execute("PRAGMA table_info(documents)")}
        if "next_row" not in columns:
            self.conn.execute("ALTER TABLE documents ADD COLUMN next_row INTEGER")
        self.conn.execute("UPDATE documents SET next_row = NULL")

    def without_next_rows(self, after_row: int, limit: int) -> list[tuple[int, str, str]]:
        """``(row, id, text)`` of up to ``limit`` documents past vector row ``after_row`` that
        have no next-generation row yet, by row (writes append rows, so one pass in row
        order meets the documents written while it runs too)."""
        query = (
            "SELECT row, id, text FROM documents WHERE row > ? AND next_row IS NULL "
            "ORDER BY row LIMIT ?"
        )
        return self.conn.execute(query, (after_row, limit)).fetchall()

    def count_without_next_rows(self) -> int:
        """Documents the swap has still to embed."""
        query = "SELECT COUNT(*) FROM documents WHERE next_row IS NULL"
        return int(self.conn.execute(query).fetchone()[0])

    def set_next_rows(self, pairs: Sequence[tuple[str, int]]) -> None:
        """``(id, next row)`` recorded, inside the caller's transaction."""
        self.conn.executemany(
            "UPDATE documents SET next_row = ? WHERE id = ?", [(r, i) for i, r in pairs]
        )

    def promote_next_rows(self) -> None:
        """Every document's next-generation row becomes its row (the swap's switch), keeping
        rows unique at every step."""
        self.conn.execute("UPDATE documents SET row = -row - 1")  # park at negative rows
        self.conn.execute("UPDATE documents SET row = next_row, next_row = NULL")

    def update_metadata(self, documents: Sequence[Document]) -> int:
        """Replace title and metadata of stored documents; returns the rows changed."""
        cursor = self.conn.executemany(
            "UPDATE documents SET title=?, meta=?, meta_hash=? WHERE id=?",
            [
                (d.title or "", json.dumps(d.meta or {}, default=str), meta_hash(d), d.id)
                for d in documents
            ],
        )
        return cursor.rowcount

    def delete(self, ids: list[str]) -> None:
        """Delete these documents (inside the caller's transaction)."""
        for part in parts(ids):
            marks = ",".join("?" * len(part))
            self.conn.execute(f"DELETE FROM documents WHERE id IN ({marks})", part)

    def rows_in_order(self) -> list[tuple[int, str]]:
        """``(row, id)`` of every document, by row."""
        return self.conn.execute("SELECT row, id FROM documents ORDER BY row").fetchall()

    def renumber(self, ids_in_order: list[str]) -> None:
        """Give the i-th id row i (compaction), keeping rows unique at every step."""
        self.conn.execute("UPDATE documents SET row = -row - 1")  # park at negative rows
        self.conn.executemany(
            "UPDATE documents SET row = ? WHERE id = ?",
            [(i, doc_id) for i, doc_id in enumerate(ids_in_order)],
        )

    def close(self) -> None:
        """Close the connection."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
