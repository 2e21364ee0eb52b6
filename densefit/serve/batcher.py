"""Micro-batching: queries that arrive within a few milliseconds share one forward pass.

Each HTTP request puts its queries on an asyncio queue and awaits their futures. One task
waits until one of the ``workers`` worker threads is free, then takes the first waiting
query, collects more for up to ``max_wait`` seconds or until ``max_batch`` are waiting, and
hands the batch to that worker, which embeds all of it in one call and searches the store.
A batch is formed only when a worker can start it at once: while every worker is busy, new
queries wait in the queue and all of them join the next batch, so under load the batches
grow by themselves (16 clients with one query each and 2 workers: about 8 per forward
pass) and the forward passes stay few; an idle server answers a lone query after at most
``max_wait``. The app announces each search request as it arrives (:meth:`MicroBatcher.
announce`), before its body is read and validated: when no worker is busy and no announced
request has yet to queue its queries, nothing is on its way and the batch starts at once, so
a lone client's query does not wait ``max_wait`` for company that is not coming. Each
worker thread runs its forward passes with ``threads_per_worker`` torch
threads, so that the workers together use the CPU cores without competing for them.
Throughput and latency against a server that encodes per request:
bench/results/serve.json (``bench/serve.py``). Batched and single-query encodings differ at
the float level (padding), so near-tied hits may swap places; the benchmark counts them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["MicroBatcher", "Query"]


@dataclass
class Query:
    """One query of a search request, with what the search needs besides the text."""

    text: str
    k: int = 10
    filters: dict | None = None
    scale_score: bool = False
    mode: str = "dense"  # densefit.choices.SEARCH_MODES: bm25 queries are not embedded
    future: asyncio.Future | None = field(default=None, repr=False)


class MicroBatcher:
    """Collects :class:`Query` objects and runs them in batches through ``run_batch``.

    ``run_batch(queries)`` runs in a worker thread and returns one result per query, in
    order (an exception object fails only that query). ``on_batch(size)`` is told each
    batch's size (metrics).

    >>> import asyncio
    >>> async def demo():
    ...     batcher = MicroBatcher(lambda qs: [q.text.upper() for q in qs], max_wait=0.01)
    ...     await batcher.start()
    ...     out = await asyncio.gather(*(batcher.submit(Query(t)) for t in "abc"))
    ...     await batcher.stop()
    ...     return out, batcher.batches
    >>> asyncio.run(demo())
    (['A', 'B', 'C'], 1)
    """

    def __init__(
        self,
        run_batch: Callable[[list[Query]], Sequence[object]],
        *,
        max_batch: int = 64,
        max_wait: float = 0.002,
        workers: int = 1,
        threads_per_worker: int | None = None,
        on_batch: Callable[[int], None] | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_wait < 0:
            raise ValueError(f"max_wait must be >= 0 seconds, got {max_wait}")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.run_batch = run_batch
        self.workers = workers
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.on_batch = on_batch
        self.batches = 0
        self._arriving = 0  # announced requests whose queries are not queued yet
        self._announced = False  # True once the app announces requests (else: always wait)
        self._running = 0  # batches in the workers
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        if threads_per_worker is not None and threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be at least 1, got {threads_per_worker}")
        self.threads_per_worker = threads_per_worker
        # One thread per worker: ``workers`` batches are encoded at the same time.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            workers,
            thread_name_prefix="densefit-query",
            initializer=_set_torch_threads,
            initargs=(threads_per_worker,),
        )

    async def start(self) -> None:
        """Start collecting (call from the event loop that will submit)."""
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, query: Query) -> object:
        """Queue ``query`` and wait for its result (or its exception)."""
        if self._task is None or self._task.done():
            raise RuntimeError("the query batcher is not running")
        query.future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(query)
        return await query.future

    async def search(
        self, queries: Sequence[Query], arrived: Callable[[], None] | None = None
    ) -> list[object]:
        """Submit several queries (one request's list) and wait for all of them;
        ``arrived`` (from :meth:`announce`) is called once they are all queued."""
        if self._task is None or self._task.done():
            raise RuntimeError("the query batcher is not running")
        loop = asyncio.get_running_loop()
        for query in queries:
            query.future = loop.create_future()
            self._queue.put_nowait(query)
        if arrived is not None:
            arrived()
        return list(await asyncio.gather(*(q.future for q in queries)))

    def announce(self) -> Callable[[], None]:
        """Say that a search request has arrived whose queries will follow (unless it is
        refused); returns the function to call when they are queued or the request ended
        (calls after the first do nothing). Call on the event loop's thread.

        Once requests are announced, a batch collected while no worker is busy waits (up to
        ``max_wait``) for more queries only while some announced request has not queued its
        queries yet; under load (a worker busy) it always waits, as queries keep coming."""
        self._announced = True
        self._arriving += 1
        done = False

        def arrived() -> None:
            nonlocal done
            if not done:
                done = True
                self._arriving -= 1

        return arrived

    async def stop(self) -> None:
        """Finish the queries already queued, then stop the task and the worker thread."""
        if self._task is not None:
            self._queue.put_nowait(None)
            await self._task
            self._task = None
        self._executor.shutdown(wait=True)

    async def _collect(self, first: Query) -> tuple[list[Query], bool]:
        """``first`` and whatever arrives within ``max_wait``; True when told to stop."""
        loop = asyncio.get_running_loop()
        batch, deadline = [first], loop.time() + self.max_wait
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                if self._announced and self._arriving <= 0 and self._running == 0:
                    break  # an idle server with no request on its way: do not wait
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    async def _run(self) -> None:
        """Wait for a free worker, then collect a batch and start it there: queries that
        arrive while every worker is busy all join the next batch (none is formed early and
        left waiting for a worker while newer queries queue behind it)."""
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(self.workers)
        running: set[asyncio.Future] = set()
        stopping = False
        while not stopping:
            await slots.acquire()
            first = await self._queue.get()
            if first is None:
                break
            batch, stopping = await self._collect(first)
            self.batches += 1
            if self.on_batch is not None:
                self.on_batch(len(batch))
            work = loop.run_in_executor(self._executor, self.run_batch, batch)
            self._running += 1
            running.add(work)
            work.add_done_callback(lambda done, batch=batch: self._finished(batch, done, slots))
            work.add_done_callback(running.discard)
        if running:
            await asyncio.wait(running)

    def _finished(self, batch: list[Query], done: asyncio.Future, slots) -> None:
        self._running -= 1
        self._deliver(batch, done, slots)

    @staticmethod
    def _deliver(batch: list[Query], done: asyncio.Future, slots: asyncio.Semaphore) -> None:
        slots.release()
        try:
            results = done.result()
        except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving
            results = [exc] * len(batch)
        for query, result in zip(batch, results, strict=True):
            if query.future.done():  # the client went away
                continue
            if isinstance(result, BaseException):
                query.future.set_exception(result)
            else:
                query.future.set_result(result)


def _set_torch_threads(threads: int | None) -> None:
    """Run in each worker thread as it starts: its forward passes use ``threads`` torch
    intra-op threads (None: leave torch's setting)."""
    if threads is None:
        return

    torch.set_num_threads(threads)
