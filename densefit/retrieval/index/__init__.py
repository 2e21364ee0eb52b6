"""Document stores and vector search.

One store contract (:class:`~densefit.retrieval.index.base.DocumentStore`) and the engines
behind it, opened by :func:`~densefit.retrieval.index.engines.open_store` from a target: a
folder (the embedded store: SQLite for documents, an append-only vector file for embeddings,
exact and FAISS backends), ``postgresql://...`` (PostgreSQL with pgvector) or
``qdrant://...`` / ``qdrant:FOLDER`` (Qdrant); indexing that resumes after a crash, and
search::

    from densefit.retrieval.index import open_store, index_documents, search
    from densefit.models import load_model
    from densefit.data.corpus import iter_corpus

    model = load_model("all-MiniLM-L6-v2")
    with open_store("stores/scifact", model) as store:          # created for this model
        index_documents(store, model, iter_corpus("datasets/scifact"), show_progress=True)
        for hit in search(store, model, "vitamin D and bone density", top_k=5):
            print(hit.rank, hit.score, hit.id, hit.snippet())

The same from the shell: ``densefit index``, ``densefit search``, ``densefit eval``.

>>> from densefit.retrieval.index import LocalDocumentStore, ExactBackend, VectorBackend
>>> isinstance(ExactBackend(), VectorBackend)
True
"""

from __future__ import annotations

from densefit._lazy import lazy_exports

_EXPORTS = {
    "Capabilities": "densefit.retrieval.index.base",
    "CapabilityError": "densefit.retrieval.index.base",
    "DocumentStore": "densefit.retrieval.index.base",
    "ModelSwappedError": "densefit.retrieval.index.base",
    "NoStoreError": "densefit.retrieval.index.base",
    "ModelMismatchError": "densefit.retrieval.index.base",
    "SearchHit": "densefit.retrieval.index.base",
    "StoreError": "densefit.retrieval.index.base",
    "VectorBackend": "densefit.retrieval.index.base",
    "WriteResult": "densefit.retrieval.index.base",
    "ExactBackend": "densefit.retrieval.index.exact",
    "exact_search": "densefit.retrieval.index.exact",
    "validate_filters": "densefit.retrieval.index.filters",
    "IndexReport": "densefit.retrieval.index.indexing",
    "index_documents": "densefit.retrieval.index.indexing",
    "prune_documents": "densefit.retrieval.index.indexing",
    "scaled_scores": "densefit.retrieval.index.common",
    "search": "densefit.retrieval.index.searching",
    "search_batch": "densefit.retrieval.index.searching",
    "LocalDocumentStore": "densefit.retrieval.index.store",
    "make_backend": "densefit.retrieval.index.store",
    "ENGINES": "densefit.retrieval.index.engines",
    "engine_of": "densefit.retrieval.index.engines",
    "open_store": "densefit.retrieval.index.engines",
    "record_for": "densefit.retrieval.index.settings",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
