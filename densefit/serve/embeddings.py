"""Embeddings endpoints of ``densefit serve``: ``POST /v1/embeddings`` (OpenAI's shape) and
``POST /embed`` (text-embeddings-inference's shape), with the served model.

Their texts go through the same :class:`~densefit.serve.batcher.MicroBatcher` as the search
queries: an :class:`EmbedInput` waits in the queue beside the queries of ``/search`` and is
embedded in the same batch (:func:`run_batch`: one forward pass per prompt the batch needs,
with the model's prompts applied as :func:`~densefit.retrieval.encode.encode_texts` applies
them).

The prompt rule, declared once (:data:`densefit.choices.EMBED_PROMPTS`): every text gets the
store's query prompt or its document prompt (the model's ``prompts``, which the store was
indexed with), chosen by ``input_type`` (``/v1/embeddings``) or TEI's ``prompt_name``
(``/embed``); without one, :attr:`ServeConfig.embed_prompt` (``"query"``). A model without
prompts embeds every text as it is.

The vectors are the store's kind: the served size (``truncate_dim`` when the store was cut
with ``--dim``); in a cosine store ``/v1/embeddings`` gives them at unit length, as the store
keeps them, so an input embedded as a ``document`` equals the stored vector of the same text.
``dimensions`` (Matryoshka) cuts them further and re-normalises; it is accepted below the
served size only for a model trained with ``--matryoshka-dims`` (or when
:attr:`ServeConfig.matryoshka` says so). Inputs longer than the model's ``max_seq_length``
tokens are truncated, as documents are when indexed (``/embed`` with ``"truncate": false``
refuses them with 413, as TEI does). ``usage`` counts the tokens embedded: prompt and special
tokens included, after truncation.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np

from densefit.choices import EMBED_PROMPTS
from densefit.config.options import flag_of
from densefit.losses.matryoshka import truncate
from densefit.prompts import model_prompts
from densefit.retrieval.encode import TextTokens, encode_texts, tokenize_texts
from densefit.serve.batcher import Query
from densefit.serve.config import ServeConfig
from densefit.serve.errors import ClientError, checked_request_text

try:
    from fastapi import Body, Request
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"densefit serve needs FastAPI and uvicorn ({exc.name} is missing): "
        "pip install 'densefit[serve]'"
    ) from None

__all__ = [
    "EmbedInput",
    "Embedded",
    "OpenAIEmbeddingRequest",
    "TEIEmbedRequest",
    "add_embedding_routes",
    "matryoshka_trained",
    "measure_request",
    "measure_tokens",
    "run_batch",
]


@dataclass
class EmbedInput:
    """One text of an embeddings request, queued in the micro-batcher beside search queries.

    ``prompt_name`` is one of :data:`~densefit.choices.EMBED_PROMPTS`; ``truncate=False``
    makes a text longer than the model's ``max_seq_length`` tokens fail with 413 instead."""

    text: str
    prompt_name: str = "query"
    truncate: bool = True
    future: asyncio.Future | None = field(default=None, repr=False)
    tokens: TextTokens | None = field(default=None, repr=False)  # set by measure_tokens


@dataclass(frozen=True)
class Embedded:
    """What the batch gives an :class:`EmbedInput`: its ``(dim,)`` float32 vector (as the
    model made it, cut to the served size) and the tokens it took."""

    vector: np.ndarray
    tokens: int


def run_batch(
    store,
    model,
    items: Sequence[Query | EmbedInput],
    search: Callable[..., list],
    *,
    pass_cost_tokens: int | None = None,
    runtime: str = "torch",
) -> list[object]:
    """Run one micro-batch: embed every text (one forward pass per prompt the batch needs),
    then ``search(store, model, queries, embeddings=...)`` for the search queries (BM25
    ones are not embedded: ``embeddings`` holds the others' rows, in order); one result
    (hit list, :class:`Embedded` or exception) per item, in order. ``runtime`` runs the
    model (:func:`~densefit.retrieval.runtimes.resolve_runtime`; resolved in the calling
    worker thread, so its sessions use that worker's threads). Items the batcher measured
    (:func:`measure_tokens`) are embedded from their token ids; others are measured here.

    A batch of search queries only is handed to ``search`` as it is (it embeds them itself).
    """
    if all(isinstance(item, Query) for item in items):
        return search(store, model, list(items))
    results: list[object] = [None] * len(items)
    unmeasured = [i for i, item in enumerate(items) if item.tokens is None and _embedded(item)]
    refused = measure_tokens(model, [items[i] for i in unmeasured])
    for i, refusal in zip(unmeasured, refused, strict=True):
        results[i] = refusal
    prompts = model_prompts(model)
    # Texts wanting the same prompt share a pass; without such a prompt they all share one.
    groups: dict[str | None, list[int]] = {}
    for i, item in enumerate(items):
        if results[i] is None and _embedded(item):
            groups.setdefault(_prompt_of(item, prompts), []).append(i)
    vectors: dict[int, np.ndarray] = {}
    for name, indices in groups.items():
        try:
            embedded = encode_texts(
                model,
                [items[i].text for i in indices],
                batch_size=max(len(indices), 1),
                prompt_name=name,
                pass_cost_tokens=pass_cost_tokens,
                runtime=runtime,
                tokens=[items[i].tokens for i in indices],
            )
        except Exception as exc:  # noqa: BLE001 - fails only this group's items
            for i in indices:
                results[i] = exc
            continue
        vectors.update(zip(indices, embedded, strict=True))
    for i, item in enumerate(items):
        if isinstance(item, EmbedInput) and i in vectors:
            results[i] = Embedded(vectors[i], item.tokens.count)
    queries = [
        i
        for i, item in enumerate(items)
        if isinstance(item, Query) and (i in vectors or not item.request.embeds)
    ]
    dense = [i for i in queries if items[i].request.embeds]
    if queries:
        found = search(
            store,
            model,
            [items[i] for i in queries],
            embeddings=np.stack([vectors[i] for i in dense]) if dense else None,
        )
        for i, hits in zip(queries, found, strict=True):
            results[i] = hits
    return results


