"""What a search asks of a store (:class:`SearchRequest`, made once where a search comes in
and handed down as it is to :meth:`~densefit.retrieval.index.common.StoreCommon.search`, the
queries beside it), what an engine's ranking hook answers (:class:`Ranked`), and the one rule
that orders equal scores on every engine (:func:`ranked_order`).

>>> request = SearchRequest("hybrid", top_k=5, filters={"field": "meta.lang", "operator": "==", "value": "en"})
>>> request.embeds, request.reads_texts, request.filters.conditions
(True, True, 1)
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from densefit.choices import embeds, reads_texts, search_mode
from densefit.retrieval.fusion import Fusion
from densefit.retrieval.index.filters import Filter, parse_filters
from densefit.retrieval.index.registry import require

__all__ = [
    "TIE",
    "Ranked",
    "SearchRequest",
    "in_rank_order",
    "past_ties",
    "ranked_order",
    "tie_groups",
]

# The capability a mode needs beyond dense search, and how the refusal names the mode.
_NEEDS = {
    "bm25": ("lexical", "search by BM25 (--mode bm25)"),
    "hybrid": ("hybrid", "search by dense and BM25 fused (--mode hybrid)"),
}


@dataclass(frozen=True)
class SearchRequest:
    """How to search: the ``top_k`` best documents per query, by ``mode``
    (:data:`~densefit.choices.SEARCH_MODES`): ``"dense"`` by the query embeddings, ``"bm25"``
    by BM25 over the documents' texts (documents sharing no token with a query are not found,
    so fewer than ``top_k`` may come back), ``"hybrid"`` both fused by ``fusion`` (None:
    :class:`~densefit.retrieval.fusion.Fusion`'s defaults, reciprocal rank fusion).

    ``filters`` (Haystack's syntax, :mod:`~densefit.retrieval.index.filters`: a dict is
    parsed here, once; a :class:`~densefit.retrieval.index.filters.Filter` is kept) restricts
    the search to the matching documents *before* ranking, on both sides of a hybrid search:
    the best ``top_k`` that match. ``dense_filters``: further conditions on the dense side
    only (the Haystack store leaves documents without an embedding out of it, not out of
    BM25). ``scale_score`` maps scores to [0, 1]: dense as
    :func:`~densefit.retrieval.index.common.scaled_scores`, BM25 as ``expit(score / 8)``
    (Haystack's in-memory BM25), fused by :meth:`~densefit.retrieval.fusion.Fusion.scaled`.
    ``model_generation``: the store's model generation the query embeddings were made for
    (None: not checked); a store that switched to another model since (a model swap) raises
    :class:`~densefit.retrieval.index.types.ModelSwappedError` instead of ranking by the wrong
    model. ValueError (one line) for a bad value.

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
    (``int64``, the engine's own: a row, a write sequence) and their ``scores``, best first,
    ties in any order (:func:`in_rank_order` orders them); ``documents``: ``{key: (id, text,
    title, meta)}`` of the keys whose document came with the ranking (None: none did; the
    store reads the others)."""

    keys: np.ndarray
    scores: np.ndarray
    documents: dict[int, tuple[str, str, str, dict]] | None = None


# Scores closer than this (times the score, above 1) are equal: float32 rounding, which one
# engine's kernel may apply differently to two copies of one vector (Milvus Lite: 1 ulp).
TIE = 1e-6


def tie_groups(scores: Sequence[float]) -> list[int]:
    """For ``scores`` best first, the number of each one's group of equal scores (0, 1,
    ...): a group begins at a score and holds the next ones within :data:`TIE` of it (times
    the score where it is above 1), so a group never spans more than that.

    >>> tie_groups([0.9, 0.5000008, 0.5, 0.4999994, 0.1])  # no chain: 0.4999994 is a group
    [0, 1, 1, 2, 3]
    """
    values = np.asarray(scores, dtype=np.float64)
    if len(values) < 2:
        return list(range(len(values)))
    fresh = _fresh(values)
    if fresh.all():  # no two close: the usual case
        return list(range(len(values)))
    groups, anchor, group = [], 0.0, -1
    for score, new in zip(values.tolist(), [True, *fresh.tolist()], strict=True):
        if new or anchor - score > TIE * max(1.0, abs(anchor)):
            anchor, group = score, group + 1
        groups.append(group)
    return groups


def _fresh(values: np.ndarray) -> np.ndarray:
    """For ``values`` best first, whether each after the first lies so far below the one
    before that it begins a group (:func:`tie_groups`) whatever the group's first score."""
    return values[:-1] - values[1:] > 1.01 * TIE * np.maximum(1.0, np.abs(values[:-1]))


def _near(scores: np.ndarray, k: int) -> int:
    """How many of ``scores`` (best first) may tie with the ``k``-th: those not below it by
    more than twice :data:`TIE` (its group lies within :data:`TIE` of a first score that is
    at most :data:`TIE` above it)."""
    return int(np.searchsorted(-scores, -_tie_floor(float(scores[k - 1])), side="right"))


def _tie_floor(kth: float) -> float:
    """The lowest score that may tie with ``kth`` (:func:`_near`)."""
    return kth - 2 * TIE * max(1.0, abs(kth))


def ranked_order(ids: Sequence[str], scores: Sequence[float]) -> list[int]:
    """The positions of ``ids`` and their ``scores`` in ranking order, the one rule by which
    every engine ranks (dense, BM25 and fused alike): score descending, then, among equal
    scores (:func:`tie_groups`: within :data:`TIE`), document id ascending by code point (as
    Python compares strings).

    >>> ranked_order(["b", "c", "a", "d"], [0.5, 0.9, 0.5, 0.1])
    [1, 2, 0, 3]
    """
    scores = np.asarray(scores, dtype=np.float64).tolist()
    best = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable
    groups = [0] * len(scores)
    for i, group in zip(best, tie_groups([scores[i] for i in best]), strict=True):
        groups[i] = group
    return sorted(best, key=lambda i: (groups[i], ids[i]))


def past_ties(ask: Callable[[list[int], int], list], count: int, k: int) -> list[Ranked]:
    """The rankings of ``count`` queries, each deep enough to hold every document whose score
    equals its ``k``-th: ``ask(positions, depth)`` (an engine's hook for the queries at
    ``positions``) is asked for ``k + 1`` first (one more than wanted, so that a search
    without a tie at ``k`` costs one document more), then, for the queries whose last
    document still ties with their ``k``-th, for twice as many, until it does not or the
    engine has no more (answers fewer than asked).

    >>> scores = np.array([3.0, 2.0, 2.0, 2.0, 1.0])  # the engine's 5 documents, best first
    >>> def ask(positions, depth):
    ...     asked.append(depth)
    ...     return [(np.arange(5)[:depth], scores[:depth]) for _ in positions]
    >>> asked = []
    >>> [len(r.keys) for r in past_ties(ask, 1, 2)], asked  # the 2nd ties with the 3rd
    ([5], [3, 6])
    """
    answers: list[Ranked | None] = [None] * count
    pending, depth = list(range(count)), k + 1
    while pending:
        got = [a if isinstance(a, Ranked) else Ranked(*a) for a in ask(pending, depth)]
        for i, ranked in zip(pending, got, strict=True):
            answers[i] = ranked
        pending = [i for i, r in zip(pending, got, strict=True) if _open_tie(r.scores, k, depth)]
        depth *= 2
    return answers


def _open_tie(scores, k: int, depth: int) -> bool:
    """Whether the engine may hold more documents tied with the ``k``-th of ``scores``: it
    gave all ``depth`` asked for, and the last ties with the ``k``-th."""
    if len(scores) < depth:
        return False
    ordered = sorted(np.asarray(scores, dtype=np.float64).tolist(), reverse=True)
    if ordered[-1] < _tie_floor(ordered[k - 1]):  # the last lies well below the k-th
        return False
    return _through_ties(np.array(ordered), k) == len(ordered)


def _through_ties(scores: np.ndarray, k: int) -> int:
    """How many of ``scores`` (best first) are the ``k`` best and those tied with the ``k``-th
    (:func:`tie_groups`)."""
    if len(scores) <= k:
        return len(scores)
    near = _near(scores, k)  # what lies well below the k-th cannot tie with it
    groups = tie_groups(scores[:near])
    last = groups[k - 1]
    return groups.index(last + 1) if groups[-1] > last else near


def in_rank_order(
    rankings: Sequence[Ranked],
    k: int,
    ids_at: Callable[[list[int]], dict[int, str]],
    known: dict[int, str] | None = None,
) -> list[Ranked]:
    """Each ranking in :func:`ranked_order` (score, then document id) cut to its best ``k``;
    the ids of the keys whose score ties with another's come from the documents that came
    with the rankings, or ``known`` (``{key: id}``, added to: pass one dict to the calls
    of one search to read each id once), or else from ``ids_at(keys)`` (``{key: id}``, one
    call for every query). A ranking must hold every document tied with its ``k``-th
    (:func:`past_ties`); a tied key whose document is gone (deleted meanwhile) is left out.

    >>> ids = {7: "b", 8: "a", 9: "c"}
    >>> ranked = Ranked(np.array([7, 8, 9]), np.array([1.0, 1.0, 0.5]))  # 7 and 8 tie
    >>> in_rank_order([ranked], 1, lambda keys: {key: ids[key] for key in keys})[0].keys
    array([8])
    """
    cut = []
    for ranked in rankings:
        scores = np.asarray(ranked.scores, dtype=np.float64)
        keys = np.asarray(ranked.keys, dtype=np.int64)
        head = scores[: k + 1]
        if _fresh(head).all() and (len(scores) <= k + 1 or scores[k + 1 :].max() <= head[-1]):
            # best first and no two of the k + 1 best close: no tie to order (the usual case)
            cut.append((ranked, keys[:k], scores[:k], None))
            continue
        if (np.diff(scores) > 0).any():  # not best first
            best = np.argsort(-scores, kind="stable")
            scores, keys = scores[best], keys[best]
        keep = _through_ties(scores, k)
        scores, keys = scores[:keep], keys[:keep]
        groups = tie_groups(scores)
        if not groups or groups[-1] == len(groups) - 1:  # no two equal: the usual case
            cut.append((ranked, keys, scores, None))
            continue
        sizes = Counter(groups)
        tied = [sizes[group] > 1 for group in groups]
        cut.append((ranked, keys.tolist(), scores, tied))
    known = {} if known is None else known
    missing = {key for _, keys, _, tied in cut if tied for key, t in zip(keys, tied) if t}
    if missing:
        known.update((key, doc[0]) for r, *_ in cut for key, doc in (r.documents or {}).items())
        if missing - known.keys():
            known.update(ids_at(sorted(missing - known.keys())))
    answers = []
    for ranked, keys, scores, tied in cut:
        if tied is not None:  # the ids of the tied, in the one order of ranked_order
            kept = [i for i, t in enumerate(tied) if not t or keys[i] in known]
            ids = [known[keys[i]] if tied[i] else "" for i in kept]
            rows = np.array(kept, dtype=np.int64)[ranked_order(ids, scores[kept])]
            keys, scores = np.array(keys, dtype=np.int64)[rows], scores[rows]
        answers.append(Ranked(keys[:k], scores[:k], ranked.documents))
    return answers
