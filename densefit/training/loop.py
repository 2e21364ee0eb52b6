"""One readable training loop: batches of text in, a fine-tuned SentenceTransformer out.

    run = setup_run(model, examples, config, ...)     # plan, strategy, optimizer, resume
    for each step's micro-batches:
        record = train_step(run, group)               # embed, loss, backward, sync, step
        log, guard, checkpoint

The memory strategy (plain, checkpoint, gradient cache) decides how the encoder is called;
the loss is a pure function of the embeddings; nothing else is hidden.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer

from densefit.config import TrainConfig
from densefit.data.batching import planned_batches, step_groups  # noqa: F401 (cli imports it)
from densefit.data.types import TrainingExample
from densefit.memory.plan import MemoryPlan
from densefit.models import has_lora, merged_copy, save_lora_adapter
from densefit.training.setup import TrainRun, setup_run
from densefit.training.step import train_step
from densefit.training.telemetry import StepLog, peak_rss_bytes

__all__ = ["train", "TrainResult", "save_model", "peak_rss_bytes"]


@dataclass
class TrainResult:
    """What a run did: steps, final loss, the memory plan and where the log went."""

    steps: int
    examples: int
    final_loss: float
    losses: list[float] = field(default_factory=list)
    plan: dict = field(default_factory=dict)  # the memory plan's fields and the run's layout
    log_path: str | None = None
    seconds: float = 0.0
    skipped_nonfinite: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    memory_plan: MemoryPlan | None = None  # the plan the last step ran with


def train(
    model: SentenceTransformer,
    examples: Sequence[TrainingExample],
    config: TrainConfig | None = None,
    *,
    output_dir: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
    on_step: Callable[[dict], None] | None = None,
    resume: bool | str | os.PathLike = False,
    overwrite: bool = False,
) -> TrainResult:
    """Fine-tune ``model`` on ``examples`` in place; save to ``output_dir`` when given.

    ``output_dir`` must be new, empty, or hold a densefit run of the same options (its log
    is kept as ``train_log.1.jsonl``); ``overwrite=True`` trains into any folder. Checkpoints
    go to ``output_dir/checkpoints`` (every ``config.checkpoint_every`` steps and at each
    epoch end; see :mod:`densefit.training.checkpoint`). ``resume=True`` continues from the
    newest good one there, ``resume=<folder>`` from that one: same batches, same RNG
    stream, the weights an uninterrupted run would end with. A step with a non-finite loss
    or gradient is skipped; too many in a row, or every step of the run, raise
    :class:`~densefit.training.guards.NonFiniteError` (see :mod:`densefit.training.guards`).
    Inside an initialised process group of several ranks (torchrun), ``config.batch_size``
    is the global batch, each rank trains on its share with cross-device negatives, and
    only rank 0 logs, checkpoints and saves (see :mod:`densefit.training.distributed`).

    >>> from densefit.testing import tiny_model
    >>> from densefit.data import TrainingExample
    >>> rows = [TrainingExample("what is a cell", "the cell is a unit"),
    ...         TrainingExample("python list", "a list is a python value")]
    >>> result = train(tiny_model(), rows, TrainConfig(batch_size=2, show_progress=False))
    >>> result.steps
    1
    """
    run = setup_run(
        model,
        examples,
        config,
        output_dir=output_dir,
        log_path=log_path,
        resume=resume,
        overwrite=overwrite,
    )
    config = run.config
    log = StepLog(
        run.log_path if run.is_main else None,
        total=run.total_steps,
        initial=run.step,
        every=config.log_every,
        progress=config.show_progress and run.is_main,
    )
    model.train()
    started = time.perf_counter()
    record, origins = {}, []
    with log:
        for group in step_groups(examples, config, epoch=run.epoch, batch=run.batch):
            if run.step >= run.total_steps:
                break
            record = train_step(run, group.micro_batches)
            run.step, run.seen = run.step + 1, run.seen + len(group.rows)
            run.epoch, run.batch = group.next_epoch, group.next_batch
            run.losses.append(record["loss"])
            record.update(step=run.step, epoch=group.epoch)
            log.write(record)
            origins = [examples[i].origin for i in group.rows]
            run.guard.check(
                run.step, record, origins, learning_rate=config.learning_rate, amp=config.amp
            )
            _checkpoint(run, epoch_end=group.epoch_end)
            if on_step is not None and run.is_main:
                on_step(record)
    run.guard.check_end(
        run.step, record, origins, learning_rate=config.learning_rate, amp=config.amp
    )
    model.eval()
    result = TrainResult(
        steps=run.step,
        examples=run.seen,
        final_loss=run.losses[-1] if run.losses else float("nan"),
        losses=run.losses,
        plan=run.report(),
        log_path=str(run.log_path) if run.log_path else None,
        seconds=time.perf_counter() - started,
        skipped_nonfinite=run.guard.total,
        memory_plan=run.plan,
    )
    if output_dir is not None and run.is_main:
        save_model(model, output_dir, config, result)
    if run.dist is not None:
        run.dist.barrier()  # every rank returns once the model is saved
    return result


def _checkpoint(run: TrainRun, *, epoch_end: bool) -> None:
    """Write a checkpoint when one is due: every ``checkpoint_every`` steps, at each epoch
    end and after the last step."""
    last = run.step >= run.total_steps
    if run.checkpoints is not None and run.checkpoints.due(
        run.step, epoch_end=epoch_end, last=last
    ):
        run.checkpoints.save(
            run.step,
            epoch=run.epoch,
            batch=run.batch,
            seen=run.seen,
            losses=run.losses,
            plan=run.plan,
        )


def save_model(
    model: SentenceTransformer,
    output_dir: str | os.PathLike,
    config: TrainConfig,
    result: TrainResult | None = None,
) -> Path:
    """Save in sentence-transformers format, with ``densefit_config.json`` beside it.

    With LoRA: the adapters merged into a copy of the model (``model`` keeps them), or with
    ``config.save_adapter`` the PEFT adapter alone (:func:`densefit.models.save_lora_adapter`).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if has_lora(model) and config.save_adapter:
        save_lora_adapter(model, out)
    else:
        merged_copy(model).save(str(out), safe_serialization=True)
    import densefit

    extra = {"densefit_version": densefit.__version__, "torch_version": torch.__version__}
    if result is not None:
        extra.update(
            steps=result.steps,
            examples=result.examples,
            final_loss=result.final_loss,
            memory_plan=result.plan,
            seconds=round(result.seconds, 2),
        )
    config.save(out / "densefit_config.json", **extra)
    return out
