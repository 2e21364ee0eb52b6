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
plus the (B, B + M) bool tensor, built only when something is masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from densefit.data.types import TrainingExample

__all__ = [
    "BatchMask",
    "candidates_of",
    "false_negative_mask",
    "health_postfix",
    "in_batch_accuracy",
    "merge_health",
    "score_health",
]


@dataclass
class BatchMask:
    """The false-negative mask of one batch and what it found.

    ``mask`` is None when nothing needs masking (the usual case: the loss runs unmasked).
    ``duplicates`` and ``known_positives`` count masked (anchor, candidate) pairs;
    a pair that is both a duplicate and a known positive counts as a duplicate.
    """

    mask: torch.Tensor | None  # (B, B + M) bool, True = excluded for that anchor
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
        >>> found.mask.int().tolist()  # candidates: cells divide, genes, python, cells divide
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
    diag = torch.arange(B)
    duplicate = None
    if len(group_of) < C:  # some text repeats: copies of each positive, and later copies
        group = torch.tensor(groups)  # (C,)
        duplicate = group[:B, None] == group[None, :]  # (B, C) copies of anchor i's positive
        duplicate |= ~torch.tensor(first)[None, :]  # each text counts once for everyone
        duplicate[diag, diag] = False

    columns_of_id: dict[str, list[int]] = {}
    for c, doc_id in enumerate(ids):
        if doc_id:
            columns_of_id.setdefault(doc_id, []).append(c)
    known = None
    if columns_of_id:
        for i, row in enumerate(rows):
            positives = set(row.positive_ids)
            positives.add(row.positive_id)
            hits = [c for p in positives if p for c in columns_of_id.get(p, ()) if c != i]
            if hits:
                if known is None:
                    known = torch.zeros(B, C, dtype=torch.bool)
                known[i, hits] = True

    n_dup = int(duplicate.sum()) if duplicate is not None else 0
    n_known = 0
    mask = duplicate
    if known is not None:
        n_known = int((known & ~duplicate).sum()) if duplicate is not None else int(known.sum())
        mask = known if duplicate is None else duplicate | known
    if mask is not None and not mask.any():
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
    block: int = 1024,
) -> float:
    """Fraction of anchors whose own positive strictly outscores every other candidate.

    Candidates are MNRL's: all ``B`` positives, then the ``M`` hard negatives; ``mask``
    (B, B + M), True = excluded, drops false negatives as the loss does. Scores are computed
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
    correct = 0
    for start in range(0, B, block):
        rows = torch.arange(start, min(start + block, B), device=anchors.device)
        scores = anchors[rows] @ candidates.T  # (b, B + M)
        own = scores[rows - start, rows].clone()  # (b,)
        if mask is not None:
            scores = scores.masked_fill(mask[rows].to(scores.device), float("-inf"))
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
