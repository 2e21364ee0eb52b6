"""Batch size independent of memory: chunking, gradient cache, checkpointing, the planner."""

from densefit.memory.chunking import Chunk, make_chunks, padding_efficiency, tokenize
from densefit.memory.strategies import (
    STRATEGIES,
    CachedStrategy,
    MemoryStrategy,
    PlainStrategy,
    StepStats,
    make_strategy,
)

__all__ = [
    "STRATEGIES",
    "CachedStrategy",
    "Chunk",
    "MemoryStrategy",
    "PlainStrategy",
    "StepStats",
    "make_chunks",
    "make_strategy",
    "padding_efficiency",
    "tokenize",
]
