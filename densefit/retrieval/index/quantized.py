"""int8 and binary vectors: a small copy in memory finds candidates, float32 on disk ranks them.

A store of kind ``int8`` or ``binary`` (``open_store(..., vectors="int8")``) writes float32
vectors to its vector file like a float32 store, and searches them through a
:class:`QuantizedBackend` that holds only their quantized codes in memory:

- ``int8``: one byte per dimension, 4x smaller than float32, in sentence-transformers'
  ``quantize_embeddings(..., "int8")`` convention: per-dimension ``start = min`` and
  ``step = (max - min) / 255`` over the stored vectors (a step of 0 becomes 1), code
  ``clip(floor((x - start) / step), 0, 255) - 128``. A query scores a code by its float
  dot product with the dequantized vector, ``start + (code + 128) x step``; the ranges are
  recomputed from every stored vector whenever the store has doubled since they were (the
  codes are then made again), so they always come from at least half of the vectors and
  recalibration costs O(1) per vector over a store's life.
- ``binary``: one bit per dimension (its sign), 32x smaller, packed as sentence-transformers'
  ``"ubinary"`` (``np.packbits(x > 0)``); candidates are the smallest Hamming distances
  between the query's bits and the documents' (FAISS's ``IndexBinaryFlat`` when faiss is
  installed, numpy's ``bitwise_count`` otherwise).

Each search takes ``rescore x top_k`` candidates from the codes (:data:`DEFAULT_RESCORE`),
reads their float32 vectors from the vector file on disk (only those rows, by positioned
reads: the file is never loaded nor mapped whole) and returns the best ``top_k`` by their
exact float32 scores. What it changes:
a document that the codes do not rank among the candidates is missed; every score returned is
the exact float32 score, and the result equals exact float32 search over the candidates
(``tests/test_vectors.py``). The ranking cost on full test corpora: ``bench/results/vectors.json``.
"""

from __future__ import annotations

import os

import numpy as np

from densefit.config.shared import DEFAULT_RESCORE as _DEFAULT_RESCORE
from densefit.retrieval.index.exact import exact_search, faiss_module
from densefit.retrieval.index.types import StoreError

__all__ = [
    "DEFAULT_RESCORE",
    "QUANTIZED_KINDS",
    "QuantizedBackend",
    "checked_rescore",
    "int8_ranges",
    "quantize_binary",
    "quantize_int8",
    "rescore_candidates",
]

QUANTIZED_KINDS = ("int8", "binary")  # the kinds of densefit.choices.VECTOR_KINDS with codes
# Candidates per result: ``rescore x top_k`` are rescored against the float32 vectors.
DEFAULT_RESCORE = _DEFAULT_RESCORE  # the default of --rescore (densefit.config.shared)
# Rows read from the vector file at a time while (re)quantizing: 3 MiB at 384-d, so that the
# read buffers stay small beside the codes (binary codes of 1M vectors are 46 MiB).
_READ_CHUNK = 1 << 11
_HAMMING_BYTES = 1 << 24  # XOR bytes the numpy Hamming scan holds at a time
_RESCORE_QUERIES = 32  # queries rescored together (bounds the candidate block)


def int8_ranges(vectors: np.ndarray) -> np.ndarray:
    """``(2, dim)`` float32: each dimension's minimum and maximum (the int8 calibration).

    >>> int8_ranges(np.array([[0.0, 1.0], [2.0, -1.0]], dtype=np.float32)).tolist()
    [[0.0, -1.0], [2.0, 1.0]]
    """
    vectors = np.asarray(vectors, dtype=np.float32)
    return np.vstack([vectors.min(axis=0), vectors.max(axis=0)]).astype(np.float32)


