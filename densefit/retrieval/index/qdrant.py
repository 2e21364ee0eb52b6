"""Qdrant: densefit's documents and vectors in a Qdrant collection, through qdrant-client.

Targets (:func:`~densefit.retrieval.index.engines.open_store`):

- ``qdrant://HOST:PORT/COLLECTION``: a Qdrant server or cluster (port 6333 when left out;
  ``?https=true`` for TLS; the API key, if any, from the environment variable
  ``QDRANT_API_KEY``, so that it never appears in a target, a log or a message);
- ``qdrant:FOLDER`` (or ``qdrant:///abs/folder``): qdrant-client's local mode, the collection
  kept in files in ``FOLDER`` and searched in this process; the collection is named
  ``densefit`` unless ``qdrant:FOLDER?collection=NAME``.

Collection names are 1 to 64 letters, digits, ``_`` and ``-``. The store's name is an
alias of the collection that holds it, ``NAME_g<N>`` (``NAME_g0`` when created, ``NAME_g<N+1>``
after a model swap, see below): a point per document (its id the ``uuid5`` of the document
id) with a named dense vector ``dense`` (the record's dimension, dot product: cosine stores
hold unit vectors; float16 stores ask Qdrant for float16 storage and send values already
rounded to float16), a sparse vector ``bm25`` and a payload: ``id``, ``text``, ``title``,
``meta`` (as the embedded store keeps it: JSON, values JSON cannot hold written as text),
``fields`` (every filterable field split by type, :func:`~densefit.retrieval.index.filters.
typed_fields`, under a key :func:`field_key` spells with ``[A-Za-z0-9_]`` only, so that
Qdrant's payload paths address any field name), ``text_hash``, ``meta_hash``, ``stale`` and
``seq`` (the write order: each writer gives every document it writes ``microseconds * 1024 +
tag``, the time strictly increasing per writer and ``tag`` a random 10-bit number per store
object, so concurrent writers interleave by time and almost never collide). The model record
(:class:`~densefit.retrieval.index.types.StoreRecord`) is the collection's metadata,
written with the collection in one call, with the store's name (``store``), its model
generation (``model_generation``) and the model swap under way (``swap``), and read again
before a search (on a server at most once a second): :meth:`~densefit.retrieval.index.common.
StoreCommon.check_model` refuses another model as the embedded store does.

Filters (parsed once, :mod:`~densefit.retrieval.index.filters`) are emitted by
:func:`compile_filter` as one ``qdrant_client.models.Filter`` over the typed fields, with the embedded store's semantics exactly (a missing field is None, ``!=``
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
updated and deleted vectors itself (no compaction).

Model swaps (``densefit reembed``): :class:`~densefit.retrieval.index.swap.SwapCoordinator`'s
steps, blue/green through the alias. The next generation is the collection ``NAME_g<N+1>``
(the new model's record, ``swap_of`` the serving collection, its BM25 average length), the
swap under way is recorded in the serving collection's metadata, and a copy of a document
there (payload, BM25 vector, the new model's vector) counts only while its ``seq`` and
``meta_hash`` are the document's in the serving collection, that is while it was made from
its current text and metadata (a row of the swap is a ``seq``). Writes during the swap reach
the next collection too, with the new model's vectors or, without them, by leaving it (the
swap embeds their new text); deletes and metadata updates apply to both. The switch records
``model_generation + 1`` in the next collection, points the alias at it (one request: delete
and create alias, applied together) and drops the old collection; BM25 scores do not change
(the same sparse vectors and average length). A process killed between a switch and the drop
leaves the old collection, dropped at the next swap (local mode: when the folder is next
opened); killed between creating a collection and its alias, the alias is made when the store
is next opened.

A store created before generations (a plain collection named ``NAME``, no alias) opens and
works as generation 0; its first model swap migrates it: at the switch the plain collection is
deleted and ``NAME`` becomes an alias of ``NAME_g1``, in two requests (Qdrant refuses an alias
named like a collection), so for the moment between them a server has no collection ``NAME``
(its other clients' requests fail; local mode does both under the process's lock, and a process
killed between them leaves ``NAME_g1`` finished, aliased when the folder is next opened).

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

What a server adds to model swaps (not run here): the alias switch is atomic for every
client of the cluster (local mode: for the one process that may open the folder, whose calls a
lock serialises), so servers behind a load balancer all move to the new model at once. There
is no lock across processes, so run one ``densefit reembed`` per store at a time; a write or
delete by a process whose view of the swap is up to a second old (the record is re-read at most
once a second for searches; before every write) may miss the next collection, and the swap
still gets it right: a stale copy is recognised by its ``seq`` or ``meta_hash`` and embedded
again, and copies of deleted documents are dropped at the switch. Another process's switch is
seen at the next read of the record: a search in the second before it is checked against the
old model's record (searches that pass ``model_generation`` are refused as soon as it is
read). ``swap_pending`` scrolls by ``seq``, which needs the payload index on ``seq`` that
every collection gets on a server.

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
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from densefit.choices import SIMILARITIES
from densefit.data.types import Document
from densefit.errors import storage_fault
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
from densefit.retrieval.index.swap import (
    MODEL_GENERATION_KEY,
    SWAP_KEY,
    SwapCoordinator,
)
from densefit.retrieval.index.types import (
    StoreError,
    StoreRecord,
    SwapTarget,
    VectorSettings,
)

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

CAPABILITIES = capabilities_of("qdrant")  # declared in its registry row

DENSE = "dense"  # the named dense vector
SPARSE = "bm25"  # the named sparse vector
DEFAULT_COLLECTION = "densefit"
DEFAULT_PORT = 6333
API_KEY_VARIABLE = "QDRANT_API_KEY"
LAYOUT = "densefit-qdrant/1"  # metadata key "layout": the payload layout above
AVGDL_KEY = "bm25_avgdl"  # metadata: the average document length BM25 weights are made with
STORE_KEY = "store"  # metadata of a generation collection: the store (alias) it belongs to
BUILDING_KEY = "swap_of"  # metadata of a collection a swap is filling: the one it replaces
_RECORD_COUNTERS = ("n_rows", "generation", "stale_below_row")  # the embedded store's only
_NAMESPACE = uuid.UUID("6f0b5e1c-3d0a-5a43-9a1e-2f4e0d9c7b11")  # point ids: uuid5(this, id)
_UPSERT_BATCH = 128  # points per upsert request
_PAGE = 1000  # points per scroll request
_SWAP_PAGE = 256  # points per scroll request of swap_pending, at least
_VERSION = ["id", "seq", "meta_hash"]  # the payload that tells a current copy (_version)
_REFRESH_SECONDS = 1.0  # a server's record is read again at most this often
_SHOWN = ["id", "text", "title", "meta", "seq"]  # the payload a search hit needs


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


def _version(point) -> tuple[int, str]:
    """What a copy in the next generation must share with the document: its write (``seq``)
    and its title and metadata (``meta_hash``)."""
    return int(point.payload["seq"]), point.payload.get("meta_hash", "")


def _document_of(payload: dict) -> tuple[str, str, str, dict]:
    """``(id, text, title, meta)`` of a point's payload."""
    meta = payload.get("meta") or {}
    return payload["id"], payload.get("text", ""), payload.get("title", ""), meta


