"""Haystack 3: a document store over densefit's store, and its retriever components.

:class:`DensefitDocumentStore` implements Haystack's ``DocumentStore`` protocol
(``count_documents``, ``filter_documents``, ``write_documents`` with ``DuplicatePolicy``,
``delete_documents``, ``to_dict``/``from_dict``), the extended methods
(``delete_all_documents``, ``delete_by_filter``, ``update_by_filter``,
``count_documents_by_filter``), the metadata methods (``count_unique_metadata_by_filter``,
``get_metadata_fields_info``, ``get_metadata_field_min_max``,
``get_metadata_field_unique_values``, computed in SQLite) and an ``*_async`` twin of each,
and passes every suite of Haystack's ``haystack.testing.document_store`` and
``haystack.testing.document_store_async`` (``tests/test_haystack.py``).
:class:`DensefitEmbeddingRetriever` is the component that searches it with a query
embedding (``filters``, ``top_k``, ``scale_score``; ``run`` and ``run_async``), like
``InMemoryEmbeddingRetriever``::

    from haystack import Document, Pipeline
    from haystack_integrations.components.embedders.sentence_transformers import (
        SentenceTransformersDocumentEmbedder, SentenceTransformersTextEmbedder)
    from densefit.integrations.haystack import DensefitDocumentStore, DensefitEmbeddingRetriever

    store = DensefitDocumentStore("stores/haystack", model="models/my-densefit-model")
    embedder = SentenceTransformersDocumentEmbedder(model="models/my-densefit-model")
    store.write_documents(embedder.run(documents)["documents"])
    query = Pipeline()
    query.add_component("embed", SentenceTransformersTextEmbedder(model="models/my-densefit-model"))
    query.add_component("retrieve", DensefitEmbeddingRetriever(store, top_k=5))
    query.connect("embed.embedding", "retrieve.query_embedding")
    query.run({"embed": {"text": "vitamin D"}, "retrieve": {"filters": {...}}})

:class:`DensefitHybridRetriever` searches it by BM25 over the query text, by the query
embedding, or by both fused (``mode="hybrid"``, the default: connect the text to ``query`` and
the embedder's output to ``query_embedding``; ``run`` and ``run_async``); the store keeps the BM25 index of the
documents' content itself (:mod:`densefit.retrieval.index.lexical`).

Both retrievers also take the query text alone (``query``): without ``query_embedding`` they
embed it with the model the store records, through ``runtime`` (the vocabulary and default of
``--runtime``: ``auto`` picks the fastest exported runtime whose check passed, else torch),
with the store's query prompt and vector size, and a runtime whose vectors may not meet the
store's is refused as ``densefit search --runtime`` refuses it
(:func:`~densefit.retrieval.index.searching.query_runtime`).

Where the vectors come from: Haystack's embedders compute them, so the store takes them as
given. With ``model=`` (the path or name the embedders load) a new store records that model
like ``densefit index`` does (name, fingerprint, settings), and ``densefit search`` works on
it; without, the store records the model as ``"external"`` and takes its dimension from
``embedding_dim=`` or the first document written with an embedding.

The ``*_async`` methods run their sync twin in a worker thread (``asyncio.to_thread``), so a
slow SQLite query, a large write or a search never blocks the event loop; every method holds
the store object's lock, so concurrent calls (async tasks, threads) run one at a time and a
check-then-write such as ``DuplicatePolicy.FAIL`` is never interleaved with another write.

Haystack fields densefit's documents do not have (``content=None``, ``blob``,
``sparse_embedding``, an embedding the vector file cannot reproduce exactly, e.g. one a cosine
store normalised, and whether the document has an embedding at all) are kept in the metadata
under the reserved key :data:`RESERVED_KEY`, hidden from Haystack. Documents without an
embedding get a zero vector and are never returned by embedding retrieval.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import os
import threading
from dataclasses import replace
from typing import Any

import numpy as np

try:
    from haystack import Document, component, default_from_dict, default_to_dict
    from haystack.dataclasses import ByteStream, SparseEmbedding
    from haystack.document_stores.errors import DuplicateDocumentError
    from haystack.document_stores.types import DuplicatePolicy, FilterPolicy, apply_filter_policy
    from haystack.errors import FilterError
    from haystack.utils import Secret, deserialize_secrets_inplace
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError(
        "densefit.integrations.haystack needs Haystack 3: pip install 'densefit[haystack]'"
    ) from None

from densefit.choices import (
    FUSIONS,
    RUNTIME_CHOICES,
    VECTOR_KINDS,
    embeds,
    reads_texts,
    search_mode,
)
from densefit.config.shared import DENSE_WEIGHT, FUSION, FUSION_DEPTH, RRF_K, RUNTIME
from densefit.data.text import InvalidText, checked_text
from densefit.data.types import Document as DensefitDocument
from densefit.integrations.haystack_embedders import DensefitDocumentEmbedder, DensefitTextEmbedder
from densefit.models import load_model
from densefit.retrieval.fusion import Fusion
from densefit.retrieval.index.base import DocumentStore, MetadataStats
from densefit.retrieval.index.common import checked_vectors
from densefit.retrieval.index.engines import open_store
from densefit.retrieval.index.filters import Filter, parse_filters
from densefit.retrieval.index.registry import redacted, require
from densefit.retrieval.index.request import SearchRequest
from densefit.retrieval.index.searching import embed_queries, model_for_store, search_embedded
from densefit.retrieval.index.types import NoStoreError, StoreRecord

__all__ = [
    "EXTERNAL_MODEL",
    "RESERVED_KEY",
    "DensefitDocumentEmbedder",
    "DensefitDocumentStore",
    "DensefitEmbeddingRetriever",
    "DensefitHybridRetriever",
    "DensefitTextEmbedder",
]

RESERVED_KEY = "_haystack"
EXTERNAL_MODEL = "external"
# Haystack's similarity names -> densefit's (densefit.choices.SIMILARITIES).
HAYSTACK_SIMILARITIES = {"cosine": "cosine", "dot_product": "dot", "dot": "dot"}
_HAS_EMBEDDING = {"field": f"meta.{RESERVED_KEY}.embedded", "operator": "!=", "value": False}
_WITH_EMBEDDING = parse_filters(_HAS_EMBEDDING)  # the dense side's further condition
_NO_EMBEDDING = parse_filters({**_HAS_EMBEDDING, "operator": "=="})  # parsed once, not per search


# Haystack's metadata type names (as its InMemoryDocumentStore reports them) by SQLite's
# json_type: lists and objects count as keywords there too.
_FIELD_TYPES = {
    "text": "keyword",
    "integer": "int",
    "real": "float",
    "true": "boolean",
    "false": "boolean",
    "array": "keyword",
    "object": "keyword",
}


def _locked(method):
    """Run a store method under the object's lock: one call at a time, whichever thread."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _in_thread(method):
    """The ``*_async`` twin of a sync method: the same call, run in a worker thread."""

    @functools.wraps(method)
    async def run(self, *args, **kwargs):
        return await asyncio.to_thread(method, self, *args, **kwargs)

    run.__name__ = f"{method.__name__}_async"
    run.__qualname__ = f"{method.__qualname__}_async"
    run.__doc__ = f"``await`` :meth:`{method.__name__}` (run in a worker thread)."
    return run


