"""The embedded document store: a folder with SQLite for documents and a file of vectors.

Layout of a store folder::

    store.sqlite          documents (id, text, title, meta, hashes, vector row) and meta
    densefit.lock         the writer lock, while creation or indexing holds it
    vectors-<gen>.f32     committed embeddings, row-major (``.f16`` for float16 stores); during
                          a model swap also the next generation's, made by the new model
    bm25-<gen>.npz        the BM25 index of the documents' texts (a cache, checked before use)
    faiss-<gen>-*.index   FAISS cache, only when searched with the FAISS backend

The parts, put together behind :class:`LocalDocumentStore` (the embedded engine of
:func:`~densefit.retrieval.index.engines.open_store`: a folder, or None for a temporary
store): :mod:`~densefit.retrieval.index.documents` (SQLite: documents, meta, transactions),
:mod:`~densefit.retrieval.index.vectors` (the vector file, its commit protocol, the search
backends; int8 and binary codes: :mod:`~densefit.retrieval.index.quantized`),
:mod:`~densefit.retrieval.index.lexical` (the BM25 index, brought up to date before it
answers), :mod:`~densefit.retrieval.index.locking` (one writer at a time) and
:mod:`~densefit.retrieval.index.settings` (the record: searching with another model raises
:class:`~densefit.retrieval.index.types.ModelMismatchError`, indexing with other settings
:class:`~densefit.retrieval.index.settings.SettingsMismatchError`).

Every write is one SQLite transaction, its vectors fsync'd before it commits: a process
killed at any point leaves the last committed state readable, and ``densefit index``
resumes, skipping unchanged documents by their text hash. A model swap
(:mod:`densefit.retrieval.index.swap`) writes the next generation's vector file while the
store answers from the current one, and switches in one commit. Updated and deleted
documents leave dead rows that searches skip; :meth:`LocalDocumentStore.compact` rewrites
the file without them (a new generation, swapped in by one commit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sqlite3
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import wraps
from pathlib import Path

import numpy as np

from densefit.data.types import Document
from densefit.errors import (
    FREE_SPACE,
    DamagedFileError,
    DiskFullError,
    ReadOnlyStoreError,
    StorageFault,
    storage_fault,
)
from densefit.retrieval.index.common import (
    Fault,
    StoreCommon,
    checked_documents,
    checked_write,
    translated,
)
from densefit.retrieval.index.documents import (
    DB_NAME,
    DocumentTable,
    meta_hash,
    text_hash,
    write_new_database,
)
from densefit.retrieval.index.filters import Filter, parse_filters
from densefit.retrieval.index.lexical import StoreBm25
from densefit.retrieval.index.locking import LOCK_NAME, writer_lock
from densefit.retrieval.index.registry import capabilities_of
from densefit.retrieval.index.settings import settings_of
from densefit.retrieval.index.sqlite_filters import (
    compile_filters,
    meta_field_sql,
    meta_index_sql,
)
from densefit.retrieval.index.swap import LOCK_NAME as SWAP_LOCK_NAME
from densefit.retrieval.index.swap import (
    MODEL_GENERATION_KEY,
    SWAP_KEY,
    SwapCoordinator,
    model_swapped,
    next_vectors_for,
    refuse_during_swap,
    switched_meta,
)
from densefit.retrieval.index.types import (
    StoreError,
    StoreRecord,
    SwapTarget,
    WriteResult,
)
from densefit.retrieval.index.vectors import CommittedVectors, make_backend
from densefit.wording import plural

__all__ = [
    "CAPABILITIES",
    "LocalDocumentStore",
    "create",
    "make_backend",
    "meta_hash",
    "open_existing",
    "text_hash",
    "why_none",
]

CAPABILITIES = capabilities_of("embedded")  # declared in its registry row
# The files a store keeps in its folder (see the layout above): drop() deletes these, under
# the writer lock, whose own file (LOCK_NAME) goes as the lock is let go.
_OWN_FILES = (
    f"{DB_NAME}*",  # the database, its WAL and shared memory
    "vectors-*.*",
    "bm25-*.npz*",
    "faiss-*.index*",
    SWAP_LOCK_NAME,
)
SWAP_ROWS_KEY = "swap_rows"  # meta: the rows committed to the swap's vector file
_DROP_SWAP = "DELETE FROM meta WHERE key IN (?, ?)"  # a swap switched or cancelled


def _locked(method):
    """``method`` run in the store's :meth:`~LocalDocumentStore._reading`."""

    @wraps(method)
    def locked(self, *args, **kwargs):
        with self._reading():
            return method(self, *args, **kwargs)

    return locked


def _json_value(kind: str, value):
    """A metadata value from SQLite's ``json_extract`` back to its Python type."""
    if kind in ("true", "false"):
        return kind == "true"
    if kind in ("array", "object"):
        return json.loads(value)
    return value


