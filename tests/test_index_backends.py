"""Vector backends against brute force: exact (torch and FAISS kernels, float16), FAISS indexes."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densefit.retrieval.index import ExactBackend, VectorBackend, exact_search, make_backend

HAS_FAISS = importlib.util.find_spec("faiss") is not None
needs_faiss = pytest.mark.skipif(not HAS_FAISS, reason="faiss is not installed (densefit[index])")

RNG = np.random.default_rng(0)
VECTORS = RNG.standard_normal((3000, 16)).astype(np.float32)
QUERIES = RNG.standard_normal((30, 16)).astype(np.float32)


def brute_force(vectors, queries, k, alive=None):
    scores = queries @ vectors.astype(np.float32).T
    if alive is not None:
        scores[:, ~alive] = -np.inf
    rows = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, rows, axis=1), rows


EXACT = {
    "exact-torch": lambda dim: ExactBackend(use_faiss=False, chunk_rows=700),
    "exact-faiss-kernel": pytest.param(
        lambda dim: ExactBackend(use_faiss=True, chunk_rows=700), marks=needs_faiss
    ),
    "faiss-flat": pytest.param(lambda dim: make_backend("faiss:Flat", dim), marks=needs_faiss),
}


@pytest.fixture(params=list(EXACT.values()), ids=list(EXACT))
def exact_backend(request):
    return request.param(16)


@pytest.mark.parametrize("n_queries", [1, 7, 30])  # both sides of the FAISS-kernel cutoff
def test_exact_backends_equal_brute_force(exact_backend, n_queries):
    alive = np.ones(len(VECTORS), dtype=bool)
    exact_backend.update(VECTORS, alive)
    scores, rows = exact_backend.search(QUERIES[:n_queries], 10)
    ref_scores, ref_rows = brute_force(VECTORS, QUERIES[:n_queries], 10)
    np.testing.assert_array_equal(rows, ref_rows)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert isinstance(exact_backend, VectorBackend)


@pytest.mark.parametrize("n_queries", [1, 30])
def test_dead_rows_are_never_returned(exact_backend, n_queries):
    alive = RNG.random(len(VECTORS)) > 0.3
    alive[700:1400] = False  # a whole chunk dead
    exact_backend.update(VECTORS, alive)
    scores, rows = exact_backend.search(QUERIES[:n_queries], 25)
    assert alive[rows].all()
    np.testing.assert_array_equal(rows, brute_force(VECTORS, QUERIES[:n_queries], 25, alive)[1])


@pytest.mark.parametrize("n_queries", [1, 30])
def test_fewer_live_rows_than_k_pads(exact_backend, n_queries):
    alive = np.zeros(len(VECTORS), dtype=bool)
    alive[[5, 2000, 2999]] = True
    exact_backend.update(VECTORS, alive)
    scores, rows = exact_backend.search(QUERIES[:n_queries], 5)
    assert scores.shape == rows.shape == (n_queries, 5)
    assert (np.sort(rows[:, :3], axis=1) == [5, 2000, 2999]).all()
    assert (rows[:, 3:] == -1).all() and np.isneginf(scores[:, 3:]).all()


def test_empty_and_incremental(exact_backend):
    exact_backend.update(VECTORS[:0], np.zeros(0, dtype=bool))
    scores, rows = exact_backend.search(QUERIES[:2], 3)
    assert (rows == -1).all() and np.isneginf(scores).all()
    exact_backend.update(VECTORS[:1000], np.ones(1000, dtype=bool))
    exact_backend.search(QUERIES[:2], 3)
    exact_backend.update(VECTORS, np.ones(len(VECTORS), dtype=bool))  # rows appended
    np.testing.assert_array_equal(
        exact_backend.search(QUERIES[:2], 3)[1], brute_force(VECTORS, QUERIES[:2], 3)[1]
    )


@pytest.mark.parametrize("use_faiss", [False, pytest.param(True, marks=needs_faiss)])
def test_float16_vectors_are_widened(use_faiss):
    half = VECTORS.astype(np.float16)
    scores, rows = exact_search(half, QUERIES[:3], 5, use_faiss=use_faiss, chunk_rows=1000)
    ref_scores, ref_rows = brute_force(half, QUERIES[:3], 5)
    np.testing.assert_array_equal(rows, ref_rows)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-4)


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(1, 60),
    n_queries=st.integers(1, 12),
    k=st.integers(1, 70),
    chunk=st.one_of(st.none(), st.integers(1, 25)),  # None: one block
    seed=st.integers(0, 2**16),
    dead=st.sampled_from([0.0, 0.2, 1.0]),
    use_faiss=st.sampled_from([False, True] if HAS_FAISS else [False]),
)
def test_chunked_paths_equal_one_matrix(n, n_queries, k, chunk, seed, dead, use_faiss):
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, 8)).astype(np.float32)
    queries = rng.standard_normal((n_queries, 8)).astype(np.float32)
    alive = rng.random(n) >= dead
    options = {"chunk_rows": chunk, "use_faiss": use_faiss}
    scores, rows = exact_search(vectors, queries, k, alive=alive, **options)
    assert scores.shape == rows.shape == (n_queries, k) and scores.dtype == np.float32
    ref_scores, _ = brute_force(vectors, queries, k, alive)
    live = min(k, int(alive.sum()))
    # Ties could order differently; the scores must agree exactly, the rows must be live.
    np.testing.assert_allclose(scores[:, :live], ref_scores[:, :live], rtol=1e-5, atol=1e-5)
    assert (rows[:, live:] == -1).all() and alive[rows[:, :live]].all()


@needs_faiss
def test_hnsw_recall():
    vectors = RNG.standard_normal((5000, 32)).astype(np.float32)
    queries = RNG.standard_normal((50, 32)).astype(np.float32)
    backend = make_backend("faiss:HNSW32", 32)
    alive = RNG.random(5000) > 0.1
    backend.update(vectors, alive)
    _, rows = backend.search(queries, 10)
    _, truth = brute_force(vectors, queries, 10, alive)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, truth, strict=True)])
    assert recall >= 0.95 and alive[rows[rows >= 0]].all()


@needs_faiss
def test_ivf_needs_enough_vectors_and_says_so():
    backend = make_backend("faiss:IVF64,Flat", 16)
    backend.update(VECTORS[:100], np.ones(100, dtype=bool))
    with pytest.raises(ValueError, match="at least 2496 vectors.*faiss:HNSW32"):
        backend.search(QUERIES[:1], 5)
    small = make_backend("faiss:IVF16,Flat", 16)
    small.nprobe = 16  # all lists: exact
    small.update(VECTORS, np.ones(len(VECTORS), dtype=bool))
    np.testing.assert_array_equal(
        small.search(QUERIES[:4], 5)[1], brute_force(VECTORS, QUERIES[:4], 5)[1]
    )


@needs_faiss
def test_faiss_cache_is_saved_and_caught_up(tmp_path):
    alive = np.ones(len(VECTORS), dtype=bool)
    first = make_backend("faiss:Flat", 16, tmp_path / "faiss-0")
    first.update(VECTORS[:1000], alive[:1000])
    first.flush()
    cache = tmp_path / "faiss-0-Flat.index"
    assert cache.is_file()
    second = make_backend("faiss:Flat", 16, tmp_path / "faiss-0")
    assert second._index.ntotal == 1000  # loaded, not rebuilt
    second.update(VECTORS, alive)  # 2000 more rows committed since the cache was written
    np.testing.assert_array_equal(
        second.search(QUERIES[:3], 5)[1], brute_force(VECTORS, QUERIES[:3], 5)[1]
    )
    # A cache ahead of the committed rows (another history) is rebuilt, never trusted.
    second.flush()
    third = make_backend("faiss:Flat", 16, tmp_path / "faiss-0")
    third.update(VECTORS[:500], alive[:500])
    assert third.search(QUERIES[:3], 5)[1].max() < 500
