"""Equivalence tests: every memory strategy gives the full-batch loss and gradients."""

import copy
from functools import partial

import pytest
import torch

from densefit.losses import mnrl
from densefit.losses.matryoshka import matryoshka
from densefit.memory import make_chunks, make_strategy, padding_efficiency, tokenize
from densefit.models import enable_gradient_checkpointing

QUERIES = [("what is the cell " * (i % 5 + 1)) + str(i) for i in range(12)]
DOCS = [("the protein gene cancer risk " * (i % 7 + 1)) + str(i) for i in range(12)]
NEGS = [("python function class " * (i % 3 + 1)) + str(i) for i in range(24)]
COLUMNS = [QUERIES, DOCS, NEGS]


def loss_fn(emb):
    return mnrl(emb[0], emb[1], emb[2], symmetric=True)


def run(model, strategy_name, chunk=None, seed=1, columns=COLUMNS, loss=loss_fn, **kw):
    model = copy.deepcopy(model)
    model.train()
    strategy = make_strategy(strategy_name, chunk, **kw)
    strategy.prepare(model)
    torch.manual_seed(seed)
    stats = strategy.forward_backward(model, columns, loss)
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return stats, grads


def full_batch(model, seed=1, columns=COLUMNS, loss_fn=loss_fn):
    """Reference: one padded forward per column, no chunking, no sorting."""
    model = copy.deepcopy(model)
    model.train()
    torch.manual_seed(seed)
    emb = [model(tokenize(model, c))["sentence_embedding"] for c in columns]
    loss = loss_fn(emb)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return float(loss.detach()), grads


@pytest.mark.parametrize("name", ["cache", "cache+checkpoint", "checkpoint"])
@pytest.mark.parametrize("chunk", [1, 4, 5])
def test_strategies_equal_plain_with_dropout_on(tiny, name, chunk):
    """Same chunks, dropout on: RNG replay makes cached gradients exact."""
    ref, ref_grads = run(tiny, "plain", chunk)
    stats, got = run(tiny, name, chunk)
    assert abs(stats.loss - ref.loss) < 1e-5
    torch.testing.assert_close(got, ref_grads, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["plain", "cache", "checkpoint", "cache+checkpoint"])
def test_chunked_and_sorted_equals_one_padded_batch(tiny, name):
    """Regrouping rows and trimming padding changes no result (dropout off)."""
    tiny[0].auto_model.config.hidden_dropout_prob = 0.0
    for module in tiny.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ref_loss, ref_grads = full_batch(tiny)
    for kwargs in (
        {"chunk": 3},
        {"chunk": None, "token_budget": 40},
        {"chunk": 5, "sort_by_length": False},
    ):
        chunk = kwargs.pop("chunk")
        stats, got = run(tiny, name, chunk, **kwargs)
        assert abs(stats.loss - ref_loss) < 1e-5
        torch.testing.assert_close(got, ref_grads, atol=1e-5, rtol=1e-4)


def matryoshka_loss(chunk_size=None):
    nested = matryoshka(partial(mnrl, symmetric=True, chunk_size=chunk_size), [32, 16, 8])
    return lambda emb: nested(emb[0], emb[1], emb[2])


@pytest.mark.parametrize("name", ["plain", "cache", "checkpoint", "cache+checkpoint"])
def test_matryoshka_loss_equals_one_padded_batch(tiny, name):
    """Matryoshka composes with every strategy and with blocked scores (dropout off)."""
    for module in tiny.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ref_loss, ref_grads = full_batch(tiny, loss_fn=matryoshka_loss())
    stats, got = run(tiny, name, 3, loss=matryoshka_loss(chunk_size=4))
    assert abs(stats.loss - ref_loss) < 1e-5
    torch.testing.assert_close(got, ref_grads, atol=1e-5, rtol=1e-4)


def test_cache_matches_full_batch_with_dropout_when_one_chunk(tiny):
    """With a single chunk per column the cache replays the exact full-batch dropout."""
    ref_loss, ref_grads = full_batch(tiny)
    stats, got = run(tiny, "cache", 1000, sort_by_length=False)
    assert abs(stats.loss - ref_loss) < 1e-5
    torch.testing.assert_close(got, ref_grads, atol=1e-5, rtol=1e-4)


