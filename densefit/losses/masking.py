"""False negatives inside the loss (the step telemetry is in :mod:`densefit.training.telemetry`).

In-batch negatives are only negatives if they are different documents. A batch can hold
the same text twice (duplicate rows, a hard negative equal to some row's positive, the same
mined negative for two queries) or another positive of the same query (BEIR queries with
several relevant documents, mined rows that share a query). Left in, such a candidate is a
*false negative*: the loss pushes the anchor away from a document it should retrieve.

:func:`false_negative_mask` builds a ``(B, B + M)`` bool mask over the candidates of
:func:`densefit.losses.mnrl` (the ``B`` positives, then the ``M`` hard negatives flattened
in row order). For anchor ``i``, candidate ``c`` is masked when

- its text is identical to anchor ``i``'s positive (other than ``i``'s own positive slot);
- its text already appeared at an earlier candidate (each distinct text counts once, so a
  batch with duplicates has the same loss as the batch with the duplicates removed);
- its document id is a known positive of anchor ``i`` (``positive_ids`` / ``positive_id``
  of the row; candidates carry ``positive_id`` and ``negative_ids`` where known).

The mask is a loss input, not a sampler: it works with every memory strategy (the gradient
cache computes the loss on all the batch's embeddings at once) and costs O(B + M) hashing
plus a compact mask (text and id groups, never B x (B + M)) whose rows the chunked loss
builds one block at a time, only when something is masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from densefit.data.types import TrainingExample

__all__ = [
    "BatchMask",
    "CandidateMask",
    "candidates_of",
    "false_negative_mask",
]


class CandidateMask:
    """A ``(B, C)`` false-negative mask kept compact: O(B + C + known pairs), never B x C.

    Rows are built on demand, a block at a time (``mask[start:stop]``), so the chunked loss
    never holds more than one block of it; :meth:`dense` gives the whole matrix for small
    batches and tests. An anchor's own positive (column ``i`` for anchor ``i``) is never
    masked. ``transposed()`` is the mask of the symmetric direction: positive ``j`` picking
    its anchor among the ``B`` anchors, excluding anchor ``i`` where anchor ``i`` excludes
    positive ``j``.
    """

    def __init__(
        self,
        n_anchors: int,
        n_candidates: int,
        *,
        group: torch.Tensor | None = None,  # (C,) id of each candidate's text
        first: torch.Tensor | None = None,  # (C,) True at a text's first occurrence
        id_group: torch.Tensor | None = None,  # (C,) document id of each candidate, -1 unknown
        anchor_set: torch.Tensor | None = None,  # (B,) each anchor's known-positive set, -1 none
        known: torch.Tensor | None = None,  # (K, 2) (set, document id), sorted by set
        n_ids: int = 0,
        transposed: bool = False,
    ):
        self.n_anchors, self.n_candidates = n_anchors, n_candidates
        self.group, self.first, self.id_group, self.known = group, first, id_group, known
        self.anchor_set = anchor_set
        self.n_ids, self.is_transposed = n_ids, transposed

    @property
    def shape(self) -> tuple[int, int]:
        B = self.n_anchors
        return (B, B) if self.is_transposed else (B, self.n_candidates)

    def to(self, device: torch.device | str) -> CandidateMask:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return CandidateMask(
            self.n_anchors,
            self.n_candidates,
            group=move(self.group),
            first=move(self.first),
            id_group=move(self.id_group),
            anchor_set=move(self.anchor_set),
            known=move(self.known),
            n_ids=self.n_ids,
            transposed=self.is_transposed,
        )

    def transposed(self) -> CandidateMask:
        """``mask[:, :B].T``: rows are positives, columns anchors (symmetric MNRL)."""
        out = self.to(self.group.device if self.group is not None else "cpu")
        out.is_transposed = not self.is_transposed
        return out

    def rows(self, start: int, stop: int) -> CandidateMask | _RowView:
        """Rows ``start:stop`` only, still compact (one device's share of the anchors)."""
        if (start, stop) == (0, self.shape[0]):
            return self
        return _RowView(self, start, stop)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise IndexError("CandidateMask rows are taken in contiguous blocks")
        duplicate, known = self._parts(start, stop)
        out = duplicate if known is None else (known if duplicate is None else duplicate | known)
        if out is None:
            out = torch.zeros(stop - start, self.shape[1], dtype=torch.bool, device=self._device)
        return out

    def dense(self) -> torch.Tensor:
        return self[:]

    def counts(self, block: int = 512) -> tuple[int, int]:
        """Masked (duplicate, known-positive-only) pairs, counted block by block."""
        n_dup = n_known = 0
        for start in range(0, self.shape[0], block):
            duplicate, known = self._parts(start, min(start + block, self.shape[0]))
            if duplicate is not None:
                n_dup += int(duplicate.sum())
            if known is not None:
                n_known += int((known & ~duplicate).sum() if duplicate is not None else known.sum())
        return n_dup, n_known

    @property
    def _device(self) -> torch.device:
        for t in (self.group, self.id_group):
            if t is not None:
                return t.device
        return torch.device("cpu")

    def _parts(self, start: int, stop: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rows ``start:stop`` of the duplicate part and of the known-positive part."""
        B, c = self.n_anchors, stop - start
        rows = torch.arange(start, stop, device=self._device)
        duplicate = known = None
        if self.is_transposed:  # element (j, i) = mask[i, j], i, j < B
            if self.group is not None:
                g = self.group[:B]
                duplicate = (g[rows, None] == g[None, :]) | ~self.first[rows, None]
            if self.known is not None:
                known = self._known_columns(rows)
        else:
            if self.group is not None:
                duplicate = (self.group[rows, None] == self.group[None, :]) | ~self.first[None, :]
            if self.known is not None:
                known = self._known_rows(start, stop)
        own = torch.arange(c, device=self._device)
        for part in (duplicate, known):
            if part is not None:
                part[own, rows] = False  # the true positive always counts
        return duplicate, known

    def _known_rows(self, start: int, stop: int) -> torch.Tensor:
        """(stop - start, C): True where the candidate's id is a known positive of the anchor."""
        sets = self.anchor_set[start:stop]
        which, ids = _expand(self.known[:, 0], self.known[:, 1], sets)
        table = torch.zeros(stop - start, self.n_ids + 1, dtype=torch.bool, device=self._device)
        table[which, ids] = True
        column = torch.where(self.id_group >= 0, self.id_group, self.n_ids)  # unknown: never
        return table[:, column]

    def _known_columns(self, rows: torch.Tensor) -> torch.Tensor:
        """(len(rows), B): True at (j, i) where positive ``j``'s id is a known positive of anchor ``i``."""
        ids, order = torch.sort(self.known[:, 1])
        which, sets = _expand(ids, self.known[:, 0][order], self.id_group[rows])
        n_sets = int(self.anchor_set.max()) + 1
        table = torch.zeros(len(rows), n_sets + 1, dtype=torch.bool, device=self._device)
        table[which, sets] = True
        column = torch.where(self.anchor_set >= 0, self.anchor_set, n_sets)  # none: never
        return table[:, column]


class _RowView:
    """Rows ``start:stop`` of a :class:`CandidateMask`, indexed from 0, built per block."""

    def __init__(self, base: CandidateMask, start: int, stop: int):
        self.base, self.start, self.stop = base, start, stop

    @property
    def shape(self) -> tuple[int, int]:
        return (self.stop - self.start, self.base.shape[1])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, step = rows.indices(self.stop - self.start)
        if step != 1:
            raise IndexError("CandidateMask rows are taken in contiguous blocks")
        return self.base[self.start + start : self.start + stop]

    def dense(self) -> torch.Tensor:
        return self[:]


def _expand(keys: torch.Tensor, values: torch.Tensor, wanted: torch.Tensor):
    """For sorted ``keys``: (i, value) for every pair whose key equals ``wanted[i]``."""
    keys = keys.contiguous()
    lo = torch.searchsorted(keys, wanted)
    count = torch.searchsorted(keys, wanted, right=True) - lo  # 0 for a missing key (-1)
    which = torch.repeat_interleave(torch.arange(len(wanted), device=keys.device), count)
    offset = torch.arange(int(count.sum()), device=keys.device)
    offset -= torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    return which, values[torch.repeat_interleave(lo, count) + offset]


@dataclass
class BatchMask:
    """The false-negative mask of one batch and what it found.

    ``mask`` is None when nothing needs masking (the usual case: the loss runs unmasked).
    ``duplicates`` and ``known_positives`` count masked (anchor, candidate) pairs;
    a pair that is both a duplicate and a known positive counts as a duplicate.
    """

    mask: CandidateMask | None  # (B, B + M), True = excluded for that anchor; compact
    candidates: int
    unique_candidates: int
    duplicates: int
    known_positives: int

    def telemetry(self) -> dict:
        return {
            "candidates": self.candidates,
            "unique_candidates": self.unique_candidates,
            "masked_duplicates": self.duplicates,
            "masked_known_positives": self.known_positives,
        }


def candidates_of(rows: Sequence[TrainingExample]) -> tuple[list[str], list[str]]:
    """Texts and ids ("" = unknown) of a batch's MNRL candidates: positives, then negatives.

    >>> rows = [TrainingExample("q", "p", ("n1", "n2"), positive_id="d1", negative_ids=("d7", "d8"))]
    >>> candidates_of(rows)
    (['p', 'n1', 'n2'], ['d1', 'd7', 'd8'])
    """
    texts = [r.positive for r in rows]
    ids = [r.positive_id for r in rows]
    for r in rows:
        texts += r.negatives
        aligned = len(r.negative_ids) == len(r.negatives)
        ids += r.negative_ids if aligned else [""] * len(r.negatives)
    return texts, ids


def false_negative_mask(rows: Sequence[TrainingExample]) -> BatchMask:
    """The (B, B + M) false-negative mask of a batch (see the module docstring).

    Example:
        >>> rows = [TrainingExample("q1", "cells divide", ("python",)),
        ...         TrainingExample("q2", "genes", ("cells divide",))]  # q1's positive again
        >>> found = false_negative_mask(rows)
        >>> found.mask.dense().int().tolist()  # candidates: cells divide, genes, python, cells divide
        [[0, 0, 0, 1], [0, 0, 0, 1]]
        >>> found.unique_candidates, found.duplicates
        (3, 2)
    """
    B = len(rows)
    texts, ids = candidates_of(rows)
    C = len(texts)
    group_of: dict[str, int] = {}
    groups, first = [], []
    for text in texts:
        n = len(group_of)
        g = group_of.setdefault(text, n)
        groups.append(g)
        first.append(g == n)
    parts: dict = {}
    if len(group_of) < C:  # some text repeats: copies of each positive, and later copies
        parts.update(group=torch.tensor(groups), first=torch.tensor(first))

    id_of: dict[str, int] = {}
    id_group = [id_of.setdefault(doc_id, len(id_of)) if doc_id else -1 for doc_id in ids]
    # Rows of the same query share one set of known positives: store each set once.
    set_of: dict[tuple, int] = {}
    anchor_set, known = [-1] * B, []
    if id_of:
        for i, row in enumerate(rows):
            key = row.positive_ids  # a BEIR query's relevant documents include this row's
            if row.positive_id and row.positive_id not in key:
                key = (*key, row.positive_id)
            s = set_of.get(key)
            if s is None:
                s = set_of[key] = len(set_of)
                ids_in_batch = {
                    id_of[p] for p in (*row.positive_ids, row.positive_id) if p in id_of
                }
                known.append(torch.tensor(sorted(ids_in_batch), dtype=torch.long))
            anchor_set[i] = s
    if any(len(k) for k in known):
        sets = torch.repeat_interleave(
            torch.arange(len(known)), torch.tensor([len(k) for k in known])
        )
        parts.update(
            id_group=torch.tensor(id_group),
            anchor_set=torch.tensor(anchor_set),
            known=torch.stack([sets, torch.cat(known)], dim=1),
            n_ids=len(id_of),
        )
    mask = CandidateMask(B, C, **parts) if parts else None
    n_dup, n_known = mask.counts() if mask is not None else (0, 0)
    if n_dup + n_known == 0:
        mask = None
    return BatchMask(mask, C, len(group_of), n_dup, n_known)
