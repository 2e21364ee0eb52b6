"""Vector kinds: int8 and binary codes (sentence-transformers' conventions), search equal to
exact float32 search over the rescored candidates, recalibration, candidate recall on real
embeddings, and float32 vectors that stay on disk."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from densefit.retrieval.index.quantized import (
    QuantizedBackend,
    _random_access,
    _RowReader,
    int8_ranges,
    quantize_binary,
    quantize_int8,
)
from densefit.retrieval.index.vectors import VectorFile, make_backend

HAS_FAISS = importlib.util.find_spec("faiss") is not None
RNG = np.random.default_rng(0)


def unit(n: int, dim: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


VECTORS = unit(3000, 48)
QUERIES = unit(25, 48, seed=1)


def brute_force_among(vectors, queries, k, candidates):
    """Exact float32 top-``k`` of each query among its candidate rows (-1: none), ties by row."""
    scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    rows = np.full((len(queries), k), -1, dtype=np.int64)
    for q, cands in enumerate(candidates):
        cands = np.unique(cands[cands >= 0])
        found = vectors[cands] @ queries[q]
        order = np.lexsort((cands, -found))[:k]
        scores[q, : len(order)], rows[q, : len(order)] = found[order], cands[order]
    return scores, rows


KINDS = {
    "int8": lambda r: QuantizedBackend("int8", 48, rescore=r),
    "binary-numpy": lambda r: QuantizedBackend("binary", 48, rescore=r, use_faiss=False),
    "binary-faiss": pytest.param(
        lambda r: QuantizedBackend("binary", 48, rescore=r, use_faiss=True),
        marks=pytest.mark.skipif(not HAS_FAISS, reason="faiss is not installed"),
    ),
}


@pytest.fixture(params=list(KINDS.values()), ids=list(KINDS))
def make(request):
    return request.param


def test_codes_follow_sentence_transformers_quantize_embeddings():
    from sentence_transformers.util import quantize_embeddings

    ranges = int8_ranges(VECTORS)
    reference = quantize_embeddings(VECTORS[:500], "int8", calibration_embeddings=VECTORS)
    np.testing.assert_array_equal(quantize_int8(VECTORS[:500], ranges), reference)
    np.testing.assert_array_equal(quantize_binary(VECTORS), quantize_embeddings(VECTORS, "ubinary"))
    signs = np.array([[0.0, -0.0, 1e-9, -1e-9, 0.5, 0.0, -0.5, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(quantize_binary(signs), quantize_embeddings(signs, "ubinary"))
    assert quantize_int8(VECTORS, ranges).nbytes * 4 == VECTORS.nbytes
    assert quantize_binary(VECTORS).nbytes * 32 == VECTORS.nbytes


@pytest.mark.parametrize("k", [1, 10])
def test_search_equals_exact_float32_search_over_the_candidates(make, k):
    backend = make(3)
    alive = RNG.random(len(VECTORS)) > 0.2
    backend.update(VECTORS, alive)
    candidates = backend.candidates(QUERIES, k)
    assert candidates.shape == (len(QUERIES), 3 * k) and alive[candidates[candidates >= 0]].all()
    scores, rows = backend.search(QUERIES, k)
    want_scores, want_rows = brute_force_among(VECTORS, QUERIES, k, candidates)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-6)
    # Filters: the mask and the subset paths search the codes of the matching rows only.
    mask = np.zeros(len(VECTORS), dtype=bool)
    mask[::7] = True
    masked = backend.candidates(QUERIES, k, mask)
    assert mask[masked[masked >= 0]].all()
    got = backend.search_masked(QUERIES, k, mask)
    np.testing.assert_array_equal(got[1], brute_force_among(VECTORS, QUERIES, k, masked)[1])
    subset_rows = np.flatnonzero(mask & alive)
    subset = backend.search_subset(QUERIES, k, subset_rows)
    assert np.isin(subset[1][subset[1] >= 0], subset_rows).all()
    np.testing.assert_array_equal(subset[1], got[1])


def test_enough_candidates_make_it_exact_search(make):
    backend = make(100)  # 10 x 100 candidates cover the 800 live rows
    alive = np.zeros(len(VECTORS), dtype=bool)
    alive[1000:1800] = True
    backend.update(VECTORS, alive)
    exact = QUERIES @ VECTORS.T
    exact[:, ~alive] = -np.inf
    want = np.argsort(-exact, axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(backend.search(QUERIES, 10)[1], want)


def test_int8_recalibrates_each_time_the_store_doubles():
    backend = QuantizedBackend("int8", 48)
    sizes = [100, 150, 199, 200, 390, 420, 800, 3000]
    calibrations = []
    for n in sizes:
        backend.update(VECTORS[:n], np.ones(n, dtype=bool))
        calibrations.append(backend.calibrated_rows)
        assert backend.calibrated_rows * 2 > n  # the ranges come from over half the rows
        np.testing.assert_array_equal(
            backend.codes,
            quantize_int8(VECTORS[:n], int8_ranges(VECTORS[: backend.calibrated_rows])),
        )
    assert calibrations == [100, 100, 100, 200, 200, 420, 420, 3000]
    assert backend.recalibrations == 4


def test_binary_candidates_agree_between_faiss_and_numpy():
    if not HAS_FAISS:
        pytest.skip("faiss is not installed")
    alive = RNG.random(len(VECTORS)) > 0.1
    paths = [QuantizedBackend("binary", 48, use_faiss=flag) for flag in (False, True)]
    bits = quantize_binary(QUERIES)
    distances = []
    for backend in paths:
        backend.update(VECTORS, alive)
        rows = backend.candidates(QUERIES, 10)
        codes = quantize_binary(VECTORS)[rows]
        distances.append(np.bitwise_count(codes ^ bits[:, None, :]).sum(axis=2))
    np.testing.assert_array_equal(np.sort(distances[0], axis=1), np.sort(distances[1], axis=1))


def test_quantized_kinds_refuse_other_backends_and_float_kinds_refuse_rescore():
    with pytest.raises(ValueError, match="cannot search a int8 store"):
        make_backend("faiss:HNSW32", 8, kind="int8")
    with pytest.raises(ValueError, match="rescore applies to int8 and binary"):
        make_backend("exact", 8, kind="float32", rescore=4)
    with pytest.raises(ValueError, match="rescore must be an integer >= 1"):
        QuantizedBackend("binary", 8, rescore=0)


def _mapped_kib(path) -> int:
    """KiB of ``path``'s memory mappings resident in this process (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("kind", ["int8", "binary", "float32"])
