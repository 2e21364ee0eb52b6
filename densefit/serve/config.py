"""The limits and knobs of ``densefit serve``, declared once (the CLI options derive from
:class:`ServeConfig`'s defaults). Importing this module does not need FastAPI."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

__all__ = ["ServeConfig", "is_local_host"]


@dataclass(frozen=True)
class ServeConfig:
    """Limits and knobs of the service; the ``densefit serve`` options take their defaults
    from here."""

    max_k: int = 100  # results per query
    max_queries: int = 64  # queries per /search request
    max_documents: int = 256  # documents per upsert or delete request
    max_text_chars: int = 100_000  # characters per query or document text
    max_body_bytes: int = 4 * 1024 * 1024  # larger requests get 413
    max_batch: int = 64  # queries per forward pass
    max_wait_ms: float = 2.0  # how long the first query of a batch waits for others
    query_workers: int = 2  # batches encoded at the same time (one forward pass each)
    api_key: str | None = None  # required on every request when set
    allow_writes: bool = True  # False: upserts and deletes get 403


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