def measure_tokens(model, items: Sequence[Query | EmbedInput]) -> list[ClientError | None]:
    """Tokenize each item the forward pass embeds (not BM25 queries) as its batch will embed
    it (:func:`~densefit.retrieval.encode.tokenize_texts`: its prompt, truncated to the
    model's ``max_seq_length``) and set its ``tokens``: the batch's token budget counts them
    and the pass embeds their token ids. An embeddings input with ``truncate=False`` over
    ``max_seq_length`` gets no tokens: its entry is the 413 saying so (None for the others).
    """
    prompts = model_prompts(model)
    groups: dict[tuple[str | None, bool], list[int]] = {}
    for i, item in enumerate(items):
        if _embedded(item):
            truncation = isinstance(item, Query) or item.truncate
            groups.setdefault((_prompt_of(item, prompts), truncation), []).append(i)
    refused: list[ClientError | None] = [None] * len(items)
    limit = model.max_seq_length
    for (name, truncation), indices in groups.items():
        texts = [items[i].text for i in indices]
        measured = tokenize_texts(model, texts, prompt_name=name, truncation=truncation)
        for i, tokens in zip(indices, measured, strict=True):
            if not truncation and limit and tokens.count > limit:
                refused[i] = ClientError(
                    413,
                    f"inputs: a text has {tokens.count} tokens (its prompt and special tokens "
                    f'included); the model reads at most {limit}: shorten it or send "truncate": '
                    "true",
                    param="inputs",
                )
            else:
                items[i].tokens = tokens
    return refused


def measure_request(model, items: Sequence[Query | EmbedInput]) -> None:
    """:func:`measure_tokens` for one request's items, raising the first refusal (the
    batcher's ``measure``: the request is answered with it, nothing is queued)."""
    for refusal in measure_tokens(model, items):
        if refusal is not None:
            raise refusal


def _embedded(item: Query | EmbedInput) -> bool:
    """Whether the forward pass embeds ``item``: BM25 queries are searched by their text."""
    return not isinstance(item, Query) or item.request.embeds


def _prompt_of(item: Query | EmbedInput, prompts: dict[str, str]) -> str | None:
    """The prompt name ``item`` is embedded with (None: the model has no such prompt)."""
    name = "query" if isinstance(item, Query) else item.prompt_name
    return name if prompts.get(name) else None


def matryoshka_trained(store, model) -> bool:
    """Whether the served model was trained with ``--matryoshka-dims`` (its folder's
    ``densefit_config.json`` records the sizes), so that its embeddings cut to fewer
    dimensions still retrieve well."""
    for name in (store.model_name, getattr(model, "_densefit_name", None)):
        if not name:
            continue
        config = Path(str(name)).expanduser() / "densefit_config.json"
        try:
            dims = json.loads(config.read_text(encoding="utf-8")).get("matryoshka_dims")
        except (OSError, ValueError, AttributeError):
            continue
        if dims:
            return True
    return False


# -- request bodies ----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class OpenAIEmbeddingRequest(_Strict):
    """OpenAI's embeddings request (``input`` a text or a list of texts)."""

    input: StrictStr | list[Any] = Field(..., description="A text or a list of texts.")
    model: StrictStr | None = Field(
        None,
        description="Any name: the server embeds with the model it serves, named in the response.",
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes."
    )
    dimensions: StrictInt | None = Field(
        None, description="Cut to this many dimensions and re-normalise (Matryoshka models)."
    )
    input_type: Literal[EMBED_PROMPTS] | None = Field(  # type: ignore[valid-type]
        None, description="Which of the store's prompts the texts get (default: the server's)."
    )
    user: StrictStr | None = Field(None, description="Accepted and ignored.")


