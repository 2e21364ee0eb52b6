"""The store contract over a database server (PostgreSQL, Qdrant, Milvus): what they share.

:class:`DatabaseStore` adds to :class:`~densefit.retrieval.index.common.StoreCommon` (the
model checks and the search) what an engine whose data lives in a database does alike: the
record kept current (:meth:`~DatabaseStore._refresh` calls the engine's ``_read_record()``,
which hands the keys it read to :meth:`~DatabaseStore._take_record`, the one rule of what a
new record resets), re-embedding with new settings (``densefit index --reembed``), the write
path (:meth:`~DatabaseStore.write`, :meth:`~DatabaseStore.write_metadata` and
:meth:`~DatabaseStore.delete` check the input and count, and run the engine's hooks inside
``_swap_transaction()``), the ids in pages and the metadata statistics. Each engine writes
the methods listed last in the class (each says what it must do), its error table
``_faults`` (:class:`~densefit.retrieval.index.common.Fault` rows), its own ``info()`` keys
(``_info_extra()``), the contract's other data methods (``count``, ``count_matching``,
``get``, ``hashes``, ``vectors``, ``vectors_for_texts``, ``filter_documents``,
``index_meta_field``, ``writer_lock``, ``close``) and the search parts.

Metadata statistics (:meth:`~DatabaseStore.meta_values`, :meth:`~DatabaseStore.meta_range`,
:meth:`~DatabaseStore.meta_fields`, Haystack's metadata methods) are computed here from the
matching documents, with the embedded store's semantics; an engine may answer them itself.
An engine without model swaps refuses them with one line
(:class:`~densefit.retrieval.index.types.CapabilityError`); a database reclaims dead vectors
itself, so there is nothing to compact and no BM25 file to keep.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np

from densefit.data.types import Document
from densefit.retrieval.index.common import StoreCommon, checked_documents, checked_write
from densefit.retrieval.index.documents import meta_hash, text_hash
from densefit.retrieval.index.filters import meta_path, typed_fields
from densefit.retrieval.index.registry import require
from densefit.retrieval.index.settings import settings_of
from densefit.retrieval.index.swap import (
    MODEL_GENERATION_KEY,
    SWAP_KEY,
    model_swapped,
    next_vectors_for,
    refuse_during_swap,
)
from densefit.retrieval.index.types import (
    StoreError,
    StoreRecord,
    SwapTarget,
    VectorSettings,
    WriteResult,
)

__all__ = ["DatabaseStore", "StoredRow", "ordered_vectors", "stored_meta"]

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
    value = meta
    for name in meta_path(field):  # the name checked as filters check theirs
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

    _record_seconds = 0.0  # a record read stays current this long (0: read at every call)
    _read_at = -math.inf

    def _refresh(self) -> None:
        """Make the record current (another process may have changed the settings, or begun
        or finished a model swap): read it again unless read less than ``_record_seconds``
        ago."""
        self._check_open()
        if time.monotonic() - self._read_at >= self._record_seconds:
            self._read_record()

    def _take_record(self, meta: Mapping[str, str]) -> None:
        """Make this object's view current from the record's keys ``meta`` as just read: the
        record and the model generation (:meth:`~densefit.retrieval.index.common.
        StoreCommon._loaded`, which says when checked models are checked again) and the swap
        under way."""
        record = StoreRecord.from_meta(meta, self.location)
        self._loaded(record, int(meta.get(MODEL_GENERATION_KEY) or 0))
        self._swap = SwapTarget.from_json(meta.get(SWAP_KEY) or None, self.location)
        self._read_at = time.monotonic()

    def _check_open(self) -> None:
        """StoreError once closed (an engine whose reads say so by themselves: nothing)."""

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """What a call runs inside: the object's lock, the store open, the engine's errors
        translated (:meth:`~densefit.retrieval.index.common.StoreCommon._errors`)."""
        with self._lock, self._errors():
            self._check_open()
            yield

    def adopt_runtime(self, source) -> bool:
        """Record ``source`` (a :class:`~densefit.retrieval.vector_source.VectorSource`) as what
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
        re-embeds them (those missing from its input from their stored text); refused while
        a model swap is under way (the swap records its own settings)."""
        with self._lock:
            refuse_during_swap(self.location, self.swap_target())
            self._save_settings(settings_of(model, runtime))
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

    _swap: SwapTarget | None = None  # the swap under way, as last read

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

    def _swap_progress(self) -> dict | None:
        return None

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
        engine has them (:attr:`~densefit.retrieval.index.types.Capabilities.transactions`).

        While a model swap is under way a written document's next vector is the new model's
        vector of its text, ``swap_embeddings`` (made for ``swap_target``, the swap under
        way: :meth:`swap_target`), or none until the swap embeds it. A write prepared for
        the model the store has switched from (another process's swap) is refused with
        :class:`~densefit.retrieval.index.types.ModelSwappedError`: embed again and write.
        """
        documents = list(documents)
        with self._lock:  # the model the caller embedded for, as this object last read it
            record, prepared_for = self._record, self.model_generation
        vectors, next_vectors = checked_write(
            record, documents, embeddings, swap_embeddings, swap_target
        )
        if not documents:
            return WriteResult()
        rows = [StoredRow.of(d) for d in documents]
        self._before_write(rows, prepared_for)
        with self._swap_transaction() as tx:
            if self.model_generation != prepared_for:
                raise model_swapped(self.location, self.model_name)
            next_vectors = next_vectors_for(self._swap, swap_target, next_vectors)
            existed = self._upsert(tx, rows, vectors, next_vectors)
        self._after_write()
        return WriteResult(added=len(rows) - len(existed), updated=len(existed))

    def write_metadata(self, documents: Sequence[Document]) -> int:
        """Replace title and metadata of stored documents (their text, vector and place in
        the write order stay; in the next generation too while a model swap is under way);
        returns how many were stored."""
        documents = list(documents)
        checked_documents(documents)
        with self._swap_transaction() as tx:
            return self._set_metadata(tx, documents)

    def delete(self, ids: Iterable[str]) -> int:
        """Delete documents by id (their vectors, current and next, with them), in one
        transaction where the engine has them; returns how many existed."""
        ids = list(dict.fromkeys(ids))
        with self._swap_transaction() as tx:
            return self._remove(tx, ids) if ids else 0

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

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.location!r}, model={self.model_name!r}, "
            f"dim={self.dim}, backend={self.backend_name!r})"
        )

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

    def _save_settings(self, settings: VectorSettings) -> None:
        """Record new vector settings."""
        raise NotImplementedError

    def _mark_stale(self) -> None:
        """Mark every stored vector stale, in one write (a write clears what it writes)."""
        raise NotImplementedError

    def _stale(self, ids: list[str] | None) -> list[str]:
        """The stale ones among ``ids`` (None: all of them), in write order."""
        raise NotImplementedError

    def _ids_after(self, last: str, limit: int) -> list[str]:
        """Up to ``limit`` ids after ``last``, in id order."""
        raise NotImplementedError

    def _swap_transaction(self) -> AbstractContextManager:
        """The write transaction (swap.py's primitive; see :meth:`write`)."""
        raise NotImplementedError

    def _before_write(self, rows: list[StoredRow], prepared_for: int) -> None:
        """Outside the write's transaction, before it (checks, or a load's preparations)."""

    def _upsert(
        self, tx, rows: list[StoredRow], vectors: np.ndarray, next_vectors: np.ndarray | None
    ) -> set[str]:
        """Write ``rows`` with their checked ``vectors`` in ``tx``, and, while a swap is under
        way, into its generation with ``next_vectors`` (None: leave them out of it, for the
        swap to embed); returns the ids that were stored before."""
        raise NotImplementedError

    def _after_write(self) -> None:
        """After the write's transaction committed."""

    def _set_metadata(self, tx, documents: list[Document]) -> int:
        """Replace title and metadata of the stored ones among ``documents`` (checked) in
        ``tx`` (the next generation's copies too); how many were stored."""
        raise NotImplementedError

    def _remove(self, tx, ids: list[str]) -> int:
        """Delete the documents ``ids`` (unique, at least one) in ``tx`` (the next
        generation's copies too); how many existed."""
        raise NotImplementedError


def stored_meta(meta: dict | None) -> dict:
    """Metadata as the embedded store keeps it, which a database engine stores: JSON, values
    JSON cannot hold written as text (NaN and infinities are refused before, by
    :func:`~densefit.retrieval.index.common.checked_documents`).

    >>> stored_meta({"tags": ("a", "b"), "n": 1})
    {'tags': ['a', 'b'], 'n': 1}
    """
    return json.loads(json.dumps(meta or {}, default=str))


def ordered_vectors(ids: list[str], found: Mapping[str, object], dim: int) -> np.ndarray:
    """The vectors ``found`` by id, in the order of ``ids``, as one float32 array of ``dim``
    columns; KeyError naming the ids not found."""
    missing = [i for i in ids if i not in found]
    if missing:
        raise KeyError(f"{len(missing)} ids are not in the store, e.g. {missing[:3]}")
    return np.array([found[i] for i in ids], dtype=np.float32).reshape(len(ids), dim)
