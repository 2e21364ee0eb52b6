"""The options of ``densefit serve``, declared once (:mod:`densefit.config.options`): the
service's limits and knobs (:class:`ServeConfig`, which the app reads) and what the command
takes besides (:class:`ServeJob`). Importing this module does not need FastAPI."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from densefit.choices import EMBED_PROMPTS
from densefit.config.options import Options, option, section
from densefit.config.shared import (
    BACKEND,
    DEVICE,
    MODEL,
    PRECISION,
    RESCORE,
    RUNTIME,
    STORE,
    VECTORS,
)

__all__ = ["API_KEY_ENV", "DEFAULT_HOST", "DEFAULT_PORT", "ServeConfig", "ServeJob",
           "is_local_host", "worker_threads"]  # fmt: skip

API_KEY_ENV = "DENSEFIT_API_KEY"
DEFAULT_HOST = "127.0.0.1"  # loopback: nothing outside this machine reaches it
DEFAULT_PORT = 8000

_LIMITS = "Limits"


@dataclass(frozen=True, kw_only=True)
class ServeConfig(Options):
    """Limits and knobs of the service (every request is checked against them).

    >>> ServeConfig(max_k=0)
    Traceback (most recent call last):
    ...
    densefit.errors.OptionError: max_k must be >= 1, got 0
    """

    max_k: int = option(100, "Largest k a search may ask for.", ge=1, group=_LIMITS)
    max_queries: int = option(64, "Queries per request.", ge=1, group=_LIMITS)
    max_documents: int = option(256, "Documents per upsert or delete request.", ge=1, group=_LIMITS)
    max_text_chars: int = option(
        100_000, "Characters per query or document text.", ge=1, group=_LIMITS
    )
    max_body_bytes: int = option(
        4 * 1024 * 1024, "Larger request bodies get 413.", ge=1, group=_LIMITS
    )
    max_batch: int = option(64, "Queries per forward pass.", ge=1, group=_LIMITS)
    max_batch_tokens: int = option(
        4096,
        "Tokens per batch of queries and embeddings inputs (their sum, prompts and special "
        "tokens included; a longer text runs alone). 4,096 holds 64 queries of up to 64 "
        "tokens and bounds each pass's time and memory (about 0.9 s of MiniLM on a CPU core) "
        "at under 1% of throughput, a pass's fixed cost being about 24 tokens "
        "(bench/results/pass_cost.json); on a GPU raise it (text-embeddings-inference: 16,384).",
        ge=1,
        group=_LIMITS,
    )
    runtime: str = RUNTIME()
    precision: str = PRECISION()
    max_wait_ms: float = option(
        2.0,
        "How long a batch waits for more queries (not on an idle server with none coming).",
        ge=0,
    )
    query_workers: int = option(
        2,
        "Query batches encoded at the same time, each with its share of the torch threads.",
        ge=1,
    )
    threads_per_worker: int = option(
        0,
        "Torch threads per query worker (0: torch's threads, i.e. the cores or "
        "OMP_NUM_THREADS, divided among the workers).",
        ge=0,
    )
    api_key: str | None = option(
        None,
        f"Required on every request when set (header X-API-Key); or ${API_KEY_ENV}. Without "
        "it a server on a non-local address is read-only.",
        flag="--api-key",
        envvar=API_KEY_ENV,
    )
    allow_writes: bool = option(
        True, "Upserts and deletes allowed (else 403); set from the address and key.", cli=False
    )
    max_embed_inputs: int = option(
        2048,
        "Texts per /v1/embeddings or /embed request (OpenAI's own limit); more get 413.",
        ge=1,
        group=_LIMITS,
    )
    embed_prompt: str = option(
        "query",
        "The store's prompt an embeddings input gets when the request names none "
        "(input_type / prompt_name).",
        choices=EMBED_PROMPTS,
    )
    matryoshka: bool | None = option(
        None,
        "Accept /v1/embeddings `dimensions` below the model's size; default: only when the "
        "model's densefit_config.json records --matryoshka-dims.",
        flag="--matryoshka/--no-matryoshka",
    )
    ui: bool = option(
        True,
        "Serve the search page at / (a query box over the HTTP API, from the package: no "
        "CDN); --no-ui leaves the server API-only.",
        flag="--ui/--no-ui",
    )
    retry_after: int = option(
        5,
        "Seconds a client is told to wait (the Retry-After header) when the store's engine "
        "cannot be reached and the server answers 503.",
        ge=1,
    )
    health_timeout: float = option(
        2.0,
        "Seconds GET /health waits for the store before answering 503 (a hung engine cannot "
        "hang the health check).",
        ge=0.1,
    )


@dataclass(kw_only=True)
class ServeJob(Options):
    """``densefit serve``: what to serve, where, and the service's limits."""

    store: str = STORE(required=True)
    model: str | None = MODEL()
    device: str | None = DEVICE()
    host: str = option(DEFAULT_HOST, "Address to bind (loopback by default).")
    port: int = option(DEFAULT_PORT, "TCP port.", ge=0, le=65535)
    create: bool = option(False, "Create an empty store for --model when --store holds none.")
    backend: str | None = BACKEND()
    vectors: str = VECTORS()
    rescore: int | None = RESCORE()
    serve: ServeConfig = section(ServeConfig, "The service's limits and knobs.")


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
