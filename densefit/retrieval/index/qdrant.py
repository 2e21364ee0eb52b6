"""Qdrant: densefit's documents and vectors in a Qdrant collection, through qdrant-client.

Targets: ``qdrant://HOST:PORT/COLLECTION``, a Qdrant server or cluster (port 6333 when left
out; ``?https=true`` for TLS; ``?timeout=SECONDS`` for each request, 10 when left out; the
API key, if any, from the environment variable ``QDRANT_API_KEY``, never from the target);
``qdrant:FOLDER`` (or ``qdrant:///abs/folder``), qdrant-client's local mode: the collections
kept in ``FOLDER`` and searched in this process, one process at a time (``?collection=NAME``;
default ``densefit``). Collection names are 1 to 64 letters, digits, ``_`` and ``-``.

Collections, rows, write order, model swaps and opening are :mod:`~densefit.retrieval.index.
aliased`'s. A row is a point (its id the ``uuid5`` of the document id): the payload, a dense
vector ``dense`` (dot product; float16 stores ask for float16 storage, values rounded before
they are sent) and a sparse vector ``bm25``: bm25s's weights ``tf / (tf + k1 (1 - b + b dl /
avgdl))`` by :func:`token_id`, which Qdrant's IDF modifier turns into bm25s's scores; ``avgdl``
is the average length of the first documents written (in the metadata), so scores drift as
later writes move the true average. Filters: :func:`compile_filter`, one Qdrant ``Filter``
over the typed fields under the keys :func:`field_key` spells. A store made before
generations (a plain collection ``NAME``) serves as generation 0 until its first model swap
deletes it and makes ``NAME`` the alias (two requests: Qdrant refuses an alias named like a
collection). Run here: local mode (``tests/test_qdrant.py``); a server by the same calls.

>>> field_key("meta.release date")
'meta_drelease_sdate'
>>> parse_target("qdrant://db.example:6334/docs?https=true").collection
'docs'
>>> parse_target("qdrant:runs/q").folder, parse_target("qdrant:runs/q").collection
('runs/q', 'densefit')
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from densefit.errors import storage_fault
from densefit.retrieval.bm25 import K1, B, tokenize
from densefit.retrieval.index.aliased import (
    BUILDING_KEY,
    PAYLOAD,
    SHOWN,
    STORE_KEY,
    VERSION,
    AliasedStore,
    checked_backend,
    checked_record,
    generation_collection,
    nothing,
    ranked,
)
from densefit.retrieval.index.common import Fault, translated
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
from densefit.retrieval.index.registry import capabilities_of, redacted
from densefit.retrieval.index.request import Ranked
from densefit.retrieval.index.types import StoreError, StoreRecord, StoreUnavailableError

__all__ = [
    "CAPABILITIES",
    "EVERYTHING",
    "NOTHING",
    "QdrantDocumentStore",
    "QdrantTarget",
    "compile_filter",
    "create",
    "field_key",
    "generation_collection",
    "open_existing",
    "parse_target",
    "token_id",
]

CAPABILITIES = capabilities_of("qdrant")  # declared in its registry row

DENSE = "dense"  # the named dense vector
SPARSE = "bm25"  # the named sparse vector
DEFAULT_COLLECTION = "densefit"
DEFAULT_PORT = 6333
API_KEY_VARIABLE = "QDRANT_API_KEY"
DEFAULT_TIMEOUT = 10  # seconds a request to a server may take, unless the target's ?timeout=
LAYOUT = "densefit-qdrant/1"  # metadata key "layout": the rows of aliased.py as points
AVGDL_KEY = "bm25_avgdl"  # metadata: the average document length BM25 weights are made with
_NAMESPACE = uuid.UUID("6f0b5e1c-3d0a-5a43-9a1e-2f4e0d9c7b11")  # point ids: uuid5(this, id)
_UPSERT_BATCH = 128  # points per upsert request
_PAGE = 1000  # points per scroll or retrieve request


def _client_module():
    """``qdrant_client``, or an ImportError saying what to install."""
    try:
        import qdrant_client  # an optional extra: densefit[qdrant]
    except ImportError:
        raise ImportError(
            "the Qdrant engine needs qdrant-client: pip install 'densefit[qdrant]'"
        ) from None
    return qdrant_client


def _models():
    _client_module()
    from qdrant_client import models  # the optional extra, checked just above

    return models


# -- targets ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class QdrantTarget:
    """Where a Qdrant store lives: a server (``host``, ``port``, ``https``) or a local-mode
    ``folder``, and the ``collection``; ``location`` is the target as shown (redacted)."""

    location: str
    collection: str
    folder: str | None = None
    host: str | None = None
    port: int = DEFAULT_PORT
    https: bool = False
    timeout: float = DEFAULT_TIMEOUT

    @property
    def local(self) -> bool:
        return self.folder is not None


def _checked_collection(name: str, location: str) -> str:
    if not (1 <= len(name) <= 64) or any(
        not (c.isascii() and (c.isalnum() or c in "_-")) for c in name
    ):
        raise StoreError(
            f"{location}: collection name {name!r} is not 1 to 64 letters, digits, '_' or '-': "
            "pick a name like docs_v1"
        )
    return name


def parse_target(target: str) -> QdrantTarget:
    """The :class:`QdrantTarget` a ``qdrant:`` target names (see the module docstring), or a
    one-line :class:`~densefit.retrieval.index.types.StoreError` saying what to write.

    >>> parse_target("qdrant://localhost/docs").port
    6333
    >>> parse_target("qdrant:///srv/q?collection=scifact").folder
    '/srv/q'
    >>> parse_target("qdrant://localhost/my docs")
    Traceback (most recent call last):
    ...
    densefit.retrieval.index.types.StoreError: qdrant://localhost/my docs: collection name 'my docs' is not 1 to 64 letters, digits, '_' or '-': pick a name like docs_v1
    """
    location = redacted(target)  # what messages show; the target itself is parsed
    if not str(target).lower().startswith("qdrant:"):
        raise StoreError(f"{location} is not a Qdrant target: write qdrant://HOST:PORT/COLLECTION")
    parts = urlsplit(str(target))
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    server = str(target)[len("qdrant:") :].startswith("//") and bool(parts.netloc)
    if server:
        return _server_target(location, parts, options)
    unknown = sorted(set(options) - {"collection"})
    if unknown:
        raise StoreError(
            f"{location}: unknown option {unknown[0]!r}: a local Qdrant folder takes "
            "?collection=NAME only"
        )
    folder = parts.path
    if not folder:
        raise StoreError(
            f"{location}: no folder: write qdrant:FOLDER (local mode) or "
            "qdrant://HOST:PORT/COLLECTION (a server)"
        )
    collection = options.get("collection", DEFAULT_COLLECTION)
    return QdrantTarget(location, _checked_collection(collection, location), folder=folder)


def _server_target(location: str, parts, options: dict) -> QdrantTarget:
    if parts.username is not None or parts.password is not None:
        raise StoreError(
            f"{location}: a Qdrant target takes no user or key: set the API key in the "
            f"environment variable {API_KEY_VARIABLE}"
        )
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise StoreError(f"{location}: the port is not a number from 1 to 65535") from None
    unknown = sorted(set(options) - {"https", "timeout"})
    if unknown:
        raise StoreError(
            f"{location}: unknown option {unknown[0]!r}: a Qdrant server target takes "
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
    name = parts.path.strip("/")
    if not name:
        raise StoreError(
            f"{location}: no collection: write qdrant://{parts.netloc}/COLLECTION "
            "(a name of letters, digits, '_' and '-')"
        )
    return QdrantTarget(
        location,
        _checked_collection(name, location),
        host=parts.hostname,
        port=port,
        https=https in ("true", "1"),
        timeout=timeout,
    )


# -- connections: a server's client, or local mode's one client per folder and process ----


class _Connection:
    """A client and the locks its stores share; :meth:`release` when a store closes."""

    def __init__(self, client, *, local: bool, key: str | None = None):
        self.client, self.local, self.key, self.users = client, local, key, 1
        self.lock = threading.RLock()  # local mode: one call at a time on the client
        self.writers: dict[str, threading.RLock] = {}  # local mode's, by name

    def release(self) -> None:
        if not self.local:
            return self.client.close()
        with _LOCAL_LOCK:
            self.users -= 1
            if self.users == 0:
                _LOCAL.pop(self.key, None)
                with self.lock:
                    self.client.close()


_LOCAL: dict[str, _Connection] = {}  # local mode: the open client of each process and folder
_LOCAL_LOCK = threading.Lock()


def _connect(target: QdrantTarget) -> _Connection:
    """A connection to ``target``'s server or folder (the folder is created if missing)."""
    qdrant_client = _client_module()
    if target.local:
        key = f"{os.getpid()}:{os.path.realpath(target.folder)}"  # a forked child: its own
        with _LOCAL_LOCK:
            found = _LOCAL.get(key)
            if found is not None:
                found.users += 1
                return found
            try:
                client = qdrant_client.QdrantClient(
                    path=target.folder, force_disable_check_same_thread=True
                )
            except RuntimeError as exc:
                if "already accessed" not in str(exc):
                    raise
                raise StoreError(
                    f"{target.location}: another process has this Qdrant folder open (local "
                    "mode lets one process open it): stop that process, or serve the "
                    "collection from a Qdrant server (qdrant://HOST:PORT/COLLECTION)"
                ) from None
            connection = _LOCAL[key] = _Connection(client, local=True, key=key)
            return connection
    client = qdrant_client.QdrantClient(
        host=target.host,
        port=target.port,
        https=target.https,
        api_key=os.environ.get(API_KEY_VARIABLE) or None,
        check_compatibility=False,
        timeout=target.timeout,
    )
    return _Connection(client, local=False)


