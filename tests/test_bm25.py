"""BM25 (densefit.retrieval.bm25) against bm25s itself, incremental indexes against fresh ones,
and the two fusions against hand computations."""

from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pytest

from densefit.retrieval.bm25 import Bm25Index, Tokens, best_positions, tokenize
from densefit.retrieval.fusion import Fusion, reciprocal_rank_fusion, weighted_fusion

bm25s = pytest.importorskip("bm25s")

WORDS = (
    "cells genes protein vitamin bone density python function return socket kernel river "
    "mountain bread music the of and a to in is vaccine dose trial mice ACE inhibitors"
).split()


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(0, 30))) for _ in range(n)]


def bm25s_scores(texts, queries):
    """The reference: bm25s's own index and query scores (what mining used before)."""
    reference = bm25s.BM25()
    reference.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    out = []
    for query in queries:
        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
        out.append(reference.get_scores_from_ids(reference.get_tokens_ids(tokens)))
    return out


def check_equal_to_bm25s(texts, queries):
    index = Bm25Index(Tokens.of(texts))
    for ids, want in zip(
        index.tokens.query_ids(queries), bm25s_scores(texts, queries), strict=True
    ):
        np.testing.assert_array_equal(index.scores(ids), want)


def test_scores_equal_bm25s_on_random_texts():
    texts = random_texts(300)
    check_equal_to_bm25s(texts, ["cells genes", "python return python", "the of", "zebra", ""])


def test_scores_equal_bm25s_on_real_documents(shared_datasets):
    with gzip.open(shared_datasets / "scifact" / "corpus.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(600), f, strict=False)]
    texts = [f"{r.get('title', '')} {r['text']}".strip() for r in rows]
    queries = [" ".join(t.split()[:12]) for t in texts[::40]] + ["vitamin D and bone density"]
    check_equal_to_bm25s(texts, queries)


def test_an_index_grown_and_pruned_equals_one_built_from_scratch():
    texts = random_texts(200, seed=1)
    more = random_texts(40, seed=2)
    keep = np.array([i for i in range(200) if i % 3])
    grown = Tokens.of(texts).select(keep).extended(more)  # what a store does after changes
    fresh = Tokens.of([texts[i] for i in keep] + more)
    a, b = Bm25Index(grown), Bm25Index(fresh)
    queries = ["cells bone", "python kernel socket", "mice vaccine dose"]
    for ids_a, ids_b in zip(a.tokens.query_ids(queries), b.tokens.query_ids(queries), strict=True):
        np.testing.assert_allclose(a.scores(ids_a), b.scores(ids_b), rtol=1e-6)
    round_trip = Bm25Index.from_arrays(a.to_arrays())
    assert round_trip.search(queries, 7)[1][0].tolist() == a.search(queries, 7)[1][0].tolist()


def test_search_keeps_positive_scores_best_first_and_masks():
    index = Bm25Index(Tokens.of(["cells divide", "python", "cells cells genes", "genes"]))
    (positions, scores), (nothing, _) = index.search(["cells", "zebra"], 10)
    assert positions.tolist() == [2, 0] and scores[0] > scores[1] > 0  # 1 and 3: no "cells"
    assert nothing.tolist() == []
    mask = np.array([True, True, False, True])
    assert index.search(["cells"], 10, mask)[0][0].tolist() == [0]
    assert tokenize(["The cells"]) == [["cells"]]


def test_best_positions_breaks_ties_by_position():
    scores = np.array([1.0, 3.0, 3.0, 0.0, 3.0, 2.0])
    assert best_positions(scores, 3)[0].tolist() == [1, 2, 4]
    assert best_positions(scores, 10)[0].tolist() == [1, 2, 4, 5, 0]


# -- fusion -------------------------------------------------------------------------------------


def test_reciprocal_rank_fusion_equals_a_hand_computation():
    dense = np.array([10, 20, 30])
    lexical = np.array([30, 40, 10])
    keys, fused = reciprocal_rank_fusion([dense, lexical], 10, rrf_k=60)
    by_hand = {
        10: 1 / 61 + 1 / 63,
        20: 1 / 62,
        30: 1 / 63 + 1 / 61,
        40: 1 / 62,
    }
    # 10 and 30 tie (first and third in one list each), as do 20 and 40: ties by key
    assert keys.tolist() == [10, 30, 20, 40]
    np.testing.assert_allclose(fused, [by_hand[k] for k in keys.tolist()], rtol=1e-12)
    assert reciprocal_rank_fusion([dense, lexical], 2, rrf_k=0)[0].tolist() == [10, 30]


def test_weighted_fusion_equals_a_hand_computation():
    dense_keys, dense_scores = np.array([1, 2, 3]), np.array([0.9, 0.5, 0.1])
    bm25_keys, bm25_scores = np.array([3, 4]), np.array([12.0, 4.0])
    fusion = Fusion(method="weighted", alpha=0.25)
    keys, fused = fusion.fuse([dense_keys, bm25_keys], 4, [dense_scores, bm25_scores])
    by_hand = {
        1: 0.25 * 1.0,  # dense min-max (0.9 - 0.1) / 0.8; no BM25 score: 0
        2: 0.25 * 0.5,
        3: 0.25 * 0.0 + 0.75 * 1.0,
        4: 0.75 * 0.0,
    }
    assert keys.tolist() == [3, 1, 2, 4]
    np.testing.assert_allclose(fused, [by_hand[k] for k in keys.tolist()])
    one_score = weighted_fusion([np.array([5])], [np.array([2.0])], [1.0], 3)
    assert one_score[1].tolist() == [1.0]  # equal scores normalise to 1


def test_fusion_options_are_checked_and_scaled_scores_are_in_the_unit_interval():
    with pytest.raises(ValueError, match="fusion must be one of rrf, weighted"):
        Fusion(method="max")
    with pytest.raises(ValueError, match="alpha must be in"):
        Fusion(method="weighted", alpha=1.5)
    with pytest.raises(ValueError, match="depth must be"):
        Fusion(depth=0)
    with pytest.raises(ValueError, match="rrf_k"):
        Fusion(rrf_k=-1)
    fusion = Fusion(rrf_k=60)
    _, fused = fusion.fuse([np.array([1, 2]), np.array([1, 3])], 3)
    scaled = fusion.scaled(fused)
    assert scaled[0] == pytest.approx(1.0) and (0 < scaled).all() and (scaled <= 1).all()
