"""The store contract: :class:`DocumentStore`, the core every engine implements, and the
optional roles (:class:`Reembedding`, :class:`ModelSwap`, :class:`Upkeep`,
:class:`MetadataStats`) an engine implements as its
:class:`~densefit.retrieval.index.types.Capabilities` declare; docs/architecture.md (the store
contract) lists their members and the commands that check for each before they start. The
records and errors they speak of are :mod:`~densefit.retrieval.index.types`'s; the
conformance suite (:mod:`densefit.testing.conformance`) states the behaviour of the core and
of every role, and runs on each engine for the roles it declares. :class:`VectorBackend` is
the embedded store's search part.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import numpy as np

from densefit.data.types import Document
from densefit.retrieval.index.types import (
    Capabilities,
    SearchHit,
    StoreRecord,
    SwapTarget,
    WriteResult,
)

__all__ = [
    "ROLES",
    "DocumentStore",
    "MetadataStats",
    "ModelSwap",
    "Reembedding",
    "Upkeep",
    "VectorBackend",
    "members",
]


@runtime_checkable
class DocumentStore(Protocol):
    """The core every engine implements (:func:`~densefit.retrieval.index.engines.open_store`
    gives one); the optional roles below add to it. Every method is safe to call from
    several threads. ``model_name``, ``dim``, ``similarity``, ``vector_kind`` and
    ``settings`` are :attr:`record`'s (the shared base class offers them as properties).
    """

    # -- what the store is -----------------------------------------------------------------
    location: str  # the target it was opened from, for messages (a folder, a URL)
    capabilities: Capabilities
    model_generation: int  # model swaps the store went through (searches say which they embed for)

    @property
    def record(self) -> StoreRecord:
        """The model and settings that made the vectors."""
        ...

    def info(self) -> dict:
        """A summary for humans and ``--json``: engine, model, settings, counts."""
        ...

    # -- the model -------------------------------------------------------------------------
    def check_model(self, model) -> None:
        """Raise :class:`~densefit.retrieval.index.types.ModelMismatchError` unless ``model``
        made this store's embeddings."""
        ...

    def check_settings(self, model, runtime=None) -> None:
        """Raise :class:`~densefit.retrieval.index.types.SettingsMismatchError` when ``model``
        (run by ``runtime``) would embed documents differently from the stored ones."""
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

    # -- searching -------------------------------------------------------------------------
    def search(
        self,
        query_embeddings: np.ndarray | None = None,
        top_k: int = 10,
        *,
        query_texts: Sequence[str] | None = None,
        request=None,
        filters: dict | None = None,
        scale_score: bool = False,
        mode: str = "dense",
        fusion=None,
        dense_filters: dict | None = None,
        model_generation: int | None = None,
    ) -> list[list[SearchHit]]:
        """The ``top_k`` best documents for each query among those matching ``filters``
        (:mod:`densefit.retrieval.index.filters`): by ``query_embeddings`` (``mode="dense"``),
        by BM25 over ``query_texts`` (``"bm25"``) or by both fused (``"hybrid"``, ``fusion``:
        :class:`~densefit.retrieval.fusion.Fusion`). ``request``: a
        :class:`~densefit.retrieval.index.request.SearchRequest` holding those options
        (made once where the search came in) instead of them;
        :meth:`~densefit.retrieval.index.common.StoreCommon.search` assembles it for every
        engine."""
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

    # -- the store as a whole ----------------------------------------------------------------
    def flush(self) -> None:
        """Persist caches; documents are durable once a write returns."""
        ...

    def drop(self) -> None:
        """Delete everything this store holds at its target (documents, vectors, its model
        record: the embedded store's files, a database's tables or collections) and close
        it; opening the target afterwards finds no store."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> DocumentStore: ...

    def __exit__(self, *exc) -> None: ...


@runtime_checkable
class Reembedding(Protocol):
    """Re-embedding every document with new settings of the same model, in place
    (``densefit index --reembed``; :attr:`Capabilities.reembedding`)."""

    def start_reembedding(self, model, runtime=None) -> None:
        """Record ``model``'s settings and mark every stored vector stale."""
        ...

    def stale_ids(self, ids: Sequence[str]) -> set[str]:
        """The stale ones among ``ids`` (a write of a document makes it current)."""
        ...

    def all_stale_ids(self) -> list[str]:
        """Every stale id, in write order."""
        ...

    def finish_reembedding(self) -> None:
        """Clear the mark once no vector is stale."""
        ...


@runtime_checkable
class ModelSwap(Protocol):
    """A new model's vectors built beside the current ones and switched to atomically
    (``densefit reembed``, serve's swap; :attr:`Capabilities.model_swap`)."""

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


@runtime_checkable
class Upkeep(Protocol):
    """Keeping a store's side structures current (:attr:`Capabilities.upkeep`)."""

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

    def index_meta_field(self, field: str) -> None:
        """Make filters on a metadata field look documents up (idempotent)."""
        ...


@runtime_checkable
class MetadataStats(Protocol):
    """Statistics of the documents' metadata (:attr:`Capabilities.metadata_stats`)."""

    def meta_values(self, field: str, filters: dict | None = None) -> list[tuple[object, int]]:
        """Each distinct value of a metadata field among the matches, with its count."""
        ...

    def meta_range(self, field: str, filters: dict | None = None) -> tuple[object, object]:
        """``(min, max)`` of a metadata field's numbers (else strings) among the matches."""
        ...

    def meta_fields(self) -> dict[str, dict[str, int]]:
        """``{top-level metadata key: {JSON type: documents}}``."""
        ...


# Each optional role, by the Capabilities field that declares it.
ROLES: dict[str, type] = {
    "reembedding": Reembedding,
    "model_swap": ModelSwap,
    "upkeep": Upkeep,
    "metadata_stats": MetadataStats,
}


def members(protocol: type) -> list[str]:
    """The members a protocol of this module asks for (attributes, properties, methods,
    ``__enter__``/``__exit__``), sorted.

    >>> len(members(DocumentStore)), len(members(Upkeep))
    (26, 5)
    """
    names = set(getattr(protocol, "__annotations__", {}))
    for name in vars(protocol):
        if not name.startswith("_") or name in ("__enter__", "__exit__"):
            names.add(name)
    return sorted(names)


@runtime_checkable
class VectorBackend(Protocol):
    """Searches a store's committed vectors by inner product (exact search, FAISS...): a
    cache that can always be rebuilt from the store, which owns the vectors.

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
