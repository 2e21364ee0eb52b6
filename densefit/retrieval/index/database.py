"""The store contract over a database server (PostgreSQL, Qdrant): what such engines share.

:class:`DatabaseStore` adds to :class:`~densefit.retrieval.index.common.StoreCommon` (the
model checks and the search) what an engine whose data lives in a database does alike, on
top of a few methods each engine writes:

- the record: ``_save_settings(settings)`` records new vector settings (and ``_refresh()``
  re-reads the record, as :class:`~densefit.retrieval.index.common.StoreCommon` says);
- re-embedding with new settings (``densefit index --reembed``): ``_mark_stale()`` marks
  every stored vector stale in one write, ``_stale(ids)`` lists the stale ones among
  ``ids`` (None: all of them), in write order; a write clears the mark of what it writes;
- writing: ``_upsert(rows, vectors)`` writes :class:`StoredRow` s (the document, its hashes
  and its typed filter fields) with their checked vectors and returns the ids stored
  before (:meth:`~DatabaseStore.write` checks the input and counts);
- reading in pages: ``_ids_after(last, limit)``;
- and the contract's other data methods (``count``, ``count_matching``, ``get``,
  ``hashes``, ``vectors``, ``vectors_for_texts``, ``filter_documents``, ``write_metadata``,
  ``delete``, ``index_meta_field``, ``writer_lock``, ``close``) and the search parts.

Metadata statistics (:meth:`~DatabaseStore.meta_values`, :meth:`~DatabaseStore.meta_range`,
:meth:`~DatabaseStore.meta_fields`, Haystack's metadata methods) are computed here from the
matching documents, with the embedded store's semantics; an engine may answer them itself.
An engine without model swaps refuses them with one line
(:class:`~densefit.retrieval.index.base.CapabilityError`); a database reclaims dead vectors
itself, so there is nothing to compact and no BM25 file to keep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from densefit.data.types import Document
from densefit.retrieval.index.base import StoreError, WriteResult
from densefit.retrieval.index.common import StoreCommon, checked_vectors
from densefit.retrieval.index.documents import meta_hash, text_hash
from densefit.retrieval.index.engines import require
from densefit.retrieval.index.filters import meta_field_sql, typed_fields
from densefit.retrieval.index.settings import SwapTarget, VectorSettings

__all__ = ["DatabaseStore", "StoredRow"]

_PAGE = 1000  # ids per query of ids()
_NUMBER = ("integer", "real")


def _json_type(value) -> str | None:
    """SQLite's ``json_type`` name of a metadata value (None for null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "real"
    if isinstance(value, str):
        return "text"
    return "array" if isinstance(value, list) else "object"


def _field_value(meta: dict, field: str):
    """The value of ``meta.a.b`` in a document's metadata (None when missing)."""
    meta_field_sql(field)  # the name checked as filters check theirs
    value = meta
    for name in field[len("meta.") :].split("."):
        value = value.get(name) if isinstance(value, dict) else None
    return value


@dataclass(frozen=True)
class StoredRow:
    """What an engine stores for a document besides its vector: the document, the hashes
    that decide whether indexing must re-embed it (:func:`~densefit.retrieval.index.
    documents.text_hash`, :func:`~densefit.retrieval.index.documents.meta_hash`) and its
    fields typed for filters (:func:`~densefit.retrieval.index.filters.typed_fields`)."""

    document: Document
    text_hash: str
    meta_hash: str
    fields: dict

    @classmethod
    def of(cls, document: Document) -> StoredRow:
        return cls(
            document,
            text_hash(document.text),
            meta_hash(document),
            typed_fields(document.id, document.text, document.title, document.meta),
        )


