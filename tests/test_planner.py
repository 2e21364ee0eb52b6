import pytest
import torch

from densefit import TrainConfig, TrainingExample
from densefit.config.train import parse_bytes
from densefit.data.batching import planned_batches
from densefit.memory.planner import (
    CPU_MAX_CHUNK_ROWS,
    HEADROOM,
    RELATIVE_TIME,
    ActivationModel,
    plan_for_run,
    plan_memory,
    resolve_budget,
    saved_bytes,
)


def model_only(model) -> int:
    """Pin the process to holding just the model: these tests are of the planner's choices."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


ROWS = [
    TrainingExample(f"query {i} " * (i % 4 + 1), f"the cell protein {i} " * (i % 9 + 1))
    for i in range(50)
]


def test_parse_bytes():
    assert parse_bytes("1GiB") == 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(1024) == 1024
    with pytest.raises(ValueError, match="8GiB"):
        parse_bytes("eight gigs")


def test_resolve_budget_fraction_and_size():
    assert resolve_budget("2GiB", torch.device("cpu")) == 2 * 2**30
    assert (
        0 < resolve_budget("10%", torch.device("cpu")) < resolve_budget("0.5", torch.device("cpu"))
    )


def test_plain_when_it_fits_cache_when_not(tiny):
    big = plan_memory(
        tiny, ROWS, TrainConfig(batch_size=32, memory_budget="4GiB"), held_bytes=model_only(tiny)
    )
    assert big.strategy == "plain"
    small = plan_memory(
        tiny, ROWS, TrainConfig(batch_size=4096, memory_budget="40MiB"), held_bytes=model_only(tiny)
    )
    assert small.strategy in ("cache", "cache+checkpoint")
    assert small.predicted_peak_bytes <= small.budget_bytes
    rows = chosen(small)["chunk_size"]  # rows per chunk at the longest length
    assert small.token_budget >= rows and small.chunk_size is None  # capped in tokens only
    assert "largest chunk" in small.reason
    assert "predicted peak" in small.table()


def chosen(plan) -> dict:
    """The planner's row of the strategy it chose."""
    return next(c for c in plan.candidates if c["strategy"] == plan.strategy)


def test_planner_raises_clear_error_when_nothing_fits(tiny):
    with pytest.raises(MemoryError, match="raise --memory-budget"):
        plan_memory(tiny, ROWS, TrainConfig(batch_size=64, memory_budget="1KiB"))


def test_planner_picks_largest_fitting_chunk():
    from densefit.testing import tiny_model

    model = tiny_model()
    act = ActivationModel(per_token=1000.0, per_token_squared=0.0)
    plan = plan_memory(
        model,
        ROWS,
        TrainConfig(batch_size=1024, memory_budget="12MiB"),
        activation_model=act,
        held_bytes=model_only(model),
    )
    # doubling the chosen chunk must not fit (on CPU the planner also stops at 32 rows)
    rows = chosen(plan)["chunk_size"]
    longest = max(v["max"] for v in plan.lengths.values())
    next_peak = plan.predicted_peak_bytes + HEADROOM * act.bytes(rows, longest)
    assert plan.strategy == "cache" and plan.token_budget == rows * longest
    assert rows == CPU_MAX_CHUNK_ROWS or next_peak > plan.budget_bytes
    assert rows <= CPU_MAX_CHUNK_ROWS


def test_probe_does_not_touch_the_random_stream(tiny):
    torch.manual_seed(5)
    before = torch.get_rng_state()
    config = TrainConfig(batch_size=8, memory_budget="1GiB")
    plan_memory(tiny, ROWS, config, held_bytes=model_only(tiny))
    assert torch.equal(torch.get_rng_state(), before)


def test_probe_scales_with_tokens(tiny):
    from densefit.memory.planner import probe_activations

    act = probe_activations(tiny, 32)
    assert act.bytes(8, 32) > act.bytes(4, 32) > act.bytes(4, 16) > 0


