"""Batch size independent of memory: chunking, gradient cache, checkpointing, the planner."""

from __future__ import annotations

from densefit._lazy import lazy_exports

_EXPORTS = {
    "Chunk": "densefit.memory.chunking",
    "make_chunks": "densefit.memory.chunking",
    "padding_efficiency": "densefit.memory.chunking",
    "tokenize": "densefit.memory.chunking",
    "MemoryPlan": "densefit.memory.plan",
    "CachedStrategy": "densefit.memory.strategies",
    "MemoryStrategy": "densefit.memory.strategies",
    "PlainStrategy": "densefit.memory.strategies",
    "StepStats": "densefit.memory.strategies",
    "fixed_plan": "densefit.memory.strategies",
    "make_strategy": "densefit.memory.strategies",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
