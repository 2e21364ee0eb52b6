"""The HTTP service of ``densefit serve``: a FastAPI app over one store and one model.

Routes: ``POST /search``, ``POST /documents`` (upsert), ``DELETE /documents``,
``GET /documents/{id}``, ``POST /v1/embeddings`` and ``POST /embed``
(:mod:`densefit.serve.embeddings`), ``POST`` and ``GET /admin/reembed`` (a model swap with
no downtime, :mod:`densefit.serve.swap`; only with an API key), ``GET /health``,
``GET /metrics``, the OpenAPI docs at ``/docs`` and the search page at ``/``
(:mod:`densefit.serve.ui`, unless ``--no-ui``).

- Searches go through the :class:`~densefit.serve.batcher.MicroBatcher` (one forward pass
  for the queries of concurrent requests), writes through the
  :class:`~densefit.serve.writer.DocumentWriter` (one writer, acknowledged after commit).
- Every request passes :class:`Guard` first: the API key (when set), a body-size limit
  (413), a JSON body (415 for any other declared type: a browser page cannot send a
  JSON-typed body to another site without the server's consent, so a page cannot write to a
  local server that needs no key), and the metrics. Bad requests get a 4xx saying what is
  wrong (:mod:`densefit.serve.errors`: the statuses, and each API's error shape); every text
  is checked as the data readers check theirs; the server keeps serving. A full disk, a
  read-only or damaged store file gets its status and one message naming the file (507, 403,
  503); a store whose engine cannot be reached a 503 with ``Retry-After`` on every route that
  reads or writes it, ``/health`` included (:mod:`densefit.serve.health`); only a bug is a
  500. No request value is
  used as a filesystem path: the store is the one given at start, ids and texts only reach
  SQLite as bound parameters.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import sqlite3
import time
from collections import defaultdict
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import torch

from densefit.choices import SEARCH_MODES
from densefit.data.corpus import non_finite_path
from densefit.data.types import Document
from densefit.errors import StorageFault, storage_fault
from densefit.retrieval.index.filters import Filter, parse_filters
from densefit.retrieval.index.request import SearchRequest as StoreRequest
from densefit.retrieval.index.searching import embed_queries, search_embedded
from densefit.retrieval.index.types import StoreUnavailableError
from densefit.serve.batcher import MicroBatcher, Query
from densefit.serve.config import ServeConfig, is_local_host, worker_threads
from densefit.serve.embeddings import add_embedding_routes, measure_request, run_batch
from densefit.serve.errors import (
    JSON_BODY_HINT,
    ClientError,
    checked_request_json,
    checked_request_text,
    error_body,
    validation_message,
)
from densefit.serve.health import StoreProbe, unavailable_body
from densefit.serve.metrics import Metrics
from densefit.serve.swap import AdminSwap, ServedModel, query_state_maker, retrying_swaps
from densefit.serve.ui import UI_PATHS, add_ui_routes
from densefit.serve.writer import DocumentWriter

try:
    from fastapi import Body, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"densefit serve needs FastAPI and uvicorn ({exc.name} is missing): "
        "pip install 'densefit[serve]'"
    ) from None

__all__ = ["ClientError", "ServeConfig", "create_app", "is_local_host", "search_queries"]


# The fixed cost of a query batch's forward pass (tokenising, the Python of each layer,
# pooling), in tokens of work: the ratio of a pass's fixed time to its time per token for
# all-MiniLM-L6-v2 on one CPU thread, fitted over passes of up to 512 tokens
# (bench/results/pass_cost.json, bench/pass_cost.py). A batch of queries is split by length
# where padding the short ones to the longest would cost more than another pass.
PASS_COST_TOKENS = 24


def search_queries(
    store,
    model,
    queries: list[Query],
    embeddings=None,
    *,
    runtime: str = "torch",
    model_generation: int | None = None,
) -> list[object]:
    """Embed the ``queries`` that need it (dense and hybrid ones; one forward pass, or a few
    of similar lengths: :func:`~densefit.retrieval.encode.padding_aware_cuts`), then search
    the store once per group of queries with equal search requests (their ``request``: mode,
    k, filters...); one hit list (or exception) per query, in order. ``embeddings``: the
    embeddings of the queries whose mode embeds (in order), when the batch embedded them already; ``runtime``: what runs the model (a
    name, resolved in the worker thread); ``model_generation``: the store's model generation
    ``model`` is for (a search after a model swap then fails with
    :class:`~densefit.retrieval.index.store.ModelSwappedError` instead of mixing models)."""
    embedded = [i for i, q in enumerate(queries) if q.request.embeds]
    vectors = embeddings
    if vectors is None and embedded:
        vectors = embed_queries(
            store,
            model,
            [queries[i].text for i in embedded],
            runtime=runtime,
            checked=True,  # when the served model's state was made (densefit.serve.swap)
            batch_size=max(len(embedded), 1),
            pass_cost_tokens=PASS_COST_TOKENS,
            tokens=[queries[i].tokens for i in embedded],  # measured by the batcher
        )
    row_of = {query: row for row, query in enumerate(embedded)}
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, q in enumerate(queries):
        groups[q.request.key].append(i)
    results: list[object] = [None] * len(queries)
    for indices in groups.values():
        first = queries[indices[0]]
        try:
            hits = search_embedded(
                store,
                [queries[i].text for i in indices],
                vectors[[row_of[i] for i in indices]] if first.request.embeds else None,
                first.request.embedded_for(model_generation),
            )
        except Exception as exc:  # noqa: BLE001 - fails only this group's queries
            hits = [exc] * len(indices)
        for i, found in zip(indices, hits, strict=True):
            results[i] = found
    return results


def search_modes(capabilities) -> list[str]:
    """The search modes (:data:`~densefit.choices.SEARCH_MODES`) a store of ``capabilities``
    runs: ``/health`` lists them for clients (the search page offers those)."""
    able = {"dense": True, "bm25": bool(capabilities.lexical), "hybrid": capabilities.hybrid}
    return [mode for mode in SEARCH_MODES if able[mode]]


# -- request and response bodies -------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SearchRequest(_Strict):
    """One query or a list; ``k`` results each; optional metadata filters (Haystack syntax);
    ranked by embedding, BM25 or both fused (``mode``)."""

    query: StrictStr | list[StrictStr] = Field(..., description="A query or a list of queries.")
    k: StrictInt = Field(10, description="Results per query.")
    filters: dict[str, Any] | None = Field(None, description="Metadata filter (Haystack syntax).")
    scale_score: StrictBool = Field(False, description="Scores scaled to [0, 1].")
    mode: Literal[SEARCH_MODES] = Field(
        "dense",
        description="dense: by embedding; bm25: by BM25 over the texts; hybrid: both, fused "
        "by reciprocal rank (filters apply to both sides).",
    )


MAX_ID_CHARS = 512


class DocumentIn(_Strict):
    """A document to add or replace (by id)."""

    # Lengths and contents are checked by the server's one text check (checked_request_text).
    id: StrictStr = Field(..., description=f"Non-empty, at most {MAX_ID_CHARS} characters.")
    text: StrictStr = Field(...)
    title: StrictStr = ""
    meta: dict[str, Any] = Field(default_factory=dict)


class UpsertRequest(_Strict):
    """Documents to add or replace, embedded with the store's model, committed in one go."""

    documents: list[DocumentIn]


