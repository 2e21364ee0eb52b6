"""False negatives inside the loss, and the per-step batch health telemetry.

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
import torch.nn.functional as F

from densefit.data.types import TrainingExample

__all__ = [
    "BatchMask",
    "CandidateMask",
    "candidates_of",
    "false_negative_mask",
    "health_postfix",
    "in_batch_accuracy",
    "merge_health",
    "score_health",
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
            self.n_anchors, self.n_candidates, group=move(self.group), first=move(self.first),
            id_group=move(self.id_group), anchor_set=move(self.anchor_set),
            known=move(self.known), n_ids=self.n_ids,
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
                ids_in_batch = {id_of[p] for p in (*row.positive_ids, row.positive_id) if p in id_of}
                known.append(torch.tensor(sorted(ids_in_batch), dtype=torch.long))
            anchor_set[i] = s
    if any(len(k) for k in known):
        sets = torch.repeat_interleave(torch.arange(len(known)), torch.tensor([len(k) for k in known]))
        parts.update(
            id_group=torch.tensor(id_group), anchor_set=torch.tensor(anchor_set),
            known=torch.stack([sets, torch.cat(known)], dim=1), n_ids=len(id_of),
        )
    mask = CandidateMask(B, C, **parts) if parts else None
    n_dup, n_known = mask.counts() if mask is not None else (0, 0)
    if n_dup + n_known == 0:
        mask = None
    return BatchMask(mask, C, len(group_of), n_dup, n_known)


@torch.no_grad()
def score_health(
    embeddings: Sequence[torch.Tensor], rows: Sequence[TrainingExample], similarity: str = "cos"
) -> dict:
    """Mean similarity of each anchor to its own positive and to its own hard negatives.

    Detached and O((B + M) d). A hard-negative score close to (or above) the positive score
    is the sign of false negatives among the mined negatives.

    >>> a = torch.tensor([[1.0, 0.0]]); p = torch.tensor([[1.0, 0.0]]); n = torch.tensor([[0.0, 1.0]])
    >>> score_health([a, p, n], [TrainingExample("q", "p", ("n",))])
    {'pos_score': 1.0, 'hard_neg_score': 0.0}
    """
    anchors, positives = embeddings[0].detach().float(), embeddings[1].detach().float()
    d = anchors.shape[-1]
    negatives = embeddings[2].detach().float().reshape(-1, d) if len(embeddings) > 2 else None
    if similarity == "cos":
        anchors, positives = F.normalize(anchors, dim=-1), F.normalize(positives, dim=-1)
        if negatives is not None:
            negatives = F.normalize(negatives, dim=-1)
    out = {
        "pos_score": round(float((anchors * positives).sum(-1).mean()), 4),
        "hard_neg_score": None,
    }
    if negatives is not None and negatives.numel():
        owner = torch.tensor([i for i, r in enumerate(rows) for _ in r.negatives])  # (M,)
        if len(owner) == len(negatives):
            owner = owner.to(anchors.device)
            score = (anchors[owner] * negatives).sum(-1).mean()
            out["hard_neg_score"] = round(float(score), 4)
    return out


@torch.no_grad()
def in_batch_accuracy(
    embeddings: Sequence[torch.Tensor],
    mask: torch.Tensor | None = None,
    similarity: str = "cos",
    block: int | None = None,
) -> float:
    """Fraction of anchors whose own positive strictly outscores every other candidate.

    Candidates are MNRL's: all ``B`` positives, then the ``M`` hard negatives; ``mask``
    (B, B + M) tensor or :class:`CandidateMask`, True = excluded, drops false negatives as
    the loss does. Scores are computed
    in blocks of ``block`` anchors under no_grad, so nothing B x B is held for big batches.

    >>> a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> in_batch_accuracy([a, a, torch.empty(0, 2)])
    1.0
    >>> in_batch_accuracy([a, a, torch.tensor([[1.0, 0.0]])])  # ties anchor 0's positive
    0.5
    """
    anchors, d = embeddings[0].detach().float(), embeddings[0].shape[-1]
    parts = [embeddings[1].detach().float()]
    if len(embeddings) > 2 and embeddings[2].numel():
        parts.append(embeddings[2].detach().float().reshape(-1, d))
    candidates = torch.cat(parts)  # (B + M, d)
    if similarity == "cos":
        anchors, candidates = F.normalize(anchors, dim=-1), F.normalize(candidates, dim=-1)
    B = anchors.shape[0]
    block = block or max(1, 2**20 // max(1, candidates.shape[0]))  # ~1M scores per block
    correct = 0
    for start in range(0, B, block):
        rows = torch.arange(start, min(start + block, B), device=anchors.device)
        scores = anchors[rows] @ candidates.T  # (b, B + M)
        own = scores[rows - start, rows].clone()  # (b,)
        if mask is not None:
            stop = start + len(rows)  # a tensor or a CandidateMask: one block of rows
            scores.masked_fill_(mask[start:stop].to(scores.device), float("-inf"))
        scores[rows - start, rows] = float("-inf")  # compare with every other candidate
        correct += int((own > scores.max(dim=1).values).sum())
    return round(correct / B, 4) if B else 0.0


def merge_health(parts: Sequence[dict]) -> dict:
    """One step's telemetry from its micro-batches': counts add up, scores and accuracies
    are averaged.

    >>> merge_health([{"candidates": 4, "pos_score": 0.5}, {"candidates": 2, "pos_score": 0.7}])
    {'candidates': 6, 'pos_score': 0.6}
    """
    out: dict = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        values = [part[key] for part in parts if part.get(key) is not None]
        if key.endswith(("_score", "_accuracy")):
            out[key] = round(sum(values) / len(values), 4) if values else None
        else:
            out[key] = sum(values)
    return out


def health_postfix(record: dict) -> dict:
    """The batch health fields of a step record, short, for the progress bar.

    >>> health_postfix({"candidates": 8, "unique_candidates": 7, "masked_duplicates": 2,
    ...                 "masked_known_positives": 1, "pos_score": 0.8, "hard_neg_score": 0.5})
    {'uniq': '7/8', 'fn': 3, 'pos/neg': '0.80/0.50'}
    """
    out: dict = {}
    if "candidates" in record:
        out["uniq"] = f"{record['unique_candidates']}/{record['candidates']}"
        out["fn"] = record["masked_duplicates"] + record["masked_known_positives"]
    if record.get("pos_score") is not None:
        neg = record.get("hard_neg_score")
        out["pos/neg"] = f"{record['pos_score']:.2f}/" + ("-" if neg is None else f"{neg:.2f}")
    return out
