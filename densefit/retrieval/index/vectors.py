"""The append-only file of raw vectors behind a store, its commit protocol, and the backend
that searches the committed rows.

The store's vector kind (:data:`densefit.choices.VECTOR_KINDS`) decides both: ``float32`` and
``float16`` files are searched as they are (exact or FAISS); ``int8`` and ``binary`` stores
keep a float32 file on disk and search it through their codes in memory, rescoring the
candidates against the file (:mod:`densefit.retrieval.index.quantized`).

Rows are written at the end of the file and made durable (``fsync``) *before* the SQLite
transaction that records the new row count commits. Readers map only the committed rows, so a
crash between the two steps leaves unreferenced bytes past the end that the next write
overwrites: the last committed state is always readable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from densefit.choices import VECTOR_KINDS
from densefit.errors import RESTORE, DamagedFileError
from densefit.retrieval.index.base import VectorBackend
from densefit.retrieval.index.exact import ExactBackend, exact_search
from densefit.retrieval.index.faiss_backend import FaissBackend
from densefit.retrieval.index.quantized import QUANTIZED_KINDS, QuantizedBackend, checked_rescore

__all__ = ["FILE_DTYPES", "CommittedVectors", "VectorFile", "make_backend", "search_rows"]

# The dtype of each vector kind's file: quantized kinds keep float32 vectors for rescoring.
FILE_DTYPES = {"float32": "float32", "float16": "float16", "int8": "float32", "binary": "float32"}
_SUFFIXES = {"float32": "f32", "float16": "f16"}
assert set(FILE_DTYPES) == set(VECTOR_KINDS)

# A filter matching at most this fraction of the rows is searched exactly over its rows
# alone (reading only them); larger ones go through the backend with a row mask.
SUBSET_FRACTION = 1 / 8
_SUBSET_CHUNK = 1 << 16


class VectorFile:
    """``(rows, dim)`` vectors of one dtype in a raw little-endian file.

    >>> import tempfile, numpy as np
    >>> vf = VectorFile(Path(tempfile.mkdtemp()) / "v.f32", dim=2, dtype="float32")
    >>> vf.write(0, np.ones((3, 2), dtype=np.float32))
    >>> vf.view(3).shape
    (3, 2)
    """

    def __init__(self, path: str | os.PathLike, *, dim: int, dtype: str):
        self.path = Path(path)
        self.dim = dim
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.row_bytes = self.dim * self.dtype.itemsize

    def write(self, start_row: int, vectors: np.ndarray) -> None:
        """Write ``vectors`` from ``start_row`` on, drop anything after them, and fsync."""
        data = np.ascontiguousarray(vectors, dtype=self.dtype)
        if data.ndim != 2 or data.shape[1] != self.dim:
            raise ValueError(f"expected (n, {self.dim}) vectors, got {data.shape}")
        offset = start_row * self.row_bytes
        view = memoryview(data).cast("B")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, offset)  # bytes left by a write that never committed
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], offset + written)
            os.fsync(fd)
        except OSError as exc:  # a full disk: say which file
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        finally:
            os.close(fd)

    def drop_uncommitted(self, rows: int) -> int:
        """Cut the file after its first ``rows`` rows (the committed ones; the caller holds
        the write lock); returns the bytes dropped."""
        extra = self.path.stat().st_size - rows * self.row_bytes if self.path.exists() else 0
        if extra > 0:
            os.truncate(self.path, rows * self.row_bytes)
        return max(extra, 0)

    def view(self, rows: int) -> np.ndarray:
        """A read-only ``(rows, dim)`` memory map of the first ``rows`` rows."""
        if rows == 0:
            return np.zeros((0, self.dim), dtype=self.dtype)
        on_disk = self.path.stat().st_size // self.row_bytes if self.path.exists() else 0
        if on_disk < rows:
            raise DamagedFileError(
                f"{self.path}: the file holds {on_disk:,} vectors but the store committed "
                f"{rows:,} (it was cut or replaced outside densefit): {RESTORE}"
            )
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(rows, self.dim))


def make_backend(
    spec: str | Callable[[int], VectorBackend],
    dim: int,
    cache_path: Path | None = None,
    *,
    kind: str = "float32",
    rescore: int | None = None,
) -> VectorBackend:
    """Build a backend from ``"exact"``, ``"faiss"`` / ``"faiss:FACTORY"`` or a factory, for a
    store of vector ``kind``: ``int8`` and ``binary`` stores search their codes and rescore
    ``rescore x k`` candidates (``"exact"`` or ``"faiss"``, the same search).

    >>> make_backend("exact", dim=4).name
    'exact'
    >>> make_backend("exact", dim=4, kind="binary", rescore=8).rescore
    8
    """
    rescore = checked_rescore(rescore, kind)
    if kind in QUANTIZED_KINDS:
        if callable(spec) or str(spec) not in ("exact", "faiss"):
            raise ValueError(
                f"backend {spec!r} cannot search a {kind} store: its vectors are searched "
                "through their codes and rescored; use --backend exact (or faiss)"
            )
        return QuantizedBackend(kind, dim, rescore=rescore)
    if callable(spec):
        return spec(dim)
    name, _, option = str(spec).partition(":")
    if name == "exact":
        return ExactBackend()
    if name == "faiss":
        factory = option or "HNSW32"
        slug = "".join(c if c.isalnum() else "_" for c in factory)
        path = cache_path.with_name(f"{cache_path.name}-{slug}.index") if cache_path else None
        return FaissBackend(dim, factory=factory, cache_path=path)
    raise ValueError(
        f"unknown backend {spec!r}: use 'exact', 'faiss' (HNSW32) or 'faiss:FACTORY' "
        "with a FAISS index_factory string such as 'faiss:Flat' or 'faiss:IVF4096,Flat'"
    )


class CommittedVectors:
    """A store's committed vectors: the file of one generation, the live-row mask, the backend.

    The store tells it what SQLite committed (:meth:`load`, :meth:`after_write`); it keeps the
    backend in step. A new generation (after compaction) gets a new file and a new backend.

    >>> import tempfile, numpy as np
    >>> vectors = CommittedVectors(Path(tempfile.mkdtemp()), dim=2, kind="float32", backend="exact")
    >>> vectors.file_for(0).write(0, np.eye(2, dtype=np.float32))
    >>> vectors.load(n_rows=2, generation=0, live_rows=[1])
    >>> vectors.search(np.array([[0.0, 1.0]], dtype=np.float32), 1)[1].tolist()
    [[1]]
    """

    def __init__(self, folder: Path, *, dim: int, kind: str, backend, rescore: int | None = None):
        if kind not in FILE_DTYPES:
            raise ValueError(f"vector kind {kind!r} is not one of {', '.join(VECTOR_KINDS)}")
        self.folder = folder
        self.dim = dim
        self.kind = kind
        self.dtype = FILE_DTYPES[kind]
        self.rescore = rescore
        self.backend_spec = backend
        self.backend: VectorBackend | None = None
        self.generation = -1
        self.n_rows = 0
        self.alive = np.zeros(0, dtype=bool)
        self.file: VectorFile | None = None
        self.finite_rows = 0  # rows of this generation's file known to be finite

    def file_for(self, generation: int, dim: int | None = None) -> VectorFile:
        """The vector file of ``generation`` (``vectors-<gen>.f32`` or ``.f16``), of
        ``dim``-d rows (default: this store's; a model swap's next generation may differ)."""
        suffix = _SUFFIXES[self.dtype]
        return VectorFile(
            self.folder / f"vectors-{generation}.{suffix}", dim=dim or self.dim, dtype=self.dtype
        )

    def use_generation(self, generation: int) -> None:
        """Write to ``generation``'s file from now on (another process compacted)."""
        self.file = self.file_for(generation)
        self.finite_rows = 0

    def load(self, *, n_rows: int, generation: int, live_rows) -> None:
        """Take the committed state: ``n_rows`` rows, of which ``live_rows`` are alive."""
        alive = np.zeros(n_rows, dtype=bool)
        alive[np.asarray(live_rows, dtype=np.int64)] = True
        if generation != self.generation or self.backend is None:
            self.file = self.file_for(generation)
            self.backend = make_backend(
                self.backend_spec,
                self.dim,
                self.folder / f"faiss-{generation}",
                kind=self.kind,
                rescore=self.rescore,
            )
            self.generation, self.finite_rows = generation, 0
        self.n_rows, self.alive = n_rows, alive
        self._check_finite()
        self.backend.update(self.view(), alive)

    def after_write(self, *, dead: list[int], n_rows: int) -> None:
        """Our own commit grew the file to ``n_rows`` and killed the rows ``dead``."""
        alive = self.alive
        if n_rows > len(alive):
            alive = np.concatenate([alive, np.ones(n_rows - len(alive), dtype=bool)])
        alive[dead] = False
        self.alive, self.n_rows = alive, n_rows
        self.finite_rows = n_rows  # checked before they were written
        self.backend.update(self.view(), alive)

    def _check_finite(self) -> None:
        """:class:`~densefit.errors.DamagedFileError` when a committed row not checked yet
        holds NaN or infinity, which densefit never writes (a file changed outside it)."""
        view = self.view()
        for start in range(self.finite_rows, self.n_rows, _SUBSET_CHUNK):
            block = np.asarray(view[start : start + _SUBSET_CHUNK])
            bad = np.flatnonzero(~np.isfinite(block).all(axis=1))
            if len(bad):
                raise DamagedFileError(
                    f"{self.file.path}: vector row {start + int(bad[0]):,} holds NaN or "
                    "infinite values, which densefit never writes (the file was changed "
                    f"outside densefit): {RESTORE}"
                )
        self.finite_rows = self.n_rows

    def view(self, rows: int | None = None) -> np.ndarray:
        """The committed rows (a read-only memory map)."""
        return self.file.view(self.n_rows if rows is None else rows)

    def copy_rows(self, rows: np.ndarray, *, n_rows: int, generation: int) -> None:
        """Write ``rows`` of the current file, in order, as ``generation``'s file (compaction)."""
        old = self.file.view(n_rows)
        new_file = self.file_for(generation)
        new_file.path.unlink(missing_ok=True)
        for start in range(0, len(rows), 1 << 16):
            part = rows[start : start + (1 << 16)]
            new_file.write(start, np.asarray(old[part]))

    def dead_rows(self) -> int:
        """Rows no document points at any more."""
        return int(self.n_rows - self.alive[: self.n_rows].sum())

    def live_rows(self) -> np.ndarray:
        """The committed rows documents point at, sorted."""
        return np.flatnonzero(self.alive[: self.n_rows])

    def search(
        self, queries: np.ndarray, k: int, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The backend's ``(scores, rows)`` for ``queries``; with ``rows``, the best ``k``
        among those rows only (a filter's matches): see :func:`search_rows`."""
        if rows is None:
            return self.backend.search(queries, k)
        return search_rows(self.backend, self.view(), queries, k, rows)

    def remove_other_generations(self, generation: int, building: int | None = None) -> None:
        """Delete vector files and FAISS caches of every generation but ``generation`` (and
        ``building``, the generation a model swap is writing)."""
        keep = {f"vectors-{g}.{_SUFFIXES[self.dtype]}" for g in (generation, building)}
        for path in self.folder.glob("vectors-*.*"):
            if path.name not in keep:
                path.unlink(missing_ok=True)
        for path in self.folder.glob("faiss-*.index*"):
            if not path.name.startswith(f"faiss-{generation}-"):
                path.unlink(missing_ok=True)


def search_rows(
    backend: VectorBackend, vectors: np.ndarray, queries: np.ndarray, k: int, rows
) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of ``rows`` (vector rows) for each query: ``(scores, rows)`` as
    :meth:`VectorBackend.search <densefit.retrieval.index.base.VectorBackend.search>` gives.

    Always ``min(k, len(rows))`` results: a small subset (at most :data:`SUBSET_FRACTION`
    of the rows) is searched exactly by reading only its vectors (a backend with its own
    ``search_subset(queries, k, rows)``, a quantized one, searches its codes of those rows);
    a larger one goes to the backend's optional ``search_masked(queries, k, mask)`` (exact: a
    masked scan; FAISS: an ``IDSelectorBitmap``), and when that comes back short (an
    approximate index missing matches) or the backend has no ``search_masked``, the subset is
    searched exactly.

    >>> import numpy as np
    >>> from densefit.retrieval.index.exact import ExactBackend, exact_search
    >>> vectors = np.eye(3, dtype=np.float32)
    >>> query = np.array([[1.0, 2.0, 0.5]], dtype=np.float32)  # row 1 scores best
    >>> search_rows(ExactBackend(), vectors, query, 5, [2, 0])[1].tolist()  # but is not a match
    [[0, 2, -1, -1, -1]]
    """
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    rows = np.unique(np.asarray(rows, dtype=np.int64))  # sorted: the tie order of a scan
    wanted = min(k, len(rows))
    masked = getattr(backend, "search_masked", None)
    if masked is not None and len(rows) > SUBSET_FRACTION * len(vectors):
        mask = np.zeros(len(vectors), dtype=bool)
        mask[rows] = True
        scores, found = masked(queries, k, mask)
        if ((found >= 0).sum(axis=1) >= wanted).all():
            return scores, found
    subset = getattr(backend, "search_subset", None)
    if subset is not None:
        return subset(queries, k, rows)
    return exact_subset_search(vectors, queries, k, rows)


def exact_subset_search(
    vectors: np.ndarray, queries: np.ndarray, k: int, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` among the sorted ``rows`` of ``vectors``, reading a chunk at a time."""
    best_scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    best_rows = np.full((len(queries), k), -1, dtype=np.int64)
    for start in range(0, len(rows), _SUBSET_CHUNK):
        part = rows[start : start + _SUBSET_CHUNK]
        scores, local = exact_search(np.asarray(vectors[part]), queries, k, use_faiss=False)
        found = np.where(local >= 0, part[np.maximum(local, 0)], -1)
        merged_scores = np.concatenate([best_scores, scores], axis=1)
        merged_rows = np.concatenate([best_rows, found], axis=1)
        # Stable: on equal scores the earlier row wins, as in a full scan.
        order = np.argsort(-merged_scores, axis=1, kind="stable")[:, :k]
        best_scores = np.take_along_axis(merged_scores, order, axis=1)
        best_rows = np.take_along_axis(merged_rows, order, axis=1)
    best_rows[np.isinf(best_scores)] = -1
    return best_scores, best_rows
