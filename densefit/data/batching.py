"""Batching: which rows each optimizer step of a run trains on, decided in one place.

Every epoch is a seeded permutation of the rows cut into micro-batches (:func:`batches`),
optionally rearranged so no batch holds the same text twice (:func:`no_duplicate_batches`);
:func:`step_groups` walks the optimizer steps (``gradient_accumulation_steps`` micro-batches
each) from any position, for the training loop, a resume, and the planner
(:func:`planned_batches`). The order depends only on the seed, so it is known in advance.

Several sources (:class:`~densefit.data.sources.TrainingData`) with ``source_batches="same"``
(the default): every optimizer step takes its rows from one source. Each source is its own
stream of steps (its rows permuted, seeded per source and pass, cut into micro-batches and
grouped into steps, never across two passes), and :func:`source_schedule` decides which
source each step of an epoch comes from: ``proportional`` (each source's steps, one pass
of it, spread at random over the epoch), ``round_robin`` (one step of each source in turn
until the smallest has given one pass; the larger ones go on where they stopped in the next
epoch) or ``temperature`` (each step's source drawn with probability proportional to
``rows ** (1 / source_temperature)``; the epoch as long as a proportional one). Every rank
of a multi-process run computes the same schedule, so every rank trains on the same source
in a step. ``source_batches="mixed"`` shuffles the rows of all sources together.

:func:`no_duplicate_batches` takes the plain seeded batches of :func:`batches` and moves rows between them so that, where the data allows
it, no text (query, positive or hard negative) appears in two rows of one batch. The batch
count and sizes never change (every rank of a distributed run gets the same count), every
row is used exactly once per epoch, and the work is O(rows x texts per row): texts are
hashed, each batch looks at a bounded number of deferred rows, and the swaps that place
the last leftovers have a fixed budget per row.

A duplicate in a batch is also handled by the loss (:mod:`densefit.losses.masking` masks it), so
this sampler is an optimisation: every batch keeps its full number of distinct negatives.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from hashlib import blake2b

import torch

from densefit.config.train import TrainConfig
from densefit.data.sources import TrainingData
from densefit.data.types import TrainingExample

__all__ = [
    "StepGroup",
    "batches",
    "columns_of",
    "effective_batch_size",
    "epoch_batches",
    "epoch_steps",
    "no_duplicate_batches",
    "planned_batches",
    "row_keys",
    "same_source_batches",
    "source_bounds",
    "source_schedule",
    "step_groups",
    "steps_per_epoch",
    "total_steps",
]

# Deferred rows each batch re-examines before taking new ones, as a multiple of its size:
# bounds the work per batch (O(n) overall) even when the data is full of duplicates.
_DEFERRED_LOOKS = 2
# Leftover rows may be swapped into one of the last _SWAP_BATCHES batches; the rows looked
# at for swaps are capped at _SWAP_WORK per row of the epoch (O(n) overall).
_SWAP_BATCHES = 16
_SWAP_WORK = 4


def batches(
    n: int, batch_size: int, *, seed: int, epoch: int, drop_last: bool = False
) -> list[list[int]]:
    """The row indices of each batch of one epoch: a seeded permutation cut into batches.

    >>> batches(5, 2, seed=0, epoch=0)
    [[4, 0], [1, 3], [2]]
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=generator).tolist()
    out = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if drop_last and out and len(out[-1]) < batch_size:
        out.pop()
    return out


def _micro_batch_size(config: TrainConfig) -> int:
    return config.batch_size // config.gradient_accumulation_steps or 1


def epoch_batches(
    examples: Sequence[TrainingExample], config: TrainConfig, epoch: int
) -> list[list[int]]:
    """Row indices of each micro-batch of one epoch: seeded, then de-duplicated if asked."""
    out = batches(
        len(examples),
        _micro_batch_size(config),
        seed=config.seed,
        epoch=epoch,
        drop_last=config.drop_last,
    )
    if config.no_duplicates:  # same batch count and sizes, texts unique per batch
        out = no_duplicate_batches(examples, out)
    return out


def source_bounds(examples: Sequence[TrainingExample]) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each source: a :class:`TrainingData`'s, else one source.

    >>> source_bounds([None] * 3)
    [(0, 3)]
    """
    if isinstance(examples, TrainingData):
        return [(s.start, s.rows) for s in examples.sources]
    return [(0, len(examples))]


def same_source_batches(examples: Sequence[TrainingExample], config: TrainConfig) -> bool:
    """Several sources, each step's rows from one of them (``source_batches="same"``)."""
    return config.source_batches == "same" and len(source_bounds(examples)) > 1