class DatabaseStore(StoreCommon):
    """The shared half of the stores whose data lives in a database (see the module
    docstring). Subclasses set ``capabilities``, ``location`` and ``_record``."""

    # -- the record ------------------------------------------------------------------------

    def adopt_runtime(self, source) -> bool:
        """Record ``source`` (a :class:`~densefit.retrieval.runtimes.VectorSource`) as what
        makes this store's vectors when it holds none yet; returns whether it did."""
        with self._lock:
            self._refresh()
            settings = self._record.settings
            if settings is None or self.count() > 0:
                return False
            if settings.source != source:
                self._save_settings(dataclasses.replace(settings, source=source))
            return True

    def start_reembedding(self, model, runtime=None) -> None:
        """Record ``model``'s settings and mark every stored vector stale: the next indexing
        re-embeds them (those missing from its input from their stored text)."""
        with self._lock:
            self._save_settings(VectorSettings.of(model, runtime))
            self._mark_stale()

    def stale_ids(self, ids: Sequence[str]) -> set[str]:
        """The ids among ``ids`` whose vectors predate the last :meth:`start_reembedding`."""
        return set(self._stale(list(ids)))

    def all_stale_ids(self) -> list[str]:
        """Every id whose vector predates the last :meth:`start_reembedding`."""
        return self._stale(None)

    def finish_reembedding(self) -> None:
        """Check that no stale vector is left (a write clears each document's mark)."""
        if self._stale(None):
            raise StoreError(f"{self.location}: documents still hold vectors made before --reembed")

    # -- a model swap ----------------------------------------------------------------------

    def swap_target(self) -> SwapTarget | None:
        """None: no model swap is under way (an engine with swaps overrides this)."""
        return None

    def _no_swap(self, *args, **kwargs):
        """Refuse a model swap with one line (an engine with swaps overrides these)."""
        require(
            self.capabilities, "model_swap", "swap models (densefit reembed)", None, self.location
        )
        raise NotImplementedError(f"{type(self).__name__} declares model swaps: implement them")

    begin_swap = swap_pending = write_swap = finish_swap = _no_swap

    def cancel_swap(self) -> bool:
        """False: no model swap is under way."""
        return False

    # -- writing ---------------------------------------------------------------------------

    def write(
        self,
        documents: Sequence[Document],
        embeddings: np.ndarray,
        *,
        swap_embeddings: np.ndarray | None = None,
        swap_target: SwapTarget | None = None,
    ) -> WriteResult:
        """Add or replace ``documents`` (by id) with their embeddings (normalised for a
        cosine store), each document's stale mark cleared; in one transaction where the
        engine has them (:attr:`~densefit.retrieval.index.base.Capabilities.transactions`)."""
        documents = list(documents)
        vectors = checked_vectors(self._record, documents, embeddings)
        if swap_embeddings is not None:
            self._no_swap()
        if not documents:
            return WriteResult()
        with self._lock:
            existed = self._upsert([StoredRow.of(d) for d in documents], vectors)
        return WriteResult(added=len(documents) - len(existed), updated=len(existed))

    # -- reading ---------------------------------------------------------------------------

    def ids(self) -> Iterator[str]:
        """Every document id, in id order."""
        last = ""
        while page := self._ids_after(last, _PAGE):
            yield from page
            last = page[-1]

    def meta_values(self, field: str, filters: dict | None = None) -> list[tuple[object, int]]:
        """Each distinct value of the metadata field ``field`` among the documents matching
        ``filters``, with how many hold it; values keep their JSON type (``1``, ``1.0``,
        ``True`` and ``"1"`` are four values); missing and null values are left out."""
        counts: dict[tuple, list] = {}
        for doc in self.filter_documents(filters):
            value = _field_value(doc.meta, field)
            kind = _json_type(value)
            if kind is None:
                continue
            key = (kind, repr(value))
            counts.setdefault(key, [value, 0])[1] += 1
        return [(value, n) for value, n in counts.values()]

    def meta_range(self, field: str, filters: dict | None = None) -> tuple[object, object]:
        """``(min, max)`` of the field's numbers among the matches (booleans are not numbers
        here), or, when it holds none, of its strings; ``(None, None)`` when neither."""
        values = [_field_value(d.meta, field) for d in self.filter_documents(filters)]
        for kinds in (_NUMBER, ("text",)):
            found = [v for v in values if _json_type(v) in kinds]
            if found:
                return min(found), max(found)
        return None, None

    def meta_fields(self) -> dict[str, dict[str, int]]:
        """The top-level metadata keys: ``{key: {JSON type: documents}}`` (nulls left out)."""
        fields: dict[str, dict[str, int]] = {}
        for doc in self.filter_documents(None):
            for key, value in doc.meta.items():
                kind = _json_type(value)
                if kind is not None:
                    kinds = fields.setdefault(key, {})
                    kinds[kind] = kinds.get(kind, 0) + 1
        return fields

    def info(self) -> dict:
        """A summary for humans and ``--json``: engine, model, settings, size."""
        settings = self.settings
        return {
            "engine": self.capabilities.engine,
            "path": self.location,
            "model": self.model_name,
            "dim": self.dim,
            "similarity": self.similarity,
            "vectors": self.vector_kind,
            "max_seq_length": settings.max_seq_length if settings else None,
            "normalize": settings.normalize if settings else None,
            "prompts": dict(settings.prompts) if settings else None,
            "runtime": settings.source.describe() if settings else None,
            "documents": self.count(),
            "dead_rows": 0,
            "backend": self.backend_name,
            "bm25": self.capabilities.lexical,
            "model_swaps": self.model_generation,
            "swap": None,
        }

    # -- upkeep: the database does it ------------------------------------------------------------

    def dead_rows(self) -> int:
        return 0

    def compact(self) -> int:
        return 0

    @property
    def bm25_loaded(self) -> bool:
        return False

    def update_bm25(self) -> bool:
        return False

    def flush(self) -> None:
        """Nothing to do: a write is durable once it returns."""

    # -- what each engine supplies ----------------------------------------------------------

    backend_name: str = ""

    def _save_settings(self, settings: VectorSettings) -> None:
        raise NotImplementedError

    def _mark_stale(self) -> None:
        raise NotImplementedError

    def _stale(self, ids: list[str] | None) -> list[str]:
        raise NotImplementedError

    def _ids_after(self, last: str, limit: int) -> list[str]:
        raise NotImplementedError

    def _upsert(self, rows: list[StoredRow], vectors: np.ndarray) -> set[str]:
        """Write ``rows`` with their checked ``vectors``; the ids that were stored before."""
        raise NotImplementedError

    def write_metadata(self, documents: Sequence[Document]) -> int:
        raise NotImplementedError
