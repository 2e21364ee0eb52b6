"""What every engine does alike: the checks of a search's and a write's inputs, the model
checks, and the search assembled once.

:class:`StoreCommon` is the base of every engine's store class. Its :meth:`~StoreCommon.search`
takes a :class:`~densefit.retrieval.index.request.SearchRequest` (the mode, the parsed
filter, ``top_k``, the fusion...), checks the queries, asks the engine for each side's
ranking (the embeddings, BM25, or both), fuses and scales them, and builds the hits; an
engine supplies the parts that touch its data (each documented in the class):
``_refresh``, ``_where``, ``_dense``, ``_lexical``, ``_documents_at`` and, optionally,
``_ids_at``, ``_reading`` and ``_faults`` (its error table, :class:`Fault` rows applied by
:func:`translated`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from densefit.data.corpus import non_finite_path
from densefit.data.types import Document
from densefit.errors import StorageFault
from densefit.retrieval.fusion import Fusion
from densefit.retrieval.index.filters import Filter
from densefit.retrieval.index.lexical import BM25_SCALE
from densefit.retrieval.index.request import (
    Ranked,
    SearchRequest,
    in_rank_order,
    past_ties,
)
from densefit.retrieval.index.settings import check_model, settings_of
from densefit.retrieval.index.types import (
    ModelSwappedError,
    SearchHit,
    StoreError,
    StoreRecord,
    SwapTarget,
    VectorSettings,
)

__all__ = [
    "Fault",
    "StoreCommon",
    "checked_documents",
    "checked_queries",
    "checked_query_texts",
    "checked_vectors",
    "normalise_rows",
    "one_line",
    "scaled_scores",
    "translated",
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


def checked_queries(record: StoreRecord, query_embeddings: np.ndarray) -> np.ndarray:
    """``(q, dim)`` float32 queries for a search of ``record``'s store, or ValueError."""
    queries = np.asarray(query_embeddings, dtype=np.float32)
    if queries.ndim == 1:
        queries = queries[None, :]
    if queries.ndim != 2 or queries.shape[1] != record.dim:
        raise ValueError(
            f"query embeddings have shape {np.shape(query_embeddings)}, but this store "
            f"holds {record.dim}-d embeddings from {record.model_name!r}"
        )
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


@dataclass(frozen=True)
class Fault:
    """One row of an engine's error table (:func:`translated`): the native errors it
    ``match`` es (exception classes, or a predicate) become ``error(message)``, where
    ``message`` is a template (``{detail}``: the first line of the native message; the
    engine writes the store's redacted location into it) or a function of the native error
    giving the message, the error itself, or None (not this row's after all).

    >>> table = [Fault(KeyError, "db://s: no such key ({detail})")]
    >>> try:
    ...     with translated(table):
    ...         {}["x"]
    ... except StoreError as error:
    ...     print(error)
    db://s: no such key ('x')
    """

    match: type | tuple[type, ...] | Callable[[BaseException], bool]
    message: str | Callable[[BaseException], str | BaseException | None]
    error: type[Exception] = StoreError

    def translate(self, exc: BaseException) -> BaseException | None:
        """The error ``exc`` becomes by this row (None: not this row's)."""
        kinds = self.match if isinstance(self.match, (type, tuple)) else None
        if not (isinstance(exc, kinds) if kinds is not None else self.match(exc)):
            return None
        if isinstance(self.message, str):
            return self.error(self.message.replace("{detail}", one_line(exc)))
        made = self.message(exc)
        return made if made is None or isinstance(made, BaseException) else self.error(made)


