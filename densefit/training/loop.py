"""One readable training loop: batches of text in, a fine-tuned SentenceTransformer out.

    for each batch:
        strategy.forward_backward(model, columns, loss)   # memory strategy wraps the encoder
        clip, optimizer.step(), scheduler.step()
        log one JSON line

The memory strategy (plain, checkpoint, gradient cache) decides how the encoder is called;
the loss is a pure function of the embeddings; nothing else is hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from densefit.training.checkpoint import Checkpointer, resume_checkpoint, truncate_log
from densefit.config import TrainConfig
from densefit.data.samplers import no_duplicate_batches
from densefit.data.types import TrainingExample
from densefit.training.distributed import DistributedRun, broadcast_parameters
from densefit.training.guards import NonFiniteGuard, guarded_step
from densefit.losses import margin_mse, mnrl
from densefit.losses.masking import (
    false_negative_mask,
    health_postfix,
    in_batch_accuracy,
    merge_health,
    score_health,
)
from densefit.memory.allocator import allocator_in_use, release_freed_memory_promptly
from densefit.memory.dropout import enable_invariant_dropout
from densefit.memory.planner import auto_loss_chunk
from densefit.memory.strategies import MemoryStrategy, make_strategy

__all__ = ["train", "TrainResult", "batches", "make_loss_fn", "peak_rss_bytes", "build_strategy"]


@dataclass
class TrainResult:
    """What a run did: steps, final loss, the memory plan and where the log went."""

    steps: int
    examples: int
    final_loss: float
    losses: list[float] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    log_path: str | None = None
    seconds: float = 0.0
    skipped_nonfinite: int = 0  # optimizer steps skipped for a non-finite loss or gradient


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux: ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def batches(
    n: int, batch_size: int, *, seed: int, epoch: int, drop_last: bool = False
) -> list[list[int]]:
    """The row indices of each batch of one epoch: a seeded permutation cut into batches.

    >>> batches(5, 2, seed=0, epoch=0)
    [[4, 1], [2, 0], [3]]
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=generator).tolist()
    out = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if drop_last and out and len(out[-1]) < batch_size:
        out.pop()
    return out


def epoch_batches(
    examples: Sequence[TrainingExample], config: TrainConfig, epoch: int
) -> list[list[int]]:
    """Row indices of each micro-batch of one epoch: seeded, then de-duplicated if asked."""
    micro = config.batch_size // config.gradient_accumulation_steps or 1
    out = batches(len(examples), micro, seed=config.seed, epoch=epoch, drop_last=config.drop_last)
    if config.no_duplicates:  # same batch count and sizes, texts unique per batch
        out = no_duplicate_batches(examples, out)
    return out


def planned_batches(examples: Sequence[TrainingExample], config: TrainConfig) -> list[list[int]]:
    """Row indices of every forward-backward (micro-batch) the run will do, in order."""
    per_epoch = epoch_batches(examples, config, 0)
    steps = math.ceil(len(per_epoch) / config.gradient_accumulation_steps)
    total = (config.max_steps or steps * config.epochs) * config.gradient_accumulation_steps
    out: list[list[int]] = []
    epoch = 0
    while len(out) < total and per_epoch:
        out += per_epoch if epoch == 0 else epoch_batches(examples, config, epoch)
        epoch += 1
    return out[:total]


def columns_of(rows: Sequence[TrainingExample]) -> list[list[str]]:
    """Text columns of a batch: anchors, positives, then all hard negatives flattened."""
    return [
        [r.query for r in rows],
        [r.positive for r in rows],
        [n for r in rows for n in r.negatives],
    ]


