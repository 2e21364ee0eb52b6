"""One readable training loop: batches of text in, a fine-tuned SentenceTransformer out.

    run = setup_run(model, examples, config, ...)     # plan, strategy, optimizer, resume
    for each step's micro-batches:
        record = train_step(run, group)               # embed, loss, backward, sync, step
        log, guard, checkpoint

The memory strategy (plain, checkpoint, gradient cache) decides how the encoder is called;
the loss is a pure function of the embeddings; nothing else is hidden.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sentence_transformers import SentenceTransformer

from densefit._version import __version__
from densefit.config.train import TrainConfig
from densefit.data.batching import StepGroup, step_groups
from densefit.data.corpus import BeirDataset
from densefit.data.rows import OnBadRow
from densefit.data.sources import TrainingData, load_training_data
from densefit.data.types import ReadReport, TrainingExample
from densefit.memory.plan import MemoryPlan
from densefit.memory.process import peak_rss_bytes
from densefit.models import has_lora, merged_copy, model_name_of, save_lora_adapter
from densefit.training.checkpoint import checkpoint_due, rng_state
from densefit.training.distributed import broadcast_object, gather_object
from densefit.training.evaluation import evaluation_due
from densefit.training.model_card import write_model_card
from densefit.training.setup import TrainRun, setup_run
from densefit.training.step import train_step
from densefit.training.telemetry import StepLog, source_summary
from densefit.training.tracking import Trackers

__all__ = ["train", "TrainResult", "describe_data", "save_model", "peak_rss_bytes"]


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
    base_model: str | None = None  # the name of the model the run started from
    data: dict = field(default_factory=dict)  # files and rows trained on (model card)
    # evaluation during training: Evaluator.summary(); None when off, and on the ranks other
    # than 0 of a multi-process run (rank 0 evaluates)
    evaluation: dict | None = None
    # several sources: rows, steps, trained rows and loss of each (telemetry.source_summary)
    sources: dict | None = None


def train(
    model: SentenceTransformer,
    examples: Sequence[TrainingExample] | Any,
    config: TrainConfig | None = None,
    *,
    output_dir: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
    on_step: Callable[[dict], None] | None = None,
    resume: bool | str | os.PathLike = False,
    overwrite: bool = False,
    eval_data: str | os.PathLike | BeirDataset | None = None,
    data_report: ReadReport | None = None,
    split: str = "train",
    on_bad_row: OnBadRow = "error",
) -> TrainResult:
    """Fine-tune ``model`` on ``examples`` in place; save to ``output_dir`` when given.

    ``examples`` is anything :func:`~densefit.data.sources.load_training_data` reads (read
    with ``split`` and ``on_bad_row``): TrainingExamples, dicts, a path, a
    ``datasets.Dataset`` (or ``DatasetDict``: its ``split``), or several sources as a list or
    a mapping ``{name: source}``. With several sources each step's rows come from one source
    (``config.source_batches``, interleaved as ``config.source_sampling`` says), each step's
    log record names its ``source`` and the result's ``sources`` has each one's rows, steps
    and loss.

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
    ``eval_data`` (a BEIR folder or dataset) evaluates the model during training, as the
    ``eval_*`` options, ``keep_best`` and ``early_stopping_patience`` say (see
    :mod:`densefit.training.evaluation`). With several processes rank 0 evaluates and
    every rank stops after the step its early stopping decides; with ``keep_best`` only rank
    0's model is turned into the best step's (the one it saves; the other ranks return
    theirs as trained), and only rank 0's result has the ``evaluation`` summary (None on
    the others). ``data_report`` (what the reader skipped) goes into the model card.
    ``config.report_to`` also sends every log record to TensorBoard, MLflow or W&B
    (:mod:`densefit.training.tracking`).

    >>> from densefit.testing import tiny_model
    >>> from densefit.data import TrainingExample
    >>> rows = [TrainingExample("what is a cell", "the cell is a unit"),
    ...         TrainingExample("python list", "a list is a python value")]
    >>> result = train(tiny_model(), rows, TrainConfig(batch_size=2, show_progress=False))
    >>> result.steps
    1
    """
    examples = load_training_data(examples, on_bad_row=on_bad_row, split=split)
    run = setup_run(
        model,
        examples,
        config,
        output_dir=output_dir,
        log_path=log_path,
        resume=resume,
        overwrite=overwrite,
        eval_data=eval_data,
    )
    config, base_model = run.config, model_name_of(model)
    trackers = _start_trackers(run, output_dir, resume=bool(resume))
    log = StepLog(
        run.log_path if run.is_main else None,
        total=run.total_steps,
        initial=run.position.step,
        every=config.log_every,
        progress=config.show_progress and run.is_main,
        trackers=trackers,
    )
    model.train()
    started = time.perf_counter()
    record, origins = {}, []
    try:
        with log:
            _evaluate(run, log, epoch_end=False, last=False)  # the base model, at step 0
            at = run.position  # the one part of the run that moves
            for group in step_groups(examples, config, epoch=at.epoch, batch=at.batch):
                if at.step >= run.total_steps or _stopped(run):
                    break
                record = train_step(run, group.micro_batches)
                origins = _advance(run, group, record, log)  # position, log record, guard
                last = at.step >= run.total_steps
                _evaluate(run, log, epoch_end=group.epoch_end, last=last)
                _checkpoint(run, epoch_end=group.epoch_end, last=last or _stopped(run))
                if on_step is not None and run.is_main:
                    on_step(record)
        run.guard.check_end(
            run.position.step, record, origins, learning_rate=config.learning_rate, amp=config.amp
        )
    except BaseException:
        if trackers is not None:
            trackers.finish({"steps": run.position.step}, failed=True)
        raise
    model.eval()
    if run.evaluator is not None and config.keep_best:
        run.evaluator.restore_best(model)  # the output is the best evaluated step's model
    data = describe_data(examples, data_report)
    result = _result(run, base_model, data, seconds=time.perf_counter() - started)
    if output_dir is not None and run.is_main:
        save_model(model, output_dir, config, result)
    if trackers is not None:
        trackers.finish(_summary(result))
    if run.dist is not None:
        run.dist.barrier()  # every rank returns once the model is saved
    return result


def _start_trackers(run: TrainRun, output_dir, *, resume: bool) -> Trackers | None:
    """The trackers of ``config.report_to`` (rank 0), started with the config and the plan."""
    if not (run.is_main and run.config.report_to):
        return None
    trackers = Trackers(
        run.config.report_to, output_dir=output_dir, resume=resume, step=run.position.step
    )
    trackers.start(run.config.to_dict(), run.report())
    return trackers


def _advance(run: TrainRun, group: StepGroup, record: dict, log: StepLog) -> list[str]:
    """After a step: move the position past ``group``, complete and write its log
    ``record``, let the guard check it; the origins of its rows (for the guard's messages)."""
    at, examples = run.position, run.examples
    at.step, at.seen = at.step + 1, at.seen + len(group.rows)
    at.epoch, at.batch = group.next_epoch, group.next_batch
    at.losses.append(record["loss"])
    record.update(step=at.step, epoch=group.epoch, **_source_fields(examples, group))
    log.write(record)
    origins = [examples[i].origin for i in group.rows]
    config = run.config
    run.guard.check(at.step, record, origins, learning_rate=config.learning_rate, amp=config.amp)
    return origins


def _result(run: TrainRun, base_model: str, data: dict, *, seconds: float) -> TrainResult:
    """What the run did, as :func:`train` returns it."""
    at = run.position
    return TrainResult(
        steps=at.step,
        examples=at.seen,
        final_loss=at.losses[-1] if at.losses else float("nan"),
        losses=at.losses,
        plan=run.report(),
        log_path=str(run.log_path) if run.log_path else None,
        seconds=seconds,
        skipped_nonfinite=run.guard.total,
        memory_plan=run.plan,
        base_model=base_model,
        data=data,
        evaluation=run.evaluator.summary() if run.evaluator is not None else None,
        sources=source_summary(run.examples, _steps_done(run), at.losses),
    )


def _source_fields(examples: Sequence[TrainingExample], group: StepGroup) -> dict:
    """Several sources: the step's ``source`` (one source per step), or its rows per source
    (``rows_by_source``, mixed batches); nothing with one source."""
    if not isinstance(examples, TrainingData) or len(examples.sources) < 2:
        return {}
    names = examples.names
    if group.source is not None:
        return {"source": names[group.source]}
    counts = dict.fromkeys(names, 0)
    for i in group.rows:
        counts[names[examples.source_of(i)]] += 1
    return {"rows_by_source": counts}


def _steps_done(run: TrainRun) -> list[StepGroup]:
    """The run's steps so far, from the start (a resumed run's too): the schedule is seeded."""
    if len(getattr(run.examples, "sources", ())) < 2:
        return []
    return list(itertools.islice(step_groups(run.examples, run.config), run.position.step))


def _summary(result: TrainResult) -> dict:
    """What the trackers get at the end of a run."""
    return {
        "steps": result.steps,
        "examples": result.examples,
        "final_loss": result.final_loss,
        "seconds": round(result.seconds, 2),
        "skipped_nonfinite": result.skipped_nonfinite,
        "sources": result.sources,
        "evaluation_best": (result.evaluation or {}).get("best"),
    }


def _evaluate(run: TrainRun, log: StepLog, *, epoch_end: bool, last: bool) -> None:
    """Evaluate when due (step 0, every ``eval_every`` steps, epoch ends, the last step).

    In a multi-process run rank 0 evaluates while the other ranks wait for its early-stopping
    decision: the schedule (:func:`evaluation_due`) is the same on every rank, so every rank
    joins that broadcast and all of them stop after the same step.
    """
    if not run.evaluates or not evaluation_due(
        run.config, run.position.step, epoch_end=epoch_end, last=last
    ):
        return
    evaluator = run.evaluator  # None on the ranks other than 0
    if evaluator is not None and evaluator.due(run.position.step, epoch_end=epoch_end, last=last):
        log.event(evaluator.run(run.model, run.position.step), evaluator.postfix())
    stopped = evaluator is not None and evaluator.stopped
    run.position.stopped = broadcast_object(stopped) if run.dist is not None else stopped


def _stopped(run: TrainRun) -> bool:
    """Early stopping decided to end the run (on every rank alike)."""
    return run.position.stopped


def _checkpoint(run: TrainRun, *, epoch_end: bool, last: bool) -> None:
    """Write a checkpoint when one is due: every ``checkpoint_every`` steps, at each epoch
    end and after the last step. With several processes every rank sends its RNG state to
    rank 0, which writes them all (a resume on as many processes restores each rank's)."""
    if not run.checkpointing or not checkpoint_due(
        run.config, run.position.step, epoch_end=epoch_end, last=last
    ):
        return
    states = gather_object(rng_state()) if run.dist is not None else None
    if run.checkpoints is not None:
        run.checkpoints.save(
            run.position.step,
            epoch=run.position.epoch,
            batch=run.position.batch,
            seen=run.position.seen,
            losses=run.position.losses,
            plan=run.plan,
            rng_states=states,
        )


def describe_data(examples: Sequence[TrainingExample], report: ReadReport | None = None) -> dict:
    """The files the examples came from (their ``origin``, or ``report``'s path), the rows,
    the skipped rows; with several sources each source's too (``sources``).

    >>> describe_data([TrainingExample("q", "d", origin="a.jsonl:1")])
    {'files': ['a.jsonl'], 'rows': 1, 'skipped_rows': None}
    """
    if isinstance(examples, TrainingData):
        out = examples.describe()
    else:
        files = {ex.origin.rpartition(":")[0] or ex.origin for ex in examples if ex.origin}
        out = {"files": sorted(files), "rows": len(examples), "skipped_rows": None}
    if report is not None:  # the reader's own account (the CLI's, the pipeline's)
        out["files"] = [report.path] if report.path else out["files"]
        out["skipped_rows"] = report.n_skipped
    return out


def save_model(
    model: SentenceTransformer,
    output_dir: str | os.PathLike,
    config: TrainConfig,
    result: TrainResult | None = None,
) -> Path:
    """Save in sentence-transformers format, with ``densefit_config.json`` and a model card
    (``README.md``, :mod:`densefit.training.model_card`) beside it.

    With LoRA: the adapters merged into a copy of the model (``model`` keeps them), or with
    ``config.save_adapter`` the PEFT adapter alone (:func:`densefit.models.save_lora_adapter`).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if has_lora(model) and config.save_adapter:
        save_lora_adapter(model, out)
    else:
        merged_copy(model).save(str(out), safe_serialization=True)
    extra = {"densefit_version": __version__, "torch_version": torch.__version__}
    if result is not None:
        extra.update(
            steps=result.steps,
            examples=result.examples,
            final_loss=result.final_loss,
            memory_plan=result.plan,
            seconds=round(result.seconds, 2),
        )
        if result.evaluation is not None:
            extra["evaluation"] = result.evaluation
        if result.sources is not None:
            extra["sources"] = result.sources
    config.save(out / "densefit_config.json", **extra)
    write_model_card(out, model, config, result)
    return out
