"""Milvus: densefit's documents and vectors in a Milvus collection, through pymilvus.

Targets: ``milvus://HOST:PORT/COLLECTION``, a Milvus server or cluster (port 19530 by
default, ``?https=true`` for TLS, the token (``USER:PASSWORD`` or an API key) from the
environment variable ``MILVUS_TOKEN``, never from the target); ``milvus:FILE.db``, Milvus Lite:
collections kept in ``FILE.db`` and served by an in-process server that stops when the
process's last store on the file closes (``?collection=NAME``; default ``densefit``).

The store's name is an alias of its collection ``NAME_g<N>`` (``N``: the model swaps so far),
strongly consistent, one row per document: ``id`` (primary key), ``text``, ``title``,
``meta``, ``fields`` (the typed filter fields, :func:`~densefit.retrieval.index.filters.
typed_fields`), ``text_hash``, ``meta_hash``, ``stale``, ``seq`` (the write order, as the Qdrant
engine makes it), ``dense`` (float32, inner product: cosine stores hold unit vectors),
``tokens`` (the text's bm25s tokens) and ``sparse`` (Milvus's BM25 function of ``tokens``).
The model record, model generation and swap under way are the collection's properties.
Ids, texts and titles are ``VARCHAR`` s (65,535 bytes at most).

Filters are one boolean expression over ``fields``, each comparison guarded by ``exists``
so that it is false, never null, where a field is missing (Milvus Lite's ``not`` keeps a null);
values are escaped literals (Milvus Lite has no expression templates). BM25: Milvus's function,
bm25s's ``k1`` and ``b``, over bm25s's tokens (Milvus Lite's ``standard`` analyzer keeps them
whole; a server gets ``whitespace``); scores divided by ``k1 + 1`` read as bm25s's. Milvus
keeps the IDF and average length: Milvus Lite per segment and, for a filtered search, over the
matching documents, so its scores can drift from the embedded store's (measured in
docs/search.md). Model swaps: :class:`~densefit.retrieval.index.swap.SwapCoordinator`'s
primitives, blue/green as the Qdrant engine does it (a collection per generation, the alias
moved by one ``alter_alias``). Run here: Milvus Lite (``tests/test_milvus.py``); a server or
cluster is reached by the same calls (not run).

>>> parse_target("milvus://db.example/docs").uri, parse_target("milvus:m.db").collection
('http://db.example:19530', 'densefit')
>>> print(compile_filter({"field": "meta.lang", "operator": "==", "value": 'e"n'}))
(exists fields["meta.lang"]["s"] and fields["meta.lang"]["s"] == "e\\"n")
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from densefit.choices import SIMILARITIES
from densefit.data.types import Document
from densefit.retrieval.bm25 import K1, B, tokenize
from densefit.retrieval.index.common import Fault, translated
from densefit.retrieval.index.database import DatabaseStore, StoredRow
from densefit.retrieval.index.documents import meta_hash
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
from densefit.retrieval.index.locking import StoreLockedError
from densefit.retrieval.index.registry import capabilities_of, redacted, require
from densefit.retrieval.index.request import Ranked
from densefit.retrieval.index.swap import MODEL_GENERATION_KEY, SWAP_KEY, SwapCoordinator
from densefit.retrieval.index.types import StoreError, StoreRecord, SwapTarget, VectorSettings

__all__ = ["CAPABILITIES", "MilvusDocumentStore", "compile_filter", "create", "open_existing"]

CAPABILITIES = capabilities_of("milvus")
DEFAULT_COLLECTION, DEFAULT_PORT, TOKEN_VARIABLE = "densefit", 19530, "MILVUS_TOKEN"
LAYOUT = "densefit-milvus/1"  # property "layout": the row layout above
STORE_KEY, BUILDING_KEY = "store", "swap_of"  # properties: the store (alias), the swap's source
_COUNTERS = ("n_rows", "generation", "stale_below_row")  # the embedded store's only
_MAX_BYTES, _BATCH, _PAGE, _MAX_K = 65535, 256, 1000, 16384
_VERSION = ["id", "seq", "meta_hash"]  # what tells a current copy in the next generation
_SHOWN = ["id", "text", "title", "meta", "seq"]  # what a search hit needs
_ROW = [*_SHOWN, "fields", "text_hash", "meta_hash", "stale", "tokens", "dense"]
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")
_REFRESH_SECONDS = 1.0  # a server's record is read again at most this often


# -- targets and connections -----------------------------------------------------------------


@dataclass(frozen=True)
class MilvusTarget:
    """A server's ``uri`` or a Milvus Lite ``file``, the ``collection`` (the store's alias)
    and ``location``, the target as shown (redacted)."""

    location: str
    collection: str
    file: str | None = None
    uri: str | None = None


def parse_target(target: str) -> MilvusTarget:
    """The :class:`MilvusTarget` a ``milvus:`` target names, or a one-line StoreError.

    >>> parse_target("milvus://localhost:19531/docs?https=true").uri
    'https://localhost:19531'
    """
    location = redacted(target)  # what messages show; the target itself is parsed
    parts = urlsplit(str(target))
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    if str(target)[len("milvus:") :].startswith("//") and parts.netloc:
        if parts.username is not None or parts.password is not None:
            raise StoreError(
                f"milvus://***@{parts.hostname}{parts.path}: a Milvus target takes no user or "
                f"password: set the token in the environment variable {TOKEN_VARIABLE}"
            )
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError:
            raise StoreError(f"{location}: the port is not a number from 1 to 65535") from None
        https = options.pop("https", "false").lower()
        if options or https not in ("true", "false", "1", "0"):
            raise StoreError(f"{location}: a Milvus server target takes ?https=true|false only")
        uri = f"{'https' if https in ('true', '1') else 'http'}://{parts.hostname}:{port}"
        return MilvusTarget(location, _checked_name(parts.path.strip("/"), location), uri=uri)
    collection = options.pop("collection", DEFAULT_COLLECTION)
    if options or not parts.path.endswith(".db"):
        raise StoreError(
            f"{location}: write milvus:FILE.db[?collection=NAME] (Milvus Lite) or "
            "milvus://HOST:PORT/COLLECTION (a server)"
        )
    return MilvusTarget(location, _checked_name(collection, location), file=parts.path)


def _checked_name(name: str, location: str) -> str:
    if not _NAME.match(name):
        raise StoreError(
            f"{location}: collection name {name!r} is not 1 to 200 letters, digits or '_' "
            "starting with a letter or '_': pick a name like docs_v1"
        )
    return name


class _Connection:
    """A client and the locks its stores share; :meth:`release` when a store closes."""

    def __init__(self, client, target: MilvusTarget, key: str | None = None, held: int = -1):
        self.client, self.target, self.key, self.held, self.users = client, target, key, held, 1
        self.lock, self.writers = threading.RLock(), {}  # Milvus Lite's: a file's, by name

    def release(self) -> None:
        if self.target.file is None:
            return self.client.close()
        with _LOCAL_LOCK:
            self.users -= 1
            if self.users > 0:
                return None
            del _LOCAL[self.key]
        from milvus_lite.server_manager import server_manager_instance  # the optional extra

        with self.lock:
            self.client.close()
            server_manager_instance.release_server(self.target.file)  # stops its threads
            os.close(self.held)  # lets the file go for another process


_LOCAL: dict[str, _Connection] = {}  # Milvus Lite: the open client of each process and file
_LOCAL_LOCK = threading.Lock()


def _connect(target: MilvusTarget) -> _Connection:
    try:
        import pymilvus  # an optional extra: densefit[milvus]
    except ImportError:
        raise ImportError(
            "the Milvus engine needs pymilvus: pip install 'densefit[milvus]'"
        ) from None
    if target.file is None:
        with _requests(target):
            token = os.environ.get(TOKEN_VARIABLE) or ""
            return _Connection(pymilvus.MilvusClient(uri=target.uri, token=token), target)
    key = f"{os.getpid()}:{os.path.realpath(target.file)}"  # a forked child: its own
    with _LOCAL_LOCK:
        if key in _LOCAL:
            _LOCAL[key].users += 1
        elif not Path(target.file).parent.is_dir():
            raise StoreError(f"{target.location}: no folder {Path(target.file).parent}")
        else:  # one process per file: Milvus Lite's server is the process's own
            held = os.open(f"{target.file}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                with _requests(target):
                    client = pymilvus.MilvusClient(uri=target.file)
            except BaseException as exc:
                os.close(held)
                if not isinstance(exc, BlockingIOError):
                    raise
                raise StoreError(
                    f"{target.location}: another process has this Milvus Lite file open (one "
                    "process at a time): stop it, or serve the store from a Milvus server"
                ) from None
            _LOCAL[key] = _Connection(client, target, key, held)
        return _LOCAL[key]


def _faults(target: MilvusTarget) -> tuple[Fault, ...]:
    """Milvus's failures (unreachable, refused, an error answer) as one-line StoreErrors."""

    def message(exc: BaseException) -> str:
        why = " ".join(str(getattr(exc, "message", None) or exc).split())[:200]
        return (
            f"{target.location}: Milvus at {target.file or target.uri} refused or failed "
            f"({why}): start it, or check the host, port, ?https= and {TOKEN_VARIABLE}"
        )

    return (Fault(lambda exc: type(exc).__module__.startswith("pymilvus"), message),)


