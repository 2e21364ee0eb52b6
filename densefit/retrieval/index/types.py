"""The store contract's records and errors: what a store says about its vectors and its
engine, what a search returns, and what goes wrong.

The bottom of :mod:`densefit.retrieval.index`: NumPy and the standard library only, so that
the protocols (:mod:`~densefit.retrieval.index.base`), the engine registry
(:mod:`~densefit.retrieval.index.registry`) and every engine import it without loading a
model framework. What needs a model (a record made from one, the fingerprint check) is
:mod:`~densefit.retrieval.index.settings`'s.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from densefit.choices import SIMILARITIES, VECTOR_KINDS
from densefit.retrieval.vector_source import VectorSource, disagreement

__all__ = [
    "FORMAT",
    "SAME_WEIGHTS_COSINE",
    "Capabilities",
    "CapabilityError",
    "ModelMismatchError",
    "ModelSwappedError",
    "NoStoreError",
    "SearchHit",
    "SettingsMismatchError",
    "StoreError",
    "StoreRecord",
    "StoreUnavailableError",
    "SwapTarget",
    "VectorSettings",
    "WriteResult",
]

FORMAT = "densefit-store/1"
# Same weights reproduce the probe embeddings to ~1e-7; a fine-tuned model moves them more.
SAME_WEIGHTS_COSINE = 1 - 1e-5


class StoreError(ValueError):
    """A document store cannot do what was asked; the message says why and what to do.

    A ValueError: like bad input, it is the user's to fix, and the CLI prints it as one line.
    """


class StoreUnavailableError(StoreError):
    """The store's engine cannot be reached, dropped the connection, or did not answer
    within its timeout: not the caller's fault, worth retrying once the engine is back
    (``densefit serve`` answers 503 with ``Retry-After``, the CLI exits 3)."""


class NoStoreError(StoreError):
    """There is no store at the target (and it was not to be created)."""


class ModelMismatchError(StoreError):
    """The store's embeddings were made by a different model than the one given."""


class ModelSwappedError(StoreError):
    """The store switched to another model since the caller embedded its queries: embed
    them again with the store's model (``DocumentStore.model_generation``)."""


class CapabilityError(StoreError):
    """The store's engine cannot do what was asked; the message names the engines that can."""


class SettingsMismatchError(StoreError):
    """Indexing would mix vectors made with different settings into one store."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared once in its row of the engine registry
    (:data:`densefit.retrieval.index.registry.ENGINES`).

    ``vector_kinds``: the vector kinds it stores (:data:`densefit.choices.VECTOR_KINDS`);
    ``backends``: the vector searches it offers (:data:`densefit.choices.SEARCH_BACKENDS`;
    the first is its default); ``lexical``: how ``mode="bm25"`` ranks (None: not at all);
    ``hybrid``: dense and lexical fused; ``transactions``: a write commits all its documents
    or none; ``crash_safe``: a process killed at any point leaves the last committed state
    readable, and indexing resumes (the conformance suite kills one to check);
    ``compaction``: dead vectors are dropped by ``compact()`` rather than by the engine
    itself; ``shared``: several processes (servers behind a load balancer) may serve one
    store and see each other's writes. ``filter_max_depth`` / ``filter_max_conditions``:
    the largest filter it takes (:class:`~densefit.retrieval.index.filters.Filter`'s
    ``depth`` and ``conditions``; None: no limit of its own), checked when a filter is
    parsed for it. ``model_swap``, ``reembedding``, ``upkeep`` and ``metadata_stats``: the
    optional roles of :mod:`~densefit.retrieval.index.base` the engine's store implements
    (:data:`~densefit.retrieval.index.base.ROLES`).
    """

    engine: str
    vector_kinds: tuple[str, ...]
    backends: tuple[str, ...]
    lexical: str | None
    hybrid: bool
    model_swap: bool
    transactions: bool
    crash_safe: bool
    compaction: bool
    shared: bool
    reembedding: bool = False
    upkeep: bool = False
    metadata_stats: bool = False
    filter_max_depth: int | None = None
    filter_max_conditions: int | None = None