def test_float32_vectors_stay_on_disk(tmp_path, kind):
    """Coding and searching an int8 or binary store reads its float32 file (the rescored
    rows only, counted) without mapping any of it into the process; exact float32 search
    maps all of it (the check can tell them apart)."""
    n, dim = 60_000, 64
    file = VectorFile(tmp_path / "vectors-0.f32", dim=dim, dtype="float32")
    for start in range(0, n, 10_000):
        file.write(start, unit(10_000, dim, seed=start))
    view = file.view(n)
    backend = make_backend("exact", dim, kind=kind)
    backend.update(view, np.ones(n, dtype=bool))
    queries = unit(20, dim, seed=99)
    backend.search(queries, 10)
    mapped = _mapped_kib(file.path) * 1024
    if kind == "float32":
        assert mapped > 0.9 * view.nbytes
        return
    assert type(backend._vectors).__name__ == "_RowReader"  # coded from the file by reads
    assert backend.rows_rescored <= 20 * 10 * backend.rescore
    assert mapped == 0  # the rescored rows were read, not mapped
    assert backend.memory_bytes() * (4 if kind == "int8" else 32) == view.nbytes


@pytest.mark.slow
def test_candidate_recall_on_real_embeddings(minilm, shared_datasets):
    """On a SciFact sample embedded by MiniLM, the default 4 x 10 candidates hold nearly all of
    float32's top 10 (int8), and most of it (binary); rescoring keeps their order exact."""
    from densefit.data.corpus import load_beir
    from densefit.retrieval.encode import encode_texts

    beir = load_beir(shared_datasets / "scifact", "test")
    docs = sorted(beir.corpus.values(), key=lambda d: d.id)[:800]
    minilm.max_seq_length = 128
    vectors = encode_texts(minilm, [d.text for d in docs], batch_size=64, normalize=True)
    queries = encode_texts(minilm, list(beir.queries.values())[:100], normalize=True)
    exact = np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :10]
    recall = {}
    for kind in ("int8", "binary"):
        backend = QuantizedBackend(kind, vectors.shape[1])
        backend.update(vectors, np.ones(len(vectors), dtype=bool))
        candidates = backend.candidates(queries, 10)
        recall[kind] = np.mean([len(set(e) & set(c)) / 10 for e, c in zip(exact, candidates)])
        top = backend.search(queries, 10)[1]
        found = [len(set(e) & set(t)) / 10 for e, t in zip(exact, top, strict=True)]
        assert np.mean(found) == pytest.approx(recall[kind])  # rescoring loses nothing found
    assert recall["int8"] >= 0.99, recall  # measured 1.0 (800 documents, 100 queries)
    assert recall["binary"] >= 0.85, recall  # measured 0.90