def _server_error(target: QdrantTarget, exc: Exception) -> StoreError:
    """A one-line error for a failed request to ``target``'s server: a refused key or
    request a StoreError; an unreachable, lost or timed-out server, or its 502/503/504, a
    StoreUnavailableError."""
    status = getattr(exc, "status_code", None)
    if status in (401, 403):
        return StoreError(
            f"{target.location}: the Qdrant server refused the request (HTTP {status}): set "
            f"{API_KEY_VARIABLE} to an API key that may use collection {target.collection!r}"
        )
    why = " ".join(str(exc).split())[:200] or type(exc).__name__
    scheme = "https" if target.https else "http"
    error = StoreError if status is not None and status not in (502, 503, 504) else None
    error = error or StoreUnavailableError  # no answer (refused, lost, timed out) or busy
    return error(
        f"{target.location}: cannot use the Qdrant server at {scheme}://{target.host}:"
        f"{target.port} ({why}): start it, or check the host, port, ?https= and "
        f"{API_KEY_VARIABLE}"
    )


def _faults(target: QdrantTarget) -> tuple[Fault, ...]:
    """Qdrant's error table (:func:`~densefit.retrieval.index.common.translated`): local
    mode's full disk or read-only folder as its StorageFault; a server's failures
    (unreachable, refused, an error answer) as one line saying what to check."""
    if target.local:
        return (Fault(Exception, lambda exc: storage_fault(exc, target.folder)),)
    return (Fault(_is_request_error, lambda exc: _server_error(target, exc)),)