def test_saved_bytes_counts_activations_not_parameters():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(100, 64, requires_grad=True)
    n = saved_bytes(lambda: torch.tanh(lin(x)), exclude=list(lin.parameters()))
    assert n == 2 * 100 * 64 * 4  # the input of the linear and the tanh output


def test_plan_for_the_runs_real_batches_is_tighter_than_worst_case(tiny):
    rows = [TrainingExample("q", "cell " * (60 if i < 8 else 2)) for i in range(64)]
    config = TrainConfig(batch_size=8, memory_budget="4GiB", chunk_size=4)
    act = ActivationModel(per_token=1000.0, per_token_squared=0.0)
    held = model_only(tiny)
    batches = planned_batches(rows, config)
    exact = plan_memory(tiny, rows, config, batches=batches, activation_model=act, held_bytes=held)
    worst = plan_memory(tiny, rows, config, activation_model=act, held_bytes=held)
    plain = lambda p: next(c for c in p.candidates if c["strategy"] == "plain")["peak_bytes"]  # noqa: E731
    assert plain(exact) < plain(worst)
    assert exact.lengths["positives"]["exact"] is True
    assert "largest batch of this run" in exact.reason


def test_group_rows_is_what_make_chunks_runs(tiny):
    from densefit.memory.chunking import group_rows, make_chunks, tokenize

    texts = [("the cell " * (i % 11 + 1)).strip() for i in range(50)]
    features = tokenize(tiny, texts)
    lengths = features["attention_mask"].sum(1).tolist()
    for kw in (
        {"chunk_size": 8},
        {"token_budget": 100},
        {"chunk_size": 16, "sort_by_length": False},
    ):
        chunks = make_chunks(features, **kw)
        assert [c.index.tolist() for c in chunks] == group_rows(lengths, **kw)


def test_cache_keeps_as_many_chunk_graphs_as_the_budget_allows():
    from densefit.testing import tiny_model

    model = tiny_model()
    act = ActivationModel(per_token=1000.0, per_token_squared=0.0)
    plans = [
        plan_memory(
            model,
            ROWS,
            TrainConfig(batch_size=1024, memory_budget=b),
            activation_model=act,
            held_bytes=model_only(model),
        )
        for b in ("10MiB", "12MiB", "16MiB")
    ]
    assert [p.strategy for p in plans] == ["cache"] * 3
    keeps = [p.keep_graphs for p in plans]
    assert keeps == sorted(keeps) and keeps[0] >= 1 and keeps[-1] > keeps[0]
    for p in plans:
        assert p.predicted_peak_bytes <= p.budget_bytes
        chosen = next(c for c in p.candidates if c["strategy"] == "cache")
        assert chosen["keep_graphs"] == p.keep_graphs
        assert chosen["relative_time"] < RELATIVE_TIME["cache"]  # kept chunks are not re-embedded
        assert "graph(s) kept" in p.table()
    times = [
        next(c for c in p.candidates if c["strategy"] == "cache")["relative_time"] for p in plans
    ]
    assert times[-1] < times[0]


def test_auto_strategy_carries_the_planned_kept_graphs(tiny):
    import dataclasses

    from densefit.memory import make_strategy

    rows = ROWS * 82  # one batch of 4,096
    from densefit.memory.process import STEP_SETUP_BYTES, resident_bytes

    # the budget is for the whole process: what it holds now, the first step's allocator
    # pages and backward setup, and 40 MiB for training
    budget = resident_bytes() + STEP_SETUP_BYTES + 40 * 2**20
    config = TrainConfig(batch_size=4096, memory_budget=budget, memory="auto", show_progress=False)
    plan = plan_for_run(tiny, rows, config)
    strategy = make_strategy(plan)
    assert plan.strategy == "cache" and plan.chosen_by == "planner"
    assert strategy.keep_graphs == plan.keep_graphs >= 1
    assert strategy.token_budget == plan.token_budget and strategy.chunk_size is None
    plan = plan_for_run(tiny, rows, dataclasses.replace(config, keep_graphs=0))
    assert make_strategy(plan).keep_graphs == 0