class TEIEmbedRequest(_Strict):
    """text-embeddings-inference's ``/embed`` request."""

    inputs: StrictStr | list[Any] = Field(..., description="A text or a list of texts.")
    normalize: StrictBool = Field(True, description="Unit-length vectors.")
    truncate: StrictBool | None = Field(
        None, description="Truncate texts over the model's length (default: refuse, 413)."
    )
    truncation_direction: Literal["right", "Right", "left", "Left"] = Field(
        "right", description="Only right truncation is supported."
    )
    prompt_name: Literal[EMBED_PROMPTS] | None = Field(  # type: ignore[valid-type]
        None, description="Which of the store's prompts the texts get (default: the server's)."
    )


def _texts(value: Any, field_name: str, config) -> list[str]:
    """The request's texts, each checked like every other text of the server."""
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise ClientError(422, f"{field_name} is an empty list", param=field_name)
    if len(texts) > config.max_embed_inputs:
        raise ClientError(
            413,
            f"{len(texts)} {field_name} in one request; the limit is {config.max_embed_inputs}",
            param=field_name,
        )
    where = field_name if isinstance(value, str) else None
    for i, text in enumerate(texts):
        name = where or f"{field_name}[{i}]"
        if isinstance(text, int | list) and not isinstance(text, bool):
            raise ClientError(
                422,
                f"{name}: token arrays are not supported (the server has its own tokenizer): "
                "send the texts (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)",
                param=field_name,
            )
        checked_request_text(text, name, max_chars=config.max_text_chars)
    return texts


# -- the routes --------------------------------------------------------------------------------


def add_embedding_routes(app, store, served, config, batcher, arrival_key: str) -> None:
    """``POST /v1/embeddings`` and ``POST /embed`` on ``app``, through ``batcher``, for the
    model ``served`` serves (:class:`~densefit.serve.swap.ServedModel`: after a model swap,
    the new one)."""

    async def embed(texts: list[str], prompt_name: str, truncate: bool, http: Request):
        items = [EmbedInput(t, prompt_name, truncate) for t in texts]
        found = await batcher.search(items, http.scope.get(arrival_key))
        return np.stack([e.vector for e in found]), sum(e.tokens for e in found)

    @app.post("/v1/embeddings", summary="Embed texts (OpenAI's embeddings API)")
    async def openai_embeddings(
        request: Annotated[OpenAIEmbeddingRequest, Body()], http: Request
    ) -> JSONResponse:
        texts = _texts(request.input, "input", config)
        served_dim, name = store.dim, store.model_name
        # on the event loop: the model served now, never loading one (a batch does that)
        matryoshka, cosine = served.state.matryoshka, store.similarity == "cosine"
        dims = request.dimensions
        if dims is not None and not 1 <= dims <= served_dim:
            raise ClientError(
                422, f"dimensions must be between 1 and {served_dim}, got {dims}", "dimensions"
            )
        if dims is not None and dims < served_dim and not matryoshka:
            raise ClientError(
                422,
                f"dimensions {dims}: {name} was not trained with --matryoshka-dims, so its "
                f"embeddings cut below {served_dim} dimensions retrieve poorly: omit "
                f"dimensions (a Matryoshka model trained elsewhere: serve it with `densefit "
                f"serve {flag_of(ServeConfig, 'matryoshka')}`, ServeConfig(matryoshka=True) "
                "in Python)",
                "dimensions",
            )
        vectors, tokens = await embed(texts, request.input_type or config.embed_prompt, True, http)

        def render() -> bytes:
            out = vectors
            if dims is not None and dims < served_dim:  # OpenAI's: shortened, unit length
                out = _unit(truncate(out, dims))
            elif cosine:
                out = _unit(out)
            data = [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": _encoded(v, request.encoding_format),
                }
                for i, v in enumerate(out)
            ]
            usage = {"prompt_tokens": tokens, "total_tokens": tokens}
            return _json({"object": "list", "data": data, "model": name, "usage": usage})

        return _raw_json(await asyncio.get_running_loop().run_in_executor(None, render))

    @app.post("/embed", summary="Embed texts (text-embeddings-inference's API)")
    async def tei_embed(request: Annotated[TEIEmbedRequest, Body()], http: Request) -> JSONResponse:
        texts = _texts(request.inputs, "inputs", config)
        if request.truncation_direction.lower() != "right":
            raise ClientError(
                422,
                "truncation_direction: only right truncation is supported",
                "truncation_direction",
            )
        truncate = bool(request.truncate)
        vectors, _ = await embed(texts, request.prompt_name or config.embed_prompt, truncate, http)

        def render() -> bytes:
            out = _unit(vectors) if request.normalize else vectors
            return _json([v.tolist() for v in out])

        return _raw_json(await asyncio.get_running_loop().run_in_executor(None, render))


def _unit(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def _encoded(vector: np.ndarray, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _json(payload) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode("utf-8")


class _RawJSON(JSONResponse):
    def render(self, content) -> bytes:  # already rendered in a worker thread
        return content


def _raw_json(body: bytes) -> JSONResponse:
    return _RawJSON(body)
