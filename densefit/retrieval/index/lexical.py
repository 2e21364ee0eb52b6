"""The store's BM25 index: a cache of its live documents' texts, checked before every use.

Every document a store holds lives at one row of the vector file, and a row's text never
changes (an updated text gets a new row; the old row dies). So the BM25 index of a store is
determined by its live rows, and :class:`StoreBm25` records exactly which rows it covers. Before
a BM25 search it compares them with the rows the store has committed (SQLite is the truth),
and if they differ it brings itself up to date first: the texts of rows it lacks are read from
SQLite and tokenised, the token ids of rows that are still live are kept, dead rows are
dropped, and the score matrix is rebuilt from the token ids (:mod:`densefit.retrieval.bm25`:
vectorised, a fraction of a second for 10,000 documents). It never answers from a stale index.

Writes do not touch it, so writing stays as fast as before and a crash between a write's
commit and a BM25 update cannot leave them disagreeing: the next BM25 search sees the rows
differ. The index is saved as ``bm25-<generation>.npz`` (written to a temporary file, fsync'd
and renamed: complete or absent) when the store flushes (``index_documents`` flushes at its
end; closing a store flushes), and read back by the next process that needs it; a file that
is missing, unreadable or of another generation (the store was compacted) is rebuilt from the
texts. Rows added since the file was saved are tokenised; the rest is reused.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from densefit.retrieval.bm25 import Bm25Index, Tokens

__all__ = ["BM25_SCALE", "StoreBm25"]

FORMAT = 1
# Haystack's InMemoryBM25Retriever scales BM25 scores to [0, 1] as expit(score / 8).
BM25_SCALE = 8.0


class StoreBm25:
    """The BM25 index of the live rows of one store folder (see the module docstring).

    ``texts_of(rows)`` reads the texts of vector rows from the store's documents.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.generation = -1
        self.rows = np.zeros(0, dtype=np.int64)  # sorted live rows the index covers
        self.index: Bm25Index | None = None
        self.saved = True  # the file holds what memory holds (or there is nothing)
        self.updates = 0  # times brought up to date (with texts tokenised)
        self.tokenised = 0  # texts tokenised in all

    def path_for(self, generation: int) -> Path:
        return self.folder / f"bm25-{generation}.npz"

    @property
    def loaded(self) -> bool:
        """Whether an index is in memory (it was used or built in this process)."""
        return self.index is not None

    def is_current(self, generation: int, live_rows: np.ndarray) -> bool:
        return (
            self.index is not None
            and self.generation == generation
            and np.array_equal(self.rows, live_rows)
        )

    def current(
        self, generation: int, live_rows: np.ndarray, texts_of: Callable[[np.ndarray], list[str]]
    ) -> Bm25Index:
        """The index of exactly ``live_rows`` (sorted), brought up to date if it is not."""
        update = self.plan(generation, live_rows, texts_of)
        if update is not None:
            self.install(update.build())
        return self.index

    def plan(
        self, generation: int, live_rows: np.ndarray, texts_of: Callable[[np.ndarray], list[str]]
    ) -> _Update | None:
        """What bringing the index up to date to ``live_rows`` takes (None: it is current):
        the token ids kept and the texts of the rows it lacks. Cheap; the caller holds the
        store's lock. :meth:`_Update.build` does the work and needs no lock."""
        live_rows = np.asarray(live_rows, dtype=np.int64)
        if self.is_current(generation, live_rows):
            return None
        if self.index is None or self.generation != generation:
            self._load(generation)
            if self.is_current(generation, live_rows):
                return None
        keep = np.isin(self.rows, live_rows, assume_unique=True)
        new_rows = np.setdiff1d(live_rows, self.rows[keep], assume_unique=True)
        kept = self.index.tokens if self.index is not None else Tokens.empty()
        return _Update(generation, self.rows[keep], kept, np.flatnonzero(keep), new_rows,
                       texts_of(new_rows))  # fmt: skip

    def install(self, built: tuple[int, np.ndarray, Bm25Index, int]) -> None:
        """Take an index :meth:`_Update.build` made (unless the store was compacted since:
        then its rows mean other documents). An index of an older state is still exact for
        the rows it records; the next :meth:`current` brings it further."""
        generation, rows, index, tokenised = built
        if self.index is not None and generation != self.generation:
            return
        if self.is_current(generation, rows):  # a search brought it there meanwhile
            return
        self.index, self.rows, self.generation = index, rows, generation
        self.saved = False
        self.updates += 1
        self.tokenised += tokenised

    def search(
        self, queries: Sequence[str], k: int, mask: np.ndarray | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(rows, scores)`` of the best ``k`` documents for each query (score above 0: a
        document sharing no token with the query is not found); ``mask`` is over store rows.
        Call :meth:`current` first."""
        weights = None if mask is None else np.asarray(mask)[self.rows]
        found = self.index.search(queries, k, weights)
        return [(self.rows[positions], scores) for positions, scores in found]

    def renumbered(self, generation: int) -> None:
        """The store was compacted into ``generation``: its live rows, in order, are now
        ``0 .. n - 1`` (call only when the index covered exactly those rows)."""
        if self.index is None:
            return
        self.rows = np.arange(len(self.rows), dtype=np.int64)
        self.generation = generation
        self.saved = False

    def save(self) -> None:
        """Write the index to ``bm25-<generation>.npz`` (complete or absent)."""
        if self.index is None or self.saved:
            return
        path = self.path_for(self.generation)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                np.savez(
                    f,
                    format=np.array(FORMAT),
                    generation=np.array(self.generation),
                    rows=self.rows,
                    **self.index.to_arrays(),
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except FileNotFoundError:  # another process cleaned it up meanwhile: saved next time
            return
        finally:
            tmp.unlink(missing_ok=True)
        self.saved = True

    def remove_other_generations(self, generation: int) -> None:
        """Delete the files of other generations, and temporary files that no running
        process is writing (left by a crash)."""
        keep = self.path_for(generation).name
        for path in self.folder.glob("bm25-*.npz"):
            if path.name != keep:
                path.unlink(missing_ok=True)
        for path in self.folder.glob("bm25-*.npz.*.tmp"):
            if not _running(path.suffixes[-2].lstrip(".")):
                path.unlink(missing_ok=True)

    def _load(self, generation: int) -> None:
        """Read the saved index of ``generation``; nothing usable: start empty."""
        self.index, self.rows, self.generation = None, np.zeros(0, dtype=np.int64), generation
        path = self.path_for(generation)
        if not path.is_file():
            return
        try:
            with np.load(path, allow_pickle=False) as arrays:
                if int(arrays["format"]) != FORMAT or int(arrays["generation"]) != generation:
                    return
                rows = np.asarray(arrays["rows"], dtype=np.int64)
                index = Bm25Index.from_arrays(arrays)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # rebuilt
            return
        if len(rows) != index.n_docs or (len(rows) and np.any(np.diff(rows) <= 0)):
            return
        self.index, self.rows = index, rows
        self.saved = True


@dataclass
class _Update:
    """An update planned under the store's lock (:meth:`StoreBm25.plan`), built without it."""

    generation: int
    kept_rows: np.ndarray
    tokens: Tokens  # the current index's tokens, of which ``keep`` are kept
    keep: np.ndarray
    new_rows: np.ndarray
    new_texts: list[str]

    def build(self) -> tuple[int, np.ndarray, Bm25Index, int]:
        """``(generation, rows, index, texts tokenised)``: the kept token ids, the new texts
        tokenised, in row order, and the score matrix over them."""
        tokens = self.tokens.select(self.keep).extended(self.new_texts)
        rows = np.concatenate([self.kept_rows, self.new_rows])
        order = np.argsort(rows, kind="stable")
        index = Bm25Index(tokens.select(order))
        return self.generation, rows[order], index, len(self.new_rows)


def _running(pid: str) -> bool:
    """Whether process ``pid`` (a string from a file name) exists on this machine."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True