def _ranked_pairs(points) -> tuple[list[int], list[float]]:
    """Keys (``seq``) and scores, best first, ties by write order (as the embedded store)."""
    pairs = sorted((-float(p.score), int(p.payload["seq"])) for p in points)
    return [seq for _, seq in pairs], [-score for score, _ in pairs]


class QdrantDocumentStore(SwapCoordinator, DatabaseStore):
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
        self._faults = _faults(target)
        self.location = target.location
        self.collection = target.collection
        self._connection: _Connection | None = connection
        self._client = connection.client
        if connection.local:
            self._lock = connection.lock  # one call at a time on local mode's client
            self.capabilities = dataclasses.replace(
                CAPABILITIES, shared=False, filter_max_conditions=LOCAL_FILTER_MAX_CONDITIONS
            )
        self.backend_name = backend or CAPABILITIES.backends[0]
        self._models = _models()
        self._record_seconds = 0.0 if connection.local else _REFRESH_SECONDS
        self._avgdl: float | None = None
        self._tag = secrets.randbelow(1024)
        self._last_micros = 0
        self.model_generation = -1  # read from the metadata below
        with self._lock:
            self._read_record()
            if connection.local:  # the folder is this process's: nobody else reads them
                with self._errors():
                    self._drop_older_generations()

    # -- the record ------------------------------------------------------------------------

    def _read_record(self) -> None:
        """Read the record, the BM25 length average, the model generation and the swap
        under way from the serving collection's metadata."""
        with self._errors():
            info = self._client.get_collection(self.collection)
        meta = _record_of(info, self.target)
        self._take_record(meta)
        self._avgdl = None if AVGDL_KEY not in meta else float(meta[AVGDL_KEY])

    def _check_open(self) -> None:
        if self._connection is None:
            raise StoreError(f"{self.location}: the store is closed")

    def _save_settings(self, settings: VectorSettings) -> None:
        with self._reading():
            self._client.update_collection(self.collection, metadata=settings.to_meta())
            self._read_record()

    # -- reading ---------------------------------------------------------------------------

    def _retrieve(
        self, ids: Sequence[str], payload, vectors=False, *, collection: str | None = None
    ) -> dict[str, object]:
        """``{id: point}`` of the stored ones among ``ids`` (in the store, or ``collection``)."""
        found = {}
        unique = list(dict.fromkeys(ids))
        for start in range(0, len(unique), _PAGE):
            points = self._client.retrieve(
                collection or self.collection,
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
        with self._reading():
            return self._client.count(self.collection, exact=True).count

    def count_matching(self, filters: Filter | dict | None = None) -> int:
        """How many documents match ``filters`` (all of them for None or ``{}``)."""
        where = compile_filter(parse_filters(filters, self.capabilities))
        if where is NOTHING:
            return 0
        with self._reading():
            query = None if where is EVERYTHING else where
            return self._client.count(self.collection, count_filter=query, exact=True).count

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """The documents with these ids, None where an id is unknown."""
        with self._reading():
            found = self._retrieve(ids, ["id", "text", "title", "meta"])
        return [None if i not in found else _document(found[i].payload) for i in ids]

    def hashes(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """``{id: (text hash, meta hash)}`` of the stored ones among ``ids``."""
        with self._reading():
            found = self._retrieve(ids, ["id", "text_hash", "meta_hash"])
        return {i: (p.payload["text_hash"], p.payload["meta_hash"]) for i, p in found.items()}

    def vectors(self, ids: Sequence[str]) -> np.ndarray:
        """The stored float32 embeddings of ``ids`` (normalised, for cosine stores)."""
        ids = list(ids)
        with self._reading():
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
        with self._reading():
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

    def filter_documents(self, filters: Filter | dict | None = None) -> list[Document]:
        """The documents matching ``filters``, in the order they were written (an updated
        document counts as written last)."""
        where = compile_filter(parse_filters(filters, self.capabilities))
        with self._reading():
            points = list(self._scroll(where, ["id", "text", "title", "meta", "seq"]))
        points.sort(key=lambda p: int(p.payload["seq"]))
        return [_document(p.payload) for p in points]

    def ids(self) -> Iterator[str]:
        """Every document id, in id order."""
        yield from self._all_ids()

    def _all_ids(self) -> list[str]:
        with self._reading():
            return sorted(p.payload["id"] for p in self._scroll(EVERYTHING, ["id"]))

    def _ids_after(self, last: str, limit: int) -> list[str]:
        return [i for i in self._all_ids() if i > last][:limit]

    def index_meta_field(self, field: str) -> None:
        """Create Qdrant payload indexes on the typed parts of the metadata field ``field``
        (``"meta.lang"``), so that a server's filters on it look documents up (idempotent;
        local mode scans whatever is indexed)."""
        meta_path(field)  # the name checked as filters check theirs
        schema = self._models.PayloadSchemaType
        key = f"fields.{field_key(field)}"
        parts = {"t": schema.KEYWORD, "s": schema.KEYWORD, "j": schema.KEYWORD}
        parts |= {"n": schema.FLOAT, "d": schema.FLOAT}
        with self._reading():
            if self._connection.local:
                return  # local mode scans: its payload indexes do nothing
            for part, kind in parts.items():
                self._client.create_payload_index(
                    self.collection, field_name=f"{key}.{part}", field_schema=kind, wait=True
                )

    # -- re-embedding ---------------------------------------------------------------------

    def _mark_stale(self) -> None:
        with self._reading():
            self._client.set_payload(
                self.collection,
                payload={"stale": True},
                points=self._models.FilterSelector(filter=self._models.Filter()),
                wait=True,
            )

    def _stale(self, ids: list[str] | None) -> list[str]:
        models = self._models
        stale = models.FieldCondition(key="stale", match=models.MatchValue(value=True))
        with self._reading():
            if ids is None:
                points = list(self._scroll(models.Filter(must=[stale]), ["id", "seq"]))
            else:
                found = self._retrieve(ids, ["id", "seq", "stale"])
                points = [p for p in found.values() if p.payload.get("stale")]
        points.sort(key=lambda p: int(p.payload["seq"]))
        return [p.payload["id"] for p in points]

    # -- a model swap: the next generation collection ---------------------------------------
    # SwapCoordinator (densefit.retrieval.index.swap) runs the swap over these primitives (see
    # the module docstring): the next generation is a collection beside the serving one, and
    # the switch points the store's alias at it.

    @contextlib.contextmanager
    def _swap_transaction(self) -> Iterator[None]:
        """A write's or a swap step's context: the object's lock and the record read again
        (no transaction: each step is ordered to be safe when killed)."""
        with self._reading():
            self._read_record()
            yield None

    def _save_swap(self, tx, swap: SwapTarget | None) -> None:
        recorded = None if swap is None else swap.to_json()
        self._client.update_collection(self.collection, metadata={SWAP_KEY: recorded})

    def _create_generation(self, tx, record: StoreRecord, generation: int | None) -> int:
        serving = self._serving()
        self._drop_older_generations(serving)
        fresh = generation is None
        if fresh:
            generation = _generation_of(self.collection, serving, self.location) + 1
        collection = generation_collection(self.collection, generation)
        exists = self._client.collection_exists(collection)
        if exists and fresh:  # a swap cancelled or restarted
            metadata = self._client.get_collection(collection).config.metadata or {}
            if metadata.get(STORE_KEY) != self.collection:
                raise StoreError(
                    f"{self.location}: collection {collection!r} exists and is not this "
                    "store's: the next model swap creates it; delete or rename it"
                )
            self._client.delete_collection(collection)
        if fresh or not exists:  # resumed: made again, empty, when dropped by hand
            self._create_next(collection, record, serving)
        return generation

    def _drop_generation(self, tx, swap: SwapTarget) -> None:
        collection = self._next_collection(swap)
        if self._client.collection_exists(collection):
            self._client.delete_collection(collection)

    def _pending_rows(self, swap: SwapTarget, after_row: int, limit: int) -> list:
        """Those without a copy in the next generation made from their current version (a
        copy whose ``seq`` or ``meta_hash`` is not the document's was made from an older
        text or metadata); a row is a document's ``seq``."""
        models = self._models
        collection = self._next_collection(swap)
        pending: list[tuple[int, str, str]] = []
        start = after_row + 1
        with self._errors():
            while len(pending) < limit:
                points, _ = self._client.scroll(
                    self.collection,
                    order_by=models.OrderBy(key="seq", start_from=start),
                    limit=max(limit, _SWAP_PAGE),
                    with_payload=[*_VERSION, "text"],
                )
                if not points:
                    break
                ids = [p.payload["id"] for p in points]
                made = self._retrieve(ids, _VERSION, collection=collection)
                for point in points:
                    copy = made.get(point.payload["id"])
                    if copy is None or _version(copy) != _version(point):
                        seq = int(point.payload["seq"])
                        pending.append((seq, point.payload["id"], point.payload.get("text", "")))
                start = int(points[-1].payload["seq"]) + 1
        return pending[:limit]

    def _count_pending(self, swap: SwapTarget) -> int:
        with self._errors():
            made = self._versions(self._next_collection(swap))
            current = self._versions(self.collection)
        return sum(made.get(i) != v for i, v in current.items())

    def _put_next(self, tx, swap: SwapTarget, pending: list, vectors: np.ndarray) -> int:
        """Copies with each document's payload and BM25 vector as the serving collection
        holds them now."""
        models = self._models
        current = self._retrieve([i for _, i in pending], True, [SPARSE])
        keep = [
            k
            for k, (row, doc_id) in enumerate(pending)
            if doc_id in current and int(current[doc_id].payload["seq"]) == row
        ]
        empty = models.SparseVector(indices=[], values=[])
        copies = []
        for k, vector in zip(keep, self._stored(vectors[keep]), strict=True):
            point = current[pending[k][1]]
            sparse = point.vector.get(SPARSE, empty) if point.vector else empty
            copies.append(
                models.PointStruct(
                    id=point.id,
                    vector={DENSE: vector.tolist(), SPARSE: sparse},
                    payload={**point.payload, "stale": False},
                )
            )
        self._upsert_points(self._next_collection(swap), copies)
        return len(copies)

    def _switch(self, tx, swap: SwapTarget) -> None:
        """The next collection's copies of deleted documents dropped, the model generation
        recorded in it, then the alias pointed at it in one request (a store made before
        aliases: two, see the module docstring) and the old collection dropped."""
        collection = self._next_collection(swap)
        current = self._versions(self.collection)
        self._delete_points(collection, [i for i in self._versions(collection) if i not in current])
        finished = {MODEL_GENERATION_KEY: str(self.model_generation + 1), BUILDING_KEY: None}
        if self._avgdl is not None:
            finished[AVGDL_KEY] = repr(self._avgdl)
        self._client.update_collection(collection, metadata=finished)
        serving = self._serving()
        if serving == self.collection:  # a plain collection, made before model swaps
            self._client.delete_collection(serving)  # the name becomes the alias
            self._client.update_collection_aliases(
                _alias_operations(self.collection, collection, self._models, replace=False)
            )
        else:
            self._client.update_collection_aliases(
                _alias_operations(self.collection, collection, self._models, replace=True)
            )
            self._client.delete_collection(serving)

    def _swap_changed(self) -> None:
        with self._lock:
            self._read_record()

    def _next_collection(self, swap: SwapTarget) -> str:
        return generation_collection(self.collection, swap.generation)

    def _serving(self) -> str:
        serving = _serving(self._client, self.collection)
        if serving is None:
            raise StoreError(
                f"{self.location}: collection {self.collection!r} is gone (deleted by another "
                "process?): index into it again"
            )
        return serving

    def _create_next(self, collection: str, record: StoreRecord, serving: str) -> None:
        """A swap's empty ``collection``: the new model's ``record``, the BM25 length average
        of the serving collection, and (on a server) its payload indexes."""
        extra = {BUILDING_KEY: serving}
        if self._avgdl is not None:
            extra[AVGDL_KEY] = repr(self._avgdl)
        indexes = {}
        if not self._connection.local:
            schema = self._client.get_collection(serving).payload_schema or {}
            indexes = {field: info.data_type for field, info in schema.items()}
        _new_collection(self._client, self.target, collection, record, self._models, extra, indexes)

    def _versions(self, collection: str) -> dict[str, tuple[int, str]]:
        """``{id: (seq, meta hash)}`` of every point in ``collection``."""
        offset, versions = None, {}
        while True:
            points, offset = self._client.scroll(
                collection, limit=_PAGE, offset=offset, with_payload=_VERSION
            )
            versions.update((p.payload["id"], _version(p)) for p in points)
            if offset is None:
                return versions

    def _drop_older_generations(self, serving: str | None = None) -> None:
        """Delete the store's generation collections older than the serving one (left by a
        process killed between a switch and the drop)."""
        serving = serving or self._serving()
        if serving == self.collection:
            return
        current = _generation_of(self.collection, serving, self.location)
        for number in _generations(self._client, self.collection):
            if number < current:
                self._client.delete_collection(generation_collection(self.collection, number))

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

    def _stored(self, vectors: np.ndarray) -> np.ndarray:
        """``vectors`` as the collection keeps them (float16 stores: rounded to float16)."""
        if self.vector_kind == "float16":
            return vectors.astype(np.float16).astype(np.float32)
        return vectors

    def _upsert(
        self, tx, rows: list[StoredRow], vectors: np.ndarray, next_vectors: np.ndarray | None
    ) -> set[str]:
        """During a model swap the rows also go to the next generation, with ``next_vectors``
        (the new model's), or leave it when there are none."""
        models = self._models
        vectors = self._stored(vectors)
        counted = _token_counts([row.document.text for row in rows])
        existed = set(self._retrieve([r.document.id for r in rows], ["id"]))
        avgdl = self._bm25_average(counted)
        seqs = self._next_seqs(len(rows))
        points = []
        for row, vector, (counts, length), seq in zip(rows, vectors, counted, seqs, strict=True):
            doc = row.document
            meta = _stored_meta(doc.meta)
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
            vector = {DENSE: vector.tolist(), SPARSE: _sparse_vector(counts, length, avgdl)}
            points.append(models.PointStruct(id=_point_id(doc.id), vector=vector, payload=payload))
        self._upsert_points(self.collection, points)
        if self._swap is not None:
            self._write_next(self._swap, points, next_vectors)
        return existed

    def _upsert_points(self, collection: str, points: list) -> None:
        for start in range(0, len(points), _UPSERT_BATCH):
            self._client.upsert(collection, points[start : start + _UPSERT_BATCH], wait=True)

    def _write_next(self, swap: SwapTarget, points: list, next_vectors: np.ndarray | None) -> None:
        """The written ``points`` in the next generation: with ``next_vectors`` (same
        payload, ``seq`` included, and BM25 vector), or removed from it."""
        collection = self._next_collection(swap)
        if next_vectors is None:
            self._delete_points(collection, [p.payload["id"] for p in points])
            return
        models = self._models
        next_vectors = self._stored(next_vectors)
        copies = [
            models.PointStruct(
                id=p.id, vector={DENSE: v.tolist(), SPARSE: p.vector[SPARSE]}, payload=p.payload
            )
            for p, v in zip(points, next_vectors, strict=True)
        ]
        self._upsert_points(collection, copies)

    def _delete_points(self, collection: str, ids: list[str]) -> None:
        if ids:
            self._client.delete(
                collection,
                points_selector=self._models.PointIdsList(points=[_point_id(i) for i in ids]),
                wait=True,
            )

    def _set_metadata(self, tx, documents: list[Document]) -> int:
        models = self._models
        found = self._retrieve([d.id for d in documents], ["id", "text"])
        operations = {}
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
            operations[doc.id] = models.SetPayloadOperation(
                set_payload=models.SetPayload(payload=payload, points=[_point_id(doc.id)])
            )
        self._update_points(self.collection, list(operations.values()))
        if self._swap is not None and operations:
            collection = self._next_collection(self._swap)
            copied = self._retrieve(list(operations), ["id"], collection=collection)
            self._update_points(collection, [operations[i] for i in copied])
        return len(operations)

    def _update_points(self, collection: str, operations: list) -> None:
        for start in range(0, len(operations), _UPSERT_BATCH):
            self._client.batch_update_points(
                collection, operations[start : start + _UPSERT_BATCH], wait=True
            )

    def _remove(self, tx, ids: list[str]) -> int:
        existed = list(self._retrieve(ids, ["id"]))
        self._delete_points(self.collection, existed)
        if self._swap is not None:
            self._delete_points(self._next_collection(self._swap), ids)
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

    def _where(self, filters: Filter):
        return compile_filter(filters)

    def _query(self, requests: list) -> list[Ranked]:
        """Each request's ranking, with the documents of its points (their payloads)."""
        ranked = []
        answers = self._client.query_batch_points(self.collection, requests) if requests else []
        for answer in answers:
            keys, scores = _ranked_pairs(answer.points)
            documents = {int(p.payload["seq"]): _document_of(p.payload) for p in answer.points}
            ranked.append(Ranked(np.array(keys, np.int64), np.array(scores, np.float64), documents))
        return ranked

    def _dense(self, queries: np.ndarray, k: int, where) -> list[Ranked]:
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
                with_payload=_SHOWN,
            )
            for i in asked
        ]
        answers = dict(zip(asked, self._query(requests), strict=True))
        return [answers.get(i, _nothing()) for i in range(len(texts))]

    # -- upkeep ----------------------------------------------------------------------------

    def _info_extra(self) -> dict:
        return {
            "collection": self.collection,
            "serving_collection": self._serving(),
            "mode": "local" if self._connection.local else "server",
            "bm25_avgdl": self._avgdl,
        }

    def close(self) -> None:
        """Let go of the client (local mode: the folder, once the process's last store on
        it closes)."""
        with self._lock:
            if self._connection is None:
                return
            connection, self._connection = self._connection, None
        connection.release()

    def drop(self) -> None:
        """Delete the store: its alias, every generation's collection (and the plain
        collection of a store made before generations); the store is closed after."""
        with self._lock, self._errors():
            name = self.collection
            if any(a.alias_name == name for a in self._client.get_aliases().aliases):
                self._client.update_collection_aliases(
                    [
                        self._models.DeleteAliasOperation(
                            delete_alias=self._models.DeleteAlias(alias_name=name)
                        )
                    ]
                )
            for number in _generations(self._client, name):
                self._client.delete_collection(generation_collection(name, number))
            if self._client.collection_exists(name):
                self._client.delete_collection(name)
        self.close()

    def __repr__(self) -> str:
        return (
            f"QdrantDocumentStore({self.location!r}, model={self.model_name!r}, dim={self.dim}, "
            f"backend={self.backend_name!r})"
        )


