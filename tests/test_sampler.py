"""The duplicate-free batch sampler: same batches count and sizes, every row once, O(n)."""

import random
import time

import pytest

from densefit import TrainConfig, TrainingExample, train
from densefit.data.batching import batches, no_duplicate_batches, row_keys


def dataset(n, n_queries, n_docs, seed=0, negatives=1):
    rng = random.Random(seed)
    return [
        TrainingExample(
            f"query {rng.randrange(n_queries)}",
            f"doc {rng.randrange(n_docs)}",
            tuple(f"doc {rng.randrange(n_docs)}" for _ in range(negatives)),
        )
        for _ in range(n)
    ]


def duplicates_in(examples, batch):
    seen, dup = set(), 0
    for i in batch:
        keys = row_keys(examples[i])
        dup += not seen.isdisjoint(keys)
        seen |= keys
    return dup


@pytest.mark.parametrize(
    "n,bs,nq,nd", [(100, 8, 30, 200), (257, 16, 500, 40), (64, 64, 64, 64), (50, 7, 3, 3)]
)
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_count_sizes_and_every_row_once(n, bs, nq, nd, drop_last):
    examples = dataset(n, nq, nd)
    plain = batches(n, bs, seed=1, epoch=2, drop_last=drop_last)
    got = no_duplicate_batches(examples, plain)
    assert [len(b) for b in got] == [len(b) for b in plain]
    assert sorted(i for b in got for i in b) == sorted(i for b in plain for i in b)
    assert got == no_duplicate_batches(examples, plain)  # deterministic: same on every rank


def test_removes_duplicates_when_the_data_allows():
    examples = dataset(400, 100, 1000, seed=3)  # each query about 4 times
    plain = batches(len(examples), 16, seed=0, epoch=0)
    before = sum(duplicates_in(examples, b) for b in plain)
    got = no_duplicate_batches(examples, plain)
    after = sum(duplicates_in(examples, b) for b in got)
    assert before > 10
    assert after == 0


def test_all_identical_rows_still_fill_every_batch():
    examples = [TrainingExample("same query", "same doc")] * 50
    got = no_duplicate_batches(examples, batches(50, 8, seed=0, epoch=0))
    assert [len(b) for b in got] == [8] * 6 + [2]
    assert sorted(i for b in got for i in b) == list(range(50))


def test_linear_time_on_heavy_duplicates():
    """Bounded looks at deferred rows: 60k rows of 3 queries take seconds, not minutes.

    CPU time of this process, so that other work on the machine does not count.
    """
    examples = dataset(60_000, 3, 3, negatives=0)
    plain = batches(len(examples), 64, seed=0, epoch=0)
    started = time.process_time()
    got = no_duplicate_batches(examples, plain)
    assert time.process_time() - started < 10
    assert sum(len(b) for b in got) == 60_000


def test_training_with_no_duplicates_keeps_the_step_count(tiny):
    examples = dataset(40, 30, 200, negatives=1)  # about 1.3 rows per query: feasible
    records = []
    result = train(
        tiny,
        examples,
        TrainConfig(batch_size=8, no_duplicates=True, show_progress=False),
        on_step=records.append,
    )
    assert result.steps == 5 and result.examples == 40
    assert all(r["masked_duplicates"] == 0 for r in records)
