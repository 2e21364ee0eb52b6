"""Indexing, retrieval and evaluation methods for :class:`densefit.retrieval.retriever.Retriever`.

:class:`RetrievalMixin` is mixed into ``Retriever``. Attribute contract -- the class it is
mixed into provides:

``self.model``
    the :class:`sentence_transformers.SentenceTransformer` used for queries and documents.
``self.store``
    ``None`` until :meth:`RetrievalMixin.index` (or the user) sets it; then an object
    satisfying :class:`densefit.retrieval.index.base.DocumentStore`, normally a
    :class:`densefit.retrieval.index.store.LocalDocumentStore`. ``index`` sets it.
``self.batch_size`` (optional)
    default encoding batch size for queries; 64 when absent.

The store remembers the model that embedded it, so retrieving after the model was trained in
place (or swapped) raises :class:`densefit.retrieval.index.base.ModelMismatchError`: call ``index``
again to re-embed the documents with the current weights.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence

from densefit.data.types import Document
from densefit.retrieval.index.base import SearchHit, StoreError

__all__ = ["RetrievalMixin", "as_document"]


def as_document(item, position: int = 0) -> Document:
    """A :class:`Document` from a Document, a Haystack-style dict or a plain string.

    Dicts use ``id`` (or ``_id``), ``content`` (or ``text``), ``title`` and ``meta``; strings
    and dicts without an id get a stable id from their text's hash.

    >>> as_document({"id": "7", "content": "Cells divide.", "title": "Biology"}).text
    'Biology Cells divide.'
    >>> as_document("some text").id
    'sha1:37aa63c77398d954'
    """
    if isinstance(item, Document):
        return item
    if isinstance(item, str):
        return Document(id=_hash_id(item), text=item)
    if isinstance(item, Mapping):
        body = item.get("content", item.get("text"))
        if not isinstance(body, str):
            raise TypeError(
                f"documents[{position}] has no text: a dict needs 'content' (or 'text') "
                f"holding a string, got keys {sorted(item)}"
            )
        title = item.get("title") or ""
        doc_id = item.get("id", item.get("_id"))
        text = f"{title} {body}".strip() if title else body
        return Document(
            id=str(doc_id) if doc_id is not None else _hash_id(text),
            text=text,
            title=title,
            meta=dict(item.get("meta") or {}),
        )
    raise TypeError(
        f"documents[{position}] is a {type(item).__name__}: pass Documents, dicts with "
        "'content', or strings"
    )


def _hash_id(text: str) -> str:
    return "sha1:" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


class RetrievalMixin:
    """``index`` / ``retrieve`` / ``retrieve_batch`` / ``evaluate`` over ``self.store``.

    >>> from densefit.testing import tiny_model
    >>> class Demo(RetrievalMixin):
    ...     def __init__(self, model):
    ...         self.model, self.store = model, None
    >>> retriever = Demo(tiny_model())
    >>> report = retriever.index([{"id": "a", "content": "cells divide"}, {"id": "b", "content": "python"}])
    >>> [hit.id for hit in retriever.retrieve("python", top_k=1)]
    ['b']
    """

    model: object
    store: object

    def index(
        self,
        documents: Iterable[Document | Mapping | str],
        store: str | os.PathLike | object | None = None,
        batch_size: int = 64,
        *,
        backend: str | None = None,
        show_progress: bool = False,
    ):
        """Embed ``documents`` and write them to ``store`` (which becomes ``self.store``).

        ``store`` is a folder path (created for this model if new), a store object, or None:
        ``self.store`` if set, else a temporary store deleted when the retriever is. Documents
        already stored with the same text are skipped, so calling ``index`` again with a grown
        corpus only embeds the new documents. Returns an
        :class:`~densefit.retrieval.index.indexing.IndexReport`.
        """
        from densefit.retrieval.index.indexing import index_documents
        from densefit.retrieval.index.store import open_store

        if store is None:
            store = (
                self.store
                if self.store is not None
                else open_store(None, self.model, backend=backend)
            )
        elif isinstance(store, (str, os.PathLike)):
            store = open_store(store, self.model, backend=backend)
        store.check_model(self.model)
        self.store = store
        docs = (as_document(d, i) for i, d in enumerate(documents))
        total = len(documents) if isinstance(documents, Sequence) else None
        return index_documents(
            store, self.model, docs, batch_size=batch_size, show_progress=show_progress, total=total
        )

    def retrieve(self, query: str, top_k: int = 10) -> list[SearchHit]:
        """The ``top_k`` documents best matching ``query``, best first.

        Each :class:`~densefit.retrieval.index.base.SearchHit` has ``id``, ``score``, ``rank``,
        ``text``, ``title`` and ``meta``.
        """
        if not isinstance(query, str):
            raise TypeError("retrieve takes one query string; use retrieve_batch for a list")
        return self.retrieve_batch([query], top_k=top_k)[0]

    def retrieve_batch(self, queries: Sequence[str], top_k: int = 10) -> list[list[SearchHit]]:
        """:meth:`retrieve` for many queries, embedded and searched together."""
        from densefit.retrieval.index.searching import search_batch

        return search_batch(
            self._require_store(),
            self.model,
            queries,
            top_k=top_k,
            batch_size=getattr(self, "batch_size", 64),
        )

    def evaluate(
        self,
        queries: str | os.PathLike | Mapping[str, str] | None = None,
        qrels: str | os.PathLike | Mapping[str, Mapping[str, int]] | None = None,
        *,
        dataset: str | os.PathLike | None = None,
        split: str = "test",
        metrics: Sequence[str] | None = None,
        top_k: int | None = None,
    ):
        """nDCG@10, MRR@10, Recall@10/100 and MAP@100 (pytrec_eval) of this retriever.

        Either ``queries`` + ``qrels`` (files or mappings) scored against ``self.store``, or
        ``dataset=BEIR_FOLDER`` which indexes that corpus into a temporary store (leaving
        ``self.store`` alone). Returns an :class:`~densefit.evaluate.EvalResult`.
        """
        from densefit.evaluate import (
            DEFAULT_METRICS,
            evaluate_beir,
            evaluate_store,
            load_queries_and_qrels,
        )

        metrics = tuple(metrics or DEFAULT_METRICS)
        batch_size = getattr(self, "batch_size", 64)
        if dataset is not None:
            if queries is not None or qrels is not None:
                raise ValueError("pass either dataset= or queries and qrels, not both")
            return evaluate_beir(
                self.model, dataset, split, metrics=metrics, top_k=top_k, batch_size=batch_size
            )
        if queries is None or qrels is None:
            raise ValueError("evaluate needs queries and qrels, or dataset=BEIR_FOLDER")
        queries, qrels = load_queries_and_qrels(queries, qrels)
        return evaluate_store(
            self._require_store(),
            self.model,
            queries,
            qrels,
            metrics=metrics,
            top_k=top_k,
            batch_size=batch_size,
        )

    def _require_store(self):
        if self.store is None:
            raise StoreError(
                "this retriever has no document store yet: call retriever.index(documents) "
                "(or retriever.index(documents, store='path/to/store')) first"
            )
        return self.store
