"""The limits and knobs of ``densefit serve``, declared once (the CLI options derive from
:class:`ServeConfig`'s defaults). Importing this module does not need FastAPI."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from densefit.choices import EMBED_PROMPTS

__all__ = ["ServeConfig", "is_local_host", "worker_threads"]


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
    max_wait_ms: float = 2.0  # how long a batch waits for more (idle server: no wait)
    query_workers: int = 2  # batches encoded at the same time (one forward pass each)
    threads_per_worker: int = 0  # torch threads of each query worker; 0: torch's / workers
    api_key: str | None = None  # required on every request when set
    allow_writes: bool = True  # False: upserts and deletes get 403
    max_embed_inputs: int = 2048  # texts per /v1/embeddings or /embed request (OpenAI's limit)
    embed_prompt: str = "query"  # the prompt an embeddings input gets unless it names one
    matryoshka: bool | None = None  # `dimensions` below the model's size; None: if trained so

    def __post_init__(self) -> None:
        if self.embed_prompt not in EMBED_PROMPTS:
            raise ValueError(
                f"embed_prompt must be one of {', '.join(EMBED_PROMPTS)}, got {self.embed_prompt!r}"
            )
        if self.max_embed_inputs < 1:
            raise ValueError(f"max_embed_inputs must be at least 1, got {self.max_embed_inputs}")


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
