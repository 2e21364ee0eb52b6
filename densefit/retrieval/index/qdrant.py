"""Qdrant: densefit's documents and vectors in a Qdrant collection, through qdrant-client.

Targets (:func:`~densefit.retrieval.index.engines.open_store`):

- ``qdrant://HOST:PORT/COLLECTION``: a Qdrant server or cluster (port 6333 when left out;
  ``?https=true`` for TLS; the API key, if any, from the environment variable
  ``QDRANT_API_KEY``, so that it never appears in a target, a log or a message);
- ``qdrant:FOLDER`` (or ``qdrant:///abs/folder``): qdrant-client's local mode, the collection
  kept in files in ``FOLDER`` and searched in this process; the collection is named
  ``densefit`` unless ``qdrant:FOLDER?collection=NAME``.

Collection names are 1 to 64 letters, digits, ``_`` and ``-``. One collection holds one
store: a point per document (its id the ``uuid5`` of the document id) with a named dense
vector ``dense`` (the record's dimension, dot product: cosine stores hold unit vectors;
float16 stores ask Qdrant for float16 storage and send values already rounded to float16),
a sparse vector ``bm25`` and a payload: ``id``, ``text``, ``title``, ``meta`` (as the
embedded store keeps it: JSON, values JSON cannot hold written as text), ``fields`` (every
filterable field split by type, :func:`~densefit.retrieval.index.filters.typed_fields`,
under a key :func:`field_key` spells with ``[A-Za-z0-9_]`` only, so that Qdrant's payload
paths address any field name), ``text_hash``, ``meta_hash``, ``stale`` and ``seq`` (the
write order: each writer gives every document it writes ``microseconds * 1024 + tag``, the
time strictly increasing per writer and ``tag`` a random 10-bit number per store object, so
concurrent writers interleave by time and almost never collide). The model record
(:class:`~densefit.retrieval.index.settings.StoreRecord`) is the collection's metadata,
written with the collection in one call and read again before a search (on a server at
most once a second): :meth:`~densefit.retrieval.index.common.StoreCommon.check_model`
refuses another model as the embedded store does.

Filters (:func:`compile_filter`) become one ``qdrant_client.models.Filter`` over the typed
fields, with the embedded store's semantics exactly (a missing field is None, ``!=``
matches it, numbers and bools compare as numbers, ISO dates by their instant, lists and
dicts by their JSON text, ``NOT`` negates the AND of its conditions), applied inside the
search: the best ``k`` of the matching documents come back. :meth:`~QdrantDocumentStore.
index_meta_field` creates Qdrant payload indexes on a field's typed parts.

Search: ``backend="hnsw"`` (the default: Qdrant's HNSW index, filtered) or ``"exact"``
(``SearchParams(exact=True)``). BM25 (``mode="bm25"``, and ``"hybrid"``, fused with the
dense ranking by :class:`~densefit.retrieval.fusion.Fusion`) uses Qdrant's sparse vectors
with the IDF modifier: a document's weight for a token is bm25s's ``tf / (tf + k1 (1 - b +
b dl / avgdl))`` (:mod:`densefit.retrieval.bm25`'s tokens, ``K1``, ``B``; token ids a
32-bit hash of the token), Qdrant multiplies it by ``ln(1 + (N - n + 0.5) / (n + 0.5))``
when it searches, and a query weighs each of its tokens by its count: bm25s's score. Qdrant
cannot renormalise stored weights, so ``avgdl`` is the average length of the first
documents written (recorded in the metadata; two writers racing to write the first
documents may each use their own): scores equal :class:`~densefit.retrieval.bm25.
Bm25Index`'s while the collection holds those documents, and drift from them as later
writes move the true average. Documents without a token get an empty sparse vector and
count in ``N``, as in Bm25Index. Two tokens whose hashes collide count as one token.

Writes are batched upserts (``wait=True``); Qdrant applies each batch, not a transaction
(``transactions=False``), and a write is idempotent by document id. Qdrant reclaims
updated and deleted vectors itself (no compaction). Model swaps are not implemented (a
collection alias switched to a new collection would allow them).

Processes: a Qdrant server serves several densefit processes at once, each seeing the
others' writes (``shared``). It has no lock across processes: :meth:`~QdrantDocumentStore.
writer_lock` checks its timeout and holds nothing, and concurrent indexers are safe because
an upsert is idempotent by id (two indexers of one corpus embed some documents twice and
store them once). Local mode holds a file lock on its folder: one process at a time opens
it (another gets a one-line error), and the stores of one process share one client, a
threading lock serialising their calls and another their writers.

Versions: collection metadata needs Qdrant and qdrant-client 1.16 or later; local mode's
IDF follows updates and deletes from qdrant-client 1.20 (before, it kept counting replaced
and deleted documents).

What was run: everything in local mode (``tests/test_qdrant.py``), where qdrant-client
searches exactly whatever the backend (``"exact"`` sends no search parameter there), keeps
float16 vectors as float32, and computes the IDF over every live point holding the sparse
vector; against a server, only the refusals (no server listening, an API key refused by a
stand-in answering 401). Not run here: a Qdrant server or cluster (the same calls by URL:
HNSW recall, float16 storage, payload indexes, the IDF statistics of a server's sparse
index, which may count deleted points until its optimizer drops them).

>>> field_key("meta.release date")
'meta_drelease_sdate'
>>> parse_target("qdrant://db.example:6334/docs?https=true").collection
'docs'
>>> parse_target("qdrant:runs/q").folder, parse_target("qdrant:runs/q").collection
('runs/q', 'densefit')
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from densefit.choices import SIMILARITIES
from densefit.data.types import Document
from densefit.retrieval.bm25 import K1, B, tokenize
from densefit.retrieval.index.base import Capabilities, SearchHit, StoreError
from densefit.retrieval.index.common import checked_documents
from densefit.retrieval.index.database import DatabaseStore, StoredRow
from densefit.retrieval.index.documents import meta_hash
from densefit.retrieval.index.engines import require
from densefit.retrieval.index.filters import (
    Comparison,
    Logical,
    date_seconds,
    json_text,
    meta_field_sql,
    parse_filters,
    typed_fields,
)
from densefit.retrieval.index.locking import StoreLockedError
from densefit.retrieval.index.settings import StoreRecord, VectorSettings

__all__ = [
    "CAPABILITIES",
    "EVERYTHING",
    "NOTHING",
    "QdrantDocumentStore",
    "QdrantTarget",
    "compile_filter",
    "create",
    "field_key",
    "open_existing",
    "parse_target",
    "token_id",
]

CAPABILITIES = Capabilities(
    engine="qdrant",
    vector_kinds=("float32", "float16"),
    backends=("hnsw", "exact"),
    lexical=(
        "bm25 (Qdrant sparse vectors with its IDF modifier; document lengths normalised by "
        "the average length of the first documents written)"
    ),
    hybrid=True,
    model_swap=False,
    transactions=False,
    crash_safe=False,
    compaction=False,
    shared=True,  # a server's; a store in local mode says False
)

DENSE = "dense"  # the named dense vector
SPARSE = "bm25"  # the named sparse vector
DEFAULT_COLLECTION = "densefit"
DEFAULT_PORT = 6333
API_KEY_VARIABLE = "QDRANT_API_KEY"
LAYOUT = "densefit-qdrant/1"  # metadata key "layout": the payload layout above
AVGDL_KEY = "bm25_avgdl"  # metadata: the average document length BM25 weights are made with
_RECORD_COUNTERS = ("n_rows", "generation", "stale_below_row")  # the embedded store's only
_NAMESPACE = uuid.UUID("6f0b5e1c-3d0a-5a43-9a1e-2f4e0d9c7b11")  # point ids: uuid5(this, id)
_UPSERT_BATCH = 128  # points per upsert request
_PAGE = 1000  # points per scroll request
_REFRESH_SECONDS = 1.0  # a server's record is read again at most this often
_SHOWN = ["id", "text", "title", "meta", "seq"]  # the payload a search hit needs


def _client_module():
    """``qdrant_client``, or an ImportError saying what to install."""
    try:
        import qdrant_client
    except ImportError:
        raise ImportError(
            "the Qdrant engine needs qdrant-client: pip install 'densefit[qdrant]'"
        ) from None
    return qdrant_client


def _models():
    _client_module()
    from qdrant_client import models

    return models


# -- targets ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class QdrantTarget:
    """Where a Qdrant store lives: a server (``host``, ``port``, ``https``) or a local-mode
    ``folder``, and the ``collection``; ``location`` is the target as given."""

    location: str
    collection: str
    folder: str | None = None
    host: str | None = None
    port: int = DEFAULT_PORT
    https: bool = False

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
    one-line :class:`~densefit.retrieval.index.base.StoreError` saying what to write.

    >>> parse_target("qdrant://localhost/docs").port
    6333
    >>> parse_target("qdrant:///srv/q?collection=scifact").folder
    '/srv/q'
    >>> parse_target("qdrant://localhost/my docs")
    Traceback (most recent call last):
    ...
    densefit.retrieval.index.base.StoreError: qdrant://localhost/my docs: collection name 'my docs' is not 1 to 64 letters, digits, '_' or '-': pick a name like docs_v1
    """
    location = str(target)
    if not location.lower().startswith("qdrant:"):
        raise StoreError(f"{location} is not a Qdrant target: write qdrant://HOST:PORT/COLLECTION")
    parts = urlsplit(location)
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    server = location[len("qdrant:") :].startswith("//") and bool(parts.netloc)
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
        shown = location.replace(parts.netloc, "***@" + parts.netloc.rsplit("@", 1)[-1], 1)
        raise StoreError(
            f"{shown}: a Qdrant target takes no user or key: set the API key in the "
            f"environment variable {API_KEY_VARIABLE}"
        )
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise StoreError(f"{location}: the port is not a number from 1 to 65535") from None
    unknown = sorted(set(options) - {"https"})
    if unknown:
        raise StoreError(
            f"{location}: unknown option {unknown[0]!r}: a Qdrant server target takes "
            "?https=true only"
        )
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
    )