class DeleteRequest(_Strict):
    """Ids of documents to delete (unknown ids are ignored)."""

    ids: list[StrictStr]


def _error(path: str, status: int, message: str, **extra) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, **extra), status_code=status)


_log = logging.getLogger("densefit.serve")
# FastAPI's words for its refusals, and ours
_HTTP_MESSAGES = {
    "There was an error parsing the body": (
        "the body is not valid JSON (it nests deeper than the parser allows, about 1,000 "
        "levels): send JSON that nests less"
    ),
    "Not Found": "no such route: see /docs for the routes",
    "Method Not Allowed": "this route does not take that method: see /docs",
}


# -- the guard: API key, body size, metrics ----------------------------------------------------

_WRITE_METHODS = {"POST", "DELETE", "PUT", "PATCH"}
_ARRIVAL = "densefit.search_arrival"  # scope key: the batcher's "arrived" callback
_BATCHED = {"/search", "/v1/embeddings", "/embed"}  # routes whose texts go through the batcher
_ADMIN = "/admin/reembed"
_ROUTES = {*_BATCHED, _ADMIN, "/documents", "/health", "/metrics", "/docs", "/openapi.json",
           *UI_PATHS}  # fmt: skip


def _route_label(path: str) -> str:
    """A bounded set of metric labels: ids in paths are not labels."""
    if path.startswith("/documents/"):
        return "/documents/{id}"
    return path if path in _ROUTES else "other"


