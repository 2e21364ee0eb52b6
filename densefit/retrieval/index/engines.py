"""Where a store lives: the engines, and :func:`open_store`, the one way to open or create one.

A target names the engine by its form:

=====================================================  ============================================
target                                                 engine
=====================================================  ============================================
a folder (``runs/store``), or None (temporary)         the embedded store (SQLite + a vector file)
``postgresql://USER@HOST:PORT/DATABASE/TABLE``         PostgreSQL with pgvector (``postgres://`` too)
``qdrant://HOST:PORT/COLLECTION``, ``qdrant:FOLDER``   Qdrant: a server, or its local mode in a folder
=====================================================  ============================================

An engine is one module (listed in :data:`ENGINES`) that declares what it can do
(``CAPABILITIES``, a :class:`~densefit.retrieval.index.base.Capabilities`), optionally
``why_none(target)`` (why there is no store there, when it can say better than "none"), and
two functions:
``open_existing(target, *, backend, rescore, lock_timeout)`` (the store there, or None when
there is none) and ``create(target, record, *, backend, rescore, lock_timeout)`` (a new,
empty store recording ``record``, the model's :class:`~densefit.retrieval.index.settings.
StoreRecord`; when another process created it meanwhile, that one opened). Its store class
implements :class:`~densefit.retrieval.index.base.DocumentStore`, most of it inherited from
:class:`~densefit.retrieval.index.common.StoreCommon`. A module imports its client library
inside those functions, so that listing the engines (and their capabilities) needs none.

>>> engine_of("runs/store"), engine_of("postgresql://me@db/search/docs"), engine_of("qdrant:q")
('embedded', 'postgresql', 'qdrant')
>>> redacted("postgresql://me:secret@db:5432/search/docs")
'postgresql://me:***@db:5432/search/docs'
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from types import ModuleType

from densefit.choices import VECTOR_KINDS
from densefit.retrieval.index.base import (
    Capabilities,
    CapabilityError,
    DocumentStore,
    ModelMismatchError,
    NoStoreError,
    StoreError,
)
from densefit.retrieval.index.settings import record_for

__all__ = [
    "ENGINES",
    "capabilities_of",
    "capabilities_table",
    "engine_of",
    "open_store",
    "redacted",
    "require",
]

# Each engine: its module, the URL schemes of its targets (a target with none of them is a
# folder: the embedded store's) and how a target is written.
ENGINES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "embedded": ("densefit.retrieval.index.store", (), "a folder"),
    "postgresql": (
        "densefit.retrieval.index.pgvector",
        ("postgresql", "postgres"),
        "`postgresql://USER@HOST/DATABASE/TABLE`",
    ),
    "qdrant": (
        "densefit.retrieval.index.qdrant",
        ("qdrant",),
        "`qdrant://HOST:PORT/COLLECTION`, `qdrant:FOLDER`",
    ),
}
_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*):")


def engine_of(target: str | os.PathLike | None) -> str:
    """The engine a target names (see the module docstring)."""
    if target is None or isinstance(target, os.PathLike):
        return "embedded"
    found = _SCHEME.match(str(target))
    if found is not None:
        for engine, (_, schemes, _) in ENGINES.items():
            if found.group(1).lower() in schemes:
                return engine
    return "embedded"


def engine_module(engine: str) -> ModuleType:
    """The module implementing ``engine`` (see :data:`ENGINES`)."""
    return importlib.import_module(ENGINES[engine][0])


def capabilities_of(engine: str) -> Capabilities:
    """What ``engine`` can do."""
    return engine_module(engine).CAPABILITIES


def capabilities_table() -> str:
    """Every engine's capabilities as a Markdown table (docs/search.md holds it; a test
    checks that it is current).

    >>> capabilities_table().splitlines()[0]
    '| | the embedded store | postgresql | qdrant |'
    """
    engines = {e: capabilities_of(e) for e in ENGINES}

    def yes(value: bool) -> str:
        return "yes" if value else "no"

    rows = [
        ("target", lambda e, c: ENGINES[e][2]),
        ("vector kinds", lambda e, c: ", ".join(c.vector_kinds)),
        ("`--backend`", lambda e, c: ", ".join(c.backends) + " (default " + c.backends[0] + ")"),
        ("`--mode bm25`", lambda e, c: c.lexical or "no"),
        ("`--mode hybrid`", lambda e, c: yes(c.hybrid)),
        ("model swap (`reembed`)", lambda e, c: yes(c.model_swap)),
        ("transactions", lambda e, c: yes(c.transactions)),
        ("crash safe (tested by SIGKILL)", lambda e, c: yes(c.crash_safe)),
        ("`compact`", lambda e, c: yes(c.compaction)),
        ("several servers on one store", lambda e, c: yes(c.shared)),
    ]
    lines = ["| | " + " | ".join(_named(e) for e in engines) + " |"]
    lines.append("|---" * (len(engines) + 1) + "|")
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(e, c) for e, c in engines.items()) + " |")
    return "\n".join(lines) + "\n"


def redacted(target: str | os.PathLike | None) -> str:
    """``target`` as messages show it: a URL's password replaced by ``***``."""
    return re.sub(r"(://[^:/@]+:)[^@/]*@", r"\1***@", str(target))