def _requests(target: QdrantTarget) -> AbstractContextManager:
    """Qdrant's errors raised in the block translated (before a store object exists)."""
    return translated(_faults(target))


def _is_request_error(exc: Exception) -> bool:
    # the optional extra (densefit[qdrant]), installed once a Qdrant store is open
    from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

    return isinstance(exc, (ResponseHandlingException, UnexpectedResponse, ConnectionError))


# -- payload keys, filters, BM25 weights ----------------------------------------------------------

_ESCAPES = {"_": "__", "-": "_h", " ": "_s", ".": "_d"}


def field_key(field: str) -> str:
    """The payload key of a filter field's typed parts under ``fields``: ASCII letters and
    digits as they are, ``_ - space .`` as ``__ _h _s _d``, any other character as
    ``_u<hex>_``; one key per field name (it can be read back), addressable by every
    Qdrant payload path without quoting.

    >>> field_key("meta.a_b"), field_key("meta.größe")
    ('meta_da__b', 'meta_dgr_uf6__udf_e')
    """
    out = []
    for char in field:
        if char.isascii() and char.isalnum():
            out.append(char)
        elif char in _ESCAPES:
            out.append(_ESCAPES[char])
        else:
            out.append(f"_u{ord(char):x}_")
    return "".join(out)


class _Constant:
    """A filter part known to match every document (True) or none (False)."""

    def __init__(self, value: bool):
        self.value = value

    def __repr__(self) -> str:
        return "EVERYTHING" if self.value else "NOTHING"


EVERYTHING, NOTHING = _Constant(True), _Constant(False)


# Local mode evaluates a filter in Python, about 40 us per condition and stored document in
# each search (bench/filter_limits.py: 900 conditions over 40 documents took 1.3-2 s a search);
# a server evaluates it natively and has no limit of its own (Qdrant's strict mode can set one).
LOCAL_FILTER_MAX_CONDITIONS = 200