def _nothing() -> Ranked:
    return Ranked(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64))


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


# -- generations: the collections behind a store's alias -------------------------------------


def generation_collection(name: str, generation: int) -> str:
    """The collection holding generation ``generation`` of the store ``name`` (its alias).

    >>> generation_collection("docs", 2)
    'docs_g2'
    """
    return f"{name}_g{generation}"


def _generation_of(name: str, collection: str, location: str) -> int:
    """The generation number of ``collection`` in the store ``name``: 0 for a plain
    collection named ``name`` (a store made before model swaps)."""
    if collection == name:
        return 0
    number = collection.removeprefix(f"{name}_g")
    if collection.startswith(f"{name}_g") and number.isdigit():
        return int(number)
    raise StoreError(
        f"{location}: the alias {name!r} points at collection {collection!r}, not at one of "
        f"its generations ({name}_g<N>): point it back at the store's collection"
    )


def _serving(client, name: str) -> str | None:
    """The collection the store ``name`` reads: its alias's, the plain collection ``name``
    (a store made before model swaps), or None when neither exists."""
    for alias in client.get_aliases().aliases:
        if alias.alias_name == name:
            return alias.collection_name
    return name if client.collection_exists(name) else None


def _generations(client, name: str) -> dict[int, dict]:
    """``{generation: metadata}`` of the collections named ``name_g<N>`` that densefit made
    for the store ``name``."""
    found = {}
    prefix = f"{name}_g"
    for description in client.get_collections().collections:
        number = description.name.removeprefix(prefix)
        if description.name.startswith(prefix) and number.isdigit():
            metadata = client.get_collection(description.name).config.metadata or {}
            if metadata.get("layout") == LAYOUT and metadata.get(STORE_KEY) == name:
                found[int(number)] = metadata
    return found