# -- connections: a server's client, or local mode's one client per folder and process ----


class _Connection:
    """A client and the locks its stores share; :meth:`release` when a store closes."""

    def __init__(self, client, *, local: bool, key: str | None = None):
        self.client = client
        self.local = local
        self.key = key
        self.lock = threading.RLock()  # local mode: one call at a time on the client
        self.writer_locks: dict[str, threading.RLock] = {}
        self.users = 1

    def writer_lock(self, name: str) -> threading.RLock:
        with self.lock:
            return self.writer_locks.setdefault(name, threading.RLock())

    def release(self) -> None:
        if not self.local:
            self.client.close()
            return
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
    )
    return _Connection(client, local=False)


def _server_error(target: QdrantTarget, exc: Exception) -> StoreError:
    """A one-line error for a failed request to ``target``'s server."""
    status = getattr(exc, "status_code", None)
    if status in (401, 403):
        return StoreError(
            f"{target.location}: the Qdrant server refused the request (HTTP {status}): set "
            f"{API_KEY_VARIABLE} to an API key that may use collection {target.collection!r}"
        )
    why = " ".join(str(exc).split())[:200] or type(exc).__name__
    scheme = "https" if target.https else "http"
    return StoreError(
        f"{target.location}: cannot use the Qdrant server at {scheme}://{target.host}:"
        f"{target.port} ({why}): start it, or check the host, port, ?https= and "
        f"{API_KEY_VARIABLE}"
    )


