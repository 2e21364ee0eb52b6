"""Numerical guards: a step whose loss or gradients are not finite changes nothing.

``guarded_step`` replaces ``optimizer.step(); scheduler.step()`` in the training loop:

- without a GradScaler (fp32, bf16): a non-finite loss or gradient norm skips the step;
  the optimizer and the scheduler are untouched and the gradients are zeroed;
- with a GradScaler (fp16 on CUDA): the scaler skips steps with inf/nan gradients by
  itself and lowers its scale; the skip is detected (the scale went down) and counted.

``NonFiniteGuard`` counts the skips and stops the run, with advice, after ``limit`` in a row.
A scaler skip while the scale is still above 1 is the scaler searching for its scale
(normal at the start of fp16 training), so it is counted but does not move towards the limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["NonFiniteError", "StepOutcome", "guarded_step", "NonFiniteGuard"]


class NonFiniteError(FloatingPointError):
    """Raised after too many optimizer steps in a row had a non-finite loss or gradient."""


@dataclass
class StepOutcome:
    """What happened to one optimizer step."""

    grad_norm: float
    skipped: bool  # the optimizer did not step (non-finite loss or gradients)
    counts: bool  # the skip counts towards the ``--max-nonfinite`` limit


def _total_norm(parameters: Sequence[torch.nn.Parameter]) -> float:
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    )


def guarded_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
    *,
    loss: float,
    max_grad_norm: float | None,
) -> StepOutcome:
    """Clip, then step the optimizer and scheduler, unless the loss or gradients are not finite.

    >>> model = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    >>> model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    >>> guarded_step(model, optimizer, scheduler, None, loss=float("nan"), max_grad_norm=1.0).skipped
    True
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    if scaler is not None:
        scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm))
    else:
        grad_norm = _total_norm(parameters)
    finite_loss = math.isfinite(loss)

    if scaler is None:
        skipped = not (finite_loss and math.isfinite(grad_norm))
        if not skipped:
            optimizer.step()
        counts = skipped
    else:
        scale = scaler.get_scale()
        if finite_loss:
            scaler.step(optimizer)  # skips by itself when a gradient is inf/nan
            scaler.update()
            skipped = scaler.get_scale() < scale  # the scale only goes down after a skip
        else:  # a non-finite loss is never the scale's fault: skip, back off like the scaler
            scaler.update(scale * scaler.get_backoff_factor())
            skipped = True
        counts = skipped and (not finite_loss or scale <= 1.0)

    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        scheduler.step()
    return StepOutcome(grad_norm=grad_norm, skipped=skipped, counts=counts)


class NonFiniteGuard:
    """Counts skipped steps; raises :class:`NonFiniteError` after ``limit`` in a row (0: never).

    >>> guard = NonFiniteGuard(limit=2)
    >>> guard.update(StepOutcome(float("nan"), skipped=True, counts=True))
    >>> guard.total, guard.in_a_row
    (1, 1)
    """

    def __init__(self, limit: int = 5):
        self.limit = limit
        self.total = 0  # skipped steps in the whole run (logged as skipped_nonfinite)
        self.in_a_row = 0  # counting skips since the last real step

    def update(self, outcome: StepOutcome) -> None:
        if outcome.skipped:
            self.total += 1
        if outcome.counts:
            self.in_a_row += 1
        elif not outcome.skipped:
            self.in_a_row = 0

    def check(
        self,
        step: int,
        record: dict,
        origins: Sequence[str] = (),
        *,
        learning_rate: float | None = None,
        amp: str | None = None,
    ) -> None:
        """Raise when the last ``limit`` steps were all skipped, saying what to try."""
        if not self.limit or self.in_a_row < self.limit:
            return
        first = step - self.in_a_row + 1
        raise NonFiniteError(
            f"step {step}: the loss or gradient norm was not finite in {self.in_a_row} steps "
            f"in a row (steps {first}-{step}; last loss {record.get('loss')}, grad norm "
            f"{record.get('grad_norm')}). Those optimizer steps were skipped, so the weights "
            f"are still those after step {first - 1}; stopping. "
            + self._advice(origins, learning_rate, amp)
        )

    def check_end(
        self,
        step: int,
        record: dict,
        origins: Sequence[str] = (),
        *,
        learning_rate: float | None = None,
        amp: str | None = None,
    ) -> None:
        """At the end of a run: raise when every step was skipped (whatever ``limit``), so a
        run that never updated the weights does not end as if it had trained."""
        if step == 0 or self.total < step:
            return
        raise NonFiniteError(
            f"all {step} steps of the run had a non-finite loss or gradient norm (last loss "
            f"{record.get('loss')}, grad norm {record.get('grad_norm')}) and were skipped: "
            "the weights were never updated. " + self._advice(origins, learning_rate, amp)
        )

    def _advice(self, origins: Sequence[str], learning_rate: float | None, amp: str | None) -> str:
        rows = ", ".join(o for o in list(origins)[:5] if o) or "origins not recorded"
        lr = f" (--lr, now {learning_rate:g})" if learning_rate is not None else ""
        fp16 = "; --amp bf16 instead of fp16 (fp16 overflows above 65504)" if amp == "fp16" else ""
        return (
            f"Try: a lower learning rate{lr}{fp16}, in a new run (a resume keeps the "
            f"checkpoint's options); or check the data rows of the last bad step ({rows}). "
            f"--max-nonfinite sets how many skips in a row to tolerate (now {self.limit}; "
            "0: never stop)."
        )

    def state_dict(self) -> dict:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.in_a_row = int(state["total"]), int(state["in_a_row"])