def _meta_field(name: str) -> str:
    """``"meta.NAME"`` for a metadata field given with or without the prefix."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a metadata field name must be a non-empty string, got {name!r}")
    return name if name.startswith("meta.") else f"meta.{name}"


def _checked_filters(filters: dict[str, Any] | None, store=None) -> Filter | None:
    """``filters`` parsed (None for none) for ``store``'s engine (None: no store yet), or
    Haystack's FilterError saying what is malformed or too large for the engine."""
    try:
        return parse_filters(filters, None if store is None else store.capabilities)
    except ValueError as exc:
        raise FilterError(str(exc)) from None


class DensefitDocumentStore:
    """Haystack's ``DocumentStore`` over a densefit store, on any engine.

    :param path: the store: a folder (the embedded store), ``postgresql://.../TABLE`` or
        ``qdrant://HOST:PORT/COLLECTION`` / ``qdrant:FOLDER`` (any target of
        :func:`~densefit.retrieval.index.engines.open_store`); opened if it holds a store,
        created at the first write otherwise. None: a temporary embedded store, deleted with
        this object. A target holding a password or key is best given as
        ``Secret.from_env_var("VAR")`` (Haystack's secrets): :meth:`to_dict` writes the
        variable's name, never the value, and refuses a plain target that holds a secret.
    :param model: the sentence-transformers model (path or name) Haystack's embedders use;
        a new store records it so that densefit (``densefit search``) can search it too.
    :param embedding_dim: the embedding dimension of a new store without ``model``; by
        default, the length of the first embedding written.
    :param similarity: ``"cosine"`` (default) or ``"dot_product"``, for a new store.
    :param backend: the vector search (None: the engine's default; ``"exact"``, ``"faiss"``
        or ``"faiss:FACTORY"`` for a folder, ``"exact"`` or ``"hnsw"`` for an engine).
    :param vectors: the vector kind of a new store: ``"float32"`` (default), ``"float16"``,
        ``"int8"`` or ``"binary"`` (int8 and binary keep codes in memory and rescore against
        float32 vectors on disk: :mod:`densefit.retrieval.index.quantized`).
    :param rescore: int8 and binary stores: candidates per result that are rescored.
    """

    def __init__(
        self,
        path: str | os.PathLike | Secret | None = None,
        *,
        model: str | None = None,
        embedding_dim: int | None = None,
        similarity: str = "cosine",
        backend: str | None = None,
        vectors: str = "float32",
        rescore: int | None = None,
    ) -> None:
        if similarity not in HAYSTACK_SIMILARITIES:
            raise ValueError(
                f"similarity {similarity!r} is not supported: use 'cosine' or 'dot_product'"
            )
        if vectors not in VECTOR_KINDS:
            raise ValueError(f"vectors must be one of {', '.join(VECTOR_KINDS)}, not {vectors!r}")
        self._secret = path if isinstance(path, Secret) else None  # what to_dict writes
        if self._secret is not None:
            path = self._secret.resolve_value()
        self.path = None if path is None else str(path)
        self.model = model
        self.embedding_dim = embedding_dim
        self.similarity = similarity
        self.backend = backend
        self.vectors = vectors
        self.rescore = rescore
        self._store: DocumentStore | None = None
        self._indexed = False  # the "has no embedding" field has its index
        self._lock = threading.RLock()  # see _locked: one call at a time
        self._query_model = None  # the model embed_queries loads once
        self._model_lock = threading.Lock()
        if self.path is not None:
            try:
                self._store = open_store(self.path, backend=backend, rescore=rescore, create=False)
            except NoStoreError:
                pass  # created at the first write

    # -- the densefit store ----------------------------------------------------------------

    @property
    def store(self) -> DocumentStore | None:
        """The underlying :class:`~densefit.retrieval.index.base.DocumentStore` (None until
        the first write creates it)."""
        return self._store

    def _create(self, dim_hint: int | None) -> DocumentStore:
        if self.model is not None:
            return open_store(
                self.path,
                load_model(self.model),
                backend=self.backend,
                vectors=self.vectors,
                rescore=self.rescore,
            )
        dim = self.embedding_dim or dim_hint
        if dim is None:
            raise ValueError(
                "DensefitDocumentStore does not know the embedding dimension yet: pass "
                "embedding_dim= or model=, or write documents with embeddings first"
            )
        record = StoreRecord(
            EXTERNAL_MODEL,
            dim,
            HAYSTACK_SIMILARITIES[self.similarity],
            self.vectors,
            np.zeros((3, dim), dtype=np.float32),
            None,
        )
        return open_store(self.path, record=record, backend=self.backend, rescore=self.rescore)

    # -- serialisation ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Serialise the store's settings (not its documents: they live in ``path``); a
        target given as a Secret is written as the Secret (its variable's name). ValueError
        for a plain target holding a password or key, which would land in the file."""
        path: Any = self.path
        if self._secret is not None:
            path = self._secret.to_dict()
        elif path is not None and redacted(path) != path:
            raise ValueError(
                f"{redacted(path)}: the store target holds a secret that to_dict would write "
                "into the pipeline file: give the target as Secret.from_env_var('VAR') "
                "(from haystack.utils import Secret)"
            )
        return default_to_dict(
            self,
            path=path,
            model=self.model,
            embedding_dim=self.embedding_dim,
            similarity=self.similarity,
            backend=self.backend,
            vectors=self.vectors,
            rescore=self.rescore,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DensefitDocumentStore:
        """The store :meth:`to_dict` described (the same folder or target)."""
        if isinstance(data.get("init_parameters", {}).get("path"), dict):
            deserialize_secrets_inplace(data["init_parameters"], ["path"])
        return default_from_dict(cls, data)

    # -- the protocol ----------------------------------------------------------------------

    @_locked
    def count_documents(self) -> int:
        """The number of documents."""
        return 0 if self._store is None else self._store.count()

    @_locked
    def count_documents_by_filter(self, filters: dict[str, Any]) -> int:
        """The number of documents matching ``filters``."""
        filters = _checked_filters(filters, self._store)
        return 0 if self._store is None else self._store.count_matching(filters)

    @_locked
    def filter_documents(self, filters: dict[str, Any] | None = None) -> list[Document]:
        """The documents matching ``filters`` (Haystack's syntax), in the order written.

        Filters are parsed once (:mod:`densefit.retrieval.index.filters`) and evaluated by
        the store's engine; a malformed filter raises ``FilterError``.
        """
        filters = _checked_filters(filters, self._store)
        if self._store is None:
            return []
        found = self._store.filter_documents(filters)
        return self._to_haystack(found, with_embedding=True)

    @_locked
    def write_documents(
        self, documents: list[Document], policy: DuplicatePolicy = DuplicatePolicy.NONE
    ) -> int:
        """Write ``documents``; ``DuplicatePolicy.NONE`` means ``FAIL``. Returns how many
        were written. Embeddings must all have the store's dimension."""
        if not isinstance(documents, (list, tuple)) or any(
            not isinstance(d, Document) for d in documents
        ):
            raise ValueError("write_documents takes a list of haystack Documents")
        for doc in documents:
            _check_texts(doc)  # before any id reaches SQLite
        if policy == DuplicatePolicy.NONE:
            policy = DuplicatePolicy.FAIL
        documents = _one_per_id(documents, policy)
        if not documents:
            return 0
        if self._store is None:
            dims = [len(d.embedding) for d in documents if d.embedding is not None]
            self._store = self._create(dims[0] if dims else None)
        existing = set(self._store.hashes([d.id for d in documents]))
        if existing and policy == DuplicatePolicy.FAIL:
            raise DuplicateDocumentError(f"ID '{sorted(existing)[0]}' already exists.")
        if policy == DuplicatePolicy.SKIP:
            documents = [d for d in documents if d.id not in existing]
        if documents:
            converted, vectors = self._to_densefit(documents)
            self._store.write(converted, vectors)
        return len(documents)

    @_locked
    def delete_documents(self, document_ids: list[str]) -> None:
        """Delete documents by id; unknown ids are ignored."""
        if self._store is not None:
            self._store.delete(document_ids)

    @_locked
    def delete_all_documents(self, recreate_index: bool = False) -> None:
        """Delete every document (``recreate_index`` has nothing to recreate here)."""
        del recreate_index
        if self._store is not None:
            self._store.delete(list(self._store.ids()))

    @_locked
    def delete_by_filter(self, filters: dict[str, Any]) -> int:
        """Delete the documents matching ``filters``; returns how many."""
        filters = _checked_filters(filters, self._store)
        if self._store is None:
            return 0
        ids = [d.id for d in self._store.filter_documents(filters)]
        return self._store.delete(ids)

    @_locked
    def update_by_filter(self, filters: dict[str, Any], meta: dict[str, Any]) -> int:
        """Merge ``meta`` into the metadata of the documents matching ``filters`` (their
        text and embedding stay); returns how many were updated."""
        filters = _checked_filters(filters, self._store)
        if RESERVED_KEY in meta:
            raise ValueError(f"the metadata key {RESERVED_KEY!r} is reserved by densefit")
        if self._store is None:
            return 0
        found = self._store.filter_documents(filters)
        updated = [DensefitDocument(d.id, d.text, d.title, {**d.meta, **meta}) for d in found]
        return self._store.write_metadata(updated) if updated else 0

    # -- metadata --------------------------------------------------------------------------

    @_locked
    def count_unique_metadata_by_filter(
        self, filters: dict[str, Any], metadata_fields: list[str]
    ) -> dict[str, int]:
        """How many distinct values each of ``metadata_fields`` (with or without ``meta.``)
        takes among the documents matching ``filters``: ``{field without "meta.": count}``.
        Values keep their type (``1``, ``1.0``, ``True``, ``"1"`` are four); missing and null
        values do not count."""
        filters = _checked_filters(filters, self._store)
        counts = {}
        for name in metadata_fields:
            field = _meta_field(name)
            values = [] if self._store is None else self._statistics().meta_values(field, filters)
            counts[field.removeprefix("meta.")] = len(values)
        return counts

    @_locked
    def get_metadata_fields_info(self) -> dict[str, dict[str, str]]:
        """The top-level metadata fields of the stored documents and their type:
        ``{"year": {"type": "int"}, ...}`` with Haystack's names ``keyword``, ``int``,
        ``float``, ``boolean``; a field holding ints and floats is ``float``, otherwise the
        type most of its values have."""
        if self._store is None:
            return {}
        info = {}
        for key, kinds in self._statistics().meta_fields().items():
            if key == RESERVED_KEY:
                continue
            names: dict[str, int] = {}
            for kind, n in kinds.items():
                name = _FIELD_TYPES.get(kind, "keyword")
                names[name] = names.get(name, 0) + n
            if set(names) == {"int", "float"}:
                info[key] = {"type": "float"}
            else:
                info[key] = {"type": max(names, key=lambda k: (names[k], k))}
        return info

    @_locked
    def get_metadata_field_min_max(self, metadata_field: str) -> dict[str, Any]:
        """``{"min": ..., "max": ...}`` of a metadata field (with or without ``meta.``) over
        all documents: of its numbers, or of its strings when it holds no number (ISO dates
        order as dates); ``None`` for both when it has neither."""
        if self._store is None:
            return {"min": None, "max": None}
        low, high = self._statistics().meta_range(_meta_field(metadata_field))
        return {"min": low, "max": high}

    @_locked
    def get_metadata_field_unique_values(
        self,
        metadata_field: str,
        search_term: str | None = None,
        from_: int = 0,
        size: int = 10,
        filters: dict[str, Any] | None = None,
    ) -> tuple[list[Any], int]:
        """One page of the distinct values of a metadata field (with or without ``meta.``)
        among the documents matching ``filters``, and how many there are in all:
        ``(values[from_ : from_ + size], total)``. ``search_term`` keeps the values whose
        text contains it (case-insensitive). Values are ordered by their text, then their
        type, so pages are stable; they keep their type (``1`` and ``"1"`` are two)."""
        filters = _checked_filters(filters, self._store)
        if from_ < 0 or size < 0:
            raise ValueError(f"from_ and size must be >= 0, got {from_} and {size}")
        if self._store is None:
            return [], 0
        stats = self._statistics()
        values = [v for v, _ in stats.meta_values(_meta_field(metadata_field), filters)]
        if search_term:
            wanted = search_term.lower()
            values = [v for v in values if wanted in str(v).lower()]
        values.sort(key=lambda v: (str(v), type(v).__name__))
        return values[from_ : from_ + size], len(values)

    # -- retrieval -------------------------------------------------------------------------

    @_locked
    def embedding_retrieval(
        self,
        query_embedding: list[float],
        filters: dict[str, Any] | None = None,
        top_k: int = 10,
        scale_score: bool = False,
        return_embedding: bool = False,
    ) -> list[Document]:
        """The ``top_k`` documents with embeddings closest to ``query_embedding`` among
        those matching ``filters``, best first, with ``score`` set."""
        filters = _checked_filters(filters, self._store)
        if self._store is None or top_k == 0:
            return []
        query = self._query_vector(query_embedding)
        dense_filters = _WITH_EMBEDDING if self._has_documents_without_embedding() else None
        request = SearchRequest(
            "dense", top_k, filters, scale_score=scale_score, dense_filters=dense_filters
        )
        hits = search_embedded(self._store, [""], query, request)[0]
        return self._scored(hits, return_embedding)

    @_locked
    def bm25_retrieval(
        self,
        query: str,
        filters: dict[str, Any] | None = None,
        top_k: int = 10,
        scale_score: bool = False,
        return_embedding: bool = False,
    ) -> list[Document]:
        """The ``top_k`` documents whose content best matches ``query`` by BM25 among those
        matching ``filters``, best first, with ``score`` set (documents sharing no word with
        the query are not returned; ``scale_score``: ``expit(score / 8)``, as Haystack's
        ``InMemoryBM25Retriever``)."""
        return self._retrieval("bm25", query, None, filters, top_k, scale_score, return_embedding)

    @_locked
    def hybrid_retrieval(
        self,
        query: str,
        query_embedding: list[float],
        filters: dict[str, Any] | None = None,
        top_k: int = 10,
        scale_score: bool = False,
        return_embedding: bool = False,
        fusion: Fusion | None = None,
    ) -> list[Document]:
        """The ``top_k`` best documents by BM25 over ``query`` and embedding similarity to
        ``query_embedding``, fused (``fusion``: reciprocal rank by default,
        :class:`~densefit.retrieval.fusion.Fusion`), among those matching ``filters`` on
        both sides; documents without an embedding take part on the BM25 side only."""
        return self._retrieval(
            "hybrid", query, query_embedding, filters, top_k, scale_score, return_embedding, fusion
        )

    def _retrieval(
        self,
        mode,
        query,
        query_embedding,
        filters,
        top_k,
        scale_score,
        return_embedding,
        fusion=None,
    ) -> list[Document]:
        filters = _checked_filters(filters, self._store)
        if not isinstance(query, str):
            raise ValueError(f"{mode} retrieval needs the query text, got {type(query).__name__}")
        checked_text(query, "query")  # InvalidText (a ValueError) names the problem
        if self._store is None or top_k == 0:
            return []
        query_vector = None
        dense_filters = None
        if embeds(mode):
            query_vector = self._query_vector(query_embedding)
            if self._has_documents_without_embedding():
                dense_filters = _WITH_EMBEDDING
        request = SearchRequest(mode, top_k, filters, fusion, scale_score, dense_filters)
        hits = search_embedded(self._store, [query], query_vector, request)[0]
        return self._scored(hits, return_embedding)

    def embed_queries(self, queries: list[str], runtime: str = RUNTIME.default) -> np.ndarray:
        """The ``(len(queries), dim)`` embeddings of ``queries`` by the model the store
        records (or ``model=``; loaded once), with its query prompt and vector size, the
        transformer run by ``runtime`` (:data:`densefit.choices.RUNTIME_CHOICES`). A runtime
        whose vectors may not meet the store's raises
        :class:`~densefit.retrieval.index.types.SettingsMismatchError` (a ValueError), a
        store of external embeddings (no model recorded) a ValueError."""
        if self._store is None or self._store.model_name == EXTERNAL_MODEL:
            raise ValueError(
                "this store needs the query embedding: connect `query_embedding` (its "
                "embeddings came from an external embedder and it records no model to embed "
                "`query` with; create it with model= to embed queries here)"
            )
        with self._model_lock:
            if self._query_model is None:
                self._query_model = model_for_store(self._store, self.model)
        return embed_queries(self._store, self._query_model, queries, runtime=runtime)

    def _query_vector(self, query_embedding) -> np.ndarray:
        query = np.asarray(query_embedding, dtype=np.float32)
        if query.ndim != 1 or len(query) != self._store.dim:
            raise ValueError(
                f"the query embedding has {query.size} values but the store holds "
                f"{self._store.dim}-d embeddings"
            )
        return query

    def _statistics(self) -> MetadataStats:
        """The store, for metadata statistics; CapabilityError (one line naming the engines
        that can) where its engine has none."""
        doing = "give metadata statistics"
        require(self._store.capabilities, "metadata_stats", doing, location=self._store.location)
        return self._store

    def _scored(self, hits, return_embedding: bool) -> list[Document]:
        found = [DensefitDocument(h.id, h.text, h.title, h.meta) for h in hits]
        documents = self._to_haystack(found, with_embedding=return_embedding)
        return [replace(d, score=h.score) for d, h in zip(documents, hits, strict=True)]

    def _has_documents_without_embedding(self) -> bool:
        """Whether any stored document lacks an embedding (an index lookup: the field is
        indexed, so that searches without such documents need no filter at all)."""
        if not self._indexed and self._store.capabilities.upkeep:
            self._store.index_meta_field(_HAS_EMBEDDING["field"])
            self._indexed = True
        return self._store.count_matching(_NO_EMBEDDING) > 0

    # -- async: each method's twin, run in a worker thread -----------------------------------

    count_documents_async = _in_thread(count_documents)
    count_documents_by_filter_async = _in_thread(count_documents_by_filter)
    filter_documents_async = _in_thread(filter_documents)
    write_documents_async = _in_thread(write_documents)
    delete_documents_async = _in_thread(delete_documents)
    delete_all_documents_async = _in_thread(delete_all_documents)
    delete_by_filter_async = _in_thread(delete_by_filter)
    update_by_filter_async = _in_thread(update_by_filter)
    count_unique_metadata_by_filter_async = _in_thread(count_unique_metadata_by_filter)
    get_metadata_fields_info_async = _in_thread(get_metadata_fields_info)
    get_metadata_field_min_max_async = _in_thread(get_metadata_field_min_max)
    get_metadata_field_unique_values_async = _in_thread(get_metadata_field_unique_values)
    embedding_retrieval_async = _in_thread(embedding_retrieval)
    bm25_retrieval_async = _in_thread(bm25_retrieval)
    hybrid_retrieval_async = _in_thread(hybrid_retrieval)

    # -- conversion ------------------------------------------------------------------------

    def _to_densefit(self, documents: list[Document]) -> tuple[list[DensefitDocument], np.ndarray]:
        """densefit documents and the ``(n, dim)`` vectors to write (zeros: no embedding)."""
        dim = self._store.dim
        vectors = np.zeros((len(documents), dim), dtype=np.float32)
        for i, doc in enumerate(documents):
            if RESERVED_KEY in doc.meta:
                raise ValueError(
                    f"document {doc.id!r}: the metadata key {RESERVED_KEY!r} is reserved by densefit"
                )
            if doc.embedding is not None:
                if len(doc.embedding) != dim:
                    raise ValueError(
                        f"document {doc.id!r} has a {len(doc.embedding)}-d embedding but the "
                        f"store holds {dim}-d embeddings"
                    )
                vectors[i] = doc.embedding
        plain = [DensefitDocument(d.id, d.content or "") for d in documents]
        stored = checked_vectors(self._store.record, plain, vectors).astype(np.float64)
        converted = []
        for doc, vector in zip(documents, stored, strict=True):
            extra: dict[str, Any] = {"embedded": doc.embedding is not None}
            if doc.content is None:
                extra["content"] = None
            if doc.blob is not None:
                extra["blob"] = {**doc.blob.to_dict(), "data": _b64(doc.blob.data)}
            if doc.sparse_embedding is not None:
                extra["sparse_embedding"] = doc.sparse_embedding.to_dict()
            if doc.embedding is not None and vector.tolist() != list(doc.embedding):
                # The vector file holds float32 (normalised, in a cosine store): keep the
                # embedding as given, so that it reads back unchanged.
                extra["embedding"] = _b64(np.asarray(doc.embedding, dtype=np.float64).tobytes())
            meta = {**doc.meta, RESERVED_KEY: extra}
            converted.append(DensefitDocument(doc.id, doc.content or "", "", meta))
        return converted, vectors

    def _to_haystack(
        self, documents: list[DensefitDocument], *, with_embedding: bool
    ) -> list[Document]:
        """Haystack documents (embeddings read from the store where not kept exactly)."""
        extras = [d.meta.get(RESERVED_KEY) or {} for d in documents]
        need_vectors = [
            d.id
            for d, extra in zip(documents, extras, strict=True)
            if with_embedding and extra.get("embedded", True) and "embedding" not in extra
        ]
        vectors = {}
        if need_vectors:
            vectors = dict(zip(need_vectors, self._store.vectors(need_vectors), strict=True))
        out = []
        for doc, extra in zip(documents, extras, strict=True):
            embedding = None
            if with_embedding and extra.get("embedded", True):
                if "embedding" in extra:
                    embedding = np.frombuffer(_unb64(extra["embedding"]), np.float64).tolist()
                else:
                    embedding = vectors[doc.id].astype(np.float64).tolist()
            blob = None
            if "blob" in extra:
                blob = ByteStream.from_dict(
                    {**extra["blob"], "data": _unb64(extra["blob"]["data"])}
                )
            sparse = extra.get("sparse_embedding")
            out.append(
                Document(
                    id=doc.id,
                    content=None if "content" in extra else doc.text,
                    blob=blob,
                    meta={k: v for k, v in doc.meta.items() if k != RESERVED_KEY},
                    embedding=embedding,
                    sparse_embedding=SparseEmbedding.from_dict(sparse) if sparse else None,
                )
            )
        return out


def _check_texts(doc: Document) -> None:
    """The document's id and content checked as every text densefit reads is
    (:func:`densefit.data.text.text_problem`): ValueError naming the document and field."""
    try:
        checked_text(doc.id, "id")
        if doc.content is not None:
            checked_text(doc.content, "content", empty_ok=True)
    except InvalidText as error:
        raise ValueError(f"document {doc.id!r}: {error}") from None


def _one_per_id(documents: list[Document], policy: DuplicatePolicy) -> list[Document]:
    """One document per id, as writing them one by one under ``policy`` would leave."""
    kept: dict[str, Document] = {}
    for doc in documents:
        if doc.id in kept:
            if policy == DuplicatePolicy.FAIL:
                raise DuplicateDocumentError(f"ID '{doc.id}' already exists.")
            if policy == DuplicatePolicy.SKIP:
                continue
        kept[doc.id] = doc
    return list(kept.values())


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _retriever_init(
    retriever,
    document_store,
    filters,
    top_k,
    scale_score,
    return_embedding,
    filter_policy,
    runtime,
) -> None:
    """The settings every densefit retriever component checks and keeps."""
    if not isinstance(document_store, DensefitDocumentStore):
        raise TypeError("document_store must be a DensefitDocumentStore")
    if top_k <= 0:
        raise ValueError(f"top_k must be greater than 0, got {top_k}")
    if runtime not in RUNTIME_CHOICES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIME_CHOICES)}, not {runtime!r}")
    retriever.runtime = runtime
    retriever.document_store = document_store
    _checked_filters(filters)  # malformed: FilterError now (kept as given, for to_dict)
    retriever.filters = filters or None
    retriever.top_k = top_k
    retriever.scale_score = scale_score
    retriever.return_embedding = return_embedding
    retriever.filter_policy = (
        filter_policy
        if isinstance(filter_policy, FilterPolicy)
        else FilterPolicy.from_str(filter_policy)
    )


