"""FAISS as a :class:`~densefit.retrieval.index.base.VectorBackend`: approximate search at scale.

The store's vector file stays the source of truth; the FAISS index is a cache built from it
(lazily, at the first search after new rows were committed) and saved beside it, so a crash
can never leave the FAISS index and the documents disagreeing: at worst the cache is behind
and catches up from the vector file. Dead rows (updated or deleted documents) are filtered
inside FAISS with an ``IDSelectorBitmap``.

``factory`` is a FAISS ``index_factory`` string: ``"HNSW32"`` (default; no training, good
recall at millions of rows), ``"Flat"`` (exact), ``"IVF4096,Flat"`` (trained on the stored
vectors at the first search), ...
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

__all__ = ["FaissBackend", "import_faiss"]

_ADD_CHUNK = 1 << 16


def import_faiss():
    """``import faiss``, or an ImportError that says what to install."""
    try:
        import faiss  # the optional extra `index`
    except ImportError:
        raise ImportError(
            "the FAISS backend needs faiss: pip install 'densefit[index]' (or faiss-cpu); "
            "or use --backend exact"
        ) from None
    return faiss


class FaissBackend:
    """Inner-product search through a FAISS index built from the committed vectors.

    >>> import numpy as np
    >>> backend = FaissBackend(dim=2, factory="Flat")  # doctest: +SKIP
    >>> backend.update(np.eye(2, dtype=np.float32), np.array([True, True]))  # doctest: +SKIP
    >>> backend.search(np.array([[0.0, 1.0]], dtype=np.float32), k=1)[1].tolist()  # doctest: +SKIP
    [[1]]
    """

    name = "faiss"

    def __init__(
        self,
        dim: int,
        *,
        factory: str = "HNSW32",
        ef_search: int = 128,
        nprobe: int = 32,
        cache_path: str | os.PathLike | None = None,
    ):
        self.faiss = import_faiss()
        self.dim = dim
        self.factory = factory
        self.ef_search = ef_search
        self.nprobe = nprobe
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self._vectors = np.zeros((0, dim), dtype=np.float32)
        self._alive = np.zeros(0, dtype=bool)
        self._index = None
        self._dirty = False
        if self.cache_path is not None and self.cache_path.exists():
            self._index = self._read_cache()

    def update(self, vectors: np.ndarray, alive: np.ndarray) -> None:
        self._vectors = vectors
        self._alive = alive

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self._search(queries, k, self._alive)

    def search_masked(
        self, queries: np.ndarray, k: int, mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` among the live rows where ``mask`` is True (a filter's matches),
        through an ``IDSelectorBitmap``. Approximate indexes may return fewer than ``k``
        when few rows match; :func:`~densefit.retrieval.index.vectors.search_rows` then
        searches the matches exactly."""
        return self._search(queries, k, mask & self._alive[: len(mask)])

    def _search(self, queries, k, alive) -> tuple[np.ndarray, np.ndarray]:
        index = self._synced_index()
        queries = np.ascontiguousarray(queries, dtype=np.float32)  # (q, d)
        if index.ntotal == 0 or k == 0:
            scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
            return scores, np.full((len(queries), k), -1, dtype=np.int64)
        bits = None
        if not alive.all():
            bits = np.packbits(alive, bitorder="little")  # referenced until search ends
        scores, rows = index.search(queries, k, params=self._search_params(index, bits))
        missing = rows < 0
        scores[missing] = -np.inf
        rows[missing] = -1
        return scores, rows

    def flush(self) -> None:
        """Bring the index up to date and save it (atomically) beside the store."""
        if self.cache_path is None or len(self._vectors) == 0:
            return
        index = self._synced_index()
        if not self._dirty:
            return
        tmp = self.cache_path.with_name(self.cache_path.name + ".tmp")
        self.faiss.write_index(index, str(tmp))
        os.replace(tmp, self.cache_path)
        self._dirty = False

    # -- internals -------------------------------------------------------------------------

    def _read_cache(self):
        try:
            index = self.faiss.read_index(str(self.cache_path))
        except RuntimeError:  # unreadable cache: rebuild from the vector file
            return None
        return index if index.d == self.dim else None

    def _synced_index(self):
        """The FAISS index holding exactly the committed rows (building or extending it)."""
        n_rows = len(self._vectors)
        if self._index is not None and self._index.ntotal > n_rows:
            self._index = None  # cache from another history of the store: rebuild
        if self._index is None:
            self._index = self.faiss.index_factory(
                self.dim, self.factory, self.faiss.METRIC_INNER_PRODUCT
            )
            self._dirty = True
        index = self._index
        if index.ntotal < n_rows:
            if not index.is_trained:
                self._train(index)
            todo = n_rows - index.ntotal
            with tqdm(
                total=todo, desc=f"FAISS {self.factory}", unit="vec", disable=todo < 4 * _ADD_CHUNK
            ) as bar:
                for start in range(index.ntotal, n_rows, _ADD_CHUNK):
                    block = self._vectors[start : min(start + _ADD_CHUNK, n_rows)]
                    index.add(np.ascontiguousarray(block, dtype=np.float32))
                    bar.update(len(block))
            self._dirty = True
        return index

    def _train(self, index) -> None:
        live = np.flatnonzero(self._alive)
        nlist = _ivf_lists(self.factory)
        needed = 39 * nlist if nlist else 1
        if len(live) < needed:
            raise ValueError(
                f"FAISS index {self.factory!r} must be trained on at least {needed} vectors "
                f"(39 per IVF list) but the store holds {len(live)}: use --backend "
                "faiss:HNSW32 or --backend exact for a store this small"
            )
        rng = np.random.default_rng(0)
        sample = np.sort(rng.choice(live, size=min(len(live), 256 * max(nlist, 1)), replace=False))
        index.train(np.ascontiguousarray(self._vectors[sample], dtype=np.float32))

    def _search_params(self, index, bits):
        faiss = self.faiss
        kwargs = {}
        if bits is not None:
            kwargs["sel"] = faiss.IDSelectorBitmap(len(bits) * 8, faiss.swig_ptr(bits))
        inner = faiss.downcast_index(index)
        if isinstance(inner, faiss.IndexHNSW):
            return faiss.SearchParametersHNSW(efSearch=self.ef_search, **kwargs)
        if isinstance(inner, faiss.IndexIVF):
            return faiss.SearchParametersIVF(nprobe=self.nprobe, **kwargs)
        return faiss.SearchParameters(**kwargs) if kwargs else None


def _ivf_lists(factory: str) -> int:
    match = re.search(r"IVF(\d+)", factory)
    return int(match.group(1)) if match else 0