def make_loss_fn(
    config: TrainConfig, rows: Sequence[TrainingExample], health: dict | None = None
) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """The batch's loss as a function of its column embeddings [anchors, positives, negatives].

    MNRL masks false negatives (duplicates, known positives: :mod:`densefit.losses.masking`);
    ``health`` receives the batch's telemetry (counts now, scores when the loss runs).
    """
    health = {} if health is None else health
    if config.loss == "mnrl":
        n_negatives = sum(len(r.negatives) for r in rows)
        loss_chunk = config.loss_chunk_size or auto_loss_chunk(len(rows), n_negatives)
        found = false_negative_mask(rows)
        mask = found.mask if config.mask_false_negatives else None  # (B, B + M) or None
        health.update(found.telemetry())

        def loss_fn(emb: list[torch.Tensor]) -> torch.Tensor:
            negatives = emb[2] if emb[2].numel() else None
            health.update(score_health(emb, rows, config.similarity))
            health["in_batch_accuracy"] = in_batch_accuracy(emb, mask, config.similarity)
            return mnrl(
                emb[0], emb[1], negatives,
                scale=config.scale, symmetric=config.symmetric,
                similarity=config.similarity, chunk_size=loss_chunk,
                mask=None if mask is None else mask.to(emb[0].device),
            )

        return loss_fn
    scores = torch.tensor([r.score for r in rows], dtype=torch.float32)

    def margin_loss(emb: list[torch.Tensor]) -> torch.Tensor:
        health.update(score_health(emb, rows, config.similarity))
        health["in_batch_accuracy"] = in_batch_accuracy(emb, None, config.similarity)
        return margin_mse(emb[0], emb[1], emb[2], scores.to(emb[0].device))

    return margin_loss


def _check_examples(examples: Sequence[TrainingExample], config: TrainConfig) -> None:
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


def _no_decay(name: str) -> bool:
    return name.endswith(".bias") or "LayerNorm" in name or "layer_norm" in name or "norm." in name


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
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