@contextlib.contextmanager
def _requests(target: QdrantTarget) -> Iterator[None]:
    """Turn a server's failures (unreachable, refused, an error answer) into StoreErrors."""
    try:
        yield
    except StoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - httpx, grpc and qdrant-client raise many kinds
        if target.local or not _is_request_error(exc):
            raise
        raise _server_error(target, exc) from None


def _is_request_error(exc: Exception) -> bool:
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


def _typed_payload(doc_id: str, text: str, title: str, meta: dict) -> dict:
    return {field_key(f): v for f, v in typed_fields(doc_id, text, title, meta).items()}


def _stored_meta(meta: dict | None) -> dict:
    """Metadata as the embedded store keeps it: JSON, what JSON cannot hold as text."""
    return json.loads(json.dumps(meta or {}, default=str))


class _Constant:
    """A filter part known to match every document (True) or none (False)."""

    def __init__(self, value: bool):
        self.value = value

    def __repr__(self) -> str:
        return "EVERYTHING" if self.value else "NOTHING"


EVERYTHING, NOTHING = _Constant(True), _Constant(False)


def compile_filter(filters: dict | None):
    """``filters`` (Haystack's syntax, :func:`~densefit.retrieval.index.filters.
    parse_filters`) as a ``qdrant_client.models.Filter`` over the typed fields, or
    :data:`EVERYTHING` / :data:`NOTHING` when the filter matches every document or none
    whatever they hold.

    >>> compile_filter({"operator": "OR", "conditions": []})
    NOTHING
    >>> compile_filter({"field": "meta.n", "operator": ">", "value": 2}).must[0].key
    'fields.meta_dn.n'
    """
    node = parse_filters(filters)
    if node is None:
        return EVERYTHING
    compiled = _compile(node, _models())
    if isinstance(compiled, _Constant):
        return compiled
    return compiled if _is_filter(compiled) else _models().Filter(must=[compiled])


def _is_filter(condition) -> bool:
    return type(condition).__name__ == "Filter"


def _any_of(parts: list, models):
    if any(p is EVERYTHING for p in parts):
        return EVERYTHING
    parts = [p for p in parts if p is not NOTHING]
    if not parts:
        return NOTHING
    return parts[0] if len(parts) == 1 else models.Filter(should=parts)


def _all_of(parts: list, models):
    if any(p is NOTHING for p in parts):
        return NOTHING
    parts = [p for p in parts if p is not EVERYTHING]
    if not parts:
        return EVERYTHING
    return parts[0] if len(parts) == 1 else models.Filter(must=parts)


def _negated(condition, models):
    if isinstance(condition, _Constant):
        return NOTHING if condition.value else EVERYTHING
    return models.Filter(must_not=[condition])


