"""The contracts of the index package: search hits, errors, and the two Protocols.

A :class:`DocumentStore` keeps documents and their embeddings together, records which model
made the embeddings, and searches them. A :class:`VectorBackend` is the part that searches:
the store owns the committed vectors and hands them to the backend after every commit, so a
backend is a cache that can always be rebuilt from the store (exact search, FAISS...).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from densefit.data.types import Document

__all__ = [
    "DocumentStore",
    "ModelMismatchError",
    "SearchHit",
    "StoreError",
    "VectorBackend",
    "WriteResult",
]


class StoreError(ValueError):
    """A document store cannot do what was asked; the message says why and what to do.

    A ValueError: like bad input, it is the user's to fix, and the CLI prints it as one line.
    """


class ModelMismatchError(StoreError):
    """The store's embeddings were made by a different model than the one given."""


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
    """What :class:`~densefit.api.Retriever` and the CLI need from a store.

    Implemented by :class:`~densefit.retrieval.index.store.LocalDocumentStore`; the conformance suite in
    :mod:`densefit.testing.conformance` states the behaviour every implementation must have.
    """

    model_name: str
    dim: int
    similarity: str

    def check_model(self, model) -> None:
        """Raise :class:`ModelMismatchError` unless ``model`` made this store's embeddings."""
        ...

    def count(self) -> int:
        """The number of documents."""
        ...

    def write(self, documents: Sequence[Document], embeddings: np.ndarray) -> WriteResult:
        """Add or replace ``documents`` (by id) with their embeddings, in one transaction."""
        ...

    def delete(self, ids: Iterable[str]) -> int:
        """Delete documents by id, in one transaction; returns how many existed."""
        ...

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """The documents with these ids, None where an id is unknown."""
        ...

    def ids(self) -> Iterator[str]:
        """Every document id."""
        ...

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
    ) -> list[list[SearchHit]]:
        """The ``top_k`` best documents for each query (among those matching ``filters``,
        :mod:`densefit.retrieval.index.filters`): by ``query_embeddings`` (``mode="dense"``),
        by BM25 over ``query_texts`` (``"bm25"``) or by both fused (``"hybrid"``,
        ``fusion``: :class:`~densefit.retrieval.fusion.Fusion`)."""
        ...

    def close(self) -> None: ...
