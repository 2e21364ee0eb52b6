"""The embedded document store: a folder with SQLite for documents and a file of vectors.

Layout of a store folder::

    store.sqlite          documents (id, text, title, meta, hashes, vector row) and meta
    vectors-<gen>.f32     committed embeddings, row-major (``.f16`` for float16 stores)
    faiss-<gen>-*.index   FAISS cache, only when searched with the FAISS backend

Every write is one SQLite transaction: the new vectors are appended to the vector file and
fsync'd, then the rows are recorded and committed (see :mod:`densefit.retrieval.index.vectors`). A
process killed at any point leaves the last committed state readable, and re-running
``densefit index`` resumes: unchanged documents are recognised by their text hash and skipped.

Updated and deleted documents leave dead rows in the vector file that searches skip;
:meth:`LocalDocumentStore.compact` rewrites the file without them (a new generation, swapped
in by one commit).

The store records the model that made the embeddings: its name, the embedding dimension and a
*fingerprint* (the model's embeddings of three probe sentences). Searching with another model
raises :class:`~densefit.retrieval.index.base.ModelMismatchError` instead of returning garbage.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import wraps
from pathlib import Path

import numpy as np

from densefit.data.types import Document
from densefit.retrieval.index.base import (
    ModelMismatchError,
    SearchHit,
    StoreError,
    VectorBackend,
    WriteResult,
)
from densefit.retrieval.index.exact import ExactBackend
from densefit.retrieval.index.vectors import VectorFile

__all__ = ["LocalDocumentStore", "open_store", "make_backend", "text_hash", "meta_hash"]

FORMAT = "densefit-store/1"
DB_NAME = "store.sqlite"
SIMILARITIES = ("cosine", "dot")
DTYPES = {"float32": "f32", "float16": "f16"}
PROBE_TEXTS = (
    "densefit model fingerprint: the quick brown fox jumps over the lazy dog.",
    "What is the effect of vitamin D on bone density in older adults?",
    "def search(index, query, k=10): return index.top_k(query, k)",
)
# Same weights reproduce the probe embeddings to ~1e-7; a fine-tuned model moves them more.
_SAME_WEIGHTS_COSINE = 1 - 1e-5
_SQL_VARS = 900  # stay under SQLite's default limit on bound parameters

_SCHEMA = """
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


def text_hash(text: str) -> str:
    """The hash that decides whether a document must be re-embedded."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def meta_hash(document: Document) -> str:
    """The hash of what is stored but not embedded: title and metadata."""
    payload = json.dumps([document.title, document.meta], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


def make_backend(
    spec: str | Callable[[int], VectorBackend], dim: int, cache_path: Path | None = None
) -> VectorBackend:
    """Build a backend from ``"exact"``, ``"faiss"`` / ``"faiss:FACTORY"`` or a factory.

    >>> make_backend("exact", dim=4).name
    'exact'
    """
    if callable(spec):
        return spec(dim)
    name, _, option = str(spec).partition(":")
    if name == "exact":
        return ExactBackend()
    if name == "faiss":
        from densefit.retrieval.index.faiss_backend import FaissBackend

        factory = option or "HNSW32"
        slug = "".join(c if c.isalnum() else "_" for c in factory)
        path = cache_path.with_name(f"{cache_path.name}-{slug}.index") if cache_path else None
        return FaissBackend(dim, factory=factory, cache_path=path)
    raise ValueError(
        f"unknown backend {spec!r}: use 'exact', 'faiss' (HNSW32) or 'faiss:FACTORY' "
        "with a FAISS index_factory string such as 'faiss:Flat' or 'faiss:IVF4096,Flat'"
    )


def canonical_model_name(name: str) -> str:
    """A model name that compares equal however the same model was named."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    lowered = name.strip().lower()
    return lowered.removeprefix("sentence-transformers/")


