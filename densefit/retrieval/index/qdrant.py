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
>>> parse_target("qdrant:runs/q").path, parse_target("qdrant:runs/q").collection
('runs/q', 'densefit')
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

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
    CollectionTarget,
    Connection,
    generation_collection,
    nothing,
    parse_collection_target,
    ranked,
    shared_connection,
)
from densefit.retrieval.index.common import Fault
from densefit.retrieval.index.filters import (
    Comparison,
    Filter,
    date_seconds,
    emit,
    folded,
    json_text,
    meta_path,
    parse_filters,
    typed_fields,
)
from densefit.retrieval.index.registry import capabilities_of
from densefit.retrieval.index.request import Ranked
from densefit.retrieval.index.types import StoreError, StoreRecord, StoreUnavailableError

__all__ = [
    "CAPABILITIES",
    "QdrantDocumentStore",
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
DEFAULT_PORT = 6333
API_KEY_VARIABLE = "QDRANT_API_KEY"
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
    return _client_module().models


# -- targets ---------------------------------------------------------------------------------


def parse_target(target: str) -> CollectionTarget:
    """The :class:`~densefit.retrieval.index.aliased.CollectionTarget` a ``qdrant:`` target
    names (see the module docstring), or a one-line StoreError saying what to write.

    >>> parse_target("qdrant://localhost/docs").port
    6333
    >>> parse_target("qdrant:///srv/q?collection=scifact").path
    '/srv/q'
    >>> parse_target("qdrant://localhost/my docs")
    Traceback (most recent call last):
    ...
    densefit.retrieval.index.types.StoreError: qdrant://localhost/my docs: collection name 'my docs' is not 1 to 64 letters, digits, '_' or '-': pick a name like docs_v1
    """
    return parse_collection_target(
        target,
        "Qdrant",
        port=DEFAULT_PORT,
        local="FOLDER",
        secret=("API key", API_KEY_VARIABLE),
        names=(re.compile(r"[A-Za-z0-9_-]{1,64}"), "1 to 64 letters, digits, '_' or '-'"),
    )


# -- connections: a server's client, or local mode's one client per folder and process ----


_LOCAL: dict[str, Connection] = {}  # local mode: the open client of each process and folder


def _connect(target: CollectionTarget) -> Connection:
    """A connection to ``target``'s server or folder (the folder is created if missing)."""
    qdrant_client = _client_module()
    if not target.local:
        client = qdrant_client.QdrantClient(
            host=target.host,
            port=target.port,
            https=target.https,
            api_key=os.environ.get(API_KEY_VARIABLE) or None,
            check_compatibility=False,
            timeout=target.timeout,
        )
        return Connection(client)

    def local() -> Connection:
        try:
            return Connection(
                qdrant_client.QdrantClient(path=target.path, force_disable_check_same_thread=True)
            )
        except RuntimeError as exc:
            if "already accessed" not in str(exc):
                raise
            raise StoreError(
                f"{target.location}: another process has this Qdrant folder open (local "
                "mode lets one process open it): stop that process, or serve the "
                "collection from a Qdrant server (qdrant://HOST:PORT/COLLECTION)"
            ) from None

    return shared_connection(_LOCAL, target.path, local)


def _server_error(target: CollectionTarget, exc: Exception) -> StoreError:
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
    error = StoreError if status is not None and status not in (502, 503, 504) else None
    error = error or StoreUnavailableError  # no answer (refused, lost, timed out) or busy
    return error(
        f"{target.location}: cannot use the Qdrant server at {target.url} ({why}): start "
        "it, or check the host, port, ?https= and "
        f"{API_KEY_VARIABLE}"
    )


def _faults(target: CollectionTarget) -> tuple[Fault, ...]:
    """Qdrant's error table (:func:`~densefit.retrieval.index.common.translated`): local
    mode's full disk or read-only folder as its StorageFault; a server's failures
    (unreachable, refused, an error answer) as one line saying what to check."""
    if target.local:
        return (Fault(Exception, lambda exc: storage_fault(exc, target.path)),)
    # the optional extra (densefit[qdrant]), installed once a Qdrant store is open
    from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

    failed = (ResponseHandlingException, UnexpectedResponse, ConnectionError)
    return (Fault(failed, lambda exc: _server_error(target, exc)),)


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
    return "".join(
        c if c.isascii() and c.isalnum() else _ESCAPES.get(c, f"_u{ord(c):x}_") for c in field
    )


# Local mode evaluates a filter in Python, about 40 us per condition and stored document in
# each search (bench/filter_limits.py: 900 conditions over 40 documents took 1.3-2 s a search);
# a server evaluates it natively and has no limit of its own (Qdrant's strict mode can set one).
LOCAL_FILTER_MAX_CONDITIONS = 200


def compile_filter(filters: Filter | dict | None):
    """``filters`` (parsed, :class:`~densefit.retrieval.index.filters.Filter`; a dict is
    parsed for this engine) as a ``qdrant_client.models.Filter`` over the typed fields, or
    True / False when the filter matches every document or none whatever they hold (no
    filter: True).

    >>> compile_filter({"operator": "OR", "conditions": []})
    False
    >>> compile_filter({"field": "meta.n", "operator": ">", "value": 2}).must[0].key
    'fields.meta_dn.n'
    """
    parsed = parse_filters(filters, CAPABILITIES)
    compiled = True if parsed is None else emit(parsed, _Payload(_models()))
    if isinstance(compiled, bool) or type(compiled).__name__ == "Filter":
        return compiled
    return _models().Filter(must=[compiled])


class _Payload:
    """The filter emitter (:class:`~densefit.retrieval.index.filters.Emitter`): Qdrant
    conditions over the typed fields, True and False folded away."""

    def __init__(self, models):
        self.models = models

    def compare(self, c: Comparison):
        key = f"fields.{field_key(c.field)}"
        if c.operator == "==":
            return self._equal(key, c.value)
        if c.operator == "in":
            return self._member(key, c.value)
        if c.value is None:
            return False  # Haystack: None is not ordered
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
        if isinstance(condition, bool):
            return not condition
        return self.models.Filter(must_not=[condition])

    def all_of(self, parts: list):
        return folded(parts, False, lambda rest: self.models.Filter(must=rest))

    def any_of(self, parts: list):
        return folded(parts, True, lambda rest: self.models.Filter(should=rest))

    def _member(self, key: str, values: list):
        """Strings as one ``MatchAny`` condition (one condition however long the list),
        numbers and the rest each as its own equality."""
        strings = list(dict.fromkeys(v for v in values if isinstance(v, str)))
        rest = {json.dumps(v): v for v in values if not isinstance(v, str)}.values()
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


def token_id(token: str) -> int:
    """A BM25 token's sparse-vector index: a stable 32-bit hash of its UTF-8 bytes.

    >>> token_id("cells") == token_id("cells") != token_id("genes")
    True
    """
    return int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=4).digest(), "big")


