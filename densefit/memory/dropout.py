"""Chunking-invariant dropout: a row's masks depend on the row, never on how it was batched.

Ordinary dropout draws its masks from the global random stream in the order the elements
are computed, so a row's mask depends on which chunk it landed in, its position there and
the chunk's padded width. Two runs that only chunk the batch differently (a plain chunk
of 16 or a cache chunk of 32, which the planner picks from the memory budget) then train on
different dropout draws, as if the seed had changed.

Here each mask element is a pure function of its coordinates::

    keep = hash(step key, site, column, row, token position(s), feature or head) / 2**32 >= p

- the **step key** is drawn once per forward-backward from torch's seeded CPU generator
  (:func:`step_key`), so a resumed run (which restores the RNG states) draws the same keys;
- the **site** numbers the model's modules (each dropout module, each attention module);
- **column** and **row** say which text it is (``Chunk.index``: the row's place in its column,
  so the anchor and the positive of one pair get different masks);
- **positions** count from the row's first real token, so padding (right or left) moves
  nothing.

The hash is ``lowbias32`` (Wellons' hash-prospector) on int32 tensors: a few vectorised
integer operations per element, about what drawing Bernoulli masks costs; a CPU training
step costs the same as with ordinary dropout (bench/results/dropout.json). The strategies pass the rows of each chunk through
:func:`dropout_rows` (in ``densefit.memory.strategies._embed``); gradient checkpointing
re-enters that context when it recomputes a layer, and the cache's second pass sees the same
rows, so plain, checkpointing and the cache at any chunk size or token budget compute the
same masks and give the same loss and gradients.

Attention-probability dropout happens inside the attention kernel (``F.scaled_dot_product_attention``
takes only a rate), so while this is on the model's attention runs through
:func:`invariant_attention`, registered with transformers' ``AttentionInterface``: eager
attention with the mask applied to the probabilities. It materialises the (rows, heads, L, L)
probabilities, as PyTorch's CPU attention does with dropout on (it saves fewer bytes for
backward than that: bench/results/dropout.json); on CUDA that is more memory than the fused
kernels need (not measured yet; the planner's probe runs this path). In eval mode, with dropout 0, or outside a strategy's
:func:`dropout_rows` context (e.g. another trainer), every module falls back to exactly
what it replaced, and nothing is stored in the model's weights or config:
:func:`disable_invariant_dropout` restores the original modules.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from densefit.models import transformer_of

__all__ = [
    "InvariantDropout",
    "enable_invariant_dropout",
    "disable_invariant_dropout",
    "is_invariant_dropout",
    "step_key",
    "dropout_rows",
    "invariant_attention",
]

# lowbias32 (https://github.com/skeeto/hash-prospector): xorshift-multiply, 3 shifts, 2 products.
_C1, _C2 = 0x21F0AAAD, 0x735A2D97
_GOLDEN = 0x9E3779B9  # odd step between consecutive coordinates before mixing
_FLAG = "_densefit_invariant_dropout"  # on the SentenceTransformer: the original attention
_SITE = "_densefit_dropout_site"  # on every module of the transformer: its index
_PREFIX = "densefit_invariant_"  # + the original attention implementation
_SUPPORTED = ("sdpa", "eager")


def _to_int32(value: int) -> int:
    """A 32-bit pattern as the signed int a torch.int32 holds."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _mix_int(value: int) -> int:
    """``lowbias32`` on a Python int (the reference the tensor version is checked against)."""
    x = value & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * _C1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * _C2) & 0xFFFFFFFF
    return x ^ (x >> 15)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` on an int32 tensor (products wrap; ``& mask`` makes shifts logical)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _to_int32(_C1)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _to_int32(_C2)
    return x ^ ((x >> 15) & 0x1FFFF)


def _seed(*parts: int) -> int:
    """One 32-bit value from several integers (as an int32 pattern)."""
    h = 0
    for part in parts:
        h = _mix_int(h ^ _mix_int(part))
    return _to_int32(h)


@dataclass(frozen=True)
class _Rows:
    """Who the rows of the chunk being embedded are."""

    key: int  # the step's key
    column: int
    rows: torch.Tensor | None  # (B,) int32: each row's place in its column; None: 0..B-1
    offsets: torch.Tensor | None  # (B,) int32: left padding of each row; None: no padding
    width: int | None  # padded length L of the chunk; None: that of the tensor


_CURRENT: contextvars.ContextVar[_Rows | None] = contextvars.ContextVar(
    "densefit_dropout_rows", default=None
)


def _keep_mask(rows: _Rows, site: int, shape: torch.Size, p: float, device) -> torch.Tensor:
    """Boolean keep mask for a (B, L, H) hidden state or (B, heads, L, L) attention probabilities.

    Element ``[b, ...]`` depends on (key, site, column, rows[b], positions counted from the
    row's first real token, feature or head) only.
    """
    B = shape[0]
    ids = torch.arange(B, device=device) if rows.rows is None else rows.rows.to(device)
    if B != ids.numel():
        raise RuntimeError(f"invariant dropout: {B} rows in the tensor, {ids.numel()} row ids")
    width = shape[-2] if rows.width is None else rows.width  # (B, L, H) or (B, h, L, L)
    g = _to_int32(_GOLDEN)
    off = 0 if rows.offsets is None else rows.offsets.to(device)[:, None]  # (B, 1)
    ids = ids.to(torch.int32)
    base = _mix(ids * g + _seed(rows.key, site, rows.column))  # (B,)
    threshold = _to_int32(min(int(p * 2**32), 2**32 - 1) - 2**31)  # P(x < threshold) = p
    if len(shape) == 3 and shape[1] == width:  # (B, L, H) hidden states
        pos = torch.arange(shape[1], dtype=torch.int32, device=device)[None, :] - off  # (B, L)
        token = _mix(base[:, None] + pos * g)  # (B, L)
        feature = _mix(
            torch.arange(shape[2], dtype=torch.int32, device=device) * g + _seed(rows.key, site, -1)
        )  # (H,)
        x = _mix(token[:, :, None] ^ feature)  # (B, L, H)
    elif len(shape) == 4 and shape[2] == shape[3] == width:  # (B, heads, L, L)
        heads = torch.arange(shape[1], dtype=torch.int32, device=device)
        pos = torch.arange(shape[2], dtype=torch.int32, device=device)[None, :] - off  # (B, L)
        head = _mix(base[:, None] + heads * g)  # (B, h)
        query = _mix(head[:, :, None] + pos[:, None, :] * g)  # (B, h, L)
        key = _mix(pos * g + _seed(rows.key, site, -2))  # (B, L)
        x = _mix(query[..., None] ^ key[:, None, None, :])  # (B, h, L, L)
    else:
        raise RuntimeError(
            f"invariant dropout: cannot place a tensor of shape {tuple(shape)} on tokens of a "
            f"chunk {width} wide (expected (rows, L, features) or (rows, heads, L, L)); "
            "train without invariant_dropout for this model"
        )
    return x >= threshold


def _apply(input: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return input * 0.0
    # where() keeps only the bool mask for backward, like native dropout.
    return torch.where(keep, input, 0.0) * (1.0 / (1.0 - p))


class InvariantDropout(torch.nn.Dropout):
    """``nn.Dropout`` whose mask is a function of the rows' identities (see module docstring).

    Outside a :func:`dropout_rows` context it is ordinary dropout; in eval mode the identity.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, site: int = 0):
        super().__init__(p, inplace)
        self.site = site

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = _CURRENT.get()
        if not self.training or self.p == 0.0 or rows is None:
            return F.dropout(input, self.p, self.training, self.inplace)
        with torch.no_grad():
            keep = _keep_mask(rows, self.site, input.shape, self.p, input.device)
        return _apply(input, keep, self.p)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, site={self.site}"


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups <= 1 else x.repeat_interleave(groups, dim=1)


def invariant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, heads, L, d)
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    original=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with a chunking-invariant mask on its probabilities (transformers' interface).

    Without dropout or outside :func:`dropout_rows` it is ``original`` unchanged (sdpa; for
    an eager model, eager attention with ordinary dropout); else eager attention:
    softmax(QK^T * scaling + mask), dropped with :func:`_keep_mask`, times V.
    """
    rows = _CURRENT.get()
    if (dropout == 0.0 or rows is None) and original is not None:
        return original(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError("invariant dropout: attention with position_bias or softcap")
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, h, L, L)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # sdpa's masks: True = attend
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:  # eager's masks: additive
            scores = scores + attention_mask
    elif getattr(module, "is_causal", False) and query.shape[2] > 1:
        causal = torch.ones(
            query.shape[2], key.shape[2], dtype=torch.bool, device=query.device
        ).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if rows is None:  # eager attention outside a strategy: ordinary dropout
        probs = F.dropout(probs, dropout, training=dropout > 0.0)
    elif dropout > 0.0:
        with torch.no_grad():
            keep = _keep_mask(rows, getattr(module, _SITE, 0), probs.shape, dropout, probs.device)
        probs = _apply(probs, keep, dropout)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, L, h, d)
    return out, probs


@functools.cache
def _register(original: str) -> str:
    """Register ``densefit_invariant_<original>`` with transformers (once per process)."""

    base = None if original == "eager" else ALL_ATTENTION_FUNCTIONS[original]
    name = _PREFIX + original
    AttentionInterface.register(name, functools.partial(invariant_attention, original=base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


def _check_hash(device: torch.device) -> None:
    """The int32 hash must wrap like the reference on this device (it does on CPU and CUDA)."""
    # 67 values: the vectorised loop and its scalar tail both run.
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [(i * _GOLDEN) & 0xFFFFFFFF for i in range(62)]
    x = torch.tensor([_to_int32(v) for v in values], dtype=torch.int32, device=device)
    got = [v & 0xFFFFFFFF for v in _mix(x).tolist()]
    if got != [_mix_int(v) for v in values]:
        raise RuntimeError(f"invariant dropout: int32 arithmetic does not wrap on {device}")


def is_invariant_dropout(model: SentenceTransformer) -> bool:
    """Whether :func:`enable_invariant_dropout` is in effect on ``model``."""
    return getattr(model, _FLAG, None) is not None


def enable_invariant_dropout(model: SentenceTransformer) -> SentenceTransformer:
    """Make every dropout mask of ``model``'s transformer a function of the rows (in place).

    Replaces each ``nn.Dropout`` by :class:`InvariantDropout` and routes attention through
    :func:`invariant_attention`. Idempotent. Nothing changes in eval mode, and nothing is
    saved: the weights and ``config.json`` are those of the original model.

    >>> from densefit.testing import tiny_model
    >>> model = enable_invariant_dropout(tiny_model())
    >>> is_invariant_dropout(model)
    True
    """
    if is_invariant_dropout(model):
        return model
    inner = transformer_of(model)
    config = getattr(inner, "config", None)
    original = getattr(config, "_attn_implementation", None)
    if original is not None and original not in _SUPPORTED:
        raise ValueError(
            f"invariant dropout supports sdpa and eager attention, not {original!r}: load the "
            "model with attn_implementation='sdpa', or train without invariant_dropout"
        )
    _check_hash(next(inner.parameters()).device)
    for module in list(inner.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Dropout:
                replacement = InvariantDropout(child.p, child.inplace)
                replacement.train(child.training)
                setattr(module, child_name, replacement)
    for site, module in enumerate(inner.modules()):  # same order as the architecture's modules
        setattr(module, _SITE, site)
        if isinstance(module, InvariantDropout):
            module.site = site
    if original is not None:
        config._attn_implementation = _register(original)
    setattr(model, _FLAG, original or "")
    return model


def disable_invariant_dropout(model: SentenceTransformer) -> SentenceTransformer:
    """Undo :func:`enable_invariant_dropout`: ordinary ``nn.Dropout`` and attention again."""
    if not is_invariant_dropout(model):
        return model
    inner = transformer_of(model)
    for module in list(inner.modules()):
        if hasattr(module, _SITE):
            delattr(module, _SITE)
        for child_name, child in list(module.named_children()):
            if isinstance(child, InvariantDropout):
                replacement = torch.nn.Dropout(child.p, child.inplace)
                replacement.train(child.training)
                setattr(module, child_name, replacement)
    original = getattr(model, _FLAG)
    if original:
        inner.config._attn_implementation = original
    delattr(model, _FLAG)
    return model


def step_key(model: SentenceTransformer) -> int | None:
    """This forward-backward's dropout key: one draw from torch's CPU generator, or None.

    None (and no draw, so the random stream is untouched) when invariant dropout is off.
    """
    if not is_invariant_dropout(model):
        return None
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))


def _recompute_context() -> tuple[
    contextlib.AbstractContextManager, contextlib.AbstractContextManager
]:
    """``context_fn`` for torch.utils.checkpoint: the recompute sees the forward's rows."""
    return contextlib.nullcontext(), _use(_CURRENT.get())


@contextlib.contextmanager
def _use(rows: _Rows | None) -> Iterator[None]:
    token = _CURRENT.set(rows)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _keep_rows_on_recompute(model: SentenceTransformer) -> None:
    """Make transformers' checkpointed layers replay the rows when they recompute.

    transformers gives each checkpointed layer a ``_gradient_checkpointing_func`` (a
    partial of ``torch.utils.checkpoint.checkpoint``); it is set anew each time
    checkpointing is switched on, so this runs before every chunk (a few attribute reads).
    """
    for module in transformer_of(model).modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None or getattr(func, "_densefit_rows", False):
            continue
        wrapped = functools.partial(func, context_fn=_recompute_context)
        wrapped._densefit_rows = True  # type: ignore[attr-defined]
        module._gradient_checkpointing_func = wrapped


@contextlib.contextmanager
def dropout_rows(
    model: SentenceTransformer,
    key: int | None,
    column: int = 0,
    rows: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> Iterator[None]:
    """Embed a chunk inside this: its masks become functions of (key, column, rows).

    ``rows`` (c,) are the chunk's row positions in column ``column`` (``Chunk.index``;
    None: 0..c-1); ``attention_mask`` (c, L) its padding (None: none). A no-op when ``key``
    is None (invariant dropout off, see :func:`step_key`) or the model does not use it.
    """
    if key is None or not is_invariant_dropout(model):
        yield
        return
    _keep_rows_on_recompute(model)
    mask = None if attention_mask is None else attention_mask.to(torch.int32)
    state = _Rows(
        key=key,
        column=column,
        rows=None if rows is None else rows.to(torch.int32),
        width=None if mask is None else int(mask.shape[1]),
        offsets=None if mask is None else mask.argmax(dim=1).to(torch.int32),  # first real token
    )
    with _use(state):
        yield
