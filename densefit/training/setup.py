"""Everything a run needs before its first step, in one object: :func:`setup_run`.

The training loop, the benchmarks and the tests all start a run the same way: check the
data and the output folder, move the model, agree on a memory plan (the user's, the
planner's, the checkpoint's, or rank 0's under torchrun), build the strategy from it, the
optimizer, the schedule, AMP, the guards, then restore a checkpoint when resuming.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from densefit.choices import SIMILARITIES
from densefit.config.options import default_of
from densefit.config.train import AUTO_LR_BATCH, TrainConfig, auto_learning_rate
from densefit.data.batching import effective_batch_size, same_source_batches, total_steps
from densefit.data.corpus import BeirDataset
from densefit.data.sources import TrainingData
from densefit.data.types import TrainingExample
from densefit.errors import OptionError
from densefit.memory.allocator import allocator_in_use, release_freed_memory_promptly
from densefit.memory.dropout import enable_invariant_dropout
from densefit.memory.plan import MemoryPlan
from densefit.memory.planner import plan_for_run
from densefit.memory.strategies import MemoryStrategy, make_strategy
from densefit.models import apply_lora, model_similarity, resolve_device
from densefit.prompts import set_prompts
from densefit.retrieval.encode import embedding_dimension
from densefit.training.checkpoint import (
    CHECKPOINTS,
    Checkpoint,
    Checkpointer,
    CheckpointError,
    changed_weight_options,
    resume_checkpoint,
    truncate_log,
    verify_checkpoint,
)
from densefit.training.distributed import (
    DistributedRun,
    broadcast_object,
    broadcast_parameters,
    is_main_process,
)
from densefit.training.evaluation import BEST, Evaluator, make_evaluator
from densefit.training.guards import NonFiniteGuard
from densefit.training.telemetry import rotate_log
from densefit.training.tracking import TENSORBOARD_DIR, TRACKING_FILE, check_trackers

__all__ = [
    "Position",
    "TrainRun",
    "check_examples",
    "check_output_dir",
    "make_optimizer",
    "make_scheduler",
    "resolve_learning_rate",
    "seed_everything",
    "setup_run",
    "warn_batch_larger_than_data",
]

LOG_NAME = "train_log.jsonl"
# What report_to writes into the output folder (densefit.training.tracking).
TRACKER_FILES = (TRACKING_FILE, TENSORBOARD_DIR, "mlruns", "wandb")


@dataclass
class Position:
    """Where the loop stands: what it has done and where the data resumes (saved in every
    checkpoint, restored on ``--resume``)."""

    step: int = 0  # optimizer steps done
    seen: int = 0  # rows trained on
    epoch: int = 0  # the data position of the next step: epoch and micro-batch
    batch: int = 0
    losses: list[float] = field(default_factory=list)
    stopped: bool = False  # early stopping ended the run (rank 0's decision, on every rank)


@dataclass(frozen=True)
class TrainRun:
    """What :func:`setup_run` builds for one run (model, data, memory plan, optimizer, the
    output), fixed for the run, and the loop's :class:`Position`, the one part that moves.

    ``plan`` and ``strategy`` change together, only through :meth:`use_plan` (after an
    out-of-memory error the step switches to the halved plan).
    """

    model: SentenceTransformer
    examples: Sequence[TrainingExample]
    config: TrainConfig
    device: torch.device
    plan: MemoryPlan
    strategy: MemoryStrategy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    autocast: Callable[[], contextlib.AbstractContextManager]
    guard: NonFiniteGuard
    dist: DistributedRun | None  # None: one process
    total_steps: int
    log_path: Path | None = None
    checkpoints: Checkpointer | None = None
    resumed: Checkpoint | None = None
    evaluator: Evaluator | None = None  # evaluation during training; None: off, or not rank 0
    evaluates: bool = False  # evaluation during training is on (on every rank; rank 0 runs it)
    # checkpoints are written (by rank 0); with several processes every rank sends its RNG state
    checkpointing: bool = False
    learning_rate_auto: bool = False  # learning_rate was "auto": config holds the rule's value
    position: Position = field(default_factory=Position)

    @property
    def is_main(self) -> bool:
        """The process that logs, checkpoints and saves."""
        return self.dist is None or self.dist.is_main

    def use_plan(self, plan: MemoryPlan) -> None:
        """Switch to ``plan``: its strategy is built and prepared on the model (the one change
        of what setup built, hence the frozen dataclass's ``object.__setattr__``)."""
        strategy = make_strategy(plan)
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "strategy", strategy)
        strategy.prepare(self.model)

    def report(self) -> dict:
        """The plan as logged and returned: its fields, the allocator, the process layout."""
        out = self.plan.to_dict()
        if self.device.type == "cpu":  # mimalloc (the CLI's default on Linux) or the system's
            out["cpu_allocator"] = allocator_in_use()
        if self.dist is not None:
            out.update(self.dist.describe(self.config))
        out["learning_rate"] = self.config.learning_rate
        out["learning_rate_from"] = "auto" if self.learning_rate_auto else "given"
        return out


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_examples(examples: Sequence[TrainingExample], config: TrainConfig) -> None:
    """Refuse empty data, and rows the loss cannot use (margin-MSE: one negative, a score)."""
    if not examples:
        raise ValueError("no training examples: the data is empty")
    if config.loss == "margin_mse":
        for ex in examples:
            if ex.score is None or len(ex.negatives) != 1:
                where = ex.origin or "a row"
                raise ValueError(
                    f"{where}: loss margin_mse needs exactly one negative and a score per row "
                    f"(found {len(ex.negatives)} negative(s), score {ex.score!r}); "
                    "add neg_doc and score, or train with --loss mnrl"
                )