@dataclass(frozen=True)
class SearchHit:
    """One search result: the document, its score (higher is better) and its 1-based rank."""

    id: str
    score: float
    rank: int
    text: str = ""
    title: str = ""
    meta: dict = field(default_factory=dict, hash=False, compare=False)

    def snippet(self, width: int = 160) -> str:
        """The start of the text, whitespace folded, cut at a word boundary near ``width``.

        >>> SearchHit("d1", 0.5, 1, text="Cells   divide.\\nOften.").snippet()
        'Cells divide. Often.'
        """
        if width < 1:
            raise ValueError(f"width must be at least 1 character, got {width}")
        text = " ".join(self.text.split())
        if len(text) <= width:
            return text
        cut = text.rfind(" ", 0, width)
        return text[: cut if cut > width // 2 else width].rstrip() + " ..."

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "id": self.id,
            "score": self.score,
            "title": self.title,
            "text": self.text,
            "meta": self.meta,
        }


@dataclass(frozen=True)
class WriteResult:
    """What one committed write did."""

    added: int = 0
    updated: int = 0


@dataclass(frozen=True)
class VectorSettings:
    """The settings besides the weights that decide a model's vector for a text.

    ``None`` (in a store made before they were recorded) means unknown: not compared.
    :func:`~densefit.retrieval.index.settings.settings_of` reads them from a model.
    """

    max_seq_length: int | None = None
    normalize: bool | None = None
    prompts: dict = field(default_factory=dict, hash=False)  # {"query": ..., "document": ...}
    truncate_dim: int | None = None  # Matryoshka: vectors cut to this size, re-normalised
    source: VectorSource = field(default_factory=VectorSource)  # the runtime that made them

    def to_meta(self) -> dict[str, str]:
        """The meta-table entries of these settings."""
        return {
            "max_seq_length": json.dumps(self.max_seq_length),
            "normalize": json.dumps(self.normalize),
            "prompts": json.dumps(self.prompts, sort_keys=True),
            "truncate_dim": json.dumps(self.truncate_dim),
            "runtime": self.source.to_json(),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, str]) -> VectorSettings | None:
        """The recorded settings, or None for a store made before they were recorded."""
        if "max_seq_length" not in meta:
            return None
        return cls(
            max_seq_length=json.loads(meta["max_seq_length"]),
            normalize=json.loads(meta["normalize"]),
            prompts=json.loads(meta["prompts"]),
            truncate_dim=json.loads(meta.get("truncate_dim", "null")),
            source=VectorSource.from_json(meta.get("runtime")),  # none recorded: torch
        )

    def differences(self, other: VectorSettings) -> list[tuple[str, object, object]]:
        """``(setting, ours, theirs)`` for every setting that differs; the runtime differs
        when the two may not write into one store (:func:`~densefit.retrieval.vector_source.
        disagreement`)."""
        found = [
            (name, getattr(self, name), getattr(other, name))
            for name in ("max_seq_length", "normalize", "prompts", "truncate_dim")
            if getattr(self, name) != getattr(other, name)
        ]
        if disagreement(self.source, other.source, mixing=True):
            found.append(("runtime", self.source.runtime, other.source.runtime))
        return found


_FIXES = {
    "max_seq_length": "pass --max-seq-length {stored}",
    "normalize": "use a model that {verb} normalise its embeddings",
    "prompts": "pass the prompts {stored} (--query-prompt/--document-prompt)",
    "truncate_dim": "pass --dim {stored}",
    "runtime": "pass --runtime {stored} (auto picks it when it is exported for this model)",
}


