"""A pytest plugin that records which members of the store contract the tests use on the
embedded store, from outside the store object (its own methods calling each other do not
count), and writes them as JSON to ``$DENSEFIT_CONTRACT_USED`` at the end. Only the test
classes named in ``$DENSEFIT_CONTRACT_CLASSES`` (comma-separated) run.

tests/test_engines.py runs the conformance suite on the embedded store with it
(``python -m pytest -p _contract_recorder``, with tests/ on ``PYTHONPATH``).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys

from densefit.retrieval.index.base import ROLES, DocumentStore, members
from densefit.retrieval.index.store import LocalDocumentStore

_USED: set[str] = set()


def _note(name: str, store) -> None:
    caller = sys._getframe(2)  # the frame that used the member (past _note and its wrapper)
    if caller.f_locals.get("self") is not store:
        _USED.add(name)


class _Watched:
    """A plain attribute (``location``, ``capabilities``...) whose reads are recorded."""

    def __init__(self, name: str, default):
        self.name, self.default = name, default

    def __get__(self, store, owner=None):
        if store is None:
            return self.default
        _note(self.name, store)
        return store.__dict__.get(self.name, self.default)

    def __set__(self, store, value) -> None:
        store.__dict__[self.name] = value


def _watch(cls: type, name: str) -> None:
    found = inspect.getattr_static(cls, name, None)
    if isinstance(found, property):
        getter = found.fget

        def read(store):
            _note(name, store)
            return getter(store)

        setattr(cls, name, property(read, found.fset))
    elif inspect.isfunction(found):

        @functools.wraps(found)
        def call(store, *args, **kwargs):
            _note(name, store)
            return found(store, *args, **kwargs)

        setattr(cls, name, call)
    else:
        setattr(cls, name, _Watched(name, found))


def pytest_configure(config) -> None:
    names = set(members(DocumentStore))
    for role in ROLES.values():
        names.update(members(role))
    for name in sorted(names):
        _watch(LocalDocumentStore, name)


def pytest_collection_modifyitems(config, items) -> None:
    wanted = set(os.environ["DENSEFIT_CONTRACT_CLASSES"].split(","))
    keep = [item for item in items if item.cls is not None and item.cls.__name__ in wanted]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def pytest_sessionfinish(session) -> None:
    with open(os.environ["DENSEFIT_CONTRACT_USED"], "w") as fh:
        json.dump(sorted(_USED), fh)
