"""One optimizer step: embed, loss, backward (the memory strategy), sync, clip, step.

:func:`train_step` is the whole step the training loop, the benchmarks and the tests run.
On an out-of-memory error it switches the run to the halved memory plan
(:meth:`~densefit.memory.plan.MemoryPlan.halved`) and redoes the step from zeroed gradients
with the same random stream: no step is lost, and the redone step is the one a run started
with the halved plan takes.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence

import torch

from densefit.data.batching import columns_of
from densefit.memory.process import peak_rss_bytes
from densefit.memory.strategies import StepStats
from densefit.prompts import model_prompts, prompt_columns
from densefit.training import objective
from densefit.training.guards import guarded_step
from densefit.training.setup import TrainRun
from densefit.training.telemetry import merge_health

__all__ = ["is_oom", "train_step"]


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error (CUDA's, or a RuntimeError that says so)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def train_step(run: TrainRun, group: Sequence[Sequence[int]]) -> dict:
    """Forward-backward every micro-batch of ``group`` (row indices into ``run.examples``),
    then one optimizer step; the step's record (loss, gradient norm, timing, memory, health).

    With several ranks each micro-batch is the global batch: this rank embeds its share and
    one all-reduce sums gradients and loss before the step. A non-finite loss or gradient
    skips the optimizer step (:mod:`densefit.training.guards`) and is counted by the guard.
    """
    started = time.perf_counter()
    lr = run.optimizer.param_groups[0]["lr"]  # this step's rate (the scheduler moves it after)
    # A redone step replays the random stream of the failed attempt: the same dropout key,
    # so it is the step a run started with the halved plan takes (tests/test_train.py).
    random_state = _torch_random_state(run.device)
    while True:
        # Zeroed in place, not freed: the gradient buffers are allocated once and reused.
        # Freeing them each step lets the next backward allocate them again in a heap the
        # step's activations have fragmented (on CPU under glibc: higher peaks; see README,
        # "What these runs showed", and bench/results/allocator.md for glibc's heap).
        run.optimizer.zero_grad(set_to_none=False)
        try:
            stats, health = _forward_backward(run, group)
            break
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
            _shrink_after_oom(run, exc)
            _set_torch_random_state(random_state)
    record = _sync_and_step(run, group, stats, health)
    seconds = time.perf_counter() - started
    rows = sum(len(b) for b in group)
    record.update(
        examples=rows,
        step_time_s=round(seconds, 4),
        examples_per_s=round(rows / seconds, 2) if seconds > 0 else None,
        lr=lr,
        peak_rss_mb=round(peak_rss_bytes() / 2**20, 1),
        strategy=run.plan.strategy,
        chunk_size=run.plan.chunk_size,
        token_budget=run.plan.token_budget,
        oom_retries=run.plan.oom_retries,
        skipped_nonfinite=run.guard.total,
    )
    if run.device.type == "cuda":
        record["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(run.device) / 2**20, 1)
    return record


def _forward_backward(run: TrainRun, group) -> tuple[list[StepStats], list[dict]]:
    """Each micro-batch's loss back-propagated by the run's strategy (losses / micro-batches)."""
    n_micro = len(group)
    stats, health = [], []
    for indices in group:
        rows = [run.examples[i] for i in indices]
        health.append({})
        if run.dist is None:
            loss_fn = objective.make_loss_fn(run.config, rows, health[-1])
        else:  # this rank's rows; the loss gathers the other ranks' candidates
            rows, loss_fn = run.dist.local_loss_fn(run.config, rows, health[-1])
        if n_micro > 1:
            loss_fn = lambda emb, base=loss_fn: base(emb) / n_micro  # noqa: E731
        stats.append(
            run.strategy.forward_backward(
                run.model,
                prompt_columns(columns_of(rows), model_prompts(run.model)),
                loss_fn,
                autocast=run.autocast,
                scaler=run.scaler,
            )
        )
    return stats, health


def _shrink_after_oom(run: TrainRun, exc: RuntimeError) -> None:
    """Switch to the halved plan, or re-raise when it cannot shrink (or several ranks run)."""
    old = run.plan
    if run.dist is not None:  # the other ranks are already in the step's collectives
        raise RuntimeError(
            f"out of memory on rank {run.dist.rank} with chunk {old.chunk_size} / token "
            f"budget {old.token_budget}: with several processes a step cannot be redone "
            "with smaller chunks; lower --chunk-size / --token-budget or --memory-budget"
        ) from exc
    run.optimizer.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    halved = old.halved()
    if halved is None:
        raise exc
    run.use_plan(halved)
    warnings.warn(
        f"out of memory with {old.summary()}: redoing the step with {halved.summary()}",
        RuntimeWarning,
        stacklevel=3,
    )


def _torch_random_state(device: torch.device) -> tuple:
    """torch's CPU generator state, and the CUDA device's when the step runs on one."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, device


def _set_torch_random_state(state: tuple) -> None:
    cpu, cuda, device = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _sync_and_step(run: TrainRun, group, stats: list[StepStats], health: list[dict]) -> dict:
    """Sum over ranks (one all-reduce), clip, step unless non-finite; the step's record."""
    loss = sum(s.loss for s in stats)  # micro losses are already divided by n_micro
    real = sum(s.real_tokens for s in stats)
    padded = sum(s.padded_tokens for s in stats)
    extra = {}
    if run.dist is not None:  # the step's one synchronisation: gradients and loss, summed
        local_rows = sum(run.dist.shard(len(b))[1] - run.dist.shard(len(b))[0] for b in group)
        loss, real, padded = run.dist.sync(run.model, loss, real, padded)
        extra = {
            "world_size": run.dist.world_size,
            "per_device_examples": local_rows,
            **run.dist.take_comm_stats(),
        }
    outcome = guarded_step(
        run.model,
        run.optimizer,
        run.scheduler,
        run.scaler,
        loss=loss,
        max_grad_norm=run.config.max_grad_norm,
    )
    run.guard.update(outcome)
    return {
        "loss": loss,
        "grad_norm": outcome.grad_norm,
        "skipped": outcome.skipped,
        "padding_efficiency": round(real / padded, 4) if padded else 1.0,
        **merge_health(health),  # unique candidates, masked false negatives, mean scores
        "chunks": sum(s.chunks for s in stats),
        **extra,
    }