def _is_json(content_type: bytes | None) -> bool:
    """``application/json`` or a ``+json`` type, whatever its parameters (charset)."""
    media = (content_type or b"").split(b";")[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


class Guard:
    """ASGI middleware: API key, request-body limit (413, read in full before the app sees
    it) and request metrics, in front of the FastAPI app."""

    def __init__(
        self, app, *, config: ServeConfig, metrics: Metrics, batcher: MicroBatcher | None = None
    ):
        self.app = app
        self.config = config
        self.metrics = metrics
        self.batcher = batcher
        self.key = config.api_key.encode() if config.api_key else None
        # the search page's files: a browser opening a page sends no key (its API calls do)
        self.open_paths = UI_PATHS if config.ui else frozenset()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}
        arrived = None
        if self.batcher is not None and scope["method"] == "POST" and scope["path"] in _BATCHED:
            # Announced before the body is read: a batch being collected waits for its queries.
            arrived = scope[_ARRIVAL] = self.batcher.announce()

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is None:
                body, refusal = await self._read_body(scope, receive)
            if refusal is None:
                refusal = _not_utf8(scope["path"], body)
            if refusal is not None:
                await refusal(scope, receive, send_status)
                return
            await self.app(scope, _replay(body), send_status)
        finally:
            if arrived is not None:
                arrived()  # refused, failed or answered: nothing more will come from it
            self.metrics.observe_request(
                _route_label(scope["path"]),
                scope["method"],
                status["code"],
                time.perf_counter() - start,
            )

    def _refusal(self, scope) -> JSONResponse | None:
        headers = dict(scope["headers"])
        path = scope["path"]
        if scope["method"] == "GET" and path in self.open_paths:
            return None
        if self.key is not None:
            given = headers.get(b"x-api-key")
            auth = headers.get(b"authorization", b"")
            if given is None and auth[:7].lower() == b"bearer ":
                given = auth[7:].strip()
            if given is None or not hmac.compare_digest(given, self.key):
                return _error(
                    path,
                    401,
                    "missing or wrong API key: send the header X-API-Key: KEY "
                    "(or Authorization: Bearer KEY)",
                )
        if path.startswith("/admin/") and self.key is None:
            return _error(
                path,
                403,
                "admin routes need an API key: start the server with --api-key (or "
                "DENSEFIT_API_KEY) and send it",
            )
        if scope["method"] in _WRITE_METHODS and path.startswith("/documents"):
            if not self.config.allow_writes:
                return _error(
                    path,
                    403,
                    "writes are disabled: a server bound to a non-local address accepts "
                    "writes only with --api-key (or DENSEFIT_API_KEY)",
                )
        length = headers.get(b"content-length")
        if length is not None:
            try:
                if int(length) > self.config.max_body_bytes:
                    return self._too_large(path)
            except ValueError:
                return _error(path, 400, "the Content-Length header is not a number")
        if scope["method"] in _WRITE_METHODS and not _is_json(headers.get(b"content-type")):
            declared = headers.get(b"content-type", b"").decode("latin-1") or "none"
            return _error(
                path, 415, f"the request body is declared {declared!r}, not JSON: {JSON_BODY_HINT}"
            )
        return None

    def _too_large(self, path: str) -> JSONResponse:
        return _error(
            path, 413, f"request body larger than {self.config.max_body_bytes} bytes: split it"
        )

    async def _read_body(self, scope, receive) -> tuple[bytes, JSONResponse | None]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", _error(scope["path"], 400, "the client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.config.max_body_bytes:
                return b"", self._too_large(scope["path"])
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _not_utf8(path: str, body: bytes) -> JSONResponse | None:
    """A 400 for a body that is not UTF-8 (JSON's encoding), naming the first bad byte."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _error(
            path,
            400,
            f"the body is not valid JSON: byte 0x{body[exc.start]:02x} at position {exc.start} "
            "is not UTF-8: send the JSON encoded as UTF-8",
        )
    return None


def _replay(body: bytes):
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # like a client that keeps the connection open
        return {"type": "http.disconnect"}  # pragma: no cover

    return receive


# -- the app -----------------------------------------------------------------------------------


def create_app(store, model, config: ServeConfig | None = None, *, close_store: bool = True):
    """A FastAPI app serving ``store`` with ``model`` (which must have made its embeddings:
    :class:`~densefit.retrieval.index.types.ModelMismatchError` otherwise, with the prompts
    the store was indexed with: :class:`~densefit.retrieval.index.settings.
    SettingsMismatchError` otherwise).

    The batcher and the writer start with the app (its lifespan) and stop with it: queued
    queries are answered, queued writes committed, then the store is closed (unless
    ``close_store=False``).
    """
    config = config or ServeConfig()
    # Queries get the model's query prompt and documents its document prompt, as the store's
    # were indexed (SettingsMismatchError when the model's prompts are not the store's), and
    # are embedded by config.runtime where its vectors may meet the store's (the same error
    # otherwise). The query workers resolve it by name again: their sessions use their threads.
    # After a model swap the served model is the store's new one (densefit.serve.swap).
    threads = worker_threads(config, torch.get_num_threads())
    make_state = query_state_maker(store, config, threads)
    served = ServedModel(store, model, make_state, device=str(getattr(model, "device", "cpu")))
    probe = StoreProbe(store, config.health_timeout)  # /health's and /metrics' bounded look
    metrics = Metrics(documents=probe.count)

    def run(items, state):
        search = functools.partial(
            search_queries, runtime=state.runtime, model_generation=state.generation
        )
        return run_batch(
            store, state.model, items, search, pass_cost_tokens=PASS_COST_TOKENS,
            runtime=state.runtime,
        )  # fmt: skip

    batcher = MicroBatcher(
        # Search queries and embeddings inputs share batches (densefit.serve.embeddings).
        lambda items: retrying_swaps(functools.partial(run, items), served),
        max_batch=config.max_batch,
        max_wait=config.max_wait_ms / 1000,
        workers=config.query_workers,
        threads_per_worker=threads,
        on_batch=metrics.observe_batch,
        max_batch_tokens=config.max_batch_tokens,
        # on the event loop: the model served now, never loading one (a batch does that)
        measure=lambda items: measure_request(served.state.model, items),
    )
    writer = DocumentWriter(
        store,
        lambda texts: served.current().encode_documents(texts),
        swap_vectors=served.swap_vectors,
        on_commit=metrics.observe_write,
        on_error=lambda: metrics.observe_error("write"),
        after_ack=lambda: _update_bm25(store),
    )

    admin = AdminSwap(served, runtime=config.runtime)

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        writer.start()
        try:
            yield
        finally:
            admin.stop()  # between commits: the swap stays resumable
            await batcher.stop()
            writer.stop()
            if close_store:
                store.close()

    app = FastAPI(
        title="densefit serve",
        description=f"Search and update the store {store.location!r} ({store.model_name}).",
        lifespan=lifespan,
    )
    app.state.metrics, app.state.batcher, app.state.writer = metrics, batcher, writer
    app.state.store, app.state.config = store, config
    app.state.served, app.state.admin = served, admin
    _add_error_handlers(app, metrics, config)
    _add_routes(app, store, config, batcher, writer, metrics, probe)
    _add_admin_routes(app, admin, config)
    add_embedding_routes(app, store, served, config, batcher, _ARRIVAL)
    if config.ui:
        add_ui_routes(app)
    app.add_middleware(Guard, config=config, metrics=metrics, batcher=batcher)
    return app


class ReembedRequest(_Strict):
    """The model to swap the store to."""

    model: StrictStr = Field(
        ..., description="A sentence-transformers folder or name the server can load."
    )


def _add_admin_routes(app, admin: AdminSwap, config: ServeConfig) -> None:
    @app.post(_ADMIN, summary="Swap the store to another model, with no downtime", status_code=202)
    def start_reembed(request: Annotated[ReembedRequest, Body()]) -> dict:
        checked_request_text(request.model, "model", max_chars=config.max_text_chars)
        try:
            return admin.start(request.model)
        except RuntimeError as exc:
            raise ClientError(409, str(exc)) from None
        except StoreUnavailableError:
            raise  # the engine's fault, not the request's: 503
        except ValueError as exc:
            raise ClientError(422, str(exc), param="model") from None

    @app.get(_ADMIN, summary="The model swap's progress")
    def reembed_status() -> dict:
        return admin.report()


def _update_bm25(store) -> None:
    """After a write is acknowledged: bring the BM25 index up to date in the writer thread, if
    this server searched by BM25 already, so that the next BM25 search does not wait for it."""
    if store.capabilities.upkeep and store.bm25_loaded:
        store.update_bm25()


def _add_error_handlers(app, metrics: Metrics, config: ServeConfig) -> None:
    @app.exception_handler(StoreUnavailableError)
    async def unreachable(request: Request, exc: StoreUnavailableError):
        metrics.observe_error("store_unavailable")
        return _unavailable(request.url.path, str(exc), config)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        status, message, detail = validation_message(list(exc.errors()))
        path = request.url.path
        if path.startswith("/v1/") or path == "/embed":
            return _error(path, status, message)
        return _error(path, status, message, detail=detail)

    @app.exception_handler(ClientError)
    async def refused(request: Request, exc: ClientError):
        return _error(request.url.path, exc.status, str(exc), param=exc.param)

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError):
        return _error(request.url.path, 400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's own refusals (no such route, a body its JSON parser gave up on), in the
        # project's shape
        message = _HTTP_MESSAGES.get(str(exc.detail), str(exc.detail))
        return _error(request.url.path, exc.status_code, message)

    @app.exception_handler(StorageFault)
    async def machine(request: Request, exc: StorageFault):
        return _error(request.url.path, exc.status, str(exc))

    async def system_error(request: Request, exc: Exception):
        fault = storage_fault(exc)  # a full disk, a read-only or damaged file: not a bug
        if fault is not None:
            return _error(request.url.path, fault.status, str(fault))
        _log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _internal_error(request.url.path, exc)

    app.exception_handler(OSError)(system_error)
    app.exception_handler(sqlite3.Error)(system_error)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        # a bug: Starlette raises it again after this answer, and the server logs its traceback
        return _internal_error(request.url.path, exc)


def _unavailable(path: str, message: str, config: ServeConfig) -> JSONResponse:
    """503: the store's engine cannot be reached; ``Retry-After`` says when to try again."""
    return JSONResponse(
        unavailable_body(path, " ".join(message.split())),
        status_code=503,
        headers={"Retry-After": str(config.retry_after)},
    )


