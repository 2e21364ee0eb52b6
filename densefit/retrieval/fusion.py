"""Fusing rankings: reciprocal rank fusion and weighted normalised scores.

Hybrid search (:meth:`LocalDocumentStore.search <densefit.retrieval.index.store.
LocalDocumentStore.search>` with ``mode="hybrid"``) and hybrid mining (:mod:`densefit.mine`)
rank the same documents twice, by embedding and by BM25, and fuse the two lists:

- ``rrf`` (default): reciprocal rank fusion (Cormack et al. 2009): a document's score is
  ``sum over the lists of 1 / (rrf_k + rank)``, ranks from 1, ``rrf_k = 60``; a document
  missing from a list gets nothing from it. Scores do not matter, only ranks.
- ``weighted``: each list's scores are min-max normalised to [0, 1] over that list (all 1 when
  they are equal), then ``alpha x dense + (1 - alpha) x bm25`` (a document missing from a list
  counts 0 there; Weaviate's "relative score fusion").

Ties are broken by key (a store row, a corpus position): the earlier document first; a
store's search then orders equal fused scores by document id
(:func:`~densefit.retrieval.index.request.ranked_order`).
Each side ranks ``depth`` documents (100) before fusion; the fused list is cut to ``top_k``.

>>> fused = Fusion().fuse([np.array([7, 3]), np.array([3, 9])], top_k=3)
>>> fused[0].tolist(), [round(s, 5) for s in fused[1].tolist()]
([3, 7, 9], [0.03252, 0.01639, 0.01613])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from densefit.choices import FUSIONS
from densefit.config.shared import DENSE_WEIGHT, FUSION, FUSION_DEPTH, RRF_K

__all__ = ["Fusion", "reciprocal_rank_fusion", "weighted_fusion"]


@dataclass(frozen=True)
class Fusion:
    """How hybrid search fuses its dense and BM25 rankings (see the module docstring).

    ``method``: ``"rrf"`` or ``"weighted"``; ``rrf_k``: the RRF constant; ``alpha``: the
    dense list's weight in weighted fusion; ``depth``: documents each side ranks.

    >>> Fusion(method="weighted", alpha=0.7).alpha
    0.7
    """

    # The defaults of the options that set them (--fusion, --rrf-k, --dense-weight,
    # --fusion-depth: densefit.config.shared), so that one default holds everywhere.
    method: str = FUSION.default
    rrf_k: int = RRF_K.default
    alpha: float = DENSE_WEIGHT.default
    depth: int = FUSION_DEPTH.default

    def __post_init__(self):
        if self.method not in FUSIONS:
            raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}, not {self.method!r}")
        if isinstance(self.rrf_k, bool) or not isinstance(self.rrf_k, int) or self.rrf_k < 0:
            raise ValueError(f"rrf_k must be an integer >= 0, e.g. 60; got {self.rrf_k!r}")
        if not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1] (the dense side's weight); got {self.alpha}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth must be an integer >= 1, e.g. 100; got {self.depth!r}")

    def fuse(
        self,
        keys: Sequence[np.ndarray],
        top_k: int,
        scores: Sequence[np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Fuse ranked lists of ``keys`` (best first; the dense list first, then BM25) into
        the best ``top_k`` keys and their fused scores; ``weighted`` needs each list's
        ``scores``."""
        if self.method == "rrf":
            return reciprocal_rank_fusion(keys, top_k, rrf_k=self.rrf_k)
        if scores is None:
            raise ValueError("weighted fusion needs the scores of each list")
        n = len(keys)
        weights = [self.alpha, 1 - self.alpha] if n == 2 else [1 / n] * n if n else []
        return weighted_fusion(keys, scores, weights, top_k)

    def scaled(self, fused: np.ndarray, lists: int = 2) -> np.ndarray:
        """Fused scores mapped to [0, 1]: RRF divided by its largest possible value
        (first in every list), weighted scores as they are (already in [0, 1])."""
        fused = np.asarray(fused, dtype=np.float64)
        if self.method == "rrf":
            return fused / (lists / (self.rrf_k + 1))
        return fused


def reciprocal_rank_fusion(
    keys: Sequence[np.ndarray], top_k: int, *, rrf_k: int = RRF_K.default
) -> tuple[np.ndarray, np.ndarray]:
    """``sum 1 / (rrf_k + rank)`` over the lists (ranks from 1); the best ``top_k`` keys and
    their scores, ties by key.

    >>> reciprocal_rank_fusion([np.array([1, 2]), np.array([2, 1])], 2)[0].tolist()
    [1, 2]
    """
    parts = [np.asarray(k, dtype=np.int64) for k in keys]
    contributions = [1.0 / (rrf_k + np.arange(1, len(p) + 1, dtype=np.float64)) for p in parts]
    return _sum_by_key(parts, contributions, top_k)


def weighted_fusion(
    keys: Sequence[np.ndarray],
    scores: Sequence[np.ndarray],
    weights: Sequence[float],
    top_k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``sum weight x minmax(score)`` over the lists (0 where a key is missing from a list);
    the best ``top_k`` keys and their scores, ties by key.

    >>> keys, fused = weighted_fusion([np.array([1, 2])], [np.array([3.0, 1.0])], [1.0], 2)
    >>> keys.tolist(), fused.tolist()
    ([1, 2], [1.0, 0.0])
    """
    parts = [np.asarray(k, dtype=np.int64) for k in keys]
    contributions = []
    for weight, part, values in zip(weights, parts, scores, strict=True):
        values = np.asarray(values, dtype=np.float64)[: len(part)]
        low, high = (values.min(), values.max()) if len(values) else (0.0, 0.0)
        normal = (values - low) / (high - low) if high > low else np.ones_like(values)
        contributions.append(weight * normal)
    return _sum_by_key(parts, contributions, top_k)


def _sum_by_key(parts, contributions, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    if not parts or not sum(len(p) for p in parts):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    keys, inverse = np.unique(np.concatenate(parts), return_inverse=True)  # keys ascending
    fused = np.bincount(inverse, weights=np.concatenate(contributions), minlength=len(keys))
    order = np.lexsort((keys, -fused))[:top_k]  # best first, ties by key
    return keys[order], fused[order]
