"""False-negative masking inside the loss: duplicates and known positives, any strategy."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from densefit import TrainConfig, TrainingExample, train
from densefit.data.batching import columns_of
from densefit.losses.masking import false_negative_mask
from densefit.memory import make_strategy
from densefit.training.objective import make_loss_fn
from densefit.training.telemetry import merge_health, score_health

D = 16


def embed_lookup(columns, seed=0):
    """Deterministic embeddings: the same text always gets the same vector."""
    table: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(seed)
    for text in sorted({t for column in columns for t in column}):
        table[text] = torch.randn(D, generator=generator)
    return [
        torch.stack([table[t] for t in column]) if column else torch.empty(0, D)
        for column in columns
    ]


def loss_of(rows, *, masked, **kw):
    config = TrainConfig(
        similarity="cosine", show_progress=False, mask_false_negatives=masked, **kw
    )
    return make_loss_fn(config, rows)(embed_lookup(columns_of(rows)))


CLEAN = [
    TrainingExample("q0 cells", "p0 cells divide", ("n0 python",)),
    TrainingExample("q1 genes", "p1 genes code", ("n1 banana",)),
    TrainingExample("q2 virus", "p2 virus spreads", ("n2 apple",)),
    TrainingExample("q3 heart", "p3 heart beats", ()),
]
# The same batch plus: a negative equal to its own positive (row 0), a negative equal to
# another row's positive (row 1), a negative repeated across rows (rows 2 and 3).
WITH_DUPLICATES = [
    TrainingExample("q0 cells", "p0 cells divide", ("n0 python", "p0 cells divide")),
    TrainingExample("q1 genes", "p1 genes code", ("n1 banana", "p2 virus spreads")),
    TrainingExample("q2 virus", "p2 virus spreads", ("n2 apple", "n0 python")),
    TrainingExample("q3 heart", "p3 heart beats", ("n1 banana",)),
]


@pytest.mark.parametrize("chunk", [None, 3])
def test_duplicates_masked_equal_duplicates_removed(chunk):
    clean = loss_of(CLEAN, masked=True, loss_block_size=chunk)
    masked = loss_of(WITH_DUPLICATES, masked=True, loss_block_size=chunk)
    unmasked = loss_of(WITH_DUPLICATES, masked=False, loss_block_size=chunk)
    torch.testing.assert_close(masked, clean, atol=1e-6, rtol=1e-6)
    assert abs(float(unmasked) - float(clean)) > 1e-3  # the duplicates did change the loss


def test_duplicate_rows_see_each_text_once():
    """Two rows with the same positive: neither is pushed away from the other's copy."""
    rows = [CLEAN[0], TrainingExample("q0 again", "p0 cells divide"), CLEAN[1]]
    found = false_negative_mask(rows)
    # candidates: p0, p0 (row 1's copy), p1, n0, n1
    assert found.mask.dense().int().tolist() == [[0, 1, 0, 0, 0], [1, 0, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert (found.candidates, found.unique_candidates) == (5, 4)


def test_mask_counts_and_nothing_to_mask():
    found = false_negative_mask(WITH_DUPLICATES)
    assert (found.candidates, found.unique_candidates) == (11, 7)
    # every anchor: the 4 later copies (row 0's copy of its own positive is one of them)
    assert found.duplicates == 4 * 4 and found.known_positives == 0
    assert false_negative_mask(CLEAN).mask is None  # no mask, no cost


def test_known_positive_ids_are_masked_for_their_anchor_only():
    rows = [
        TrainingExample(
            "q0",
            "doc a",
            ("doc x",),
            positive_ids=("a", "b", "x"),
            positive_id="a",
            negative_ids=("x",),
        ),
        TrainingExample("q0 again", "doc b", positive_ids=("a", "b", "x"), positive_id="b"),
        TrainingExample("q1", "doc c", positive_id="c"),
    ]
    found = false_negative_mask(rows)
    # candidates: doc a, doc b, doc c, doc x
    assert found.mask.dense().int().tolist() == [[0, 1, 0, 1], [1, 0, 0, 1], [0, 0, 0, 0]]
    assert found.known_positives == 4 and found.duplicates == 0

    emb = embed_lookup(columns_of(rows))
    got = make_loss_fn(TrainConfig(similarity="cosine", show_progress=False), rows)(emb)
    # Reference: cross-entropy over the allowed candidates only, written out by hand.
    a = F.normalize(emb[0], dim=-1)
    cands = F.normalize(torch.cat([emb[1], emb[2]]), dim=-1)
    logits = 20.0 * a @ cands.T
    allowed = [[0, 2], [1, 2], [0, 1, 2, 3]]
    ref = torch.stack(
        [torch.logsumexp(logits[i, allowed[i]], 0) - logits[i, i] for i in range(3)]
    ).mean()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_symmetric_loss_with_mask_equals_duplicates_removed():
    """The backward direction (positive -> anchor) sees the same anchors either way, so with
    the duplicates masked the symmetric loss is the clean batch's."""
    masked = loss_of(WITH_DUPLICATES, masked=True, symmetric=True)
    clean = loss_of(CLEAN, masked=True, symmetric=True)
    torch.testing.assert_close(masked, clean, atol=1e-6, rtol=1e-6)
    assert abs(float(clean) - float(loss_of(CLEAN, masked=True))) > 1e-3  # symmetric counts


def grads_of(model, rows, strategy_name, chunk, masked=True):
    model = copy.deepcopy(model)
    model.train()
    strategy = make_strategy(strategy_name, chunk)
    strategy.prepare(model)
    config = TrainConfig(
        similarity="cosine", show_progress=False, mask_false_negatives=masked, symmetric=True
    )
    torch.manual_seed(3)
    stats = strategy.forward_backward(model, columns_of(rows), make_loss_fn(config, rows))
    return stats.loss, torch.cat(
        [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    )


KNOWN_AND_DUPLICATES = [
    dataclasses.replace(WITH_DUPLICATES[0], positive_id="d0"),
    *WITH_DUPLICATES[1:],
    TrainingExample(
        "q0 cells again",
        "p4 cells split",
        ("p0 cells divide",),
        positive_ids=("d0", "d4"),
        positive_id="d4",
        negative_ids=("d0",),
    ),
]


@pytest.mark.parametrize("name", ["cache", "cache+checkpoint"])
def test_masked_cached_gradients_equal_masked_plain(tiny, name):
    ref_loss, ref = grads_of(tiny, KNOWN_AND_DUPLICATES, "plain", 2)
    loss, got = grads_of(tiny, KNOWN_AND_DUPLICATES, name, 2)
    _, unmasked = grads_of(tiny, KNOWN_AND_DUPLICATES, "plain", 2, masked=False)
    assert abs(loss - ref_loss) < 1e-5
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(unmasked, ref, atol=1e-5)  # the mask is really in the gradient


def test_step_records_carry_batch_health(tiny):
    records = []
    rows = WITH_DUPLICATES * 2
    train(
        tiny,
        rows,
        TrainConfig(batch_size=8, max_steps=1, show_progress=False),
        on_step=records.append,
    )
    (record,) = records
    assert record["candidates"] == 22 and record["unique_candidates"] == 7
    assert record["masked_duplicates"] > 0 and record["masked_known_positives"] == 0
    assert -1 <= record["hard_neg_score"] <= 1 and -1 <= record["pos_score"] <= 1


def test_gradient_accumulation_merges_health(tiny):
    records = []
    config = TrainConfig(
        batch_size=8, gradient_accumulation_steps=2, max_steps=1, show_progress=False
    )
    with pytest.warns(UserWarning, match="accumulation"):
        train(tiny, WITH_DUPLICATES * 2, config, on_step=records.append)
    assert records[0]["candidates"] == 22  # both micro-batches of 4 rows added up


def test_score_health_and_merge():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    health = score_health(
        [a, a, torch.tensor([[0.0, 1.0]])],
        [TrainingExample("q", "p", ("n",)), TrainingExample("q2", "p2")],
    )
    assert health == {"pos_score": 1.0, "hard_neg_score": 0.0}
    merged = merge_health(
        [
            {"masked_duplicates": 2, "hard_neg_score": None},
            {"masked_duplicates": 1, "hard_neg_score": 0.5},
        ]
    )
    assert merged == {"masked_duplicates": 3, "hard_neg_score": 0.5}


def _reference_dense_mask(rows):
    """The (B, C) mask written out the obvious way, pair by pair."""
    from densefit.losses.masking import candidates_of

    texts, ids = candidates_of(rows)
    B, C = len(rows), len(texts)
    mask = torch.zeros(B, C, dtype=torch.bool)
    for i, row in enumerate(rows):
        known = {p for p in (*row.positive_ids, row.positive_id) if p}
        for c in range(C):
            if c == i:
                continue
            duplicate = texts[c] == texts[i] or texts[c] in texts[:c]
            mask[i, c] = duplicate or (ids[c] in known and ids[c] != "")
    return mask


def _random_rows(seed, n=40):
    import random

    rng = random.Random(seed)
    docs = [f"doc {k}" for k in range(25)]
    rows = []
    for i in range(n):
        pos = rng.randrange(25)
        negs = tuple(rng.sample(range(25), rng.randrange(3)))
        rows.append(
            TrainingExample(
                f"q{i}",
                docs[pos],
                tuple(docs[k] for k in negs),
                positive_id=f"d{pos}" if rng.random() < 0.8 else "",
                negative_ids=tuple(f"d{k}" for k in negs),
                positive_ids=tuple(f"d{k}" for k in rng.sample(range(25), rng.randrange(4))),
            )
        )
    return rows


@pytest.mark.parametrize("seed", range(5))
def test_compact_mask_equals_dense_reference_blockwise_and_transposed(seed):
    rows = _random_rows(seed)
    found = false_negative_mask(rows)
    expected = _reference_dense_mask(rows)
    mask = found.mask
    assert mask is not None and mask.shape == tuple(expected.shape)
    torch.testing.assert_close(mask.dense(), expected)
    torch.testing.assert_close(
        torch.cat([mask[s : s + 7] for s in range(0, len(rows), 7)]), expected
    )
    B = len(rows)
    back = mask.transposed()
    torch.testing.assert_close(back.dense(), expected[:, :B].T)
    torch.testing.assert_close(
        torch.cat([back[s : s + 6] for s in range(0, B, 6)]), expected[:, :B].T
    )
    n_dup_known = int(expected.sum())
    assert found.duplicates + found.known_positives == n_dup_known


@pytest.mark.parametrize("symmetric", [False, True])
def test_compact_mask_loss_equals_dense_mask_loss(symmetric):
    from densefit.losses import mnrl

    rows = _random_rows(7, n=30)
    emb = embed_lookup(columns_of(rows))
    emb = [e.clone().requires_grad_(True) for e in emb]
    mask = false_negative_mask(rows).mask
    neg = emb[2].reshape(-1, D)
    ref = mnrl(emb[0], emb[1], neg, mask=_reference_dense_mask(rows), symmetric=symmetric)
    grads_ref = torch.autograd.grad(ref, emb[:2])
    for chunk in (None, 4):
        got = mnrl(emb[0], emb[1], neg, mask=mask, symmetric=symmetric, chunk_size=chunk)
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
        for g, r in zip(torch.autograd.grad(got, emb[:2]), grads_ref):
            torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)


def test_in_batch_accuracy_in_blocks_equals_the_full_score_matrix():
    from densefit.training.telemetry import in_batch_accuracy

    torch.manual_seed(0)
    a, p, n = torch.randn(37, 8), torch.randn(37, 8), torch.randn(11, 8)
    p[:20] = a[:20] + 0.1 * torch.randn(20, 8)  # about half the anchors find their positive
    mask = torch.rand(37, 48) < 0.2
    scores = F.normalize(a, dim=-1) @ F.normalize(torch.cat([p, n]), dim=-1).T  # reference
    own = scores.diagonal().clone()
    scores = scores.masked_fill(mask, float("-inf"))
    scores.fill_diagonal_(float("-inf"))
    expected = round(float((own > scores.max(1).values).float().mean()), 4)
    assert 0 < expected < 1
    for block in (1, 5, 1024):
        assert in_batch_accuracy([a, p, n], mask, block=block) == expected
    assert in_batch_accuracy([a, p, n], None) <= expected  # masking only removes competitors


def test_step_records_carry_in_batch_accuracy(tiny):
    records = []
    train(
        tiny,
        WITH_DUPLICATES * 2,
        TrainConfig(batch_size=8, max_steps=2, show_progress=False),
        on_step=records.append,
    )
    assert all(0.0 <= r["in_batch_accuracy"] <= 1.0 for r in records)