def _token_counts(texts: Sequence[str]) -> list[tuple[Counter, int]]:
    """``(counts by token id, length in tokens)`` of each text (bm25s's tokens)."""
    return [(Counter(token_id(t) for t in tokens), len(tokens)) for tokens in tokenize(texts)]


def _sparse_vector(counts: Counter, length: int, avgdl: float | None):
    """A document's sparse vector: bm25s's weights ``tf / (tf + k1 (1 - b + b dl / avgdl))``,
    empty for a text without a token."""
    ids = sorted(counts)
    norm = K1 * (1 - B + B * length / avgdl) if counts else 0.0
    return _models().SparseVector(indices=ids, values=[counts[i] / (counts[i] + norm) for i in ids])


# -- the store ---------------------------------------------------------------------------------


def _filter(where):
    """A compiled filter as a request's (None: every point)."""
    return None if where is None or where is True else where


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


def _local_state(target: CollectionTarget) -> bool:
    """Whether ``target``'s folder holds Qdrant's local storage (False: nothing there
    yet); a one-line StoreError for a file or a folder holding something else."""
    folder = Path(target.path)
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
    _ROW = [*PAYLOAD, SPARSE]
    _local_capabilities = {"filter_max_conditions": LOCAL_FILTER_MAX_CONDITIONS}
    _faults_of = staticmethod(_faults)
    _parse_target, _connect = staticmethod(parse_target), staticmethod(_connect)
    _local_files = staticmethod(_local_state)

    def __init__(self, target: CollectionTarget, connection: Connection, *, backend: str | None):
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
        if where is False:
            return []
        payload, vectors = _asked(fields)
        rows, offset = [], None
        while True:
            points, offset = self._client.scroll(
                collection or self.collection,
                scroll_filter=_filter(where),
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
        return self._client.count(self.collection, count_filter=_filter(where), exact=True).count

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

    def _query(self, using: str, queries: list, k: int, where, params=None) -> list[Ranked]:
        """Each query's ranking by the vector ``using`` among the points ``where`` matches,
        with the documents of its points (their payloads)."""
        if where is False or not queries:
            return [nothing() for _ in queries]
        requests = [
            self._models.QueryRequest(
                query=query,
                using=using,
                filter=_filter(where),
                limit=k,
                params=params,
                with_payload=SHOWN,
            )
            for query in queries
        ]
        answers = self._client.query_batch_points(self.collection, requests)
        return [ranked([(p.score, p.payload) for p in answer.points]) for answer in answers]

    def _dense(self, queries: np.ndarray, k: int, where) -> list[Ranked]:
        exact = self.backend_name == "exact" and not self.target.local  # local: always
        params = self._models.SearchParams(exact=True) if exact else None
        return self._query(DENSE, [query.tolist() for query in queries], k, where, params)

    def _lexical(self, texts: list[str], k: int, where) -> list[Ranked]:
        counted = [counts for counts, _ in _token_counts(texts)]
        asked = [i for i, counts in enumerate(counted) if counts]
        sparse = [
            self._models.SparseVector(indices=sorted(c), values=[float(c[t]) for t in sorted(c)])
            for c in (counted[i] for i in asked)
        ]
        answers = dict(zip(asked, self._query(SPARSE, sparse, k, where), strict=True))
        return [answers.get(i, nothing()) for i in range(len(texts))]

    def _info_extra(self) -> dict:
        return super()._info_extra() | {"bm25_avgdl": self._avgdl}


def _record_of(info, target: CollectionTarget) -> dict[str, str]:
    """The record the collection ``info`` describes (its metadata, the BM25 length average
    under AVGDL_KEY), or a one-line StoreError when the collection is not a densefit store,
    its vectors do not fit its record, or it is a generation of another store."""
    metadata = dict(info.config.metadata or {})
    where = target.location
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


def open_existing(target: str, *, backend=None, **_) -> QdrantDocumentStore | None:
    """The densefit store in ``target``'s collection; None when there is none (local mode:
    nothing is created then). ``rescore`` and ``lock_timeout`` do not apply."""
    return QdrantDocumentStore.opened(target, backend, None)


def create(target: str, record: StoreRecord, *, backend=None, **_) -> QdrantDocumentStore:
    """A new collection for ``record``'s vectors at ``target`` and its alias; when another
    process created them meanwhile, that store opened."""
    return QdrantDocumentStore.opened(target, backend, record)