def _micro_batches_of(rows: int, micro: int, drop_last: bool) -> int:
    return rows // micro if drop_last else -(-rows // micro)


def _steps_per_pass(rows: int, config: TrainConfig) -> int:
    """Optimizer steps one pass over a source of ``rows`` rows gives (steps stay in a pass)."""
    micro = _micro_batches_of(rows, _micro_batch_size(config), config.drop_last)
    return math.ceil(micro / config.gradient_accumulation_steps)


def _seed_of(*parts: object) -> int:
    """A generator seed from ``parts`` (the run's seed, a source, a pass...): the same in
    every process (not Python's salted ``hash``)."""
    digest = blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")  # 32 bits: batches() multiplies it by ~1e6


def source_schedule(
    rows: Sequence[int], steps: Sequence[int], config: TrainConfig, epoch: int
) -> list[int]:
    """The source of each optimizer step of ``epoch``: sources ``rows`` rows and ``steps``
    steps a pass each, interleaved as ``config.source_sampling`` says (seeded by
    ``config.seed`` and ``epoch``; sources without a step are left out).

    >>> config = TrainConfig(source_sampling="round_robin")
    >>> source_schedule([10, 4], [5, 2], config, 0)
    [0, 1, 0, 1]
    >>> sorted(source_schedule([10, 4], [5, 2], TrainConfig(), 0))  # proportional
    [0, 0, 0, 0, 0, 1, 1]
    """
    active = [s for s in range(len(steps)) if steps[s] > 0]
    if not active:
        return []
    generator = torch.Generator().manual_seed(_seed_of("schedule", config.seed, epoch))
    if config.source_sampling == "round_robin":
        turns = min(steps[s] for s in active)
        return [s for _ in range(turns) for s in active]
    if config.source_sampling == "temperature":
        weights = torch.tensor(
            [rows[s] ** (1 / config.source_temperature) for s in active], dtype=torch.float64
        )
        total = sum(steps[s] for s in active)
        drawn = torch.multinomial(weights, total, replacement=True, generator=generator)
        return [active[d] for d in drawn.tolist()]
    ids = [s for s in active for _ in range(steps[s])]  # proportional: one pass of each
    return [ids[i] for i in torch.randperm(len(ids), generator=generator).tolist()]


class _SourceStream:
    """One source's optimizer steps, pass after pass: each pass a seeded permutation of its
    rows cut into micro-batches (de-duplicated if asked) and grouped into steps."""

    def __init__(self, examples, config: TrainConfig, index: int, start: int, rows: int):
        self.examples, self.config = examples, config
        self.index, self.start, self.rows = index, start, rows
        self.per_pass = _steps_per_pass(rows, config)
        self._passes: dict[int, list[list[list[int]]]] = {}

    def step(self, position: int) -> list[list[int]]:
        """The micro-batches of this source's step number ``position`` (from 0)."""
        done, at = divmod(position, self.per_pass)
        if done not in self._passes:
            config = self.config
            micro = batches(
                self.rows,
                _micro_batch_size(config),
                seed=_seed_of("source", config.seed, self.index),
                epoch=done,
                drop_last=config.drop_last,
            )
            micro = [[self.start + i for i in b] for b in micro]
            if config.no_duplicates:
                micro = no_duplicate_batches(self.examples, micro)
            accumulate = config.gradient_accumulation_steps
            self._passes = {
                done: [micro[i : i + accumulate] for i in range(0, len(micro), accumulate)]
            }
        return self._passes[done][at]


def epoch_steps(
    examples: Sequence[TrainingExample], config: TrainConfig, epoch: int
) -> list[tuple[int | None, list[list[int]]]]:
    """``(source, micro-batches)`` of every optimizer step of ``epoch``, in order.

    ``source`` is the index of the source all rows of the step come from (0 with one source,
    None for mixed batches of several sources).

    >>> epoch_steps([None] * 5, TrainConfig(batch_size=2), 0)
    [(0, [[3, 0]]), (0, [[1, 2]]), (0, [[4]])]
    """
    bounds = source_bounds(examples)
    if not same_source_batches(examples, config):
        micro = epoch_batches(examples, config, epoch)
        accumulate = config.gradient_accumulation_steps
        source = 0 if len(bounds) == 1 else None
        return [(source, micro[i : i + accumulate]) for i in range(0, len(micro), accumulate)]
    streams = [_SourceStream(examples, config, k, *b) for k, b in enumerate(bounds)]
    rows, steps = [s.rows for s in streams], [s.per_pass for s in streams]
    used = Counter()  # each source's steps taken by the epochs before this one
    if config.source_sampling != "proportional":  # (proportional: one pass per epoch)
        for earlier in range(epoch):
            used.update(source_schedule(rows, steps, config, earlier))
    else:
        used.update({k: epoch * n for k, n in enumerate(steps)})
    out = []
    for source in source_schedule(rows, steps, config, epoch):
        out.append((source, streams[source].step(used[source])))
        used[source] += 1
    return out


