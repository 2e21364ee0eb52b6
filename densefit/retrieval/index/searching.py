"""Searching a store with a model: embed the queries, then ask the store."""

from __future__ import annotations

from collections.abc import Sequence

from densefit.retrieval.index.base import DocumentStore, SearchHit
from densefit.retrieval.index.settings import check_search_settings

__all__ = ["search", "search_batch"]


def search(store: DocumentStore, model, query: str, top_k: int = 10) -> list[SearchHit]:
    """The ``top_k`` documents of ``store`` best matching ``query``, best first.

    Raises :class:`~densefit.retrieval.index.base.ModelMismatchError` when ``model`` did not make the
    store's embeddings, and :class:`~densefit.retrieval.index.settings.SettingsMismatchError`
    when its prompts are not those the store was indexed with. The query gets the model's
    query prompt, and is cut to the model's ``truncate_dim`` as the documents were.

    >>> from densefit.testing import tiny_model
    >>> from densefit.data.types import Document
    >>> from densefit.retrieval.index import open_store
    >>> from densefit.retrieval.index.indexing import index_documents
    >>> model = tiny_model()
    >>> store = open_store(None, model)
    >>> _ = index_documents(store, model, [Document("a", "cells divide"), Document("b", "python")])
    >>> [hit.id for hit in search(store, model, "python", top_k=1)]
    ['b']
    """
    if not isinstance(query, str):
        raise TypeError("search takes one query string; use search_batch for a list")
    return search_batch(store, model, [query], top_k=top_k)[0]


def search_batch(
    store: DocumentStore,
    model,
    queries: Sequence[str],
    top_k: int = 10,
    *,
    batch_size: int = 64,
    show_progress: bool = False,
) -> list[list[SearchHit]]:
    """:func:`search` for many queries at once (one matrix product per chunk of the store).

    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.index import open_store
    >>> store = open_store(None, tiny_model())
    >>> search_batch(store, tiny_model(), ["a", "b"])  # an empty store finds nothing
    [[], []]
    """
    from densefit.retrieval.encode import encode_texts

    if isinstance(queries, str):
        raise TypeError("search_batch takes a list of queries; use search for one string")
    store.check_model(model)
    check_search_settings(getattr(store, "settings", None), model, getattr(store, "path", ""))
    embeddings = encode_texts(
        model,
        list(queries),
        batch_size=batch_size,
        show_progress=show_progress,
        prompt_name="query",
    )
    if not len(embeddings):
        return []
    return store.search(embeddings, top_k=top_k)
