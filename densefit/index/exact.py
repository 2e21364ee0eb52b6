"""Exact inner-product search: matrix products over chunks of the stored vectors.

Each chunk of rows is scored against all queries at once (one BLAS call), dead rows are
masked, and a running top-k is merged chunk by chunk, so memory stays bounded however many
rows there are. float16 stores are widened to float32 one chunk at a time.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["ExactBackend", "exact_search"]

# Score-matrix budget per chunk (queries x rows), in float32 values: 16M = 64 MiB.
_SCORE_BUDGET = 1 << 24
_MIN_CHUNK, _MAX_CHUNK = 1 << 12, 1 << 18


class ExactBackend:
    """Brute-force search over every live row: always the true top-k.

    >>> import numpy as np
    >>> backend = ExactBackend()
    >>> backend.update(np.eye(3, dtype=np.float32), np.array([True, False, True]))
    >>> scores, rows = backend.search(np.array([[0.0, 1.0, 0.5]], dtype=np.float32), k=2)
    >>> rows.tolist()  # row 1 scores highest but is dead
    [[2, 0]]
    """

    name = "exact"

    def __init__(self, *, chunk_rows: int | None = None):
        self.chunk_rows = chunk_rows
        self._vectors = np.zeros((0, 0), dtype=np.float32)
        self._alive = np.zeros(0, dtype=bool)

    def update(self, vectors: np.ndarray, alive: np.ndarray) -> None:
        self._vectors = vectors
        self._alive = alive

    def flush(self) -> None:
        pass

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return exact_search(self._vectors, queries, k, alive=self._alive, chunk_rows=self.chunk_rows)


def exact_search(
    vectors: np.ndarray,
    queries: np.ndarray,
    k: int,
    *,
    alive: np.ndarray | None = None,
    chunk_rows: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` rows of ``vectors`` by inner product with each query, best first.

    ``vectors`` is ``(n, dim)`` float32 or float16 (a memmap is fine); ``alive`` masks rows
    out. Returns ``(scores, rows)`` of shape ``(q, k)``, padded with ``-inf`` / ``-1``.

    >>> import numpy as np
    >>> vectors = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float32)
    >>> exact_search(vectors, np.array([[1.0, 0.0]], dtype=np.float32), k=2)[1].tolist()
    [[0, 2]]
    """
    queries = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))  # (q, d)
    n_queries, n_rows = queries.shape[0], len(vectors)
    best_scores = torch.full((n_queries, k), float("-inf"))
    best_rows = torch.full((n_queries, k), -1, dtype=torch.int64)
    if n_rows == 0 or k == 0 or n_queries == 0:
        return best_scores.numpy(), best_rows.numpy()
    chunk = chunk_rows or min(_MAX_CHUNK, max(_MIN_CHUNK, _SCORE_BUDGET // n_queries))
    alive_t = None if alive is None or alive.all() else torch.from_numpy(np.asarray(alive))
    for start in range(0, n_rows, chunk):
        block = _as_float_tensor(vectors[start : start + chunk])  # (c, d)
        scores = queries @ block.T  # (q, c)
        if alive_t is not None:
            scores.masked_fill_(~alive_t[start : start + chunk], float("-inf"))
        top_scores, top_idx = torch.topk(scores, min(k, scores.shape[1]), dim=1)  # (q, <=k)
        merged_scores = torch.cat([best_scores, top_scores], dim=1)
        merged_rows = torch.cat([best_rows, top_idx + start], dim=1)
        best_scores, pick = torch.topk(merged_scores, k, dim=1)
        best_rows = torch.gather(merged_rows, 1, pick)
    best_rows[torch.isinf(best_scores)] = -1
    return best_scores.numpy(), best_rows.numpy()


def _as_float_tensor(array: np.ndarray) -> torch.Tensor:
    """A float32 tensor sharing memory with ``array`` when it is float32 already."""
    array = np.asarray(array)
    if not array.flags.writeable:  # read-only memmaps: torch warns but never writes to them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
    else:
        tensor = torch.from_numpy(array)
    return tensor if tensor.dtype == torch.float32 else tensor.float()