def _requests(target: MilvusTarget):
    """Milvus's errors raised in the block translated (before a store object exists)."""
    return translated(_faults(target))


# -- filters ------------------------------------------------------------------------------------


def _quoted(text: str) -> str:
    """``text`` as a Milvus string literal (backslashes, quotes and line breaks escaped)."""
    for char, escaped in (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r")):
        text = text.replace(char, escaped)
    return '"' + text.replace("\t", "\\t") + '"'


def compile_filter(filters: Filter | dict | None) -> str | bool:
    """``filters`` (parsed, or a dict parsed here) as a Milvus expression over ``fields``,
    or True / False when it matches every document or none (no filter: True).

    >>> compile_filter({"operator": "OR", "conditions": []})
    False
    """
    parsed = parse_filters(filters, CAPABILITIES)
    return True if parsed is None else emit(parsed, _Expression())


class _Expression:
    """The filter emitter (:class:`~densefit.retrieval.index.filters.Emitter`): Milvus
    expressions over the typed fields, True and False folded away."""

    def compare(self, c: Comparison) -> str | bool:
        key = f"fields[{_quoted(c.field)}]"
        if c.operator == "in":
            unique = {(type(v) is str, json.dumps(v)): v for v in c.value}.values()
            return self.any_of([_equal(key, v) for v in unique])
        if c.operator == "==":
            return _equal(key, c.value)
        if c.value is None:
            return False  # Haystack: None is not ordered
        if isinstance(c.value, str):  # an ISO date: by its instant, where the field is one
            return _typed(key, "d", c.operator, date_seconds(c.value, f"{c.field} {c.operator}"))
        return _typed(key, "n", c.operator, float(c.value))  # a number (bools are 1 and 0)

    def negate(self, term: str | bool) -> str | bool:
        return (not term) if isinstance(term, bool) else f"(not {term})"

    def all_of(self, terms: list) -> str | bool:
        return _joined(terms, "and", absorbing=False)

    def any_of(self, terms: list) -> str | bool:
        return _joined(terms, "or", absorbing=True)


def _equal(key: str, value) -> str:
    if value is None:  # missing or null: the field has no typed entry
        return f"(not exists {key}[{_quoted('t')}])"
    if isinstance(value, (list, dict)):
        return _typed(key, "j", "==", json_text(value))
    if isinstance(value, (bool, int, float)):
        return _typed(key, "n", "==", float(value))
    return _typed(key, "s", "==", value)


def _typed(key: str, part: str, operator: str, value) -> str:
    """A comparison of a typed part: false, never null, where the part is missing."""
    literal = _quoted(value) if isinstance(value, str) else repr(float(value))
    path = f"{key}[{_quoted(part)}]"
    return f"(exists {path} and {path} {operator} {literal})"


def _joined(terms: list, word: str, absorbing: bool) -> str | bool:
    if any(t is absorbing for t in terms):
        return absorbing
    terms = [t for t in terms if not isinstance(t, bool)]
    if not terms:
        return not absorbing
    return terms[0] if len(terms) == 1 else "(" + f" {word} ".join(terms) + ")"


def _in(field: str, values: Iterable[str]) -> str:
    return f"{field} in [{', '.join(_quoted(v) for v in values)}]"


def _where(expression: str | bool) -> str:
    return "" if expression is True else expression


# -- collections: the generations behind a store's alias -----------------------------------


def _properties(client, collection: str) -> dict[str, str]:
    return dict(client.describe_collection(collection).get("properties") or {})


def _serving(client, name: str) -> str | None:
    """The collection the store ``name`` reads (its alias's), or None."""
    if name in client.list_aliases().get("aliases", []):
        return client.describe_alias(name)["collection_name"]
    return None


def _generations(client, name: str) -> dict[int, dict]:
    """``{generation: properties}`` of the collections densefit made for the store ``name``."""
    found = {}
    for collection in client.list_collections():
        number = collection.removeprefix(f"{name}_g")
        if collection.startswith(f"{name}_g") and number.isdigit():
            properties = _properties(client, collection)
            if properties.get("layout") == LAYOUT and properties.get(STORE_KEY) == name:
                found[int(number)] = properties
    return found


def _found(client, name: str) -> bool:
    """Whether the store ``name`` exists; its alias made again when a process was killed
    between creating its collection and the alias."""
    if _serving(client, name) is not None:
        return True
    finished = [n for n, p in _generations(client, name).items() if not p.get(BUILDING_KEY)]
    if finished:
        client.create_alias(f"{name}_g{max(finished)}", name)
    return bool(finished)


def _new_collection(client, target: MilvusTarget, name: str, record: StoreRecord, extra: dict):
    """Create the collection ``name`` for ``record``'s vectors (its properties the record,
    the layout, the store it belongs to and ``extra``) and load it."""
    from pymilvus import DataType, Function, FunctionType  # the optional extra

    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    for field in ("id", "text", "title", "text_hash", "meta_hash"):
        schema.add_field(field, DataType.VARCHAR, max_length=_MAX_BYTES, is_primary=field == "id")
    analyzer = {"tokenizer": "whitespace" if target.file is None else "standard"}
    schema.add_field("tokens", DataType.VARCHAR, max_length=_MAX_BYTES, enable_analyzer=True,
                     analyzer_params=analyzer)  # fmt: skip
    for field, kind in (("meta", "JSON"), ("fields", "JSON"), ("stale", "BOOL"), ("seq", "INT64")):
        schema.add_field(field, getattr(DataType, kind))
    schema.add_field("dense", DataType.FLOAT_VECTOR, dim=record.dim)
    schema.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
    schema.add_function(Function(name="bm25", function_type=FunctionType.BM25,
                                 input_field_names=["tokens"], output_field_names=["sparse"]))  # fmt: skip
    indexes = client.prepare_index_params()
    indexes.add_index("dense", index_type="FLAT", metric_type="IP")
    indexes.add_index("sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25",
                      params={"bm25_k1": K1, "bm25_b": B})  # fmt: skip
    properties = {k: v for k, v in record.to_meta().items() if k not in _COUNTERS}
    properties |= {"layout": LAYOUT, STORE_KEY: target.collection, **extra}
    client.create_collection(name, schema=schema, consistency_level="Strong", properties=properties)
    client.create_index(name, indexes, sync=False)  # sync: pymilvus polls it every 0.5 s
    client.load_collection(name)


# -- the engine's functions (densefit.retrieval.index.engines) ---------------------------------


def open_existing(target: str, *, backend=None, **_) -> MilvusDocumentStore | None:
    """The densefit store in ``target``'s collection; None when there is none (for Milvus
    Lite, nothing is created then)."""
    parsed = parse_target(target)
    if parsed.file is not None and not Path(parsed.file).is_dir():
        return None
    return _opened(parsed, backend, None)


def create(target: str, record: StoreRecord, *, backend=None, **_) -> MilvusDocumentStore:
    """A new collection for ``record``'s vectors at ``target`` and its alias; when another
    process created them meanwhile, that one opened."""
    parsed = parse_target(target)
    if record.similarity not in SIMILARITIES:
        raise StoreError(
            f"{parsed.location}: similarity {record.similarity!r} is not supported: the store "
            f"searches by inner product, which serves {' and '.join(SIMILARITIES)} models"
        )
    return _opened(parsed, backend, record)


def _opened(target: MilvusTarget, backend, record: StoreRecord | None):
    """The store at ``target``, created for ``record`` when there is none (None: not)."""
    if callable(backend):
        raise StoreError("the Milvus engine searches with Milvus's own index: pass backend='exact'")
    if backend is not None:
        require(CAPABILITIES, "backends", f"search by {backend!r}", str(backend))
    connection = _connect(target)
    try:
        with connection.lock, _requests(target):
            client = connection.client
            if not _found(client, target.collection):
                if record is None:
                    connection.release()
                    return None
                first = f"{target.collection}_g0"
                if not client.has_collection(first):
                    _new_collection(client, target, first, record, {MODEL_GENERATION_KEY: "0"})
                try:
                    client.create_alias(first, target.collection)
                except Exception:  # another process's, made meanwhile: theirs kept
                    if _serving(client, target.collection) is None:
                        raise
            client.load_collection(target.collection)  # Milvus Lite reopened: released
        return MilvusDocumentStore(target, connection, backend=backend)
    except BaseException:
        with contextlib.suppress(Exception):
            connection.release()
        raise


# -- the store ---------------------------------------------------------------------------------


def _document(row: dict) -> Document:
    return Document(row["id"], row.get("text", ""), row.get("title", ""), row.get("meta") or {})


def _version(row: dict) -> tuple[int, str]:
    return int(row["seq"]), row.get("meta_hash", "")


def _nothing() -> Ranked:
    return Ranked(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64))


