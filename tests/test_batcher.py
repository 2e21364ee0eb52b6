"""The micro-batcher alone, without a model or a server: what forms a batch (count, tokens,
waiting, announced requests), the workers and their threads, failures, and stopping."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from densefit.serve.batcher import MicroBatcher, Query, tokens_of


def _run(coroutine):
    return asyncio.run(coroutine)


def item(text: str, tokens: int | None = None) -> Query:
    query = Query(text)
    query.tokens = None if tokens is None else SimpleNamespace(count=tokens)
    return query


class Recorder:
    """A run_batch that records each batch's texts and answers their upper case."""

    def __init__(self, delay: float = 0.0):
        self.batches: list[list[str]] = []
        self.delay = delay

    def __call__(self, batch):
        self.batches.append([q.text for q in batch])
        time.sleep(self.delay)
        return [q.text.upper() for q in batch]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"max_batch": 0}, "max_batch must be at least 1, got 0"),
        ({"max_batch_tokens": 0}, "max_batch_tokens must be at least 1, got 0"),
        ({"max_wait": -0.1}, "max_wait must be >= 0 seconds, got -0.1"),
        ({"workers": 0}, "workers must be at least 1, got 0"),
        ({"threads_per_worker": 0}, "threads_per_worker must be at least 1, got 0"),
    ],
)
def test_bad_options_are_refused_saying_which(options, words):
    with pytest.raises(ValueError, match=f"^{words}$"):
        MicroBatcher(lambda batch: batch, **options)


def test_the_smallest_options_are_allowed():
    batcher = MicroBatcher(
        lambda batch: batch, max_batch=1, max_batch_tokens=1, max_wait=0, workers=1,
        threads_per_worker=1,
    )  # fmt: skip
    assert (batcher.max_batch, batcher.max_batch_tokens, batcher.max_wait) == (1, 1, 0)
    assert batcher.workers == batcher.threads_per_worker == 1
    batcher._executor.shutdown()


def test_a_batcher_not_started_or_stopped_refuses_queries():
    async def main():
        batcher = MicroBatcher(lambda batch: batch)
        for call in (batcher.submit(Query("x")), batcher.search([Query("x")])):
            with pytest.raises(RuntimeError, match="the query batcher is not running"):
                await call
        await batcher.start()
        await batcher.stop()
        with pytest.raises(RuntimeError, match="not running"):
            await batcher.search([Query("y")])

    _run(main())


def test_queries_waiting_together_share_a_batch_up_to_max_batch():
    recorder = Recorder()

    async def main():
        batcher = MicroBatcher(recorder, max_batch=3, max_wait=0.2, on_batch=sizes.append)
        await batcher.start()
        out = await batcher.search([Query(t) for t in "abcdefg"])
        await batcher.stop()
        return out, batcher.batches

    sizes: list[int] = []
    out, batches = _run(main())
    assert out == list("ABCDEFG")
    assert recorder.batches == [["a", "b", "c"], ["d", "e", "f"], ["g"]]
    assert sizes == [3, 3, 1] and batches == 3


def test_a_lone_query_waits_max_wait_for_company_unless_requests_are_announced():
    async def one(announce: bool) -> float:
        batcher = MicroBatcher(Recorder(), max_wait=0.3)
        await batcher.start()
        arrived = batcher.announce() if announce else None
        started = time.perf_counter()
        await batcher.search([Query("a")], arrived)
        took = time.perf_counter() - started
        await batcher.stop()
        return took

    assert _run(one(False)) >= 0.29  # nobody says whether more is coming: it waits
    assert _run(one(True)) < 0.2  # announced and queued: nothing on its way, it starts


def test_a_batch_waits_for_an_announced_request_still_on_its_way():
    recorder = Recorder()

    async def main():
        batcher = MicroBatcher(recorder, max_wait=1.0)
        await batcher.start()
        first, second = batcher.announce(), batcher.announce()
        waiting = asyncio.ensure_future(batcher.search([Query("a")], first))
        await asyncio.sleep(0.05)  # "a" is collected; the second request has not queued yet
        assert recorder.batches == []
        later = await batcher.search([Query("b")], second)
        assert await waiting == ["A"] and later == ["B"]
        await batcher.stop()

    _run(main())
    assert recorder.batches == [["a", "b"]]


