"""Batch samplers: rearrange an epoch's batches so that no batch holds the same text twice.

:func:`no_duplicate_batches` takes the plain seeded batches of
:func:`densefit.train.batches` and moves rows between them so that, where the data allows
it, no text (query, positive or hard negative) appears in two rows of one batch. The batch
count and sizes never change (every rank of a distributed run gets the same count), every
row is used exactly once per epoch, and the work is O(rows x texts per row): texts are
hashed, and each batch looks at a bounded number of deferred rows.

A duplicate in a batch is also handled by the loss (:mod:`densefit.masking` masks it), so
this sampler is an optimisation: every batch keeps its full number of distinct negatives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from hashlib import blake2b

from densefit.data.types import TrainingExample

__all__ = ["no_duplicate_batches", "row_keys"]

# Deferred rows each batch re-examines before taking new ones, as a multiple of its size:
# bounds the work per batch (O(n) overall) even when the data is full of duplicates.
_DEFERRED_LOOKS = 2


def row_keys(row: TrainingExample) -> frozenset[bytes]:
    """Stable hashes of every text of a row (query, positive, negatives).

    blake2b rather than ``hash()``: Python salts string hashes per process, and every rank
    of a distributed run must build the same batches.
    """
    texts = (row.query, row.positive, *row.negatives)
    return frozenset(blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8).digest() for t in texts)


def no_duplicate_batches(
    examples: Sequence[TrainingExample], batches: Sequence[Sequence[int]]
) -> list[list[int]]:
    """The rows of ``batches`` regrouped, same sizes in the same order, avoiding duplicates.

    Rows are taken in the order of ``batches`` (the seeded shuffle). A row sharing a text
    with the batch being filled is deferred to a later batch; each batch first retries the
    deferred rows. When no duplicate-free choice is left (the last batches of data that is
    mostly one text), the remaining rows fill the batches anyway: sizes and coverage are
    never traded for uniqueness.

    Example:
        >>> rows = [TrainingExample(q, p) for q, p in [("a", "x"), ("a", "y"), ("b", "z"), ("c", "w")]]
        >>> no_duplicate_batches(rows, [[0, 1], [2, 3]])  # rows 0 and 1 share the query "a"
        [[0, 2], [1, 3]]
    """
    sizes = [len(b) for b in batches]
    stream = (i for b in batches for i in b)
    keys = _Keys(examples)
    deferred: deque[int] = deque()
    out: list[list[int]] = []
    for size in sizes:
        batch: list[int] = []
        seen: set[bytes] = set()
        _retry_deferred(deferred, batch, seen, size, keys)
        while len(batch) < size:
            i = next(stream, None)
            if i is None:
                break
            if seen.isdisjoint(keys[i]):
                batch.append(i)
                seen.update(keys[i])
            else:
                deferred.append(i)
        if len(batch) < size:  # the stream is exhausted: a last look, then accept duplicates
            _retry_deferred(deferred, batch, seen, size, keys)
            while len(batch) < size:
                batch.append(deferred.popleft())
        keys.forget(batch)
        out.append(batch)
    return out


class _Keys(dict):
    """Row index -> its text hashes, computed on first use and dropped once placed."""

    def __init__(self, examples: Sequence[TrainingExample]):
        super().__init__()
        self.examples = examples

    def __missing__(self, i: int) -> frozenset[bytes]:
        self[i] = row_keys(self.examples[i])
        return self[i]

    def forget(self, rows: list[int]) -> None:
        for i in rows:
            self.pop(i, None)


def _retry_deferred(
    deferred: deque[int], batch: list[int], seen: set[bytes], size: int, keys: _Keys
) -> None:
    """Move deferred rows that fit into ``batch``, looking at a bounded number of them."""
    for _ in range(min(len(deferred), _DEFERRED_LOOKS * size)):
        if len(batch) == size:
            return
        i = deferred.popleft()
        if seen.isdisjoint(keys[i]):
            batch.append(i)
            seen.update(keys[i])
        else:
            deferred.append(i)
