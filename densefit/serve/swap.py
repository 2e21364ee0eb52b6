"""The served model, and a model swap while the server keeps answering.

:class:`ServedModel` is what the batcher, the writer and the embeddings routes embed with:
one immutable :class:`ModelState` (model, runtime, document encoder, the store's model
generation it belongs to), replaced in one assignment when the store switches to another
model. That happens two ways:

- ``POST /admin/reembed`` (behind the API key): :class:`AdminSwap` loads the new model and
  runs :func:`~densefit.retrieval.index.reembed.reembed_store` in a thread, while the writer
  embeds every write for both models; at the switch the new model becomes the served one.
- ``densefit reembed`` in another process: the next search finds the store switched
  (:class:`~densefit.retrieval.index.store.ModelSwappedError`), and the server loads the
  model the store now records (as ``densefit serve`` picks it at start).

Either way a query embedded by the old model a moment before the switch is embedded again by
the new one and searched: no request fails because of a swap.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from densefit.config.shared import ENCODE_BATCH_SIZE
from densefit.models import load_model, resolve_device
from densefit.retrieval.encode import configure_model, encode_texts, fastest_runtime
from densefit.retrieval.index.reembed import reembed_store
from densefit.retrieval.index.searching import model_for_store, query_runtime
from densefit.retrieval.index.settings import record_for
from densefit.retrieval.index.types import ModelSwappedError, SettingsMismatchError, StoreRecord
from densefit.retrieval.runtimes import (
    RuntimeUnavailableError,
    auto_candidates,
    disagreement,
    release_runtimes,
    resolve_runtime,
    set_precision,
)
from densefit.serve.embeddings import matryoshka_trained

__all__ = [
    "SWAP_RETRIES",
    "AdminSwap",
    "ModelState",
    "ServedModel",
    "document_encoder",
    "query_runtime_for",
    "retrying_swaps",
]

# A batch or a write prepared for the old model is embedded again after a switch, up to this
# many times (a second switch in between is rare).
SWAP_RETRIES = 3


@dataclass(frozen=True)
class ModelState:
    """What the server embeds with for one model generation of the store."""

    model: object
    runtime: str  # the query runtime's name (resolved again in each worker thread)
    generation: int  # the store's model_generation these embeddings are for
    encode_documents: Callable[[list[str]], object]
    matryoshka: bool
    runtime_ms: dict = field(default_factory=dict)  # auto: ms per query of each candidate


@dataclass(frozen=True)
class _Next:
    """The model a swap under way embeds with, for the writer's second vectors."""

    model: object
    runtime: object  # a resolved Runtime
    record: StoreRecord


class ServedModel:
    """The current :class:`ModelState`, brought in step with the store's model on demand.

    ``make_state(model)`` builds the state of a model (the app's runtime rules); ``device``
    is where a model loaded after an outside swap runs.
    """

    def __init__(self, store, model, make_state: Callable[[object], ModelState], device):
        self.store = store
        self._make_state = make_state
        self.device = device
        self._lock = threading.Lock()
        self.next: _Next | None = None
        self.state = make_state(model)

    def current(self) -> ModelState:
        """The state for the store's current model (loading it after a swap)."""
        state = self.state
        if state.generation == self.store.model_generation:
            return state
        with self._lock:
            if self.state.generation != self.store.model_generation:
                nxt = self.next
                if nxt is not None and nxt.record.same_vectors(self.store.record):
                    model = nxt.model
                else:  # swapped by another process: the model the store records now
                    model = model_for_store(self.store, None, device=self.device)
                self.state = self._make_state(model)
            return self.state

    def swap_vectors(self, texts: list[str]):
        """``(swap target, the next model's document vectors)`` for a write while a swap
        this server runs is under way; None otherwise (the swap embeds the write itself)."""
        nxt = self.next
        if nxt is None:
            return None
        target = self.store.swap_target()
        if target is None or not target.record.same_vectors(nxt.record):
            return None
        vectors = encode_texts(
            nxt.model,
            texts,
            batch_size=ENCODE_BATCH_SIZE.default,
            prompt_name="document",
            runtime=nxt.runtime,
        )
        return target, vectors


def retrying_swaps(run: Callable[[ModelState], list], served: ServedModel) -> list:
    """``run(state)`` for the current model; again, with the new one, when a result says the
    store switched model meanwhile (:class:`ModelSwappedError`)."""
    results = run(served.current())
    for _ in range(SWAP_RETRIES):
        if not any(isinstance(r, ModelSwappedError) for r in results):
            break
        results = run(served.current())
    return results


