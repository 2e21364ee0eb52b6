"""The limits and knobs of ``densefit serve``, declared once (the CLI options derive from
:class:`ServeConfig`'s defaults). Importing this module does not need FastAPI."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from densefit.errors import OptionError

__all__ = ["ServeConfig", "is_local_host", "worker_threads"]


@dataclass(frozen=True)
class ServeConfig:
    """Limits and knobs of the service; the ``densefit serve`` options take their defaults
    from here. A limit below its smallest value is an :class:`~densefit.errors.OptionError`.

    >>> ServeConfig(max_k=0)
    Traceback (most recent call last):
    ...
    densefit.errors.OptionError: max_k must be >= 1, got 0
    """

    max_k: int = 100  # results per query
    max_queries: int = 64  # queries per /search request
    max_documents: int = 256  # documents per upsert or delete request
    max_text_chars: int = 100_000  # characters per query or document text
    max_body_bytes: int = 4 * 1024 * 1024  # larger requests get 413
    max_batch: int = 64  # queries per forward pass
    max_wait_ms: float = 2.0  # how long a batch waits for more (idle server: no wait)
    query_workers: int = 2  # batches encoded at the same time (one forward pass each)
    threads_per_worker: int = 0  # torch threads of each query worker; 0: torch's / workers
    api_key: str | None = None  # required on every request when set
    allow_writes: bool = True  # False: upserts and deletes get 403

    def __post_init__(self) -> None:
        for name, low in _LOWEST.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
                raise OptionError(name, f"{{option}} must be >= {low}, got {value!r}")


# The smallest allowed value of each numeric ServeConfig field.
_LOWEST = {"max_k": 1, "max_queries": 1, "max_documents": 1, "max_text_chars": 1,
           "max_body_bytes": 1, "max_batch": 1, "max_wait_ms": 0, "query_workers": 1,
           "threads_per_worker": 0}  # fmt: skip


def worker_threads(config: ServeConfig, available: int) -> int:
    """The torch threads each query worker runs its forward passes with: the configured
    number, or (0) the ``available`` threads (torch's setting: the CPU cores, or
    ``OMP_NUM_THREADS``) divided among the workers, at least one each. Workers that asked
    for all the cores each would compete for them, and an OpenMP thread that waits for a
    busy core spins instead of yielding it.

    >>> worker_threads(ServeConfig(query_workers=2), 16), worker_threads(ServeConfig(), 1)
    (8, 1)
    >>> worker_threads(ServeConfig(threads_per_worker=3), 16)
    3
    """
    if config.threads_per_worker:
        return config.threads_per_worker
    return max(1, available // max(1, config.query_workers))


def is_local_host(host: str) -> bool:
    """True for loopback addresses (and ``localhost``), where writes need no API key.

    >>> is_local_host("127.0.0.1"), is_local_host("::1"), is_local_host("0.0.0.0")
    (True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
