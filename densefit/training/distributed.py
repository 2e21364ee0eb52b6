"""Training on several devices with torch.distributed: cross-device negatives, one sync per step.

    torchrun --nproc-per-node 2 -m densefit train data.jsonl --output runs/m --batch-size 1024

Every rank computes the same seeded order of *global* batches (``--batch-size`` is the
global batch) and takes its contiguous share of each one (:func:`shard_bounds`), so every
rank does the same number of steps whatever the data size: nothing to hang on. Because
every rank knows the whole batch, it also knows every other rank's row counts and the
whole batch's false-negative mask without exchanging a single text.

Per step and micro-batch, with ``gather="candidates"`` (the default):

1. each rank embeds its rows with its memory strategy (plain, checkpoint, gradient cache);
2. the loss gathers the candidate embeddings (positives, hard negatives; anchors too for a
   symmetric loss) of all ranks in **one** all-gather (:func:`gather_rows`), whose backward
   is **one** all-reduce of the embedding gradients, each rank keeping its own slice;
3. each rank computes the loss terms of its own anchors against every candidate of the
   global batch (labels offset by the rank's first row) and weighs them by its share of
   the rows, so the losses of all ranks add up to the union batch's loss;
4. after the strategy's backward(s), **one** all-reduce of a flat buffer holding every
   parameter gradient and the loss (:func:`all_reduce_gradients`) sums them over ranks.

The gradient cache re-embeds its chunks with no communication at all (nothing of
DistributedDataParallel's per-backward reducer is involved), so a step has exactly one
gradient synchronisation whatever its chunk count, and the parameter gradients equal those
of one process on the union batch (``tests/test_distributed.py``, atol 1e-5).

``gather="both"`` gathers anchors too and every rank computes the loss of the whole batch
(divided by the world size): the same result with ``world`` times the score work, kept as
a reference. ``gather="none"``: each rank's rows are negatives only for each other (the
loss of ``--batch-size / world`` batches, averaged), no embedding communication.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from densefit.choices import GATHER_MODES
from densefit.data.batching import planned_batches
from densefit.data.types import TrainingExample
from densefit.memory.plan import MemoryPlan
from densefit.memory.planner import plan_for_run
from densefit.retrieval.encode import embedding_dimension
from densefit.training.objective import LossFn, batch_loss, make_loss_fn

__all__ = [
    "DistributedRun",
    "all_reduce_gradients",
    "broadcast_object",
    "broadcast_parameters",
    "gather_object",
    "gather_rows",
    "init_distributed",
    "is_main_process",
    "launched_by_torchrun",
    "rank",
    "shard_bounds",
    "teardown_distributed",
    "world_size",
]


# ----------------------------------------------------------------------------- process group


def launched_by_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    """This process's rank (0 without an initialised process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Processes in the run (1 without an initialised process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """Rank 0 (or a run without torch.distributed): the one that logs and saves."""
    return rank() == 0