def compile_filter(filters: Filter | dict | None):
    """``filters`` (parsed, :class:`~densefit.retrieval.index.filters.Filter`; a dict is
    parsed for this engine) as a ``qdrant_client.models.Filter`` over the typed fields, or
    :data:`EVERYTHING` / :data:`NOTHING` when the filter matches every document or none
    whatever they hold (no filter: EVERYTHING).

    >>> compile_filter({"operator": "OR", "conditions": []})
    NOTHING
    >>> compile_filter({"field": "meta.n", "operator": ">", "value": 2}).must[0].key
    'fields.meta_dn.n'
    """
    parsed = parse_filters(filters, CAPABILITIES)
    if parsed is None:
        return EVERYTHING
    compiled = emit(parsed, _Payload(_models()))
    if isinstance(compiled, _Constant):
        return compiled
    return compiled if _is_filter(compiled) else _models().Filter(must=[compiled])


def _is_filter(condition) -> bool:
    return type(condition).__name__ == "Filter"


class _Payload:
    """The filter emitter (:class:`~densefit.retrieval.index.filters.Emitter`): Qdrant
    conditions over the typed fields, :data:`EVERYTHING` and :data:`NOTHING` folded away."""

    def __init__(self, models):
        self.models = models

    def compare(self, c: Comparison):
        key = f"fields.{field_key(c.field)}"
        if c.operator == "==":
            return self._equal(key, c.value)
        if c.operator == "in":
            return self._member(key, c.value)
        if c.value is None:
            return NOTHING  # Haystack: None is not ordered
        bound = {">": "gt", ">=": "gte", "<": "lt", "<=": "lte"}[c.operator]
        if isinstance(c.value, str):  # an ISO date: by its instant, where the field is one
            seconds = date_seconds(c.value, f"{c.field} {c.operator}")
            return self.models.FieldCondition(
                key=f"{key}.d", range=self.models.Range(**{bound: seconds})
            )
        # a number (bools are 1 and 0): where the field is a number or a bool
        return self.models.FieldCondition(
            key=f"{key}.n", range=self.models.Range(**{bound: float(c.value)})
        )

    def negate(self, condition):
        if isinstance(condition, _Constant):
            return NOTHING if condition.value else EVERYTHING
        return self.models.Filter(must_not=[condition])

    def all_of(self, parts: list):
        if any(p is NOTHING for p in parts):
            return NOTHING
        parts = [p for p in parts if p is not EVERYTHING]
        if not parts:
            return EVERYTHING
        return parts[0] if len(parts) == 1 else self.models.Filter(must=parts)

    def any_of(self, parts: list):
        if any(p is EVERYTHING for p in parts):
            return EVERYTHING
        parts = [p for p in parts if p is not NOTHING]
        if not parts:
            return NOTHING
        return parts[0] if len(parts) == 1 else self.models.Filter(should=parts)

    def _member(self, key: str, values: list):
        """Strings as one ``MatchAny`` condition (one condition however long the list),
        numbers and the rest each as its own equality."""
        strings = list(dict.fromkeys(v for v in values if isinstance(v, str)))
        rest = _unique([v for v in values if not isinstance(v, str)])
        parts = [self._equal(key, v) for v in rest]
        if len(strings) == 1:
            parts.append(self._equal(key, strings[0]))
        elif strings:
            any_of = self.models.MatchAny(any=strings)
            parts.append(self.models.FieldCondition(key=f"{key}.s", match=any_of))
        return self.any_of(parts)

    def _equal(self, key: str, value):
        models = self.models
        if value is None:  # missing or null: the field has no typed entry
            return models.IsEmptyCondition(is_empty=models.PayloadField(key=f"{key}.t"))
        if isinstance(value, (list, dict)):
            return models.FieldCondition(
                key=f"{key}.j", match=models.MatchValue(value=json_text(value))
            )
        if isinstance(value, (bool, int, float)):
            number = float(value)
            return models.FieldCondition(key=f"{key}.n", range=models.Range(gte=number, lte=number))
        return models.FieldCondition(key=f"{key}.s", match=models.MatchValue(value=value))


def _unique(values: list) -> list:
    seen, out = set(), []
    for value in values:
        marker = (type(value) is str, json.dumps(value, sort_keys=False))
        if marker not in seen:
            seen.add(marker)
            out.append(value)
    return out


def token_id(token: str) -> int:
    """A BM25 token's sparse-vector index: a stable 32-bit hash of its UTF-8 bytes.

    >>> token_id("cells") == token_id("cells") != token_id("genes")
    True
    """
    return int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=4).digest(), "big")


