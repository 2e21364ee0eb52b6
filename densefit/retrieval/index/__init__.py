"""Document stores and vector search.

One store contract (:class:`~densefit.retrieval.index.base.DocumentStore` and its optional
roles) and the engines behind it (:mod:`~densefit.retrieval.index.registry`: the embedded
store in a folder, PostgreSQL + pgvector, Qdrant, Milvus), opened by
:func:`~densefit.retrieval.index.engines.open_store` from a target; indexing that resumes
after a crash, and search::

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
    "Capabilities": "densefit.retrieval.index.types",
    "CapabilityError": "densefit.retrieval.index.types",
    "DocumentStore": "densefit.retrieval.index.base",
    "ModelSwappedError": "densefit.retrieval.index.types",
    "NoStoreError": "densefit.retrieval.index.types",
    "ModelMismatchError": "densefit.retrieval.index.types",
    "SearchHit": "densefit.retrieval.index.types",
    "StoreError": "densefit.retrieval.index.types",
    "StoreUnavailableError": "densefit.retrieval.index.types",
    "VectorBackend": "densefit.retrieval.index.base",
    "MetadataStats": "densefit.retrieval.index.base",
    "ModelSwap": "densefit.retrieval.index.base",
    "Reembedding": "densefit.retrieval.index.base",
    "Upkeep": "densefit.retrieval.index.base",
    "SettingsMismatchError": "densefit.retrieval.index.types",
    "StoreRecord": "densefit.retrieval.index.types",
    "WriteResult": "densefit.retrieval.index.types",
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
    "ENGINES": "densefit.retrieval.index.registry",
    "engine_of": "densefit.retrieval.index.registry",
    "require": "densefit.retrieval.index.registry",
    "open_store": "densefit.retrieval.index.engines",
    "record_for": "densefit.retrieval.index.settings",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