def require(
    capabilities: Capabilities,
    ability: str,
    doing: str,
    value: str | None = None,
    location: str | None = None,
) -> None:
    """Raise :class:`~densefit.retrieval.index.base.CapabilityError` (one line naming the
    engines that can) unless the engine of ``capabilities`` has ``ability`` (a
    :class:`~densefit.retrieval.index.base.Capabilities` field: true, set, or holding
    ``value``); ``doing`` says what was asked, as the user asked it.

    >>> require(capabilities_of("embedded"), "vector_kinds", "store int8 vectors", "int8")
    """
    if _has(capabilities, ability, value):
        return
    able = [e for e in ENGINES if _has(capabilities_of(e), ability, value)]
    where = f"{location} " if location else ""
    offered = ""
    if value is not None:
        offered = f" (it offers {', '.join(getattr(capabilities, ability))})"
    others = f": {' and '.join(_named(e) for e in able)} can" if able else ""
    raise CapabilityError(f"{where}({_named(capabilities.engine)}) cannot {doing}{offered}{others}")


def _has(capabilities: Capabilities, ability: str, value: str | None) -> bool:
    held = getattr(capabilities, ability)
    if value is not None:
        return value in held
    return bool(held)


def _named(engine: str) -> str:
    return "the embedded store" if engine == "embedded" else engine


def _backend_name(backend: str | Callable | None) -> str | None:
    """The search backend a spec names (``faiss:IVF4096,Flat`` names faiss); None for a
    factory (a test's callable) or no choice."""
    if backend is None or callable(backend):
        return None
    return str(backend).split(":", 1)[0]


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
    base.ModelMismatchError` when the embeddings came from another model). ``target=None``
    gives a temporary embedded store. ``backend`` is the vector search (the engine's own
    default when None: exact for the embedded store, ``faiss`` / ``faiss:FACTORY`` there
    too; ``exact`` or ``hnsw`` for PostgreSQL and Qdrant): a search-time choice that may
    differ between opens of the same store. ``vectors`` is the vector kind of a new store
    (:data:`densefit.choices.VECTOR_KINDS`; an existing store keeps its own); ``rescore``
    the candidates per result an int8 or binary store rescores. Creation is safe against
    concurrent callers (waiting up to ``lock_timeout`` seconds for another's): the store is
    created once. An engine that cannot do what was asked (a vector kind, a backend) raises
    :class:`~densefit.retrieval.index.base.CapabilityError` naming the engines that can.

    >>> from densefit.testing import tiny_model
    >>> store = open_store(None, tiny_model())
    >>> store.count(), store.dim, store.capabilities.engine
    (0, 32, 'embedded')
    """
    engine = engine_of(target)
    module = engine_module(engine)
    capabilities: Capabilities = module.CAPABILITIES
    location = redacted(target)
    name = _backend_name(backend)
    if name is not None:
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
            record = record_for(model, vectors)
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
