"""Chunking-invariant dropout: every strategy and chunking gives the same loss and gradients."""

import copy

import pytest
import torch
from sentence_transformers import SentenceTransformer

from densefit.config.train import TrainConfig
from densefit.data import TrainingExample
from densefit.losses import mnrl
from densefit.memory import make_strategy, tokenize
from densefit.memory.dropout import (
    InvariantDropout,
    disable_invariant_dropout,
    dropout_rows,
    enable_invariant_dropout,
    is_invariant_dropout,
    step_key,
)
from densefit.models import transformer_of
from densefit.training.loop import train

QUERIES = [("what is the cell " * (i % 5 + 1)) + str(i) for i in range(12)]
DOCS = [("the protein gene cancer risk " * (i % 7 + 1)) + str(i) for i in range(12)]
NEGS = [("python function class " * (i % 3 + 1)) + str(i) for i in range(24)]
COLUMNS = [QUERIES, DOCS, NEGS]

# (strategy, chunk size, options): every way densefit may embed a batch
CHUNKINGS = [
    ("plain", 2, {}),
    ("plain", 3, {}),
    ("plain", 16, {}),
    ("checkpoint", 3, {}),
    ("cache", 1, {}),
    ("cache", 2, {}),
    ("cache", 5, {}),
    ("cache", 4, {"keep_graphs": 0}),
    ("cache", None, {"token_budget": 40}),
    ("cache+checkpoint", 3, {}),
    ("cache+checkpoint", None, {"token_budget": 60, "sort_by_length": False}),
]


def loss_fn(emb):
    return mnrl(emb[0], emb[1], emb[2], symmetric=True)


def run(model, name, chunk=None, *, invariant=True, seed=1, train_mode=True, **kw):
    """Loss and flat parameter gradients of one forward-backward of COLUMNS."""
    model = copy.deepcopy(model)
    model.train(train_mode)
    strategy = make_strategy(name, chunk, **kw)
    strategy.prepare(model)
    if invariant:
        enable_invariant_dropout(model)
    torch.manual_seed(seed)
    stats = strategy.forward_backward(model, COLUMNS, loss_fn)
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return stats.loss, grads


def one_padded_batch(model, **kw):
    """Reference: each column as one chunk, unsorted (one padded batch)."""
    return run(model, "plain", 10_000, sort_by_length=False, **kw)


@pytest.mark.parametrize("name,chunk,kw", CHUNKINGS)
def test_every_chunking_gives_the_one_batch_loss_and_gradients(tiny, name, chunk, kw):
    ref_loss, ref_grads = one_padded_batch(tiny)
    loss, grads = run(tiny, name, chunk, **kw)
    assert abs(loss - ref_loss) < 1e-5
    torch.testing.assert_close(grads, ref_grads, atol=1e-5, rtol=0)


def test_eager_attention_is_invariant_too(tiny):
    transformer_of(tiny).config._attn_implementation = "eager"
    ref_loss, ref_grads = one_padded_batch(tiny)
    for name, chunk in (("plain", 3), ("cache", 2), ("cache+checkpoint", 5)):
        loss, grads = run(tiny, name, chunk)
        assert abs(loss - ref_loss) < 1e-5
        torch.testing.assert_close(grads, ref_grads, atol=1e-5, rtol=0)


def test_without_it_chunkings_draw_different_dropout(tiny):
    """The problem this solves (so the test above would fail if the feature did nothing)."""
    ref_loss, ref_grads = one_padded_batch(tiny, invariant=False)
    for name, chunk in (("plain", 3), ("cache", 2)):
        loss, grads = run(tiny, name, chunk, invariant=False)
        assert abs(loss - ref_loss) > 1e-3
        assert (grads - ref_grads).abs().max() > 1e-3


def test_dropout_is_really_on(tiny):
    loss, grads = run(tiny, "plain", 3)
    eval_loss, eval_grads = run(tiny, "plain", 3, train_mode=False)
    other_key, other_grads = run(tiny, "plain", 3, seed=2)
    assert abs(loss - eval_loss) > 1e-3 and (grads - eval_grads).abs().max() > 1e-3
    assert abs(loss - other_key) > 1e-3 and (grads - other_grads).abs().max() > 1e-3


