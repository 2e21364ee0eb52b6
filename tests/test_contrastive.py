"""The contrastive losses where tests/test_losses.py does not reach: one device's rows of a
batch with a false-negative mask (a tensor or a compact CandidateMask), the chunked loss in
half precision and with inputs that need no gradient, MarginMSE with several negatives, and
the one-line refusals (bench/results/mutation.md: the mutants of
densefit/losses/contrastive.py these kill)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from densefit.losses import chunked_cross_entropy, margin_mse, mnrl
from densefit.losses.masking import CandidateMask

B, D, M = 8, 6, 4


def batch(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    a, p, n = (torch.randn(shape, generator=g) for shape in ((B, D), (B, D), (M, D)))
    return [t.to(dtype).requires_grad_() for t in (a, p, n)]


def compact_mask() -> CandidateMask:
    """Duplicate texts among the B positives and M negatives: candidates sharing an anchor's
    positive's text are masked for that anchor (all but its own)."""
    group = torch.tensor([0, 1, 2, 0, 3, 4, 1, 5, 2, 6, 0, 7])  # (B + M,)
    first = torch.zeros(B + M, dtype=torch.bool)
    first[[0, 1, 2, 4, 5, 7, 9, 11]] = True
    mask = CandidateMask(B, B + M, group=group, first=first)
    assert mask.dense().any()
    return mask


def dense_mask() -> torch.Tensor:
    mask = torch.zeros(B, B + M, dtype=torch.bool)
    mask[0, 3] = mask[3, 0] = mask[1, 6] = mask[2, B + 1] = mask[5, 2] = True
    mask[4, 4] = True  # its own positive: never masked
    return mask


def loss_and_grads(function, tensors):
    loss = function(*tensors)
    return loss.detach(), torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("mask_kind", ["none", "tensor", "compact"])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("chunk", [None, 3])