def resolve_learning_rate(config: TrainConfig, batch_size: int | None = None) -> TrainConfig:
    """``config`` with ``learning_rate="auto"`` replaced by the value the rule gives for the
    batch a step really has: ``batch_size`` (what
    :func:`~densefit.data.batching.effective_batch_size` says of the data) when smaller than
    ``config.batch_size``. What runs, checkpoints and saved configs hold and compare.

    >>> resolve_learning_rate(TrainConfig(batch_size=10**9), 64).learning_rate
    4e-05
    """
    if config.learning_rate == "auto":
        batch = config.batch_size if batch_size is None else min(config.batch_size, batch_size)
        return dataclasses.replace(config, learning_rate=auto_learning_rate(batch))
    return config


def warn_batch_larger_than_data(
    examples: Sequence[TrainingExample], config: TrainConfig, batch: int
) -> None:
    """Warn (UserWarning) when ``batch_size`` is more rows than a step can have (``batch``,
    from :func:`~densefit.data.batching.effective_batch_size`), naming both numbers."""
    if batch >= config.batch_size:
        return
    rows = "row" if batch == 1 else "rows"
    where = f"{batch:,} {rows}"
    if same_source_batches(examples, config) and isinstance(examples, TrainingData):
        largest = max(examples.sources, key=lambda s: s.rows)
        where = f"{batch:,} {rows} in its largest source, {largest.name}"
    rate = ""
    if config.learning_rate == "auto":
        rate = f"; learning_rate auto follows {batch:,}: {auto_learning_rate(batch):.3g}"
    warnings.warn(
        f"batch_size {config.batch_size:,} is larger than the data ({where}): every step "
        f"trains on at most {batch:,} {rows}{rate}",
        UserWarning,
        stacklevel=4,
    )


def resolve_similarity(config: TrainConfig, model: SentenceTransformer) -> TrainConfig:
    """``config`` with ``similarity=None`` replaced by the model's own
    (:func:`~densefit.models.model_similarity`): what the loss uses and the saved model
    records. A model that scores by a similarity densefit does not train is refused."""
    if config.similarity is not None:
        return config
    own = model_similarity(model)
    if own not in SIMILARITIES:
        raise ValueError(
            f"the model scores by {own!r} similarity, which densefit does not train: pass "
            f"--similarity {' or '.join(SIMILARITIES)}"
        )
    return dataclasses.replace(config, similarity=own)


def check_matryoshka_dims(config: TrainConfig, model: SentenceTransformer) -> None:
    """Refuse ``--matryoshka-dims`` above the model's embedding size (an OptionError)."""
    if not config.matryoshka_dims:
        return
    full = embedding_dimension(model)
    above = [d for d in config.matryoshka_dims if d > full]
    if above:
        raise OptionError(
            "matryoshka_dims",
            f"{{option}} {', '.join(map(str, above))}: above the model's embedding size "
            f"{full}; give sizes up to {full}",
            flag="--matryoshka-dims",
        )


