"""The user errors of ``densefit index | search | eval``, as one red line and exit status 2.

Library code raises ValueError (``StoreError``, ``BadRowError`` and ``SettingsMismatchError``
are ValueErrors), FileNotFoundError, ModelNotFoundError or ImportError (a missing extra) with
a message that says what and how to fix; :func:`user_errors` turns them into
:func:`densefit.cli.common.fail`. It also works under ``typer.testing.CliRunner``, which
calls the commands without ``main()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from densefit.cli.common import fail

__all__ = ["user_errors"]


@contextmanager
def user_errors() -> Iterator[None]:
    """Run the block; an explained library error becomes ``error: message`` and exit 2."""
    from densefit.models import ModelNotFoundError

    try:
        yield
    except (ValueError, FileNotFoundError, ModelNotFoundError, ImportError) as exc:
        fail(str(exc))