def test_arrived_counts_once_however_often_it_is_called():
    batcher = MicroBatcher(lambda batch: batch)
    arrived = batcher.announce()
    batcher.announce()
    assert batcher._arriving == 2 and batcher._announced
    arrived()
    arrived()
    assert batcher._arriving == 1
    batcher._executor.shutdown()


def test_the_token_budget_cuts_batches_and_an_item_over_it_runs_alone():
    recorder = Recorder()

    async def main():
        batcher = MicroBatcher(recorder, max_wait=0.2, max_batch_tokens=10)
        await batcher.start()
        items = [item("a", 4), item("b", 6), item("c", 1), item("d", 25), item("e", 9), item("f")]
        out = await batcher.search(items)
        await batcher.stop()
        return out

    assert _run(main()) == list("ABCDEF")
    # a+b fill 10; c would not fit and starts the next; d alone; e and f (no count) together
    assert recorder.batches == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    assert tokens_of(item("x")) == 0 and tokens_of(item("x", 7)) == 7 and tokens_of("x") == 0


def test_large_requests_are_measured_off_the_event_loop():
    where: list[str] = []

    def measure(items):
        where.append(threading.current_thread().name)
        for it in items:
            it.tokens = SimpleNamespace(count=1)

    async def main():
        batcher = MicroBatcher(lambda batch: [q.tokens.count for q in batch], measure=measure)
        await batcher.start()
        small = await batcher.search([Query("x" * 8192)])
        large = await batcher.search([Query("x" * 8193)])
        single = await batcher.submit(Query("y"))
        await batcher.stop()
        return small, large, single

    assert _run(main()) == ([1], [1], 1)
    loop_thread = threading.main_thread().name
    assert where[0] == loop_thread and where[1] != loop_thread and where[2] == loop_thread


def test_a_failing_measure_refuses_the_request_and_nothing_queues():
    def measure(items):
        raise ValueError("too long")

    recorder = Recorder()

    async def main():
        batcher = MicroBatcher(recorder, measure=measure)
        await batcher.start()
        with pytest.raises(ValueError, match="too long"):
            await batcher.search([Query("a")])
        await batcher.stop()

    _run(main())
    assert recorder.batches == []