def _internal_error(path: str, exc: Exception) -> JSONResponse:
    why = " ".join(str(exc).split())[:300]
    return _error(
        path,
        500,
        f"internal error: {exc.__class__.__name__}{': ' + why if why else ''} (a bug; the "
        "server's log holds the traceback)",
    )


def _check_texts(texts: str | list[str], what: str, config: ServeConfig) -> None:
    """Each text checked (:func:`~densefit.serve.errors.checked_request_text`), named
    ``what`` for a single text and ``what[i]`` in a list."""
    if isinstance(texts, str):
        checked_request_text(texts, what, max_chars=config.max_text_chars)
    for i, text in enumerate([] if isinstance(texts, str) else texts):
        checked_request_text(text, f"{what}[{i}]", max_chars=config.max_text_chars)


def _check_filters(filters: dict | None, capabilities) -> Filter | None:
    if not filters:
        return None
    checked_request_json(filters, "filters")
    return parse_filters(filters, capabilities)  # ValueError -> 400 saying what is wrong


def _check_document(doc: DocumentIn, i: int, config: ServeConfig) -> None:
    where = f"documents[{i}]"
    checked_request_text(doc.id, f"{where}.id", max_chars=config.max_text_chars)
    if len(doc.id) > MAX_ID_CHARS:
        raise ClientError(
            422, f"{where}.id: has {len(doc.id):,} characters; ids have at most {MAX_ID_CHARS}"
        )
    checked_request_text(doc.text, f"{where}.text", max_chars=config.max_text_chars)
    checked_request_text(
        doc.title, f"{where}.title", max_chars=config.max_text_chars, empty_ok=True
    )
    checked_request_json(doc.meta, f"{where}.meta")
    bad = non_finite_path(doc.meta)
    if bad is not None:
        raise ClientError(
            422,
            f"{where}.meta.{bad}: NaN or infinite: metadata numbers must be finite (filters "
            "compare them)",
            param=f"{where}.meta.{bad}",
        )