def compiled_filters(filters: Filter | dict | None) -> tuple[str, list]:
    """The SQL clause and parameters of ``filters`` (parsed for the embedded store: a dict
    here, a :class:`~densefit.retrieval.index.filters.Filter` from the edge); ``"1"`` when
    there is nothing to filter."""
    return compile_filters(parse_filters(filters, CAPABILITIES))


class LocalDocumentStore(SwapCoordinator, StoreCommon):
    """Documents in SQLite, embeddings in a vector file, searched by a pluggable backend.

    Get one from :func:`~densefit.retrieval.index.engines.open_store` with a folder (or
    None: a temporary store, deleted when closed or garbage-collected), which creates it for
    a model and records it; ``LocalDocumentStore(path)`` opens an existing folder.

    >>> from densefit.testing import tiny_model
    >>> from densefit.data.types import Document
    >>> from densefit.retrieval.encode import encode_texts
    >>> from densefit.retrieval.index.engines import open_store
    >>> model = tiny_model()
    >>> store = open_store(None, model)
    >>> docs = [Document("a", "cells divide"), Document("b", "python functions")]
    >>> store.write(docs, encode_texts(model, [d.text for d in docs]))
    WriteResult(added=2, updated=0)
    >>> store.search(encode_texts(model, ["python functions"]), top_k=1)[0][0].id
    'b'
    """

    capabilities = CAPABILITIES

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        backend: str | Callable | None = None,
        rescore: int | None = None,
        read_only: bool = False,
    ):
        super().__init__()
        self.path = Path(path)
        self.location = str(self.path)
        db = self.path / DB_NAME
        if not db.is_file():
            raise StoreError(_not_a_store(self.path))
        self._table = None
        try:
            with self._errors():
                self._open(db, backend=backend, rescore=rescore, read_only=read_only)
        except BaseException:
            if self._table is not None:
                self._table.close()
            raise

    def _open(self, db: Path, *, backend, rescore, read_only: bool) -> None:
        """Open the database (read-only when asked, or when this process may not write the
        folder), check that it is whole, and load the committed state."""
        why = "opened read-only" if read_only else _unwritable(self.path)
        # one connection shared by threads, under self._lock
        self._table = DocumentTable(db, read_only=why is not None)
        self.read_only = why or self._table.read_only  # why writes are refused; None: they are not
        self._table.check()
        self.backend_spec = backend or CAPABILITIES.backends[0]
        self._rescore = rescore
        self._vectors: CommittedVectors | None = None  # made by _reload, for the record's model
        self.model_generation = -1  # the model swaps the store went through; -1: not read yet
        self._bm25 = StoreBm25(self.path)
        self._wrote = False  # this object committed text changes (flush saves the BM25 index)
        self._cleanup: Callable | None = None
        self._reload()
        if not self.read_only:
            self._remove_stale_files()
        elif self._table.unmerged_wal():
            warnings.warn(
                f"{db}-wal holds writes that a read-only store cannot read; open the store "
                "once where it may be written to merge them",
                stacklevel=3,
            )

    @property
    def backend(self):
        """The search backend over the committed vectors (rebuilt after a compaction)."""
        return self._vectors.backend

    # -- creation --------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | os.PathLike | None,
        record: StoreRecord,
        *,
        backend: str | Callable | None = None,
        rescore: int | None = None,
    ) -> LocalDocumentStore:
        """Create an empty store for the vectors ``record`` describes (model, dimension,
        similarity, vector kind, settings) in the folder ``path`` (None: a temporary one).
        The caller holds the folder's writer lock when others may create it too
        (:func:`create` does)."""
        record.check_searchable(str(path) if path is not None else "a temporary store")
        backend = backend or CAPABILITIES.backends[0]
        make_backend(backend, record.dim, kind=record.vector_kind, rescore=rescore)  # fails first
        temporary = path is None
        folder = Path(tempfile.mkdtemp(prefix="densefit-store-")) if temporary else Path(path)
        _check_new_folder(folder)
        db = folder / DB_NAME  # a full disk, a read-only file system: a fault naming it
        with translated([Fault((OSError, sqlite3.Error), lambda exc: storage_fault(exc, db))]):
            folder.mkdir(parents=True, exist_ok=True)
            write_new_database(db, record.to_meta())
        store = cls(folder, backend=backend, rescore=rescore)
        if temporary:
            store._cleanup = weakref.finalize(store, shutil.rmtree, folder, True)
        return store

    def writer_lock(
        self, timeout: float | None = None, *, name: str | None = None, doing: str | None = None
    ) -> AbstractContextManager:
        """The folder's lock file ``name`` (the writer lock by default), held across
        processes (:func:`~densefit.retrieval.index.locking.writer_lock`);
        :class:`~densefit.errors.ReadOnlyStoreError` for a read-only store."""
        self._check_writable()
        options = {"name": name, "doing": doing}
        return writer_lock(self.path, timeout=timeout, **{k: v for k, v in options.items() if v})

    # -- the model -------------------------------------------------------------------------

    @_locked
    def adopt_runtime(self, source) -> bool:
        """Record ``source`` (a :class:`~densefit.retrieval.vector_source.VectorSource`) as what
        makes this store's vectors when it holds none yet: an empty store takes the runtime
        of its first write. Returns whether it did."""
        self._refresh()
        settings = self.record.settings
        if settings is None or int(self._table.meta_value("n_rows")) > 0:
            return False
        if settings.source == source:
            return True
        with self.transaction() as fresh:
            if int(self._table.meta_value("n_rows")) > 0:
                return False
            self._table.set_meta("runtime", source.to_json())
        if fresh:
            self.record.settings = dataclasses.replace(settings, source=source)
        else:
            self._reload()
        return True

    @_locked
    def start_reembedding(self, model, runtime=None) -> None:
        """Record ``model``'s settings and mark every stored vector stale, in one commit.

        Stale documents are re-embedded by the next :func:`~densefit.retrieval.index.
        indexing.index_documents` even when their text is unchanged, and it re-embeds those
        missing from its input from their stored text; a crash in between resumes.
        """
        settings = settings_of(model, runtime)
        with self.transaction() as fresh:
            refuse_during_swap(self.location, self._swap_under_way())
            for key, value in settings.to_meta().items():
                self._table.set_meta(key, value)
            self._table.set_meta("stale_below_row", self._table.meta_value("n_rows"))
        self.record.settings = settings
        if not fresh:
            self._reload()

    @_locked
    def stale_ids(self, ids: Sequence[str]) -> set[str]:
        """The ids among ``ids`` whose vectors predate the last :meth:`start_reembedding`."""
        below = int(self._table.meta_value("stale_below_row", "0"))
        if below == 0:
            return set()
        return {i for i, row in self._table.rows_of(list(ids)).items() if row < below}

    @_locked
    def all_stale_ids(self) -> list[str]:
        """Every id whose vector predates the last :meth:`start_reembedding`."""
        below = int(self._table.meta_value("stale_below_row", "0"))
        return [doc_id for row, doc_id in self._table.rows_in_order() if row < below]

    @_locked
    def finish_reembedding(self) -> None:
        """Clear the stale mark once no stale vector is left (see :meth:`start_reembedding`)."""
        if self._table.meta_value("stale_below_row", "0") == "0":
            return
        if self.all_stale_ids():
            raise StoreError(f"{self.path}: documents still hold vectors made before --reembed")
        with self.transaction():
            self._table.set_meta("stale_below_row", 0)

    # -- a model swap: the next generation's vector file ------------------------------------
    # SwapCoordinator (densefit.retrieval.index.swap) runs the swap over these primitives:
    # the next generation's vectors go to their own file, each document's row there to
    # ``next_row``, and the switch promotes them in one SQLite commit.

    swap_target = _locked(SwapCoordinator.swap_target)
    begin_swap = _locked(SwapCoordinator.begin_swap)
    swap_pending = _locked(SwapCoordinator.swap_pending)
    write_swap = _locked(SwapCoordinator.write_swap)
    finish_swap = _locked(SwapCoordinator.finish_swap)
    cancel_swap = _locked(SwapCoordinator.cancel_swap)

    @contextmanager
    def _swap_transaction(self) -> Iterator[None]:
        with self._lock, self.transaction():
            self._swap = self._swap_under_way()
            yield None

    def _save_swap(self, tx, swap: SwapTarget | None) -> None:
        if swap is None:
            self._table.conn.execute(_DROP_SWAP, (SWAP_KEY, SWAP_ROWS_KEY))
        else:
            self._table.set_meta(SWAP_KEY, swap.to_json())
            self._table.set_meta(SWAP_ROWS_KEY, 0)

    def _create_generation(self, tx, record: StoreRecord, generation: int | None) -> int:
        if generation is not None:  # resumed: its file and next rows are kept
            return generation
        self._table.add_next_rows()
        return int(self._table.meta_value("generation")) + 1

    def _drop_generation(self, tx, swap: SwapTarget) -> None:
        """Nothing in the transaction: :meth:`_remove_stale_files` deletes the file after."""

    def _pending_rows(self, swap: SwapTarget, after_row: int, limit: int) -> list:
        return self._table.without_next_rows(after_row, limit)

    def _count_pending(self, swap: SwapTarget) -> int:
        return self._table.count_without_next_rows()

    def _put_next(self, tx, swap: SwapTarget, pending: list, vectors: np.ndarray) -> int:
        current = self._table.rows_of([i for _, i in pending])
        keep = [k for k, (row, i) in enumerate(pending) if current.get(i) == row]
        if not keep:
            return 0
        start = int(self._table.meta_value(SWAP_ROWS_KEY))
        self._swap_file(swap).write(start, vectors[keep])
        self._table.set_next_rows([(pending[k][1], start + n) for n, k in enumerate(keep)])
        self._table.set_meta(SWAP_ROWS_KEY, start + len(keep))
        return len(keep)

    def _switch(self, tx, swap: SwapTarget) -> None:
        self._table.promote_next_rows()
        values = switched_meta(swap, int(self._table.meta_value(MODEL_GENERATION_KEY, "0")))
        values.update(n_rows=self._table.meta_value(SWAP_ROWS_KEY), stale_below_row=0)
        for key, value in values.items():
            self._table.set_meta(key, value)
        self._save_swap(tx, None)
        self._wrote = True

    def _swap_changed(self) -> None:
        self._reload()
        self._remove_stale_files()

    def _swap_file(self, swap: SwapTarget):
        return self._vectors.file_for(swap.generation, swap.record.dim)

    def _swap_under_way(self) -> SwapTarget | None:
        """The swap the meta table records now (inside the caller's transaction)."""
        return SwapTarget.from_json(self._table.meta_value(SWAP_KEY), self.path)

    # -- reading ---------------------------------------------------------------------------

    @_locked
    def count(self) -> int:
        """The number of documents."""
        self._refresh()
        return self._table.count()

    @_locked
    def get(self, ids: Sequence[str]) -> list[Document | None]:
        self._refresh()
        found = self._table.get(ids)
        return [found.get(i) for i in ids]

    @_locked
    def hashes(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        self._refresh()
        return self._table.hashes(ids)

    def ids(self) -> Iterator[str]:
        last = ""
        while True:
            with self._lock:
                self._refresh()
                page = self._table.ids_after(last)
            if not page:
                return
            yield from page
            last = page[-1]

    @_locked
    def vectors(self, ids: Sequence[str]) -> np.ndarray:
        """The stored (normalised, for cosine stores) embeddings of ``ids`` as float32."""
        self._refresh()
        rows = self._table.rows_of(list(ids))
        missing = [i for i in ids if i not in rows]
        if missing:
            raise KeyError(f"{len(missing)} ids are not in the store, e.g. {missing[:3]}")
        return np.asarray(self._vectors.view()[[rows[i] for i in ids]], dtype=np.float32)

    @_locked
    def vectors_for_texts(self, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """Stored vectors of documents whose :func:`text_hash` is in ``hashes``, one per hash.

        Lets indexing copy the vector of a text that is already stored (a duplicate document)
        instead of encoding it again. Stale vectors (:meth:`start_reembedding`) are not used.
        """
        self._refresh()
        below = int(self._table.meta_value("stale_below_row", "0"))
        rows = {
            h: r
            for h, r in self._table.first_rows_of_texts(list(hashes)).items()
            if below <= r < self._vectors.n_rows
        }
        if not rows:
            return {}
        found = np.asarray(self._vectors.view()[list(rows.values())], dtype=np.float32)
        return dict(zip(rows, found, strict=True))

    # The engine's parts of a search (StoreCommon.search): keys are rows of the vector file.

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """The store's lock held (one call at a time per store object, which a server's
        threads may share), a full disk, a read-only or a damaged file turned into its
        :class:`~densefit.errors.StorageFault` naming the file (:attr:`_faults`)."""
        with self._lock, self._errors():
            yield

    def _where(self, filters: Filter) -> np.ndarray:
        """The rows of the documents matching ``filters``."""
        return np.asarray(self._table.rows_matching(*compile_filters(filters)), dtype=np.int64)

    def _dense(self, queries: np.ndarray, k: int, rows) -> list[tuple[np.ndarray, np.ndarray]]:
        scores, found = self._vectors.search(queries, k, rows)  # padded with row -1
        return [(r[r >= 0], s[r >= 0]) for s, r in zip(scores, found, strict=True)]

    def _lexical(self, texts: list[str], k: int, rows) -> list[tuple[np.ndarray, np.ndarray]]:
        """BM25 ``(rows, scores)`` of each text among the live rows (of ``rows``)."""
        self._bm25_current()
        mask = None
        if rows is not None:
            mask = np.zeros(self._vectors.n_rows, dtype=bool)
            mask[rows] = True
        return self._bm25.search(texts, k, mask)

    def _documents_at(self, rows: list[int]) -> dict[int, tuple[str, str, str, dict]]:
        return self._table.documents_at(rows)

    def _ids_at(self, rows: list[int]) -> dict[int, str]:
        return self._table.ids_at(rows)

    def _bm25_current(self):
        """The BM25 index of exactly the committed live rows (updated first if behind)."""
        vectors = self._vectors
        return self._bm25.current(vectors.generation, vectors.live_rows(), self._table.texts_at)

    def update_bm25(self) -> bool:
        """Bring the BM25 index up to date with the committed documents now (searches do it
        when they need it); returns whether it had to change. The texts are read under the
        store's lock, but tokenised and indexed outside it, so searches go on meanwhile.
        ``densefit serve``'s writer calls it after each commit, once BM25 has been used, so
        that BM25 searches do not pay for it."""
        with self._lock:
            self._refresh()
            vectors = self._vectors
            update = self._bm25.plan(vectors.generation, vectors.live_rows(), self._table.texts_at)
        if update is None:
            return False
        built = update.build()
        with self._lock:
            self._bm25.install(built)
        return True

    @property
    def bm25_loaded(self) -> bool:
        """Whether this process holds the BM25 index in memory (it searched or built it)."""
        return self._bm25.loaded

    @_locked
    def filter_documents(self, filters: Filter | dict | None = None) -> list[Document]:
        """Every document matching ``filters`` (all of them for None or ``{}``), in the
        order they were written (an updated document counts as written last)."""
        where = compiled_filters(filters)
        self._refresh()
        return self._table.documents_matching(*where)

    @_locked
    def count_matching(self, filters: Filter | dict | None = None) -> int:
        """How many documents match ``filters`` (all of them for None or ``{}``)."""
        where = compiled_filters(filters)
        self._refresh()
        return self._table.count_matching(*where)

    @_locked
    def meta_values(
        self, field: str, filters: Filter | dict | None = None
    ) -> list[tuple[object, int]]:
        """Each distinct value of the metadata field ``field`` (``"meta.lang"``, nested
        ``"meta.a.b"``) among the documents matching ``filters``, with how many documents
        hold it, computed in SQLite. Documents without the field (or with null) are left
        out; values keep their JSON type, so ``1``, ``1.0``, ``True`` and ``"1"`` are four
        values; lists and objects come back as lists and dicts."""
        field_sql, type_sql = meta_field_sql(field)
        where = compiled_filters(filters)
        self._refresh()
        rows = self._table.meta_values(field_sql, type_sql, *where)
        return [(_json_value(kind, value), n) for kind, value, n in rows]

    @_locked
    def meta_range(self, field: str, filters: Filter | dict | None = None) -> tuple[object, object]:
        """``(min, max)`` of the metadata field ``field`` among the documents matching
        ``filters``: of its numbers (booleans are not numbers here), or, when it holds no
        number, of its strings (ISO dates order as dates); ``(None, None)`` when neither."""
        field_sql, type_sql = meta_field_sql(field)
        where = compiled_filters(filters)
        self._refresh()
        for types in (("integer", "real"), ("text",)):
            low, high = self._table.meta_range(field_sql, type_sql, types, *where)
            if low is not None:
                return low, high
        return None, None

    @_locked
    def meta_fields(self) -> dict[str, dict[str, int]]:
        """The top-level metadata keys of the stored documents: ``{key: {JSON type:
        documents}}`` (SQLite's ``json_type`` names: ``text``, ``integer``, ``real``,
        ``true``, ``false``, ``array``, ``object``; null values left out)."""
        self._refresh()
        fields: dict[str, dict[str, int]] = {}
        for key, kind, n in self._table.meta_keys():
            fields.setdefault(key, {})[kind] = n
        return fields

    @_locked
    def index_meta_field(self, field: str) -> None:
        """Add an SQLite index on the metadata field ``field`` (``"meta.lang"``): filters
        comparing it with ``==``, ``in`` or a number then look rows up instead of scanning
        every document's JSON. Idempotent."""
        with self.transaction():
            self._table.conn.execute(meta_index_sql(field)[1])

    # -- writing ---------------------------------------------------------------------------

    @_locked
    def write(
        self,
        documents: Sequence[Document],
        embeddings: np.ndarray,
        *,
        swap_embeddings: np.ndarray | None = None,
        swap_target: SwapTarget | None = None,
    ) -> WriteResult:
        """Add or replace ``documents`` (by id) with their embeddings, in one transaction.

        Ids must be unique within one call. Cosine stores normalise the embeddings. While a
        model swap is under way the documents are embedded for both generations: by the new
        model too when ``swap_embeddings`` (made for ``swap_target``, the swap under way:
        :meth:`swap_target`) are given, else by the swap itself before it switches.
        """
        documents = list(documents)
        vectors, next_vectors = checked_write(
            self.record, documents, embeddings, swap_embeddings, swap_target
        )
        if not documents:
            return WriteResult()
        self._wrote = True
        with self.transaction() as fresh:
            start = int(self._table.meta_value("n_rows"))
            replaced = self._table.rows_of([d.id for d in documents])
            self._vectors.file.write(start, vectors)
            swap = self._swap_under_way()
            next_vectors = next_vectors_for(swap, swap_target, next_vectors)
            next_start = None
            if next_vectors is not None:
                next_start = int(self._table.meta_value(SWAP_ROWS_KEY))
                self._swap_file(swap).write(next_start, next_vectors)
                self._table.set_meta(SWAP_ROWS_KEY, next_start + len(documents))
            self._table.upsert(
                documents, start=start, swapping=swap is not None, next_start=next_start
            )
            self._table.set_meta("n_rows", start + len(documents))
        self._after_commit(fresh, dead=list(replaced.values()), n_rows=start + len(documents))
        return WriteResult(added=len(documents) - len(replaced), updated=len(replaced))

    @_locked
    def write_metadata(self, documents: Sequence[Document]) -> int:
        checked_documents(documents)
        with self.transaction():
            return self._table.update_metadata(documents)

    @_locked
    def delete(self, ids: Iterable[str]) -> int:
        """Delete documents by id in one transaction (unknown ids are ignored); returns how
        many were deleted."""
        ids = list(dict.fromkeys(ids))
        self._wrote = True
        with self.transaction() as fresh:
            rows = self._table.rows_of(ids)
            self._table.delete(list(rows))
        self._after_commit(fresh, dead=list(rows.values()), n_rows=self._vectors.n_rows)
        return len(rows)

    @_locked
    def dead_rows(self) -> int:
        self._refresh()
        return self._vectors.dead_rows()

    @_locked
    def compact(self) -> int:
        """Rewrite the vector file without dead rows; returns how many were dropped (none
        while a model swap is under way: the swap's switch starts a new file anyway)."""
        self._refresh()
        if self._swap is not None:
            return 0
        bm25_current = self._bm25.is_current(self._vectors.generation, self._vectors.live_rows())
        with self.transaction() as fresh:
            n_rows = int(self._table.meta_value("n_rows"))
            generation = int(self._table.meta_value("generation"))
            pairs = self._table.rows_in_order()
            dropped = n_rows - len(pairs)
            if dropped == 0:
                return 0
            rows = np.fromiter((r for r, _ in pairs), dtype=np.int64, count=len(pairs))
            self._vectors.copy_rows(rows, n_rows=n_rows, generation=generation + 1)
            self._table.renumber([doc_id for _, doc_id in pairs])
            # Rows keep their order, so the stale rows stay the first ones.
            below = int(self._table.meta_value("stale_below_row", "0"))
            self._table.set_meta("stale_below_row", int(np.sum(rows < below)))
            self._table.set_meta("n_rows", len(pairs))
            self._table.set_meta("generation", generation + 1)
        self._wrote = True
        self._reload()
        if bm25_current and fresh:
            # Live rows keep their order and become 0..n-1: the same BM25 index, renumbered.
            self._bm25.renumbered(generation + 1)
        self._remove_stale_files()
        return dropped

    @_locked
    def flush(self) -> None:
        """Let the backend persist its caches (the FAISS index) and save the BM25 index
        (brought up to date first) when this object wrote documents or used BM25;
        documents are always durable. Temporary stores keep no BM25 file."""
        if self.read_only:
            return  # nothing was written; the caches stay in memory
        try:
            self.backend.flush()
            if self._cleanup is None and (self._wrote or self._bm25.loaded):
                self._refresh()
                self._bm25_current()
                self._bm25.save()
        except OSError as exc:  # a cache: the next search builds it again
            warnings.warn(
                f"{exc.filename or self.path}: the search caches (BM25, FAISS) were not saved "
                f"({exc.strerror or exc}); the next search builds them again",
                stacklevel=2,
            )

    @_locked
    def close(self) -> None:
        """Flush caches and close the database. Temporary stores are deleted."""
        if self._table.conn is None:
            return
        try:
            self.flush()
        finally:
            self._table.close()
            if self._cleanup is not None:
                self._cleanup()

    @_locked
    def drop(self) -> None:
        """Delete the store: the files it keeps in its folder (database, vector files, BM25
        and FAISS caches, lock files; other files stay, and the folder goes when nothing else
        is left in it), under the writer lock; the store is closed after."""
        if self._table.conn is None:
            raise StoreError(f"{self.path}: the store is closed; open it again to drop it")
        with self.writer_lock():
            self._table.close()
            for pattern in _OWN_FILES:
                for path in self.path.glob(pattern):
                    path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.path.rmdir()  # only when empty
        if self._cleanup is not None:
            self._cleanup()

    def __repr__(self) -> str:
        return (
            f"LocalDocumentStore({str(self.path)!r}, model={self.model_name!r}, dim={self.dim}, "
            f"backend={getattr(self.backend, 'name', self.backend_spec)!r})"
        )

    def _info_extra(self) -> dict:
        current = self._bm25.is_current(self._vectors.generation, self._vectors.live_rows())
        return {
            "backend": getattr(self.backend, "name", str(self.backend_spec)),
            "bm25": "current" if current else "updated at the next BM25 search",
            "rescore": getattr(self.backend, "rescore", None),
        }

    @contextmanager
    def transaction(self) -> Iterator[bool]:
        """Hold SQLite's write lock in a ``with`` block (``BEGIN IMMEDIATE`` ... ``COMMIT``,
        the vectors appended inside); it yields True when no other connection committed
        since this store last loaded (its view is current). ModelSwappedError, the view
        reloaded, when another process switched to a new model."""
        if self._table.conn is None:
            raise StoreError(f"{self.path}: the store is closed")
        self._check_writable()
        with self._table.transaction() as table:
            swapped = int(table.meta_value(MODEL_GENERATION_KEY, "0")) != self.model_generation
            if not swapped:
                version = table.data_version()
                generation = int(table.meta_value("generation"))
                if generation != self._vectors.generation:  # another process compacted
                    self._vectors.use_generation(generation)
                yield version == self._data_version and generation == self._vectors.generation
        if swapped:
            self._reload()
            raise model_swapped(self.location, self.model_name)

    # -- internals -------------------------------------------------------------------------

    def _check_writable(self) -> None:
        """:class:`~densefit.errors.ReadOnlyStoreError` unless this store may be written
        (:class:`~densefit.errors.DiskFullError` when it opened read-only for a full disk)."""
        if self._table.full_disk:
            raise DiskFullError(
                f"{self.path}: the disk is full ({self.read_only}): {FREE_SPACE}; searching the "
                "store works meanwhile"
            )
        if self.read_only:
            raise ReadOnlyStoreError(
                f"{self.path} is read-only ({self.read_only}): searching it works; to change "
                "it, make the folder and its files writable by this user (or copy the store "
                "to a writable folder)"
            )

    @property
    def _faults(self) -> tuple[Fault, ...]:
        """The error table: the file system's and SQLite's errors as storage faults."""
        return (Fault((OSError, sqlite3.Error), self._fault),)

    def _fault(self, exc: BaseException) -> StorageFault | None:
        """The storage fault ``exc`` means for this store (see :func:`~densefit.errors.
        storage_fault`): SQLite's errors name ``store.sqlite``. Metadata that is not JSON
        (NaN written by an older densefit breaks SQLite's JSON functions) names the
        documents holding it."""
        db = self.path / DB_NAME
        if isinstance(exc, sqlite3.Error) and "malformed JSON" in str(exc):
            ids = self._table.invalid_meta_ids()
            some = ", ".join(map(repr, ids[:3])) + (", ..." if len(ids) > 3 else "")
            return DamagedFileError(
                f"{db}: the metadata of {plural(len(ids), 'document')} ({some}) is not valid "
                "JSON (NaN or Infinity, which densefit refuses now): write them again with "
                "finite numbers, or delete them"
            )
        fault = storage_fault(exc, db)
        if isinstance(fault, DiskFullError):  # say that nothing committed is lost
            fault = DiskFullError(f"{fault}; the store keeps what was committed (index resumes)")
        return fault

    def _after_commit(self, fresh: bool, *, dead: list[int], n_rows: int) -> None:
        """Update the live-row mask in place after our own commit (or reload if others wrote)."""
        if fresh:
            self._vectors.after_write(dead=dead, n_rows=n_rows)
        else:
            self._reload()

    def _refresh(self) -> None:
        """Reload if another connection (process) committed since we last looked."""
        if self._table.conn is None:
            raise StoreError(f"{self.path}: the store is closed")
        if self._table.data_version() != self._data_version:
            self._reload()

    def _reload(self) -> None:
        """Read the committed state and hand it to the backend."""
        table = self._table
        self._data_version = table.data_version()
        table.conn.execute("BEGIN")  # one consistent snapshot of meta and rows
        try:
            meta = table.read_meta()
            rows = table.all_rows()
        finally:
            table.conn.execute("COMMIT")
        record = StoreRecord.from_meta(meta, self.path / DB_NAME)
        model_generation = int(meta.get(MODEL_GENERATION_KEY, "0"))
        if model_generation != self.model_generation:  # opened, or another model swapped in
            self._vectors = CommittedVectors(
                self.path,
                dim=record.dim,
                kind=record.vector_kind,
                backend=self.backend_spec,
                rescore=self._rescore,
            )
        self._loaded(record, model_generation)
        self._swap = SwapTarget.from_json(meta.get(SWAP_KEY), self.path / DB_NAME)
        try:
            self._vectors.load(
                n_rows=int(meta["n_rows"]), generation=int(meta["generation"]), live_rows=rows
            )
        except OSError as exc:
            raise StoreError(str(exc)) from None

    def _remove_stale_files(self) -> None:
        """Delete vector files and caches of other generations (an interrupted compaction's);
        add the text-hash index to stores made before it existed.

        Only under the write lock, taken without waiting: a compaction in another process
        writes the next generation's file while holding that lock, and it must not be
        mistaken for garbage. When another process is writing, cleaning up waits for later.
        """
        conn = self._table.conn
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            return
        finally:
            conn.execute("PRAGMA busy_timeout = 60000")
        try:
            conn.execute("CREATE INDEX IF NOT EXISTS documents_text_hash ON documents(text_hash)")
            generation = int(self._table.meta_value("generation"))
            swap = self._swap_under_way()
            building = swap.generation if swap is not None else None
            self._vectors.remove_other_generations(generation, building)
            self._bm25.remove_other_generations(generation)
            if generation == self._vectors.generation:
                n_rows = int(self._table.meta_value("n_rows"))
                dropped = self._vectors.file.drop_uncommitted(n_rows)
                if dropped:
                    warnings.warn(
                        f"{self._vectors.file.path}: {dropped:,} bytes past its {n_rows:,} "
                        "committed vectors (a write that never committed, or bytes added "
                        "outside densefit) were dropped",
                        stacklevel=4,
                    )
        finally:
            conn.execute("COMMIT")


def _check_new_folder(folder: Path) -> None:
    """Refuse to create a store where one is, or in a file, or in a folder holding other files."""
    if (folder / DB_NAME).exists():
        raise StoreError(f"{folder} already holds a store: open it instead of creating it")
    if folder.exists() and not folder.is_dir():
        raise StoreError(f"{folder} is a file; --store needs a folder")
    if _holds_files(folder):
        raise StoreError(
            f"{folder} exists and is not empty but holds no {DB_NAME}: pick a new or "
            "empty folder for the store"
        )


def _holds_files(folder: Path) -> bool:
    """Whether ``folder`` is a folder holding files besides the writer lock's."""
    return folder.is_dir() and any(p.name != LOCK_NAME for p in folder.iterdir())


def _not_a_store(folder: Path) -> str:
    """Why ``folder`` cannot be opened as a store, and what to do."""
    if (folder / "meta.json").is_file() and (folder / "collection").is_dir():
        return f"{folder} holds a Qdrant local store: open it as qdrant:{folder}"
    return (
        f"{folder} is not a densefit store (no {DB_NAME}): create it with "
        f"`densefit index CORPUS --model MODEL --store {folder}`"
    )


def _unwritable(folder: Path) -> str | None:
    """Why this process may not write the store in ``folder`` (None: it may)."""
    if not os.access(folder, os.W_OK):
        return "the folder is on a read-only file system or not writable by this user"
    for path in folder.glob(f"{DB_NAME}*"):  # the database, its WAL and shared memory
        if not os.access(path, os.W_OK):
            return f"{path.name} is not writable by this user"
    return None


def why_none(path: str | os.PathLike | None) -> str | None:
    """Why the folder ``path`` holds no store, when it holds something else."""
    return _not_a_store(Path(path)) if path is not None and _holds_files(Path(path)) else None


def open_existing(
    path: str | os.PathLike | None,
    *,
    backend: str | Callable | None = None,
    rescore: int | None = None,
    lock_timeout: float | None = None,
) -> LocalDocumentStore | None:
    """The store in the folder ``path`` (read-only when this process may not write the
    folder); None when there is none (creating one checks that the folder is new or empty),
    StoreError when ``path`` is a file or Qdrant's folder."""
    if path is None:
        return None
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise StoreError(f"{folder} is a file; --store needs a folder")
    if (folder / DB_NAME).is_file():
        return LocalDocumentStore(folder, backend=backend, rescore=rescore)
    if (folder / "meta.json").is_file() and (folder / "collection").is_dir():
        raise StoreError(_not_a_store(folder))
    return None


def create(
    path: str | os.PathLike | None,
    record: StoreRecord,
    *,
    backend: str | Callable | None = None,
    rescore: int | None = None,
    lock_timeout: float | None = None,
) -> LocalDocumentStore:
    """A new store in the folder ``path`` (None: a temporary folder) for ``record``'s
    vectors, created under the folder's writer lock (waiting up to ``lock_timeout`` seconds),
    so that concurrent callers create it once: a store another process created meanwhile is
    opened instead."""
    if path is None:
        return LocalDocumentStore.create(None, record, backend=backend, rescore=rescore)
    with writer_lock(path, timeout=lock_timeout):
        if (Path(path) / DB_NAME).is_file():  # created while we waited
            return LocalDocumentStore(path, backend=backend, rescore=rescore)
        return LocalDocumentStore.create(path, record, backend=backend, rescore=rescore)