def test_cache_leaves_rng_stream_as_plain_does(tiny):
    run(tiny, "plain", 4, seed=3)
    after_plain = torch.get_rng_state()
    run(tiny, "cache", 4, seed=3)
    assert torch.equal(torch.get_rng_state(), after_plain)


def test_length_sorted_chunks_trim_padding(tiny):
    texts = ["a", "the cell " * 20] * 4
    features = tokenize(tiny, texts)
    unsorted = make_chunks(features, chunk_size=4, sort_by_length=False)
    sorted_ = make_chunks(features, chunk_size=4)
    assert padding_efficiency(sorted_) > padding_efficiency(unsorted)
    assert padding_efficiency(sorted_) == pytest.approx(1.0)
    # every row appears exactly once
    rows = torch.cat([c.index for c in sorted_]).sort().values
    assert rows.tolist() == list(range(len(texts)))


def test_token_budget_caps_padded_tokens(tiny):
    texts = [("the cell " * (i % 9 + 1)).strip() for i in range(40)]
    chunks = make_chunks(tokenize(tiny, texts), token_budget=64)
    assert all(c.padded_tokens <= 64 or len(c) == 1 for c in chunks)
    assert sum(len(c) for c in chunks) == 40
    # short texts get more rows per chunk than long ones
    assert len(chunks[0]) > len(chunks[-1])


def test_halved_plan_shrinks_chunk_then_stops():
    plan = make_strategy("cache", 4).plan
    assert plan.halved().chunk_size == 2 and plan.halved().oom_retries == 1
    assert plan.halved().halved().chunk_size == 1
    assert plan.halved().halved().halved() is None
    assert plan.chunk_size == 4  # frozen: halving makes a new plan


def test_checkpointing_same_gradients_fewer_saved_bytes(tiny):
    """Issue 2: checkpointing == plain (dropout off, atol 1e-6) and saves fewer bytes."""
    for module in tiny.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    from densefit.memory.planner import saved_bytes

    texts = DOCS
    params = list(tiny.parameters())

    def forward_backward(model):
        model.zero_grad(set_to_none=True)
        features = tokenize(model, texts)
        nbytes = saved_bytes(lambda: model(features)["sentence_embedding"], exclude=params)
        emb = model(features)["sentence_embedding"]
        loss = mnrl(emb[:6], emb[6:])
        loss.backward()
        return (
            float(loss),
            [p.grad.clone() for p in model.parameters() if p.grad is not None],
            nbytes,
        )

    tiny.train()
    loss_a, grads_a, bytes_plain = forward_backward(tiny)
    enable_gradient_checkpointing(tiny)
    loss_b, grads_b, bytes_ckpt = forward_backward(tiny)
    assert abs(loss_a - loss_b) < 1e-6
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert bytes_ckpt < bytes_plain / 2, (bytes_ckpt, bytes_plain)


def test_chunks_close_early_when_padding_would_be_wasteful(tiny):
    texts = ["a"] * 8 + ["the cell " * 25] * 8
    features = tokenize(tiny, texts)
    chunks = make_chunks(features, chunk_size=16)
    assert [len(c) for c in chunks] == [8, 8]  # not one chunk padded to the long texts
    assert len(make_chunks(features, chunk_size=16, min_efficiency=None)) == 1


@pytest.mark.parametrize("name", ["plain", "cache"])
def test_chunk_features_do_not_keep_model_outputs(tiny, name):
    """The model writes token embeddings into the dict it is given: not into the chunks'."""
    strategy = make_strategy(name, 2)
    seen = []
    original = strategy.chunk_columns

    def spy(model, columns):
        chunked = original(model, columns)
        seen.extend(c for col in chunked for c in col)
        return chunked

    strategy.chunk_columns = spy
    columns = [["a b", "c d e", "f", "g h"], ["x", "y z", "w v u", "t"]]
    strategy.forward_backward(tiny, columns, lambda emb: mnrl(emb[0], emb[1]))
    assert seen and all(
        set(c.features) <= {"input_ids", "attention_mask", "token_type_ids", "modality"}
        for c in seen
    )


