"""The engines that keep a store in collections behind an alias (Qdrant, Milvus): what they share.

A store named ``NAME`` is an alias of the collection ``NAME_g<N>`` (:func:`generation_collection`;
``N``: the model swaps so far). A collection's metadata holds the model record, the layout,
the store it belongs to (``store``), its model generation, the swap under way and, while a
swap fills it, the collection it replaces (``swap_of``). A row per document holds ``id``,
``text``, ``title``, ``meta``, the typed filter ``fields``, ``text_hash``, ``meta_hash``,
``stale``, ``seq`` (the write order: ``microseconds * 1024 + tag``, strictly increasing per
store object, ``tag`` a random 10-bit number per object, so concurrent writers interleave by
time) and its vectors. :class:`AliasedStore` writes once, over an engine's primitives, the
reads, the writes, the model swap (blue/green: the next generation is a collection beside the
serving one, a copy counting while its ``seq`` and ``meta_hash`` are the document's; the
switch moves the alias in one request and drops the old collection), opening or creating a
store against other processes (an alias lost to a kill is made again) and the upkeep.

The engine's primitives (rows are dicts of the fields asked for, vectors by name):

- collections: ``_collections()``, ``_exists(c)``, ``_properties(c)``,
  ``_set_properties(c, values)`` (None: cleared), ``_new_collection(c, record, extra)`` (one
  made meanwhile by another process kept), ``_drop_collection(c)``;
- the alias: ``_serving_collection()`` (the collection it names, None: no store),
  ``_point_alias(c, replace)`` (one request), ``_drop_alias()``;
- rows: ``_rows(where, fields, collection)``, ``_rows_after(seq, limit)`` (at least ``limit``
  rows past ``seq``, by ``seq``), ``_by_id(ids, fields, collection)``, ``_count(where)``,
  ``_selection(stale, hashes)`` (the filter of rows so marked, with one of those text hashes),
  ``_with_vectors(rows, vectors)`` (new rows' vectors added), ``_upsert_rows(c, rows)``,
  ``_update_rows(c, changes)`` (``{id: fields}`` merged into the rows that exist),
  ``_delete_rows(c, ids)``;
- and ``_read_record``, ``_mark_stale``, ``_where``, ``_dense``, ``_lexical``,
  ``index_meta_field``, ``_opened()`` (after the record is read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from densefit.data.types import Document
from densefit.retrieval.index.database import (
    DatabaseStore,
    StoredRow,
    ordered_vectors,
    stored_meta,
)
from densefit.retrieval.index.documents import meta_hash
from densefit.retrieval.index.filters import Filter, parse_filters, typed_fields
from densefit.retrieval.index.locking import StoreLockedError
from densefit.retrieval.index.registry import redacted
from densefit.retrieval.index.request import Ranked
from densefit.retrieval.index.swap import MODEL_GENERATION_KEY, SWAP_KEY, SwapCoordinator
from densefit.retrieval.index.types import StoreError, StoreRecord, SwapTarget, VectorSettings

__all__ = [
    "AliasedStore",
    "CollectionTarget",
    "Connection",
    "generation_collection",
    "nothing",
    "parse_collection_target",
    "ranked",
    "shared_connection",
]

STORE_KEY = "store"  # metadata: the store (alias) a generation collection belongs to
BUILDING_KEY = "swap_of"  # metadata of a collection a swap is filling: the one it replaces
RECORD_COUNTERS = ("n_rows", "generation", "stale_below_row")  # the embedded store's only
VERSION = ["id", "seq", "meta_hash"]  # what a current copy in the next generation shares
SHOWN = ["id", "text", "title", "meta", "seq"]  # what a search hit needs
PAYLOAD = [*SHOWN, "fields", "text_hash", "meta_hash", "stale"]  # a row but its vectors
REFRESH_SECONDS = 1.0  # a server's record is read again at most this often
_PAGE = 1000  # ids per request
_SWAP_PAGE = 256  # rows per request of swap_pending, at least
_WRITERS = threading.Lock()  # guards each connection's writer locks by name


DEFAULT_COLLECTION = "densefit"  # an in-process target's collection unless ?collection=
DEFAULT_TIMEOUT = 10  # seconds a request to a server may take, unless the target's ?timeout=


@dataclass(frozen=True)
class CollectionTarget:
    """Where a store of collections lives: a server (``host``, ``port``, ``https``;
    ``timeout``: the seconds a request may take) or the in-process mode's ``path`` (Qdrant's
    folder, a Milvus Lite file), and the ``collection`` (the store's alias); ``location`` is
    the target as shown (redacted)."""

    location: str
    collection: str
    path: str | None = None
    host: str | None = None
    port: int | None = None
    https: bool = False
    timeout: float = DEFAULT_TIMEOUT

    @property
    def local(self) -> bool:
        return self.path is not None

    @property
    def url(self) -> str:
        """The server's ``http(s)://HOST:PORT``."""
        return f"{'https' if self.https else 'http'}://{self.host}:{self.port}"


def parse_collection_target(
    target: str, engine: str, *, port: int, local: str, suffix: str = "", secret: tuple, names
) -> CollectionTarget:
    """The :class:`CollectionTarget` a target of ``engine`` (as messages name it; its scheme
    in lower case) names: ``SCHEME://HOST[:PORT]/COLLECTION`` (a server, ``port`` when left
    out; ``?https=true`` for TLS, ``?timeout=SECONDS``; no user or password: ``secret`` says
    what the server takes instead, and the environment variable it comes from) or
    ``SCHEME:PATH[?collection=NAME]`` (the in-process mode; ``local`` is how PATH is written,
    ``FOLDER`` or ``FILE.db``; it ends with ``suffix``); ``names``: the collection names the
    engine takes, a pattern and how messages say it. A one-line StoreError saying what to
    write otherwise.
    """
    location, scheme = redacted(target), engine.lower()  # messages show the first
    forms = f"write {scheme}:{local}[?collection=NAME] or {scheme}://HOST:PORT/COLLECTION"
    if not str(target).lower().startswith(f"{scheme}:"):
        raise StoreError(f"{location} is not a {engine} target: {forms}")
    parts = urlsplit(str(target))
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    if not (str(target)[len(scheme) + 1 :].startswith("//") and parts.netloc):
        unknown = sorted(set(options) - {"collection"})
        if unknown or not parts.path or not parts.path.endswith(suffix):
            why = f"unknown option {unknown[0]!r}: " if unknown else ""
            raise StoreError(f"{location}: {why}{forms}")
        collection = _named(options.get("collection", DEFAULT_COLLECTION), names, location)
        return CollectionTarget(location, collection, path=parts.path)
    if parts.username is not None or parts.password is not None:
        raise StoreError(
            f"{location}: a {engine} target takes no user or password: set the {secret[0]} in "
            f"the environment variable {secret[1]}"
        )
    try:
        port = parts.port or port
    except ValueError:
        raise StoreError(f"{location}: the port is not a number from 1 to 65535") from None
    unknown = sorted(set(options) - {"https", "timeout"})
    if unknown:
        raise StoreError(
            f"{location}: unknown option {unknown[0]!r}: a {engine} server target takes "
            "?https=true and ?timeout=SECONDS only"
        )
    try:
        timeout = float(options.get("timeout", DEFAULT_TIMEOUT))
    except ValueError:
        timeout = -1.0
    if not 0 < timeout < float("inf"):
        raise StoreError(f"{location}: timeout must be a number of seconds above 0")
    https = options.get("https", "false").lower()
    if https not in ("true", "false", "1", "0"):
        raise StoreError(f"{location}: https must be true or false, got {https!r}")
    collection = parts.path.strip("/")
    if not collection:
        raise StoreError(f"{location}: no collection: write {scheme}://{parts.netloc}/COLLECTION")
    return CollectionTarget(
        location,
        _named(collection, names, location),
        host=parts.hostname,
        port=port,
        https=https in ("true", "1"),
        timeout=timeout,
    )


def _named(collection: str, names: tuple, location: str) -> str:
    if not names[0].fullmatch(collection):
        raise StoreError(
            f"{location}: collection name {collection!r} is not {names[1]}: pick a name like "
            "docs_v1"
        )
    return collection


class Connection:
    """A client and the locks its stores share; :meth:`release` when a store closes (``close``:
    what lets the client go, its ``close()`` unless given). An in-process client is shared by
    the stores of one process on the same files (:func:`shared_connection`) and let go with
    the last."""

    def __init__(self, client, close=None):
        self.client, self.close = client, close or client.close
        self.key, self.shared, self.users = None, None, 1
        self.lock = threading.RLock()  # in-process: one call at a time on the client
        self.writers: dict[str, threading.RLock] = {}  # in-process: the writer locks by name

    def release(self) -> None:
        if self.shared is None:
            return self.close()
        with _SHARED_LOCK:
            self.users -= 1
            if self.users == 0:
                del self.shared[self.key]
                with self.lock:
                    self.close()


_SHARED_LOCK = threading.Lock()  # guards every engine's in-process connections


def shared_connection(shared: dict, path: str, connect) -> Connection:
    """This process's in-process connection to the files at ``path``, kept in ``shared`` (an
    engine's, by process and files): the open one, or a new one from ``connect()``."""
    key = f"{os.getpid()}:{os.path.realpath(path)}"  # a forked child: its own
    with _SHARED_LOCK:
        found = shared.get(key)
        if found is not None:
            found.users += 1
            return found
        connection = shared[key] = connect()
        connection.key, connection.shared = key, shared
        return connection


def generation_collection(name: str, generation: int) -> str:
    """The collection holding generation ``generation`` of the store ``name`` (its alias).

    >>> generation_collection("docs", 2)
    'docs_g2'
    """
    return f"{name}_g{generation}"


def nothing() -> Ranked:
    return Ranked(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64))


