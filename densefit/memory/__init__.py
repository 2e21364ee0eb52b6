"""Batch size independent of memory: chunking, gradient cache, checkpointing, the planner."""

from densefit.memory.chunking import Chunk, make_chunks, padding_efficiency, tokenize
from densefit.memory.plan import STRATEGIES, MemoryPlan
from densefit.memory.strategies import (
    CachedStrategy,
    MemoryStrategy,
    PlainStrategy,
    StepStats,
    fixed_plan,
    make_strategy,
)

__all__ = [
    "STRATEGIES",
    "CachedStrategy",
    "Chunk",
    "MemoryPlan",
    "MemoryStrategy",
    "PlainStrategy",
    "StepStats",
    "fixed_plan",
    "make_chunks",
    "make_strategy",
    "padding_efficiency",
    "tokenize",
]