@pytest.mark.parametrize("keep", [0, 2, 100])
def test_kept_graphs_give_the_same_gradients(tiny, keep):
    """Chunks whose first-pass graph is kept need no replay: gradients stay exact."""
    ref, ref_grads = run(tiny, "plain", 4)
    for name in ("cache", "cache+checkpoint"):
        stats, got = run(tiny, name, 4, keep_graphs=keep)
        assert abs(stats.loss - ref.loss) < 1e-5
        torch.testing.assert_close(got, ref_grads, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("keep", [0, 1, 3, 100])
def test_kept_chunks_are_not_embedded_again(tiny, keep):
    model = copy.deepcopy(tiny)
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(torch.is_grad_enabled()))
    strategy = make_strategy("cache", 4, keep_graphs=keep)
    stats = strategy.forward_backward(model, COLUMNS, loss_fn)
    n = stats.chunks  # 3 + 3 + 6 chunks of 4 rows
    kept = min(keep, n)
    assert len(calls) == 2 * n - kept
    assert calls[:n] == [False] * (n - kept) + [True] * kept  # the last chunks keep their graph


def test_kept_graph_of_a_column_the_loss_ignores_is_dropped(tiny):
    strategy = make_strategy("cache", 4, keep_graphs=2)
    model = copy.deepcopy(tiny)
    stats = strategy.forward_backward(model, COLUMNS, lambda emb: mnrl(emb[0], emb[1]))
    assert stats.chunks == 12
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_halving_drops_kept_graphs_before_the_chunk():
    plans = [make_strategy("cache", 4, keep_graphs=4).plan]
    for _ in range(3):
        plans.append(plans[-1].halved())
    assert [(p.keep_graphs, p.chunk_size) for p in plans[1:]] == [(2, 4), (1, 4), (1, 2)]
    token = make_strategy("checkpoint", token_budget=64).plan
    assert (token.halved().token_budget, token.halved().chunk_size) == (32, None)
    with pytest.raises(ValueError, match="keep_graphs"):
        make_strategy("cache", 4, keep_graphs=-1)


@pytest.mark.parametrize("name", ["plain", "checkpoint", "cache", "cache+checkpoint"])
def test_plan_to_strategy_to_plan_round_trip(name):
    """Through JSON (a checkpoint, a broadcast) and back: the strategy is what the plan says."""
    import json

    from densefit.memory import CachedStrategy, MemoryPlan

    plan = MemoryPlan(
        name,
        chunk_size=8,
        token_budget=256,
        keep_graphs=3,
        sort_by_length=False,
        loss_block_size=4,
        oom_retries=1,
        chosen_by="planner",
    )
    strategy = make_strategy(MemoryPlan.from_dict(json.loads(json.dumps(plan.to_dict()))))
    assert strategy.plan == plan
    assert (
        strategy.name,
        strategy.chunk_size,
        strategy.token_budget,
        strategy.sort_by_length,
        strategy.checkpoint,
    ) == (name, 8, 256, False, name.endswith("checkpoint"))
    assert isinstance(strategy, CachedStrategy) == name.startswith("cache")
    if name.startswith("cache"):
        assert strategy.keep_graphs == 3
    with pytest.raises(ValueError, match="unknown memory plan fields: chunk"):
        MemoryPlan.from_dict({**plan.to_dict(), "chunk": 1})


def test_the_users_plan_keeps_kept_graphs_and_token_budget():
    from densefit.config.train import TrainConfig
    from densefit.memory.planner import plan_for_run

    config = TrainConfig(memory="cache+checkpoint", keep_graphs=3, token_budget=64)
    strategy = make_strategy(plan_for_run(None, [], config))
    assert (strategy.name, strategy.keep_graphs, strategy.token_budget, strategy.chunk_size) == (
        "cache+checkpoint",
        3,
        64,
        None,
    )
    plain = plan_for_run(None, [], TrainConfig(memory="plain", gradient_checkpointing=True))
    assert (plain.strategy, plain.chunk_size, plain.chosen_by) == ("checkpoint", 16, "user")