def test_fewer_live_rows_than_results_give_each_of_them_then_padding(make):
    """With fewer matching rows than ``rescore x k`` (and than ``k``), every live row is a
    candidate, the first and the last row included, and the rest is padding (-1 / -inf) on
    every path: search, a filter's mask and a filter's subset. Dead and unmatched rows never
    stand in for the padding."""
    backend = make(3)
    alive = np.zeros(len(VECTORS), dtype=bool)
    alive[[0, 5, len(VECTORS) - 1]] = True
    backend.update(VECTORS, alive)
    k = 10
    live = np.flatnonzero(alive)
    candidates = backend.candidates(QUERIES, k)
    assert candidates.shape == (len(QUERIES), 3 * k)
    for row in candidates:
        assert sorted(row[row >= 0]) == live.tolist() and (row[len(live) :] == -1).all()
    want_scores, want_rows = brute_force_among(
        VECTORS, QUERIES, k, np.tile(live, (len(QUERIES), 1))
    )
    scores, rows = backend.search(QUERIES, k)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-6)
    assert (rows[:, 3:] == -1).all() and np.isneginf(scores[:, 3:]).all()
    mask = np.zeros(len(VECTORS), dtype=bool)
    mask[[0, 7]] = True  # row 7 matches the filter but is dead
    for scores, rows in (
        backend.search_masked(QUERIES, k, mask),
        backend.search_subset(QUERIES, k, np.array([7, 0])),
    ):
        assert (rows[:, 0] == 0).all() and (rows[:, 1:] == -1).all()
        assert np.isneginf(scores[:, 1:]).all()


@pytest.mark.parametrize("n", [0, 4])
def test_a_store_smaller_than_the_candidates_finds_all_of_it_then_padding(make, n):
    backend = make(3)
    backend.update(VECTORS[:n], np.ones(n, dtype=bool))
    scores, rows = backend.search(QUERIES, 5)
    everything = np.tile(np.arange(n), (len(QUERIES), 1))
    want_scores, want_rows = brute_force_among(VECTORS[:n], QUERIES, 5, everything)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-6)
    assert (rows[:, n:] == -1).all() and np.isneginf(scores[:, n:]).all()
    candidates = backend.candidates(QUERIES, 5)
    assert candidates.shape == (len(QUERIES), 15) and (candidates[:, n:] == -1).all()


def test_many_queries_at_once_equal_each_query_alone(make):
    """A batch of queries larger than the rescoring block (an evaluation's, or a server's
    micro-batch) gets what each query gets alone."""
    backend = make(3)
    alive = RNG.random(len(VECTORS)) > 0.2
    backend.update(VECTORS, alive)
    queries = unit(75, 48, seed=2)
    scores, rows = backend.search(queries, 10)
    for i in range(0, len(queries), 7):
        alone = backend.search(queries[i : i + 1], 10)
        np.testing.assert_array_equal(rows[i], alone[1][0])
        np.testing.assert_allclose(scores[i], alone[0][0], rtol=1e-6)


