"""The append-only file of raw vectors behind a store, and its commit protocol.

Rows are written at the end of the file and made durable (``fsync``) *before* the SQLite
transaction that records the new row count commits. Readers map only the committed rows, so a
crash between the two steps leaves unreferenced bytes past the end that the next write
overwrites: the last committed state is always readable.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["VectorFile"]


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

    def rows_on_disk(self) -> int:
        """Whole rows in the file (committed or not)."""
        return self.path.stat().st_size // self.row_bytes if self.path.exists() else 0

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
        finally:
            os.close(fd)

    def view(self, rows: int) -> np.ndarray:
        """A read-only ``(rows, dim)`` memory map of the first ``rows`` rows."""
        if rows == 0:
            return np.zeros((0, self.dim), dtype=self.dtype)
        on_disk = self.rows_on_disk()
        if on_disk < rows:
            raise OSError(
                f"{self.path} holds {on_disk} vectors but the store committed {rows}: the "
                "vector file was truncated or replaced outside densefit; re-index into a new store"
            )
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(rows, self.dim))
