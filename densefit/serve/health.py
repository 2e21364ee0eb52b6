"""How ``densefit serve`` answers when its store's engine is unreachable: ``GET /health``'s
bounded look at the store (:class:`StoreProbe`) and the 503 with ``Retry-After`` that every
route answers for a :class:`~densefit.retrieval.index.types.StoreUnavailableError`
(:func:`unavailable_body`). Importing this module does not need FastAPI.

A load balancer reads the 503 of ``/health`` as "take this replica out" and its 200 as "put
it back": the probe asks the store at every check, so the replica comes back by itself once
the engine answers again (the engines connect again at their next call).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from densefit.errors import StorageFault
from densefit.retrieval.index.types import StoreError, StoreUnavailableError
from densefit.serve.errors import error_body

__all__ = ["StoreProbe", "unavailable_body"]


class StoreProbe:
    """The store's document count, asked in a thread of its own and waited for ``timeout``
    seconds at most, so that a hung engine cannot hang ``/health`` (or ``/metrics``).

    One question at a time: checks that come while one is still waiting share it (no thread
    piles up behind a hung engine), and each check waits up to ``timeout`` from its own
    arrival, so a check that comes while an engine that was hung answers again sees the answer.
    """

    def __init__(self, store, timeout: float):
        self._store = store
        self._timeout = timeout
        self._lock = threading.Lock()
        self._asked: Future | None = None
        self._since = 0.0

    def count(self) -> int:
        """The store's document count; :class:`StoreUnavailableError` when the engine cannot
        be reached, fails the question, or does not answer within the timeout."""
        arrived = time.monotonic()
        with self._lock:
            if self._asked is None or self._asked.done():
                self._asked, self._since = Future(), time.monotonic()
                threading.Thread(
                    target=self._ask, args=(self._asked,), name="densefit-health", daemon=True
                ).start()
            asked, since = self._asked, self._since
        remaining = self._timeout - (time.monotonic() - arrived)
        if not asked.done() and remaining > 0:
            try:
                asked.result(timeout=remaining)
            except Exception:  # noqa: BLE001,S110 - read below, from the future
                pass
        if not asked.done():
            raise StoreUnavailableError(
                f"{self._store.location}: the store has not answered for "
                f"{time.monotonic() - since:.1f} s (the health check waits "
                f"{self._timeout:g} s): check that its engine is running and reachable"
            )
        error = asked.exception()
        if error is None:
            return asked.result()
        if isinstance(error, StoreUnavailableError):
            raise error
        if isinstance(error, (StoreError, StorageFault)):  # it cannot serve: unhealthy
            raise StoreUnavailableError(" ".join(str(error).split())) from error
        raise error

    def _ask(self, asked: Future) -> None:
        try:
            asked.set_result(self._store.count())
        except BaseException as exc:  # noqa: BLE001 - handed to the check that waits
            asked.set_exception(exc)


def unavailable_body(path: str, message: str) -> dict:
    """The JSON body of a 503 for an unreachable store on ``path``: the route's error shape
    (:func:`~densefit.serve.errors.error_body`) and, outside the OpenAI and TEI routes,
    ``detail``: the same one line.

    >>> unavailable_body("/search", "pg://h/t: PostgreSQL is unreachable")
    {'error': 'pg://h/t: PostgreSQL is unreachable', 'detail': 'pg://h/t: PostgreSQL is unreachable'}
    """
    body = error_body(path, 503, message)
    if not path.startswith("/v1/") and path != "/embed":
        body["detail"] = message
    return body