def init_distributed(
    device: str | None = None, *, backend: str | None = None, timeout_s: float = 1800
) -> torch.device:
    """Join the process group described by torchrun's environment; return this rank's device.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (set by ``torchrun``). The backend is nccl for CUDA devices and gloo for CPU unless
    given. ``device="cuda"`` becomes ``cuda:LOCAL_RANK`` (one GPU per process); ``None``
    means CPU. A no-op (besides returning the device) when already initialised.

    Example (in a script started with ``torchrun --nproc-per-node 2 script.py``)::

        device = init_distributed("cuda")
        model.to(device)
        train(model, rows, TrainConfig(batch_size=1024, device=str(device)))
        teardown_distributed()
    """
    if not launched_by_torchrun():
        raise RuntimeError(
            "init_distributed: RANK and WORLD_SIZE are not set; start the script with "
            "torchrun --nproc-per-node N (or densefit train --nproc N)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    resolved = torch.device(device or "cpu")
    if resolved.type == "cuda":
        if resolved.index is None:
            resolved = torch.device("cuda", local_rank)
        torch.cuda.set_device(resolved)  # nccl and broadcast_object_list use the current device
    if not dist.is_initialized():
        chosen = backend or ("nccl" if resolved.type == "cuda" else "gloo")
        kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if (
            chosen == "nccl"
            and "device_id" in inspect.signature(dist.init_process_group).parameters
        ):
            kwargs["device_id"] = resolved  # binds the communicator to this rank's GPU
        dist.init_process_group(chosen, **kwargs)
    return resolved


def teardown_distributed() -> None:
    """Leave the process group (after a barrier, so no rank exits while another still saves)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- sharding


def shard_bounds(n: int, world: int, r: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a global batch of ``n`` rows that rank ``r`` of ``world`` takes.

    Contiguous, sizes differ by at most one (lower ranks take the extra rows), so the
    gathered rows of all ranks are the global batch in its own order. A rank may get no row
    when ``n < world``; it still takes part in every collective.

    >>> [shard_bounds(5, 2, r) for r in range(2)]
    [(0, 3), (3, 5)]
    >>> shard_bounds(1, 2, 1)
    (1, 1)
    """
    base, extra = divmod(n, world)
    start = r * base + min(r, extra)
    return start, start + base + (1 if r < extra else 0)


# ----------------------------------------------------------------------------- collectives


@dataclass
class CommStats:
    """Collectives densefit issued (counted per step in the training log)."""

    counts: Counter = field(default_factory=Counter)
    bytes: int = 0

    def add(self, kind: str, nbytes: int) -> None:
        self.counts[kind] += 1
        self.bytes += nbytes

    def take(self) -> dict:
        """The counts since the last call, as log fields; resets them."""
        out = {
            "grad_allreduces": self.counts["grad_allreduce"],
            "embedding_allgathers": self.counts["embedding_allgather"],
            "embedding_grad_allreduces": self.counts["embedding_grad_allreduce"],
            "comm_mb": round(self.bytes / 2**20, 3),
        }
        self.counts.clear()
        self.bytes = 0
        return out


_STATS = CommStats()


class _GatherRows(torch.autograd.Function):
    """All-gather of several (n_r, d) tensors in one collective; backward: one all-reduce.

    Forward: each rank packs its tensors into one (max_rows, d) buffer; one all_gather; the
    output for tensor ``c`` is every rank's part, in rank order. Backward: each rank holds
    d(its loss)/d(every rank's rows); one all-reduce sums them over ranks and each rank
    keeps its own slice, i.e. d(sum of all ranks' losses)/d(its rows).
    """

    @staticmethod
    def forward(ctx, counts, dim, *tensors):  # counts[c][r]: rows of tensor c on rank r
        world, me = dist.get_world_size(), dist.get_rank()
        per_rank = [sum(col[r] for col in counts) for r in range(world)]
        width = max(per_rank)
        device = tensors[0].device
        local = torch.zeros(width, dim, dtype=torch.float32, device=device)
        at = 0
        for col, t in zip(counts, tensors):
            local[at : at + col[me]] = t.reshape(col[me], dim)
            at += col[me]
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        _STATS.add("embedding_allgather", local.numel() * 4 * world)
        outputs, offsets = [], [0] * world
        for col in counts:
            pieces = []
            for r in range(world):
                pieces.append(parts[r][offsets[r] : offsets[r] + col[r]])
                offsets[r] += col[r]
            outputs.append(torch.cat(pieces) if pieces else local[:0])
        ctx.counts, ctx.dim, ctx.width = counts, dim, width
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        counts, dim, width = ctx.counts, ctx.dim, ctx.width
        world, me = dist.get_world_size(), dist.get_rank()
        device = next((g.device for g in grads if g is not None), None)
        buffer = torch.zeros(world, width, dim, dtype=torch.float32, device=device)
        offsets = [0] * world
        for col, grad in zip(counts, grads):
            start = 0
            for r in range(world):
                if grad is not None:
                    buffer[r, offsets[r] : offsets[r] + col[r]] = grad[start : start + col[r]]
                offsets[r] += col[r]
                start += col[r]
        dist.all_reduce(buffer)  # sum over ranks of d(rank's loss)/d(every row)
        _STATS.add("embedding_grad_allreduce", buffer.numel() * 4)
        out, at = [], 0
        for col in counts:
            out.append(buffer[me, at : at + col[me]].clone())
            at += col[me]
        return (None, None, *out)


def gather_rows(
    tensors: Sequence[torch.Tensor], counts: Sequence[Sequence[int]], dim: int
) -> list[torch.Tensor]:
    """Gather each (counts[c][rank], dim) tensor of every rank, concatenated in rank order.

    One all-gather for all the tensors; gradients flow back to the rank that owns each row
    (one all-reduce in backward). ``counts[c][r]`` is how many rows tensor ``c`` has on rank
    ``r``: every rank must pass the same counts (densefit derives them from the global
    batch, which every rank knows). A rank with no rows passes empty tensors and still takes
    part in both collectives.
    """
    tensors = [
        t if t.numel() else torch.zeros(0, dim, device=t.device, requires_grad=True)
        for t in tensors
    ]
    return list(_GatherRows.apply([list(c) for c in counts], int(dim), *tensors))


def all_reduce_gradients(
    parameters: Sequence[torch.nn.Parameter], extras: Sequence[float] = ()
) -> list[float]:
    """Sum every parameter's ``.grad`` over all ranks in ONE all-reduce; return summed extras.

    The gradients (a parameter without one counts as zero), one flag per parameter (so a
    parameter gets a gradient exactly when some rank produced one, as in one process on the
    union batch) and ``extras`` (the loss, token counts) travel in a single flat fp32
    buffer: one synchronisation per step however many backwards the strategy ran.

    >>> all_reduce_gradients([])  # without a process group: nothing to do
    []
    """
    params = [p for p in parameters if p.requires_grad]
    if not (dist.is_available() and dist.is_initialized()) or world_size() == 1:
        return list(extras)
    device = params[0].device if params else torch.device("cpu")
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    flat = torch.zeros(total + len(params) + len(extras), dtype=torch.float32, device=device)
    at = 0
    for i, (p, n) in enumerate(zip(params, sizes)):
        if p.grad is not None:
            flat[at : at + n] = p.grad.reshape(-1)
            flat[total + i] = 1.0
        at += n
    if extras:
        flat[total + len(params) :] = torch.tensor([float(x) for x in extras], device=device)
    dist.all_reduce(flat)
    _STATS.add("grad_allreduce", flat.numel() * 4)
    flags = flat[total : total + len(params)].tolist()  # one device-to-host copy
    at = 0
    for i, (p, n) in enumerate(zip(params, sizes)):
        if flags[i] > 0:
            summed = flat[at : at + n].view_as(p)
            if p.grad is None:
                p.grad = summed.to(p.dtype).clone()
            else:
                p.grad.copy_(summed)
        at += n
    return flat[total + len(params) :].tolist()


def broadcast_parameters(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (one broadcast per dtype).

    Ranks that loaded the same weights are unchanged; a layer initialised at random on
    each rank (a new head, say) starts identical everywhere, as under DDP.
    """
    tensors = [t for t in (*module.parameters(), *module.buffers())]
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            dist.broadcast(flat, src)
            at = 0
            for t in group:
                t.copy_(flat[at : at + t.numel()].view_as(t))
                at += t.numel()


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s picklable ``obj`` on every rank."""
    box = [obj if rank() == src else None]
    dist.broadcast_object_list(box, src)
    return box[0]


def gather_object(obj, dst: int = 0) -> list | None:
    """Every rank's picklable ``obj``, in rank order, on rank ``dst`` (None on the others)."""
    out = [None] * world_size() if rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


# ----------------------------------------------------------------------------- the run


class _GatheredShare:
    """One rank's part of an MNRL batch: its anchors against every rank's candidates.

    ``gather="candidates"``: one all-gather of the positives and hard negatives (anchors too
    for a symmetric loss); this rank scores its own anchors (labels offset by its first row)
    and weighs its loss by its share of the rows. ``gather="both"``: anchors gathered too,
    every rank computes the whole batch's loss divided by the world size.
    """

    def __init__(self, run: DistributedRun, config, rows: Sequence[TrainingExample]):
        n = len(rows)
        bounds = [shard_bounds(n, run.world_size, r) for r in range(run.world_size)]
        self.rows = slice(*bounds[run.rank])
        self.row_counts = [b - a for a, b in bounds]
        self.neg_counts = [sum(len(r.negatives) for r in rows[a:b]) for a, b in bounds]
        self.both = run.gather == "both"
        self.gather_anchors = self.both or config.symmetric
        self.local = self.row_counts[run.rank]
        self.weight = self.local / n
        self.queries = n if self.both else self.local
        self.world, self.dim = run.world_size, run.dim

    def loss(self, emb: list[torch.Tensor], mnrl_fn, record_health) -> torch.Tensor:
        anchors, positives, negatives = (
            e if e.numel() else torch.zeros(0, self.dim, device=emb[0].device) for e in emb
        )
        if self.local:
            record_health([anchors, positives, negatives])
        columns, counts = [positives, negatives], [self.row_counts, self.neg_counts]
        if self.gather_anchors:
            columns.append(anchors)
            counts.append(self.row_counts)
        gathered = gather_rows(columns, counts, self.dim)
        if (
            not self.local and not self.both
        ):  # no rows here: a zero whose backward joins the all-reduce
            return sum(g.sum() for g in gathered) * 0.0
        negs = gathered[1] if sum(self.neg_counts) else None
        if self.both:  # every rank: the whole batch's loss; the ranks' copies add up to one
            return mnrl_fn(gathered[2], gathered[0], negs) / self.world
        all_anchors = gathered[2] if self.gather_anchors else anchors
        return mnrl_fn(all_anchors, gathered[0], negs, rows=self.rows) * self.weight


@dataclass
class DistributedRun:
    """This rank's view of a multi-process run: sharding, the gathering loss, the one sync.

    Built by :func:`densefit.training.setup.setup_run` when a process group with more than one rank is
    initialised; ``None`` there means one process and the plain code path.
    """

    rank: int
    world_size: int
    gather: str
    dim: int  # embedding size, for the empty tensors of a rank without rows

    @classmethod
    def detect(cls, model, config) -> DistributedRun | None:
        """The run's distributed view, or None in a single process."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None

        if config.gather not in GATHER_MODES:
            raise ValueError(
                f"gather must be one of {', '.join(GATHER_MODES)}, not {config.gather!r}"
            )
        return cls(
            dist.get_rank(), dist.get_world_size(), config.gather, embedding_dimension(model)
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- setup ----------------------------------------------------------------------------

    def agree_on_plan(self, model, examples: Sequence[TrainingExample], config) -> MemoryPlan:
        """Rank 0 makes the memory plan (:func:`densefit.memory.planner.plan_for_run`); every
        rank gets the same one. The planner plans for one device's share: the largest shard
        of any batch of the run.
        """
        plan = None
        if self.is_main:
            shards = [
                b[slice(*shard_bounds(len(b), self.world_size, r))]
                for b in planned_batches(examples, config)
                for r in range(self.world_size)
            ]
            per_device = dataclasses.replace(config, batch_size=max(1, *map(len, shards)))
            plan = plan_for_run(model, examples, per_device, [s for s in shards if s]).to_dict()
        return MemoryPlan.from_dict(broadcast_object(plan))

    def describe(self, config) -> dict:
        """The run's layout, for the plan report."""
        return {
            "batch_size": config.batch_size,
            "per_device_batch_size": -(-config.batch_size // self.world_size),
            "world_size": self.world_size,
            "gather": self.gather,
        }

    def shard(self, n: int) -> tuple[int, int]:
        return shard_bounds(n, self.world_size, self.rank)

    # -- one micro-batch ------------------------------------------------------------------

    def local_loss_fn(
        self, config, rows: Sequence[TrainingExample], health: dict
    ) -> tuple[list[TrainingExample], LossFn]:
        """This rank's rows of the global batch ``rows`` and the loss over their embeddings.

        The losses of all ranks add up to the loss of the whole batch in one process.
        """
        n = len(rows)
        start, stop = self.shard(n)
        local = list(rows[start:stop])
        share = len(local) / n
        if not batch_loss(config.loss).cross_row or self.gather == "none":
            # No cross-row terms to gather (margin_mse) or none wanted: a weighted local loss.
            base = make_loss_fn(config, local, health) if local else None

            def local_loss(emb: list[torch.Tensor]) -> torch.Tensor:
                if base is None:  # no rows here: a zero that still has a backward
                    return torch.zeros((), device=emb[0].device, requires_grad=True)
                return base(emb) * share

            return local, local_loss
        # Every rank knows the whole batch: its false-negative mask needs no communication,
        # and its candidate order (positives, then negatives, by row) is the gathered order.
        return local, make_loss_fn(config, rows, health, share=_GatheredShare(self, config, rows))

    def sync(self, model: torch.nn.Module, loss: float, real_tokens: int, padded_tokens: int):
        """The step's one all-reduce: gradients, loss and token counts summed over ranks."""
        params = [p for p in model.parameters() if p.requires_grad]
        loss, real, padded = all_reduce_gradients(params, [loss, real_tokens, padded_tokens])
        return loss, int(round(real)), int(round(padded))

    def barrier(self) -> None:
        dist.barrier()

    def take_comm_stats(self) -> dict:
        return _STATS.take()
