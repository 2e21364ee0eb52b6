"""Tokenise a column once, then cut it into length-sorted chunks padded to their own longest text.

Padding is waste: a chunk of short texts padded to the batch's longest text spends most of
its compute (and activation memory) on pad tokens. Sorting a column by token length and
trimming each chunk's padding keeps results identical (attention masks hide the padding;
the loss is over the whole batch, so regrouping rows changes nothing) and saves that waste.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sentence_transformers import SentenceTransformer

__all__ = ["Chunk", "tokenize", "make_chunks", "padding_efficiency"]


@dataclass
class Chunk:
    """Rows ``index`` of a column, as model features padded to the chunk's longest text."""

    index: torch.Tensor  # (c,) positions of these rows in the column
    features: dict
    real_tokens: int
    padded_tokens: int

    def __len__(self) -> int:
        return int(self.index.numel())


def tokenize(model: SentenceTransformer, texts: list[str]) -> dict:
    """Tokenise ``texts`` once with the model's own preprocessing (truncation included)."""
    features = model.preprocess(texts)
    if "attention_mask" not in features:
        raise TypeError(
            "densefit needs a text model whose preprocessing returns an attention_mask "
            f"(got keys {sorted(features)})"
        )
    return features


def _select(features: dict, rows: torch.Tensor, n: int) -> dict:
    """Rows ``rows`` of every per-row tensor, trimmed to the columns any of them uses."""
    mask = features["attention_mask"][rows]
    keep = mask.any(dim=0)  # works for right and left padding alike
    if bool(keep.all()):
        keep = None
    out = {}
    for key, value in features.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n:
            value = value[rows]
            if keep is not None and value.dim() >= 2 and value.shape[1] == keep.numel():
                value = value[:, keep]
        out[key] = value
    return out


def make_chunks(
    features: dict,
    *,
    chunk_size: int | None = None,
    token_budget: int | None = None,
    sort_by_length: bool = True,
) -> list[Chunk]:
    """Split a tokenised column into chunks.

    ``chunk_size`` caps rows per chunk; ``token_budget`` caps padded tokens per chunk
    (rows x longest text), so a chunk of long texts never exceeds what was planned. With
    neither, the whole column is one chunk. Sorting is stable, so equal lengths keep their
    order and chunking is deterministic.

    >>> from densefit.testing import tiny_model
    >>> m = tiny_model()
    >>> f = tokenize(m, ["a", "the cell", "a b c d e f g h"])
    >>> [len(c) for c in make_chunks(f, chunk_size=2)]
    [2, 1]
    """
    mask = features["attention_mask"]
    n = mask.shape[0]
    lengths = mask.sum(dim=1)  # (n,)
    order = (
        torch.sort(lengths, stable=True).indices if sort_by_length else torch.arange(n)
    )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    groups: list[torch.Tensor] = []
    if token_budget is None:
        size = chunk_size or n
        groups = list(order.split(size))
    else:
        # Greedy over length-sorted rows: a chunk's cost is rows x its longest row.
        start = 0
        sorted_len = lengths[order].tolist()
        while start < n:
            end, longest = start, 0
            while end < n:
                longest_next = max(longest, sorted_len[end])
                rows = end - start + 1
                over_budget = rows * longest_next > token_budget
                over_rows = chunk_size is not None and rows > chunk_size
                if end > start and (over_budget or over_rows):
                    break
                longest, end = longest_next, end + 1
            groups.append(order[start:end])
            start = end
    chunks = []
    for rows in groups:
        sub = _select(features, rows, n)
        real = int(lengths[rows].sum())
        chunks.append(Chunk(rows, sub, real, int(sub["attention_mask"].numel())))
    return chunks


def padding_efficiency(chunks: list[Chunk]) -> float:
    """Real tokens / processed tokens over ``chunks`` (1.0 = no padding at all)."""
    processed = sum(c.padded_tokens for c in chunks)
    return sum(c.real_tokens for c in chunks) / processed if processed else 1.0
