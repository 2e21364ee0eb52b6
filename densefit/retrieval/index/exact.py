"""Exact inner-product search: matrix products over chunks of the stored vectors.

Each chunk of rows is scored against all queries at once (one BLAS call), dead rows are
masked, and a running top-k is merged chunk by chunk, so memory stays bounded however many
rows there are. float16 stores are widened to float32 a few thousand rows at a time.

For a handful of queries a matrix-vector product is memory-bound and BLAS ``sgemv`` reaches a
fraction of the memory bandwidth, while FAISS's fused inner-product + heap kernel reaches all
of it; so when ``faiss`` is importable, small query batches go through
``faiss.knn_inner_product`` (same exact result, 3-4x faster; ``bench/encode_search.py``
measures both). Larger batches stay with ``torch.mm``, which beats FAISS's BLAS path there.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["ExactBackend", "exact_search", "faiss_module"]

# Score-matrix budget per chunk (queries x rows), in float32 values: 16M = 64 MiB.
_SCORE_BUDGET = 1 << 24
_MIN_CHUNK, _MAX_CHUNK = 1 << 12, 1 << 18
# float16 rows are widened this many at a time into a reused float32 buffer (6 MiB at 384-d).
_WIDEN_CHUNK = 1 << 12
# Measured crossover (1M x 384, one thread): FAISS wins below ~8 queries, torch.mm above.
_FAISS_MAX_QUERIES = 8


class ExactBackend:
    """Brute-force search over every live row: always the true top-k.

    ``use_faiss=None`` uses FAISS's kernel for small query batches when it is installed;
    ``False`` forces the pure torch path.

    >>> import numpy as np
    >>> backend = ExactBackend()
    >>> backend.update(np.eye(3, dtype=np.float32), np.array([True, False, True]))
    >>> scores, rows = backend.search(np.array([[0.0, 1.0, 0.5]], dtype=np.float32), k=2)
    >>> rows.tolist()  # row 1 scores highest but is dead
    [[2, 0]]
    """

    name = "exact"

    def __init__(self, *, chunk_rows: int | None = None, use_faiss: bool | None = None):
        self.chunk_rows = chunk_rows
        self.use_faiss = use_faiss
        self._vectors = np.zeros((0, 0), dtype=np.float32)
        self._alive = np.zeros(0, dtype=bool)

    def update(self, vectors: np.ndarray, alive: np.ndarray) -> None:
        self._vectors = vectors
        self._alive = alive

    def flush(self) -> None:
        pass

    def search_masked(
        self, queries: np.ndarray, k: int, mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` among the live rows where ``mask`` is True (a filter's matches)."""
        return self._search(queries, k, mask if not len(self._alive) else mask & self._alive)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self._search(queries, k, self._alive)

    def _search(self, queries, k, alive) -> tuple[np.ndarray, np.ndarray]:
        options = {"chunk_rows": self.chunk_rows, "use_faiss": self.use_faiss}
        return exact_search(self._vectors, queries, k, alive=alive, **options)