def test_a_partition_of_the_rows_sums_to_the_whole_batch(mask_kind, symmetric, chunk):
    """sum over parts of len(part) / B * mnrl(..., rows=part) == mnrl(...), gradients too,
    with the mask of every row given to each part; open-ended slices read as the batch's."""
    mask = {"none": None, "tensor": dense_mask(), "compact": compact_mask()}[mask_kind]
    tensors = batch()
    options = {"symmetric": symmetric, "chunk_size": chunk, "mask": mask}
    whole = loss_and_grads(lambda a, p, n: mnrl(a, p, n, **options), tensors)
    parts = [slice(None, 3), slice(3, 5), slice(5, None)]

    def summed(a, p, n):
        total = 0
        for part in parts:
            rows = range(B)[part]
            total = total + len(rows) / B * mnrl(a, p, n, rows=part, **options)
        return total

    split = loss_and_grads(summed, tensors)
    torch.testing.assert_close(split[0], whole[0], rtol=1e-6, atol=1e-6)
    for got, want in zip(split[1], whole[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_rows_with_only_their_own_anchors_equal_rows_of_the_whole_batch():
    a, p, n = batch()
    mask = dense_mask()
    whole = mnrl(a, p, n, mask=mask, rows=slice(2, 6), chunk_size=2)
    own = mnrl(a[2:6], p, n, mask=mask, rows=slice(2, 6), chunk_size=2)
    torch.testing.assert_close(own, whole, rtol=0, atol=1e-7)


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_compact_mask_equals_its_dense_matrix_chunked_and_not(symmetric):
    tensors = batch(1)
    compact = compact_mask()
    want = loss_and_grads(
        lambda a, p, n: mnrl(a, p, n, mask=compact.dense(), symmetric=symmetric), tensors
    )
    unmasked = mnrl(*tensors, symmetric=symmetric).detach()
    assert not torch.allclose(want[0], unmasked)
    for chunk in (None, 3):
        got = loss_and_grads(
            lambda a, p, n, c=chunk: mnrl(a, p, n, mask=compact, symmetric=symmetric, chunk_size=c),
            tensors,
        )
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
        for g, w in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_a_tensor_mask_masks_and_never_its_own_positive():
    a, p, n = batch(2)
    mask = dense_mask()
    masked = mnrl(a, p, n, mask=mask)
    assert not torch.allclose(masked, mnrl(a, p, n))
    everything = torch.ones(B, B + M, dtype=torch.bool)  # only the own positive counts
    assert mnrl(a, p, n, mask=everything).item() == pytest.approx(0.0, abs=1e-6)
    # the reference: cross-entropy over the unmasked candidates
    a_n, c_n = F.normalize(a, dim=-1), F.normalize(torch.cat([p, n]), dim=-1)
    mask = mask.clone()
    mask[torch.arange(B), torch.arange(B)] = False
    scores = (20.0 * a_n @ c_n.T).masked_fill(mask, float("-inf"))
    torch.testing.assert_close(masked, F.cross_entropy(scores, torch.arange(B)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_chunked_loss_in_half_precision_equals_the_full_matrix(dtype):
    """Half-precision embeddings (autocast): the chunked loss keeps its log-sum-exp, total
    and key gradients in float32 and hands back gradients of the inputs' dtype."""
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(12, 16, generator=g) * 3).to(dtype).requires_grad_()
    k = (torch.randn(20, 16, generator=g) * 3).to(dtype).requires_grad_()
    labels = torch.arange(12)
    full_loss, full_grads = loss_and_grads(
        lambda q, k: chunked_cross_entropy(q, k, labels, scale=2.0), [q, k]
    )
    loss, grads = loss_and_grads(
        lambda q, k: chunked_cross_entropy(q, k, labels, scale=2.0, chunk_size=5), [q, k]
    )
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, full_loss, rtol=0, atol=1e-5)
    for got, want in zip(grads, full_grads, strict=True):
        assert got.dtype == dtype  # to the precision of the dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_chunked_loss_gives_gradients_only_to_what_needs_them():
    q = torch.randn(9, 4, requires_grad=True)
    k = torch.randn(11, 4)  # fixed candidates (e.g. a frozen document encoder)
    labels = torch.arange(9)
    chunked = chunked_cross_entropy(q, k, labels, chunk_size=4)
    chunked.backward()
    want = torch.autograd.grad(F.cross_entropy(q @ k.T, labels), q)[0]
    torch.testing.assert_close(q.grad, want, rtol=0, atol=1e-6)
    keys = torch.randn(11, 4, requires_grad=True)
    grad_k = torch.autograd.grad(
        chunked_cross_entropy(q.detach(), keys, labels, chunk_size=4), keys
    )[0]
    torch.testing.assert_close(
        grad_k,
        torch.autograd.grad(F.cross_entropy(q.detach() @ keys.T, labels), keys)[0],
        rtol=0,
        atol=1e-6,
    )


def test_scale_defaults_to_one_and_a_chunk_of_every_row_is_the_full_matrix():
    q, k, labels = torch.randn(6, 3), torch.randn(7, 3), torch.arange(6)
    want = F.cross_entropy(q @ k.T, labels)
    for chunk in (None, 6, 10, 4):
        torch.testing.assert_close(
            chunked_cross_entropy(q, k, labels, chunk_size=chunk), want, rtol=0, atol=1e-6
        )


def test_a_single_one_dimensional_negative_is_a_candidate():
    a, p = torch.tensor([[1.0], [-1.0]]), torch.tensor([[1.0], [1.0]])
    neg = torch.tensor([[-1.0]])  # one negative of one dimension: numel() == 1
    with_neg, without = mnrl(a, p, neg, similarity="dot"), mnrl(a, p, similarity="dot")
    scores = 20.0 * a @ torch.cat([p, neg]).T
    torch.testing.assert_close(with_neg, F.cross_entropy(scores, torch.arange(2)))
    assert with_neg.item() != pytest.approx(without.item())
    assert mnrl(a, p, torch.zeros(2, 0, 1), similarity="dot").item() == pytest.approx(
        without.item()
    )


def test_margin_mse_with_several_negatives_per_row():
    g = torch.Generator().manual_seed(4)
    a, p = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    negs = torch.randn(3, 2, 5, generator=g)
    scores = torch.randn(3, 2, generator=g, dtype=torch.float64)
    want = F.mse_loss(
        (a * p).sum(-1, keepdim=True) - torch.einsum("bd,bkd->bk", a, negs), scores.float()
    )
    torch.testing.assert_close(margin_mse(a, p, negs, scores), want)
    with pytest.raises(
        ValueError, match="^margin_mse: 3 score\\(s\\) per row but 2 negative\\(s\\)$"
    ):
        margin_mse(a, p, negs, torch.zeros(3, 3))


def test_the_refusals_say_what_is_wrong():
    a, p, n = batch()
    with pytest.raises(ValueError, match=r"^anchors \(8, 5\) and positives \(8, 6\) differ$"):
        mnrl(a[:, :5], p)
    with pytest.raises(
        ValueError, match=r"^anchors \(5, 6\) and positives \(8, 6\) differ \(rows 0:3\)$"
    ):
        mnrl(a[:5], p, rows=slice(0, 3))
    with pytest.raises(ValueError, match=r"differ \(rows 6:9\)$"):
        mnrl(a, p, rows=slice(6, 9))
    with pytest.raises(ValueError, match="^similarity must be one of cosine, dot, not 'l2'$"):
        mnrl(a, p, similarity="l2")
    with pytest.raises(
        ValueError, match="^symmetric mnrl with rows= needs the anchors of the whole batch$"
    ):
        mnrl(a[:3], p, rows=slice(0, 3), symmetric=True)