def check_output_dir(
    output_dir: str | os.PathLike | None,
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
) -> None:
    """Refuse to train into a folder that holds anything but a densefit run of this config.

    Allowed: no folder, an empty one, a finished run with the same options (those in
    :func:`~densefit.training.checkpoint.changed_weight_options` may differ; its log is kept, renamed),
    an interrupted run (only a log and checkpoints), any folder with ``resume`` (the
    checkpoint decides) or ``overwrite``.
    """
    if output_dir is None:
        return
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder}: exists and is not a folder; choose another --output")
    if resume or overwrite or not folder.exists():
        return
    saved = folder / "densefit_config.json"
    if saved.is_file():
        try:
            previous = json.loads(saved.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            previous = None
        if isinstance(previous, dict):
            current = config  # learning_rate auto, similarity None: compared by setup_run
            differ = changed_weight_options(previous, current)
            if not differ:
                return
            now = current.to_dict()
            shown = ", ".join(f"{k}={previous[k]!r} (now {now[k]!r})" for k in differ[:3])
            raise ValueError(
                f"{folder}: holds a densefit run with other options ({shown}); choose a new "
                "--output, or pass --overwrite to train into it anyway"
            )
    foreign = sorted(p.name for p in folder.iterdir() if not _run_file(p.name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"{folder}: holds files that are not a densefit run ({shown}); choose a new "
            "--output, or pass --overwrite to train into it anyway"
        )


def _run_file(name: str) -> bool:
    """A file an interrupted densefit run leaves: its log (or an older, renamed one), its
    checkpoints, its best model so far (keep_best) and its trackers' files (report_to)."""
    stem, _, suffix = LOG_NAME.partition(".")
    return name in (LOG_NAME, CHECKPOINTS, BEST, *TRACKER_FILES) or (
        name.startswith(stem + ".")
        and name.endswith("." + suffix)
        and name[len(stem) + 1 : -len(suffix) - 1].isdigit()
    )


def _no_decay(name: str) -> bool:
    return name.endswith(".bias") or "LayerNorm" in name or "layer_norm" in name or "norm." in name


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with ``config.weight_decay`` on weights, none on biases and norms."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if _no_decay(name) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel updates in place: no per-step temporaries the size of the model.
    device = next(model.parameters()).device.type
    return torch.optim.AdamW(groups, lr=config.learning_rate, fused=device in ("cpu", "cuda"))


def make_scheduler(
    optimizer: torch.optim.Optimizer, warmup: int, total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` steps, then linear decay to 0 at step ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# Where --amp fp16 runs (with loss scaling): CUDA; a CPU runs it slowly, if at all, and bf16
# needs no scaling there.
FP16_DEVICES = ("cuda",)


def _mixed_precision(
    config: TrainConfig, device: torch.device
) -> tuple[Callable[[], contextlib.AbstractContextManager], torch.amp.GradScaler | None]:
    """The autocast context of ``config.amp`` on ``device``, and the loss scaler fp16 needs."""
    if config.amp is None:
        return contextlib.nullcontext, None
    dtype = torch.bfloat16 if config.amp == "bf16" else torch.float16
    if config.amp == "fp16" and device.type not in FP16_DEVICES:
        raise ValueError("--amp fp16 needs a CUDA device; on CPU use --amp bf16")
    scaler = torch.amp.GradScaler(device.type) if config.amp == "fp16" else None
    return lambda: torch.autocast(device_type=device.type, dtype=dtype), scaler


# A run of fewer optimizer steps than this barely moves the model
# (bench/results/batch_size.md: batch 2,048 over manpages' 3,739 rows, 2 steps an epoch).
FEW_STEPS = 10


def warn_few_steps(rows: int, steps: int, config: TrainConfig) -> None:
    """Warn (UserWarning) when the epochs give fewer than ``FEW_STEPS`` optimizer steps
    although the data would give that many at batch 32: the batch size ate the steps.

    Not for ``max_steps`` (steps asked for) nor data too small for any batch size.
    """
    if config.max_steps is not None or steps >= FEW_STEPS or rows < FEW_STEPS * AUTO_LR_BATCH:
        return
    per_epoch = max(1, steps // config.epochs)
    epochs = -(-FEW_STEPS // per_epoch)
    warnings.warn(
        f"batch {config.batch_size:,} over {rows:,} rows is {steps} optimizer "
        f"step{'s' if steps != 1 else ''} ({config.epochs} epoch{'s' if config.epochs != 1 else ''}"
        f"): too few for the model to learn much. Train for --epochs {epochs} or more "
        f"(>= {FEW_STEPS} steps), or use a smaller --batch-size (at most "
        f"{rows * config.epochs // FEW_STEPS:,} for {FEW_STEPS} steps); see 'Choosing a batch "
        "size' in the README",
        UserWarning,
        stacklevel=4,
    )


def _prepare_model(model: SentenceTransformer, config: TrainConfig) -> torch.device:
    apply_lora(model, config)  # before the optimizer, the planner and a checkpoint's weights
    device = torch.device(config.device or model.device)
    model.to(device)
    if config.max_seq_length is not None:
        model.max_seq_length = config.max_seq_length
    set_prompts(model, query=config.query_prompt, document=config.document_prompt)
    model.similarity_fn_name = config.similarity  # saved with the model; stores search by it
    if config.gradient_accumulation_steps > 1 and config.loss == "mnrl":
        warnings.warn(
            "gradient accumulation does not add in-batch negatives: each micro-batch only "
            "sees its own rows as negatives. Use one large --batch-size with --memory auto "
            "(gradient cache) instead.",
            UserWarning,
            stacklevel=4,
        )
    if device.type == "cpu" and config.release_cpu_memory:
        release_freed_memory_promptly()  # chunks of varying sizes would fragment the heap
    return device


def _agree_on_plan(model, examples, config, dist, resumed, batches) -> MemoryPlan:
    if resumed is not None:
        resumed.check_matches(config, examples)
        return resumed.plan()  # after any out-of-memory halving
    if dist is not None:
        broadcast_parameters(model)  # identical starting weights on every rank
        return dist.agree_on_plan(model, examples, config)  # rank 0 plans
    return plan_for_run(model, examples, config, batches)


def setup_run(
    model: SentenceTransformer,
    examples: Sequence[TrainingExample],
    config: TrainConfig | None = None,
    *,
    output_dir: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
    resume: bool | str | os.PathLike = False,
    overwrite: bool = False,
    batches: Sequence[Sequence[int]] | None = None,
    eval_data: str | os.PathLike | BeirDataset | None = None,
) -> TrainRun:
    """Check, plan and build everything a run needs; restore the checkpoint when resuming.

    ``batches`` (row indices of every forward-backward) are what ``memory="auto"`` plans
    for; by default the run's own. Inside a process group of several ranks the plan is
    rank 0's and the starting weights are broadcast. ``eval_data`` (a BEIR folder or
    dataset) turns on evaluation during training (:mod:`densefit.training.evaluation`); in
    a multi-process run only rank 0 holds the evaluator (``run.evaluator``), every rank
    knows that the run evaluates (``run.evaluates``).
    See :func:`densefit.training.train`.

    >>> from densefit.testing import tiny_model
    >>> rows = [TrainingExample("what is a cell", "the cell is a unit")]
    >>> run = setup_run(tiny_model(), rows, TrainConfig(memory="cache", show_progress=False))
    >>> run.strategy.name, run.total_steps
    ('cache', 1)
    """
    config = config or TrainConfig()
    auto_lr = config.learning_rate == "auto"  # the rule's value from here on (and in checkpoints)
    if config.device is not None:  # "auto" -> the device it names on this machine
        config = dataclasses.replace(config, device=resolve_device(config.device))
    check_examples(examples, config)
    batch = effective_batch_size(examples, config)  # the rows a step really has
    warn_batch_larger_than_data(examples, config, batch)
    config = resolve_similarity(resolve_learning_rate(config, batch), model)
    check_output_dir(output_dir, config, resume=bool(resume), overwrite=overwrite)
    if output_dir is None and config.checkpoint_every != default_of(
        TrainConfig, "checkpoint_every"
    ):
        raise ValueError(
            f"checkpoint_every={config.checkpoint_every} needs output_dir (checkpoints go to "
            "OUTPUT/checkpoints; without an output folder a run writes none)"
        )
    # Rank 0 evaluates; every rank checks the options, so all refuse the same ones.
    evaluator = make_evaluator(config, eval_data, output_dir=output_dir, main=is_main_process())
    check_trackers(config.report_to, output_dir)
    device = _prepare_model(model, config)
    check_matryoshka_dims(config, model)  # before any file is written
    dist = DistributedRun.detect(model, config)
    seed_everything(config.seed + (dist.rank if dist else 0))  # dropout differs across ranks
    if config.invariant_dropout:  # before planning: the planner probes the model as it trains
        enable_invariant_dropout(model)
    resumed = _find_checkpoint(resume, output_dir, dist) if resume else None
    if resumed is not None:
        resumed.check_world_size(dist.world_size if dist else 1)
    plan = _agree_on_plan(model, examples, config, dist, resumed, batches)
    if plan.loss_block_size and config.loss_block_size is None:
        config = dataclasses.replace(config, loss_block_size=plan.loss_block_size)
    total = total_steps(examples, config)
    warn_few_steps(len(examples), total, config)
    warmup = config.warmup_steps if config.warmup_steps is not None else int(0.1 * total)
    optimizer = make_optimizer(model, config)
    autocast, scaler = _mixed_precision(config, device)
    run = TrainRun(
        model=model,
        examples=examples,
        config=config,
        device=device,
        plan=plan,
        strategy=make_strategy(plan),
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, warmup, total),
        autocast=autocast,
        scaler=scaler,
        guard=NonFiniteGuard(config.max_nonfinite),
        dist=dist,
        total_steps=total,
        resumed=resumed,
        evaluator=evaluator,
        evaluates=eval_data is not None,
        learning_rate_auto=auto_lr,
        checkpointing=output_dir is not None and config.keep_checkpoints > 0,
    )
    run.strategy.prepare(model)
    if resumed is not None:  # weights, optimizer, scheduler, scaler, counters, then RNG states
        resumed.restore(
            model, optimizer, run.scheduler, run.scaler, run.guard, evaluator,
            rank=dist.rank if dist else 0,
        )  # fmt: skip
        state = resumed.state
        stopped = evaluator is not None and evaluator.stopped
        if dist is not None:  # rank 0 holds the evaluator: its early-stopping state for all
            stopped = broadcast_object(stopped)
        run = dataclasses.replace(
            run,
            position=Position(
                step=resumed.step,
                seen=state["seen"],
                epoch=state["epoch"],
                batch=state["batch"],
                losses=state["losses"],
                stopped=stopped,
            ),  # fmt: skip
        )
    return _prepare_output(run, output_dir, log_path, resume=bool(resume))


def _find_checkpoint(resume, output_dir, dist: DistributedRun | None) -> Checkpoint | None:
    """The checkpoint to resume from; with several processes rank 0 picks it (and warns
    about the ones it skips) and every rank reads that one."""
    if dist is None:
        return resume_checkpoint(resume, output_dir)
    found, failed = None, None
    if dist.is_main:
        try:
            found = resume_checkpoint(resume, output_dir)
        except (ValueError, OSError) as exc:  # every rank must leave the broadcast below
            failed = exc
    path, message = broadcast_object((found and str(found.path), failed and str(failed)))
    if failed is not None:
        raise failed
    if message is not None:
        raise CheckpointError(message)
    return verify_checkpoint(path) if path is not None else None


def _prepare_output(run: TrainRun, output_dir, log_path, *, resume: bool) -> TrainRun:
    """The output folder, the checkpointer, and a log that holds each step once: resumed,
    the steps after the checkpoint are dropped; a new run moves an old log aside."""
    checkpoints = None
    if output_dir is not None:
        if run.is_main:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
        log_path = log_path or Path(output_dir) / LOG_NAME
        if run.config.keep_checkpoints and run.is_main:
            checkpoints = Checkpointer(
                output_dir,
                run.config,
                run.examples,
                model=run.model,
                optimizer=run.optimizer,
                scheduler=run.scheduler,
                scaler=run.scaler,
                guard=run.guard,
                evaluator=run.evaluator,
                resumed=run.resumed,
                world_size=run.dist.world_size if run.dist is not None else 1,
            )
    run = dataclasses.replace(
        run, checkpoints=checkpoints, log_path=Path(log_path) if log_path else None
    )
    if run.log_path is None or not run.is_main:
        return run
    if resume and run.resumed is not None:
        truncate_log(run.log_path, run.position.step)  # steps after the checkpoint are redone
    else:
        rotate_log(run.log_path)  # a new run: its steps never follow an old run's
    return run
