"""Matryoshka (issue 15.2): the loss wrapper, its equality under every memory path, the
planner's score blocks, and stores / evaluation at a chosen size."""

import copy
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from densefit.config.train import TrainConfig
from densefit.data.types import Document, TrainingExample
from densefit.errors import OptionError
from densefit.losses import margin_mse, mnrl
from densefit.losses.matryoshka import matryoshka, truncate
from densefit.memory.planner import probe_run
from densefit.retrieval.encode import configure_model, encode_texts
from densefit.retrieval.index.engines import open_store
from densefit.retrieval.index.indexing import index_documents
from densefit.retrieval.index.searching import search_batch
from densefit.retrieval.index.types import ModelMismatchError
from densefit.training.objective import make_loss_fn
from densefit.training.setup import setup_run
from densefit.training.step import train_step

DIMS = [32, 16, 8]
WEIGHTS = [1.0, 0.5, 0.25]


def grads_of(fn, *tensors):
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_full_size_alone_is_exactly_the_plain_loss(similarity):
    a, p, n = torch.randn(6, 32), torch.randn(6, 32), torch.randn(12, 32)
    plain = partial(mnrl, similarity=similarity)
    ref, ref_grads = grads_of(plain, a, p, n)
    got, got_grads = grads_of(matryoshka(plain, [32]), a, p, n)
    assert torch.equal(got, ref)
    for g, r in zip(got_grads, ref_grads):
        assert torch.equal(g, r)


def test_sum_over_truncated_renormalised_embeddings():
    a, p = F.normalize(torch.randn(5, 32), dim=-1), F.normalize(torch.randn(5, 32), dim=-1)
    expected = sum(
        w * mnrl(F.normalize(a[:, :d], dim=-1), F.normalize(p[:, :d], dim=-1), similarity="dot")
        for d, w in zip(DIMS, WEIGHTS)
    )
    got = matryoshka(partial(mnrl, similarity="dot"), DIMS, WEIGHTS)(a, p)
    torch.testing.assert_close(got, expected)
    # rescaled to the full vector's norm: unit vectors stay unit
    assert torch.allclose(truncate(a, 8).norm(dim=-1), torch.ones(5))


def test_chunked_and_masked_scores_give_the_same_loss_and_gradients():
    a, p, n = torch.randn(9, 32), torch.randn(9, 32), torch.randn(9, 2, 32)
    mask = torch.rand(9, 27) < 0.2
    whole = matryoshka(partial(mnrl, symmetric=True, mask=mask), DIMS, WEIGHTS)
    blocks = matryoshka(partial(mnrl, symmetric=True, mask=mask, chunk_size=2), DIMS, WEIGHTS)
    ref, ref_grads = grads_of(whole, a, p, n)
    got, got_grads = grads_of(blocks, a, p, n)
    torch.testing.assert_close(got, ref)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_margin_mse_keeps_the_teacher_scores_whole():
    a, p, n = torch.randn(4, 32), torch.randn(4, 32), torch.randn(4, 32)
    scores = torch.randn(4)
    got = matryoshka(margin_mse, [32, 16])(a, p, n, scores)
    expected = margin_mse(a, p, n, scores) + margin_mse(
        truncate(a, 16), truncate(p, 16), truncate(n, 16), scores
    )
    torch.testing.assert_close(got, expected)


def test_a_size_above_the_model_is_an_error():
    with pytest.raises(ValueError, match="above the model's embedding size 32"):
        matryoshka(mnrl, [64, 16])(torch.randn(2, 32), torch.randn(2, 32))


def test_options_are_read_checked_and_matched():
    config = TrainConfig(matryoshka_dims="32, 16,8", matryoshka_weights="1,0.5,0.25")
    assert (config.matryoshka_dims, config.matryoshka_weights) == (DIMS, WEIGHTS)
    assert TrainConfig(matryoshka_dims=[16, 8]).matryoshka_dims == [16, 8]  # YAML list
    for bad in ("a,b", "16,16", "0"):
        with pytest.raises(OptionError, match="matryoshka_dims"):
            TrainConfig(matryoshka_dims=bad)
    with pytest.raises(OptionError, match="matryoshka_weights"):
        TrainConfig(matryoshka_dims="16", matryoshka_weights="0")
    rows = [TrainingExample("q", "p"), TrainingExample("r", "s")]
    with pytest.raises(ValueError, match="2 weight"):
        make_loss_fn(TrainConfig(matryoshka_dims="32,16,8", matryoshka_weights="1,1"), rows)
    with pytest.raises(ValueError, match="needs --matryoshka-dims"):
        make_loss_fn(TrainConfig(matryoshka_weights="1,1"), rows)


def test_the_batch_loss_is_the_weighted_sum_per_size():
    rows = [TrainingExample(f"q{i}", f"p{i}", (f"n{i}",)) for i in range(4)]
    emb = [torch.randn(4, 32), torch.randn(4, 32), torch.randn(4, 32)]
    plain = make_loss_fn(TrainConfig(similarity="cosine"), rows)
    nested = make_loss_fn(
        TrainConfig(similarity="cosine", matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS), rows
    )
    expected = sum(w * plain([truncate(e, d) for e in emb]) for d, w in zip(DIMS, WEIGHTS))
    torch.testing.assert_close(nested(emb), expected)


ROWS = [
    TrainingExample(
        ("what is the cell " * (i % 4 + 1)) + str(i),
        ("the protein gene " * (i % 5 + 1)) + str(i),
        (("python function " * (i % 3 + 1)) + str(i),),
    )
    for i in range(10)
]


