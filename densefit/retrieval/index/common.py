"""What every engine does alike: the checks of a search's and a write's inputs, the model
checks, and the search assembled once.

:class:`StoreCommon` is the base of every engine's store class. Its :meth:`~StoreCommon.search`
checks the mode, the queries and the filters, asks the engine for each side's ranking (the
embeddings, BM25, or both), fuses and scales them, and builds the hits; an engine supplies
the parts that touch its data:

- ``_refresh()``: make :attr:`record` and :attr:`model_generation` current (another process
  may have written or switched the model);
- ``_where(filters)``: a checked, non-empty filter compiled for the engine (SQL, a payload
  filter, the embedded store's matching rows);
- ``_dense(queries, k, where)`` and ``_lexical(texts, k, where)``: for each query, the best
  ``k`` matching documents as ``(keys, scores)``, best first; a key is an ``int64`` that
  orders documents as they were written (ties in a fused ranking go to the earlier one);
- ``_documents_at(keys)``: ``{key: (id, text, title, meta)}`` of the ranked documents, from
  which :meth:`~StoreCommon.search` builds the :class:`~densefit.retrieval.index.base.SearchHit` s.

The class also holds ``_lock`` (an ``RLock``: one call at a time per store object, which a
server's threads share).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import numpy as np

from densefit.choices import SEARCH_MODES
from densefit.data.corpus import non_finite_path
from densefit.data.types import Document
from densefit.retrieval.fusion import Fusion
from densefit.retrieval.index.base import ModelSwappedError, SearchHit
from densefit.retrieval.index.engines import require
from densefit.retrieval.index.filters import normalise_filters
from densefit.retrieval.index.lexical import BM25_SCALE
from densefit.retrieval.index.settings import StoreRecord, SwapTarget, VectorSettings

__all__ = [
    "StoreCommon",
    "checked_documents",
    "checked_mode",
    "checked_queries",
    "checked_query_texts",
    "checked_vectors",
    "normalise_rows",
    "scaled_scores",
]


def scaled_scores(scores: np.ndarray, similarity: str) -> np.ndarray:
    """Scores mapped to [0, 1] as Haystack does with ``scale_score=True``: cosine
    ``(s + 1) / 2``, dot product ``expit(s / 100)`` (its embedding retrievers), ``"bm25"``
    ``expit(s / 8)`` (its in-memory BM25 retriever). Order is kept.

    >>> scaled_scores(np.array([-1.0, 0.0, 1.0]), "cosine").tolist()
    [0.0, 0.5, 1.0]
    >>> scaled_scores(np.array([0.0]), "dot").tolist()
    [0.5]
    """
    scores = np.asarray(scores, dtype=np.float64)
    if similarity == "cosine":
        return (scores + 1) / 2
    if similarity == "dot":
        return 1 / (1 + np.exp(-scores / 100))
    if similarity == "bm25":
        return 1 / (1 + np.exp(-scores / BM25_SCALE))
    raise ValueError(f"no score scaling for similarity {similarity!r}: use cosine, dot or bm25")


def normalise_rows(vectors: np.ndarray) -> np.ndarray:
    """Unit-length rows. Rows already of unit length (to 1e-6) are left bit-for-bit alone, so
    that writing back a stored vector (an identical text's) gives exactly the same vector."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    norms = np.where((norms == 0) | (np.abs(norms - 1) <= 1e-6), 1, norms)
    return vectors / norms


def checked_mode(mode: str, capabilities=None) -> str:
    """``mode`` when it is a search mode (:data:`densefit.choices.SEARCH_MODES`) that the
    engine of ``capabilities`` (None: any) can run; ValueError or
    :class:`~densefit.retrieval.index.base.CapabilityError` (one line) otherwise.

    >>> checked_mode("hybrid")
    'hybrid'
    """
    if mode not in SEARCH_MODES:
        raise ValueError(f"mode must be one of {', '.join(SEARCH_MODES)}, not {mode!r}")
    if capabilities is not None and mode == "bm25":
        require(capabilities, "lexical", "search by BM25 (--mode bm25)")
    if capabilities is not None and mode == "hybrid":
        require(capabilities, "hybrid", "search by dense and BM25 fused (--mode hybrid)")
    return mode


def checked_queries(record: StoreRecord, query_embeddings: np.ndarray, top_k: int) -> np.ndarray:
    """``(q, dim)`` float32 queries for a search of ``record``'s store, or ValueError."""
    queries = np.asarray(query_embeddings, dtype=np.float32)
    if queries.ndim == 1:
        queries = queries[None, :]
    if queries.ndim != 2 or queries.shape[1] != record.dim:
        raise ValueError(
            f"query embeddings have shape {np.shape(query_embeddings)}, but this store "
            f"holds {record.dim}-d embeddings from {record.model_name!r}"
        )
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if not np.isfinite(queries).all():
        raise ValueError("query embeddings contain NaN or infinite values")
    return normalise_rows(queries) if record.similarity == "cosine" else queries


def checked_vectors(record: StoreRecord, documents: list, embeddings: np.ndarray) -> np.ndarray:
    """The float32 (normalised, for cosine stores) vectors of a write, or an error naming
    the document at fault (unique non-empty ids, the store's dimension, finite values)."""
    vectors = np.asarray(embeddings, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape != (len(documents), record.dim):
        raise ValueError(
            f"expected embeddings of shape ({len(documents)}, {record.dim}) for "
            f"{len(documents)} documents in a {record.dim}-d store, got {np.shape(embeddings)}"
        )
    checked_documents(documents)
    if not np.isfinite(vectors).all():
        bad = int(np.flatnonzero(~np.isfinite(vectors).all(axis=1))[0])
        raise ValueError(f"the embedding of document {documents[bad].id!r} has NaN/inf values")
    if record.similarity == "cosine":
        vectors = normalise_rows(vectors)
    if record.vector_kind == "float16" and np.abs(vectors).max(initial=0) > 65504:
        raise ValueError("embeddings exceed the float16 range: use a float32 store")
    return vectors


def checked_write(
    record: StoreRecord,
    documents: list,
    embeddings: np.ndarray,
    swap_embeddings: np.ndarray | None = None,
    swap_target: SwapTarget | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """A write's vectors for the store's model and, while a swap is under way, the next
    model's (:func:`checked_vectors` each; ``None`` when no ``swap_embeddings`` came): the
    checks every engine's :meth:`~densefit.retrieval.index.base.DocumentStore.write` makes
    before it touches anything."""
    vectors = checked_vectors(record, documents, embeddings)
    if swap_embeddings is None:
        return vectors, None
    if swap_target is None:
        raise ValueError("swap_embeddings need the swap_target they were made for")
    return vectors, checked_vectors(swap_target.record, documents, swap_embeddings)


def checked_documents(documents: Sequence[Document]) -> None:
    """Raise naming the document at fault unless every one is a :class:`Document` with a
    unique non-empty id and metadata of finite numbers (NaN would break every filter)."""
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
        bad = non_finite_path(doc.meta)
        if bad is not None:
            raise ValueError(
                f"document {doc.id!r}: meta.{bad} is NaN or infinite: metadata numbers must "
                "be finite (filters compare them)"
            )


def checked_query_texts(texts, mode: str) -> list[str]:
    """``texts`` as a list of strings, or an error saying that ``mode`` needs them."""
    if texts is None:
        raise ValueError(f"{mode} search needs the query texts (query_texts=[...])")
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"query_texts[{i}] is a {type(text).__name__}, not a string")
    return texts


def _parameter_version(model) -> int:
    """Changes whenever a parameter is modified in place (optimizer steps, load_state_dict)."""
    try:
        return sum(p._version for p in model.parameters())
    except (AttributeError, TypeError):  # pragma: no cover - not a torch module
        return -1


class StoreCommon:
    """The model checks and the search of every engine (see the module docstring)."""

    location: str
    capabilities = None  # each engine's class sets its module's Capabilities
    model_generation: int = 0

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._checked: dict[int, tuple[weakref.ref, int]] = {}

    # -- what made the vectors (engines set ``_record``) -----------------------------------------

    @property
    def record(self) -> StoreRecord:
        """The model and settings that made the vectors."""
        return self._record

    @property
    def model_name(self) -> str:
        return self._record.model_name

    @property
    def dim(self) -> int:
        return self._record.dim

    @property
    def similarity(self) -> str:
        return self._record.similarity

    @property
    def vector_kind(self) -> str:
        return self._record.vector_kind

    @property
    def settings(self) -> VectorSettings | None:
        """The settings the vectors were made with (None: not recorded, an older store)."""
        return self._record.settings

    # -- the model -------------------------------------------------------------------------

    def check_model(self, model) -> None:
        """Raise :class:`~densefit.retrieval.index.base.ModelMismatchError` unless ``model``
        made this store's embeddings (:meth:`StoreRecord.check_model <densefit.retrieval.
        index.settings.StoreRecord.check_model>`); checked once per model object until its
        parameters are modified."""
        with self._lock:
            self._refresh()
            version = _parameter_version(model)
            cached = self._checked.get(id(model))
            if cached is not None and cached[0]() is model and cached[1] == version:
                return
            self._record.check_model(model, self.location)
            self._checked[id(model)] = (weakref.ref(model), version)

    def check_settings(self, model, runtime=None) -> None:
        """Raise :class:`~densefit.retrieval.index.settings.SettingsMismatchError` when
        ``model`` would embed documents differently (truncation, prompts, normalisation, or a
        ``runtime`` of another family than the stored vectors'; None: torch)."""
        with self._lock:
            self._refresh()
            self._record.check_settings(VectorSettings.of(model, runtime), self.location)

    # -- searching -------------------------------------------------------------------------

    def search(
        self,
        query_embeddings: np.ndarray | None = None,
        top_k: int = 10,
        *,
        filters: dict | None = None,
        scale_score: bool = False,
        mode: str = "dense",
        query_texts: Sequence[str] | None = None,
        fusion: Fusion | None = None,
        dense_filters: dict | None = None,
        model_generation: int | None = None,
    ) -> list[list[SearchHit]]:
        """The ``top_k`` best documents for each query, best first.

        ``mode`` (:data:`densefit.choices.SEARCH_MODES`): ``"dense"`` ranks by the query
        embeddings (``query_embeddings``, ``(q, dim)`` or one ``(dim,)`` vector; cosine stores
        normalise them); ``"bm25"`` by BM25 over the documents' texts (``query_texts``, one
        text per query; documents sharing no token with a query are not found, so fewer than
        ``top_k`` may come back); ``"hybrid"`` fuses both rankings (``fusion``, default
        reciprocal rank fusion: :class:`~densefit.retrieval.fusion.Fusion`) and needs both.

        ``filters`` (Haystack's syntax, :mod:`~densefit.retrieval.index.filters`) restricts
        the search to the matching documents *before* ranking, on both sides of a hybrid
        search: the best ``top_k`` that match, not the ``top_k`` filtered afterwards.
        ``scale_score`` maps scores to [0, 1]: dense as
        :func:`scaled_scores`, BM25 as
        ``expit(score / 8)`` (Haystack's in-memory BM25), fused scores by
        :meth:`Fusion.scaled <densefit.retrieval.fusion.Fusion.scaled>`. ``dense_filters``
        are further conditions for the dense side only (the Haystack store leaves documents
        without an embedding out of it, not out of BM25). ``model_generation``: the
        :attr:`model_generation` the query embeddings were made for; when the store has
        switched to another model since (a model swap),
        :class:`~densefit.retrieval.index.base.ModelSwappedError` instead of a ranking by
        the wrong model.
        """
        checked_mode(mode, self.capabilities)
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        with self._lock:
            self._refresh()  # first: the record the queries are checked against is current
            if model_generation is not None and model_generation != self.model_generation:
                raise ModelSwappedError(
                    f"{self.location}: the store switched to the model {self.model_name!r}; "
                    "embed the queries with it"
                )
            texts = None if mode == "dense" else checked_query_texts(query_texts, mode)
            queries = None
            if mode != "bm25":
                if query_embeddings is None:
                    raise ValueError(f"{mode} search needs the query embeddings")
                queries = checked_queries(self._record, query_embeddings, top_k)
            if texts is not None and queries is not None and len(texts) != len(queries):
                raise ValueError(
                    f"hybrid search got {len(texts)} query texts for {len(queries)} query "
                    "embeddings"
                )
            fusion = fusion or Fusion()
            filters = normalise_filters(filters)
            where = None if filters is None else self._where(filters)
            dense_where = where
            if normalise_filters(dense_filters) is not None:
                both = [f for f in (filters, dense_filters) if f]
                dense_where = self._where({"operator": "AND", "conditions": both})
            if mode == "dense":
                ranked = self._dense(queries, top_k, dense_where)
                if scale_score:
                    ranked = [(k, scaled_scores(s, self.similarity)) for k, s in ranked]
            elif mode == "bm25":
                ranked = self._lexical(texts, top_k, where)
                if scale_score:
                    ranked = [(k, scaled_scores(s, "bm25")) for k, s in ranked]
            else:
                depth = max(top_k, fusion.depth)
                dense = self._dense(queries, depth, dense_where)
                lexical = self._lexical(texts, depth, where)
                ranked = []
                for (dense_keys, dense_scores), (bm25_keys, bm25_scores) in zip(
                    dense, lexical, strict=True
                ):
                    keys, fused = fusion.fuse(
                        [dense_keys, bm25_keys], top_k, [dense_scores, bm25_scores]
                    )
                    ranked.append((keys, fusion.scaled(fused) if scale_score else fused))
            return self._hits(ranked)

    # -- what each engine supplies ----------------------------------------------------------

    def _refresh(self) -> None:
        """Make the record current (nothing to do for an engine that keeps none in memory)."""

    def _where(self, filters: dict):
        raise NotImplementedError

    def _dense(self, queries: np.ndarray, k: int, where) -> list[tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError

    def _lexical(self, texts: list[str], k: int, where) -> list[tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError

    def _documents_at(self, keys: list[int]) -> dict[int, tuple[str, str, str, dict]]:
        """``{key: (id, text, title, meta)}`` of the documents still stored under ``keys``."""
        raise NotImplementedError

    def _hits(self, ranked: list[tuple[np.ndarray, np.ndarray]]) -> list[list[SearchHit]]:
        """Search hits for each query's ``(keys, scores)``, best first; a key whose document
        is gone (deleted since it was ranked) is left out."""
        docs = self._documents_at(sorted({int(k) for keys, _ in ranked for k in keys}))
        results = []
        for keys, scores in ranked:
            hits = []
            for key, score in zip(keys.tolist(), np.asarray(scores).tolist(), strict=True):
                if key in docs:
                    doc_id, text, title, meta = docs[key]
                    hits.append(SearchHit(doc_id, float(score), len(hits) + 1, text, title, meta))
            results.append(hits)
        return results

    # -- context manager -------------------------------------------------------------------

    def __len__(self) -> int:
        return self.count()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