def _token_counts(texts: Sequence[str]) -> list[tuple[Counter, int]]:
    """``(counts by token id, length in tokens)`` of each text (bm25s's tokens)."""
    return [(Counter(token_id(t) for t in tokens), len(tokens)) for tokens in tokenize(texts)]


def _bm25_vector(counts: Counter, length: int, avgdl: float, models):
    """A document's BM25 weights: bm25s's ``tf / (tf + k1 (1 - b + b dl / avgdl))``."""
    ids = sorted(counts)
    norm = K1 * (1 - B + B * length / avgdl)
    values = [counts[i] / (counts[i] + norm) for i in ids]
    return models.SparseVector(indices=ids, values=values)


def _sparse_vector(counts: Counter, length: int, avgdl: float | None):
    """A document's sparse vector: its BM25 weights, empty for a text without a token."""
    models = _models()
    if not counts:
        return models.SparseVector(indices=[], values=[])
    return _bm25_vector(counts, length, avgdl, models)


# -- the store ---------------------------------------------------------------------------------


def _point_id(doc_id: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, doc_id))


def _asked(fields: list[str]) -> tuple[list[str], list[str] | bool]:
    """``with_payload`` and ``with_vectors`` of a request for a row's ``fields``."""
    vectors = [f for f in fields if f in (DENSE, SPARSE)]
    return [f for f in fields if f not in (DENSE, SPARSE)], vectors or False


def _row(point) -> dict:
    """A point as a row: its payload and its vectors by name."""
    vectors = point.vector or {}
    return {**point.payload, **(vectors if isinstance(vectors, dict) else {DENSE: vectors})}


