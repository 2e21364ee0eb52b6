"""Document stores and vector search.

An embedded store (SQLite for documents, an append-only vector file for embeddings) with
exact and FAISS backends behind one small Protocol, transactional indexing that resumes after
a crash, and search::

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

from densefit.retrieval.index.base import (
    DocumentStore,
    ModelMismatchError,
    SearchHit,
    StoreError,
    VectorBackend,
    WriteResult,
)
from densefit.retrieval.index.exact import ExactBackend, exact_search
from densefit.retrieval.index.filters import validate_filters
from densefit.retrieval.index.indexing import IndexReport, index_documents, prune_documents
from densefit.retrieval.index.searching import scaled_scores, search, search_batch
from densefit.retrieval.index.store import LocalDocumentStore, make_backend, open_store

__all__ = [
    "DocumentStore",
    "ExactBackend",
    "IndexReport",
    "LocalDocumentStore",
    "ModelMismatchError",
    "SearchHit",
    "StoreError",
    "VectorBackend",
    "WriteResult",
    "exact_search",
    "index_documents",
    "make_backend",
    "open_store",
    "prune_documents",
    "scaled_scores",
    "search",
    "search_batch",
    "validate_filters",
]