def test_cache_chunks_are_planned_from_the_runs_real_chunks(tiny):
    """With the run's batches known, a chunk budget is costed by the chunks it really cuts.

    One long text per batch: no chunk of this run is ever full of long texts, so a larger
    token budget fits than the worst case (a full chunk of the longest texts) allows.
    """
    from densefit.memory.chunking import make_chunks, tokenize

    rows = [TrainingExample("q", "cell " * (60 if i % 64 == 0 else 3)) for i in range(256)]
    config = TrainConfig(batch_size=64, chunk_size=None)
    act = ActivationModel(per_token=1000.0, per_token_squared=100.0)
    batches = planned_batches(rows, config)
    cache = lambda p: next(c for c in p.candidates if c["strategy"] == "cache")  # noqa: E731
    static = plan_memory(
        tiny,
        rows,
        TrainConfig(batch_size=64, memory_budget="4GiB"),
        activation_model=act,
        held_bytes=model_only(tiny),
    ).static_bytes
    wider = 0
    for extra in (2**20, 2**21, 2**22, 2**23):
        budget = TrainConfig(batch_size=64, memory_budget=static + extra)
        exact = cache(
            plan_memory(
                tiny,
                rows,
                budget,
                batches=batches,
                activation_model=act,
                held_bytes=model_only(tiny),
            )
        )
        worst = cache(
            plan_memory(tiny, rows, budget, activation_model=act, held_bytes=model_only(tiny))
        )
        assert exact["token_budget"] >= worst["token_budget"]
        wider += exact["token_budget"] > worst["token_budget"]
        # the prediction covers every chunk training will cut at that budget
        for b in batches:
            texts = [rows[i].positive for i in b]
            for c in make_chunks(tokenize(tiny, texts), token_budget=exact["token_budget"]):
                n, length = c.features["attention_mask"].shape
                assert static + HEADROOM * act.bytes(n, length) <= exact["peak_bytes"]
    assert wider >= 1


def test_plain_falls_back_to_smaller_plain_chunks_before_recomputing(tiny):
    """Heavy-tailed lengths: chunks of 8 trim more padding than 16, so plain fits in less."""
    rows = [TrainingExample("q " * (i % 7 + 1), "cell " * (2 + (i * 37) % 61)) for i in range(64)]
    act = ActivationModel(per_token=1000.0, per_token_squared=10.0)
    config = TrainConfig(batch_size=64, memory_budget="4GiB")
    batches = planned_batches(rows, config)
    plain = lambda p: next(c for c in p.candidates if c["strategy"] == "plain")  # noqa: E731
    roomy = plan_memory(
        tiny, rows, config, batches=batches, activation_model=act, held_bytes=model_only(tiny)
    )
    assert (roomy.strategy, roomy.chunk_size) == ("plain", 16)
    eight = plain(
        plan_memory(
            tiny,
            rows,
            TrainConfig(batch_size=64, memory_budget="4GiB", chunk_size=8),
            batches=batches,
            activation_model=act,
            held_bytes=model_only(tiny),
        )
    )["peak_bytes"]
    assert eight < roomy.predicted_peak_bytes
    between = TrainConfig(batch_size=64, memory_budget=(eight + roomy.predicted_peak_bytes) // 2)
    tight = plan_memory(
        tiny, rows, between, batches=batches, activation_model=act, held_bytes=model_only(tiny)
    )
    assert (tight.strategy, tight.chunk_size, tight.predicted_peak_bytes) == ("plain", 8, eight)
    # a chunk the user chose is kept: then plain does not fit and something else is chosen
    fixed = plan_memory(
        tiny,
        rows,
        TrainConfig(batch_size=64, memory_budget=between.memory_budget, chunk_size=16),
        batches=batches,
        activation_model=act,
        held_bytes=model_only(tiny),
    )
    assert fixed.strategy != "plain"
