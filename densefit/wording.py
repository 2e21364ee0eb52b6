"""How messages word counts: one function every layer's summaries use (stdlib only)."""

from __future__ import annotations

__all__ = ["plural"]


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 step``, ``2 steps``, ``1,024 rows``: a count with its noun.

    >>> plural(1, "step"), plural(2048, "row"), plural(2, "query", "queries")
    ('1 step', '2,048 rows', '2 queries')
    """
    return f"{n:,} {word if n == 1 else (many or word + 's')}"
