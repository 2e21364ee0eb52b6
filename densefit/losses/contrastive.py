"""Contrastive losses as pure functions of embeddings: tensors in, a scalar out.

They never hold the model, so every memory strategy (plain, checkpointing, gradient cache)
and cross-device gathering works with every loss unchanged.

Shapes: ``B`` rows in the batch, ``d`` embedding size, ``M`` hard negatives in total.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from densefit.choices import SIMILARITIES

__all__ = ["LOSS_FUNCTIONS", "mnrl", "margin_mse", "chunked_cross_entropy"]


def _as_matrix(x: torch.Tensor | None, d: int) -> torch.Tensor | None:
    """Flatten (B, k, d) hard negatives to (B*k, d); pass (M, d) through."""
    if x is None or x.numel() == 0:
        return None
    return x.reshape(-1, d)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``scale * q @ k.T`` against ``labels``, in blocks of rows of q.

    Forward keeps only the per-row log-sum-exp; backward recomputes each block's scores.
    Peak extra memory is O(chunk x m) instead of O(n x m): the n x m score matrix is never
    materialised. ``mask`` (n, m) bool, True = exclude that candidate for that row.
    """

    @staticmethod
    def forward(ctx, q, k, labels, mask, scale: float, chunk: int):  # q (n, d), k (m, d)
        n = q.shape[0]
        lse = q.new_empty(n, dtype=torch.float32)
        total = q.new_zeros((), dtype=torch.float32)
        rows = torch.arange(n, device=q.device)
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            scores = (q[sl] @ k.T).float().mul_(scale)  # (c, m); in place: one block held
            if mask is not None:  # a tensor or a CandidateMask: rows built per block
                scores.masked_fill_(mask[sl], float("-inf"))
            lse[sl] = torch.logsumexp(scores, dim=1)
            total = total + (lse[sl] - scores[rows[sl] - start, labels[sl]]).sum()
        dense = isinstance(mask, torch.Tensor)
        ctx.save_for_backward(q, k, labels, lse, mask if dense else torch.empty(0))
        ctx.lazy_mask = None if dense else mask  # compact: nothing B x m is kept
        ctx.scale, ctx.chunk, ctx.has_mask = scale, chunk, mask is not None
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        q, k, labels, lse, mask = ctx.saved_tensors
        mask = ctx.lazy_mask if ctx.lazy_mask is not None else mask
        n, scale = q.shape[0], ctx.scale
        grad_q = torch.empty_like(q) if ctx.needs_input_grad[0] else None
        grad_k = torch.zeros_like(k, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        rows = torch.arange(n, device=q.device)
        coef = grad_out.float() * scale / n
        for start in range(0, n, ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            probs = (q[sl] @ k.T).float().mul_(scale)  # (c, m) scores, then in place:
            if ctx.has_mask:
                probs.masked_fill_(mask[sl], float("-inf"))
            # d(lse - s_label)/ds = softmax(s) - onehot(label)
            probs.sub_(lse[sl, None]).exp_()
            probs[rows[sl] - start, labels[sl]] -= 1.0
            probs.mul_(coef)
            if grad_q is not None:
                grad_q[sl] = (probs.to(k.dtype) @ k).to(q.dtype)
            if grad_k is not None:
                grad_k += probs.T @ q[sl].float()
        if grad_k is not None:
            grad_k = grad_k.to(k.dtype)
        return grad_q, grad_k, None, None, None, None


def chunked_cross_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    labels: torch.Tensor,
    *,
    scale: float = 1.0,
    chunk_size: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(scale * q @ k.T, labels)``, computed in row blocks when ``chunk_size``.

    >>> q, k = torch.randn(8, 4), torch.randn(12, 4)
    >>> labels = torch.arange(8)
    >>> full = F.cross_entropy(q @ k.T, labels)
    >>> torch.allclose(chunked_cross_entropy(q, k, labels, chunk_size=3), full, atol=1e-6)
    True
    """
    if chunk_size is None or chunk_size >= q.shape[0]:
        scores = (q @ k.T).float() * scale  # (n, m)
        if mask is not None:
            scores = scores.masked_fill(mask[:], float("-inf"))  # a tensor or a CandidateMask
        return F.cross_entropy(scores, labels)
    return _ChunkedCrossEntropy.apply(q, k, labels, mask, float(scale), int(chunk_size))


def mnrl(
    anchors: torch.Tensor,
    positives: torch.Tensor,
    negatives: torch.Tensor | None = None,
    *,
    scale: float = 20.0,
    symmetric: bool = False,
    similarity: str = "cosine",
    chunk_size: int | None = None,
    mask: torch.Tensor | None = None,
    rows: slice | None = None,
) -> torch.Tensor:
    """Multiple Negatives Ranking Loss (InfoNCE with in-batch negatives).

    Each anchor must pick its own positive among all positives of the batch plus all hard
    negatives: cross-entropy over ``scale * sim(anchor, candidate)``. ``scale`` is the
    inverse temperature (20 = temperature 0.05, as in sentence-transformers).

    Args:
        anchors: (B, d) query embeddings.
        positives: (B, d) embeddings of each anchor's positive document.
        negatives: optional hard negatives, (B, k, d) or (M, d); every one of them is a
            candidate for every anchor.
        scale: multiplies the similarities (inverse temperature).
        symmetric: also ask each positive to pick its anchor among all anchors, and
            average the two directions.
        similarity: ``"cosine"`` (normalise first) or ``"dot"`` (:data:`densefit.choices.SIMILARITIES`).
        chunk_size: compute scores and their gradient in blocks of this many anchors,
            so nothing of size B x B is ever held (exact; same result and gradients).
        mask: optional (B, B + M) bool, True where a candidate must not count for that
            anchor (false negatives); the anchor's own positive is never masked. A
            :class:`densefit.losses.masking.CandidateMask` works too and is never materialised
            whole: the chunked path builds its rows one block at a time.
        rows: only the loss terms of these rows of the batch, averaged over them (one
            device's share when the batch is gathered across devices, see
            :mod:`densefit.training.distributed`). ``positives``, ``negatives`` and ``mask`` are
            then the whole batch's; ``anchors`` the whole batch's or just these rows
            (``symmetric`` needs all of them: they are the candidates of the other
            direction). The batch's loss is the sum over a partition of its rows of
            ``len(rows) / B * mnrl(..., rows=part)``.

    Inputs:
        | anchors | positives | negatives (optional) |

    References:
        Henderson et al. 2017, "Efficient Natural Language Response Suggestion for Smart
        Reply"; sentence-transformers ``MultipleNegativesRankingLoss``.

    Example:
        >>> a, p = torch.randn(4, 8), torch.randn(4, 8)
        >>> mnrl(a, p).shape
        torch.Size([])
    """
    B, d = positives.shape
    start, stop = (
        (0, B) if rows is None else (rows.start or 0, B if rows.stop is None else rows.stop)
    )
    n = stop - start  # rows whose loss terms are computed (all B unless ``rows``)
    if anchors.shape[-1] != d or anchors.shape[0] not in (B, n) or not 0 <= start <= stop <= B:
        where = "" if rows is None else f" (rows {start}:{stop})"
        raise ValueError(
            f"anchors {tuple(anchors.shape)} and positives {tuple(positives.shape)} differ{where}"
        )
    neg = _as_matrix(negatives, d)
    if similarity == "cosine":
        anchors, positives = F.normalize(anchors, dim=-1), F.normalize(positives, dim=-1)
        neg = F.normalize(neg, dim=-1) if neg is not None else None
    elif similarity != "dot":
        raise ValueError(f"similarity must be one of {', '.join(SIMILARITIES)}, not {similarity!r}")
    every_anchor = anchors.shape[0] == B
    queries = anchors[start:stop] if every_anchor else anchors  # (n, d)
    candidates = positives if neg is None else torch.cat([positives, neg])  # (B + M, d)
    labels = torch.arange(start, stop, device=anchors.device)
    own_mask = back_mask = None
    if isinstance(mask, torch.Tensor):
        mask = mask.clone()
        diag = torch.arange(B, device=mask.device)
        mask[diag, diag] = False  # the true positive always counts
        own_mask = mask[start:stop]
        back_mask = mask[:, start:stop].T  # (n positives, B anchors)
    elif mask is not None:  # a CandidateMask: own positives built in, rows made per block
        own_mask = mask.rows(start, stop)
        back_mask = mask.transposed().rows(start, stop)
    loss = chunked_cross_entropy(
        queries,
        candidates,
        labels,
        scale=scale,
        chunk_size=chunk_size,
        mask=own_mask,
    )
    if symmetric:
        if not every_anchor:
            raise ValueError("symmetric mnrl with rows= needs the anchors of the whole batch")
        back = chunked_cross_entropy(
            positives[start:stop],
            anchors,
            labels,
            scale=scale,
            chunk_size=chunk_size,
            mask=back_mask,
        )
        loss = (loss + back) / 2
    return loss


def margin_mse(
    anchors: torch.Tensor,
    positives: torch.Tensor,
    negatives: torch.Tensor,
    scores: torch.Tensor,
) -> torch.Tensor:
    """MarginMSE: match the student's margin ``a.p - a.n`` to a teacher's margin ``scores``.

    Args:
        anchors: (B, d); positives: (B, d); negatives: (B, d) or (B, k, d).
        scores: (B,) or (B, k) teacher margins (e.g. cross-encoder score(pos) - score(neg)).

    References:
        Hofstaetter et al. 2020, "Improving Efficient Neural Ranking Models with
        Cross-Architecture Knowledge Distillation"; used by GPL / Haystack 1.x.

    Example:
        >>> a, p, n = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
        >>> margin_mse(a, p, n, torch.ones(4)).shape
        torch.Size([])
    """
    B, d = anchors.shape
    negs = negatives.reshape(B, -1, d)  # (B, k, d)
    pos = (anchors * positives).sum(-1, keepdim=True)  # (B, 1)
    neg = torch.einsum("bd,bkd->bk", anchors, negs)  # (B, k)
    target = scores.reshape(B, -1).to(pos.dtype)
    if target.shape != neg.shape:
        raise ValueError(
            f"margin_mse: {target.shape[1]} score(s) per row but {neg.shape[1]} negative(s)"
        )
    return F.mse_loss((pos - neg).float(), target.float())


# The loss of each name in densefit.choices.LOSSES.
LOSS_FUNCTIONS = {"mnrl": mnrl, "margin_mse": margin_mse}