def _stored_meta(meta: dict | None) -> dict:
    """Metadata as the embedded store keeps it: JSON, what JSON cannot hold as text."""
    return json.loads(json.dumps(meta or {}, default=str))


class MilvusDocumentStore(SwapCoordinator, DatabaseStore):
    """A densefit store in a Milvus collection (see the module docstring).

    >>> import tempfile
    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.encode import encode_texts
    >>> from densefit.retrieval.index.engines import open_store
    >>> model = tiny_model()
    >>> store = open_store(f"milvus:{tempfile.mkdtemp()}/m.db", model)  # Milvus Lite
    >>> docs = [Document("a", "cells divide"), Document("b", "python functions")]
    >>> store.write(docs, encode_texts(model, [d.text for d in docs]))
    WriteResult(added=2, updated=0)
    >>> store.search(None, 1, mode="bm25", query_texts=["python"])[0][0].id
    'b'
    >>> store.drop()
    """

    capabilities = CAPABILITIES

    def __init__(self, target: MilvusTarget, connection: _Connection, *, backend: str | None):
        super().__init__()
        self.target, self.location, self.collection = target, target.location, target.collection
        self._connection: _Connection | None = connection
        self._client = connection.client
        if target.file is not None:
            self._lock = connection.lock  # one call at a time on Milvus Lite's client
            self.capabilities = dataclasses.replace(CAPABILITIES, shared=False)
        self.backend_name = backend or CAPABILITIES.backends[0]
        self._tag, self._last_micros, self._faults = secrets.randbelow(1024), 0, _faults(target)
        self._record_seconds = 0.0 if target.file else _REFRESH_SECONDS
        self.model_generation = -1
        with self._reading():
            self._read_record()
            if self._swap and self._client.has_collection(self._next(self._swap)):
                self._client.load_collection(self._next(self._swap))  # Milvus Lite reopened

    # -- the record ------------------------------------------------------------------------

    def _read_record(self) -> None:
        with self._errors():
            properties = _properties(self._client, self.collection)
        if properties.get("layout") != LAYOUT or properties.get(STORE_KEY) != self.collection:
            raise StoreError(
                f"{self.location}: collection {self.collection!r} is not a densefit store of "
                "that name: pick another collection name"
            )
        self._take_record(properties)

    def _check_open(self) -> None:
        if self._connection is None:
            raise StoreError(f"{self.location}: the store is closed")

    def _set(self, collection: str, properties: dict) -> None:
        self._client.alter_collection_properties(collection, properties=properties)

    def _save_settings(self, settings: VectorSettings) -> None:
        with self._reading():
            self._set(self.collection, settings.to_meta())
            self._read_record()

    # -- reading ---------------------------------------------------------------------------

    def _rows(self, where: str | bool, fields: list[str], collection: str | None = None):
        """Every row matching ``where`` (an expression; True: all), its ``fields``."""
        if where is False:
            return []
        collection, rows = collection or self.collection, []
        with self._reading():
            if self.target.file:  # Milvus Lite: no limit on a query's rows
                return list(self._client.query(collection, _where(where), fields))
            pages = self._client.query_iterator(
                collection, batch_size=_PAGE, filter=_where(where), output_fields=fields
            )
            while page := pages.next():
                rows.extend(page)
            pages.close()
        return rows

    def _by_id(self, ids: Sequence[str], fields: list[str], collection: str | None = None):
        """``{id: row}`` of the stored ones among ``ids``."""
        unique, found = list(dict.fromkeys(ids)), {}
        for start in range(0, len(unique), _PAGE):
            where = _in("id", unique[start : start + _PAGE])
            found.update((r["id"], r) for r in self._rows(where, fields, collection))
        return found

    def _versions(self, collection: str | None = None) -> dict[str, tuple[int, str]]:
        return {r["id"]: _version(r) for r in self._rows(True, _VERSION, collection)}

    def count(self) -> int:
        return self.count_matching(None)

    def count_matching(self, filters: Filter | dict | None = None) -> int:
        where = compile_filter(filters)
        if where is False:
            return 0
        with self._reading():
            found = self._client.query(self.collection, _where(where), ["count(*)"])
        return int(found[0]["count(*)"])

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        found = self._by_id(ids, _SHOWN)
        return [None if i not in found else _document(found[i]) for i in ids]

    def hashes(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        found = self._by_id(ids, ["id", "text_hash", "meta_hash"])
        return {i: (r["text_hash"], r["meta_hash"]) for i, r in found.items()}

    def vectors(self, ids: Sequence[str]) -> np.ndarray:
        ids = list(ids)
        found = self._by_id(ids, ["id", "dense"])
        missing = [i for i in ids if i not in found]
        if missing:
            raise KeyError(f"{len(missing)} ids are not in the store, e.g. {missing[:3]}")
        return np.array([found[i]["dense"] for i in ids], dtype=np.float32).reshape(-1, self.dim)

    def vectors_for_texts(self, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """A stored, current vector per text hash the store holds (the first written)."""
        hashes, found = list(dict.fromkeys(hashes)), {}
        for start in range(0, len(hashes), _PAGE):
            where = _in("text_hash", hashes[start : start + _PAGE]) + " and stale == false"
            for row in sorted(self._rows(where, ["text_hash", "seq", "dense"]), key=_version):
                found.setdefault(row["text_hash"], np.asarray(row["dense"], dtype=np.float32))
        return found

    def filter_documents(self, filters: Filter | dict | None = None) -> list[Document]:
        """The documents matching ``filters``, in write order (an update counts as a write)."""
        return [_document(r) for r in sorted(self._rows(compile_filter(filters), _SHOWN),
                                             key=_version)]  # fmt: skip

    def ids(self) -> Iterator[str]:
        yield from sorted(r["id"] for r in self._rows(True, ["id"]))

    def index_meta_field(self, field: str) -> None:
        """Check the name: Milvus filters JSON fields without a per-field index."""
        meta_path(field)

    # -- re-embedding (densefit index --reembed) ---------------------------------------------

    def _mark_stale(self) -> None:
        rows = self._rows("stale == false", _ROW)
        with self._reading():
            self._upsert_rows(self.collection, [{**r, "stale": True} for r in rows])

    def _stale(self, ids: list[str] | None) -> list[str]:
        where = "stale == true" if ids is None else _in("id", ids) + " and stale == true"
        return [r["id"] for r in sorted([] if ids == [] else self._rows(where, _VERSION),
                                        key=_version)]  # fmt: skip

    # -- a model swap: the primitives of SwapCoordinator --------------------------------------

    @contextlib.contextmanager
    def _swap_transaction(self):
        with self._reading():
            self._read_record()
            yield None

    def _save_swap(self, tx, swap: SwapTarget | None) -> None:
        self._set(self.collection, {SWAP_KEY: swap.to_json() if swap else ""})

    def _create_generation(self, tx, record: StoreRecord, generation: int | None) -> int:
        serving = self._serving()
        number = _number(serving) + 1 if generation is None else generation
        name = f"{self.collection}_g{number}"
        if generation is None and self._client.has_collection(name):  # a swap begun before
            if _properties(self._client, name).get(STORE_KEY) != self.collection:
                raise StoreError(
                    f"{self.location}: collection {name!r} exists and is not this store's: "
                    "the next model swap creates it; delete or rename it"
                )
            self._client.drop_collection(name)
        if not self._client.has_collection(name):
            _new_collection(self._client, self.target, name, record, {BUILDING_KEY: serving})
        self._client.load_collection(name)  # a swap resumed by a new Milvus Lite server
        return number

    def _drop_generation(self, tx, swap: SwapTarget) -> None:
        if self._client.has_collection(self._next(swap)):
            self._client.drop_collection(self._next(swap))

    def _pending_rows(self, swap: SwapTarget, after_row: int, limit: int) -> list:
        current = sorted(self._rows(f"seq > {int(after_row)}", [*_VERSION, "text"]), key=_version)
        pending = []
        for start in range(0, len(current), _PAGE):  # those without a copy of their version
            chunk = current[start : start + _PAGE]
            made = self._by_id([r["id"] for r in chunk], _VERSION, self._next(swap))
            pending += [r for r in chunk if r["id"] not in made or
                        _version(made[r["id"]]) != _version(r)]  # fmt: skip
            if len(pending) >= limit:
                break
        return [(int(r["seq"]), r["id"], r.get("text", "")) for r in pending[:limit]]

    def _count_pending(self, swap: SwapTarget) -> int:
        made, current = self._versions(self._next(swap)), self._versions()
        return sum(made.get(i) != version for i, version in current.items())

    def _put_next(self, tx, swap: SwapTarget, pending: list, vectors: np.ndarray) -> int:
        current = self._by_id([i for _, i in pending], _ROW)
        copies = [
            {**current[doc_id], "dense": vector.tolist(), "stale": False}
            for (row, doc_id), vector in zip(pending, vectors, strict=True)
            if doc_id in current and int(current[doc_id]["seq"]) == row
        ]
        self._upsert_rows(self._next(swap), copies)
        return len(copies)

    def _switch(self, tx, swap: SwapTarget) -> None:
        """Promote the next generation (its model generation, no longer building), move the
        alias to it in one request, then drop the old one."""
        current, next_ = self._versions(), self._next(swap)
        self._delete(next_, [i for i in self._versions(next_) if i not in current])  # strays
        self._set(next_, {MODEL_GENERATION_KEY: str(self.model_generation + 1), BUILDING_KEY: ""})
        serving = self._serving()
        self._client.alter_alias(next_, self.collection)
        self._client.drop_collection(serving)

    def _swap_changed(self) -> None:
        """Read the record again; drop the generations older than the serving one (left by
        a process killed between a switch and the drop)."""
        with self._reading():
            self._read_record()
            for number in _generations(self._client, self.collection):
                if number < _number(self._serving()):
                    self._client.drop_collection(f"{self.collection}_g{number}")

    def _next(self, swap: SwapTarget) -> str:
        return f"{self.collection}_g{swap.generation}"

    def _serving(self) -> str:
        serving = _serving(self._client, self.collection)
        if serving is None:
            raise StoreError(f"{self.location}: collection {self.collection!r} is gone")
        return serving

    # -- writing ---------------------------------------------------------------------------

    def _before_write(self, rows: list[StoredRow], prepared_for: int) -> None:
        for doc in (row.document for row in rows):
            for name, value in (("id", doc.id), ("text", doc.text), ("title", doc.title or "")):
                if len(value.encode("utf-8")) > _MAX_BYTES:
                    raise StoreError(
                        f"{self.location}: document {doc.id[:80]!r}: its {name} is longer than "
                        f"the {_MAX_BYTES} bytes a Milvus VARCHAR holds: split or shorten it"
                    )

    def _upsert(self, tx, rows: list[StoredRow], vectors: np.ndarray, next_vectors) -> set[str]:
        existed = set(self._by_id([r.document.id for r in rows], ["id"]))
        start = max(time.time_ns() // 1000, self._last_micros + 1)  # write order: microseconds
        self._last_micros = start + len(rows) - 1  # * 1024 + this object's random tag
        written = []
        for i, (row, words) in enumerate(zip(rows, tokenize([r.document.text for r in rows]))):
            doc, meta = row.document, _stored_meta(row.document.meta)
            written.append({
                "id": doc.id, "text": doc.text, "title": doc.title or "", "meta": meta,
                "fields": typed_fields(doc.id, doc.text, doc.title or "", meta),
                "text_hash": row.text_hash, "meta_hash": row.meta_hash, "stale": False,
                "seq": (start + i) * 1024 + self._tag, "tokens": " ".join(words),
                "dense": vectors[i].tolist(),
            })  # fmt: skip
        self._upsert_rows(self.collection, written)
        if self._swap is not None and next_vectors is None:
            self._delete(self._next(self._swap), [r["id"] for r in written])
        elif self._swap is not None:
            copies = [
                {**r, "dense": v.tolist()} for r, v in zip(written, next_vectors, strict=True)
            ]
            self._upsert_rows(self._next(self._swap), copies)
        return existed

    def _upsert_rows(self, collection: str, rows: list[dict]) -> None:
        for start in range(0, len(rows), _BATCH):
            self._client.upsert(collection, rows[start : start + _BATCH])

    def _delete(self, collection: str, ids: list[str]) -> None:
        for start in range(0, len(ids), _PAGE):
            self._client.delete(collection, filter=_in("id", ids[start : start + _PAGE]))

    def _set_metadata(self, tx, documents: list[Document]) -> int:
        documents, stored = {d.id: d for d in documents}, 0
        for collection in [self.collection] + ([self._next(self._swap)] if self._swap else []):
            rows = []
            for doc_id, row in self._by_id(list(documents), _ROW, collection).items():
                doc, meta = documents[doc_id], _stored_meta(documents[doc_id].meta)
                fields = typed_fields(doc_id, row["text"], doc.title or "", meta)
                rows.append(row | {"title": doc.title or "", "meta": meta, "fields": fields,
                                   "meta_hash": meta_hash(doc)})  # fmt: skip
            self._upsert_rows(collection, rows)
            stored = stored or len(rows)
        return stored

    def _remove(self, tx, ids: list[str]) -> int:
        existed = list(self._by_id(ids, ["id"]))
        self._delete(self.collection, existed)
        if self._swap is not None:
            self._delete(self._next(self._swap), ids)
        return len(existed)

    @contextlib.contextmanager
    def writer_lock(self, timeout: float | None = None, *, name=None, doing=None):
        """One writer at a time in this process on a Milvus Lite file; on a server, nothing:
        an upsert is idempotent by id, so concurrent indexers are safe."""
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"lock_timeout must be >= 0 seconds (None: no limit), got {timeout!r}")
        self._check_open()
        with _LOCAL_LOCK:  # a lock per name: a model swap's does not stop writers
            lock = self._connection.writers.setdefault(name or "writer", threading.RLock())
        if self.target.file and not lock.acquire(timeout=-1 if timeout is None else timeout):
            raise StoreLockedError(
                f"{self.location}: another thread is still {doing or 'writing to this store'} "
                f"after {timeout}s: wait for it to finish, or raise --lock-timeout"
            )
        try:
            yield
        finally:
            if self.target.file:
                lock.release()

    # -- searching -------------------------------------------------------------------------

    def _where(self, filters: Filter):
        return compile_filter(filters)

    def _ask(self, data: list, field: str, k: int, where, score) -> list[Ranked]:
        """Each query's ranking (best first, ties by write order) with its hits' documents."""
        if where is False or not data:
            return [_nothing() for _ in data]
        answers = self._client.search(
            self.collection, data=data, anns_field=field, limit=min(k, _MAX_K),
            filter=_where(True if where is None else where), output_fields=_SHOWN,
            search_params={"metric_type": "IP" if field == "dense" else "BM25"},
        )  # fmt: skip
        ranked = []
        for hits in answers:
            pairs = sorted((-score(h["distance"]), int(h["entity"]["seq"])) for h in hits)
            keys = np.array([seq for _, seq in pairs], dtype=np.int64)
            found = {int(h["entity"]["seq"]): _document(h["entity"]) for h in hits}
            documents = {k: (d.id, d.text, d.title, d.meta) for k, d in found.items()}
            ranked.append(Ranked(keys, np.array([-s for s, _ in pairs]), documents))
        return ranked

    def _dense(self, queries: np.ndarray, k: int, where) -> list[Ranked]:
        return self._ask([q.tolist() for q in queries], "dense", k, where, float)

    def _lexical(self, texts: list[str], k: int, where) -> list[Ranked]:
        tokens = [" ".join(words) for words in tokenize(texts)]
        asked = [i for i, t in enumerate(tokens) if t]
        # a BM25 score is never negative (Milvus Lite reports it negated); bm25s's lack k1 + 1
        found = self._ask([tokens[i] for i in asked], "sparse", k, where,
                          lambda d: abs(d) / (K1 + 1))  # fmt: skip
        answers = dict(zip(asked, found, strict=True))
        return [answers.get(i, _nothing()) for i in range(len(texts))]

    # -- upkeep ----------------------------------------------------------------------------

    def _info_extra(self) -> dict:
        mode = "server" if self.target.file is None else "lite"
        return {"collection": self.collection, "serving_collection": self._serving(), "mode": mode}

    def drop(self) -> None:
        """Delete the store's collections (every generation) and alias, and close it."""
        with self._reading():
            self._client.drop_alias(self.collection)
            for number in _generations(self._client, self.collection):
                self._client.drop_collection(f"{self.collection}_g{number}")
        self.close()

    def close(self) -> None:
        """Let go of the client (Milvus Lite: the server stops with the file's last store)."""
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.release()


def _number(collection: str) -> int:
    return int(collection.rsplit("_g", 1)[1])
