"""The store contract: what every engine holding densefit's documents and vectors does.

A :class:`DocumentStore` keeps documents (id, text, title, ``meta``) and their embeddings
together, records which model made the embeddings and with which settings, and searches them
by embedding, by BM25 over the texts, or both fused, among the documents a filter (Haystack's
syntax) lets through. Indexing, search, evaluation, serving, re-embedding, mining and the
Haystack integration need nothing else from a store; :func:`~densefit.retrieval.index.engines.
open_store` is the one way to get one, for a target naming the engine:

- a folder: the embedded store (SQLite and a vector file, :mod:`~densefit.retrieval.index.store`);
- ``postgresql://...``: PostgreSQL with pgvector (:mod:`~densefit.retrieval.index.pgvector`);
- ``qdrant://host:port/collection`` or ``qdrant:FOLDER``: Qdrant
  (:mod:`~densefit.retrieval.index.qdrant`).

Engines differ in what they can do, and say so in their :class:`Capabilities`: a command that
asks for something its engine lacks gets one line naming the engines that can
(:class:`CapabilityError`). The conformance suite (:mod:`densefit.testing.conformance`) states
the behaviour every engine shows and runs on each.

A :class:`VectorBackend` is the embedded store's search part: the store owns the committed
vectors and hands them to the backend after every commit, so a backend is a cache that can
always be rebuilt from the store (exact search, FAISS...).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from densefit.data.types import Document

if TYPE_CHECKING:  # the record types are the settings module's; it imports this one
    from densefit.retrieval.index.settings import StoreRecord, SwapTarget, VectorSettings

__all__ = [
    "Capabilities",
    "CapabilityError",
    "DocumentStore",
    "ModelMismatchError",
    "ModelSwappedError",
    "NoStoreError",
    "SearchHit",
    "StoreError",
    "VectorBackend",
    "WriteResult",
]


class StoreError(ValueError):
    """A document store cannot do what was asked; the message says why and what to do.

    A ValueError: like bad input, it is the user's to fix, and the CLI prints it as one line.
    """


class NoStoreError(StoreError):
    """There is no store at the target (and it was not to be created)."""


class ModelMismatchError(StoreError):
    """The store's embeddings were made by a different model than the one given."""


class ModelSwappedError(StoreError):
    """The store switched to another model since the caller embedded its queries: embed
    them again with the store's model (:attr:`DocumentStore.model_generation`)."""


class CapabilityError(StoreError):
    """The store's engine cannot do what was asked; the message names the engines that can."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared once by its module.

    ``vector_kinds``: the vector kinds it stores (:data:`densefit.choices.VECTOR_KINDS`);
    ``backends``: the vector searches it offers (:data:`densefit.choices.SEARCH_BACKENDS`;
    the first is its default); ``lexical``: how ``mode="bm25"`` ranks (None: not at all);
    ``hybrid``: dense and lexical fused; ``model_swap``: a new model's vectors built beside
    the current ones and switched to atomically (``densefit reembed``); ``transactions``: a
    write commits all its documents or none; ``crash_safe``: a process killed at any point
    leaves the last committed state readable, and indexing resumes (the conformance suite
    kills one to check); ``compaction``: dead vectors are dropped by :meth:`DocumentStore.
    compact` rather than by the engine itself; ``shared``: several processes (servers behind
    a load balancer) may serve one store and see each other's writes.
    """

    engine: str
    vector_kinds: tuple[str, ...]
    backends: tuple[str, ...]
    lexical: str | None
    hybrid: bool
    model_swap: bool
    transactions: bool
    crash_safe: bool
    compaction: bool
    shared: bool