def _query_embedding(retriever, query, query_embedding, what: str):
    """``query_embedding``, else ``query`` embedded by the store's model through the
    retriever's runtime (None when the store holds nothing yet: nothing to search)."""
    if query_embedding is not None:
        return query_embedding
    store = retriever.document_store
    if store.store is None:
        return None
    if query is None:
        raise ValueError(f"{what} needs the query embedding or the query text: connect one")
    return store.embed_queries([query], retriever.runtime)[0]


def _retriever_from_dict(cls, data: dict[str, Any]):
    """A retriever component from what its ``to_dict`` wrote: its store rebuilt, its filter
    policy read back."""
    init = dict(data.get("init_parameters", {}))
    store = init.get("document_store")
    if isinstance(store, dict):
        init["document_store"] = DensefitDocumentStore.from_dict(store)
    if "filter_policy" in init:
        init["filter_policy"] = FilterPolicy.from_str(init["filter_policy"])
    return default_from_dict(cls, {**data, "init_parameters": init})


@component
class DensefitEmbeddingRetriever:
    """Retrieves the documents of a :class:`DensefitDocumentStore` closest to a query
    embedding (from a ``SentenceTransformersTextEmbedder``), like Haystack's
    ``InMemoryEmbeddingRetriever``.

    :param document_store: the store to search.
    :param filters: filters applied to every query (Haystack's syntax).
    :param top_k: how many documents to return.
    :param scale_score: scores in [0, 1]: cosine ``(s + 1) / 2``, dot product
        ``expit(s / 100)``.
    :param return_embedding: return the documents' embeddings too.
    :param filter_policy: how run-time filters combine with ``filters``: ``REPLACE``
        (default) or ``MERGE``.
    :param runtime: what runs the store's model when a query comes as text (``query``, no
        ``query_embedding``): ``"auto"`` (default), ``"torch"``, ``"onnx"``... as
        ``--runtime`` (:meth:`DensefitDocumentStore.embed_queries`).
    """

    def __init__(
        self,
        document_store: DensefitDocumentStore,
        filters: dict[str, Any] | None = None,
        top_k: int = 10,
        scale_score: bool = False,
        return_embedding: bool = False,
        filter_policy: FilterPolicy = FilterPolicy.REPLACE,
        runtime: str = RUNTIME.default,
    ) -> None:
        _retriever_init(
            self,
            document_store,
            filters,
            top_k,
            scale_score,
            return_embedding,
            filter_policy,
            runtime,
        )

    def to_dict(self) -> dict[str, Any]:
        """Serialise the component (with its store's settings)."""
        return default_to_dict(
            self,
            document_store=self.document_store,
            filters=self.filters,
            top_k=self.top_k,
            scale_score=self.scale_score,
            return_embedding=self.return_embedding,
            filter_policy=self.filter_policy.value,
            runtime=self.runtime,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DensefitEmbeddingRetriever:
        """The component :meth:`to_dict` described."""
        return _retriever_from_dict(cls, data)

    @component.output_types(documents=list[Document])
    def run(
        self,
        query_embedding: list[float] | None = None,
        filters: dict[str, Any] | None = None,
        top_k: int | None = None,
        scale_score: bool | None = None,
        return_embedding: bool | None = None,
        query: str | None = None,
    ) -> dict[str, list[Document]]:
        """The best ``top_k`` documents for ``query_embedding`` (or ``query``, embedded by
        the store's model through ``runtime``) among those matching the filters:
        ``{"documents": [...]}``, best first, each with ``score``."""
        query_embedding = _query_embedding(self, query, query_embedding, "the retriever")
        arguments = self._arguments(query_embedding, filters, top_k, scale_score, return_embedding)
        return {"documents": self.document_store.embedding_retrieval(**arguments)}

    @component.output_types(documents=list[Document])
    async def run_async(
        self,
        query_embedding: list[float] | None = None,
        filters: dict[str, Any] | None = None,
        top_k: int | None = None,
        scale_score: bool | None = None,
        return_embedding: bool | None = None,
        query: str | None = None,
    ) -> dict[str, list[Document]]:
        """:meth:`run` for ``AsyncPipeline``: the embedding and the search run in a worker
        thread, so they do not block the event loop."""
        query_embedding = await asyncio.to_thread(
            _query_embedding, self, query, query_embedding, "the retriever"
        )
        arguments = self._arguments(query_embedding, filters, top_k, scale_score, return_embedding)
        return {"documents": await self.document_store.embedding_retrieval_async(**arguments)}

    def _arguments(self, query_embedding, filters, top_k, scale_score, return_embedding) -> dict:
        """The store's ``embedding_retrieval`` arguments: run-time values over the defaults."""
        top_k = self.top_k if top_k is None else top_k
        if top_k < 0:
            raise ValueError(f"top_k must be at least 0, got {top_k}")
        return {
            "query_embedding": query_embedding,
            "filters": apply_filter_policy(self.filter_policy, self.filters, filters),
            "top_k": top_k,
            "scale_score": self.scale_score if scale_score is None else scale_score,
            "return_embedding": self.return_embedding
            if return_embedding is None
            else return_embedding,
        }


@component
class DensefitHybridRetriever:
    """Retrieves the documents of a :class:`DensefitDocumentStore` by BM25 over the query
    text, by the query embedding, or by both fused (``mode``), like Haystack's
    ``InMemoryBM25Retriever``, ``InMemoryEmbeddingRetriever`` and a ``DocumentJoiner`` with
    ``reciprocal_rank_fusion`` in one component, with filters applied to both sides before
    fusion.

    :param document_store: the store to search.
    :param mode: ``"hybrid"`` (default: needs ``query`` and ``query_embedding``), ``"bm25"``
        (``query``) or ``"dense"`` (``query_embedding``).
    :param filters: filters applied to every query (Haystack's syntax).
    :param top_k: how many documents to return.
    :param scale_score: scores in [0, 1] (dense: cosine ``(s + 1) / 2``; BM25
        ``expit(s / 8)``; fused: divided by their largest possible value).
    :param return_embedding: return the documents' embeddings too.
    :param filter_policy: how run-time filters combine with ``filters``: ``REPLACE``
        (default) or ``MERGE``.
    :param fusion: ``"rrf"`` (reciprocal rank fusion, default) or ``"weighted"``
        (min-max normalised scores, ``alpha`` x dense + (1 - ``alpha``) x BM25).
    :param rrf_k: the reciprocal rank fusion constant (60).
    :param alpha: the dense side's weight in weighted fusion (0.5).
    :param depth: documents each side ranks before fusion (100).
    :param runtime: what runs the store's model when ``query_embedding`` is not given and
        the mode needs it (the ``query`` text is embedded): ``"auto"`` (default),
        ``"torch"``, ``"onnx"``... as ``--runtime``.
    """

    def __init__(
        self,
        document_store: DensefitDocumentStore,
        mode: str = "hybrid",
        filters: dict[str, Any] | None = None,
        top_k: int = 10,
        scale_score: bool = False,
        return_embedding: bool = False,
        filter_policy: FilterPolicy = FilterPolicy.REPLACE,
        fusion: str = FUSION.default,
        rrf_k: int = RRF_K.default,
        alpha: float = DENSE_WEIGHT.default,
        depth: int = FUSION_DEPTH.default,
        runtime: str = RUNTIME.default,
    ) -> None:
        search_mode(mode)
        if fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}, not {fusion!r}")
        _retriever_init(
            self,
            document_store,
            filters,
            top_k,
            scale_score,
            return_embedding,
            filter_policy,
            runtime,
        )
        self.mode = mode
        self.fusion, self.rrf_k, self.alpha, self.depth = fusion, rrf_k, alpha, depth
        self._fusion = Fusion(method=fusion, rrf_k=rrf_k, alpha=alpha, depth=depth)

    def to_dict(self) -> dict[str, Any]:
        """Serialise the component (with its store's settings)."""
        return default_to_dict(
            self,
            document_store=self.document_store,
            mode=self.mode,
            filters=self.filters,
            top_k=self.top_k,
            scale_score=self.scale_score,
            return_embedding=self.return_embedding,
            filter_policy=self.filter_policy.value,
            fusion=self.fusion,
            rrf_k=self.rrf_k,
            alpha=self.alpha,
            depth=self.depth,
            runtime=self.runtime,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DensefitHybridRetriever:
        """The component :meth:`to_dict` described."""
        return _retriever_from_dict(cls, data)

    @component.output_types(documents=list[Document])
    def run(
        self,
        query: str | None = None,
        query_embedding: list[float] | None = None,
        filters: dict[str, Any] | None = None,
        top_k: int | None = None,
        scale_score: bool | None = None,
        return_embedding: bool | None = None,
    ) -> dict[str, list[Document]]:
        """The best ``top_k`` documents for the query (its text for BM25, its embedding for
        dense, both for hybrid; without ``query_embedding`` the text is embedded by the
        store's model through ``runtime``) among those matching the filters:
        ``{"documents": [...]}``, best first, each with ``score``."""
        method, arguments = self._call(
            query, query_embedding, filters, top_k, scale_score, return_embedding
        )
        if "query_embedding" in arguments:
            arguments["query_embedding"] = self._embedding(query, arguments["query_embedding"])
        return {"documents": getattr(self.document_store, method)(**arguments)}

    @component.output_types(documents=list[Document])
    async def run_async(
        self,
        query: str | None = None,
        query_embedding: list[float] | None = None,
        filters: dict[str, Any] | None = None,
        top_k: int | None = None,
        scale_score: bool | None = None,
        return_embedding: bool | None = None,
    ) -> dict[str, list[Document]]:
        """:meth:`run` for ``AsyncPipeline``: the embedding and the search run in a worker
        thread, so they do not block the event loop."""
        method, arguments = self._call(
            query, query_embedding, filters, top_k, scale_score, return_embedding
        )
        if "query_embedding" in arguments:
            arguments["query_embedding"] = await asyncio.to_thread(
                self._embedding, query, arguments["query_embedding"]
            )
        return {"documents": await getattr(self.document_store, f"{method}_async")(**arguments)}

    def _embedding(self, query, query_embedding):
        return _query_embedding(self, query, query_embedding, f"mode {self.mode!r}")

    def _call(
        self, query, query_embedding, filters, top_k, scale_score, return_embedding
    ) -> tuple[str, dict]:
        """The store method this retriever's mode calls and its arguments (run-time values
        over the defaults)."""
        filters = apply_filter_policy(self.filter_policy, self.filters, filters)
        top_k = self.top_k if top_k is None else top_k
        if top_k < 0:
            raise ValueError(f"top_k must be at least 0, got {top_k}")
        if reads_texts(self.mode) and query is None:
            raise ValueError(f"mode {self.mode!r} needs the query text: connect `query`")
        if embeds(self.mode) and query_embedding is None and query is None:
            raise ValueError(
                f"mode {self.mode!r} needs the query embedding: connect `query_embedding` "
                "(or `query`, embedded by the store's model)"
            )
        options = {
            "filters": filters,
            "top_k": top_k,
            "scale_score": self.scale_score if scale_score is None else scale_score,
            "return_embedding": self.return_embedding
            if return_embedding is None
            else return_embedding,
        }
        if not reads_texts(self.mode):
            return "embedding_retrieval", {"query_embedding": query_embedding, **options}
        if not embeds(self.mode):
            return "bm25_retrieval", {"query": query, **options}
        arguments = {"query": query, "query_embedding": query_embedding, **options}
        return "hybrid_retrieval", {**arguments, "fusion": self._fusion}