@dataclass
class StoreRecord:
    """What a store's meta table says about its vectors: model, shape and settings."""

    model_name: str
    dim: int
    similarity: str
    vector_kind: str  # one of densefit.choices.VECTOR_KINDS
    fingerprint: np.ndarray
    settings: VectorSettings | None

    def to_meta(self) -> dict[str, str]:
        """The meta-table entries of a new store (format, model, settings, empty counters)."""
        meta = {
            "format": FORMAT,
            "model_name": self.model_name,
            "dim": str(self.dim),
            "similarity": self.similarity,
            "vectors": self.vector_kind,
            "fingerprint": json.dumps(np.asarray(self.fingerprint, dtype=np.float32).tolist()),
            "n_rows": "0",
            "generation": "0",
            "stale_below_row": "0",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if self.settings is not None:
            meta.update(self.settings.to_meta())
        return meta

    @classmethod
    def from_meta(cls, meta: dict[str, str], where: Path) -> StoreRecord:
        """Read the record, or :class:`StoreError` for a store of an unknown format."""
        if meta.get("format") != FORMAT:
            raise StoreError(
                f"{where}: unknown store format {meta.get('format')!r} (this densefit reads "
                f"{FORMAT}); re-index into a new folder"
            )
        return cls(
            model_name=meta["model_name"],
            dim=int(meta["dim"]),
            similarity=meta["similarity"],
            # "dtype": the key of stores made before int8 and binary vectors existed
            vector_kind=meta.get("vectors", meta.get("dtype", "float32")),
            fingerprint=_fingerprint(meta["fingerprint"]),
            settings=VectorSettings.from_meta(meta),
        )

    def check_searchable(self, where: str) -> None:
        """StoreError (one line, ``where`` first) for vectors no store can hold: a similarity
        other than :data:`~densefit.choices.SIMILARITIES` (every engine searches by inner
        product) or a kind other than :data:`~densefit.choices.VECTOR_KINDS`."""
        if self.similarity not in SIMILARITIES:
            raise StoreError(
                f"{where}: similarity {self.similarity!r} is not supported: the store searches "
                f"by inner product, which serves {' and '.join(SIMILARITIES)} models"
            )
        if self.vector_kind not in VECTOR_KINDS:
            raise StoreError(
                f"{where}: vector kind {self.vector_kind!r} is not supported: use one of "
                f"{', '.join(VECTOR_KINDS)}"
            )

    def same_vectors(self, other: StoreRecord) -> bool:
        """Whether ``other`` records the same vectors: same size, similarity and settings,
        and a fingerprint of the same weights (a model swap for it may resume this one's)."""
        if (self.dim, self.similarity) != (other.dim, other.similarity) or (
            self.fingerprint.shape != other.fingerprint.shape
        ):
            return False
        if self.settings and other.settings and self.settings.differences(other.settings):
            return False
        cosine = np.min(np.sum(self.fingerprint * other.fingerprint, axis=1))
        return bool(cosine >= SAME_WEIGHTS_COSINE)

    def check_settings(self, settings: VectorSettings, where: Path) -> None:
        """Raise :class:`SettingsMismatchError` naming the first setting that differs.

        A store made before settings were recorded accepts any settings.
        """
        differences = self.settings.differences(settings) if self.settings else []
        if not differences:
            return
        name, stored, given = differences[0]
        fix = _FIXES[name].format(stored=stored, verb="does" if stored else "does not")
        raise SettingsMismatchError(
            f"{where}: the store's vectors were made with {name}={stored!r}, but this run "
            f"embeds with {name}={given!r}: {fix}, or pass --reembed (reembed=True in Python) to "
            "re-embed every document with the new settings, or index into a new --store"
        )


@functools.lru_cache(maxsize=16)
def _fingerprint(text: str) -> np.ndarray:
    """A record's fingerprint from its JSON (tens of kilobytes, parsed once: a database
    store reads its record at every search), read-only since records share it."""
    fingerprint = np.asarray(json.loads(text), dtype=np.float32)
    fingerprint.flags.writeable = False
    return fingerprint


@dataclass
class SwapTarget:
    """The model a store is being re-embedded with (a model swap): its record, and the
    generation its vectors go to. Kept in the store's metadata until the switch."""

    record: StoreRecord
    generation: int

    def to_json(self) -> str:
        return json.dumps({"record": self.record.to_meta(), "generation": self.generation})

    @classmethod
    def from_json(cls, text: str | None, where: Path) -> SwapTarget | None:
        if not text:
            return None
        data = json.loads(text)
        return cls(StoreRecord.from_meta(data["record"], where), int(data["generation"]))
