"""What each training step reports: batch health, peak memory, the JSONL log and the progress bar.

The batch health fields (:func:`score_health`, :func:`in_batch_accuracy`) are detached
telemetry computed inside the loss function (the only place that sees a step's embeddings);
:func:`merge_health` adds up a step's micro-batches; :class:`StepLog` writes one JSON line
per step, shows the progress bar and hands each record to the experiment trackers
(:mod:`densefit.training.tracking`); :func:`source_summary` sums a run's steps per source.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from densefit.data.types import TrainingExample

__all__ = [
    "StepLog",
    "health_postfix",
    "in_batch_accuracy",
    "merge_health",
    "rotate_log",
    "score_health",
    "source_summary",
]


@torch.no_grad()
def score_health(
    embeddings: Sequence[torch.Tensor], rows: Sequence[TrainingExample], similarity: str = "cosine"
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
    if similarity == "cosine":
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
    similarity: str = "cosine",
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
    if similarity == "cosine":
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
    """The batch health fields of a step record, short, for the progress bar: ``uniq``
    distinct candidate texts of all, ``masked`` candidate pairs masked out of the loss
    (duplicate texts and known positives: not false negatives found, but ones prevented),
    ``pos/neg`` the mean similarity of anchors to their positive and hard negatives.

    >>> health_postfix({"candidates": 8, "unique_candidates": 7, "masked_duplicates": 2,
    ...                 "masked_known_positives": 1, "pos_score": 0.8, "hard_neg_score": 0.5})
    {'uniq': '7/8', 'masked': 3, 'pos/neg': '0.80/0.50'}
    """
    out: dict = {}
    if "candidates" in record:
        out["uniq"] = f"{record['unique_candidates']}/{record['candidates']}"
        out["masked"] = record["masked_duplicates"] + record["masked_known_positives"]
    if record.get("pos_score") is not None:
        neg = record.get("hard_neg_score")
        out["pos/neg"] = f"{record['pos_score']:.2f}/" + ("-" if neg is None else f"{neg:.2f}")
    return out


def rotate_log(path: str | os.PathLike) -> Path | None:
    """Move a finished run's log aside (``train_log.jsonl`` -> ``train_log.1.jsonl``, the
    next free number) so a new run's steps never follow an old run's; the new name or None.
    """
    path = Path(path)
    if not path.is_file():
        return None
    n = 1
    while (target := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    os.replace(path, target)
    return target


class StepLog:
    """One JSON line per ``every`` steps into ``path`` (appended), and the progress bar.

    ``trackers`` (:class:`~densefit.training.tracking.Trackers`) get every record the file
    gets, the same ones.

    >>> with StepLog(None, total=2, progress=False) as log:
    ...     log.write({"step": 1, "loss": 0.5})
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        *,
        total: int,
        initial: int = 0,
        every: int = 1,
        progress: bool = True,
        trackers=None,  # noqa: ANN001 - densefit.training.tracking.Trackers
    ):
        self.every = every
        self.trackers = trackers
        self.shown: dict = {}  # fields kept on the bar (the last evaluation), see event()
        self.file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        self.bar = None
        if progress:
            self.bar = tqdm(
                total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True
            )

    def write(self, record: dict) -> None:
        """Log the step's record (every ``every`` steps) and advance the bar."""
        if record["step"] % self.every == 0:
            if self.file is not None:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            if self.trackers is not None:
                self.trackers.log(record)
        if self.bar is not None:
            speed = record.get("examples_per_s")
            self.bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                ex_s=f"{speed or 0:.1f}",
                fill=f"{record['padding_efficiency']:.2f}",  # real tokens / padded tokens
                **health_postfix(record),
                **self.shown,
            )
            self.bar.update(1)

    def event(self, record: dict, shown: dict | None = None) -> None:
        """Log a record that is not a step's (an evaluation) whatever ``every`` says; keep
        ``shown`` on the progress bar from now on."""
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.trackers is not None:
            self.trackers.log(record)
        self.shown = dict(shown or {})
        if self.bar is not None and self.shown:
            self.bar.set_postfix(**self.shown)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def source_summary(
    examples: Sequence[TrainingExample], steps: Iterable, losses: Sequence[float]
) -> dict[str, dict] | None:
    """Rows, steps and loss per source of a run of several sources (None with one).

    ``steps`` are the run's :class:`~densefit.data.batching.StepGroup` in order, ``losses``
    each step's loss. Per source: its ``rows``, the ``steps`` taken from it and the
    ``trained_rows`` they held, the ``mean_loss`` and ``last_loss`` of those steps (finite
    ones). With mixed batches a step has no one source: ``steps`` and the losses are None,
    ``trained_rows`` counts each source's rows in all steps.
    """
    sources = getattr(examples, "sources", ())
    if len(sources) < 2:
        return None
    out = {s.name: {"rows": s.rows, "steps": 0, "trained_rows": 0, "losses": []} for s in sources}
    mixed = False
    for group, loss in zip(steps, losses):
        if group.source is None:
            mixed = True
            for i in group.rows:
                out[sources[examples.source_of(i)].name]["trained_rows"] += 1
            continue
        entry = out[sources[group.source].name]
        entry["steps"] += 1
        entry["trained_rows"] += len(group.rows)
        entry["losses"].append(loss)
    for entry in out.values():
        finite = [x for x in entry.pop("losses") if math.isfinite(x)]
        entry["mean_loss"] = round(sum(finite) / len(finite), 6) if finite else None
        entry["last_loss"] = round(finite[-1], 6) if finite else None
        if mixed:
            entry["steps"] = entry["mean_loss"] = entry["last_loss"] = None
    return out