def _starts_steps(ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    starts = ranges[0].astype(np.float32)
    steps = (ranges[1] - starts) / 255
    return starts, np.where(steps == 0, 1, steps).astype(np.float32)


def quantize_int8(vectors: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """int8 codes of ``vectors`` under ``ranges`` (sentence-transformers' convention).

    >>> ranges = np.array([[0.0], [1.0]], dtype=np.float32)
    >>> quantize_int8(np.array([[0.0], [0.5], [2.0]], dtype=np.float32), ranges).ravel().tolist()
    [-128, -1, 127]
    """
    starts, steps = _starts_steps(ranges)
    codes = np.clip(np.floor((np.asarray(vectors, dtype=np.float32) - starts) / steps), 0, 255)
    return (codes - 128).astype(np.int8)


def quantize_binary(vectors: np.ndarray) -> np.ndarray:
    """Packed sign bits of ``vectors``: ``np.packbits(x > 0)`` (sentence-transformers'
    ``"ubinary"``), ``(n, ceil(dim / 8))`` uint8.

    >>> quantize_binary(np.array([[0.5, -1.0, 0.0, 2.0, 1, 1, 1, 1]])).tolist()
    [[159]]
    """
    return np.packbits(np.asarray(vectors) > 0, axis=-1)


def checked_rescore(rescore: int | None, kind: str, location: str | None = None) -> int | None:
    """The candidates per result a store of ``kind`` vectors rescores (None for float kinds),
    or a one-line StoreError (``location`` first) for a rescore it refuses."""
    where = f"{location}: " if location else ""
    if kind not in QUANTIZED_KINDS:
        if rescore is not None:
            raise StoreError(
                f"{where}rescore applies to int8 and binary stores; this store holds {kind} "
                "vectors, searched exactly as they are: leave --rescore out"
            )
        return None
    rescore = DEFAULT_RESCORE if rescore is None else rescore
    if isinstance(rescore, bool) or not isinstance(rescore, int) or rescore < 1:
        raise StoreError(
            f"{where}rescore must be an integer >= 1 (candidates per result), got {rescore!r}"
        )
    return rescore


class QuantizedBackend:
    """Searches a store's vectors through their int8 or binary codes, then rescores the
    candidates against the float32 vectors (see the module docstring).

    >>> import numpy as np
    >>> vectors = np.eye(4, dtype=np.float32)
    >>> backend = QuantizedBackend("int8", dim=4)
    >>> backend.update(vectors, np.array([True, True, False, True]))
    >>> backend.search(np.array([[0.1, 0.2, 1.0, 0.0]], dtype=np.float32), k=2)[1].tolist()
    [[1, 0]]
    """

    def __init__(
        self, kind: str, dim: int, *, rescore: int | None = None, use_faiss: bool | None = None
    ):
        if kind not in QUANTIZED_KINDS:
            raise ValueError(f"quantized vectors are {' or '.join(QUANTIZED_KINDS)}, not {kind!r}")
        self.name = kind
        self.kind, self.dim, self.rescore = kind, dim, checked_rescore(rescore, kind)
        self.width = dim if kind == "int8" else (dim + 7) // 8  # bytes per code
        self._codes = np.zeros((0, self.width), dtype=np.int8 if kind == "int8" else np.uint8)
        self.n_coded = 0  # rows [0, n_coded) of the vectors have codes
        self.calibrated_rows = 0  # int8: the ranges come from this many vectors
        self.ranges: np.ndarray | None = None
        self.recalibrations = 0
        self.rows_rescored = 0  # float32 rows read for rescoring (counted: never the whole file)
        self._vectors = np.zeros((0, dim), dtype=np.float32)
        self._alive = np.zeros(0, dtype=bool)
        self._faiss = faiss_module() if use_faiss is not False and kind == "binary" else None
        if use_faiss and self._faiss is None:
            raise ImportError("use_faiss=True needs faiss: pip install 'densefit[index]'")
        self._binary_index = None

    # -- the VectorBackend protocol ----------------------------------------------------------

    def update(self, vectors: np.ndarray, alive: np.ndarray) -> None:
        """See the committed float32 rows (a memory map, never read through) and code the rows
        not coded yet."""
        n = len(vectors)
        if n < self.n_coded:  # another history of the store: start again
            self._reset()
        # Codes are made from the file by reads, and rescoring reads its rows by pread: no map.
        self._vectors, self._alive = _random_access(vectors), alive
        if n == self.n_coded:
            return
        if self.kind == "int8" and (self.ranges is None or n >= 2 * self.calibrated_rows):
            self._calibrate(n)
        else:
            self._code_rows(self.n_coded, n)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self._rescored(queries, k, self.candidates(queries, k))

    def search_masked(
        self, queries: np.ndarray, k: int, mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` among the live rows where ``mask`` is True (a filter's matches)."""
        return self._rescored(queries, k, self.candidates(queries, k, mask))

    def search_subset(
        self, queries: np.ndarray, k: int, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` among ``rows`` (a filter's few matches): their codes only."""
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        rows = rows[self._alive[rows]]
        if self._binary_index is not None:  # the codes live in FAISS: a masked scan
            mask = np.zeros(self.n_coded, dtype=bool)
            mask[rows] = True
            return self.search_masked(queries, k, mask)
        candidates = self._candidates_among(queries, k, rows)
        return self._rescored(queries, k, candidates)

    def flush(self) -> None:
        pass

    # -- what it holds -----------------------------------------------------------------------

    @property
    def codes(self) -> np.ndarray:
        """The codes of the rows coded so far, ``(n_coded, width)``."""
        return self._codes[: self.n_coded]

    def memory_bytes(self) -> int:
        """Bytes of the codes in memory (the float32 vectors stay in the file)."""
        if self._binary_index is not None:
            return int(self._binary_index.ntotal * self.width)
        return int(self.n_coded * self.width)

    # -- candidates --------------------------------------------------------------------------

    def candidates(self, queries: np.ndarray, k: int, mask: np.ndarray | None = None) -> np.ndarray:
        """``(q, rescore x k)`` rows the codes rank best among the live rows (where ``mask``),
        padded with -1: what :meth:`search` rescores."""
        alive = self._alive[: self.n_coded]
        return self._candidates(queries, k, alive if mask is None else alive & mask[: len(alive)])

    def _rescored(self, queries, k, candidates) -> tuple[np.ndarray, np.ndarray]:
        self.rows_rescored += int(len(np.unique(candidates[candidates >= 0])))
        return rescore_candidates(self._vectors, queries, candidates, k)

    def _candidates(self, queries, k, alive) -> np.ndarray:
        queries = np.ascontiguousarray(queries, dtype=np.float32)  # (q, d)
        m = k * self.rescore
        if self.kind == "int8":
            _, steps = _starts_steps(self.ranges) if self.ranges is not None else (None, 1)
            # q . (start + (code + 128) step) ranks as (q * step) . code: the rest is constant.
            _, rows = exact_search(self.codes, queries * steps, m, alive=alive)
            return rows
        return self._hamming(queries, m, alive)

    def _candidates_among(self, queries, k, rows: np.ndarray) -> np.ndarray:
        """Candidates among the sorted ``rows`` only (scanning just their codes)."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        m = k * self.rescore
        if len(rows) == 0:
            return np.full((len(queries), m), -1, dtype=np.int64)
        codes = self._codes[rows]
        if self.kind == "int8":
            steps = _starts_steps(self.ranges)[1]
            _, local = exact_search(codes, queries * steps, m, use_faiss=False)
        else:
            local = _hamming_numpy(codes, quantize_binary(queries), m, None)
        return np.where(local >= 0, rows[np.maximum(local, 0)], -1)

    def _hamming(self, queries, m: int, alive: np.ndarray) -> np.ndarray:
        bits = quantize_binary(queries)
        if self._faiss is None:
            return _hamming_numpy(self.codes, bits, m, alive)
        faiss = self._faiss
        index = self._binary_index
        k = 0 if index is None else min(m, index.ntotal)
        if k == 0:
            return np.full((len(queries), m), -1, dtype=np.int64)
        params = None
        if not alive.all():
            packed = np.packbits(alive, bitorder="little")  # referenced until search ends
            params = faiss.SearchParameters(
                sel=faiss.IDSelectorBitmap(len(alive), faiss.swig_ptr(packed))
            )
        _, rows = index.search(bits, k, params=params)
        return np.pad(rows.astype(np.int64), ((0, 0), (0, m - k)), constant_values=-1)

    # -- coding ------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._codes = self._codes[:0]
        self.n_coded = self.calibrated_rows = 0
        self.ranges = None
        self._binary_index = None

    def _calibrate(self, n: int) -> None:
        """Ranges from all ``n`` rows, then every row coded again with them."""
        low = np.full(self.dim, np.inf, dtype=np.float32)
        high = np.full(self.dim, -np.inf, dtype=np.float32)
        for block in _read_rows(self._vectors, 0, n):
            ranges = int8_ranges(block)
            low, high = np.minimum(low, ranges[0]), np.maximum(high, ranges[1])
        self.ranges = np.vstack([low, high])
        self.calibrated_rows = n
        self.recalibrations += 1
        self.n_coded = 0
        self._code_rows(0, n)

    def _code_rows(self, start: int, end: int) -> None:
        self._reserve(end)
        for offset, block in zip(
            range(start, end, _READ_CHUNK), _read_rows(self._vectors, start, end), strict=True
        ):
            if self.kind == "int8":
                codes = quantize_int8(block, self.ranges)
            else:
                codes = quantize_binary(block)
            if self._faiss is not None:
                self._binary_add(codes)
            else:
                self._codes[offset : offset + len(block)] = codes
        self.n_coded = end

    def _binary_add(self, codes: np.ndarray) -> None:
        if self._binary_index is None:
            self._binary_index = self._faiss.IndexBinaryFlat(self.width * 8)
        self._binary_index.add(np.ascontiguousarray(codes))

    def _reserve(self, rows: int) -> None:
        """Room for ``rows`` codes, growing by doubling (appends are amortised O(1))."""
        if self._faiss is not None or rows <= len(self._codes):
            return
        grown = np.zeros((max(rows, 2 * len(self._codes), 1024), self.width), self._codes.dtype)
        grown[: self.n_coded] = self._codes[: self.n_coded]
        self._codes = grown


def rescore_candidates(
    vectors: np.ndarray, queries: np.ndarray, candidates: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of each query's ``candidates`` (rows, -1 padded) by exact float32 inner
    product with ``vectors`` (read at those rows only): ``(scores, rows)``, ``(q, k)``, best
    first, ties by row, padded with ``-inf`` / ``-1``.

    >>> vectors = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=np.float32)
    >>> rescore_candidates(vectors, np.array([[0.0, 1.0]]), np.array([[0, 2, -1]]), 2)[1].tolist()
    [[2, 0]]
    """
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    best_scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    best_rows = np.full((len(queries), k), -1, dtype=np.int64)
    for start in range(0, len(queries), _RESCORE_QUERIES):
        block = candidates[start : start + _RESCORE_QUERIES]
        rows = np.unique(block[block >= 0])
        if not len(rows):
            continue
        floats = np.asarray(vectors[rows], dtype=np.float32)  # (u, d): only these rows are read
        scores = queries[start : start + _RESCORE_QUERIES] @ floats.T  # (b, u)
        local = np.searchsorted(rows, np.maximum(block, 0))
        picked = np.take_along_axis(scores, local, axis=1)  # (b, m)
        picked[block < 0] = -np.inf
        keyed_rows = np.where(block < 0, np.iinfo(np.int64).max, block)
        for i in range(len(block)):
            order = np.lexsort((keyed_rows[i], -picked[i]))[:k]
            found = picked[i][order]
            best_scores[start + i, : len(order)] = found
            best_rows[start + i, : len(order)] = np.where(np.isinf(found), -1, block[i][order])
    return best_scores, best_rows


class _RowReader:
    """Rows of a vector file read on demand with positioned reads (``os.pread``), never
    through a memory map: Linux maps the cached pages around each faulted page into the
    process too (fault-around, 64 KiB), so rescoring scattered rows through a map would soon
    count the whole file in the process's memory. ``reader[rows]`` takes sorted unique rows.
    """

    def __init__(self, vectors: np.memmap):
        self.path = vectors.filename
        self.dtype, self.shape, self.offset = vectors.dtype, vectors.shape, vectors.offset
        self.row_bytes = self.shape[1] * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.shape[1]), dtype=self.dtype)
        if not len(rows):
            return out
        starts = np.concatenate([[0], np.flatnonzero(np.diff(rows) != 1) + 1])  # runs of rows
        ends = np.concatenate([starts[1:], [len(rows)]])
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for first, last in zip(starts.tolist(), ends.tolist(), strict=True):
                size = (last - first) * self.row_bytes
                data = os.pread(fd, size, self.offset + int(rows[first]) * self.row_bytes)
                if len(data) != size:
                    raise OSError(f"{self.path}: short read at row {rows[first]}")
                out[first:last] = np.frombuffer(data, dtype=self.dtype).reshape(last - first, -1)
        finally:
            os.close(fd)
        return out


def _random_access(vectors: np.ndarray):
    """What rescoring reads rows from: a :class:`_RowReader` for a memory-mapped file, the
    array itself otherwise."""
    if isinstance(vectors, np.memmap) and getattr(vectors, "filename", None):
        return _RowReader(vectors)
    return vectors


def _read_rows(vectors, start: int, end: int):
    """Rows ``[start, end)`` of ``vectors`` (:func:`_random_access`'s: a file is read, not
    mapped, so coding it leaves no page of it mapped) as float32 blocks of
    :data:`_READ_CHUNK` rows."""
    for offset in range(start, end, _READ_CHUNK):
        rows = np.arange(offset, min(offset + _READ_CHUNK, end))
        yield np.asarray(vectors[rows], dtype=np.float32)


def _hamming_numpy(codes: np.ndarray, bits: np.ndarray, m: int, alive) -> np.ndarray:
    """Rows of the ``m`` smallest Hamming distances from each query's ``bits`` (ties by row)."""
    n = len(codes)
    best_d = np.full((len(bits), m), np.iinfo(np.int64).max, dtype=np.int64)
    best_r = np.full((len(bits), m), -1, dtype=np.int64)
    # The XOR block is (queries, rows, bytes): about 16 MiB at a time.
    chunk = max(256, _HAMMING_BYTES // max(1, len(bits) * codes.shape[1]))
    for start in range(0, n, chunk):
        block = codes[start : start + chunk]
        distances = np.bitwise_count(bits[:, None, :] ^ block[None, :, :]).sum(
            axis=2, dtype=np.int64
        )
        rows = np.arange(start, start + len(block))
        if alive is not None:
            distances[:, ~alive[start : start + len(block)]] = np.iinfo(np.int64).max
        merged_d = np.concatenate([best_d, distances], axis=1)
        merged_r = np.concatenate([best_r, np.broadcast_to(rows, distances.shape)], axis=1)
        keyed = np.where(merged_r < 0, np.iinfo(np.int64).max, merged_r)
        order = np.lexsort((keyed, merged_d), axis=1)[:, :m]
        best_d = np.take_along_axis(merged_d, order, axis=1)
        best_r = np.take_along_axis(merged_r, order, axis=1)
    best_r[best_d == np.iinfo(np.int64).max] = -1
    return best_r
