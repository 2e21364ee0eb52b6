"""Milvus: densefit's documents and vectors in a Milvus collection, through pymilvus.

Targets: ``milvus://HOST:PORT/COLLECTION``, a Milvus server or cluster (port 19530 by
default, ``?https=true`` for TLS, ``?timeout=SECONDS`` for connecting and for each call (10
when left out; loading or indexing a collection gets 12 times that), the token
(``USER:PASSWORD`` or an API key) from the environment variable ``MILVUS_TOKEN``, never from
the target); ``milvus:FILE.db``, Milvus Lite: collections kept in ``FILE.db`` and served by an
in-process server that stops when the process's last store on the file closes
(``?collection=NAME``; default ``densefit``).

Collections, rows, write order, model swaps and opening are :mod:`~densefit.retrieval.index.
aliased`'s. Here a collection is strongly consistent, its properties the metadata; a row adds
``dense`` (float32, inner product), ``tokens`` (bm25s's tokens) and ``sparse`` (Milvus's BM25
function of ``tokens``, with bm25s's ``k1`` and ``b``; Milvus Lite's ``standard`` analyzer keeps
the tokens whole, a server gets ``whitespace``; scores divided by ``k1 + 1`` read as bm25s's).
Ids, texts and titles are ``VARCHAR`` s (65,535 bytes at most). Filters are one expression
over ``fields``, each comparison guarded by ``exists`` so that it is false, never null, where a
field is missing (Milvus Lite's ``not`` keeps a null); values are escaped literals (Milvus Lite
has no expression templates).

>>> parse_target("milvus://db.example/docs").url, parse_target("milvus:m.db").collection
('http://db.example:19530', 'densefit')
>>> print(compile_filter({"field": "meta.lang", "operator": "==", "value": 'e"n'}))
(exists fields["meta.lang"]["s"] and fields["meta.lang"]["s"] == "e\\"n")
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from densefit.retrieval.bm25 import K1, B, tokenize
from densefit.retrieval.index.aliased import (
    PAYLOAD,
    SHOWN,
    STORE_KEY,
    VERSION,
    AliasedStore,
    CollectionTarget,
    Connection,
    nothing,
    parse_collection_target,
    ranked,
    shared_connection,
)
from densefit.retrieval.index.common import Fault, translated
from densefit.retrieval.index.database import StoredRow
from densefit.retrieval.index.filters import (
    Comparison,
    Filter,
    date_seconds,
    emit,
    folded,
    json_text,
    meta_path,
    parse_filters,
)
from densefit.retrieval.index.registry import capabilities_of
from densefit.retrieval.index.request import Ranked
from densefit.retrieval.index.types import StoreError, StoreRecord, StoreUnavailableError

__all__ = ["CAPABILITIES", "MilvusDocumentStore", "compile_filter", "create", "open_existing"]

CAPABILITIES = capabilities_of("milvus")
DEFAULT_PORT, TOKEN_VARIABLE = 19530, "MILVUS_TOKEN"
_SLOW_CALLS = {"load_collection": 12, "create_index": 12}  # their timeout: this many times
LAYOUT = "densefit-milvus/1"  # property "layout": the rows of aliased.py, its schema below
_MAX_BYTES, _BATCH, _PAGE, _MAX_K = 65535, 256, 1000, 16384
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")  # a collection's


# -- targets and connections -----------------------------------------------------------------


def parse_target(target: str) -> CollectionTarget:
    """The :class:`~densefit.retrieval.index.aliased.CollectionTarget` a ``milvus:`` target
    names, or a one-line StoreError.

    >>> parse_target("milvus://localhost:19531/docs?https=true").url
    'https://localhost:19531'
    """
    return parse_collection_target(
        target,
        "Milvus",
        port=DEFAULT_PORT,
        local="FILE.db",
        suffix=".db",
        secret=("token", TOKEN_VARIABLE),
        names=(_NAME, "1 to 200 letters, digits or '_' starting with a letter or '_'"),
    )


_LOCAL: dict[str, Connection] = {}  # Milvus Lite: the open client of each process and file


def _connect(target: CollectionTarget) -> Connection:
    try:
        import pymilvus  # an optional extra: densefit[milvus]
    except ImportError:
        raise ImportError(
            "the Milvus engine needs pymilvus: pip install 'densefit[milvus]'"
        ) from None
    if not target.local:
        with _requests(target):
            token = os.environ.get(TOKEN_VARIABLE) or ""
            client = pymilvus.MilvusClient(uri=target.url, token=token, timeout=target.timeout)
            return Connection(_Timed(client, target.timeout))
    if not Path(target.path).parent.is_dir():
        raise StoreError(f"{target.location}: no folder {Path(target.path).parent}")

    def lite() -> Connection:  # one process per file: Milvus Lite's server is the process's own
        held = os.open(f"{target.path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with _requests(target):
                client = pymilvus.MilvusClient(uri=target.path)
        except BaseException as exc:
            os.close(held)
            if not isinstance(exc, BlockingIOError):
                raise
            raise StoreError(
                f"{target.location}: another process has this Milvus Lite file open (one "
                "process at a time): stop it, or serve the store from a Milvus server"
            ) from None

        def close() -> None:
            from milvus_lite.server_manager import server_manager_instance  # the optional extra

            client.close()
            server_manager_instance.release_server(target.path)  # stops its threads
            os.close(held)  # lets the file go for another process

        return Connection(client, close)

    return shared_connection(_LOCAL, target.path, lite)


def _faults(target: CollectionTarget) -> tuple[Fault, ...]:
    """Milvus's failures as one-line errors: an unreachable server, a lost connection or a
    call past its timeout a StoreUnavailableError; a refused call a StoreError."""

    def message(exc: BaseException) -> str:
        why = " ".join(str(getattr(exc, "message", None) or exc).split())[:200]
        waits = "" if target.local else f", ?timeout= ({target.timeout:g} s)"
        return (
            f"{target.location}: Milvus at {target.path or target.url} refused or failed "
            f"({why}): start it, or check the host, port, ?https={waits} and {TOKEN_VARIABLE}"
        )

    return (
        Fault(_is_unreachable, message, error=StoreUnavailableError),
        Fault(lambda exc: type(exc).__module__.startswith("pymilvus"), message),
    )


def _is_unreachable(exc: BaseException) -> bool:
    """Whether a pymilvus or gRPC error says the server cannot be reached or did not answer
    in time (not that it refused the call)."""
    module = type(exc).__module__
    if not module.startswith(("pymilvus", "grpc")):
        return False
    code = getattr(exc, "code", None)
    code = code() if callable(code) else code
    if getattr(code, "name", None) in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return True  # gRPC's status, as such or as a pymilvus error's code
    if code == 2 or type(exc).__name__ in ("ConnectError", "MilvusUnavailableException"):
        return True  # pymilvus's CONNECT_FAILED
    text = str(getattr(exc, "message", None) or exc).lower()
    return "retry timeout" in text or "timeout" in text and "wait" in text


class _Timed:
    """A server's MilvusClient whose calls wait ``timeout`` seconds at most unless told
    otherwise (pymilvus has no such default: a call to a server that is gone retries for
    minutes, one to a server that never answers waits for ever). A call that finds its
    collection released (a restarted server loads nothing) loads it and is made again."""

    def __init__(self, client, timeout: float):
        self._client, self._timeout = client, timeout

    def __getattr__(self, name: str):
        found = getattr(self._client, name)
        if not callable(found) or name in ("close", "create_schema", "prepare_index_params"):
            return found
        timeout = self._timeout * _SLOW_CALLS.get(name, 1)

        def call(*args, **kwargs):
            kwargs.setdefault("timeout", timeout)
            try:
                return found(*args, **kwargs)
            except Exception as exc:
                released = _RELEASED.search(str(getattr(exc, "message", None) or exc))
                if released is None or name == "load_collection":
                    raise
            self.load_collection(released.group(1))
            return found(*args, **kwargs)

        return call


# What a server answers a call on a collection it has not loaded (after a restart).
_RELEASED = re.compile(r"[Cc]ollection '([^']+)' is in state 'released'")


def _requests(target: CollectionTarget):
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
        return folded(terms, False, lambda rest: "(" + " and ".join(rest) + ")")

    def any_of(self, terms: list) -> str | bool:
        return folded(terms, True, lambda rest: "(" + " or ".join(rest) + ")")


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


def _in(field: str, values: Iterable[str]) -> str:
    return f"{field} in [{', '.join(_quoted(v) for v in values)}]"


def _where(expression: str | bool) -> str:
    return "" if expression is True else expression


# -- the store ---------------------------------------------------------------------------------


class MilvusDocumentStore(AliasedStore):
    """A densefit store in a Milvus collection (see the module docstring).

    >>> import tempfile
    >>> from densefit.testing import tiny_model
    >>> from densefit.data.types import Document
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
    _layout, _local_mode = LAYOUT, "lite"
    _ROW = [*PAYLOAD, "tokens", "dense"]
    _faults_of = staticmethod(_faults)
    _parse_target, _connect = staticmethod(parse_target), staticmethod(_connect)

    @staticmethod
    def _local_files(target: CollectionTarget) -> bool:
        return Path(target.path).is_dir()

    def _read_record(self) -> None:
        with self._errors():
            properties = self._properties(self.collection)
        if properties.get("layout") != LAYOUT or properties.get(STORE_KEY) != self.collection:
            raise StoreError(
                f"{self.location}: collection {self.collection!r} is not a densefit store of "
                "that name: pick another collection name"
            )
        self._take_record(properties)

    def _opened(self) -> None:
        self._client.load_collection(self.collection)  # Milvus Lite reopened: released
        if self._swap and self._exists(self._next(self._swap)):
            self._client.load_collection(self._next(self._swap))

    # -- collections and the alias (AliasedStore's primitives) -------------------------------

    def _collections(self) -> list[str]:
        return self._client.list_collections()

    def _exists(self, collection: str) -> bool:
        return self._client.has_collection(collection)

    def _properties(self, collection: str) -> dict:
        return dict(self._client.describe_collection(collection).get("properties") or {})

    def _set_properties(self, collection: str, values: dict) -> None:
        values = {k: "" if v is None else v for k, v in values.items()}
        self._client.alter_collection_properties(collection, properties=values)

    def _drop_collection(self, collection: str) -> None:
        self._client.drop_collection(collection)

    def _serving_collection(self) -> str | None:
        if self.collection in self._client.list_aliases().get("aliases", []):
            return self._client.describe_alias(self.collection)["collection_name"]
        return None

    def _point_alias(self, collection: str, *, replace: bool) -> None:
        (self._client.alter_alias if replace else self._client.create_alias)(
            collection, self.collection
        )

    def _drop_alias(self) -> None:
        self._client.drop_alias(self.collection)

    def _new_collection(self, collection: str, record: StoreRecord, extra: dict) -> None:
        """``collection`` for ``record``'s vectors, loaded."""
        from pymilvus import DataType, Function, FunctionType  # the optional extra

        schema = self._client.create_schema(auto_id=False, enable_dynamic_field=False)
        for field in ("id", "text", "title", "text_hash", "meta_hash"):
            schema.add_field(field, DataType.VARCHAR, max_length=_MAX_BYTES, is_primary=field == "id")  # fmt: skip
        analyzer = {"tokenizer": "standard" if self.target.local else "whitespace"}
        schema.add_field("tokens", DataType.VARCHAR, max_length=_MAX_BYTES, enable_analyzer=True,
                         analyzer_params=analyzer)  # fmt: skip
        for field, kind in (("meta", "JSON"), ("fields", "JSON"), ("stale", "BOOL"), ("seq", "INT64")):  # fmt: skip
            schema.add_field(field, getattr(DataType, kind))
        schema.add_field("dense", DataType.FLOAT_VECTOR, dim=record.dim)
        schema.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
        schema.add_function(Function(name="bm25", function_type=FunctionType.BM25,
                                     input_field_names=["tokens"], output_field_names=["sparse"]))  # fmt: skip
        indexes = self._client.prepare_index_params()
        indexes.add_index("dense", index_type="FLAT", metric_type="IP")
        indexes.add_index("sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25",
                          params={"bm25_k1": K1, "bm25_b": B})  # fmt: skip
        self._client.create_collection(collection, schema=schema, consistency_level="Strong",
                                       properties=self._new_metadata(record, extra))  # fmt: skip
        self._client.create_index(collection, indexes, sync=False)  # sync: polls every 0.5 s
        self._client.load_collection(collection)

    # -- rows ------------------------------------------------------------------------------

    def _rows(self, where: str | bool, fields: list[str], collection: str | None = None):
        """Every row matching ``where`` (an expression; True: all), its ``fields``."""
        if where is False:
            return []
        collection, rows = collection or self.collection, []
        if self.target.local:  # Milvus Lite: no limit on a query's rows
            return list(self._client.query(collection, _where(where), fields))
        pages = self._client.query_iterator(
            collection, batch_size=_PAGE, filter=_where(where), output_fields=fields
        )
        while page := pages.next():
            rows.extend(page)
        pages.close()
        return rows

    def _rows_after(self, seq: int, limit: int) -> list[dict]:
        rows = self._rows(f"seq > {int(seq)}", [*VERSION, "text"])
        return sorted(rows, key=lambda row: int(row["seq"]))

    def _by_id(self, ids: Sequence[str], fields: list[str], collection: str | None = None):
        unique, found = list(dict.fromkeys(ids)), {}
        for start in range(0, len(unique), _PAGE):
            where = _in("id", unique[start : start + _PAGE])
            found.update((r["id"], r) for r in self._rows(where, fields, collection))
        return found

    def _count(self, where) -> int:
        return int(self._client.query(self.collection, _where(where), ["count(*)"])[0]["count(*)"])

    def _selection(self, stale: bool, hashes: list[str] | None = None) -> str:
        among = "" if hashes is None else _in("text_hash", hashes) + " and "
        return among + f"stale == {str(stale).lower()}"

    def _with_vectors(self, rows: list[dict], vectors: np.ndarray) -> None:
        for row, words, vector in zip(rows, tokenize([r["text"] for r in rows]), vectors):
            row.update(tokens=" ".join(words), dense=vector.tolist())

    def _before_write(self, rows: list[StoredRow], prepared_for: int) -> None:
        for doc in (row.document for row in rows):
            for name, value in (("id", doc.id), ("text", doc.text), ("title", doc.title or "")):
                if len(value.encode("utf-8")) > _MAX_BYTES:
                    raise StoreError(
                        f"{self.location}: document {doc.id[:80]!r}: its {name} is longer than "
                        f"the {_MAX_BYTES} bytes a Milvus VARCHAR holds: split or shorten it"
                    )

    def _upsert_rows(self, collection: str, rows: list[dict]) -> None:
        for start in range(0, len(rows), _BATCH):
            self._client.upsert(collection, rows[start : start + _BATCH])

    def _update_rows(self, collection: str, changes: dict[str, dict]) -> None:
        rows = self._by_id(list(changes), self._ROW, collection)
        self._upsert_rows(collection, [row | changes[i] for i, row in rows.items()])

    def _delete_rows(self, collection: str, ids: list[str]) -> None:
        for start in range(0, len(ids), _PAGE):
            self._client.delete(collection, filter=_in("id", ids[start : start + _PAGE]))

    def _mark_stale(self) -> None:
        with self._reading():
            rows = self._rows(self._selection(False), self._ROW)
            self._upsert_rows(self.collection, [{**r, "stale": True} for r in rows])

    def index_meta_field(self, field: str) -> None:
        """Check the name: Milvus filters JSON fields without a per-field index."""
        meta_path(field)

    # -- searching -------------------------------------------------------------------------

    def _where(self, filters: Filter):
        return compile_filter(filters)

    def _ask(self, data: list, field: str, k: int, where, score) -> list[Ranked]:
        """Each query's ranking with its hits' documents."""
        if where is False or not data:
            return [nothing() for _ in data]
        answers = self._client.search(
            self.collection, data=data, anns_field=field, limit=min(k, _MAX_K),
            filter=_where(True if where is None else where), output_fields=SHOWN,
            search_params={"metric_type": "IP" if field == "dense" else "BM25"},
        )  # fmt: skip
        return [ranked([(score(h["distance"]), h["entity"]) for h in hits]) for hits in answers]

    def _dense(self, queries: np.ndarray, k: int, where) -> list[Ranked]:
        return self._ask([q.tolist() for q in queries], "dense", k, where, float)

    def _lexical(self, texts: list[str], k: int, where) -> list[Ranked]:
        tokens = [" ".join(words) for words in tokenize(texts)]
        asked = [i for i, t in enumerate(tokens) if t]
        # a BM25 score is never negative (Milvus Lite reports it negated); bm25s's lack k1 + 1
        found = self._ask([tokens[i] for i in asked], "sparse", k, where,
                          lambda d: abs(d) / (K1 + 1))  # fmt: skip
        answers = dict(zip(asked, found, strict=True))
        return [answers.get(i, nothing()) for i in range(len(texts))]


# -- the engine's functions (densefit.retrieval.index.engines) ---------------------------------


def open_existing(target: str, *, backend=None, **_) -> MilvusDocumentStore | None:
    """The densefit store in ``target``'s collection; None when there is none (for Milvus
    Lite, nothing is created then)."""
    return MilvusDocumentStore.opened(target, backend, None)


def create(target: str, record: StoreRecord, *, backend=None, **_) -> MilvusDocumentStore:
    """A new collection for ``record``'s vectors at ``target`` and its alias; when another
    process created them meanwhile, that one opened."""
    return MilvusDocumentStore.opened(target, backend, record)