def test_a_failing_batch_fails_its_queries_only_and_the_batcher_serves_on():
    calls = []

    def run_batch(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("the model broke")
        return [ValueError("bad query") if q.text == "bad" else q.text for q in batch]

    async def main():
        batcher = MicroBatcher(run_batch, max_wait=0.05)
        await batcher.start()
        with pytest.raises(RuntimeError, match="the model broke"):
            await batcher.submit(Query("a"))
        results = await asyncio.gather(
            batcher.submit(Query("ok")), batcher.submit(Query("bad")), return_exceptions=True
        )
        await batcher.stop()
        return results

    ok, bad = _run(main())
    assert ok == "ok" and isinstance(bad, ValueError) and str(bad) == "bad query"


def test_a_query_whose_client_went_away_is_skipped():
    async def main():
        release = threading.Event()

        def run_batch(batch):
            release.wait(5)
            return [q.text for q in batch]

        batcher = MicroBatcher(run_batch, max_wait=0)
        await batcher.start()
        gone = asyncio.ensure_future(batcher.submit(Query("gone")))
        await asyncio.sleep(0.05)
        gone.cancel()
        release.set()
        assert await batcher.submit(Query("next")) == "next"
        await batcher.stop()

    _run(main())


def test_workers_run_batches_at_once_each_with_its_torch_threads():
    seen: list[tuple[str, int]] = []
    both = threading.Barrier(2, timeout=5)

    def run_batch(batch):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        both.wait()  # two batches in two threads at the same time, or a timeout
        return [q.text for q in batch]

    async def main():
        batcher = MicroBatcher(run_batch, workers=2, threads_per_worker=3, max_batch=1)
        await batcher.start()
        out = await batcher.search([Query("a"), Query("b")])
        await batcher.stop()
        return out

    assert _run(main()) == ["a", "b"]
    assert len({name for name, _ in seen}) == 2
    assert all(name.startswith("densefit-query") and n == 3 for name, n in seen), seen


def test_stop_answers_what_is_queued_first():
    recorder = Recorder(delay=0.05)

    async def main():
        batcher = MicroBatcher(recorder, max_batch=1, max_wait=0)
        await batcher.start()
        pending = [asyncio.ensure_future(batcher.submit(Query(t))) for t in "abc"]
        await asyncio.sleep(0)
        await batcher.stop()
        return [p.result() for p in pending]

    assert _run(main()) == ["A", "B", "C"]
    assert recorder.batches == [["a"], ["b"], ["c"]]


def test_an_idle_server_starts_a_lone_announced_query_at_once_after_earlier_batches():
    """The batches in the workers are counted up and down again (two at once here): once the
    earlier ones are done, a lone announced query does not wait max_wait (a count left off
    zero would make every later query wait as under load)."""

    async def main():
        batcher = MicroBatcher(Recorder(delay=0.2), max_wait=0, workers=2)
        await batcher.start()
        first = asyncio.ensure_future(batcher.submit(Query("x")))
        await asyncio.sleep(0.02)  # "x" runs; "y" starts in the other worker beside it
        assert await asyncio.gather(first, batcher.submit(Query("y"))) == ["X", "Y"]
        batcher.max_wait = 0.5
        took = []
        for text in "abc":
            arrived = batcher.announce()
            started = time.perf_counter()
            assert await batcher.search([Query(text)], arrived) == [text.upper()]
            took.append(time.perf_counter() - started)
        await batcher.stop()
        return took

    assert max(_run(main())) < 0.3


def test_stop_while_a_batch_collects_ends_it_there():
    """stop() while a batch waits max_wait for company: the batch runs at once with what it
    holds and the batcher stops (it does not wait for another first query)."""

    async def main():
        batcher = MicroBatcher(Recorder(), max_wait=2.0)
        await batcher.start()
        pending = asyncio.ensure_future(batcher.submit(Query("a")))
        await asyncio.sleep(0.05)  # "a" is collected and waits for company
        started = time.perf_counter()
        await asyncio.wait_for(batcher.stop(), 5)
        return await pending, time.perf_counter() - started

    answer, took = _run(main())
    assert answer == "A" and took < 1.5


def test_a_query_gone_away_in_a_batch_leaves_the_others_answered():
    """A batch holding a query whose client went away answers the queries after it."""

    async def main():
        release = threading.Event()

        def run_batch(batch):
            if batch[0].text == "warm":
                release.wait(5)  # the worker is busy: the next three queue together
            return [q.text.upper() for q in batch]

        batcher = MicroBatcher(run_batch, max_wait=0)
        await batcher.start()
        warm = asyncio.ensure_future(batcher.submit(Query("warm")))
        await asyncio.sleep(0.05)
        gone, *rest = [asyncio.ensure_future(batcher.submit(Query(t))) for t in ("gone", "x", "y")]
        await asyncio.sleep(0.05)
        gone.cancel()
        release.set()
        answers = await asyncio.wait_for(asyncio.gather(warm, *rest), 5)
        await batcher.stop()
        return answers, batcher.batches

    assert _run(main()) == (["WARM", "X", "Y"], 2)


def test_stop_returns_with_the_running_batch_answered_and_nothing_reported_to_the_loop():
    """stop() while a batch runs in a worker: when it returns, that batch's queries have their
    answers, and no callback failed on the event loop along the way."""
    errors: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: errors.append(context)
        )
        batcher = MicroBatcher(Recorder(delay=0.2), max_wait=0, workers=2)  # a free worker
        await batcher.start()
        assert await batcher.submit(Query("a")) == "A"  # a batch that finished first
        pending = asyncio.ensure_future(batcher.submit(Query("b")))
        await asyncio.sleep(0.05)
        await batcher.stop()
        return pending.done() and pending.result()

    assert _run(main()) == "B"
    assert errors == []
