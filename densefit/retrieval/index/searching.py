"""Searching a store with a model: embed the queries (unless the search is BM25 only), then ask
the store, by embedding, by BM25 or by both fused (``mode``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from densefit.data.text import checked_texts
from densefit.models import load_model
from densefit.retrieval.encode import configure_model, encode_texts
from densefit.retrieval.index.base import DocumentStore
from densefit.retrieval.index.common import scaled_scores
from densefit.retrieval.index.filters import Filter
from densefit.retrieval.index.request import SearchRequest
from densefit.retrieval.index.settings import check_search_settings, search_options
from densefit.retrieval.index.types import SearchHit, StoreError
from densefit.retrieval.runtimes import resolve_runtime

__all__ = [
    "embed_queries",
    "model_for_store",
    "query_runtime",
    "scaled_scores",
    "search",
    "search_batch",
    "search_embedded",
]


def model_for_store(
    store,
    model: str | None = None,
    *,
    device: str = "auto",
    query_prompt: str | None = None,
    document_prompt: str | None = None,
    dim: int | None = None,
):
    """The model that searches ``store``: ``model`` (a name or folder), else the one the
    store was indexed with, loaded on ``device`` and embedding as the store recorded (its
    prompts and vector size, unless given: :func:`~densefit.retrieval.index.settings.search_options`).

    The one way ``densefit search``, ``eval --store`` and ``serve`` pick it. A recorded model
    that cannot be loaded here is a :class:`~densefit.retrieval.index.types.StoreError`
    saying to pass one.
    """

    name = model or store.model_name
    try:
        loaded = load_model(name, device=device)
    except Exception as exc:  # noqa: BLE001 - say which model and how to fix
        if model:
            raise
        raise StoreError(
            f"{store.location} was indexed with {name!r}, which cannot be "
            f"loaded here ({exc.__class__.__name__}: {str(exc)[:200]}): "
            "pass --model PATH_TO_THAT_MODEL (model= in Python)"
        ) from None
    settings = store.settings
    return configure_model(loaded, **search_options(settings, query_prompt, document_prompt, dim))


def query_runtime(store, model, runtime="auto"):
    """The runtime that embeds queries for ``store`` (:func:`~densefit.retrieval.runtimes.
    resolve_runtime` against the store's vectors), after checking the model's prompts and
    the runtime rule (:func:`~densefit.retrieval.index.settings.check_search_settings`).

    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.index import open_store
    >>> model = tiny_model()
    >>> query_runtime(open_store(None, model), model).name
    'torch'
    """
    settings = store.settings
    stored = settings.source if settings is not None else None
    runner = resolve_runtime(model, runtime, stored=stored, mixing=False)
    check_search_settings(settings, model, store.location, runner)
    return runner


def search(
    store: DocumentStore,
    model,
    query: str,
    top_k: int = 10,
    *,
    filters: Filter | dict | None = None,
    scale_score: bool = False,
    mode: str = "dense",
    fusion=None,
    runtime="auto",
) -> list[SearchHit]:
    """The ``top_k`` documents of ``store`` best matching ``query``, best first.

    ``mode``, ``filters``, ``scale_score`` and ``fusion``: as
    :class:`~densefit.retrieval.index.request.SearchRequest` says (a malformed filter raises
    ValueError); with ``mode="bm25"`` the model is not run and may be None.

    Raises :class:`~densefit.retrieval.index.types.ModelMismatchError` when ``model`` did not make the
    store's embeddings, and :class:`~densefit.retrieval.index.types.SettingsMismatchError`
    when its prompts are not those the store was indexed with. The query gets the model's
    query prompt, and is cut to the model's ``truncate_dim`` as the documents were.
    ``runtime`` runs the transformer (:data:`densefit.choices.RUNTIME_CHOICES`): ``auto``
    picks the fastest exported one whose vectors may meet the store's; another is refused by
    the same rule (:func:`~densefit.retrieval.index.settings.check_runtime`).

    >>> from densefit.testing import tiny_model
    >>> from densefit.data.types import Document
    >>> from densefit.retrieval.index import open_store
    >>> from densefit.retrieval.index.indexing import index_documents
    >>> model = tiny_model()
    >>> store = open_store(None, model)
    >>> _ = index_documents(store, model, [Document("a", "cells divide"), Document("b", "python")])
    >>> [hit.id for hit in search(store, model, "python", top_k=1)]
    ['b']
    >>> [hit.id for hit in search(store, None, "cells", mode="bm25")]
    ['a']
    """
    if not isinstance(query, str):
        raise TypeError("search takes one query string; use search_batch for a list")
    return search_batch(
        store,
        model,
        [query],
        top_k=top_k,
        filters=filters,
        scale_score=scale_score,
        mode=mode,
        fusion=fusion,
        runtime=runtime,
    )[0]


def search_batch(
    store: DocumentStore,
    model,
    queries: Sequence[str],
    top_k: int = 10,
    *,
    filters: Filter | dict | None = None,
    scale_score: bool = False,
    batch_size: int = 64,
    show_progress: bool = False,
    mode: str = "dense",
    fusion=None,
    runtime="auto",
) -> list[list[SearchHit]]:
    """:func:`search` for many queries at once (one matrix product per chunk of the store);
    ``filters``, ``scale_score``, ``mode``, ``fusion`` and ``runtime`` (as :func:`search`) apply
    to every query.

    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.index import open_store
    >>> store = open_store(None, tiny_model())
    >>> search_batch(store, tiny_model(), ["a", "b"])  # an empty store finds nothing
    [[], []]
    """

    if isinstance(queries, str):
        raise TypeError("search_batch takes a list of queries; use search for one string")
    queries = checked_texts(list(queries), "queries")  # InvalidText (a ValueError) names it
    # the one request of this search: the mode checked, the filter parsed, before the model runs
    request = SearchRequest(mode, top_k, filters, fusion, scale_score)
    if not queries:
        return []
    embeddings = None
    if request.embeds:
        if model is None:
            raise ValueError(f"{mode} search embeds the queries: pass the store's model")
        embeddings = embed_queries(
            store,
            model,
            queries,
            runtime=runtime,
            batch_size=batch_size,
            show_progress=show_progress,
        )
    return search_embedded(store, queries, embeddings, request)


def embed_queries(
    store: DocumentStore,
    model,
    texts: Sequence[str],
    *,
    runtime="auto",
    checked: bool = False,
    **encoding,
) -> np.ndarray:
    """The embeddings ``store`` is searched with for ``texts``: ``model`` checked against the
    store (:meth:`~densefit.retrieval.index.base.DocumentStore.check_model`), the model's
    query prompt, the transformer run by ``runtime`` as the store's vectors allow
    (:func:`query_runtime`). ``checked=True``: the caller did both for this model and
    ``runtime`` (a server, once per model, not per batch). ``encoding``: further arguments
    of :func:`~densefit.retrieval.encode.encode_texts` (``batch_size``, ``tokens``...).

    The one place a query is embedded for a search: ``densefit search`` and ``eval``,
    :class:`~densefit.api.Retriever`, ``densefit serve`` and the Haystack retrievers.
    """
    if not checked:
        store.check_model(model)
        runtime = query_runtime(store, model, runtime)  # checks the store's settings too
    return encode_texts(model, list(texts), prompt_name="query", runtime=runtime, **encoding)


def search_embedded(
    store: DocumentStore,
    texts: Sequence[str],
    embeddings: np.ndarray | None,
    request: SearchRequest,
) -> list[list[SearchHit]]:
    """Search ``store`` for the query ``texts`` with their ``embeddings`` (from
    :func:`embed_queries`; None when ``request``'s mode embeds nothing) as ``request`` says
    (:class:`~densefit.retrieval.index.request.SearchRequest`, made where the search came
    in): each is handed to :meth:`~densefit.retrieval.index.base.DocumentStore.search`
    when the mode reads it."""
    return store.search(
        embeddings if request.embeds else None,
        query_texts=list(texts) if request.reads_texts else None,
        request=request,
    )