class QdrantDocumentStore(AliasedStore):
    """A densefit store in a Qdrant collection (see the module docstring); get one from
    :func:`~densefit.retrieval.index.engines.open_store` with a ``qdrant:`` target.

    >>> import tempfile
    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.encode import encode_texts
    >>> from densefit.data.types import Document
    >>> from densefit.retrieval.index.engines import open_store
    >>> model = tiny_model()
    >>> store = open_store(f"qdrant:{tempfile.mkdtemp()}", model)  # local mode, in a folder
    >>> docs = [Document("a", "cells divide"), Document("b", "python functions")]
    >>> store.write(docs, encode_texts(model, [d.text for d in docs]))
    WriteResult(added=2, updated=0)
    >>> store.search(None, 1, mode="bm25", query_texts=["python"])[0][0].id
    'b'
    >>> store.close()
    """

    capabilities = CAPABILITIES
    _layout, _local_mode = LAYOUT, "local"
    _ALL, _NONE, _ROW = EVERYTHING, NOTHING, [*PAYLOAD, SPARSE]
    _local_capabilities = {"filter_max_conditions": LOCAL_FILTER_MAX_CONDITIONS}
    _faults_of = staticmethod(_faults)

    def __init__(self, target: QdrantTarget, connection: _Connection, *, backend: str | None):
        super().__init__(target, connection, backend=backend)
        self._models = _models()
        self._avgdl: float | None = None  # read from the metadata

    def _read_record(self) -> None:
        """The record, the model generation, the swap under way and the BM25 length average,
        from the serving collection's metadata."""
        with self._errors():
            info = self._client.get_collection(self.collection)
        meta = _record_of(info, self.target)
        self._take_record(meta)
        self._avgdl = None if AVGDL_KEY not in meta else float(meta[AVGDL_KEY])

    def _opened(self) -> None:
        if self.target.local:  # the folder is this process's: nobody else reads it
            self._drop_older_generations()

    # -- collections and the alias (AliasedStore's primitives) -------------------------------

    def _collections(self) -> list[str]:
        return [c.name for c in self._client.get_collections().collections]

    def _exists(self, collection: str) -> bool:
        return self._client.collection_exists(collection)

    def _properties(self, collection: str) -> dict:
        return self._client.get_collection(collection).config.metadata or {}

    def _set_properties(self, collection: str, values: dict) -> None:
        self._client.update_collection(collection, metadata=values)

    def _drop_collection(self, collection: str) -> None:
        self._client.delete_collection(collection)

    def _serving_collection(self) -> str | None:
        """The alias's collection, or the plain collection named as the store (made before
        model swaps)."""
        for alias in self._client.get_aliases().aliases:
            if alias.alias_name == self.collection:
                return alias.collection_name
        return self.collection if self._client.collection_exists(self.collection) else None

    def _alias_operations(self, collection: str | None, *, replace: bool) -> list:
        models, name = self._models, self.collection
        operations = []
        if replace:
            delete = models.DeleteAlias(alias_name=name)
            operations.append(models.DeleteAliasOperation(delete_alias=delete))
        if collection is not None:
            create = models.CreateAlias(collection_name=collection, alias_name=name)
            operations.append(models.CreateAliasOperation(create_alias=create))
        return operations

    def _point_alias(self, collection: str, *, replace: bool) -> None:
        self._client.update_collection_aliases(self._alias_operations(collection, replace=replace))

    def _drop_alias(self) -> None:
        if any(a.alias_name == self.collection for a in self._client.get_aliases().aliases):
            self._client.update_collection_aliases(self._alias_operations(None, replace=True))

    def _new_collection(self, collection: str, record: StoreRecord, extra: dict) -> None:
        """``collection`` for ``record``'s vectors; a server's gets the payload indexes
        densefit filters by and, for a swap's, those of the collection it replaces."""
        models = self._models
        datatype = models.Datatype.FLOAT16 if record.vector_kind == "float16" else None
        dense = models.VectorParams(
            size=record.dim, distance=models.Distance.DOT, datatype=datatype
        )
        sparse = models.SparseVectorParams(modifier=models.Modifier.IDF)
        try:
            self._client.create_collection(
                collection, vectors_config={DENSE: dense}, sparse_vectors_config={SPARSE: sparse},
                metadata=self._new_metadata(record, extra),
            )  # fmt: skip
        except Exception:
            if self._client.collection_exists(collection):
                return  # another process created it meanwhile: use that one
            raise
        if self.target.local:
            return  # local mode scans: its payload indexes do nothing
        schema = models.PayloadSchemaType
        indexes = {"seq": schema.INTEGER, "stale": schema.BOOL, "text_hash": schema.KEYWORD,
                   "id": schema.KEYWORD}  # fmt: skip
        if extra.get(BUILDING_KEY):
            found = self._client.get_collection(extra[BUILDING_KEY]).payload_schema or {}
            indexes |= {field: info.data_type for field, info in found.items()}
        for key, kind in indexes.items():
            self._client.create_payload_index(collection, key, kind, wait=True)

    # -- rows ------------------------------------------------------------------------------

    def _rows(self, where, fields: list[str], collection: str | None = None) -> list[dict]:
        if where is NOTHING:
            return []
        payload, vectors = _asked(fields)
        rows, offset = [], None
        while True:
            points, offset = self._client.scroll(
                collection or self.collection,
                scroll_filter=None if where is EVERYTHING else where,
                limit=_PAGE, offset=offset, with_payload=payload, with_vectors=vectors,
            )  # fmt: skip
            rows += [_row(p) for p in points]
            if offset is None:
                return rows

    def _rows_after(self, seq: int, limit: int) -> list[dict]:
        """By the payload index on ``seq`` that every server collection gets."""
        order = self._models.OrderBy(key="seq", start_from=seq + 1)
        points, _ = self._client.scroll(
            self.collection, order_by=order, limit=limit, with_payload=[*VERSION, "text"]
        )
        return [_row(p) for p in points]

    def _by_id(self, ids: Sequence[str], fields: list[str], collection: str | None = None):
        payload, vectors = _asked(fields)
        found, unique = {}, list(dict.fromkeys(ids))
        for start in range(0, len(unique), _PAGE):
            points = self._client.retrieve(
                collection or self.collection,
                [_point_id(i) for i in unique[start : start + _PAGE]],
                with_payload=payload, with_vectors=vectors,
            )  # fmt: skip
            found.update((p.payload["id"], _row(p)) for p in points)
        return found

    def _count(self, where) -> int:
        query = None if where is EVERYTHING else where
        return self._client.count(self.collection, count_filter=query, exact=True).count

    def _selection(self, stale: bool, hashes: list[str] | None = None):
        models = self._models
        must = [models.FieldCondition(key="stale", match=models.MatchValue(value=stale))]
        if hashes is not None:
            among = models.MatchAny(any=hashes)
            must.insert(0, models.FieldCondition(key="text_hash", match=among))
        return models.Filter(must=must)

    def _typed(self, doc_id: str, text: str, title: str, meta: dict) -> dict:
        return {field_key(f): v for f, v in typed_fields(doc_id, text, title, meta).items()}

    def _with_vectors(self, rows: list[dict], vectors: np.ndarray) -> None:
        counted = _token_counts([row["text"] for row in rows])
        avgdl = self._bm25_average(counted)
        for row, vector, (counts, length) in zip(rows, vectors, counted, strict=True):
            row.update({DENSE: vector.tolist(), SPARSE: _sparse_vector(counts, length, avgdl)})

    def _bm25_average(self, counted: list[tuple[Counter, int]]) -> float | None:
        """The average document length BM25 weights are made with: the collection's, or,
        for its first documents with tokens, theirs (recorded for every later write)."""
        if self._avgdl is None:
            self._read_record()  # another writer may have fixed it meanwhile
        if self._avgdl is None:
            lengths = [length for _, length in counted]
            if sum(lengths) == 0:
                return None  # no token yet: every vector is empty whatever the average
            self._avgdl = float(np.mean(lengths))
            self._set_properties(self.collection, {AVGDL_KEY: repr(self._avgdl)})
        return self._avgdl

    def _carried(self) -> dict:
        return {} if self._avgdl is None else {AVGDL_KEY: repr(self._avgdl)}

    def _upsert_rows(self, collection: str, rows: list[dict]) -> None:
        models, empty = self._models, self._models.SparseVector(indices=[], values=[])
        points = [
            models.PointStruct(
                id=_point_id(row["id"]),
                vector={DENSE: row[DENSE], SPARSE: row.get(SPARSE) or empty},
                payload={k: v for k, v in row.items() if k not in (DENSE, SPARSE)},
            )
            for row in rows
        ]
        for start in range(0, len(points), _UPSERT_BATCH):
            self._client.upsert(collection, points[start : start + _UPSERT_BATCH], wait=True)

    def _update_rows(self, collection: str, changes: dict[str, dict]) -> None:
        if collection != self.collection:  # the next generation: its copies only
            changes = {i: changes[i] for i in self._by_id(list(changes), ["id"], collection)}
        models = self._models
        operations = [
            models.SetPayloadOperation(set_payload=models.SetPayload(payload=p, points=[_point_id(i)]))
            for i, p in changes.items()
        ]  # fmt: skip
        for start in range(0, len(operations), _UPSERT_BATCH):
            batch = operations[start : start + _UPSERT_BATCH]
            self._client.batch_update_points(collection, batch, wait=True)

    def _delete_rows(self, collection: str, ids: list[str]) -> None:
        if ids:
            points = self._models.PointIdsList(points=[_point_id(i) for i in ids])
            self._client.delete(collection, points_selector=points, wait=True)

    def _mark_stale(self) -> None:
        everything = self._models.FilterSelector(filter=self._models.Filter())
        with self._reading():
            self._client.set_payload(
                self.collection, payload={"stale": True}, points=everything, wait=True
            )

    def index_meta_field(self, field: str) -> None:
        """Create Qdrant payload indexes on the typed parts of the metadata field ``field``
        (``"meta.lang"``), so that a server's filters on it look documents up (idempotent;
        local mode scans whatever is indexed)."""
        meta_path(field)  # the name checked as filters check theirs
        schema = self._models.PayloadSchemaType
        parts = {"t": schema.KEYWORD, "s": schema.KEYWORD, "j": schema.KEYWORD}
        parts |= {"n": schema.FLOAT, "d": schema.FLOAT}
        with self._reading():
            if self.target.local:
                return  # local mode scans: its payload indexes do nothing
            for part, kind in parts.items():
                self._client.create_payload_index(
                    self.collection, field_name=f"fields.{field_key(field)}.{part}",
                    field_schema=kind, wait=True,
                )  # fmt: skip

    # -- searching -------------------------------------------------------------------------

    def _where(self, filters: Filter):
        return compile_filter(filters)

    def _query(self, requests: list) -> list[Ranked]:
        """Each request's ranking, with the documents of its points (their payloads)."""
        answers = self._client.query_batch_points(self.collection, requests) if requests else []
        return [ranked([(p.score, p.payload) for p in answer.points]) for answer in answers]

    def _dense(self, queries: np.ndarray, k: int, where) -> list[Ranked]:
        if where is NOTHING:
            return [nothing() for _ in queries]
        models = self._models
        exact = self.backend_name == "exact" and not self.target.local  # local: always
        params = models.SearchParams(exact=True) if exact else None
        requests = [
            models.QueryRequest(
                query=query.tolist(),
                using=DENSE,
                filter=None if where is None or where is EVERYTHING else where,
                limit=k,
                params=params,
                with_payload=SHOWN,
            )
            for query in queries
        ]
        return self._query(requests)

    def _lexical(self, texts: list[str], k: int, where) -> list[Ranked]:
        models = self._models
        counted = _token_counts(texts)
        asked = [i for i, (counts, _) in enumerate(counted) if counts and where is not NOTHING]
        requests = [
            models.QueryRequest(
                query=models.SparseVector(
                    indices=sorted(counted[i][0]),
                    values=[float(counted[i][0][t]) for t in sorted(counted[i][0])],
                ),
                using=SPARSE,
                filter=None if where is None or where is EVERYTHING else where,
                limit=k,
                with_payload=SHOWN,
            )
            for i in asked
        ]
        answers = dict(zip(asked, self._query(requests), strict=True))
        return [answers.get(i, nothing()) for i in range(len(texts))]

    def _info_extra(self) -> dict:
        return super()._info_extra() | {"bm25_avgdl": self._avgdl}


