import pytest
import torch
import torch.nn.functional as F

from densefit.losses import chunked_cross_entropy, margin_mse, mnrl


def reference_mnrl(a, p, n=None, scale=20.0, symmetric=False):
    """Textbook MNRL: cos-sim matrix against [positives; negatives], cross-entropy."""
    a, p = F.normalize(a, dim=-1), F.normalize(p, dim=-1)
    cands = p if n is None else torch.cat([p, F.normalize(n.reshape(-1, a.shape[1]), dim=-1)])
    labels = torch.arange(len(a))
    loss = F.cross_entropy(scale * a @ cands.T, labels)
    if symmetric:
        loss = (loss + F.cross_entropy(scale * p @ a.T, labels)) / 2
    return loss


def grads(fn, *tensors):
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    loss = fn(*tensors)
    loss.backward()
    return loss.detach(), [t.grad for t in tensors]


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("chunk", [None, 1, 3, 64])
def test_mnrl_matches_reference(symmetric, k, chunk):
    torch.manual_seed(0)
    B, d = 7, 16
    a, p, n = torch.randn(B, d), torch.randn(B, d), torch.randn(B, k, d)
    args = (a, p, n) if k else (a, p)
    ref_loss, ref_grads = grads(lambda *t: reference_mnrl(*t, symmetric=symmetric), *args)
    loss, got = grads(lambda *t: mnrl(*t, symmetric=symmetric, chunk_size=chunk), *args)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for g, r in zip(got, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_chunked_cross_entropy_never_builds_full_matrix():
    """The chunked path's largest saved tensor is O(chunk x m), not O(n x m)."""
    torch.manual_seed(0)
    n, m, d, chunk = 256, 256, 8, 16
    q = torch.randn(n, d, requires_grad=True)
    k = torch.randn(m, d, requires_grad=True)
    labels = torch.arange(n)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_cross_entropy(q, k, labels, chunk_size=chunk)
    assert max(sizes) < n * m
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sizes.clear()
        chunked_cross_entropy(q, k, labels)  # full path saves the n x m scores
    assert max(sizes) >= n * m
    loss.backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_mnrl_mask_equals_removing_the_candidate():
    torch.manual_seed(0)
    a, p, n = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[0, 4] = True  # negative 0 is a false negative for anchor 0
    masked = mnrl(a, p, n, mask=mask, chunk_size=2)
    # reference: same thing with -inf logits computed by hand
    an, cn = F.normalize(a, dim=-1), F.normalize(torch.cat([p, n]), dim=-1)
    scores = 20 * an @ cn.T
    scores[0, 4] = float("-inf")
    torch.testing.assert_close(masked, F.cross_entropy(scores, torch.arange(4)))


def test_mnrl_dot_similarity_and_errors():
    a, p = torch.randn(3, 4), torch.randn(3, 4)
    expected = F.cross_entropy(a @ p.T, torch.arange(3))
    torch.testing.assert_close(mnrl(a, p, scale=1.0, similarity="dot"), expected)
    with pytest.raises(ValueError, match="similarity"):
        mnrl(a, p, similarity="l2")
    with pytest.raises(ValueError, match="differ"):
        mnrl(a, torch.randn(2, 4))


def test_margin_mse_matches_reference():
    torch.manual_seed(0)
    a, p, n, s = torch.randn(5, 8), torch.randn(5, 8), torch.randn(5, 8), torch.randn(5)
    expected = ((a * p).sum(-1) - (a * n).sum(-1) - s).pow(2).mean()
    torch.testing.assert_close(margin_mse(a, p, n, s), expected)
    with pytest.raises(ValueError, match="score"):
        margin_mse(a, p, torch.randn(5, 2, 8), s)


def test_every_loss_has_one_batch_loss_and_an_unknown_one_is_refused():
    """make_loss_fn and the several-process run read one registry: a loss without an entry
    is refused, never run as another."""
    from densefit.choices import LOSSES
    from densefit.config.train import TrainConfig
    from densefit.data.types import TrainingExample
    from densefit.training.objective import BATCH_LOSSES, batch_loss, make_loss_fn

    assert tuple(BATCH_LOSSES) == LOSSES
    assert [batch_loss(name).cross_row for name in LOSSES] == [True, False]
    with pytest.raises(ValueError, match="loss must be one of mnrl, margin_mse, got 'triplet'"):
        batch_loss("triplet")
    rows = [TrainingExample("q", "p", ("n",), score=1.0)]
    with pytest.raises(ValueError, match="margin_mse has no cross-row terms"):
        make_loss_fn(TrainConfig(loss="margin_mse"), rows, share=object())
