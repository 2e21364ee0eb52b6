"""``densefit reembed``: re-embed a store with another model while it keeps answering, then
switch (the blue/green steps are :class:`~densefit.retrieval.index.swap.SwapCoordinator`'s,
written once for every engine; this module drives them with the encoder, which loads torch,
so the engines import the coordinator without it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from densefit.models import model_name_of
from densefit.retrieval.encode import encode_with_callback
from densefit.retrieval.index.base import DocumentStore
from densefit.retrieval.index.registry import require
from densefit.retrieval.index.settings import record_for
from densefit.retrieval.index.swap import LOCK_NAME
from densefit.retrieval.runtimes import resolve_runtime

__all__ = ["SwapReport", "reembed_store"]


@dataclass
class SwapReport:
    """What :func:`reembed_store` did."""

    store: str
    old_model: str
    new_model: str
    documents: int = 0  # in the store when the swap switched
    embedded: int = 0  # vectors made by the new model in this run
    resumed: bool = False  # went on with a swap an earlier run started
    passes: int = 0  # walks over the documents (more than one when writes came in)
    switched: bool = False
    runtime: str = "torch"
    seconds: float = 0.0
    encode_seconds: float = 0.0

    def summary(self) -> str:
        how = "resumed" if self.resumed else "started"
        rate = self.embedded / self.encode_seconds if self.encode_seconds else 0.0
        done = f"switched to {self.new_model!r}" if self.switched else "not switched (stopped)"
        return (
            f"{self.store}: model swap {self.old_model!r} -> {self.new_model!r} {how}; "
            f"{self.embedded} documents embedded ({rate:.1f} docs/s, {self.runtime}) in "
            f"{self.passes} pass{'es' if self.passes != 1 else ''}; {done}; "
            f"{self.documents} documents; {self.seconds:.1f}s in all"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def reembed_store(
    store: DocumentStore,
    model,
    *,
    runtime="auto",
    batch_size: int = 64,
    commit_every: int = 1024,
    show_progress: bool = False,
    lock_timeout: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> SwapReport:
    """Re-embed every document of ``store`` with ``model`` and switch the store to it.

    ``model`` is configured as its vectors should be made (prompts, ``max_seq_length``,
    Matryoshka size); the store records those settings at the switch. ``runtime`` runs it
    (:func:`~densefit.retrieval.runtimes.resolve_runtime`). ``should_stop`` is asked
    between commits (a server shutting down): the swap then stays resumable. Holds the
    store's swap lock (:data:`LOCK_NAME`), not its writer lock: indexing and writes go on.

    >>> from densefit.testing import tiny_model
    >>> from densefit.data.types import Document
    >>> from densefit.retrieval.index import open_store, index_documents
    >>> old, new = tiny_model(seed=0), tiny_model(seed=1)
    >>> store = open_store(None, old)
    >>> _ = index_documents(store, old, [Document("a", "cells divide")])
    >>> reembed_store(store, new).switched
    True
    >>> store.check_model(new)  # the store is the new model's now
    """
    if commit_every < 1:
        raise ValueError(f"commit_every must be at least 1, got {commit_every}")
    require(
        store.capabilities, "model_swap", "swap models (densefit reembed)", None, store.location
    )
    started = time.perf_counter()
    report = SwapReport(store.location, store.model_name, model_name_of(model))
    with store.writer_lock(lock_timeout, name=LOCK_NAME, doing="re-embedding this store"):
        runner = resolve_runtime(model, runtime)
        report.runtime = runner.source.describe()
        target, report.resumed = store.begin_swap(record_for(model, store.vector_kind, runner))
        remaining = store.info()["swap"]["remaining"]
        bar = tqdm(total=remaining, desc="Re-embedding", unit="doc", disable=not show_progress)
        with bar:
            while not report.switched:
                report.passes += 1
                after = -1
                while pending := store.swap_pending(after, commit_every):
                    if should_stop is not None and should_stop():
                        report.seconds = time.perf_counter() - started
                        return report
                    if bar.n + len(pending) > bar.total:  # written while the swap runs
                        bar.total = bar.n + len(pending)
                    encoding = time.perf_counter()
                    vectors = encode_with_callback(
                        model,
                        [text for _, _, text in pending],
                        batch_size=batch_size,
                        on_batch=bar.update,
                        prompt_name="document",
                        runtime=runner,
                    )
                    report.encode_seconds += time.perf_counter() - encoding
                    report.embedded += store.write_swap(
                        target, [(row, doc_id) for row, doc_id, _ in pending], vectors
                    )
                    after = pending[-1][0]
                report.switched = store.finish_swap(target)
        store.flush()
    report.documents = store.count()
    report.seconds = time.perf_counter() - started
    return report