def _record_of(info, target: QdrantTarget) -> dict[str, str]:
    """The record the collection ``info`` describes (its metadata, the BM25 length average
    under AVGDL_KEY), or a one-line StoreError when the collection is not a densefit store,
    its vectors do not fit its record, or it is a generation of another store."""
    metadata = dict(info.config.metadata or {})
    where = f"{target.location}"
    if metadata.get("layout") != LAYOUT or "format" not in metadata:
        raise StoreError(
            f"{where}: collection {target.collection!r} is not a densefit store (its metadata "
            "holds no densefit record): pick another collection name, or delete this one "
            "if it is yours"
        )
    meta = {k: str(v) for k, v in metadata.items() if v is not None}
    record = StoreRecord.from_meta(meta, where)
    vectors = info.config.params.vectors
    dense = vectors.get(DENSE) if isinstance(vectors, dict) else None
    sparse = (info.config.params.sparse_vectors or {}).get(SPARSE)
    if dense is None or sparse is None:
        raise StoreError(
            f"{where}: collection {target.collection!r} lacks the vectors {DENSE!r} and "
            f"{SPARSE!r} densefit writes: index into a new collection"
        )
    if dense.size != record.dim:
        raise StoreError(
            f"{where}: collection {target.collection!r} holds {dense.size}-d vectors but "
            f"records {record.dim}-d embeddings from {record.model_name!r}: index into a new "
            "collection"
        )
    owner = metadata.get(STORE_KEY) or target.collection
    if owner != target.collection:
        raise StoreError(
            f"{where}: collection {target.collection!r} holds a generation of the store "
            f"{owner!r} (its model swaps): open that store, ?collection={owner}"
        )
    return meta