@dataclass(frozen=True)
class SearchHit:
    """One search result: the document, its score (higher is better) and its 1-based rank."""

    id: str
    score: float
    rank: int
    text: str = ""
    title: str = ""
    meta: dict = field(default_factory=dict, hash=False, compare=False)

    def snippet(self, width: int = 160) -> str:
        """The start of the text, whitespace folded, cut at a word boundary near ``width``.

        >>> SearchHit("d1", 0.5, 1, text="Cells   divide.\\nOften.").snippet()
        'Cells divide. Often.'
        """
        if width < 1:
            raise ValueError(f"width must be at least 1 character, got {width}")
        text = " ".join(self.text.split())
        if len(text) <= width:
            return text
        cut = text.rfind(" ", 0, width)
        return text[: cut if cut > width // 2 else width].rstrip() + " ..."

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "id": self.id,
            "score": self.score,
            "title": self.title,
            "text": self.text,
            "meta": self.meta,
        }


@dataclass(frozen=True)
class WriteResult:
    """What one committed write did."""

    added: int = 0
    updated: int = 0


@runtime_checkable
class VectorBackend(Protocol):
    """Searches a store's committed vectors by inner product.

    The store calls :meth:`update` after every commit (and once when it opens) with *all*
    committed rows: rows are only ever appended, and ``alive[i]`` says whether row ``i``
    still belongs to a document (updates and deletes leave dead rows behind until the store
    compacts; after compaction the store builds a new backend).
    """

    name: str

    def update(self, vectors: np.ndarray, alive: np.ndarray) -> None:
        """See the committed ``(n, dim)`` vectors and the ``(n,)`` bool mask of live rows."""
        ...

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The best ``k`` live rows for each of the ``(q, dim)`` float32 queries.

        Returns ``(scores, rows)``, both ``(q, k)``, best first; where fewer than ``k`` live
        rows exist, the tail has ``rows == -1`` and ``scores == -inf``.
        """
        ...

    def flush(self) -> None:
        """Persist whatever the backend caches on disk (a no-op for exact search)."""
        ...


@runtime_checkable
class DocumentStore(Protocol):
    """What index, search, eval, serve, reembed, mining and the Haystack integration need
    from a store; every engine implements all of it (:func:`~densefit.retrieval.index.
    engines.open_store` gives one). Members an engine's :class:`Capabilities` leave out
    raise :class:`CapabilityError`. Every method is safe to call from several threads.
    """

    # -- what the store is -----------------------------------------------------------------
    location: str  # the target it was opened from, for messages (a folder, a URL)
    capabilities: Capabilities
    model_name: str
    dim: int
    similarity: str  # densefit.choices.SIMILARITIES
    vector_kind: str  # densefit.choices.VECTOR_KINDS
    model_generation: int  # model swaps the store went through (searches say which they embed for)

    @property
    def record(self) -> StoreRecord:
        """The model and settings that made the vectors."""
        ...

    @property
    def settings(self) -> VectorSettings | None:
        """How the vectors were made (None: not recorded)."""
        ...

    def info(self) -> dict:
        """A summary for humans and ``--json``: engine, model, settings, counts."""
        ...

    # -- the model -------------------------------------------------------------------------
    def check_model(self, model) -> None:
        """Raise :class:`ModelMismatchError` unless ``model`` made this store's embeddings."""
        ...

    def check_settings(self, model, runtime=None) -> None:
        """Raise :class:`~densefit.retrieval.index.settings.SettingsMismatchError` when
        ``model`` (run by ``runtime``) would embed documents differently from the stored ones."""
        ...

    def adopt_runtime(self, source) -> bool:
        """Record ``source`` as what makes the vectors while the store is empty."""
        ...

    # -- reading ---------------------------------------------------------------------------
    def count(self) -> int: ...

    def count_matching(self, filters: dict | None = None) -> int: ...

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """The documents with these ids, None where an id is unknown."""
        ...

    def ids(self) -> Iterator[str]:
        """Every document id, in id order."""
        ...

    def hashes(self, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """``{id: (text hash, meta hash)}`` of the stored ids (indexing skips unchanged ones)."""
        ...

    def vectors(self, ids: Sequence[str]) -> np.ndarray:
        """The stored float32 embeddings of ``ids`` (KeyError for an unknown id)."""
        ...

    def vectors_for_texts(self, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """A stored, current vector per text hash the store holds (copied, not re-encoded)."""
        ...

    def filter_documents(self, filters: dict | None = None) -> list[Document]:
        """The documents matching ``filters``, in the order they were written."""
        ...

    def meta_values(self, field: str, filters: dict | None = None) -> list[tuple[object, int]]:
        """Each distinct value of a metadata field among the matches, with its count."""
        ...

    def meta_range(self, field: str, filters: dict | None = None) -> tuple[object, object]:
        """``(min, max)`` of a metadata field's numbers (else strings) among the matches."""
        ...

    def meta_fields(self) -> dict[str, dict[str, int]]:
        """``{top-level metadata key: {JSON type: documents}}``."""
        ...

    def index_meta_field(self, field: str) -> None:
        """Make filters on a metadata field look documents up (idempotent)."""
        ...

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
        fusion=None,
        dense_filters: dict | None = None,
        model_generation: int | None = None,
    ) -> list[list[SearchHit]]:
        """The ``top_k`` best documents for each query among those matching ``filters``
        (:mod:`densefit.retrieval.index.filters`): by ``query_embeddings`` (``mode="dense"``),
        by BM25 over ``query_texts`` (``"bm25"``) or by both fused (``"hybrid"``, ``fusion``:
        :class:`~densefit.retrieval.fusion.Fusion`); :class:`~densefit.retrieval.index.
        ranking.RankedSearch` assembles it for every engine."""
        ...

    # -- writing ---------------------------------------------------------------------------
    def write(
        self,
        documents: Sequence[Document],
        embeddings: np.ndarray,
        *,
        swap_embeddings: np.ndarray | None = None,
        swap_target: SwapTarget | None = None,
    ) -> WriteResult:
        """Add or replace ``documents`` (by id) with their embeddings; while a model swap is
        under way, ``swap_embeddings`` are the new model's vectors of the same texts."""
        ...

    def write_metadata(self, documents: Sequence[Document]) -> int:
        """Replace title and metadata of stored documents (their text and vector stay)."""
        ...

    def delete(self, ids: Iterable[str]) -> int:
        """Delete documents by id; returns how many existed."""
        ...

    def writer_lock(
        self, timeout: float | None = None, *, name: str | None = None, doing: str | None = None
    ) -> AbstractContextManager:
        """Hold the store's lock ``name`` (the writer lock by default) across processes:
        one indexer (or one model swap) at a time; waits ``timeout`` seconds (None: for ever)."""
        ...

    # -- re-embedding with new settings (densefit index --reembed) ------------------------------
    def start_reembedding(self, model, runtime=None) -> None:
        """Record ``model``'s settings and mark every stored vector stale."""
        ...

    def stale_ids(self, ids: Sequence[str]) -> set[str]: ...

    def all_stale_ids(self) -> list[str]: ...

    def finish_reembedding(self) -> None: ...

    # -- a model swap (densefit reembed; Capabilities.model_swap) ------------------------------
    def swap_target(self) -> SwapTarget | None:
        """The model swap under way (None: none, or an engine without swaps)."""
        ...

    def begin_swap(self, target: StoreRecord) -> tuple[SwapTarget, bool]: ...

    def swap_pending(self, after_row: int, limit: int) -> list[tuple[int, str, str]]: ...

    def write_swap(
        self, target: SwapTarget, pending: Sequence[tuple[int, str]], embeddings: np.ndarray
    ) -> int: ...

    def finish_swap(self, target: SwapTarget) -> bool: ...

    def cancel_swap(self) -> bool: ...

    # -- upkeep ----------------------------------------------------------------------------
    def dead_rows(self) -> int:
        """Vectors kept for updated or deleted documents until :meth:`compact` (0 where the
        engine reclaims them itself)."""
        ...

    def compact(self) -> int:
        """Drop dead vectors; returns how many (0 where the engine reclaims them itself)."""
        ...

    @property
    def bm25_loaded(self) -> bool:
        """Whether this process holds a BM25 index to keep current (:meth:`update_bm25`)."""
        ...

    def update_bm25(self) -> bool:
        """Bring this process's BM25 index up to date now; whether it changed."""
        ...

    def flush(self) -> None:
        """Persist caches; documents are durable once a write returns."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> DocumentStore: ...

    def __exit__(self, *exc) -> None: ...
