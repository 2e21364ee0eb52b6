"""One writer: upserts and deletes go through one thread, acknowledged after they commit.

The writer thread embeds a batch of documents (outside the store's lock, so searches keep
running while it encodes) and then writes it in one store transaction; the caller's future
is resolved only after :meth:`DocumentStore.write <densefit.retrieval.index.base.DocumentStore.write>` returned, i.e. after the vectors were
fsync'd and the SQLite transaction committed. The next search sees the documents: the store
object is shared, and its live-row mask is updated in place by the commit.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from densefit.data.types import Document
from densefit.retrieval.index.types import ModelSwappedError
from densefit.serve.swap import SWAP_RETRIES

__all__ = ["DocumentWriter", "WriteAck"]


@dataclass(frozen=True)
class WriteAck:
    """What a committed write did; returned only after the commit."""

    added: int = 0
    updated: int = 0
    deleted: int = 0


class DocumentWriter:
    """A queue and one thread that embeds and commits writes to ``store``, in order.

    ``embed(texts)`` returns the embeddings of document texts (a ``(n, dim)`` array);
    ``after_ack()`` runs after each acknowledged write, before the next one.

    >>> import numpy as np
    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.index import open_store
    >>> from densefit.retrieval.encode import encode_texts
    >>> model = tiny_model()
    >>> store = open_store(None, model)
    >>> writer = DocumentWriter(store, lambda texts: encode_texts(model, texts))
    >>> writer.start()
    >>> writer.upsert([Document("a", "cells divide")]).result()
    WriteAck(added=1, updated=0, deleted=0)
    >>> writer.delete(["a", "zz"]).result()
    WriteAck(added=0, updated=0, deleted=1)
    >>> writer.stop()
    """

    def __init__(
        self,
        store,
        embed: Callable[[list[str]], object],
        *,
        swap_vectors: Callable[[list[str]], tuple | None] | None = None,
        on_commit: Callable[[], None] | None = None,
        on_error: Callable[[], None] | None = None,
        after_ack: Callable[[], None] | None = None,
    ):
        self.store = store
        self.embed = embed
        self.swap_vectors = swap_vectors  # a model swap's target and its vectors, or None
        self.on_commit = on_commit
        self.on_error = on_error
        self.after_ack = after_ack  # work after the caller was answered (e.g. the BM25 index)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the writer thread."""
        self._thread = threading.Thread(target=self._run, name="densefit-writer", daemon=True)
        self._thread.start()

    def upsert(self, documents: Sequence[Document]) -> concurrent.futures.Future:
        """Queue an upsert; the future resolves to a :class:`WriteAck` after the commit."""
        return self._put(("upsert", list(documents)))

    def delete(self, ids: Sequence[str]) -> concurrent.futures.Future:
        """Queue a delete by id; unknown ids are ignored (the ack counts the deleted ones)."""
        return self._put(("delete", list(ids)))

    @property
    def pending(self) -> int:
        """Writes queued and not yet committed."""
        return self._queue.qsize()

    def stop(self) -> None:
        """Commit every queued write, then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _put(self, item: tuple) -> concurrent.futures.Future:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the document writer is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((*item, future))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, payload, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                ack = self._apply(kind, payload)
            except BaseException as exc:  # noqa: BLE001 - reported to the request, thread lives
                if self.on_error is not None:
                    self.on_error()
                future.set_exception(exc)
                continue
            if self.on_commit is not None:
                self.on_commit()
            future.set_result(ack)
            if self.after_ack is not None:
                try:
                    self.after_ack()
                except Exception:  # noqa: BLE001 - a cache: the next search brings it up to date
                    if self.on_error is not None:
                        self.on_error()

    def _apply(self, kind: str, payload: list) -> WriteAck:
        if kind == "delete":
            return WriteAck(deleted=self.store.delete(payload))
        texts = [doc.text for doc in payload]
        for attempt in range(SWAP_RETRIES + 1):
            generation = self.store.model_generation  # what the embeddings are made for
            embeddings = self.embed(texts)
            both = self.swap_vectors(texts) if self.swap_vectors is not None else None
            swap = {} if both is None else {"swap_target": both[0], "swap_embeddings": both[1]}
            try:
                result = self.store.write(payload, embeddings, **swap)  # returns after commit
            except (ModelSwappedError, ValueError) as exc:
                # the store switched model meanwhile (to another dimension: the vectors no
                # longer fit): embed again with the new one
                swapped = isinstance(exc, ModelSwappedError) or (
                    self.store.model_generation != generation
                )
                if not swapped or attempt == SWAP_RETRIES:
                    raise
                continue
            return WriteAck(added=result.added, updated=result.updated)