def _compile(node: Comparison | Logical, models):
    if isinstance(node, Logical):
        parts = [_compile(c, models) for c in node.conditions]
        if node.operator == "OR":
            return _any_of(parts, models)
        conjunction = _all_of(parts, models)
        return _negated(conjunction, models) if node.operator == "NOT" else conjunction
    key = f"fields.{field_key(node.field)}"
    operator, value = node.operator, node.value
    if operator in ("==", "!="):
        condition = _equal(key, value, models)
        return condition if operator == "==" else _negated(condition, models)
    if operator in ("in", "not in"):
        condition = _any_of([_equal(key, v, models) for v in _unique(value)], models)
        return condition if operator == "in" else _negated(condition, models)
    if value is None:
        return NOTHING  # Haystack: None is not ordered
    bound = {">": "gt", ">=": "gte", "<": "lt", "<=": "lte"}[operator]
    if isinstance(value, str):  # an ISO date: compared by its instant, where the field is one
        seconds = date_seconds(value, f"{node.field} {operator}")
        return models.FieldCondition(key=f"{key}.d", range=models.Range(**{bound: seconds}))
    # a number (bools are 1 and 0): where the field is a number or a bool
    return models.FieldCondition(key=f"{key}.n", range=models.Range(**{bound: float(value)}))


def _unique(values: list) -> list:
    seen, out = set(), []
    for value in values:
        marker = (type(value) is str, json.dumps(value, sort_keys=False))
        if marker not in seen:
            seen.add(marker)
            out.append(value)
    return out


def _equal(key: str, value, models):
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


def _bm25_vector(counts: Counter, length: int, avgdl: float, models):
    """A document's BM25 weights: bm25s's ``tf / (tf + k1 (1 - b + b dl / avgdl))``."""
    ids = sorted(counts)
    norm = K1 * (1 - B + B * length / avgdl)
    values = [counts[i] / (counts[i] + norm) for i in ids]
    return models.SparseVector(indices=ids, values=values)


# -- the store ---------------------------------------------------------------------------------


def _point_id(doc_id: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, doc_id))


def _ranked_pairs(points) -> tuple[list[int], list[float]]:
    """Keys (``seq``) and scores, best first, ties by write order (as the embedded store)."""
    pairs = sorted((-float(p.score), int(p.payload["seq"])) for p in points)
    return [seq for _, seq in pairs], [-score for score, _ in pairs]