def _add_routes(app, store, config, batcher, writer, metrics, probe) -> None:
    """The routes; each one small, the work is in the batcher and the writer."""

    @app.post("/search", summary="Search with one query or a list")
    async def search(request: Annotated[SearchRequest, Body()], http: Request) -> JSONResponse:
        texts = [request.query] if isinstance(request.query, str) else request.query
        if not texts:
            raise ClientError(422, "query is an empty list")
        if len(texts) > config.max_queries:
            raise ClientError(
                413, f"{len(texts)} queries in one request; the limit is {config.max_queries}"
            )
        if not 1 <= request.k <= config.max_k:
            raise ClientError(422, f"k must be between 1 and {config.max_k}, got {request.k}")
        _check_texts(request.query, "query", config)
        filters = _check_filters(request.filters, store.capabilities)
        # the request's one search request, shared by its queries
        asked = StoreRequest(request.mode, request.k, filters, scale_score=request.scale_score)
        queries = [Query(t, asked) for t in texts]
        found = await batcher.search(queries, http.scope.get(_ARRIVAL))
        # A ready JSONResponse skips FastAPI's recursive jsonable_encoder over every hit.
        return JSONResponse(
            {
                "results": [
                    {"query": t, "hits": [h.to_dict() for h in hits]}
                    for t, hits in zip(texts, found, strict=True)
                ]
            }
        )

    @app.post("/documents", summary="Add or replace documents (acknowledged after commit)")
    async def upsert(request: Annotated[UpsertRequest, Body()]) -> dict:
        docs = request.documents
        if not docs:
            raise ClientError(422, "documents is an empty list")
        if len(docs) > config.max_documents:
            raise ClientError(
                413, f"{len(docs)} documents in one request; the limit is {config.max_documents}"
            )
        ids = [d.id for d in docs]
        if len(set(ids)) != len(ids):
            twice = next(i for i in ids if ids.count(i) > 1)
            raise ClientError(422, f"document id {twice!r} appears twice in one request")
        for i, doc in enumerate(docs):
            _check_document(doc, i, config)
        batch = [Document(d.id, d.text, d.title, d.meta) for d in docs]
        ack = await asyncio.wrap_future(writer.upsert(batch))
        return {"added": ack.added, "updated": ack.updated, "committed": True}

    @app.delete("/documents", summary="Delete documents by id (acknowledged after commit)")
    async def delete(request: Annotated[DeleteRequest, Body()]) -> dict:
        if len(request.ids) > config.max_documents:
            raise ClientError(
                413, f"{len(request.ids)} ids in one request; the limit is {config.max_documents}"
            )
        for i, doc_id in enumerate(request.ids):
            checked_request_text(doc_id, f"ids[{i}]", max_chars=config.max_text_chars)
        ack = await asyncio.wrap_future(writer.delete(request.ids))
        return {"deleted": ack.deleted, "committed": True}

    @app.get("/documents/{doc_id:path}", summary="One document by id")
    def get_document(doc_id: str) -> dict:
        found = store.get([doc_id])[0]
        if found is None:
            raise ClientError(404, f"no document with id {doc_id!r}")
        return {"id": found.id, "text": found.text, "title": found.title, "meta": found.meta}

    @app.get(
        "/health",
        summary="Liveness and what is served; 503 (with Retry-After) while the store's "
        "engine cannot be reached",
    )
    def health() -> dict:
        documents = probe.count()  # bounded: StoreUnavailableError -> 503
        served = app.state.served.state  # the model generation answering now
        return {
            "status": "ok",
            "engine": store.capabilities.engine,
            "modes": search_modes(store.capabilities),
            "max_k": config.max_k,
            "documents": documents,
            "model": store.model_name,
            "dim": store.dim,
            "vectors": getattr(store, "vector_kind", None),
            "runtime": served.runtime,
            "runtime_ms": {k: round(v, 2) for k, v in served.runtime_ms.items()},
            "pending_writes": writer.pending,
        }

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")