def one_step(model, **options):
    config = TrainConfig(
        batch_size=len(ROWS), max_grad_norm=None, show_progress=False, keep_checkpoints=0,
        matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS, **options,
    )  # fmt: skip
    model = copy.deepcopy(model)
    model.train()
    run = setup_run(model, ROWS, config)
    torch.manual_seed(0)
    record = train_step(run, [list(range(len(ROWS)))])
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return record["loss"], grads


@pytest.mark.parametrize(
    "options",
    [
        {"memory": "cache", "chunk_size": 3},
        {"memory": "cache", "chunk_size": 4, "loss_block_size": 3, "symmetric": True},
        {"memory": "checkpoint", "chunk_size": 4},
        {"memory": "cache+checkpoint", "chunk_size": 2, "loss_block_size": 2},
    ],
)
def test_training_step_equals_plain_under_every_memory_path(tiny, options):
    """Dropout off: regrouped, length-sorted chunks change no result."""
    for module in tiny.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    reference = {"memory": "plain", "symmetric": options.get("symmetric", False)}
    ref_loss, ref_grads = one_step(tiny, **reference)
    loss, grads = one_step(tiny, **options)
    assert abs(loss - ref_loss) < 1e-5
    torch.testing.assert_close(grads, ref_grads, atol=1e-5, rtol=1e-4)


def test_matryoshka_changes_the_gradients(tiny):
    """Sanity: the equality above is not vacuous."""
    nested, _ = one_step(tiny, memory="plain")
    config = TrainConfig(batch_size=len(ROWS), show_progress=False)
    plain = setup_run(copy.deepcopy(tiny), ROWS, config)
    assert abs(train_step(plain, [list(range(len(ROWS)))])["loss"] - nested) > 1e-3


def test_planner_counts_one_score_block_per_size_unless_blocked(tiny):
    def shape(**options):
        config = TrainConfig(batch_size=8, memory_budget="1GiB", **options)
        return probe_run(tiny, ROWS, config, None, 1000, None)

    plain, nested = shape(), shape(matryoshka_dims=DIMS)
    assert nested.loss_bytes(None) == len(DIMS) * plain.loss_bytes(None)
    assert nested.loss_bytes(2) == plain.loss_bytes(2)  # blocked: one block at a time
    assert nested.embeddings > plain.embeddings  # the cut copies held for backward
    zero = shape(matryoshka_dims=DIMS, matryoshka_weights=[1, 0, 0])
    assert zero.loss_bytes(None) == plain.loss_bytes(None)


DOCS = [Document(f"d{i}", f"document {i} about " + "cells " * i) for i in range(6)]


def unit_cut(vectors, dim):
    """What a cosine store holds at ``dim``: the Matryoshka cut, at unit length."""
    cut = truncate(torch.from_numpy(vectors), dim)
    return F.normalize(cut, dim=-1).numpy()


def test_a_store_indexed_at_a_size_holds_cut_renormalised_vectors(tiny):
    full_vectors = encode_texts(tiny, [d.text for d in DOCS])
    model = configure_model(copy.deepcopy(tiny), dim=8)
    store = open_store(None, model)
    index_documents(store, model, DOCS)
    assert store.dim == 8 and store.settings.truncate_dim == 8
    np.testing.assert_allclose(
        store.vectors([d.id for d in DOCS]), unit_cut(full_vectors, 8), atol=1e-6
    )
    hits = search_batch(store, model, ["cells cells"], top_k=2)[0]
    query = unit_cut(encode_texts(tiny, ["cells cells"]), 8)[0]
    best = max(DOCS, key=lambda d: float(unit_cut(full_vectors, 8)[DOCS.index(d)] @ query))
    assert hits[0].id == best.id
    with pytest.raises(ModelMismatchError, match="--dim 8"):
        search_batch(store, tiny, ["cells"])  # the full-size model cannot search it


def test_dim_above_the_model_is_refused(tiny):
    with pytest.raises(ValueError, match="--dim 64: the model makes 32-d"):
        configure_model(copy.deepcopy(tiny), dim=64)


def test_evaluation_at_a_size_equals_a_store_indexed_at_that_size(tiny):
    from densefit.evaluate import evaluate

    queries = {"q1": "cells cells", "q2": "document 2"}
    qrels = {"q1": {"d5": 1}, "q2": {"d2": 1}}
    full = open_store(None, tiny)
    index_documents(full, tiny, DOCS)
    (at_8,) = evaluate(
        tiny, full, queries=queries, qrels=qrels, dims=[8], metrics=["ndcg@3", "recall@2"]
    )
    model = configure_model(copy.deepcopy(tiny), dim=8)
    direct = open_store(None, model)
    index_documents(direct, model, DOCS)
    reference = evaluate(
        model, direct, queries=queries, qrels=qrels, metrics=["ndcg@3", "recall@2"]
    )
    assert at_8.metrics == pytest.approx(reference.metrics)
    assert at_8.info["dim"] == 8 and at_8.name.endswith("@8")
    assert getattr(tiny, "truncate_dim", None) is None  # the model is left as it was


def test_dims_above_the_model_are_refused_before_anything_is_written(tiny, tmp_path):
    from densefit import TrainConfig, train
    from densefit.errors import OptionError

    rows = [TrainingExample(f"q {i}", f"d {i}") for i in range(4)]
    config = TrainConfig(batch_size=2, matryoshka_dims=[64, 16], show_progress=False)
    with pytest.raises(OptionError, match="64: above the model's embedding size 32"):
        train(tiny, rows, config, output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # no log, no checkpoint folder