def _alias_operations(name: str, collection: str, models, *, replace: bool) -> list:
    """The alias changes that point ``name`` at ``collection`` (one request: atomic)."""
    operations = []
    if replace:
        operations.append(
            models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=name))
        )
    operations.append(
        models.CreateAliasOperation(
            create_alias=models.CreateAlias(collection_name=collection, alias_name=name)
        )
    )
    return operations


def _recover_alias(client, target: QdrantTarget, models) -> bool:
    """Point the store's missing alias at its newest finished generation, if it has one (a
    process killed between creating a collection and its alias); whether it did."""
    finished = {
        number: metadata
        for number, metadata in _generations(client, target.collection).items()
        if not metadata.get(BUILDING_KEY)
    }
    if not finished:
        return False
    newest = generation_collection(target.collection, max(finished))
    try:
        client.update_collection_aliases(
            _alias_operations(target.collection, newest, models, replace=False)
        )
    except Exception:
        if not client.collection_exists(target.collection):  # not another process's alias
            raise
    return True


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
        with connection.lock, _requests(parsed):
            client = connection.client
            exists = client.collection_exists(parsed.collection) or _recover_alias(
                client, parsed, _models()
            )
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
        with connection.lock, _requests(parsed):
            client = connection.client
            if not client.collection_exists(parsed.collection) and not _recover_alias(
                client, parsed, models
            ):
                _create_store(client, parsed, record, models)
            return QdrantDocumentStore(parsed, connection, backend=backend)
    except BaseException:
        with contextlib.suppress(Exception):
            connection.release()
        raise


