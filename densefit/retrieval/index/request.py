"""What a search asks of a store, and what an engine's ranking hook answers.

A :class:`SearchRequest` is made once where a search comes in (``densefit search``,
:class:`~densefit.api.Retriever` and evaluation through
:func:`~densefit.retrieval.index.searching.search_batch`, ``densefit serve``'s ``/search``,
the Haystack store's retrieval methods): the mode checked, the filter parsed, and handed
down as it is to :meth:`~densefit.retrieval.index.common.StoreCommon.search`. The queries
themselves (their embeddings, their texts) travel beside it.

An engine's ``_dense`` and ``_lexical`` hooks answer one :class:`Ranked` per query: the
keys and scores, best first, and the documents of those keys when the engine got them with
the ranking (a payload, output fields), so that the store reads only the others back.

>>> request = SearchRequest("hybrid", top_k=5, filters={"field": "meta.lang", "operator": "==", "value": "en"})
>>> request.embeds, request.reads_texts, request.filters.conditions
(True, True, 1)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from densefit.choices import embeds, reads_texts, search_mode
from densefit.retrieval.fusion import Fusion
from densefit.retrieval.index.filters import Filter, parse_filters
from densefit.retrieval.index.registry import require

__all__ = ["Ranked", "SearchRequest"]

# The capability a mode needs beyond dense search, and how the refusal names the mode.
_NEEDS = {
    "bm25": ("lexical", "search by BM25 (--mode bm25)"),
    "hybrid": ("hybrid", "search by dense and BM25 fused (--mode hybrid)"),
}


@dataclass(frozen=True)
class SearchRequest:
    """How to search: ``mode`` (:data:`~densefit.choices.SEARCH_MODES`), the ``top_k`` best
    documents per query among those matching ``filters`` (Haystack's syntax: a dict is
    parsed here, once; a :class:`~densefit.retrieval.index.filters.Filter` is kept),
    ``fusion`` for hybrid (None: :class:`~densefit.retrieval.fusion.Fusion`'s defaults),
    ``scale_score`` (scores mapped to [0, 1]), ``dense_filters`` (further conditions on the
    dense side only) and ``model_generation`` (the store's model generation the query
    embeddings were made for; None: not checked). ValueError (one line) for a bad value.

    >>> SearchRequest("bm25").embeds
    False
    >>> SearchRequest(top_k=0)
    Traceback (most recent call last):
    ...
    ValueError: top_k must be at least 1, got 0
    """

    mode: str = "dense"
    top_k: int = 10
    filters: Filter | None = None
    fusion: Fusion | None = None
    scale_score: bool = False
    dense_filters: Filter | None = None
    model_generation: int | None = None

    def __post_init__(self) -> None:
        search_mode(self.mode)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if self.fusion is not None and not isinstance(self.fusion, Fusion):
            raise TypeError(f"fusion must be a Fusion, got {type(self.fusion).__name__}")
        for name in ("filters", "dense_filters"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Filter):
                object.__setattr__(self, name, parse_filters(value))  # the one parse

    @property
    def embeds(self) -> bool:
        """Whether the search ranks by query embeddings (:func:`densefit.choices.embeds`)."""
        return embeds(self.mode)

    @property
    def reads_texts(self) -> bool:
        """Whether it ranks by BM25 over the query texts (:func:`densefit.choices.reads_texts`)."""
        return reads_texts(self.mode)

    @property
    def key(self) -> tuple:
        """Equal for requests that search alike (to search queries of several requests at once)."""
        return (
            self.mode,
            self.top_k,
            None if self.filters is None else self.filters.key,
            self.fusion,
            self.scale_score,
            None if self.dense_filters is None else self.dense_filters.key,
            self.model_generation,
        )

    def embedded_for(self, model_generation: int | None) -> SearchRequest:
        """This request for queries embedded for the store's ``model_generation``."""
        if model_generation == self.model_generation:
            return self
        return dataclasses.replace(self, model_generation=model_generation)

    def within(self, capabilities) -> SearchRequest:
        """This request when the engine of ``capabilities`` can run it (its mode, its
        filters' size); :class:`~densefit.retrieval.index.types.CapabilityError` or
        ValueError (one line) otherwise; None: any engine."""
        if capabilities is None:
            return self
        if self.mode in _NEEDS:
            require(capabilities, *_NEEDS[self.mode])
        for parsed in (self.filters, self.dense_filters):
            if parsed is not None:
                parsed.within(capabilities)
        return self


class Ranked(NamedTuple):
    """One query's ranking from an engine's ``_dense`` or ``_lexical`` hook: ``keys``
    (``int64``, in the order documents were written: ties go to the earlier one) and their
    ``scores``, best first; ``documents``: ``{key: (id, text, title, meta)}`` of the keys
    whose document came with the ranking (None: none did; the store reads the others)."""

    keys: np.ndarray
    scores: np.ndarray
    documents: dict[int, tuple[str, str, str, dict]] | None = None