def steps_per_epoch(examples: Sequence[TrainingExample], config: TrainConfig) -> int:
    """Optimizer steps in one epoch (de-duplication keeps the batch count: not run here).

    >>> steps_per_epoch([None] * 10, TrainConfig(batch_size=4))
    3
    """
    if same_source_batches(examples, config):
        rows = [n for _, n in source_bounds(examples)]
        steps = [_steps_per_pass(n, config) for n in rows]
        active = [n for n in steps if n]
        if config.source_sampling == "round_robin":
            return min(active, default=0) * len(active)
        return sum(active)
    micro = _micro_batches_of(len(examples), _micro_batch_size(config), config.drop_last)
    return math.ceil(micro / config.gradient_accumulation_steps)


def total_steps(examples: Sequence[TrainingExample], config: TrainConfig) -> int:
    """Optimizer steps of the whole run: ``max_steps``, else every epoch's."""
    return config.max_steps or steps_per_epoch(examples, config) * config.epochs


def effective_batch_size(examples: Sequence[TrainingExample], config: TrainConfig) -> int:
    """The most rows an optimizer step of this run has: ``batch_size``, or fewer when the
    data (with same-source batches: the largest source) has fewer rows. ``learning_rate``
    ``auto`` follows it.

    >>> effective_batch_size([None] * 64, TrainConfig(batch_size=1_000_000_000))
    64
    """
    rows = [n for _, n in source_bounds(examples)]
    most = max(rows) if same_source_batches(examples, config) else sum(rows)
    return max(1, min(config.batch_size, most))


@dataclass(frozen=True)
class StepGroup:
    """The micro-batches of one optimizer step, and where the step after it starts."""

    epoch: int
    micro_batches: list[list[int]]  # row indices of each micro-batch
    next_epoch: int  # the data position after this step (what a checkpoint saves)
    next_batch: int
    source: int | None = 0  # the source of every row (None: mixed batches of several)

    @property
    def epoch_end(self) -> bool:
        """The last step of its epoch."""
        return self.next_epoch > self.epoch

    @property
    def rows(self) -> list[int]:
        return [i for b in self.micro_batches for i in b]


def step_groups(
    examples: Sequence[TrainingExample], config: TrainConfig, *, epoch: int = 0, batch: int = 0
) -> Iterator[StepGroup]:
    """Every optimizer step from micro-batch ``batch`` of ``epoch`` on, epoch after epoch,
    without end (the caller stops after its steps); nothing when an epoch has no batch.

    >>> from itertools import islice
    >>> steps = islice(step_groups([None] * 5, TrainConfig(batch_size=2, seed=0)), 4)
    >>> [(g.epoch, g.micro_batches, g.next_epoch, g.next_batch) for g in steps][1:]
    [(0, [[1, 3]], 0, 2), (0, [[2]], 1, 0), (1, [[0, 4]], 1, 1)]
    """
    while True:
        steps = epoch_steps(examples, config, epoch)
        if not steps:
            return
        at = 0  # the micro-batch a step starts at: the data position a checkpoint holds
        for k, (source, micro) in enumerate(steps):
            after = at + len(micro)
            if at >= batch:
                done = k == len(steps) - 1
                yield StepGroup(
                    epoch, micro, epoch + 1 if done else epoch, 0 if done else after, source
                )
            at = after
        epoch, batch = epoch + 1, 0


def planned_batches(examples: Sequence[TrainingExample], config: TrainConfig) -> list[list[int]]:
    """Row indices of every forward-backward (micro-batch) the run will do, in order."""
    out: list[list[int]] = []
    steps = total_steps(examples, config)
    for _, group in zip(range(steps), step_groups(examples, config)):
        out += group.micro_batches
    return out


def columns_of(rows: Sequence[TrainingExample]) -> list[list[str]]:
    """Text columns of a batch: anchors, positives, then all hard negatives flattened."""
    return [
        [r.query for r in rows],
        [r.positive for r in rows],
        [n for r in rows for n in r.negatives],
    ]


