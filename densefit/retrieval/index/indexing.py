"""Indexing a corpus into a store: batched encoding, commits, resume, and a report.

Documents are taken in chunks of ``commit_every``; each chunk is compared with the store by
text hash (unchanged documents are skipped, changed ones re-embedded, title/metadata-only
changes written without re-embedding), encoded in length-sorted batches, and committed in one
transaction. A killed run therefore loses at most one chunk, and running it again resumes
where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm.auto import tqdm

from densefit.data.types import Document
from densefit.models import model_name_of
from densefit.retrieval.encode import embedding_dimension, encode_with_callback
from densefit.retrieval.index.base import DocumentStore
from densefit.retrieval.index.documents import meta_hash, text_hash
from densefit.retrieval.index.registry import require
from densefit.retrieval.index.types import ModelMismatchError
from densefit.retrieval.runtimes import resolve_runtime

__all__ = ["IndexReport", "copy_documents", "index_documents", "prune_documents"]


@dataclass
class IndexReport:
    """What :func:`index_documents` did; nothing in the input goes unaccounted for.

    ``seen`` = ``added + updated + reembedded + metadata_updated + unchanged + duplicates``;
    ``reembedded_stored`` counts stored documents not in the input that ``reembed`` re-embedded.
    """

    store: str
    model: str
    seen: int = 0
    added: int = 0
    updated: int = 0
    reembedded: int = 0  # same text, vector made again with new settings (``reembed``)
    reembedded_stored: int = 0  # stored, not in the input, re-embedded from the stored text
    metadata_updated: int = 0
    unchanged: int = 0
    duplicates: int = 0
    duplicate_ids: list[str] = field(default_factory=list)  # the first few, for messages
    encoded: int = 0
    reused: int = 0  # texts already stored under another id: vector copied, not encoded
    commits: int = 0
    seconds: float = 0.0
    encode_seconds: float = 0.0
    pruned: int = 0
    compacted: int = 0
    runtime: str = "torch"  # what embedded the documents (runtime and file)
    processes: int = 1  # that embedded them together (densefit index --nproc)
    copied_from: str | None = None  # index --from-store: the store copied, nothing embedded

    @property
    def docs_per_second(self) -> float:
        """Documents encoded per second of encoding."""
        return self.encoded / self.encode_seconds if self.encode_seconds else 0.0

    def summary(self) -> str:
        if self.copied_from is not None:
            return (
                f"{self.seen} documents copied from {self.copied_from} with their vectors: "
                f"{self.added} added, {self.updated} replaced (text changed), "
                f"{self.metadata_updated} title/metadata updated, {self.unchanged} unchanged "
                f"(skipped); nothing embedded; {self.seconds:.1f}s in all"
            )
        parts = [
            f"{self.seen} documents read: {self.added} added, {self.updated} re-embedded "
            f"(text changed), {self.unchanged} unchanged (skipped)"
        ]
        if self.reembedded or self.reembedded_stored:
            parts.append(
                f"{self.reembedded + self.reembedded_stored} re-embedded with new settings "
                f"({self.reembedded_stored} of them stored but not in the input)"
            )
        if self.metadata_updated:
            parts.append(f"{self.metadata_updated} title/metadata updated")
        if self.duplicates:
            shown = ", ".join(repr(i) for i in self.duplicate_ids)
            parts.append(
                f"{self.duplicates} repeated ids replaced an earlier document with the same id "
                f"(e.g. {shown})"
            )
        if self.reused:
            parts.append(f"{self.reused} identical texts already stored: vectors copied")
        if self.pruned:
            parts.append(f"{self.pruned} documents not in the input deleted")
        if self.encoded:
            on = f", {self.processes} processes" if self.processes > 1 else ""
            parts.append(f"{self.docs_per_second:.1f} docs/s encoding ({self.runtime}{on})")
        return "; ".join(parts) + f"; {self.seconds:.1f}s in all"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["docs_per_second"] = round(self.docs_per_second, 2)
        return out


def index_documents(
    store: DocumentStore,
    model,
    documents: Iterable[Document],
    *,
    batch_size: int = 64,
    commit_every: int = 1024,
    show_progress: bool = False,
    total: int | None = None,
    compact: bool = True,
    reembed: bool = False,
    lock_timeout: float | None = None,
    runtime="auto",
    encoder: Callable[..., np.ndarray] = encode_with_callback,
) -> IndexReport:
    """Embed ``documents`` with ``model`` and write them to ``store``, resuming where it left.

    The store must have been created for ``model`` (:class:`~densefit.retrieval.index.base.
    ModelMismatchError` otherwise) and its vectors made with the model's current settings
    (truncation length, prompts, normalisation: :class:`~densefit.retrieval.index.settings.
    SettingsMismatchError` otherwise), unless ``reembed`` re-embeds every stored document with
    the new settings (those missing from ``documents`` from their stored text). Documents
    already stored with the same text are skipped; a repeated id replaces the earlier
    document and is counted in the report. ``compact`` rewrites the vector file when more
    than half of it is dead rows. The store's writer lock is held throughout: a second
    indexer waits (up to ``lock_timeout`` seconds, forever when None) and then finds the
    documents already stored. ``runtime`` runs the transformer (:data:`densefit.choices.
    RUNTIME_CHOICES`; :func:`~densefit.retrieval.runtimes.resolve_runtime`): ``auto`` picks
    the fastest exported one that may write beside the store's vectors (an empty store takes
    the runtime of its first write; a runtime of another family is refused like other
    settings, ``reembed`` re-embeds with it). ``encoder`` embeds the texts to write, called
    as :func:`~densefit.retrieval.encode.encode_with_callback` is (the default); indexing on
    several processes passes one that shares each call's texts among them
    (:func:`densefit.jobs.index_job`).

    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.index.engines import open_store
    >>> model = tiny_model()
    >>> store = open_store(None, model)
    >>> docs = [Document("a", "cells divide"), Document("b", "python functions")]
    >>> index_documents(store, model, docs).added
    2
    >>> index_documents(store, model, docs).unchanged  # a second run skips them
    2
    """
    if commit_every < 1:
        raise ValueError(f"commit_every must be at least 1, got {commit_every}")
    store.check_model(model)
    if total is None and isinstance(documents, Sequence):
        total = len(documents)
    if reembed:
        require(
            store.capabilities,
            "reembedding",
            "re-embed its documents with new settings (--reembed)",
            location=store.location,
        )
    report = IndexReport(store=store.location, model=model_name_of(model))
    started = time.perf_counter()
    with store.writer_lock(lock_timeout):
        settings = store.settings
        stored = None if reembed or settings is None or not store.count() else settings.source
        runner = resolve_runtime(model, runtime, stored=stored, mixing=True)
        report.runtime = runner.source.describe()
        if reembed:
            store.start_reembedding(model, runner)
        else:
            store.adopt_runtime(runner.source)
            store.check_settings(model, runner)
        with _progress(total, show_progress) as bar:
            seen_ids: set[str] = set()
            embed = _Embedder(store, model, runner, encoder, batch_size, bar, report)
            for chunk in _chunks(documents, commit_every):
                _index_chunk(store, embed, chunk, seen_ids, bar, report)
            _reembed_the_rest(store, embed, commit_every, bar, report)
        if compact and store.capabilities.upkeep and store.dead_rows() > max(1024, store.count()):
            report.compacted = store.compact()
        store.flush()
    report.seconds = time.perf_counter() - started
    return report


def _progress(total: int | None, show: bool):
    return tqdm(total=total, desc="Indexing", unit="doc", disable=not show, smoothing=0.1)


def _index_chunk(store, embed, chunk, seen_ids, bar, report) -> None:
    """Compare one chunk with the store by hash, embed what is new or changed, commit."""
    unique, repeats = _dedupe(chunk, seen_ids, report)
    stale = store.stale_ids(list(unique)) if store.capabilities.reembedding else set()
    written = _write_changes(store, list(unique.values()), embed, report, stale, repeats)
    bar.update(len(chunk) - written)
    bar.set_postfix(new=report.added, changed=report.updated, skipped=report.unchanged)


def _write_changes(store, documents, vectors_of, report, stale=(), repeats=()) -> int:
    """Write what ``documents`` change in ``store``, compared by hash: new and changed texts
    (and ``stale`` ids) with ``vectors_of(documents)``, title/metadata changes alone without
    vectors, one commit each; each document counted in ``report`` by what it did, except
    ``repeats`` (counted as duplicates). Returns how many were written with vectors."""
    stored = store.hashes([d.id for d in documents])
    to_embed, meta_only = [], []
    for doc in documents:
        hashes = stored.get(doc.id)
        if hashes is None or hashes[0] != text_hash(doc.text):
            to_embed.append(doc)
            outcome = "added" if hashes is None else "updated"
        elif doc.id in stale:
            to_embed.append(doc)
            outcome = "reembedded"
        elif hashes[1] != meta_hash(doc):
            meta_only.append(doc)
            outcome = "metadata_updated"
        else:
            outcome = "unchanged"
        if doc.id not in repeats:
            setattr(report, outcome, getattr(report, outcome) + 1)
    if to_embed:
        store.write(to_embed, vectors_of(to_embed))
        report.commits += 1
    if meta_only:
        store.write_metadata(meta_only)
        report.commits += 1
    return len(to_embed)


def _reembed_the_rest(store, embed, commit_every: int, bar, report) -> None:
    """Re-embed, from their stored text, the documents still holding vectors made before
    ``reembed`` (those not in this run's input), then clear the store's stale mark."""
    if not store.capabilities.reembedding:
        return
    stale = store.all_stale_ids()
    for start in range(0, len(stale), commit_every):
        docs = [d for d in store.get(stale[start : start + commit_every]) if d is not None]
        if bar.total is not None:
            bar.total += len(docs)
        store.write(docs, embed(docs))
        report.commits += 1
        report.reembedded_stored += len(docs)
    store.finish_reembedding()


@dataclass
class _Embedder:
    """Vectors for documents: copied from the store for texts it already holds, else encoded
    (by ``encoder``, with the run's runtime, batch size and the document prompt).

    Copies keep duplicate documents' vectors identical (their scores tie exactly, as when a
    whole corpus is encoded in one call), and skip the forward pass.
    """

    store: DocumentStore
    model: object
    runner: object
    encoder: Callable[..., np.ndarray]
    batch_size: int
    bar: object
    report: IndexReport

    def __call__(self, docs: list[Document]) -> np.ndarray:
        report, bar = self.report, self.bar
        hashes = [text_hash(d.text) for d in docs]
        known = self.store.vectors_for_texts(hashes)
        vectors = np.empty((len(docs), embedding_dimension(self.model)), dtype=np.float32)
        todo = [i for i, h in enumerate(hashes) if h not in known]
        for i, h in enumerate(hashes):
            if h in known:
                vectors[i] = known[h]
        report.reused += len(docs) - len(todo)
        bar.update(len(docs) - len(todo))
        if todo:
            started = time.perf_counter()
            vectors[todo] = self.encoder(
                self.model,
                [docs[i].text for i in todo],
                batch_size=self.batch_size,
                on_batch=bar.update,
                prompt_name="document",
                runtime=self.runner,
            )
            report.encode_seconds += time.perf_counter() - started
            report.encoded += len(todo)
        return vectors


def copy_documents(
    source: DocumentStore,
    target: DocumentStore,
    *,
    commit_every: int = 1024,
    show_progress: bool = False,
    lock_timeout: float | None = None,
) -> IndexReport:
    """Copy every document of ``source`` with its metadata and stored vector into
    ``target`` (another engine, usually), embedding nothing: how a store outgrows its
    machine. ``target`` must record the same vectors (the same model and settings:
    :class:`~densefit.retrieval.index.types.ModelMismatchError` otherwise). Documents already
    in ``target`` with the same text keep their vector (metadata changes are written), so a
    copy that stopped resumes where it was; ``target`` keeps documents ``source`` lacks.

    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.index.engines import open_store
    >>> model = tiny_model()
    >>> small, other = open_store(None, model), open_store(None, model)
    >>> _ = index_documents(small, model, [Document("a", "x"), Document("b", "y")])
    >>> copy_documents(small, other).added, other.count()
    (2, 2)
    """
    if commit_every < 1:
        raise ValueError(f"commit_every must be at least 1, got {commit_every}")
    if not target.record.same_vectors(source.record):
        raise ModelMismatchError(
            f"{target.location} holds vectors of {target.model_name!r} (or made with other "
            f"settings) and {source.location} of {source.model_name!r}: copy into a new store"
        )
    report = IndexReport(store=target.location, model=source.model_name)
    report.copied_from = source.location
    started = time.perf_counter()
    with target.writer_lock(lock_timeout), _progress(source.count(), show_progress) as bar:
        for ids in _chunks(source.ids(), commit_every):
            documents = [d for d in source.get(ids) if d is not None]  # deleted meanwhile: gone
            _write_changes(
                target, documents, lambda new: source.vectors([d.id for d in new]), report
            )
            report.seen += len(documents)
            bar.update(len(documents))
        target.flush()
    report.seconds = time.perf_counter() - started
    return report


def prune_documents(store: DocumentStore, keep_ids: Iterable[str]) -> int:
    """Delete every stored document whose id is not in ``keep_ids``; returns how many.

    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.index.engines import open_store
    >>> model = tiny_model()
    >>> store = open_store(None, model)
    >>> _ = index_documents(store, model, [Document("a", "x"), Document("b", "y")])
    >>> prune_documents(store, ["a"])
    1
    """
    keep = set(keep_ids)
    return store.delete([i for i in store.ids() if i not in keep])


def _chunks(items: Iterable, size: int):
    chunk: list = []
    for doc in items:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _dedupe(
    chunk: list, seen_ids: set[str], report: IndexReport
) -> tuple[dict[str, Document], set[str]]:
    """The chunk by id (last occurrence wins) and the ids already seen in earlier chunks."""
    unique: dict[str, Document] = {}
    earlier: set[str] = set()
    for i, doc in enumerate(chunk):
        if not isinstance(doc, Document):
            raise TypeError(
                f"document {report.seen + i} is a {type(doc).__name__}, not a Document: build "
                "Documents (densefit.data.types.Document) or read them with read_corpus"
            )
        if doc.id in seen_ids:
            if doc.id not in unique:
                earlier.add(doc.id)
            report.duplicates += 1
            if len(report.duplicate_ids) < 5:
                report.duplicate_ids.append(doc.id)
            unique.pop(doc.id, None)  # re-insert: the last occurrence is the one written
        seen_ids.add(doc.id)
        unique[doc.id] = doc
    report.seen += len(chunk)
    return unique, earlier