def one_line(exc: BaseException) -> str:
    """The first line of an error's message, whitespace folded (its type's name if empty)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return " ".join(lines[0].split()) if lines else type(exc).__name__


def translated(table: Sequence[Fault]) -> _Translated:
    """Run the block with an engine's native errors turned into densefit's: the first row of
    ``table`` that translates one gives the error raised instead (one line, naming the
    store); densefit's own errors (:class:`~densefit.retrieval.index.types.StoreError`,
    :class:`~densefit.errors.StorageFault`) and errors no row knows pass unchanged."""
    return _Translated(table)


class _Translated:
    """:func:`translated`'s context manager (a class: every search enters one)."""

    def __init__(self, table: Sequence[Fault]):
        self._table = table

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if not isinstance(exc, Exception) or isinstance(exc, (StoreError, StorageFault)):
            return False
        for row in self._table:
            error = row.translate(exc)
            if error is not None:
                raise error from None
        return False


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
    backend_name: str = ""

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
        """Raise :class:`~densefit.retrieval.index.types.ModelMismatchError` unless ``model``
        made this store's embeddings (:func:`~densefit.retrieval.index.settings.check_model`);
        checked once per model object until its parameters are modified."""
        with self._lock:
            self._refresh()
            version = _parameter_version(model)
            cached = self._checked.get(id(model))
            if cached is not None and cached[0]() is model and cached[1] == version:
                return
            check_model(self._record, model, self.location)
            self._checked[id(model)] = (weakref.ref(model), version)

    def check_settings(self, model, runtime=None) -> None:
        """Raise :class:`~densefit.retrieval.index.types.SettingsMismatchError` when
        ``model`` would embed documents differently (truncation, prompts, normalisation, or a
        ``runtime`` of another family than the stored vectors'; None: torch)."""
        with self._lock:
            self._refresh()
            self._record.check_settings(settings_of(model, runtime), self.location)

    def _loaded(self, record: StoreRecord, model_generation: int) -> None:
        """Take ``record`` and ``model_generation`` as just read from the store. The one
        rule of the model-check cache: a new model generation (a model swap) checks every
        model again."""
        if model_generation != self.model_generation:
            self._checked.clear()
        self._record, self.model_generation = record, model_generation

    # -- info ------------------------------------------------------------------------------

    def info(self) -> dict:
        """A summary for humans and ``--json``: engine, location (a password redacted),
        model, settings, size, the model swap under way, then the engine's own keys
        (:meth:`_info_extra`, which may also replace these); read as a search reads
        (:meth:`_reading`)."""
        with self._reading():
            self._refresh()
            settings = self.settings
            shared = {
                "engine": self.capabilities.engine,
                "path": self.location,
                "model": self.model_name,
                "dim": self.dim,
                "similarity": self.similarity,
                "vectors": self.vector_kind,
                "max_seq_length": settings.max_seq_length if settings else None,
                "normalize": settings.normalize if settings else None,
                "prompts": dict(settings.prompts) if settings else None,
                "runtime": settings.source.describe() if settings else None,
                "documents": self.count(),
                "dead_rows": self.dead_rows(),
                "backend": self.backend_name,
                "bm25": self.capabilities.lexical,
                "model_swaps": self.model_generation,
                "swap": self._swap_progress(),
            }
            return shared | self._info_extra()

    def _info_extra(self) -> dict:
        """The engine's own keys of :meth:`info` (read in its :meth:`_reading`)."""
        return {}

    # -- searching -------------------------------------------------------------------------

    def search(
        self,
        query_embeddings: np.ndarray | None = None,
        top_k: int = 10,
        *,
        query_texts: Sequence[str] | None = None,
        request: SearchRequest | None = None,
        filters: Filter | dict | None = None,
        scale_score: bool = False,
        mode: str = "dense",
        fusion: Fusion | None = None,
        dense_filters: Filter | dict | None = None,
        model_generation: int | None = None,
    ) -> list[list[SearchHit]]:
        """The ``top_k`` best documents for each query, best first.

        ``request`` (:class:`~densefit.retrieval.index.request.SearchRequest`, made where
        the search came in; its docstring says what each option does) says how to search;
        without one, the keyword options make it (passing both is a TypeError). Filters are
        checked against this engine's limits. The queries: ``query_embeddings`` (``(q, dim)``
        or one ``(dim,)`` vector; cosine stores normalise them) when the mode ranks by
        embeddings, ``query_texts`` (one text per query) when it ranks by BM25.
        """
        options = (top_k, filters, scale_score, mode, fusion, dense_filters, model_generation)
        if request is None:
            request = SearchRequest(
                mode, top_k, filters, fusion, scale_score, dense_filters, model_generation
            )
        elif options != (10, None, False, "dense", None, None, None):
            raise TypeError("search takes request= or its options (top_k, mode...), not both")
        request.within(self.capabilities)  # the engine can run the mode and the filters
        with self._reading():
            return self._search(request, query_embeddings, query_texts)

    def _search(self, request: SearchRequest, query_embeddings, query_texts):
        """:meth:`search` inside :meth:`_reading`."""
        self._refresh()  # first: the record the queries are checked against is current
        if request.model_generation not in (None, self.model_generation):
            raise ModelSwappedError(
                f"{self.location}: the store switched to the model {self.model_name!r}; "
                "embed the queries with it"
            )
        top_k, mode = request.top_k, request.mode
        embeds, reads_texts = request.embeds, request.reads_texts
        texts = checked_query_texts(query_texts, mode) if reads_texts else None
        queries = None
        if embeds:
            if query_embeddings is None:
                raise ValueError(f"{mode} search needs the query embeddings")
            queries = checked_queries(self._record, query_embeddings)
        if texts is not None and queries is not None and len(texts) != len(queries):
            raise ValueError(
                f"hybrid search got {len(texts)} query texts for {len(queries)} query embeddings"
            )
        filters, dense_filters = request.filters, request.dense_filters
        if filters is not None and dense_filters is not None:
            dense_filters = Filter.all_of(filters, dense_filters).within(self.capabilities)
        where = None if filters is None else self._where(filters)
        dense_where = where if dense_filters is None else self._where(dense_filters)
        fused = embeds and reads_texts
        fusion = (request.fusion or Fusion()) if fused else None
        depth = max(top_k, fusion.depth) if fused else top_k
        sides = []  # each side's rankings, holding every document tied with its last
        if embeds:
            sides.append(self._past_ties(self._dense, queries, depth, dense_where))
        if reads_texts:
            sides.append(self._past_ties(self._lexical, texts, depth, where))
        known: dict[int, str] = {}  # a tied document's id read once per search
        ordered = in_rank_order([r for side in sides for r in side], depth, self._ids_at, known)
        if not fused:
            similarity = self.similarity if embeds else "bm25"
            if request.scale_score:
                ordered = [r._replace(scores=scaled_scores(r.scores, similarity)) for r in ordered]
            return self._hits(ordered)
        ranked = []
        half = len(ordered) // 2
        for by_dense, by_bm25 in zip(ordered[:half], ordered[half:], strict=True):
            everything = len(by_dense.keys) + len(by_bm25.keys)
            keys, scores = fusion.fuse(
                [by_dense.keys, by_bm25.keys], everything, [by_dense.scores, by_bm25.scores]
            )
            documents = {**(by_bm25.documents or {}), **(by_dense.documents or {})}
            ranked.append(Ranked(keys, scores, documents))
        ranked = in_rank_order(ranked, top_k, self._ids_at, known)  # fused ties by id too
        if request.scale_score:
            ranked = [r._replace(scores=fusion.scaled(r.scores)) for r in ranked]
        return self._hits(ranked)

    def _past_ties(self, hook, inputs, depth: int, where) -> list[Ranked]:
        """``hook``'s (``_dense``, ``_lexical``) rankings of ``inputs`` (query embeddings or
        texts), each ``depth`` deep and one more, and more while its last one ties with its
        ``depth``-th (:func:`~densefit.retrieval.index.request.past_ties`), for
        :func:`~densefit.retrieval.index.request.in_rank_order` to order equal scores by
        document id, the same on every engine."""

        def ask(at: list[int], n: int) -> list:
            some = inputs  # the first ask: every query
            if len(at) < len(inputs):  # the queries whose last document still ties
                some = inputs[at] if isinstance(inputs, np.ndarray) else [inputs[i] for i in at]
            return hook(some, n, where)

        return past_ties(ask, len(inputs), depth)

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """What a search runs inside: the store object's lock (one call at a time); an
        engine adds what its reads need (a database snapshot, its errors translated)."""
        with self._lock:
            yield

    def _errors(self) -> _Translated:
        """The engine's native errors raised in the block as densefit's, by its table
        ``_faults`` (:class:`Fault` rows, set when the store opens: they name its location)."""
        return translated(self._faults)

    # -- what each engine supplies ----------------------------------------------------------

    _faults: Sequence[Fault] = ()  # the engine's error table (see _errors)

    def _refresh(self) -> None:
        """Make the record current (nothing to do for an engine that keeps none in memory)."""

    def _where(self, filters: Filter):
        """A parsed filter (within the engine's limits) emitted for the engine: SQL, a
        payload filter, the embedded store's matching rows."""
        raise NotImplementedError

    def _dense(self, queries: np.ndarray, k: int, where) -> list[Ranked]:
        """For each query, the best ``k`` documents matching ``where``: keys (``int64``, the
        engine's choice) and scores, best first, ties in any order (:meth:`search` asks one
        more than it needs, deeper while the last ties, and orders equal scores by id), and
        the documents when they came with the ranking. ``_lexical`` the same by BM25."""
        raise NotImplementedError

    def _lexical(self, texts: list[str], k: int, where) -> list[Ranked]:
        raise NotImplementedError

    def _documents_at(self, keys: list[int]) -> dict[int, tuple[str, str, str, dict]]:
        """``{key: (id, text, title, meta)}`` of the documents still stored under ``keys``
        (asked only for keys no hook returned the document of)."""
        raise NotImplementedError

    def _ids_at(self, keys: list[int]) -> dict[int, str]:
        """``{key: id}`` of the documents still stored under ``keys`` (to order tied scores;
        an engine may read the ids alone)."""
        return {key: document[0] for key, document in self._documents_at(keys).items()}

    def _hits(self, ranked: list[Ranked]) -> list[list[SearchHit]]:
        """Search hits for each query's :class:`~densefit.retrieval.index.request.Ranked`,
        best first: its documents, or :meth:`_documents_at` for the keys that came without
        one; a key whose document is gone (deleted since it was ranked) is left out."""
        docs: dict[int, tuple[str, str, str, dict]] = {}
        for r in ranked:
            docs.update(r.documents or {})
        missing = {int(k) for r in ranked for k in r.keys.tolist()} - docs.keys()
        if missing:
            docs.update(self._documents_at(sorted(missing)))
        results = []
        for r in ranked:
            hits = []
            for key, score in zip(r.keys.tolist(), np.asarray(r.scores).tolist(), strict=True):
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