def test_rows_read_from_the_vector_file_are_its_rows(tmp_path):
    """Rescoring reads a stored file's rows by positioned reads, in runs of consecutive rows:
    what it reads equals the rows, and a store searched from its file finds what the same
    vectors find in memory."""
    file = VectorFile(tmp_path / "vectors-0.f32", dim=48, dtype="float32")
    file.write(0, VECTORS)
    view = file.view(len(VECTORS))
    reader = _random_access(view)
    assert isinstance(reader, _RowReader) and len(reader) == len(VECTORS)
    rows = np.array([0, 1, 2, 7, 8, 20, 1500, 1501, len(VECTORS) - 1])
    np.testing.assert_array_equal(reader[rows], VECTORS[rows])
    assert reader[np.array([], dtype=np.int64)].shape == (0, 48)
    alive = RNG.random(len(VECTORS)) > 0.2
    for kind in ("int8", "binary"):
        on_disk, in_memory = QuantizedBackend(kind, 48), QuantizedBackend(kind, 48)
        on_disk.update(view, alive)
        in_memory.update(VECTORS.copy(), alive)
        for got, want in zip(on_disk.search(QUERIES, 10), in_memory.search(QUERIES, 10)):
            np.testing.assert_array_equal(got, want)


def test_the_numpy_hamming_scan_in_blocks_equals_one_pass(monkeypatch):
    """The numpy Hamming scan holds a bounded block of rows at a time: scanned in blocks of
    256 rows, the candidates (ties by row) are those of one pass."""
    from densefit.retrieval.index import quantized

    alive = RNG.random(len(VECTORS)) > 0.2
    backend = QuantizedBackend("binary", 48, use_faiss=False)
    backend.update(VECTORS, alive)
    one_pass = backend.candidates(QUERIES, 10)
    monkeypatch.setattr(quantized, "_HAMMING_BYTES", 1)  # the smallest block: 256 rows
    np.testing.assert_array_equal(backend.candidates(QUERIES, 10), one_pass)


def test_ties_go_to_the_lower_row(make):
    """Rows with equal codes and equal vectors tie at every step. Rescoring orders its ties by
    row, and so do the binary candidates (the lower rows, row 0 included, make the cut); the
    int8 candidates come from exact search, whose ties among equal scores fall as its top-k
    takes them (any of the tied rows)."""
    vectors = VECTORS.copy()
    tied = [0, 5, 10, 20, 30]
    vectors[tied] = vectors[5]
    backend = make(2)
    backend.update(vectors, np.ones(len(vectors), dtype=bool))
    query = vectors[5:6]
    candidates = backend.candidates(query, 2)[0].tolist()
    scores, rows = backend.search(query, 3)
    assert len(set(candidates)) == 4 and set(candidates) <= set(tied)
    assert rows[0].tolist() == sorted(candidates)[:3] and len(set(scores[0].tolist())) == 1
    if backend.kind == "binary":
        assert candidates == [0, 5, 10, 20]


def test_int8_codes_clip_rows_outside_the_calibrated_range_and_a_constant_dimension():
    """Rows added after calibration may fall outside its ranges: their codes clip to -128 and
    127 instead of wrapping around; a dimension with one value everywhere codes to -128."""
    ranges = int8_ranges(VECTORS)
    codes = quantize_int8(np.vstack([ranges[0] - 1, ranges[1] + 1]), ranges)
    assert (codes[0] == -128).all() and (codes[1] == 127).all()
    constant = VECTORS.copy()
    constant[:, 3] = 0.25
    with np.errstate(all="raise"):
        codes = quantize_int8(constant, int8_ranges(constant))
    assert (codes[:, 3] == -128).all()


def test_a_store_that_shrank_is_coded_again_from_its_rows(make):
    """A vector file shorter than the rows coded is another history of the store (a pruned
    or rebuilt one): the backend codes it again from scratch and searches only its rows;
    a filter matching no row finds nothing."""
    backend = make(3)
    backend.update(VECTORS, np.ones(len(VECTORS), dtype=bool))
    other = unit(500, 48, seed=7)
    alive = np.ones(len(other), dtype=bool)
    backend.update(other, alive)
    fresh = make(3)
    fresh.update(other, alive)
    for got, want in zip(backend.search(QUERIES, 10), fresh.search(QUERIES, 10)):
        np.testing.assert_array_equal(got, want)
    assert backend.search(QUERIES, 10)[1].max() < len(other)
    scores, rows = backend.search_subset(QUERIES, 10, np.array([], dtype=np.int64))
    assert (rows == -1).all() and np.isneginf(scores).all()
