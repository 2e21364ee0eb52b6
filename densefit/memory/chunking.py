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

from densefit.memory.allocator import trim

__all__ = ["Chunk", "tokenize", "make_chunks", "group_rows", "padding_efficiency"]


@dataclass
class Chunk:
    """Rows ``index`` of a column, as model features padded to the chunk's longest text."""

    index: torch.Tensor  # (c,) positions of these rows in the column
    features: dict
    real_tokens: int
    padded_tokens: int

    def __len__(self) -> int:
        return int(self.index.numel())


# Texts tokenised per call: the tokenizer's per-text encodings (full tokenisation before
# truncation, offsets, tokens) exist until the call's tensors are extracted; slices bound
# that transient to one slice's worth.
TOKENIZE_SLICE = 256


def tokenize(
    model: SentenceTransformer, texts: list[str], *, slice_size: int = TOKENIZE_SLICE
) -> dict:
    """Tokenise ``texts`` once with the model's own preprocessing (truncation included).

    Long columns are tokenised ``slice_size`` texts at a time and padded to the longest
    text of all of them: the same tensors as one call, without its O(column) peak.
    """
    tokenizer = getattr(model, "tokenizer", None)
    if len(texts) <= slice_size or getattr(tokenizer, "pad_token_id", None) is None:
        features = _tensors_only(model.preprocess(texts))
    else:
        parts = [
            _tensors_only(model.preprocess(texts[i : i + slice_size]))
            for i in range(0, len(texts), slice_size)
        ]
        features = _merge(parts, tokenizer)
    if "attention_mask" not in features:
        raise TypeError(
            "densefit needs a text model whose preprocessing returns an attention_mask "
            f"(got keys {sorted(features)})"
        )
    return features


def _tensors_only(features) -> dict:
    """A plain dict of the features, without the tokenizer's per-text encodings.

    A fast tokenizer's BatchEncoding keeps one Rust ``Encoding`` per text, holding the
    text's whole tokenisation (tokens, offsets, the overflow past the truncation), alive for
    as long as the features are (the whole training step): O(batch) memory, measured in
    README "What these runs showed" (the scaling points of bench/results/memory_speed.md).
    Only the tensors are needed; the rest is freed and trimmed now.
    """
    out = dict(features)
    del features
    trim()
    return out


def _merge(parts: list[dict], tokenizer) -> dict:
    """Concatenate tokenised slices, padding each to the longest, as one call would have."""
    width = max(p["attention_mask"].shape[1] for p in parts)
    pad_value = {
        "input_ids": tokenizer.pad_token_id,
        "token_type_ids": getattr(tokenizer, "pad_token_type_id", 0),
    }
    left = getattr(tokenizer, "padding_side", "right") == "left"
    out = {}
    for key, value in parts[0].items():
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                out[key] = torch.cat([p[key] for p in parts])
            else:
                out[key] = value  # per-batch values (e.g. the modality) are the same
            continue
        padded = []
        for p in parts:
            t = p[key]
            missing = width - t.shape[1]
            if missing:
                fill = t.new_full((t.shape[0], missing), pad_value.get(key, 0))
                t = torch.cat([fill, t] if left else [t, fill], dim=1)
            padded.append(t)
        out[key] = torch.cat(padded)
    return out


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


def group_rows(
    lengths: list[int],
    *,
    chunk_size: int | None = None,
    token_budget: int | None = None,
    sort_by_length: bool = True,
    min_efficiency: float | None = 0.8,
    min_rows: int = 4,
) -> list[list[int]]:
    """Row indices of each chunk, from token lengths alone (see :func:`make_chunks`).

    The planner calls this too, so it predicts exactly the chunks training will run.

    >>> group_rows([5, 50, 6, 48], chunk_size=2)
    [[0, 2], [3, 1]]
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = len(lengths)
    if sort_by_length:
        order = sorted(range(n), key=lengths.__getitem__)  # stable
    else:
        order, min_efficiency = list(range(n)), None  # unsorted rows: only the caps apply
    groups: list[list[int]] = []
    start = 0
    while start < n:
        end, longest, real = start, 0, 0
        while end < n:
            length = lengths[order[end]]
            longest_next, rows = max(longest, length), end - start + 1
            if end > start:
                over_rows = chunk_size is not None and rows > chunk_size
                over_budget = token_budget is not None and rows * longest_next > token_budget
                wasteful = (
                    min_efficiency is not None
                    and rows > min_rows
                    and (real + length) < min_efficiency * rows * longest_next
                )
                if over_rows or over_budget or wasteful:
                    break
            longest, real, end = longest_next, real + length, end + 1
        groups.append(order[start:end])
        start = end
    return groups


def make_chunks(
    features: dict,
    *,
    chunk_size: int | None = None,
    token_budget: int | None = None,
    sort_by_length: bool = True,
    min_efficiency: float | None = 0.8,
    min_rows: int = 4,
) -> list[Chunk]:
    """Split a tokenised column into chunks.

    ``chunk_size`` caps rows per chunk; ``token_budget`` caps padded tokens per chunk
    (rows x longest text), so a chunk of long texts never exceeds what was planned. With
    neither, the whole column is one chunk. With ``sort_by_length`` rows are sorted by
    token length (stable, so chunking is deterministic) and a chunk is also closed early
    once it holds ``min_rows`` rows and the next, longer row would drop its padding
    efficiency (real / padded tokens) under ``min_efficiency``: smaller chunks never need
    more memory than planned, and heavy-tailed data stops paying for padding.

    >>> from densefit.testing import tiny_model
    >>> m = tiny_model()
    >>> f = tokenize(m, ["a", "the cell", "a b c d e f g h"])
    >>> [len(c) for c in make_chunks(f, chunk_size=2)]
    [2, 1]
    """
    mask = features["attention_mask"]
    n = mask.shape[0]
    lengths = mask.sum(dim=1)  # (n,)
    groups = [
        torch.tensor(g, dtype=torch.long, device=mask.device)
        for g in group_rows(
            lengths.tolist(),
            chunk_size=chunk_size,
            token_budget=token_budget,
            sort_by_length=sort_by_length,
            min_efficiency=min_efficiency,
            min_rows=min_rows,
        )
    ]
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