def _locked(method):
    """Serialise calls on one store object: it may be shared by a server's threads."""

    @wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _normalise_rows(vectors: np.ndarray) -> np.ndarray:
    """Unit-length rows. Rows already of unit length (to 1e-6) are left bit-for-bit alone, so
    that writing back a stored vector (an identical text's) gives exactly the same vector."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    norms = np.where((norms == 0) | (np.abs(norms - 1) <= 1e-6), 1, norms)
    return vectors / norms


class LocalDocumentStore:
    """Documents in SQLite, embeddings in a vector file, searched by a pluggable backend.

    Create one with :func:`open_store` (or :meth:`create`), which records the model; open an
    existing folder with ``LocalDocumentStore(path)``. ``path=None`` makes a temporary store
    that is deleted when closed or garbage-collected.

    >>> from densefit.testing import tiny_model
    >>> from densefit.data.types import Document
    >>> from densefit.retrieval.encode import encode_texts
    >>> model = tiny_model()
    >>> store = open_store(None, model)
    >>> docs = [Document("a", "cells divide"), Document("b", "python functions")]
    >>> store.write(docs, encode_texts(model, [d.text for d in docs]))
    WriteResult(added=2, updated=0)
    >>> store.search(encode_texts(model, ["python functions"]), top_k=1)[0][0].id
    'b'
    """

    def __init__(self, path: str | os.PathLike, *, backend: str | Callable = "exact"):
        self.path = Path(path)
        db = self.path / DB_NAME
        if not db.is_file():
            raise StoreError(
                f"{self.path} is not a densefit store (no {DB_NAME}): create it with "
                f"`densefit index CORPUS --model MODEL --store {self.path}`"
            )
        self._lock = threading.RLock()
        # One connection shared by threads, serialised by self._lock.
        self._conn = sqlite3.connect(
            db, isolation_level=None, timeout=60.0, check_same_thread=False
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        meta = self._read_meta()
        if meta.get("format") != FORMAT:
            raise StoreError(
                f"{db}: unknown store format {meta.get('format')!r} (this densefit reads "
                f"{FORMAT}); re-index into a new folder"
            )
        self.model_name: str = meta["model_name"]
        self.dim: int = int(meta["dim"])
        self.similarity: str = meta["similarity"]
        self.dtype: str = meta["dtype"]
        self._fingerprint = np.asarray(json.loads(meta["fingerprint"]), dtype=np.float32)
        self.backend_spec = backend
        self.backend: VectorBackend | None = None
        self._generation = -1
        self._checked: dict[int, tuple[weakref.ref, int]] = {}
        self._data_version = None
        self._cleanup: Callable | None = None
        self._reload()
        self._remove_stale_files()

    # -- creation --------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | os.PathLike | None,
        *,
        model_name: str,
        dim: int,
        fingerprint: np.ndarray,
        similarity: str = "cosine",
        dtype: str = "float32",
        backend: str | Callable = "exact",
    ) -> LocalDocumentStore:
        """Create an empty store for embeddings of ``dim`` dimensions from ``model_name``."""
        if similarity not in SIMILARITIES:
            raise StoreError(
                f"similarity {similarity!r} is not supported by the store: it searches by "
                f"inner product, which serves {' and '.join(SIMILARITIES)} models"
            )
        if dtype not in DTYPES:
            raise StoreError(f"dtype {dtype!r} is not supported: use one of {sorted(DTYPES)}")
        temporary = path is None
        folder = Path(tempfile.mkdtemp(prefix="densefit-store-")) if temporary else Path(path)
        if (folder / DB_NAME).exists():
            raise StoreError(f"{folder} already holds a store: open it instead of creating it")
        if folder.exists() and not folder.is_dir():
            raise StoreError(f"{folder} is a file; --store needs a folder")
        if folder.is_dir() and any(folder.iterdir()):
            raise StoreError(
                f"{folder} exists and is not empty but holds no {DB_NAME}: pick a new or "
                "empty folder for the store"
            )
        folder.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT,
            "model_name": model_name,
            "dim": str(dim),
            "similarity": similarity,
            "dtype": dtype,
            "fingerprint": json.dumps(np.asarray(fingerprint, dtype=np.float32).tolist()),
            "n_rows": "0",
            "generation": "0",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        # Build in a side file and rename: a crash during creation leaves no half store.
        tmp_db = folder / (DB_NAME + ".creating")
        tmp_db.unlink(missing_ok=True)
        conn = sqlite3.connect(tmp_db, isolation_level=None)
        try:
            conn.executescript(_SCHEMA)
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", meta.items())
            conn.execute("COMMIT")
        finally:
            conn.close()
        os.replace(tmp_db, folder / DB_NAME)
        store = cls(folder, backend=backend)
        if temporary:
            store._cleanup = weakref.finalize(store, shutil.rmtree, folder, True)
        return store

    # -- the model -------------------------------------------------------------------------

    @_locked
    def check_model(self, model) -> None:
        """Raise :class:`ModelMismatchError` unless ``model`` made this store's embeddings.

        The dimension must match, and the model must reproduce the recorded fingerprint:
        a model of the same name whose weights changed (trained in place) is refused too, and
        the same weights under another name (a hub name vs its local folder) are accepted.
        Checked once per model object until its parameters are modified.
        """
        from densefit.models import model_name_of

        version = _parameter_version(model)
        cached = self._checked.get(id(model))
        if cached is not None and cached[0]() is model and cached[1] == version:
            return
        given = model_name_of(model)
        from densefit.retrieval.encode import embedding_dimension

        dim = embedding_dimension(model)
        if dim != self.dim:
            raise ModelMismatchError(
                f"{self.path}: the store holds {self.dim}-d embeddings from "
                f"{self.model_name!r}, but model {given!r} makes {dim}-d embeddings: search "
                f"with --model {self.model_name}, or re-index into a new store with this model"
            )
        fingerprint = model_fingerprint(model)
        similarity = float(np.min(np.sum(fingerprint * self._fingerprint, axis=1)))
        same_name = canonical_model_name(given) == canonical_model_name(self.model_name)
        if similarity < _SAME_WEIGHTS_COSINE:
            why = (
                "its weights changed since the store was indexed (was it trained?)"
                if same_name
                else "it is a different model"
            )
            raise ModelMismatchError(
                f"{self.path}: the store was indexed with {self.model_name!r}, but model "
                f"{given!r} does not reproduce its embeddings ({why}; probe cosine "
                f"{similarity:.4f}): search with the indexing model, or re-index the corpus "
                "with this one (`densefit index ... --store NEW_DIR`)"
            )
        self._checked[id(model)] = (weakref.ref(model), version)

    # -- reading ---------------------------------------------------------------------------

    @_locked
    def count(self) -> int:
        """The number of documents."""
        self._refresh()
        return int(self._conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0])

    def __len__(self) -> int:
        return self.count()

    @_locked
    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """The documents with these ids, None where an id is unknown."""
        found: dict[str, Document] = {}
        for part in _parts(list(ids)):
            marks = ",".join("?" * len(part))
            for doc_id, text, title, meta in self._conn.execute(
                f"SELECT id, text, title, meta FROM documents WHERE id IN ({marks})", part
            ):
                found[doc_id] = Document(doc_id, text, title, json.loads(meta))
        return [found.get(i) for i in ids]

    @_locked
    def hashes(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """``{id: (text_hash, meta_hash)}`` for the ids that are stored."""
        out: dict[str, tuple[str, str]] = {}
        for part in _parts(list(ids)):
            marks = ",".join("?" * len(part))
            for doc_id, th, mh in self._conn.execute(
                f"SELECT id, text_hash, meta_hash FROM documents WHERE id IN ({marks})", part
            ):
                out[doc_id] = (th, mh)
        return out

    def ids(self) -> Iterator[str]:
        """Every document id, in id order."""
        last = ""
        while True:
            with self._lock:
                page = self._conn.execute(
                    "SELECT id FROM documents WHERE id > ? ORDER BY id LIMIT 10000", (last,)
                ).fetchall()
            if not page:
                return
            yield from (row[0] for row in page)
            last = page[-1][0]

    @_locked
    def vectors(self, ids: Sequence[str]) -> np.ndarray:
        """The stored (normalised, for cosine stores) embeddings of ``ids`` as float32."""
        self._refresh()
        rows = {}
        for part in _parts(list(ids)):
            marks = ",".join("?" * len(part))
            rows.update(
                self._conn.execute(f"SELECT id, row FROM documents WHERE id IN ({marks})", part)
            )
        missing = [i for i in ids if i not in rows]
        if missing:
            raise KeyError(f"{len(missing)} ids are not in the store, e.g. {missing[:3]}")
        view = self._vector_file.view(self._n_rows)
        return np.asarray(view[[rows[i] for i in ids]], dtype=np.float32)

    @_locked
    def vectors_for_texts(self, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """Stored vectors of documents whose :func:`text_hash` is in ``hashes``, one per hash.

        Lets indexing copy the vector of a text that is already stored (a duplicate document)
        instead of encoding it again.
        """
        self._refresh()
        rows: dict[str, int] = {}
        for part in _parts(list(set(hashes))):
            marks = ",".join("?" * len(part))
            query = (
                f"SELECT text_hash, MIN(row) FROM documents WHERE text_hash IN ({marks}) "
                "GROUP BY text_hash"
            )
            rows.update((h, r) for h, r in self._conn.execute(query, part) if r < self._n_rows)
        if not rows:
            return {}
        view = self._vector_file.view(self._n_rows)
        found = np.asarray(view[list(rows.values())], dtype=np.float32)  # (n, dim)
        return dict(zip(rows, found, strict=True))

    @_locked
    def search(self, query_embeddings: np.ndarray, top_k: int = 10) -> list[list[SearchHit]]:
        """The ``top_k`` best documents for each query embedding, best first.

        ``query_embeddings`` is ``(q, dim)`` (or one ``(dim,)`` vector); cosine stores
        normalise them. Fewer than ``top_k`` hits come back only when the store holds fewer.
        """
        queries = np.asarray(query_embeddings, dtype=np.float32)
        if queries.ndim == 1:
            queries = queries[None, :]
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(
                f"query embeddings have shape {query_embeddings.shape}, but this store holds "
                f"{self.dim}-d embeddings from {self.model_name!r}"
            )
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        if not np.isfinite(queries).all():
            raise ValueError("query embeddings contain NaN or infinite values")
        if self.similarity == "cosine":
            queries = _normalise_rows(queries)
        self._refresh()
        scores, rows = self.backend.search(queries, top_k)
        wanted = sorted({int(r) for r in rows.ravel() if r >= 0})
        docs: dict[int, tuple] = {}
        for part in _parts(wanted):
            marks = ",".join("?" * len(part))
            for row, doc_id, text, title, meta in self._conn.execute(
                f"SELECT row, id, text, title, meta FROM documents WHERE row IN ({marks})", part
            ):
                docs[row] = (doc_id, text, title, meta)
        results = []
        for query_scores, query_rows in zip(scores, rows, strict=True):
            hits = []
            for score, row in zip(query_scores, query_rows, strict=True):
                if row < 0 or int(row) not in docs:
                    continue
                doc_id, text, title, meta = docs[int(row)]
                hits.append(
                    SearchHit(doc_id, float(score), len(hits) + 1, text, title, json.loads(meta))
                )
            results.append(hits)
        return results

    # -- writing ---------------------------------------------------------------------------

    @_locked
    def write(self, documents: Sequence[Document], embeddings: np.ndarray) -> WriteResult:
        """Add or replace ``documents`` (by id) with their embeddings, in one transaction.

        Ids must be unique within one call. Cosine stores normalise the embeddings.
        """
        documents = list(documents)
        vectors = self._validate_write(documents, embeddings)
        if not documents:
            return WriteResult()
        records = [
            (
                d.id,
                d.text,
                d.title or "",
                json.dumps(d.meta or {}, default=str),
                text_hash(d.text),
                meta_hash(d),
            )
            for d in documents
        ]
        with self._transaction() as fresh:
            start = int(self._meta_value("n_rows"))
            replaced = self._rows_of([d.id for d in documents])
            self._vector_file.write(start, vectors)
            self._conn.executemany(
                "INSERT INTO documents(id, row, text, title, meta, text_hash, meta_hash) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET row=excluded.row, "
                "text=excluded.text, title=excluded.title, meta=excluded.meta, "
                "text_hash=excluded.text_hash, meta_hash=excluded.meta_hash",
                [(r[0], start + i, *r[1:]) for i, r in enumerate(records)],
            )
            self._set_meta("n_rows", start + len(documents))
        self._after_commit(fresh, dead=list(replaced.values()), n_rows=start + len(documents))
        return WriteResult(added=len(documents) - len(replaced), updated=len(replaced))

    @_locked
    def write_metadata(self, documents: Sequence[Document]) -> int:
        """Replace title and metadata of stored documents (their text and vector stay)."""
        with self._transaction():
            cursor = self._conn.executemany(
                "UPDATE documents SET title=?, meta=?, meta_hash=? WHERE id=?",
                [
                    (d.title or "", json.dumps(d.meta or {}, default=str), meta_hash(d), d.id)
                    for d in documents
                ],
            )
        return cursor.rowcount

    @_locked
    def delete(self, ids: Iterable[str]) -> int:
        """Delete documents by id in one transaction; unknown ids are ignored.

        Returns the number of documents deleted.
        """
        ids = list(dict.fromkeys(ids))
        with self._transaction() as fresh:
            rows = self._rows_of(ids)
            for part in _parts(list(rows)):
                marks = ",".join("?" * len(part))
                self._conn.execute(f"DELETE FROM documents WHERE id IN ({marks})", part)
        self._after_commit(fresh, dead=list(rows.values()), n_rows=self._n_rows)
        return len(rows)

    @_locked
    def dead_rows(self) -> int:
        """Vectors kept for updated or deleted documents, until :meth:`compact`."""
        self._refresh()
        return int(self._n_rows - self._alive[: self._n_rows].sum())

    @_locked
    def compact(self) -> int:
        """Rewrite the vector file without dead rows; returns how many were dropped."""
        with self._transaction():
            n_rows = int(self._meta_value("n_rows"))
            generation = int(self._meta_value("generation"))
            pairs = self._conn.execute("SELECT row, id FROM documents ORDER BY row").fetchall()
            dropped = n_rows - len(pairs)
            if dropped == 0:
                return 0
            old = self._vector_file.view(n_rows)
            new_file = self._file_for(generation + 1)
            rows = np.fromiter((r for r, _ in pairs), dtype=np.int64, count=len(pairs))
            new_file.path.unlink(missing_ok=True)
            for start in range(0, len(rows), 1 << 16):
                part = rows[start : start + (1 << 16)]
                new_file.write(start, np.asarray(old[part]))
            # Rows must stay unique at every step: park them at negative numbers first.
            self._conn.execute("UPDATE documents SET row = -row - 1")
            self._conn.executemany(
                "UPDATE documents SET row = ? WHERE id = ?",
                [(i, doc_id) for i, (_, doc_id) in enumerate(pairs)],
            )
            self._set_meta("n_rows", len(pairs))
            self._set_meta("generation", generation + 1)
        self._reload()
        self._remove_stale_files()
        return dropped

    @_locked
    def flush(self) -> None:
        """Let the backend persist its caches (the FAISS index); documents are always durable."""
        if self.backend is not None:
            self.backend.flush()

    @_locked
    def close(self) -> None:
        """Flush caches and close the database. Temporary stores are deleted."""
        if self._conn is None:
            return
        try:
            self.flush()
        finally:
            self._conn.close()
            self._conn = None
            if self._cleanup is not None:
                self._cleanup()

    def __enter__(self) -> LocalDocumentStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LocalDocumentStore({str(self.path)!r}, model={self.model_name!r}, dim={self.dim}, "
            f"backend={getattr(self.backend, 'name', self.backend_spec)!r})"
        )

    @_locked
    def info(self) -> dict:
        """A summary for humans and ``--json``: model, sizes, dtype, backend."""
        self._refresh()
        return {
            "path": str(self.path),
            "model": self.model_name,
            "dim": self.dim,
            "similarity": self.similarity,
            "dtype": self.dtype,
            "documents": self.count(),
            "dead_rows": self.dead_rows(),
            "backend": getattr(self.backend, "name", str(self.backend_spec)),
        }

    # -- internals -------------------------------------------------------------------------

    def _validate_write(self, documents: list, embeddings: np.ndarray) -> np.ndarray:
        vectors = np.asarray(embeddings, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape != (len(documents), self.dim):
            raise ValueError(
                f"expected embeddings of shape ({len(documents)}, {self.dim}) for "
                f"{len(documents)} documents in a {self.dim}-d store, got {np.shape(embeddings)}"
            )
        seen: set[str] = set()
        for i, doc in enumerate(documents):
            if not isinstance(doc, Document):
                raise TypeError(f"documents[{i}] is a {type(doc).__name__}, not a Document")
            if not isinstance(doc.id, str) or not doc.id:
                raise ValueError(f"documents[{i}] has an empty or non-string id {doc.id!r}")
            if doc.id in seen:
                raise ValueError(
                    f"document id {doc.id!r} appears twice in one write: ids must be unique "
                    "(index_documents keeps the last occurrence and reports duplicates)"
                )
            seen.add(doc.id)
        if not np.isfinite(vectors).all():
            bad = int(np.flatnonzero(~np.isfinite(vectors).all(axis=1))[0])
            raise ValueError(f"the embedding of document {documents[bad].id!r} has NaN/inf values")
        if self.similarity == "cosine":
            vectors = _normalise_rows(vectors)
        if self.dtype == "float16" and np.abs(vectors).max(initial=0) > 65504:
            raise ValueError("embeddings exceed the float16 range: use a float32 store")
        return vectors

    def _transaction(self):
        return _Transaction(self)

    def _after_commit(self, fresh: bool, *, dead: list[int], n_rows: int) -> None:
        """Update the live-row mask in place after our own commit (or reload if others wrote)."""
        if not fresh:
            self._reload()
            return
        alive = self._alive
        if n_rows > len(alive):
            alive = np.concatenate([alive, np.ones(n_rows - len(alive), dtype=bool)])
        alive[dead] = False
        self._alive, self._n_rows = alive, n_rows
        self.backend.update(self._vector_file.view(n_rows), alive)

    def _read_meta(self) -> dict[str, str]:
        return dict(self._conn.execute("SELECT key, value FROM meta"))

    def _meta_value(self, key: str) -> str:
        return self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()[0]

    def _set_meta(self, key: str, value) -> None:
        self._conn.execute("UPDATE meta SET value=? WHERE key=?", (str(value), key))

    def _rows_of(self, ids: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in _parts(ids):
            marks = ",".join("?" * len(part))
            out.update(
                self._conn.execute(f"SELECT id, row FROM documents WHERE id IN ({marks})", part)
            )
        return out

    def _file_for(self, generation: int) -> VectorFile:
        suffix = DTYPES[self.dtype]
        return VectorFile(
            self.path / f"vectors-{generation}.{suffix}", dim=self.dim, dtype=self.dtype
        )

    def _refresh(self) -> None:
        """Reload if another connection (process) committed since we last looked."""
        if self._conn is None:
            raise StoreError(f"{self.path}: the store is closed")
        if self._conn.execute("PRAGMA data_version").fetchone()[0] != self._data_version:
            self._reload()

    def _reload(self) -> None:
        """Read the committed state and hand it to the backend."""
        self._data_version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        self._conn.execute("BEGIN")  # one consistent snapshot of meta and rows
        try:
            n_rows = int(self._meta_value("n_rows"))
            generation = int(self._meta_value("generation"))
            rows = np.fromiter(
                (r for (r,) in self._conn.execute("SELECT row FROM documents")), dtype=np.int64
            )
        finally:
            self._conn.execute("COMMIT")
        alive = np.zeros(n_rows, dtype=bool)
        alive[rows] = True
        if generation != self._generation or self.backend is None:
            self._vector_file = self._file_for(generation)
            self.backend = make_backend(
                self.backend_spec, self.dim, self.path / f"faiss-{generation}"
            )
            self._generation = generation
        self._n_rows = n_rows
        self._alive = alive
        try:
            vectors = self._vector_file.view(n_rows)
        except OSError as exc:
            raise StoreError(str(exc)) from None
        self.backend.update(vectors, alive)

    def _remove_stale_files(self) -> None:
        """Delete vector files and caches of other generations (an interrupted compaction's);
        add the text-hash index to stores made before it existed.

        Only under the write lock, taken without waiting: a compaction in another process
        writes the next generation's file while holding that lock, and it must not be
        mistaken for garbage. When another process is writing, cleaning up waits for later.
        """
        self._conn.execute("PRAGMA busy_timeout = 0")
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            return
        finally:
            self._conn.execute("PRAGMA busy_timeout = 60000")
        try:
            self._conn.execute(
                "CREATE INDEX IF NOT EXISTS documents_text_hash ON documents(text_hash)"
            )
            generation = int(self._meta_value("generation"))
            keep = self._file_for(generation).path.name
            for path in self.path.glob("vectors-*.*"):
                if path.name != keep:
                    path.unlink(missing_ok=True)
            for path in self.path.glob("faiss-*.index*"):
                if not path.name.startswith(f"faiss-{generation}-"):
                    path.unlink(missing_ok=True)
        finally:
            self._conn.execute("COMMIT")


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``: the write lock is held while vectors are appended."""

    def __init__(self, store: LocalDocumentStore):
        self.store = store

    def __enter__(self) -> bool:
        """Take the write lock; True when no other connection committed since our last load."""
        store = self.store
        if store._conn is None:
            raise StoreError(f"{store.path}: the store is closed")
        store._conn.execute("BEGIN IMMEDIATE")
        version = store._conn.execute("PRAGMA data_version").fetchone()[0]
        generation = int(store._meta_value("generation"))
        if generation != store._generation:  # another process compacted: write to its file
            store._vector_file = store._file_for(generation)
        return version == store._data_version and generation == store._generation

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.store._conn.execute("COMMIT")
        else:
            self.store._conn.execute("ROLLBACK")
        return False


def model_fingerprint(model) -> np.ndarray:
    """The model's unit-length embeddings of :data:`PROBE_TEXTS`, ``(3, dim)`` float32."""
    from densefit.retrieval.encode import encode_texts

    return encode_texts(model, list(PROBE_TEXTS), batch_size=1, normalize=True)


def _parameter_version(model) -> int:
    """Changes whenever a parameter is modified in place (optimizer steps, load_state_dict)."""
    try:
        return sum(p._version for p in model.parameters())
    except (AttributeError, TypeError):  # pragma: no cover - not a torch module
        return -1


def _parts(items: list, size: int = _SQL_VARS) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def open_store(
    path: str | os.PathLike | None,
    model=None,
    *,
    backend: str | Callable | None = None,
    dtype: str = "float32",
    create: bool = True,
) -> LocalDocumentStore:
    """Open the store at ``path``, creating it for ``model`` when it does not exist yet.

    With a ``model`` the store is checked against it (:class:`ModelMismatchError` when the
    embeddings came from another model). ``path=None`` gives a temporary store. ``backend``
    is ``"exact"`` (default), ``"faiss"`` (HNSW32) or ``"faiss:FACTORY"``; it is a search-time
    choice and can differ between opens of the same store.

    >>> from densefit.testing import tiny_model
    >>> store = open_store(None, tiny_model())
    >>> store.count(), store.dim
    (0, 32)
    """
    backend = backend or "exact"
    if path is not None and (Path(path) / DB_NAME).is_file():
        store = LocalDocumentStore(path, backend=backend)
        if model is not None:
            try:
                store.check_model(model)
            except ModelMismatchError:
                store.close()
                raise
        return store
    if model is None or not create:
        raise StoreError(
            f"no densefit store at {path}: build one with "
            f"`densefit index CORPUS --model MODEL --store {path}`"
        )
    from densefit.retrieval.encode import embedding_dimension
    from densefit.models import model_name_of

    name = model_name_of(model)
    if Path(name).expanduser().is_dir():
        name = str(Path(name).expanduser().resolve())
    similarity = getattr(model, "similarity_fn_name", None) or "cosine"
    if similarity not in SIMILARITIES:
        raise StoreError(
            f"model {name!r} scores by {similarity!r} similarity; the store searches by inner "
            "product and supports cosine and dot models only"
        )
    return LocalDocumentStore.create(
        path,
        model_name=name,
        dim=embedding_dimension(model),
        fingerprint=model_fingerprint(model),
        similarity=similarity,
        dtype=dtype,
        backend=backend,
    )
