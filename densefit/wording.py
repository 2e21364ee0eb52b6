"""How messages word counts and memory plans: what every layer's summaries use (stdlib
only)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["plan_words", "plural"]


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 step``, ``2 steps``, ``1,024 rows``: a count with its noun.

    >>> plural(1, "step"), plural(2048, "row"), plural(2, "query", "queries")
    ('1 step', '2,048 rows', '2 queries')
    """
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def plan_words(plan: Mapping) -> str:
    """A memory plan (``MemoryPlan.to_dict()``, as a run records it) in a few words, as
    ``densefit train`` and ``densefit run`` print it: what is not set is not said.

    >>> plan_words({"strategy": "cache", "chunk_size": None, "token_budget": 512})
    'cache (512 tokens per chunk, 1 kept graph)'
    >>> plan_words({"strategy": "plain", "chunk_size": 16, "cpu_allocator": "mimalloc"})
    'plain (chunk 16, mimalloc malloc)'
    """
    parts = []
    if plan.get("chunk_size") is not None:
        parts.append(f"chunk {plan['chunk_size']}")
    if plan.get("token_budget") is not None:
        parts.append(f"{plural(plan['token_budget'], 'token')} per chunk")
    if str(plan.get("strategy")).startswith("cache"):
        kept = plan.get("keep_graphs")
        parts.append(plural(1 if kept is None else kept, "kept graph"))
    if plan.get("cpu_allocator"):
        parts.append(f"{plan['cpu_allocator']} malloc")
    return str(plan.get("strategy")) + (f" ({', '.join(parts)})" if parts else "")
