"""Matryoshka representation learning: any loss, summed over truncated embeddings.

``matryoshka(loss_fn, dims, weights)`` returns a loss with the same signature as
``loss_fn`` whose value is ``sum_i weights[i] * loss_fn(embeddings cut to dims[i])``. Each
cut keeps the first ``d`` coordinates and is rescaled to the full vector's norm: for unit
vectors (a model ending in ``Normalize``, or a cosine loss) that is re-normalising, and at
the full dimension it is the identity, so ``matryoshka(f, [full])`` is exactly ``f``.

Like every loss here it is a pure function of embeddings: the memory strategies (gradient
cache, chunked scores) and cross-device gathering wrap it unchanged. This mirrors
sentence-transformers' ``MatryoshkaLoss`` (Kusupati et al. 2022, "Matryoshka Representation
Learning"), which truncates the embeddings the model returns before the inner loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["matryoshka", "truncate"]


def truncate(embeddings, dim: int | None):
    """The first ``dim`` coordinates of each row, rescaled to the row's full norm: the one
    Matryoshka cut, in training (this loss) and at inference (``densefit index --dim``, the
    queries of such a store, ``densefit eval --dims``). Unit vectors stay unit; a dot-product
    model keeps the magnitudes it learned.

    Works on ``(..., d)`` torch tensors and numpy arrays (float32 out); ``dim`` None or at
    least ``d`` returns ``embeddings`` itself.

    >>> e = torch.tensor([[3.0, 4.0, 0.0, 12.0]])  # norm 13
    >>> truncate(e, 2)
    tensor([[ 7.8000, 10.4000]])
    >>> truncate(e, 4) is e
    True
    >>> truncate(np.array([[0.6, 0.8, 0.0]]), 1)
    array([[1.]], dtype=float32)
    """
    if dim is None or dim >= embeddings.shape[-1]:
        return embeddings
    if isinstance(embeddings, torch.Tensor):
        cut = embeddings[..., :dim]
        full = embeddings.norm(dim=-1, keepdim=True)
        return cut * (full / cut.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    vectors = np.asarray(embeddings, dtype=np.float32)
    cut = vectors[..., :dim]
    full = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return cut * (full / np.maximum(np.linalg.norm(cut, axis=-1, keepdims=True), 1e-12))


def matryoshka(
    loss_fn: Callable[..., torch.Tensor],
    dims: Sequence[int],
    weights: Sequence[float] | None = None,
    *,
    n_embeddings: int = 3,
) -> Callable[..., torch.Tensor]:
    """``loss_fn`` summed over embeddings truncated to each of ``dims`` (weights: all 1).

    The first ``n_embeddings`` positional arguments of the returned function are embeddings
    (``None`` passes through); every other argument (teacher scores,
    ``rows=``, ``mask=``) goes to ``loss_fn`` unchanged. A size above the embeddings' own is
    an error (the model cannot make it).

    >>> from densefit.losses import mnrl
    >>> a, p = torch.randn(4, 8), torch.randn(4, 8)
    >>> loss = matryoshka(mnrl, [8, 4], [1.0, 0.5])
    >>> torch.allclose(loss(a, p), mnrl(a, p) + 0.5 * mnrl(a[:, :4], p[:, :4]))
    True
    """
    dims = list(dims)
    weights = [1.0] * len(dims) if weights is None else list(weights)
    if len(weights) != len(dims):
        raise ValueError(
            f"--matryoshka-weights has {len(weights)} weight(s) for {len(dims)} "
            "--matryoshka-dims: give one weight per size"
        )

    def matryoshka_loss(*args, **kwargs) -> torch.Tensor:
        embeddings, rest = args[:n_embeddings], args[n_embeddings:]
        full = max((e.shape[-1] for e in embeddings if e is not None and e.numel()), default=0)
        if dims and full and max(dims) > full:
            raise ValueError(
                f"--matryoshka-dims {max(dims)} is above the model's embedding size {full}: "
                f"use sizes up to {full}"
            )
        total = None
        for dim, weight in zip(dims, weights):
            if weight == 0:
                continue
            cut = [e if e is None else truncate(e, dim) for e in embeddings]
            term = weight * loss_fn(*cut, *rest, **kwargs)
            total = term if total is None else total + term
        return total

    matryoshka_loss.dims, matryoshka_loss.weights = dims, weights  # type: ignore[attr-defined]
    return matryoshka_loss
