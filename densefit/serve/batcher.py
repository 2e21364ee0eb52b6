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

A batch is capped by tokens as well as by count (``max_batch_tokens``, as
text-embeddings-inference's ``--max-batch-tokens``): each item carries its token count
(``measure``, run as a request queues its items: the texts tokenized once, as the forward
pass will read them), and the item that would take a batch over the budget starts the next
batch instead (nothing overtakes it). An item over the budget by itself forms a batch alone.
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

from densefit.retrieval.encode import TextTokens
from densefit.retrieval.index.request import SearchRequest

__all__ = ["MicroBatcher", "Query"]


@dataclass
class Query:
    """One query of a search request, with what the search needs besides the text."""

    text: str
    # how to search (mode, k, parsed filter...): one per HTTP request, shared by its queries
    request: SearchRequest = field(default_factory=SearchRequest)
    future: asyncio.Future | None = field(default=None, repr=False)
    tokens: TextTokens | None = field(default=None, repr=False)  # set by the batcher's measure


# Requests with more characters than this are measured (tokenized) in a thread, not on the
# event loop: a search of a few queries takes tens of microseconds, 2,048 long inputs seconds.
_INLINE_CHARS = 8192


def tokens_of(item) -> int:
    """The tokens ``item`` adds to a batch: its measured count (0 when not measured, and for
    BM25 queries, which are not embedded)."""
    tokens = getattr(item, "tokens", None)
    return 0 if tokens is None else tokens.count


class MicroBatcher:
    """Collects :class:`Query` objects and runs them in batches through ``run_batch``.

    ``run_batch(queries)`` runs in a worker thread and returns one result per query, in
    order (an exception object fails only that query). ``on_batch(size)`` is told each
    batch's size (metrics). ``measure(items)`` sets each item's ``tokens`` before it is
    queued (an exception refuses the request); a batch holds at most ``max_batch`` items and
    ``max_batch_tokens`` tokens (:func:`tokens_of`; None: no token cap), or one item.

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
        max_batch_tokens: int | None = None,
        measure: Callable[[Sequence[object]], None] | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
        if max_wait < 0:
            raise ValueError(f"max_wait must be >= 0 seconds, got {max_wait}")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.run_batch = run_batch
        self.workers = workers
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.measure = measure
        self.max_wait = max_wait
        self.on_batch = on_batch
        self.batches = 0
        self._arriving = 0  # announced requests whose queries are not queued yet
        self._announced = False  # True once the app announces requests (else: always wait)
        self._running = 0  # batches in the workers
        self._queue: asyncio.Queue | None = None
        self._held: object | None = None  # left out of a full batch: it starts the next one
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
        await self._measure([query])
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
        await self._measure(queries)
        loop = asyncio.get_running_loop()
        for query in queries:
            query.future = loop.create_future()
            self._queue.put_nowait(query)
        if arrived is not None:
            arrived()
        return list(await asyncio.gather(*(q.future for q in queries)))

    async def _measure(self, items: Sequence[object]) -> None:
        """``measure(items)``: on the event loop for a small request, in a thread for a large
        one (the loop keeps answering the others meanwhile)."""
        if self.measure is None:
            return
        if sum(len(getattr(item, "text", "")) for item in items) <= _INLINE_CHARS:
            self.measure(items)
        else:
            await asyncio.get_running_loop().run_in_executor(None, self.measure, items)

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
        """``first`` and whatever arrives within ``max_wait``, up to ``max_batch`` items and
        ``max_batch_tokens`` tokens; True when told to stop."""
        loop = asyncio.get_running_loop()
        batch, deadline = [first], loop.time() + self.max_wait
        budget, used = self.max_batch_tokens, tokens_of(first)
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
            if budget is not None and used + tokens_of(item) > budget:
                self._held = item  # the batch is full: this item is the next one's first
                break
            batch.append(item)
            used += tokens_of(item)
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
            first, self._held = self._held, None
            if first is None:
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
