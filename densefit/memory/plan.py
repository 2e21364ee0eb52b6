"""The memory plan: one frozen, serialisable record of how a run calls the encoder.

A :class:`MemoryPlan` is made once per run, by the user's options or by the planner
(:func:`densefit.memory.planner.plan_for_run`), saved in every checkpoint, broadcast by rank
0 under torchrun, and turned into a strategy by the one builder,
:func:`densefit.memory.strategies.make_strategy`. After an out-of-memory error the step asks
for :meth:`MemoryPlan.halved` and builds a new strategy from it: nothing mutates.

>>> plan = MemoryPlan("cache", chunk_size=8, keep_graphs=2)
>>> MemoryPlan.from_dict(plan.to_dict()) == plan
True
>>> plan.halved().keep_graphs, plan.halved().oom_retries
(1, 1)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from densefit.choices import MEMORY_STRATEGIES
from densefit.memory.process import ProcessBaseline

__all__ = ["MemoryPlan"]

# The smallest token budget an out-of-memory halving goes down to.
MIN_TOKEN_BUDGET = 16


@dataclass(frozen=True)
class MemoryPlan:
    """How a run embeds its batches, and (when planned) the numbers behind the choice.

    The first seven fields decide what runs (the strategy is built from them alone); the
    rest are the planner's report (empty for a user's choice).
    """

    strategy: str  # plain | checkpoint | cache | cache+checkpoint
    chunk_size: int | None = None  # rows per chunk (None: capped by tokens only)
    token_budget: int | None = None  # padded tokens per chunk
    keep_graphs: int = 1  # cache: last chunks whose first-pass graphs are kept
    sort_by_length: bool = True
    loss_block_size: int | None = None  # anchors per block of the score matrix (None: auto)
    oom_retries: int = 0  # halvings after out-of-memory errors
    chosen_by: str = "user"  # user | planner
    batch_size: int | None = None  # the batch planned for (one device's share under torchrun)
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    static_bytes: int | None = None  # parameters, gradients, AdamW moments
    fits: bool = True
    reason: str = ""
    lengths: dict = field(default_factory=dict)  # token lengths per column the planner measured
    candidates: list[dict] = field(default_factory=list)  # every strategy weighed (the table)
    process: dict = field(default_factory=dict)  # densefit.memory.process.ProcessBaseline

    def __post_init__(self) -> None:
        if self.strategy not in MEMORY_STRATEGIES:
            raise ValueError(
                f"unknown memory strategy {self.strategy!r}: choose one of "
                f"{', '.join(MEMORY_STRATEGIES)} or auto"
            )
        if self.keep_graphs < 0:
            raise ValueError(f"keep_graphs must be >= 0, got {self.keep_graphs}")

    @property
    def cached(self) -> bool:
        """The gradient cache (with or without checkpointing)."""
        return self.strategy.startswith("cache")

    @property
    def checkpointed(self) -> bool:
        """Gradient checkpointing inside the transformer."""
        return self.strategy in ("checkpoint", "cache+checkpoint")

    def to_dict(self) -> dict:
        """Plain JSON-ready values (lists and dicts copied)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MemoryPlan:
        """The plan :meth:`to_dict` returned; unknown keys are an error (a format drift).
        ``loss_chunk_size`` (the block's earlier name, in older checkpoints) is read too."""
        if "loss_chunk_size" in data:
            data = {**data, "loss_block_size": data["loss_chunk_size"]}
            del data["loss_chunk_size"]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown memory plan fields: {', '.join(unknown)}")
        return cls(**data)

    def halved(self) -> MemoryPlan | None:
        """The plan to redo a step with after an out-of-memory error; None: cannot shrink.

        The cache first keeps half as many graphs, then any plan halves its token budget
        (down to 16 tokens), then its rows per chunk (down to 1).
        """
        if self.cached and self.keep_graphs > 1:
            change = {"keep_graphs": self.keep_graphs // 2}
        elif self.token_budget is not None and self.token_budget > MIN_TOKEN_BUDGET:
            change = {"token_budget": self.token_budget // 2}
        elif self.chunk_size is not None and self.chunk_size > 1:
            change = {"chunk_size": max(1, self.chunk_size // 2)}
        else:
            return None
        return dataclasses.replace(self, oom_retries=self.oom_retries + 1, **change)

    def summary(self) -> str:
        """One line: strategy, chunk, token budget, kept graphs.

        >>> MemoryPlan("cache", token_budget=512, keep_graphs=2).summary()
        'cache, chunk -, 512 tokens, 2 kept graph(s)'
        """
        kept = f", {self.keep_graphs} kept graph(s)" if self.cached else ""
        return (
            f"{self.strategy}, chunk {self.chunk_size or '-'}, "
            f"{self.token_budget or '-'} tokens{kept}"
        )

    def table(self) -> str:
        """The planner's candidates, one per line, and its choice (for ``densefit plan``)."""
        gib = 2**30
        head = f"batch size {self.batch_size}, budget {(self.budget_bytes or 0) / gib:.2f} GiB"
        if self.process:
            head += f" for the whole process; {ProcessBaseline.from_dict(self.process).describe()}"
        lines = [
            head,
            f"{'strategy':<18}{'chunk':>8}{'tokens/chunk':>14}{'kept':>6}{'peak GiB':>10}"
            f"{'rel. time':>11}  fits",
        ]
        for c in self.candidates:
            lines.append(
                f"{c['strategy']:<18}{str(c['chunk_size'] or '-'):>8}"
                f"{str(c['token_budget'] or '-'):>14}{str(c.get('keep_graphs') or '-'):>6}"
                f"{c['peak_bytes'] / gib:>10.2f}{c.get('relative_time', 0):>11.2f}  "
                f"{'yes' if c['fits'] else 'no'}"
            )
        chosen = next((c for c in self.candidates if c["strategy"] == self.strategy), {})
        rows = chosen.get("chunk_size", self.chunk_size)
        kept = f", {self.keep_graphs} graph(s) kept" if self.cached else ""
        lines.append(
            f"-> {self.strategy}"
            + (f", chunk {rows} rows / {self.token_budget} tokens{kept}" if rows else "")
            + f", predicted peak {(self.predicted_peak_bytes or 0) / gib:.2f} GiB: {self.reason}"
        )
        return "\n".join(lines)
