"""Opening a store: :func:`open_store`, the one way to open or create one, for a target
naming its engine (:mod:`~densefit.retrieval.index.registry`).

An engine's module (docs/architecture.md, adding an engine) gives ``open_existing(target, *,
backend, rescore, lock_timeout)`` (the store there, or None) and ``create(target, record,
**the same)`` (a new, empty store recording ``record``; when another process created it
meanwhile, that one opened), and optionally ``why_none(target)`` (why there is no store
there, when it can say better than "none"). This module loads the engine modules by name;
they never import it back.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

import densefit.retrieval.index as index_package  # record_for, lazily: see open_store
from densefit.choices import VECTOR_KINDS
from densefit.retrieval.index.base import DocumentStore
from densefit.retrieval.index.registry import ENGINES, engine_of, redacted, require
from densefit.retrieval.index.types import (
    Capabilities,
    ModelMismatchError,
    NoStoreError,
    StoreError,
)

__all__ = ["engine_module", "open_store"]


def engine_module(engine: str) -> ModuleType:
    """The module implementing ``engine`` (see :data:`~densefit.retrieval.index.registry.
    ENGINES`)."""
    return importlib.import_module(ENGINES[engine].module)


def open_store(
    target: str | os.PathLike | None,
    model=None,
    *,
    record=None,
    backend: str | Callable | None = None,
    vectors: str = "float32",
    rescore: int | None = None,
    create: bool = True,
    lock_timeout: float | None = None,
) -> DocumentStore:
    """Open the store at ``target`` (see the module docstring for the engines), creating it
    for ``model`` (or ``record``: what a store records about its vectors, for embeddings
    made elsewhere) when there is none yet and ``create`` allows.

    With a ``model`` the store is checked against it (:class:`~densefit.retrieval.index.
    types.ModelMismatchError` when the embeddings came from another model). ``target=None``
    gives a temporary embedded store. ``backend`` is the vector search (the engine's own
    default when None: exact for the embedded store, ``faiss`` / ``faiss:FACTORY`` there
    too; ``exact`` or ``hnsw`` for PostgreSQL and Qdrant): a search-time choice that may
    differ between opens of the same store. ``vectors`` is the vector kind of a new store
    (:data:`densefit.choices.VECTOR_KINDS`; an existing store keeps its own); ``rescore``
    the candidates per result an int8 or binary store rescores. Creation is safe against
    concurrent callers (waiting up to ``lock_timeout`` seconds for another's): the store is
    created once. An engine that cannot do what was asked (a vector kind, a backend) raises
    :class:`~densefit.retrieval.index.types.CapabilityError` naming the engines that can.

    >>> from densefit.testing import tiny_model
    >>> store = open_store(None, tiny_model())
    >>> store.count(), store.dim, store.capabilities.engine
    (0, 32, 'embedded')
    """
    engine = engine_of(target)
    module = engine_module(engine)
    capabilities: Capabilities = ENGINES[engine].capabilities
    location = redacted(target)
    if callable(backend):  # a factory of densefit's own vector search: the embedded store's
        if engine != "embedded":
            offered = " or ".join(repr(b) for b in capabilities.backends)
            raise StoreError(
                f"the {engine} engine searches with its own index: pass backend={offered}, "
                "not a backend factory"
            )
    elif backend is not None:
        name = str(backend).split(":", 1)[0]  # faiss:IVF4096,Flat names faiss
        require(capabilities, "backends", f"search by {backend!r}", name, location)
    options = {"backend": backend, "rescore": rescore, "lock_timeout": lock_timeout}
    target = None if target is None else (target if engine == "embedded" else str(target))
    store = module.open_existing(target, **options)
    if store is None:
        if not create or (model is None and record is None):
            why = getattr(module, "why_none", None)
            raise NoStoreError(
                (why(target) if why is not None else None)
                or f"no densefit store at {location}: build one with "
                f"`densefit index CORPUS --model MODEL --store {location}`"
            )
        if record is None:
            if vectors not in VECTOR_KINDS:
                raise StoreError(
                    f"vector kind {vectors!r} is not supported: use one of "
                    f"{', '.join(VECTOR_KINDS)}"
                )
            # the settings module loads the model's framework (torch): the package exports
            # record_for lazily (densefit/_lazy.py), so listing and opening stores loads none
            record = index_package.record_for(model, vectors)
        record.check_searchable(location)
        require(
            capabilities,
            "vector_kinds",
            f"store {record.vector_kind} vectors",
            record.vector_kind,
            location,
        )
        store = module.create(target, record, **options)
    if model is not None:
        try:
            store.check_model(model)
        except ModelMismatchError:
            store.close()
            raise
    return store
