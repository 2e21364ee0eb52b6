"""The loss of a batch as a function of its column embeddings: the one ``make_loss_fn``.

Each loss name (:data:`densefit.choices.LOSSES`) has one entry in :data:`BATCH_LOSSES`: how
its batch loss is made and whether it scores rows against each other's candidates (then
several processes gather them, :mod:`densefit.training.distributed`); both places read it.
MNRL masks false negatives (:mod:`densefit.losses.masking`) and blocks its score matrix
when it is large; margin-MSE takes the rows' teacher scores. Either way the loss records
the batch's health (:mod:`densefit.training.telemetry`) while it runs. Under torchrun the
same function computes one rank's part of the loss through a :class:`Share` (the
gathering lives in :mod:`densefit.training.distributed`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from densefit.config.train import TrainConfig
from densefit.data.types import TrainingExample
from densefit.losses import margin_mse, mnrl
from densefit.losses.masking import false_negative_mask
from densefit.losses.matryoshka import matryoshka
from densefit.memory.planner import loss_block_size
from densefit.training.telemetry import in_batch_accuracy, score_health

__all__ = [
    "BATCH_LOSSES",
    "BatchLoss",
    "LossFn",
    "Share",
    "batch_loss",
    "make_loss_fn",
    "matryoshka_of",
]

LossFn = Callable[[list[torch.Tensor]], torch.Tensor]


class Share(Protocol):
    """One process's part of a batch that several processes compute together."""

    rows: slice  # this process's rows of the batch
    queries: int  # anchors this process scores (for the score blocks)

    def loss(
        self,
        embeddings: list[torch.Tensor],
        mnrl_fn: Callable[..., torch.Tensor],
        record_health: Callable[[list[torch.Tensor]], None],
    ) -> torch.Tensor:
        """This process's part of the batch loss from its own column embeddings
        (``record_health`` takes them, when this process has rows)."""


def make_loss_fn(
    config: TrainConfig,
    rows: Sequence[TrainingExample],
    health: dict | None = None,
    *,
    share: Share | None = None,
) -> LossFn:
    """The batch's loss as a function of its column embeddings [anchors, positives, negatives].

    MNRL masks false negatives (duplicates, known positives: :mod:`densefit.losses.masking`);
    ``health`` receives the batch's telemetry (counts now, scores when the loss runs).
    With ``share`` (MNRL under torchrun) ``rows`` is the whole batch, the embeddings are
    this process's rows, and the result is this process's part of the batch loss.

    >>> rows = [TrainingExample("q", "p"), TrainingExample("r", "s")]
    >>> emb = [torch.eye(2), torch.eye(2), torch.empty(0, 2)]
    >>> round(float(make_loss_fn(TrainConfig(similarity="cosine"), rows)(emb)), 4)
    0.0

    With ``config.matryoshka_dims`` the loss (MNRL or margin-MSE) is summed over the
    embeddings cut to each size (:func:`densefit.losses.matryoshka.matryoshka`), after any
    gathering across processes.
    """
    health = {} if health is None else health
    kind = batch_loss(config.loss)
    if share is not None and not kind.cross_row:
        raise ValueError(f"loss {config.loss} has no cross-row terms: it takes no share")
    return kind.make(config, rows, health, share)


def _mnrl_loss(
    config: TrainConfig, rows: Sequence[TrainingExample], health: dict, share: Share | None
) -> LossFn:
    nested = matryoshka_of(config)
    if config.similarity is None:  # "the model's own": only setup_run knows the model
        raise ValueError(
            "config.similarity is None (the model's own): resolve it first with "
            "densefit.training.setup.resolve_similarity(config, model), as setup_run does"
        )
    found = false_negative_mask(rows)
    mask = found.mask if config.mask_false_negatives else None  # (B, B + M) or None
    health.update(found.telemetry())
    n_candidates = len(rows) + sum(len(r.negatives) for r in rows)
    queries = len(rows) if share is None else share.queries
    loss_block = loss_block_size(config.loss_block_size, queries, n_candidates - queries)
    local_rows = rows if share is None else rows[share.rows]

    def loss_fn(emb: list[torch.Tensor]) -> torch.Tensor:
        device = emb[0].device
        mnrl_fn = nested(
            partial(
                mnrl,
                scale=config.scale,
                symmetric=config.symmetric,
                similarity=config.similarity,
                chunk_size=loss_block,
                mask=None if mask is None else mask.to(device),
            )
        )
        if share is not None:
            return share.loss(
                emb,
                mnrl_fn,
                lambda e: health.update(score_health(e, local_rows, config.similarity)),
            )
        health.update(score_health(emb, rows, config.similarity))
        health["in_batch_accuracy"] = in_batch_accuracy(emb, mask, config.similarity)
        return mnrl_fn(emb[0], emb[1], emb[2] if emb[2].numel() else None)

    return loss_fn


def matryoshka_of(config: TrainConfig) -> Callable[[Callable], Callable]:
    """The wrapper that makes a loss Matryoshka as ``config`` asks (the identity when off).

    >>> matryoshka_of(TrainConfig())(mnrl) is mnrl
    True
    """
    dims, weights = config.matryoshka_dims, config.matryoshka_weights
    if not dims:
        if weights:
            raise ValueError("--matryoshka-weights needs --matryoshka-dims (the sizes they weigh)")
        return lambda loss: loss
    if weights is not None and len(weights) != len(dims):
        raise ValueError(
            f"--matryoshka-weights has {len(weights)} weight(s) for {len(dims)} "
            "--matryoshka-dims: give one weight per size"
        )
    return lambda loss: matryoshka(loss, dims, weights)


def _margin_loss(
    config: TrainConfig, rows: Sequence[TrainingExample], health: dict, share: None = None
) -> LossFn:
    scores = torch.tensor([r.score for r in rows], dtype=torch.float32)
    loss = matryoshka_of(config)(margin_mse)

    def margin_loss(emb: list[torch.Tensor]) -> torch.Tensor:
        health.update(score_health(emb, rows, config.similarity))
        health["in_batch_accuracy"] = in_batch_accuracy(emb, None, config.similarity)
        return loss(emb[0], emb[1], emb[2], scores.to(emb[0].device))

    return margin_loss


@dataclass(frozen=True)
class BatchLoss:
    """How a loss of :data:`densefit.choices.LOSSES` becomes a batch's loss function.

    ``make(config, rows, health, share)``: the loss over the batch's column embeddings;
    ``cross_row``: each row is scored against the other rows' candidates, so several processes
    gather them (``share``); without, each process weighs the loss of its own rows.
    """

    make: Callable[..., LossFn]
    cross_row: bool


# The one dispatch on the loss's name (make_loss_fn and the several-process run read it).
BATCH_LOSSES = {
    "mnrl": BatchLoss(_mnrl_loss, cross_row=True),
    "margin_mse": BatchLoss(_margin_loss, cross_row=False),
}


def batch_loss(name: str) -> BatchLoss:
    """The :class:`BatchLoss` of loss ``name``; ``ValueError`` naming the losses for another.

    >>> batch_loss("mnrl").cross_row, batch_loss("margin_mse").cross_row
    (True, False)
    """
    try:
        return BATCH_LOSSES[name]
    except KeyError:
        raise ValueError(f"loss must be one of {', '.join(BATCH_LOSSES)}, got {name!r}") from None
