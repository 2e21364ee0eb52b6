"""A model swap: re-embed a store with another model while it keeps answering, then switch.

``densefit reembed --store TARGET --model NEW`` (and ``POST /admin/reembed`` of ``densefit
serve``) builds the next generation of the store's vectors with the new model beside the
current one (blue/green), on every engine that declares
:attr:`~densefit.retrieval.index.types.Capabilities.model_swap`: :meth:`SwapCoordinator.
begin_swap` records the new model in the store's own metadata, where every process finds it,
then :func:`~densefit.retrieval.index.reembed.reembed_store` embeds the documents
in write order, a chunk per step, while searches keep using the current generation
(documents written meanwhile are embedded for both generations: by the writer when it has
the new model, else by this pass, which meets them at their later row; deletes and metadata
updates reach both), then :meth:`SwapCoordinator.finish_swap` switches the live
generation, the model record and ``model_generation`` together.

A process killed at any point leaves the current generation serving (nothing of it changes
before the switch) and the swap resumable: running it again with the same model goes on
from the vectors written; with another model it starts afresh. ``cancel_swap`` drops it.
The state machine is :class:`SwapCoordinator`, written once over a handful of primitives
each engine gives (a next vector file, a second table, a collection behind an alias).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from densefit.choices import SIMILARITIES
from densefit.data.types import Document
from densefit.retrieval.index.common import checked_vectors
from densefit.retrieval.index.types import (
    ModelSwappedError,
    StoreError,
    StoreRecord,
    SwapTarget,
    VectorSettings,
)

__all__ = [
    "LOCK_NAME",
    "MODEL_GENERATION_KEY",
    "SWAP_KEY",
    "SwapCoordinator",
    "model_swapped",
    "next_vectors_for",
    "refuse_during_swap",
    "switched_meta",
]

LOCK_NAME = "reembed.lock"  # one model swap at a time; writers and searches do not take it
SWAP_KEY = "swap"  # the store's metadata: the SwapTarget of the model swap under way
MODEL_GENERATION_KEY = "model_generation"  # the store's metadata: the model swaps so far


def switched_meta(swap: SwapTarget, model_generation: int) -> dict[str, str]:
    """The record entries a switch to ``swap`` writes: the new model (name, dimension,
    similarity, fingerprint), its settings, the live generation and the model generation
    after ``model_generation``."""
    meta = swap.record.to_meta()
    values = {key: meta[key] for key in ("model_name", "dim", "similarity", "fingerprint")}
    values.update((swap.record.settings or VectorSettings()).to_meta())
    values["generation"] = str(swap.generation)
    values[MODEL_GENERATION_KEY] = str(model_generation + 1)
    return values


def next_vectors_for(
    swap: SwapTarget | None, swap_target: SwapTarget | None, next_vectors: np.ndarray | None
) -> np.ndarray | None:
    """A write's next-generation vectors when they were made for ``swap``, the swap under
    way; None otherwise (no swap, none given, or made for a swap cancelled or restarted since:
    the swap embeds those documents itself)."""
    if swap is None or swap_target is None or not swap.record.same_vectors(swap_target.record):
        return None
    return next_vectors


def model_swapped(location: str, model_name: str) -> ModelSwappedError:
    """The error of a write prepared for the model the store has switched from."""
    return ModelSwappedError(
        f"{location}: the store switched to the model {model_name!r} while this write was "
        "prepared; embed the documents with it and write again"
    )


def refuse_during_swap(location: str, swap: SwapTarget | None) -> None:
    """Refuse re-embedding with new settings while a model swap is under way."""
    if swap is not None:
        raise StoreError(
            f"{location}: a model swap to {swap.record.model_name!r} is under way: finish it "
            "(densefit reembed) before re-embedding with new settings"
        )


class SwapCoordinator:
    """The model swap's state machine, over an engine's primitives (a mixin: list it before
    the store's base class).

    The engine keeps ``_swap`` (the swap its metadata records, made current by
    ``_refresh()``), ``_record``, ``model_generation``, ``_lock`` and ``location``, and
    writes (``tx`` is whatever ``_swap_transaction`` yields; the coordinator only passes it
    on):

    - ``_swap_transaction()``: a context manager holding the object's lock and the store's
      write exclusion, with ``_record``, ``model_generation`` and ``_swap`` read afresh;
      committed when the block ends, rolled back on an error (where the engine has
      transactions);
    - ``_save_swap(tx, swap)``: record ``swap`` (None: none) as the swap under way;
    - ``_create_generation(tx, record, generation) -> int``: empty storage for a new
      generation of ``record``'s vectors beside the live one, numbered by the engine
      (``generation`` None), or that of the resumed swap's ``generation``, made again only
      if it is gone; returns its number;
    - ``_drop_generation(tx, swap)``: an abandoned swap's storage goes (now, or after the
      commit, in ``_swap_changed``);
    - ``_pending_rows(swap, after_row, limit)``: ``(row, id, text)`` of up to ``limit``
      documents past ``after_row`` without a current next vector, by row (a row orders
      documents as they were written; a write gives a document a later one);
    - ``_count_pending(swap) -> int``: how many documents lack a current next vector;
    - ``_put_next(tx, swap, pending, vectors) -> int``: write the next ``vectors`` of the
      ``(row, id)`` documents whose row is still ``row``; returns how many it wrote;
    - ``_switch(tx, swap)``: make ``swap``'s generation the live one, with its record
      (:func:`switched_meta`), the next model generation and no swap under way, in one
      step; the old generation's storage goes now or in ``_swap_changed``;
    - ``_swap_changed()``: after a begin, a switch or a cancel: read the record again and
      drop storage left unused;
    - ``_before_switch(swap) -> bool`` (optional): work before the switch, outside any
      transaction (PostgreSQL builds the next table's HNSW index); False: not ready.
    """

    _swap: SwapTarget | None = None

    # -- the steps of reembed_store ----------------------------------------------------------

    def swap_target(self) -> SwapTarget | None:
        """The model swap under way (None: none)."""
        with self._lock:
            self._refresh()
            return self._swap

    def begin_swap(self, target: StoreRecord) -> tuple[SwapTarget, bool]:
        """Start re-embedding every document for ``target`` (the new model's record), or go
        on with the swap under way when it is for the same vectors; returns the swap and
        whether it resumed one. A swap for another model is started afresh (its storage
        dropped); the live generation is untouched either way."""
        if target.vector_kind != self.vector_kind:
            raise StoreError(
                f"{self.location}: a {self.vector_kind} store swaps to {self.vector_kind} "
                f"vectors, not {target.vector_kind}: embed with the store's vector kind"
            )
        if target.similarity not in SIMILARITIES:
            raise StoreError(
                f"{self.location}: the model {target.model_name!r} scores by "
                f"{target.similarity!r} similarity; the store serves "
                f"{' and '.join(SIMILARITIES)} models"
            )
        with self._swap_transaction() as tx:
            swap = self._swap
            if swap is not None and swap.record.same_vectors(target):
                self._create_generation(tx, swap.record, swap.generation)
                return swap, True
            if swap is not None:
                self._drop_generation(tx, swap)
            fresh = SwapTarget(target, self._create_generation(tx, target, None))
            self._save_swap(tx, fresh)
        self._swap_changed()
        return fresh, False

    def swap_pending(self, after_row: int, limit: int) -> list[tuple[int, str, str]]:
        """``(row, id, text)`` of up to ``limit`` documents past ``after_row`` that the swap
        has still to embed, by row (write order)."""
        with self._lock:
            self._refresh()
            if self._swap is None or limit < 1:
                return []
            return self._pending_rows(self._swap, after_row, limit)

    def write_swap(
        self, target: SwapTarget, pending: Sequence[tuple[int, str]], embeddings: np.ndarray
    ) -> int:
        """Write the new model's ``embeddings`` of the ``(row, id)`` documents
        :meth:`swap_pending` gave; a document rewritten or deleted since (its row moved or
        gone) is left for the swap to meet again. Returns the vectors written."""
        pending = list(pending)
        vectors = checked_vectors(target.record, [Document(i, "") for _, i in pending], embeddings)
        with self._swap_transaction() as tx:
            swap = self._swap_for(target)
            return self._put_next(tx, swap, pending, vectors) if pending else 0

    def finish_swap(self, target: SwapTarget) -> bool:
        """Switch to the new model's vectors when every document has one, and return True;
        False (nothing changed) while documents are left to embed. Searches and writes
        prepared for the old model get :class:`~densefit.retrieval.index.types.
        ModelSwappedError` from then on."""
        with self._lock:
            self._refresh()
            swap = self._swap_for(target)
        if not self._before_switch(swap):
            return False
        with self._swap_transaction() as tx:
            swap = self._swap_for(target)
            if self._count_pending(swap):  # written meanwhile, for the swap to embed
                return False
            self._switch(tx, swap)
        self._swap_changed()
        return True

    def cancel_swap(self) -> bool:
        """Drop the model swap under way (its storage with it; the live generation serves
        on). Returns whether there was one."""
        with self._swap_transaction() as tx:
            swap = self._swap
            if swap is None:
                return False
            self._save_swap(tx, None)
            self._drop_generation(tx, swap)
        self._swap_changed()
        return True

    def _swap_progress(self) -> dict | None:
        """What ``info()["swap"]`` says: the swap's model, dimension and the documents it
        has still to embed (None: no swap under way)."""
        with self._lock:
            self._refresh()
            swap = self._swap
            if swap is None:
                return None
            remaining = self._count_pending(swap)
        return {"model": swap.record.model_name, "dim": swap.record.dim, "remaining": remaining}

    def _swap_for(self, target: SwapTarget) -> SwapTarget:
        """The swap under way (as last read), which must be ``target``'s."""
        swap = self._swap
        if swap is None or not swap.record.same_vectors(target.record):
            raise StoreError(
                f"{self.location}: the model swap was cancelled or restarted: run densefit "
                "reembed again"
            )
        return swap

    def _before_switch(self, swap: SwapTarget) -> bool:  # see the class docstring
        return True