def exact_search(
    vectors: np.ndarray,
    queries: np.ndarray,
    k: int,
    *,
    alive: np.ndarray | None = None,
    chunk_rows: int | None = None,
    use_faiss: bool | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` rows of ``vectors`` by inner product with each query, best first.

    ``vectors`` is ``(n, dim)`` float32 or float16 (a memmap is fine); ``alive`` masks rows
    out. Returns ``(scores, rows)`` of shape ``(q, k)``, padded with ``-inf`` / ``-1``.

    >>> import numpy as np
    >>> vectors = np.array([[1, 0], [0, 1], [0.5, 0.5]], dtype=np.float32)
    >>> exact_search(vectors, np.array([[1.0, 0.0]], dtype=np.float32), k=2)[1].tolist()
    [[0, 2]]
    """
    queries = np.ascontiguousarray(queries, dtype=np.float32)  # (q, d)
    n_queries, n_rows = queries.shape[0], len(vectors)
    best_scores = torch.full((n_queries, k), float("-inf"))
    best_rows = torch.full((n_queries, k), -1, dtype=torch.int64)
    if n_rows == 0 or k == 0 or n_queries == 0:
        return best_scores.numpy(), best_rows.numpy()
    if alive is not None and alive.all():
        alive = None
    small_batch = n_queries < _FAISS_MAX_QUERIES
    faiss = faiss_module() if use_faiss is not False and small_batch else None
    if use_faiss and faiss is None and small_batch:
        raise ImportError("use_faiss=True needs faiss: pip install 'densefit[index]'")
    widen = vectors.dtype != np.float32
    if chunk_rows:
        chunk = chunk_rows
    elif widen:
        chunk = _WIDEN_CHUNK
    elif faiss is not None:
        chunk = _MAX_CHUNK
    else:
        chunk = min(_MAX_CHUNK, max(_MIN_CHUNK, _SCORE_BUDGET // n_queries))
    chunk = min(chunk, n_rows)
    if faiss is not None and chunk == n_rows and not widen:  # one block: FAISS's answer as is
        return _faiss_top_k(faiss, queries, vectors, alive, k)
    # Buffers reused across chunks: fresh multi-megabyte allocations cost a page fault per
    # 4 KiB, which at a million rows costs more than the arithmetic.
    widened = torch.empty((chunk, queries.shape[1])) if widen else None  # (c, d)
    scores_buffer = None if faiss is not None else torch.empty(n_queries * chunk)
    query_tensor = torch.from_numpy(queries)
    for start in range(0, n_rows, chunk):
        block_alive = None if alive is None else np.asarray(alive[start : start + chunk])
        if block_alive is not None and not block_alive.any():
            continue
        block = _float_block(vectors[start : start + chunk], widened)  # (c, d) float32
        if faiss is not None:
            found = _faiss_chunk_top_k(faiss, queries, block.numpy(), block_alive, k)
            top_scores, top_idx = map(torch.from_numpy, found)
        else:
            scores = scores_buffer[: n_queries * len(block)].view(n_queries, len(block))
            torch.mm(query_tensor, block.T, out=scores)  # (q, c)
            if block_alive is not None:
                scores.masked_fill_(~torch.from_numpy(block_alive), float("-inf"))
            top_scores, top_idx = torch.topk(scores, min(k, len(block)), dim=1)  # (q, <=k)
        merged_scores = torch.cat([best_scores, top_scores], dim=1)
        merged_rows = torch.cat([best_rows, top_idx + start], dim=1)
        best_scores, pick = torch.topk(merged_scores, k, dim=1)
        best_rows = torch.gather(merged_rows, 1, pick)
    best_rows[torch.isinf(best_scores)] = -1
    return best_scores.numpy(), best_rows.numpy()


def _float_block(block: np.ndarray, widened: torch.Tensor | None) -> torch.Tensor:
    """``block`` as a float32 tensor: shared memory, or widened into the reusable buffer."""
    block = np.asarray(block)
    if widened is None:
        return _as_tensor(np.ascontiguousarray(block, dtype=np.float32))
    out = widened[: len(block)]
    out.copy_(_as_tensor(block))
    return out


def _faiss_chunk_top_k(faiss, queries, block, block_alive, k):
    n_queries, (n_rows, dim) = len(queries), block.shape
    k = min(k, n_rows)
    scores = np.empty((n_queries, k), dtype=np.float32)
    rows = np.empty((n_queries, k), dtype=np.int64)
    args = [faiss.swig_ptr(queries), faiss.swig_ptr(block), dim, n_queries, n_rows, k]
    args += [faiss.swig_ptr(scores), faiss.swig_ptr(rows)]
    if block_alive is not None:
        bits = np.packbits(block_alive, bitorder="little")  # kept alive until the call returns
        args.append(faiss.IDSelectorBitmap(n_rows, faiss.swig_ptr(bits)))
    faiss.knn_inner_product(*args)
    # FAISS marks missing results with -1 and a -inf-ish score; normalise to -inf.
    missing = rows < 0
    scores[missing] = -np.inf
    rows[missing] = 0
    return scores, rows


def _faiss_top_k(faiss, queries, vectors, alive, k) -> tuple[np.ndarray, np.ndarray]:
    """:func:`exact_search`'s answer when ``vectors`` (float32) is one block for FAISS."""
    scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    rows = np.full((len(queries), k), -1, dtype=np.int64)
    if alive is None or alive.any():
        block = _float_block(vectors, None).numpy()
        found_scores, found_rows = _faiss_chunk_top_k(faiss, queries, block, alive, k)
        n = found_scores.shape[1]  # k, or fewer rows
        scores[:, :n], rows[:, :n] = found_scores, found_rows
    rows[np.isinf(scores)] = -1
    return scores, rows


def faiss_module():
    """``faiss`` when it is installed, else None."""
    try:
        import faiss  # the optional extra `index`
    except ImportError:
        return None
    return faiss


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing memory with ``array`` (read-only memmaps included: never written)."""
    if not array.flags.writeable:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(array)
    return torch.from_numpy(array)