def ranked(hits: Sequence[tuple[float, dict]]) -> Ranked:
    """A ranking of ``(score, row)`` hits, best first, ties by write order, with their
    documents.

    >>> ranked([(0.5, {"id": "a", "seq": 7}), (0.9, {"id": "b", "seq": 3})]).keys
    array([3, 7])
    """
    pairs = sorted((-float(score), int(row["seq"])) for score, row in hits)
    documents = {int(row["seq"]): _parts(row) for _, row in hits}
    keys = np.array([seq for _, seq in pairs], dtype=np.int64)
    return Ranked(keys, np.array([-score for score, _ in pairs], dtype=np.float64), documents)


def _parts(row: dict) -> tuple[str, str, str, dict]:
    return row["id"], row.get("text", ""), row.get("title", ""), row.get("meta") or {}


def _document(row: dict) -> Document:
    return Document(*_parts(row))


def _version(row: dict) -> tuple[int, str]:
    """What a copy in the next generation must share with the document: its write (``seq``)
    and its title and metadata (``meta_hash``)."""
    return int(row["seq"]), row.get("meta_hash", "")


class AliasedStore(SwapCoordinator, DatabaseStore):
    """A store in collections behind an alias (see the module docstring). The engine sets
    ``capabilities``, ``_parse_target``, ``_connect`` and ``_local_files`` (:meth:`opened`),
    ``_faults_of(target)`` (its error table), ``_layout`` (the metadata's
    ``layout``), ``_local_mode`` (``info()``'s name of its in-process mode; a target's ``local``
    says which) and ``_ROW`` (the fields a copy needs), and writes the primitives; its
    ``_where`` gives True and False for a filter matching every row and none."""

    _layout = _local_mode = ""
    _ROW: list[str] = PAYLOAD
    _local_capabilities: dict = {}  # what the in-process mode changes in the capabilities

    def __init__(self, target, connection, *, backend: str | None):
        super().__init__()
        self.target, self.location, self.collection = target, target.location, target.collection
        self._connection = connection
        self._client = connection.client
        self._faults = type(self)._faults_of(target)
        if target.local:
            self._lock = connection.lock  # one call at a time on the in-process client
            self.capabilities = dataclasses.replace(
                self.capabilities, shared=False, **self._local_capabilities
            )
        self.backend_name = backend or self.capabilities.backends[0]
        self._record_seconds = 0.0 if target.local else REFRESH_SECONDS
        self._tag, self._last_micros = secrets.randbelow(1024), 0
        self.model_generation = -1  # read from the metadata

    @classmethod
    def opened(cls, target: str, backend, record: StoreRecord | None):
        """The engine's ``open_existing`` (``record`` None: the store at ``target``, None when
        there is none) and ``create`` (the store created for ``record``; one another process
        created meanwhile is opened), with the ``backend`` and the record ``open_store``
        checked: the target parsed (the engine's ``_parse_target``), a connection
        (``_connect``); ``_local_files(target)`` says whether the in-process mode's files
        hold a store yet (and refuses files of another kind)."""
        target = cls._parse_target(target)
        if target.local and not cls._local_files(target) and record is None:
            return None
        connection = cls._connect(target)
        try:
            store = cls(target, connection, backend=backend)
            with store._reading():
                found = store._found()
                if not found and record is not None:
                    store._create_first(record)
                if found or record is not None:
                    store._read_record()
                    store._opened()
        except BaseException:
            with contextlib.suppress(Exception):
                connection.release()
            raise
        if found or record is not None:
            return store
        connection.release()
        return None

    def _found(self) -> bool:
        """Whether the store exists; its alias made again when a process was killed between
        creating its newest finished collection and pointing the alias at it."""
        if self._serving_collection() is not None:
            return True
        finished = [n for n, p in self._generations().items() if not p.get(BUILDING_KEY)]
        if finished:
            self._alias_to(generation_collection(self.collection, max(finished)))
        return bool(finished)

    def _create_first(self, record: StoreRecord) -> None:
        first = generation_collection(self.collection, 0)
        if not self._exists(first):
            self._new_collection(first, record, {MODEL_GENERATION_KEY: "0"})
        self._alias_to(first)

    def _alias_to(self, collection: str) -> None:
        try:
            self._point_alias(collection, replace=False)
        except Exception:  # another process's, made meanwhile: theirs kept
            if self._serving_collection() is None:
                raise

    def _opened(self) -> None:
        """After the record is read when the store opens."""

    def _new_metadata(self, record: StoreRecord, extra: dict) -> dict:
        """A new collection's metadata: ``record``, the layout, the store and ``extra``."""
        metadata = {k: v for k, v in record.to_meta().items() if k not in RECORD_COUNTERS}
        return metadata | {"layout": self._layout, STORE_KEY: self.collection, **extra}

    def _check_open(self) -> None:
        if self._connection is None:
            raise StoreError(f"{self.location}: the store is closed")

    def _save_settings(self, settings: VectorSettings) -> None:
        with self._reading():
            self._set_properties(self.collection, settings.to_meta())
            self._read_record()

    # -- reading ---------------------------------------------------------------------------

    def count(self) -> int:
        return self.count_matching(None)

    def count_matching(self, filters: Filter | dict | None = None) -> int:
        where = self._where(parse_filters(filters, self.capabilities))
        if where is False:
            return 0
        with self._reading():
            return self._count(where)

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        with self._reading():
            found = self._by_id(ids, SHOWN)
        return [None if i not in found else _document(found[i]) for i in ids]

    def hashes(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        with self._reading():
            found = self._by_id(ids, ["id", "text_hash", "meta_hash"])
        return {i: (r["text_hash"], r["meta_hash"]) for i, r in found.items()}

    def vectors(self, ids: Sequence[str]) -> np.ndarray:
        ids = list(ids)
        with self._reading():
            found = self._by_id(ids, ["id", "dense"])
        return ordered_vectors(ids, {i: row["dense"] for i, row in found.items()}, self.dim)

    def vectors_for_texts(self, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """A stored, current vector per text hash the store holds (the first written)."""
        hashes, found = list(dict.fromkeys(hashes)), {}
        with self._reading():
            for start in range(0, len(hashes), _PAGE):
                where = self._selection(False, hashes[start : start + _PAGE])
                for row in sorted(self._rows(where, ["text_hash", "seq", "dense"]), key=_version):
                    found.setdefault(row["text_hash"], np.asarray(row["dense"], dtype=np.float32))
        return found

    def filter_documents(self, filters: Filter | dict | None = None) -> list[Document]:
        """The documents matching ``filters``, in write order (an update counts as a write)."""
        where = self._where(parse_filters(filters, self.capabilities))
        with self._reading():
            rows = self._rows(where, SHOWN)
        return [_document(row) for row in sorted(rows, key=_version)]

    def ids(self) -> Iterator[str]:
        with self._reading():
            found = sorted(row["id"] for row in self._rows(True, ["id"]))
        yield from found

    def _stale(self, ids: list[str] | None) -> list[str]:
        with self._reading():
            if ids is None:
                rows = self._rows(self._selection(True), VERSION)
            else:
                found = self._by_id(ids, [*VERSION, "stale"]).values()
                rows = [row for row in found if row.get("stale")]
        return [row["id"] for row in sorted(rows, key=_version)]

    def _versions(self, collection: str | None = None) -> dict[str, tuple[int, str]]:
        """``{id: (seq, meta hash)}`` of every row of ``collection`` (None: the store's)."""
        return {r["id"]: _version(r) for r in self._rows(True, VERSION, collection)}

    # -- a model swap: SwapCoordinator's primitives -----------------------------------------

    @contextlib.contextmanager
    def _swap_transaction(self) -> Iterator[None]:
        """The object's lock and the record read again (no transaction: each step is
        ordered to be safe when killed)."""
        with self._reading():
            self._read_record()
            yield None

    def _save_swap(self, tx, swap: SwapTarget | None) -> None:
        self._set_properties(self.collection, {SWAP_KEY: None if swap is None else swap.to_json()})

    def _create_generation(self, tx, record: StoreRecord, generation: int | None) -> int:
        serving = self._serving()
        self._drop_older_generations(serving)
        fresh = generation is None
        if fresh:
            generation = self._generation_of(serving) + 1
        collection = generation_collection(self.collection, generation)
        exists = self._exists(collection)
        if exists and fresh:  # a swap cancelled or restarted
            if self._properties(collection).get(STORE_KEY) != self.collection:
                raise StoreError(
                    f"{self.location}: collection {collection!r} exists and is not this "
                    "store's: the next model swap creates it; delete or rename it"
                )
            self._drop_collection(collection)
        if fresh or not exists:  # resumed: made again, empty, when dropped by hand
            self._new_collection(collection, record, {BUILDING_KEY: serving, **self._carried()})
        return generation

    def _drop_generation(self, tx, swap: SwapTarget) -> None:
        if self._exists(self._next(swap)):
            self._drop_collection(self._next(swap))

    def _pending_rows(self, swap: SwapTarget, after_row: int, limit: int) -> list:
        """Those without a copy in the next generation made from their current version;
        a row is a document's ``seq``."""
        pending: list[dict] = []
        with self._reading():
            while len(pending) < limit:
                rows = self._rows_after(after_row, max(limit, _SWAP_PAGE))
                if not rows:
                    break
                for start in range(0, len(rows), _PAGE):
                    chunk = rows[start : start + _PAGE]
                    made = self._by_id([r["id"] for r in chunk], VERSION, self._next(swap))
                    pending += [r for r in chunk if r["id"] not in made or
                                _version(made[r["id"]]) != _version(r)]  # fmt: skip
                    if len(pending) >= limit:
                        break
                after_row = int(rows[-1]["seq"])
        return [(int(r["seq"]), r["id"], r.get("text", "")) for r in pending[:limit]]

    def _count_pending(self, swap: SwapTarget) -> int:
        with self._reading():
            made, current = self._versions(self._next(swap)), self._versions()
        return sum(made.get(i) != version for i, version in current.items())

    def _put_next(self, tx, swap: SwapTarget, pending: list, vectors: np.ndarray) -> int:
        """Copies of the rows as the serving collection holds them now, the new vectors."""
        current = self._by_id([i for _, i in pending], self._ROW)
        copies = [
            {**current[doc_id], "dense": vector.tolist(), "stale": False}
            for (row, doc_id), vector in zip(pending, self._stored(vectors), strict=True)
            if doc_id in current and int(current[doc_id]["seq"]) == row
        ]
        self._upsert_rows(self._next(swap), copies)
        return len(copies)

    def _switch(self, tx, swap: SwapTarget) -> None:
        """The next collection's copies of deleted documents dropped, its model generation
        recorded, the alias pointed at it in one request, the old collection dropped."""
        next_, current = self._next(swap), self._versions()
        self._delete_rows(next_, [i for i in self._versions(next_) if i not in current])
        finished = {MODEL_GENERATION_KEY: str(self.model_generation + 1), BUILDING_KEY: None}
        self._set_properties(next_, finished | self._carried())
        serving = self._serving()
        if serving == self.collection:  # a plain collection (Qdrant's, before model swaps)
            self._drop_collection(serving)  # the name becomes the alias: two requests
            self._point_alias(next_, replace=False)
        else:
            self._point_alias(next_, replace=True)
            self._drop_collection(serving)

    def _swap_changed(self) -> None:
        """Read the record again; drop the generations older than the serving one (left by
        a process killed between a switch and the drop)."""
        with self._reading():
            self._read_record()
            self._drop_older_generations()

    def _carried(self) -> dict:
        """Metadata a swap carries from the serving collection to the next one."""
        return {}

    def _next(self, swap: SwapTarget) -> str:
        return generation_collection(self.collection, swap.generation)

    def _serving(self) -> str:
        serving = self._serving_collection()
        if serving is None:
            raise StoreError(
                f"{self.location}: collection {self.collection!r} is gone (deleted by another "
                "process?): index into it again"
            )
        return serving

    def _generation_of(self, collection: str) -> int:
        """The generation ``collection`` holds: 0 for a plain collection named as the store."""
        number = collection.removeprefix(f"{self.collection}_g")
        if collection == self.collection:
            return 0
        if collection.startswith(f"{self.collection}_g") and number.isdigit():
            return int(number)
        raise StoreError(
            f"{self.location}: the alias {self.collection!r} points at collection "
            f"{collection!r}, not at one of its generations ({self.collection}_g<N>): point it "
            "back at the store's collection"
        )

    def _generations(self) -> dict[int, dict]:
        """``{generation: metadata}`` of the collections densefit made for this store."""
        found, prefix = {}, f"{self.collection}_g"
        for collection in self._collections():
            number = collection.removeprefix(prefix)
            if collection.startswith(prefix) and number.isdigit():
                metadata = self._properties(collection)
                if metadata.get("layout") == self._layout and (
                    metadata.get(STORE_KEY) == self.collection
                ):
                    found[int(number)] = metadata
        return found

    def _drop_older_generations(self, serving: str | None = None) -> None:
        current = self._generation_of(serving or self._serving())
        for number in self._generations():
            if number < current:
                self._drop_collection(generation_collection(self.collection, number))

    # -- writing ---------------------------------------------------------------------------

    def _next_seqs(self, n: int) -> list[int]:
        """``n`` write-order keys, strictly increasing for this store object."""
        start = max(time.time_ns() // 1000, self._last_micros + 1)
        self._last_micros = start + n - 1
        return [(start + i) * 1024 + self._tag for i in range(n)]

    def _stored(self, vectors: np.ndarray) -> np.ndarray:
        """``vectors`` as the collection keeps them (float16 stores: rounded to float16)."""
        if self.vector_kind == "float16":
            return vectors.astype(np.float16).astype(np.float32)
        return vectors

    def _typed(self, doc_id: str, text: str, title: str, meta: dict) -> dict:
        """The row's ``fields``: the document's typed filter fields."""
        return typed_fields(doc_id, text, title, meta)

    def _upsert(self, tx, rows: list[StoredRow], vectors: np.ndarray, next_vectors) -> set[str]:
        """During a model swap the rows also go to the next generation, with ``next_vectors``
        (the new model's), or leave it when there are none."""
        existed = set(self._by_id([r.document.id for r in rows], ["id"]))
        written = []
        for row, seq in zip(rows, self._next_seqs(len(rows)), strict=True):
            doc, meta = row.document, stored_meta(row.document.meta)
            written.append({
                "id": doc.id, "text": doc.text, "title": doc.title or "", "meta": meta,
                "fields": self._typed(doc.id, doc.text, doc.title or "", meta),
                "text_hash": row.text_hash, "meta_hash": row.meta_hash, "stale": False, "seq": seq,
            })  # fmt: skip
        self._with_vectors(written, self._stored(vectors))
        self._upsert_rows(self.collection, written)
        if self._swap is not None and next_vectors is None:
            self._delete_rows(self._next(self._swap), [r["id"] for r in written])
        elif self._swap is not None:
            vectors = self._stored(next_vectors)
            copies = [{**r, "dense": v.tolist()} for r, v in zip(written, vectors, strict=True)]
            self._upsert_rows(self._next(self._swap), copies)
        return existed

    def _set_metadata(self, tx, documents: list[Document]) -> int:
        documents = {d.id: d for d in documents}
        changes = {}
        for doc_id, row in self._by_id(list(documents), ["id", "text"]).items():
            doc, meta = documents[doc_id], stored_meta(documents[doc_id].meta)
            changes[doc_id] = {
                "title": doc.title or "", "meta": meta, "meta_hash": meta_hash(doc),
                "fields": self._typed(doc_id, row["text"], doc.title or "", meta),
            }  # fmt: skip
        self._update_rows(self.collection, changes)
        if self._swap is not None and changes:
            self._update_rows(self._next(self._swap), changes)
        return len(changes)

    def _remove(self, tx, ids: list[str]) -> int:
        existed = list(self._by_id(ids, ["id"]))
        self._delete_rows(self.collection, existed)
        if self._swap is not None:
            self._delete_rows(self._next(self._swap), ids)
        return len(existed)

    def writer_lock(
        self, timeout: float | None = None, *, name: str | None = None, doing: str | None = None
    ) -> contextlib.AbstractContextManager:
        """One writer at a time per name in this process (the in-process mode: in the only
        process that may open the store); a server's: nothing, concurrent indexers are safe
        because an upsert is idempotent by id."""
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"lock_timeout must be >= 0 seconds (None: no limit), got {timeout!r}")
        self._check_open()
        if not self.target.local:
            return contextlib.nullcontext()
        with _WRITERS:
            lock = self._connection.writers.setdefault(name or "writer", threading.RLock())
        message = (
            f"{self.location}: another thread is still {doing or 'writing to this store'} "
            f"after {timeout}s: wait for it to finish, or raise --lock-timeout"
        )
        return _held(lock, timeout, message)

    # -- upkeep ----------------------------------------------------------------------------

    def _info_extra(self) -> dict:
        mode = self._local_mode if self.target.local else "server"
        return {"collection": self.collection, "serving_collection": self._serving(), "mode": mode}

    def drop(self) -> None:
        """Delete the store: its alias, every generation's collection (and a plain collection
        named as the store); the store is closed after."""
        with self._reading():
            self._drop_alias()
            for number in self._generations():
                self._drop_collection(generation_collection(self.collection, number))
            if self._exists(self.collection):
                self._drop_collection(self.collection)
        self.close()

    def close(self) -> None:
        """Let go of the client (the in-process mode: once the process's last store on the
        same files closes)."""
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.release()


@contextlib.contextmanager
def _held(lock: threading.RLock, timeout: float | None, message: str) -> Iterator[None]:
    if not lock.acquire(timeout=-1 if timeout is None else timeout):
        raise StoreLockedError(message)
    try:
        yield
    finally:
        lock.release()