class AdminSwap:
    """``POST /admin/reembed``: one model swap at a time, in a thread; its status for
    ``GET /admin/reembed``."""

    def __init__(
        self, served: ServedModel, *, runtime: str, batch_size: int = ENCODE_BATCH_SIZE.default
    ):
        self.served = served
        self.runtime = runtime
        self.batch_size = batch_size
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.status: dict = {"state": "idle"}

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, model_name: str) -> dict:
        """Load ``model_name`` and start swapping to it; the status. RuntimeError when a swap
        is running, ValueError when the model cannot be loaded (nothing started)."""
        if self.running:
            raise RuntimeError(f"a model swap to {self.status.get('model')!r} is running")
        try:
            model = configure_model(
                load_model(model_name, device=resolve_device(self.served.device))
            ).eval()  # embedded from the swap's and the writer's threads at once
        except Exception as exc:  # noqa: BLE001 - the request's model: say why, serve on
            raise ValueError(
                f"model: cannot load {model_name!r} ({exc.__class__.__name__}: {str(exc)[:300]})"
            ) from None
        self.status = {"state": "running", "model": model_name, "started": time.time()}
        self._thread = threading.Thread(
            target=self._run, args=(model,), name="densefit-reembed", daemon=True
        )
        self._thread.start()
        return dict(self.status)

    def stop(self) -> None:
        """Stop between commits (the swap stays resumable) and wait for the thread."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def report(self) -> dict:
        """The status, with the documents left while it runs. A swap the store holds but
        no thread runs (a server restarted, another process stopped) is ``interrupted``: a
        POST with its model resumes it."""
        status = dict(self.status)
        if status.get("state") == "running":
            swap = self.served.store.info().get("swap")
            status["remaining"] = swap["remaining"] if swap else 0
        elif not self.running and self.served.store.swap_target() is not None:
            swap = self.served.store.info().get("swap") or {}
            if status.get("state") == "idle":
                status = {"state": "interrupted", "model": swap.get("model")}
            status["remaining"] = swap.get("remaining")
            status["resume"] = "POST /admin/reembed with this model resumes the swap"
        return status

    def _run(self, model) -> None:
        store = self.served.store
        try:
            runner = resolve_runtime(model, self.runtime)
            self.served.next = _Next(model, runner, record_for(model, store.vector_kind, runner))
            report = reembed_store(
                store,
                model,
                runtime=runner,
                batch_size=self.batch_size,
                should_stop=self._stopping.is_set,
            )
            if report.switched:
                self.served.current()  # the new model serves from the next batch on
            self.status.update(
                state="done" if report.switched else "stopped", report=report.to_dict()
            )
        except Exception as exc:  # noqa: BLE001 - reported by GET /admin/reembed, server lives
            self.status.update(
                state="failed",
                error=f"{exc.__class__.__name__}: {exc}",
                where=traceback.format_exc(limit=-1).strip().splitlines()[-1],
            )
        finally:
            self.served.next = None


def document_encoder(store, model, runtime: str = "auto"):
    """How written documents are embedded: by ``runtime`` when its vectors may be written
    beside the store's, else by a runtime of the store's vectors' family (found as
    ``densefit index`` finds it); writes that would mix families are refused."""
    settings = getattr(store, "settings", None)
    stored = settings.source if settings is not None else None
    try:
        runner = resolve_runtime(model, "auto", stored=stored, mixing=True)
    except RuntimeUnavailableError as exc:  # --precision other than the documents': no writes
        return _refusing(store, str(exc))
    if runtime != "auto":
        chosen = resolve_runtime(model, runtime)
        if stored is None or disagreement(stored, chosen.source, mixing=True) is None:
            runner = chosen
    reason = stored and disagreement(stored, runner.source, mixing=True)

    def encode(texts):
        if reason:
            raise SettingsMismatchError(
                f"{store.location}: cannot add documents: {reason} "
                f"(export {stored.runtime} for this model to write here)"
            )
        return encode_texts(
            model,
            texts,
            batch_size=ENCODE_BATCH_SIZE.default,
            prompt_name="document",
            runtime=runner,
        )

    return encode


def _refusing(store, reason: str):
    """A document encoder that refuses every write, saying why."""

    def encode(texts):
        raise SettingsMismatchError(f"{store.location}: cannot add documents: {reason}")

    return encode


def query_state_maker(store, config, threads: int | None = None) -> Callable:
    """``make_state(model)`` for :class:`ServedModel`: the query runtime by the store's rules
    (:func:`query_runtime_for`, timed with ``threads`` torch threads, the query workers'),
    the writer's document encoder (:func:`document_encoder`), and whether the model was
    trained for shorter embeddings (:func:`~densefit.serve.embeddings.matryoshka_trained`)."""

    def make_state(model) -> ModelState:
        store.check_model(model)
        # Inference only, from several threads at once: in eval mode for good, so that
        # encode_texts never switches it (one worker's switch back would turn dropout on in
        # another's pass).
        model.eval()
        set_precision(model, config.precision)
        runtime, timings = query_runtime_for(store, model, config.runtime, threads=threads)
        matryoshka = config.matryoshka
        if matryoshka is None:
            matryoshka = matryoshka_trained(store, model)
        return ModelState(
            model=model,
            runtime=runtime.name,
            generation=store.model_generation,
            encode_documents=document_encoder(store, model, config.runtime),
            matryoshka=matryoshka,
            runtime_ms=timings,
        )

    return make_state


def query_runtime_for(store, model, runtime: str = "auto", *, threads: int | None = None):
    """``(the runtime that embeds the server's queries, its timings)``. Named: that runtime
    (:func:`~densefit.retrieval.index.searching.query_runtime`), no timings. ``auto``: of
    the runtimes ``auto`` may use against the store's vectors, the fastest at one query
    (:func:`~densefit.retrieval.encode.fastest_runtime`, run in a thread with ``threads``
    torch threads as a query worker has; median ms per query by runtime); the others'
    sessions are let go. ``densefit index`` keeps the fixed order, fastest at batches of
    documents; at one query another runtime can be faster (``bench/results/query_parts.json``).
    """
    if runtime != "auto":
        return query_runtime(store, model, runtime), {}
    settings = getattr(store, "settings", None)
    stored = settings.source if settings is not None else None

    def timed():
        if threads is not None:
            torch.set_num_threads(threads)  # per thread, as in a query worker
        candidates = auto_candidates(model, stored=stored, mixing=False)
        return fastest_runtime(model, candidates)

    with ThreadPoolExecutor(max_workers=1) as pool:
        best, timings = pool.submit(timed).result()
    release_runtimes(model, keep=best)
    return query_runtime(store, model, best), timings
