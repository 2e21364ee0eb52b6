"""Document stores and vector search: an embedded SQLite + vector-file store, exact and FAISS
backends behind one Protocol, indexing with resume, and search.

>>> from densefit.index import open_store, index_documents, search  # doctest: +SKIP
"""

from densefit.index.base import (
    DocumentStore,
    ModelMismatchError,
    SearchHit,
    StoreError,
    VectorBackend,
    WriteResult,
)
from densefit.index.exact import ExactBackend, exact_search
from densefit.index.store import LocalDocumentStore, make_backend, open_store

__all__ = [
    "DocumentStore",
    "ExactBackend",
    "LocalDocumentStore",
    "ModelMismatchError",
    "SearchHit",
    "StoreError",
    "VectorBackend",
    "WriteResult",
    "exact_search",
    "make_backend",
    "open_store",
]