def _create_store(client, target: QdrantTarget, record: StoreRecord, models) -> None:
    """The store's first generation collection and its alias, the store's name; when
    another process created them meanwhile, theirs kept."""
    first = generation_collection(target.collection, 0)
    _new_collection(client, target, first, record, models, {MODEL_GENERATION_KEY: "0"})
    try:
        client.update_collection_aliases(
            _alias_operations(target.collection, first, models, replace=False)
        )
    except Exception:
        if not client.collection_exists(target.collection):
            raise


def _new_collection(
    client,
    target: QdrantTarget,
    collection: str,
    record: StoreRecord,
    models,
    extra: dict,
    indexes: dict | None = None,
) -> None:
    """Create ``collection`` for ``record``'s vectors, its metadata the record, the layout,
    the store it belongs to and ``extra``; a server's also gets the payload indexes
    densefit filters by and ``indexes`` (``{field: schema}``). One created meanwhile by
    another process is kept."""
    metadata = {k: v for k, v in record.to_meta().items() if k not in _RECORD_COUNTERS}
    metadata |= {"layout": LAYOUT, STORE_KEY: target.collection, **extra}
    datatype = models.Datatype.FLOAT16 if record.vector_kind == "float16" else None
    try:
        client.create_collection(
            collection,
            vectors_config={
                DENSE: models.VectorParams(
                    size=record.dim, distance=models.Distance.DOT, datatype=datatype
                )
            },
            sparse_vectors_config={SPARSE: models.SparseVectorParams(modifier=models.Modifier.IDF)},
            metadata=metadata,
        )
    except Exception:
        if client.collection_exists(collection):
            return  # another process created it meanwhile: use that one
        raise
    if target.local:
        return  # local mode scans: its payload indexes do nothing
    schema = models.PayloadSchemaType
    fields = {
        "seq": schema.INTEGER,
        "stale": schema.BOOL,
        "text_hash": schema.KEYWORD,
        "id": schema.KEYWORD,
    }
    for key, kind in (fields | (indexes or {})).items():
        client.create_payload_index(collection, field_name=key, field_schema=kind, wait=True)