# -- the engine's functions (densefit.retrieval.index.engines) ---------------------------------


def _local_state(target: QdrantTarget) -> bool:
    """Whether ``target``'s folder holds Qdrant's local storage (False: nothing there
    yet); a one-line StoreError for a file or a folder holding something else."""
    folder = Path(target.folder)
    if folder.exists() and not folder.is_dir():
        raise StoreError(f"{target.location}: {folder} is a file; qdrant:FOLDER needs a folder")
    if (folder / "meta.json").is_file():
        return True
    if folder.is_dir() and any(folder.iterdir()):
        if (folder / "store.sqlite").is_file():
            raise StoreError(
                f"{target.location}: {folder} holds an embedded densefit store: open it as "
                f"{folder} (without qdrant:)"
            )
        raise StoreError(
            f"{target.location}: {folder} is not empty and holds no Qdrant storage (no "
            "meta.json): pick a new or empty folder"
        )
    return False


def open_existing(target: str, *, backend=None, **_) -> QdrantDocumentStore | None:
    """The densefit store in ``target``'s collection; None when there is none (local mode:
    nothing is created then). ``rescore`` and ``lock_timeout`` do not apply."""
    parsed = parse_target(target)
    backend = checked_backend(backend, CAPABILITIES, "Qdrant")
    if parsed.local and not _local_state(parsed):
        return None
    return QdrantDocumentStore.opened(parsed, _connect(parsed), backend, None)


def create(target: str, record: StoreRecord, *, backend=None, **_) -> QdrantDocumentStore:
    """A new collection for ``record``'s vectors at ``target`` and its alias; when another
    process created them meanwhile, that store opened."""
    parsed = parse_target(target)
    backend = checked_backend(backend, CAPABILITIES, "Qdrant")
    checked_record(record, CAPABILITIES, parsed.location)
    if parsed.local:
        _local_state(parsed)
    return QdrantDocumentStore.opened(parsed, _connect(parsed), backend, record)
