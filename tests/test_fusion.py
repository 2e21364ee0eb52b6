"""Fusion's edges, which the hybrid tests do not reach: empty and uneven lists, a third list,
the cut to top_k, key and score types, the option bounds (bench/results/mutation.md:
the mutants of densefit/retrieval/fusion.py these kill)."""

from __future__ import annotations

import numpy as np
import pytest

from densefit.retrieval.fusion import Fusion, reciprocal_rank_fusion, weighted_fusion


@pytest.mark.parametrize("method", ["rrf", "weighted"])
@pytest.mark.parametrize("lists", [[], [[]], [[], []]])
def test_nothing_to_fuse_is_empty_keys_and_scores_of_their_types(method, lists):
    keys, fused = Fusion(method=method).fuse(
        [np.asarray(k, dtype=np.int64) for k in lists], 5, [np.zeros(0)] * len(lists)
    )
    assert keys.shape == fused.shape == (0,)
    assert keys.dtype == np.int64 and fused.dtype == np.float64


def test_keys_come_back_as_int64_whatever_they_came_as():
    for fuse in (
        lambda k: reciprocal_rank_fusion(k, 3),
        lambda k: weighted_fusion(k, [np.array([1.0]), np.zeros(0)], [0.5, 0.5], 3),
    ):
        keys, _ = fuse([np.array([7], dtype=np.int32), []])
        assert keys.dtype == np.int64 and keys.tolist() == [7]


def test_an_empty_list_beside_a_full_one_fuses_the_full_one():
    keys, fused = weighted_fusion(
        [np.array([4, 2]), np.zeros(0, dtype=np.int64)],
        [np.array([3.0, 1.0]), np.zeros(0)],
        [0.25, 0.75],
        5,
    )
    assert keys.tolist() == [4, 2] and fused.tolist() == [0.25, 0.0]


def test_the_fused_list_is_cut_to_top_k():
    dense, bm25 = np.array([1, 2, 3]), np.array([4, 5, 6])
    scores = [np.array([3.0, 2.0, 1.0]), np.array([3.0, 2.0, 1.0])]
    for fusion in (Fusion(), Fusion(method="weighted")):
        keys, fused = fusion.fuse([dense, bm25], 2, scores)
        assert len(keys) == len(fused) == 2
    assert len(weighted_fusion([dense, bm25], scores, [0.5, 0.5], 1)[0]) == 1


def test_rrf_k_is_the_fusions_own():
    keys, fused = Fusion(rrf_k=0).fuse([np.array([5, 6]), np.array([6])], 2)
    assert keys.tolist() == [6, 5] and fused.tolist() == [1.5, 1.0]


def test_three_lists_weigh_a_third_each():
    keys, fused = Fusion(method="weighted", alpha=0.9).fuse(
        [np.array([1, 2]), np.array([2, 3]), np.array([3, 1])],
        3,
        [np.array([2.0, 1.0])] * 3,
    )
    assert keys.tolist() == [1, 2, 3]
    np.testing.assert_allclose(fused, [1 / 3, 1 / 3, 1 / 3], rtol=0, atol=1e-15)


def test_weighted_fusion_needs_one_weight_and_one_score_list_per_list():
    with pytest.raises(ValueError, match="^weighted fusion needs the scores of each list$"):
        Fusion(method="weighted").fuse([np.array([1])], 1)
    with pytest.raises(ValueError):  # zip(strict=True): a list without its scores
        weighted_fusion([np.array([1]), np.array([2])], [np.array([1.0])], [0.5, 0.5], 2)
    with pytest.raises(ValueError):
        weighted_fusion([np.array([1])], [np.array([1.0])], [0.5, 0.5], 2)


def test_low_precision_scores_are_normalised_in_float64():
    scores = np.array([0.1, 0.2, 0.3], dtype=np.float16)
    _, fused = weighted_fusion([np.array([1, 2, 3])], [scores], [1.0], 3)
    exact = (scores.astype(np.float64) - scores.min()) / (float(scores.max()) - scores.min())
    assert fused.dtype == np.float64
    np.testing.assert_array_equal(fused, np.sort(exact)[::-1])


def test_scaled_scores_are_float64():
    assert Fusion(method="weighted").scaled([1, 0]).dtype == np.float64
    assert Fusion().scaled([1, 0]).dtype == np.float64


def test_the_options_bounds_are_inclusive_and_their_types_checked():
    for ok in ({"alpha": 0}, {"alpha": 1}, {"alpha": 0.0}, {"depth": 1}, {"rrf_k": 0}):
        Fusion(method="weighted", **ok)
    for bad in ({"depth": True}, {"depth": "3"}, {"depth": 0}, {"rrf_k": True}, {"rrf_k": "1"},
                {"rrf_k": -1}, {"alpha": 1.01}, {"alpha": "0.5"}):  # fmt: skip
        with pytest.raises(ValueError):
            Fusion(**bad)