class QdrantDocumentStore(DatabaseStore):
    """A densefit store in a Qdrant collection (see the module docstring); get one from
    :func:`~densefit.retrieval.index.engines.open_store` with a ``qdrant:`` target.

    >>> import tempfile
    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.encode import encode_texts
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

    def __init__(self, target: QdrantTarget, connection: _Connection, *, backend: str | None):
        super().__init__()
        self.target = target
        self.location = target.location
        self.collection = target.collection
        self._connection: _Connection | None = connection
        self._client = connection.client
        if connection.local:
            self._lock = connection.lock  # one call at a time on local mode's client
            self.capabilities = dataclasses.replace(CAPABILITIES, shared=False)
        self.backend_name = backend or CAPABILITIES.backends[0]
        self._models = _models()
        self._read_at = -float("inf")
        self._avgdl: float | None = None
        self._tag = secrets.randbelow(1024)
        self._last_micros = 0
        self._found: dict[int, dict] = {}  # the hits of the search under way, by key
        with self._lock:
            self._read_record()

    # -- the record ------------------------------------------------------------------------

    def _read_record(self) -> None:
        """Read the record (and the BM25 length average) from the collection's metadata."""
        with _requests(self.target):
            info = self._client.get_collection(self.collection)
        self._record, self._avgdl = _record_of(info, self.target)
        self._read_at = time.monotonic()

    def _refresh(self) -> None:
        self._check_open()
        if self._connection.local or time.monotonic() - self._read_at >= _REFRESH_SECONDS:
            self._read_record()

    def _check_open(self) -> None:
        if self._connection is None:
            raise StoreError(f"{self.location}: the store is closed")

    def _save_settings(self, settings: VectorSettings) -> None:
        with self._lock, _requests(self.target):
            self._check_open()
            self._client.update_collection(self.collection, metadata=settings.to_meta())
            self._read_record()

    # -- reading ---------------------------------------------------------------------------

    def _retrieve(self, ids: Sequence[str], payload, vectors=False) -> dict[str, object]:
        """``{id: point}`` of the stored ones among ``ids``."""
        found = {}
        unique = list(dict.fromkeys(ids))
        for start in range(0, len(unique), _PAGE):
            points = self._client.retrieve(
                self.collection,
                [_point_id(i) for i in unique[start : start + _PAGE]],
                with_payload=payload,
                with_vectors=vectors,
            )
            found.update((p.payload["id"], p) for p in points)
        return found

    def _scroll(self, where=None, payload=True, vectors=False) -> Iterator:
        """Every point matching ``where`` (a compiled filter; None: all)."""
        if where is NOTHING:
            return
        offset = None
        while True:
            points, offset = self._client.scroll(
                self.collection,
                scroll_filter=None if where is EVERYTHING else where,
                limit=_PAGE,
                offset=offset,
                with_payload=payload,
                with_vectors=vectors,
            )
            yield from points
            if offset is None:
                return

    def count(self) -> int:
        """The number of documents."""
        with self._lock, _requests(self.target):
            self._check_open()
            return self._client.count(self.collection, exact=True).count

    def count_matching(self, filters: dict | None = None) -> int:
        """How many documents match ``filters`` (all of them for None or ``{}``)."""
        where = compile_filter(filters)
        if where is NOTHING:
            return 0
        with self._lock, _requests(self.target):
            self._check_open()
            query = None if where is EVERYTHING else where
            return self._client.count(self.collection, count_filter=query, exact=True).count

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """The documents with these ids, None where an id is unknown."""
        with self._lock, _requests(self.target):
            self._check_open()
            found = self._retrieve(ids, ["id", "text", "title", "meta"])
        return [None if i not in found else _document(found[i].payload) for i in ids]

    def hashes(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """``{id: (text hash, meta hash)}`` of the stored ones among ``ids``."""
        with self._lock, _requests(self.target):
            self._check_open()
            found = self._retrieve(ids, ["id", "text_hash", "meta_hash"])
        return {i: (p.payload["text_hash"], p.payload["meta_hash"]) for i, p in found.items()}

    def vectors(self, ids: Sequence[str]) -> np.ndarray:
        """The stored float32 embeddings of ``ids`` (normalised, for cosine stores)."""
        ids = list(ids)
        with self._lock, _requests(self.target):
            self._check_open()
            found = self._retrieve(ids, ["id"], [DENSE])
        missing = [i for i in ids if i not in found]
        if missing:
            raise KeyError(f"{len(missing)} ids are not in the store, e.g. {missing[:3]}")
        if not ids:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.array([_dense_of(found[i]) for i in ids], dtype=np.float32)

    def vectors_for_texts(self, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """A stored, current vector per text hash the store holds (the first written)."""
        hashes = list(dict.fromkeys(hashes))
        if not hashes:
            return {}
        models = self._models
        found: dict[str, tuple[int, np.ndarray]] = {}
        with self._lock, _requests(self.target):
            self._check_open()
            for start in range(0, len(hashes), _PAGE):
                where = models.Filter(
                    must=[
                        models.FieldCondition(
                            key="text_hash",
                            match=models.MatchAny(any=hashes[start : start + _PAGE]),
                        ),
                        models.FieldCondition(key="stale", match=models.MatchValue(value=False)),
                    ]
                )
                for point in self._scroll(where, ["text_hash", "seq"], [DENSE]):
                    h, seq = point.payload["text_hash"], int(point.payload["seq"])
                    if h not in found or seq < found[h][0]:
                        found[h] = (seq, np.asarray(_dense_of(point), dtype=np.float32))
        return {h: vector for h, (_, vector) in found.items()}

    def filter_documents(self, filters: dict | None = None) -> list[Document]:
        """The documents matching ``filters``, in the order they were written (an updated
        document counts as written last)."""
        where = compile_filter(filters)
        with self._lock, _requests(self.target):
            self._check_open()
            points = list(self._scroll(where, ["id", "text", "title", "meta", "seq"]))
        points.sort(key=lambda p: int(p.payload["seq"]))
        return [_document(p.payload) for p in points]

    def ids(self) -> Iterator[str]:
        """Every document id, in id order."""
        yield from self._all_ids()

    def _all_ids(self) -> list[str]:
        with self._lock, _requests(self.target):
            self._check_open()
            return sorted(p.payload["id"] for p in self._scroll(EVERYTHING, ["id"]))

    def _ids_after(self, last: str, limit: int) -> list[str]:
        return [i for i in self._all_ids() if i > last][:limit]

    def index_meta_field(self, field: str) -> None:
        """Create Qdrant payload indexes on the typed parts of the metadata field ``field``
        (``"meta.lang"``), so that a server's filters on it look documents up (idempotent;
        local mode scans whatever is indexed)."""
        meta_field_sql(field)  # the name checked as filters check theirs
        schema = self._models.PayloadSchemaType
        key = f"fields.{field_key(field)}"
        parts = {"t": schema.KEYWORD, "s": schema.KEYWORD, "j": schema.KEYWORD}
        parts |= {"n": schema.FLOAT, "d": schema.FLOAT}
        with self._lock, _requests(self.target):
            self._check_open()
            if self._connection.local:
                return  # local mode scans: its payload indexes do nothing
            for part, kind in parts.items():
                self._client.create_payload_index(
                    self.collection, field_name=f"{key}.{part}", field_schema=kind, wait=True
                )

    # -- re-embedding ---------------------------------------------------------------------

    def _mark_stale(self) -> None:
        with self._lock, _requests(self.target):
            self._check_open()
            self._client.set_payload(
                self.collection,
                payload={"stale": True},
                points=self._models.FilterSelector(filter=self._models.Filter()),
                wait=True,
            )

    def _stale(self, ids: list[str] | None) -> list[str]:
        models = self._models
        stale = models.FieldCondition(key="stale", match=models.MatchValue(value=True))
        with self._lock, _requests(self.target):
            self._check_open()
            if ids is None:
                points = list(self._scroll(models.Filter(must=[stale]), ["id", "seq"]))
            else:
                found = self._retrieve(ids, ["id", "seq", "stale"])
                points = [p for p in found.values() if p.payload.get("stale")]
        points.sort(key=lambda p: int(p.payload["seq"]))
        return [p.payload["id"] for p in points]

    # -- writing ---------------------------------------------------------------------------

    def _next_seqs(self, n: int) -> list[int]:
        """``n`` write-order keys, strictly increasing for this store object (see the
        module docstring)."""
        start = max(time.time_ns() // 1000, self._last_micros + 1)
        self._last_micros = start + n - 1
        return [(start + i) * 1024 + self._tag for i in range(n)]

    def _bm25_average(self, counted: list[tuple[Counter, int]]) -> float | None:
        """The average document length BM25 weights are made with: the collection's, or,
        for its first documents with tokens, theirs (recorded for every later write)."""
        if self._avgdl is None:
            self._read_record()  # another writer may have fixed it meanwhile
        if self._avgdl is None:
            lengths = [length for _, length in counted]
            if sum(lengths) == 0:
                return None  # no token yet: every vector is empty whatever the average
            average = float(np.mean(lengths))
            self._client.update_collection(self.collection, metadata={AVGDL_KEY: repr(average)})
            self._avgdl = average
        return self._avgdl

    def _upsert(self, rows: list[StoredRow], vectors: np.ndarray) -> set[str]:
        models = self._models
        if self.vector_kind == "float16":
            vectors = vectors.astype(np.float16).astype(np.float32)
        counted = _token_counts([row.document.text for row in rows])
        with self._lock, _requests(self.target):
            self._check_open()
            existed = set(self._retrieve([r.document.id for r in rows], ["id"]))
            avgdl = self._bm25_average(counted)
            seqs = self._next_seqs(len(rows))
            points = []
            for row, vector, (counts, length), seq in zip(
                rows, vectors, counted, seqs, strict=True
            ):
                doc = row.document
                meta = _stored_meta(doc.meta)
                sparse = (
                    models.SparseVector(indices=[], values=[])
                    if not counts
                    else _bm25_vector(counts, length, avgdl, models)
                )
                payload = {
                    "id": doc.id,
                    "text": doc.text,
                    "title": doc.title or "",
                    "meta": meta,
                    "fields": _typed_payload(doc.id, doc.text, doc.title or "", meta),
                    "text_hash": row.text_hash,
                    "meta_hash": row.meta_hash,
                    "stale": False,
                    "seq": seq,
                }
                points.append(
                    models.PointStruct(
                        id=_point_id(doc.id),
                        vector={DENSE: vector.tolist(), SPARSE: sparse},
                        payload=payload,
                    )
                )
            for start in range(0, len(points), _UPSERT_BATCH):
                self._client.upsert(
                    self.collection, points[start : start + _UPSERT_BATCH], wait=True
                )
        return existed

    def write_metadata(self, documents: Sequence[Document]) -> int:
        """Replace title and metadata of stored documents (their text and vector stay);
        returns how many were stored."""
        checked_documents(documents)
        models = self._models
        documents = list(documents)
        with self._lock, _requests(self.target):
            self._check_open()
            found = self._retrieve([d.id for d in documents], ["id", "text"])
            operations = []
            for doc in documents:
                if doc.id not in found:
                    continue
                meta = _stored_meta(doc.meta)
                text = found[doc.id].payload["text"]
                payload = {
                    "title": doc.title or "",
                    "meta": meta,
                    "fields": _typed_payload(doc.id, text, doc.title or "", meta),
                    "meta_hash": meta_hash(doc),
                }
                operations.append(
                    models.SetPayloadOperation(
                        set_payload=models.SetPayload(payload=payload, points=[_point_id(doc.id)])
                    )
                )
            for start in range(0, len(operations), _UPSERT_BATCH):
                self._client.batch_update_points(
                    self.collection, operations[start : start + _UPSERT_BATCH], wait=True
                )
        return len(operations)

    def delete(self, ids: Iterable[str]) -> int:
        """Delete documents by id; returns how many existed."""
        ids = list(dict.fromkeys(ids))
        with self._lock, _requests(self.target):
            self._check_open()
            existed = list(self._retrieve(ids, ["id"]))
            if existed:
                self._client.delete(
                    self.collection,
                    points_selector=self._models.PointIdsList(
                        points=[_point_id(i) for i in existed]
                    ),
                    wait=True,
                )
        return len(existed)

    def writer_lock(
        self, timeout: float | None = None, *, name: str | None = None, doing: str | None = None
    ) -> AbstractContextManager:
        """One writer at a time in this process (local mode: in the only process that may
        open the folder); for a server, nothing: concurrent indexers are safe, because an
        upsert is idempotent by id (see the module docstring)."""
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"lock_timeout must be >= 0 seconds (None: no limit), got {timeout!r}")
        self._check_open()
        if not self._connection.local:
            return contextlib.nullcontext()
        return _held(
            self._connection.writer_lock(name or "writer"),
            timeout,
            f"{self.location}: another thread is still {doing or 'writing to this store'} "
            f"after {timeout}s: wait for it to finish, or raise --lock-timeout",
        )

    # -- searching -------------------------------------------------------------------------

    def search(self, *args, **kwargs) -> list[list[SearchHit]]:
        with self._lock, _requests(self.target):
            self._found = {}
            try:
                return super().search(*args, **kwargs)
            finally:
                self._found = {}

    search.__doc__ = DatabaseStore.search.__doc__

    def _where(self, filters: dict):
        return compile_filter(filters)

    def _query(self, requests: list) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each request's ``(keys, scores)``; the hits' payloads kept for :meth:`_hits`."""
        ranked = []
        answers = self._client.query_batch_points(self.collection, requests) if requests else []
        for answer in answers:
            for point in answer.points:
                self._found[int(point.payload["seq"])] = point.payload
            keys, scores = _ranked_pairs(answer.points)
            ranked.append((np.array(keys, dtype=np.int64), np.array(scores, dtype=np.float64)))
        return ranked

    def _dense(self, queries: np.ndarray, k: int, where) -> list[tuple[np.ndarray, np.ndarray]]:
        if where is NOTHING:
            return [_nothing() for _ in queries]
        models = self._models
        exact = self.backend_name == "exact" and not self._connection.local  # local: always
        params = models.SearchParams(exact=True) if exact else None
        requests = [
            models.QueryRequest(
                query=query.tolist(),
                using=DENSE,
                filter=None if where is None or where is EVERYTHING else where,
                limit=k,
                params=params,
                with_payload=_SHOWN,
            )
            for query in queries
        ]
        return self._query(requests)

    def _lexical(self, texts: list[str], k: int, where) -> list[tuple[np.ndarray, np.ndarray]]:
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
                with_payload=_SHOWN,
            )
            for i in asked
        ]
        answers = dict(zip(asked, self._query(requests), strict=True))
        return [answers.get(i, _nothing()) for i in range(len(texts))]

    def _hits(self, ranked: list[tuple[np.ndarray, np.ndarray]]) -> list[list[SearchHit]]:
        results = []
        for keys, scores in ranked:
            hits = []
            for key, score in zip(keys.tolist(), np.asarray(scores).tolist(), strict=True):
                payload = self._found[key]
                hits.append(
                    SearchHit(
                        payload["id"],
                        float(score),
                        len(hits) + 1,
                        payload.get("text", ""),
                        payload.get("title", ""),
                        payload.get("meta") or {},
                    )
                )
            results.append(hits)
        return results

    # -- upkeep ----------------------------------------------------------------------------

    def info(self) -> dict:
        """A summary for humans and ``--json``: engine, collection, model, settings, counts."""
        with self._lock:
            self._refresh()
            info = super().info()
        info["collection"] = self.collection
        info["mode"] = "local" if self._connection.local else "server"
        info["bm25_avgdl"] = self._avgdl
        return info

    def close(self) -> None:
        """Let go of the client (local mode: the folder, once the process's last store on
        it closes)."""
        with self._lock:
            if self._connection is None:
                return
            connection, self._connection = self._connection, None
        connection.release()

    def __repr__(self) -> str:
        return (
            f"QdrantDocumentStore({self.location!r}, model={self.model_name!r}, dim={self.dim}, "
            f"backend={self.backend_name!r})"
        )


def _nothing() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)


def _dense_of(point) -> list[float]:
    vector = point.vector
    return vector[DENSE] if isinstance(vector, dict) else vector


def _document(payload: dict) -> Document:
    return Document(
        payload["id"], payload.get("text", ""), payload.get("title", ""), payload.get("meta") or {}
    )


@contextlib.contextmanager
def _held(lock: threading.RLock, timeout: float | None, message: str) -> Iterator[None]:
    if not lock.acquire(timeout=-1 if timeout is None else timeout):
        raise StoreLockedError(message)
    try:
        yield
    finally:
        lock.release()


def _record_of(info, target: QdrantTarget) -> tuple[StoreRecord, float | None]:
    """The record and BM25 length average of a collection, or a one-line StoreError when
    the collection is not a densefit store or its vectors do not fit its record."""
    metadata = dict(info.config.metadata or {})
    where = f"{target.location}"
    if metadata.get("layout") != LAYOUT or "format" not in metadata:
        raise StoreError(
            f"{where}: collection {target.collection!r} is not a densefit store (its metadata "
            "holds no densefit record): pick another collection name, or delete this one "
            "if it is yours"
        )
    record = StoreRecord.from_meta({k: str(v) for k, v in metadata.items()}, where)
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
    avgdl = metadata.get(AVGDL_KEY)
    return record, None if avgdl is None else float(avgdl)


# -- the engine's functions (densefit.retrieval.index.engines) ---------------------------------


def _checked_backend(backend) -> str | None:
    if backend is None:
        return None
    if callable(backend):
        raise StoreError(
            "the Qdrant engine searches with Qdrant's own index: pass backend='hnsw' or "
            "'exact', not a backend factory"
        )
    require(CAPABILITIES, "backends", f"search by {backend!r}", str(backend))
    return str(backend)


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


def open_existing(
    target: str,
    *,
    backend=None,
    rescore: int | None = None,
    lock_timeout: float | None = None,
) -> QdrantDocumentStore | None:
    """The densefit store in ``target``'s collection; None when there is no such collection
    (local mode: nothing is created then); a one-line StoreError when the server cannot be
    used or the collection is not densefit's. ``rescore`` is for int8 and binary vectors,
    which this engine does not store; ``lock_timeout`` has nothing to wait for."""
    parsed = parse_target(target)
    backend = _checked_backend(backend)
    if parsed.local and not _local_state(parsed):
        return None
    connection = _connect(parsed)
    try:
        with _requests(parsed):
            exists = connection.client.collection_exists(parsed.collection)
        if not exists:
            connection.release()
            return None
        return QdrantDocumentStore(parsed, connection, backend=backend)
    except BaseException:
        connection.release()
        raise


def create(
    target: str,
    record: StoreRecord,
    *,
    backend=None,
    rescore: int | None = None,
    lock_timeout: float | None = None,
) -> QdrantDocumentStore:
    """A new collection for ``record``'s vectors at ``target`` (its record the collection's
    metadata, written in the same call); when another process created it meanwhile, that
    one opened."""
    parsed = parse_target(target)
    backend = _checked_backend(backend)
    if record.similarity not in SIMILARITIES:
        raise StoreError(
            f"{parsed.location}: similarity {record.similarity!r} is not supported: the store "
            f"searches by inner product, which serves {' and '.join(SIMILARITIES)} models"
        )
    require(
        CAPABILITIES,
        "vector_kinds",
        f"store {record.vector_kind} vectors",
        record.vector_kind,
        parsed.location,
    )
    if parsed.local:
        _local_state(parsed)
    models = _models()
    connection = _connect(parsed)
    try:
        with _requests(parsed):
            client = connection.client
            if not client.collection_exists(parsed.collection):
                _create_collection(client, parsed, record, models)
            return QdrantDocumentStore(parsed, connection, backend=backend)
    except BaseException:
        with contextlib.suppress(Exception):
            connection.release()
        raise


def _create_collection(client, target: QdrantTarget, record: StoreRecord, models) -> None:
    metadata = {k: v for k, v in record.to_meta().items() if k not in _RECORD_COUNTERS}
    metadata["layout"] = LAYOUT
    datatype = models.Datatype.FLOAT16 if record.vector_kind == "float16" else None
    try:
        client.create_collection(
            target.collection,
            vectors_config={
                DENSE: models.VectorParams(
                    size=record.dim, distance=models.Distance.DOT, datatype=datatype
                )
            },
            sparse_vectors_config={SPARSE: models.SparseVectorParams(modifier=models.Modifier.IDF)},
            metadata=metadata,
        )
    except Exception:
        if client.collection_exists(target.collection):
            return  # another process created it meanwhile: open that one
        raise
    if target.local:
        return  # local mode scans: its payload indexes do nothing
    schema = models.PayloadSchemaType
    for key, kind in (
        ("seq", schema.INTEGER),
        ("stale", schema.BOOL),
        ("text_hash", schema.KEYWORD),
        ("id", schema.KEYWORD),
    ):
        client.create_payload_index(target.collection, field_name=key, field_schema=kind, wait=True)