def _linear_schedule(optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _autocast(config: TrainConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if config.amp is None:
        return contextlib.nullcontext
    dtype = torch.bfloat16 if config.amp == "bf16" else torch.float16
    if config.amp == "fp16" and device.type != "cuda":
        raise ValueError("--amp fp16 needs a CUDA device; on CPU use --amp bf16")
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def build_strategy(
    model: SentenceTransformer, examples: Sequence[TrainingExample], config: TrainConfig,
    *, batches: Sequence[Sequence[int]] | None = None,
) -> tuple[MemoryStrategy, dict]:
    """The memory strategy for this run, and the plan that chose it (for the log).

    With ``memory="auto"`` the plan is for ``batches`` (row indices of every step), by
    default the batches :func:`train` will run (:func:`planned_batches`).
    """
    name = config.memory
    if config.gradient_checkpointing and name == "plain":
        name = "checkpoint"
    if name == "auto":
        from densefit.memory.planner import plan_memory

        if batches is None:
            batches = planned_batches(examples, config)
        plan = plan_memory(model, examples, config, batches=batches)
        # Cached chunks are capped in padded tokens: chunks of short texts take more rows.
        strategy = make_strategy(
            plan.strategy, None if plan.token_budget else plan.chunk_size,
            token_budget=plan.token_budget, sort_by_length=config.sort_by_length,
            keep_graphs=plan.keep_graphs if config.keep_graphs is None else config.keep_graphs,
        )
        return strategy, plan.to_dict()
    strategy = make_strategy(
        name, config.chunk_size, token_budget=config.token_budget,
        sort_by_length=config.sort_by_length,
        keep_graphs=1 if config.keep_graphs is None else config.keep_graphs,
    )
    return strategy, {"chosen_by": "user", **strategy.describe()}


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def train(
    model: SentenceTransformer,
    examples: Sequence[TrainingExample],
    config: TrainConfig | None = None,
    *,
    output_dir: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
    on_step: Callable[[dict], None] | None = None,
    resume: bool | str | os.PathLike = False,
) -> TrainResult:
    """Fine-tune ``model`` on ``examples`` in place; save to ``output_dir`` when given.

    With ``output_dir``, checkpoints go to ``output_dir/checkpoints`` (every
    ``config.checkpoint_every`` steps and at each epoch end; see :mod:`densefit.training.checkpoint`).
    ``resume=True`` continues from the newest good one there, ``resume=<folder>`` from that
    one: same batches, same RNG stream, the weights an uninterrupted run would end with.
    A step with a non-finite loss or gradient is skipped (see :mod:`densefit.training.guards`).
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
    config = config or TrainConfig()
    _check_examples(examples, config)
    device = torch.device(config.device or model.device)
    model.to(device)
    if config.max_seq_length is not None:
        model.max_seq_length = config.max_seq_length
    if config.gradient_accumulation_steps > 1 and config.loss == "mnrl":
        warnings.warn(
            "gradient accumulation does not add in-batch negatives: each micro-batch only "
            "sees its own rows as negatives. Use one large --batch-size with --memory auto "
            "(gradient cache) instead.",
            UserWarning,
            stacklevel=2,
        )

    if device.type == "cpu" and config.release_cpu_memory:
        release_freed_memory_promptly()  # chunks of varying sizes would fragment the heap
    run = DistributedRun.detect(model, config)  # None: one process
    main = run is None or run.is_main  # the process that logs, checkpoints and saves
    if run is not None and resume:
        raise ValueError(
            "resuming a multi-process run is not supported yet (each rank's RNG state is not "
            "checkpointed): resume it in one process with the same options (same global "
            "batches and gradients), or start a new run"
        )
    seed_everything(config.seed + (run.rank if run else 0))  # dropout differs across ranks
    if config.invariant_dropout:  # before planning: the planner probes the model as it trains
        enable_invariant_dropout(model)
    resumed = resume_checkpoint(resume, output_dir) if resume else None
    if resumed is not None:
        resumed.check_matches(config, examples)
        strategy, plan = resumed.strategy(), resumed.state["plan"]  # after any OOM halving
    elif run is not None:
        broadcast_parameters(model)  # identical starting weights on every rank
        strategy, plan = run.agree_on_strategy(model, examples, config)  # rank 0 plans
    else:
        strategy, plan = build_strategy(model, examples, config)
    strategy.prepare(model)
    if plan.get("loss_chunk_size") and config.loss_chunk_size is None:
        config = dataclasses.replace(config, loss_chunk_size=plan["loss_chunk_size"])
    if device.type == "cpu":  # mimalloc (the CLI's default on Linux) or the system's malloc
        plan = {**plan, "cpu_allocator": allocator_in_use()}

    micro_per_epoch = len(batches(len(examples), config.batch_size // config.gradient_accumulation_steps or 1,
                                  seed=config.seed, epoch=0, drop_last=config.drop_last))
    steps_per_epoch = math.ceil(micro_per_epoch / config.gradient_accumulation_steps)
    total_steps = config.max_steps or steps_per_epoch * config.epochs
    warmup = config.warmup_steps if config.warmup_steps is not None else int(0.1 * total_steps)
    optimizer = _optimizer(model, config)
    scheduler = _linear_schedule(optimizer, warmup, total_steps)
    autocast = _autocast(config, device)
    scaler = torch.amp.GradScaler("cuda") if config.amp == "fp16" else None
    guard = NonFiniteGuard(config.max_nonfinite)

    step, seen, losses, epoch, first_batch = 0, 0, [], 0, 0
    if resumed is not None:  # weights, optimizer, scheduler, scaler, counters, then RNG states
        resumed.restore(model, optimizer, scheduler, scaler, guard)
        step, seen, losses = resumed.step, resumed.state["seen"], resumed.state["losses"]
        epoch, first_batch = resumed.state["epoch"], resumed.state["batch"]  # the next batch

    checkpoints = None
    if output_dir is not None:
        if main:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
        log_path = log_path or Path(output_dir) / "train_log.jsonl"
        if config.keep_checkpoints and main:
            checkpoints = Checkpointer(
                output_dir, config, examples, model=model, optimizer=optimizer,
                scheduler=scheduler, scaler=scaler, strategy=strategy, plan=plan, guard=guard,
                resumed=resumed,
            )
    elif config.checkpoint_every:
        raise ValueError("checkpoint_every needs output_dir (checkpoints go to OUTPUT/checkpoints)")
    if resume and log_path:
        truncate_log(log_path, step)  # steps after the checkpoint (or all: none yet) are redone
    log_file = open(log_path, "a", encoding="utf-8") if log_path and main else None  # noqa: SIM115

    progress = None
    if config.show_progress and main:
        from tqdm.auto import tqdm

        progress = tqdm(total=total_steps, initial=step, desc="train", unit="step",
                        dynamic_ncols=True)

    model.train()
    started = time.perf_counter()
    try:
        while step < total_steps:
            micro_batches = epoch_batches(examples, config, epoch)
            for first in range(first_batch, len(micro_batches), config.gradient_accumulation_steps):
                if step >= total_steps:
                    break
                group = micro_batches[first : first + config.gradient_accumulation_steps]
                t0 = time.perf_counter()
                record = _optimizer_step(
                    model, examples, group, config, strategy, optimizer, scheduler,
                    autocast, scaler, run,
                )
                dt = time.perf_counter() - t0
                rows = sum(len(b) for b in group)
                step, seen = step + 1, seen + rows
                losses.append(record["loss"])
                guard.update(record.pop("outcome"))
                record.update(
                    step=step, epoch=epoch, examples=rows, step_time_s=round(dt, 4),
                    examples_per_s=round(rows / dt, 2) if dt > 0 else None,
                    lr=scheduler.get_last_lr()[0], peak_rss_mb=round(peak_rss_bytes() / 2**20, 1),
                    strategy=strategy.name, chunk_size=strategy.chunk_size,
                    token_budget=strategy.token_budget, oom_retries=strategy.oom_retries,
                    skipped_nonfinite=guard.total,
                )
                if device.type == "cuda":
                    record["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
                if log_file and step % config.log_every == 0:
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                guard.check(step, record, [examples[i].origin for b in group for i in b],
                            learning_rate=config.learning_rate, amp=config.amp)
                next_batch = first + config.gradient_accumulation_steps
                epoch_end = next_batch >= len(micro_batches)
                last = step >= total_steps
                if checkpoints is not None and checkpoints.due(step, epoch_end=epoch_end, last=last):
                    resume_at = (epoch + 1, 0) if epoch_end else (epoch, next_batch)
                    checkpoints.save(step, epoch=resume_at[0], batch=resume_at[1], seen=seen,
                                     losses=losses)
                if on_step is not None and main:
                    on_step(record)
                if progress is not None:
                    progress.set_postfix(
                        loss=f"{record['loss']:.4f}", ex_s=f"{record['examples_per_s']:.1f}",
                        pad=f"{record['padding_efficiency']:.2f}", **health_postfix(record),
                    )
                    progress.update(1)
            epoch, first_batch = epoch + 1, 0
    finally:
        if progress is not None:
            progress.close()
        if log_file:
            log_file.close()

    model.eval()
    result = TrainResult(
        steps=step, examples=seen, final_loss=losses[-1] if losses else float("nan"),
        losses=losses, plan=plan, log_path=str(log_path) if log_path else None,
        seconds=time.perf_counter() - started, skipped_nonfinite=guard.total,
    )
    if output_dir is not None and main:
        save_model(model, output_dir, config, result)
    if run is not None:
        run.barrier()  # every rank returns once the model is saved
    return result


def _optimizer_step(model, examples, group, config, strategy, optimizer, scheduler, autocast, scaler,
                    run: DistributedRun | None = None) -> dict:
    """Forward-backward every micro-batch of ``group``, then one optimizer step.

    On a CUDA out-of-memory error the chunk is halved and the whole step redone: no step
    is lost and the run does not crash. With several ranks each micro-batch is this rank's
    share of the global batch, and one all-reduce sums gradients and loss before the step.
    """
    n_micro = len(group)
    while True:
        # Zeroed in place, not freed: the gradient buffers are allocated once and reused.
        # Freeing them each step (set_to_none) lets the next backward allocate them again in a
        # heap the step's activations have fragmented (on CPU, glibc: higher peaks in A/B
        # runs, see README "What these runs showed").
        optimizer.zero_grad(set_to_none=False)
        try:
            stats, health = [], []
            for indices in group:
                rows = [examples[i] for i in indices]
                health.append({})
                if run is None:
                    loss_fn = make_loss_fn(config, rows, health[-1])
                else:  # this rank's rows; the loss gathers the other ranks' candidates
                    rows, loss_fn = run.local_loss_fn(config, rows, health[-1])
                if n_micro > 1:
                    loss_fn = lambda emb, base=loss_fn: base(emb) / n_micro  # noqa: E731
                stats.append(
                    strategy.forward_backward(
                        model, columns_of(rows), loss_fn, autocast=autocast, scaler=scaler
                    )
                )
            break
        except RuntimeError as exc:
            if not _is_oom(exc):
                raise
            if run is not None:  # the other ranks are already in the step's collectives
                raise RuntimeError(
                    f"out of memory on rank {run.rank} with chunk {strategy.chunk_size} / token "
                    f"budget {strategy.token_budget}: with several processes a step cannot be "
                    "redone with smaller chunks; lower --chunk-size / --token-budget or "
                    "--memory-budget"
                ) from exc
            optimizer.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            old = (strategy.chunk_size, strategy.token_budget)
            if not strategy.halve():
                raise
            strategy.oom_retries += 1
            warnings.warn(
                f"out of memory with chunk {old[0]} / token budget {old[1]}: redoing the "
                f"step with chunk {strategy.chunk_size} / token budget {strategy.token_budget}",
                RuntimeWarning, stacklevel=2,
            )
    loss = sum(s.loss for s in stats)  # micro losses are already divided by n_micro
    real = sum(s.real_tokens for s in stats)
    padded = sum(s.padded_tokens for s in stats)
    extra = {}
    if run is not None:  # the step's one synchronisation: gradients and loss, summed
        local_rows = sum(run.shard(len(b))[1] - run.shard(len(b))[0] for b in group)
        loss, real, padded = run.sync(model, loss, real, padded)
        extra = {"world_size": run.world_size, "per_device_examples": local_rows,
                 **run.take_comm_stats()}
    # Clip and step; a non-finite loss or gradient skips the step (densefit.training.guards).
    outcome = guarded_step(
        model, optimizer, scheduler, scaler, loss=loss, max_grad_norm=config.max_grad_norm
    )
    return {
        "loss": loss,
        "grad_norm": outcome.grad_norm,
        "skipped": outcome.skipped,
        "outcome": outcome,
        "padding_efficiency": round(real / padded, 4) if padded else 1.0,
        **merge_health(health),  # unique candidates, masked false negatives, mean scores
        "chunks": sum(s.chunks for s in stats),
        **extra,
    }


def train_step(
    model: SentenceTransformer,
    rows: Sequence[TrainingExample],
    config: TrainConfig,
    strategy: MemoryStrategy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    run: DistributedRun | None = None,
) -> dict:
    """One optimizer step of the training loop on ``rows`` as one batch (no AMP).

    For code that drives steps itself (benchmarks, tests): the same forward-backward,
    clipping, guards and (under torchrun) gradient sync as :func:`train`, nothing else.
    """
    if scheduler is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return _optimizer_step(
        model, rows, [list(range(len(rows)))], config, strategy, optimizer, scheduler,
        contextlib.nullcontext, None, run,
    )


def save_model(
    model: SentenceTransformer, output_dir: str | os.PathLike, config: TrainConfig,
    result: TrainResult | None = None,
) -> Path:
    """Save in sentence-transformers format, with ``densefit_config.json`` beside it."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save(str(out), safe_serialization=True)
    import densefit

    extra = {"densefit_version": densefit.__version__, "torch_version": torch.__version__}
    if result is not None:
        extra.update(steps=result.steps, examples=result.examples, final_loss=result.final_loss,
                     memory_plan=result.plan, seconds=round(result.seconds, 2))
    config.save(out / "densefit_config.json", **extra)
    return out