def row_keys(row: TrainingExample) -> frozenset[bytes]:
    """Stable hashes of every text of a row (query, positive, negatives).

    blake2b rather than ``hash()``: Python salts string hashes per process, and every rank
    of a distributed run must build the same batches.
    """
    texts = (row.query, row.positive, *row.negatives)
    return frozenset(
        blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8).digest() for t in texts
    )


def no_duplicate_batches(
    examples: Sequence[TrainingExample], batches: Sequence[Sequence[int]]
) -> list[list[int]]:
    """The rows of ``batches`` regrouped, same sizes in the same order, avoiding duplicates.

    Rows are taken in the order of ``batches`` (the seeded shuffle). A row sharing a text
    with the batch being filled is deferred to a later batch; each batch first retries the
    deferred rows. Once every row has been dealt, a leftover row that still conflicts is
    swapped into one of the last few batches for a row of it that does not conflict. Where
    no duplicate-free choice is left (data that is mostly one text), the remaining rows fill
    the batches anyway: sizes and coverage are never traded for uniqueness.

    Example:
        >>> rows = [TrainingExample(q, p) for q, p in [("a", "x"), ("a", "y"), ("b", "z"), ("c", "w")]]
        >>> no_duplicate_batches(rows, [[0, 1], [2, 3]])  # rows 0 and 1 share the query "a"
        [[0, 2], [1, 3]]
    """
    n = sum(len(b) for b in batches)
    stream = (i for b in batches for i in b)
    keys = _Keys(examples)
    deferred: deque[int] = deque()
    recent: deque[tuple[list[int], Counter]] = deque()  # the last batches, for swaps
    swap_budget = [_SWAP_WORK * n]
    out: list[list[int]] = []
    for size in (len(b) for b in batches):
        batch: list[int] = []
        seen: set[bytes] = set()
        _retry_deferred(deferred, batch, seen, size, keys)
        while len(batch) < size:
            i = next(stream, None)
            if i is None:
                break
            if seen.isdisjoint(keys[i]):
                batch.append(i)
                seen.update(keys[i])
            else:
                deferred.append(i)
        if len(batch) < size:  # every row is dealt: retry, swap, then accept duplicates
            _retry_deferred(deferred, batch, seen, size, keys)
            while len(batch) < size:
                i = deferred.popleft()
                if not _swap_in(i, batch, seen, recent, keys, swap_budget):
                    batch.append(i)
                    seen.update(keys[i])
        out.append(batch)
        recent.append((batch, Counter(h for i in batch for h in keys[i])))
        if len(recent) > _SWAP_BATCHES:
            keys.forget(recent.popleft()[0])
    return out


class _Keys(dict):
    """Row index -> its text hashes, computed on first use, dropped when no longer needed."""

    def __init__(self, examples: Sequence[TrainingExample]):
        super().__init__()
        self.examples = examples

    def __missing__(self, i: int) -> frozenset[bytes]:
        self[i] = row_keys(self.examples[i])
        return self[i]

    def forget(self, rows: list[int]) -> None:
        for i in rows:
            self.pop(i, None)


def _retry_deferred(
    deferred: deque[int], batch: list[int], seen: set[bytes], size: int, keys: _Keys
) -> None:
    """Move deferred rows that fit into ``batch``, looking at a bounded number of them."""
    for _ in range(min(len(deferred), _DEFERRED_LOOKS * size)):
        if len(batch) == size:
            return
        i = deferred.popleft()
        if seen.isdisjoint(keys[i]):
            batch.append(i)
            seen.update(keys[i])
        else:
            deferred.append(i)


def _swap_in(row, batch, seen, recent, keys, budget) -> bool:
    """Put ``row`` into a recent batch in exchange for one of its rows that fits ``batch``."""
    mine = keys[row]
    for earlier, counts in reversed(recent):
        budget[0] -= 1
        if budget[0] < 0:
            return False
        clashes = {h for h in mine if counts[h]}
        if any(counts[h] > 1 for h in clashes):
            continue  # two rows there hold the text: one swap cannot free it
        for position, other in enumerate(earlier):
            budget[0] -= 1
            if budget[0] < 0:
                return False
            theirs = keys[other]
            if clashes <= theirs and seen.isdisjoint(theirs):
                earlier[position] = row
                counts.subtract(theirs)
                counts.update(mine)
                batch.append(other)
                seen.update(theirs)
                return True
    return False
