"""PEP 562 lazy exports for package ``__init__`` modules: a name is imported on first use.

A package ``__init__`` that re-exports its modules' names eagerly makes ``import
densefit.x`` load every module of ``x`` (and torch with them); with :func:`lazy_exports` it
loads only the module that defines the name asked for.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, exporting ``exports`` (name -> module).

    >>> getattr_, dir_ = lazy_exports("pkg", {"sqrt": "math"})
    >>> getattr_("sqrt")(9.0)
    3.0
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        module = sys.modules.get(package)
        return sorted({*exports, *(vars(module) if module is not None else ())})

    return __getattr__, __dir__