def _embed_rows(model, texts, rows, key=7, column=0):
    features = tokenize(model, texts)
    with dropout_rows(model, key, column, torch.tensor(rows), features["attention_mask"]):
        return model(features)["sentence_embedding"]


def test_a_rows_masks_ignore_its_chunk_its_place_and_the_padded_width(tiny):
    model = enable_invariant_dropout(tiny).train()
    text, long = "the cell is a unit", "gene " * 30
    alone = _embed_rows(model, [text], [5])[0]
    padded = _embed_rows(model, [long, text], [9, 5])[1]  # second place, 30 tokens wider
    torch.testing.assert_close(padded, alone, atol=1e-6, rtol=0)
    assert (_embed_rows(model, [text], [6])[0] - alone).abs().max() > 1e-3  # another row
    assert (_embed_rows(model, [text], [5], column=1)[0] - alone).abs().max() > 1e-3
    assert (_embed_rows(model, [text], [5], key=8)[0] - alone).abs().max() > 1e-3


def test_left_padding_moves_no_mask(tiny):
    model = enable_invariant_dropout(tiny)
    drop = InvariantDropout(0.5).train()
    x = torch.ones(1, 5, 64)  # (rows, L, features)
    with dropout_rows(model, 3, 0, torch.tensor([4]), torch.tensor([[0, 0, 1, 1, 1]])):
        left = drop(x)
    with dropout_rows(model, 3, 0, torch.tensor([4]), torch.tensor([[1, 1, 1]])):
        right = drop(x[:, :3])
    torch.testing.assert_close(left[:, 2:], right, atol=0, rtol=0)
    assert 0.3 < (right != 0).float().mean() < 0.7  # p = 0.5, 192 draws


def test_drop_rate_and_scale_are_those_of_nn_dropout(tiny):
    model = enable_invariant_dropout(tiny)
    drop = InvariantDropout(0.1).train()
    x = torch.ones(64, 32, 48)
    with dropout_rows(model, 11, 2, torch.arange(64), torch.ones(64, 32, dtype=torch.long)):
        out = drop(x)
    dropped = (out == 0).float().mean()
    assert abs(dropped - 0.1) < 0.005  # 98,304 draws: 5 standard deviations is ~0.005
    assert torch.allclose(out[out != 0], torch.tensor(1 / 0.9))


def test_eval_mode_and_calls_outside_a_strategy_are_untouched(tiny):
    texts = ["what is a cell", "python list " * 9]
    before = tiny.encode(texts, convert_to_tensor=True)
    model = enable_invariant_dropout(copy.deepcopy(tiny))
    torch.testing.assert_close(model.encode(texts, convert_to_tensor=True), before, atol=0, rtol=0)
    features = tokenize(model, texts)
    model.train()
    torch.manual_seed(0)
    got = model(dict(features))["sentence_embedding"]  # ordinary dropout: same stream
    tiny.train()
    torch.manual_seed(0)
    torch.testing.assert_close(got, tiny(dict(features))["sentence_embedding"], atol=0, rtol=0)


def test_disable_restores_the_original_modules(tiny):
    inner = transformer_of(tiny)
    names = [type(m).__name__ for m in inner.modules()]
    enable_invariant_dropout(tiny)
    assert is_invariant_dropout(tiny)
    assert sum(isinstance(m, InvariantDropout) for m in inner.modules()) == 7  # 1 + 3 per layer
    disable_invariant_dropout(tiny)
    assert not is_invariant_dropout(tiny) and inner.config._attn_implementation == "sdpa"
    assert [type(m).__name__ for m in inner.modules()] == names


def test_step_key_draws_once_and_only_when_on(tiny):
    torch.manual_seed(0)
    assert step_key(tiny) is None
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(0).get_state())
    enable_invariant_dropout(tiny)
    torch.manual_seed(0)
    first = step_key(tiny)
    torch.manual_seed(0)
    assert step_key(tiny) == first and step_key(tiny) != first


def _examples():
    return [TrainingExample(q, d, [n]) for q, d, n in zip(QUERIES, DOCS, NEGS)]


def test_training_with_it_ends_on_the_same_weights_whatever_the_memory_plan(tiny, tmp_path):
    ends = []
    for memory, chunk in (("plain", None), ("cache", 2), ("checkpoint", 5)):
        model = copy.deepcopy(tiny)
        config = TrainConfig(
            batch_size=6,
            max_steps=2,
            memory=memory,
            chunk_size=chunk,
            invariant_dropout=True,
            show_progress=False,
            seed=3,
            keep_checkpoints=0,
        )
        train(model, _examples(), config, output_dir=tmp_path / memory)
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    start = torch.cat([p.detach().flatten() for p in tiny.parameters()])
    assert (ends[0] - start).abs().max() > 1e-6  # it trained
    for end in ends[1:]:
        torch.testing.assert_close(end, ends[0], atol=1e-6, rtol=0)
    # the saved model is an ordinary sentence-transformers model with the trained weights
    saved = SentenceTransformer(str(tmp_path / "plain"), device="cpu")
    assert not any(isinstance(m, InvariantDropout) for m in saved.modules())
    assert transformer_of(saved).config._attn_implementation == "sdpa"
    assert "densefit" not in (tmp_path / "plain" / "config.json").read_text()
    loaded = torch.cat([p.detach().flatten() for p in saved.parameters()])
    torch.testing.assert_close(loaded, ends[0], atol=0, rtol=0)


def test_rows_default_to_unpadded_rows_in_order(tiny):
    """The planner's probe enters dropout_rows(model, key) alone: rows 0..c-1, no padding."""
    model = enable_invariant_dropout(tiny).train()
    features = tokenize(model, ["the cell", "a b"])  # 4 tokens each: no padding
    assert bool(features["attention_mask"].all())
    with dropout_rows(model, 5):
        bare = model(dict(features))["sentence_embedding"]
    torch.testing.assert_close(bare, _embed_rows(model, ["the cell", "a b"], [0, 1], key=5))


def _corr(a, b):
    a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
    return float((a * b).mean() / (a.std() * b.std()))


@pytest.mark.parametrize("shape", [(64, 64, 64), (64, 4, 32, 32)])
def test_masks_look_like_independent_draws(tiny, shape):
    """Neighbours (feature, position, head, row, column) are uncorrelated, and so are 2x2
    blocks (the hash mixes a row-position value with a feature value: no XOR structure left)."""
    model = enable_invariant_dropout(tiny)
    drop = InvariantDropout(0.1).train()
    B, L = shape[0], shape[-2]
    mask = torch.ones(B, L, dtype=torch.long)
    with dropout_rows(model, 123, 0, torch.arange(B), mask):
        dropped = (drop(torch.ones(shape)) == 0).float()
    with dropout_rows(model, 123, 1, torch.arange(B), mask):
        other_column = (drop(torch.ones(shape)) == 0).float()
    n = dropped.numel()  # 262,144 (hidden) and 262,144 (attention): 5 sigma ~ 0.01
    assert abs(float(dropped.mean()) - 0.1) < 5 * (0.09 / n) ** 0.5
    for dim in range(dropped.dim()):
        a, b = dropped.narrow(dim, 0, shape[dim] - 1), dropped.narrow(dim, 1, shape[dim] - 1)
        assert abs(_corr(a, b)) < 0.01, dim
    assert abs(_corr(dropped, other_column)) < 0.01
    inner = dropped[..., :-1, :-1] + dropped[..., 1:, :-1] + dropped[..., :-1, 1:]
    parity_even = float(((inner + dropped[..., 1:, 1:]) % 2 == 0).float().mean())
    assert abs(parity_even - (1 + 0.8**4) / 2) < 0.01  # independent Bernoulli(0.1) cells
