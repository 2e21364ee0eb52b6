"""What made a store's vectors, recorded in its meta table, and the checks against a model.

A store records the model (name, embedding dimension and a *fingerprint*: the model's
embeddings of three probe sentences) and the settings that change the vectors a model makes
from the same text: the truncation length (``max_seq_length``), the query and document
prompts (:mod:`densefit.prompts`), the Matryoshka size the vectors were cut to
(``truncate_dim``, ``densefit index --dim``), whether the model normalises its embeddings,
and the runtime that computed them (:class:`~densefit.retrieval.runtimes.VectorSource`:
torch, an fp32 export or one quantized file). Searching with another model raises
:class:`~densefit.retrieval.index.base.ModelMismatchError`; indexing with other settings
raises :class:`SettingsMismatchError` (vectors made two ways must not be mixed in one store).

The runtime rule (:func:`~densefit.retrieval.runtimes.disagreement`): documents are written
by one runtime family only (torch and fp32 exports are one family; each quantized file is
its own), and queries may come from another family only where the quantized file's export
check found that mixing it with fp32 ranks the same (``agrees_with_fp32``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sentence_transformers.models import Normalize

from densefit.choices import SIMILARITIES
from densefit.models import model_name_of, model_similarity
from densefit.prompts import model_prompts
from densefit.retrieval.encode import embedding_dimension, encode_texts
from densefit.retrieval.index.base import ModelMismatchError, StoreError
from densefit.retrieval.runtimes import Runtime, VectorSource, disagreement

__all__ = [
    "FORMAT",
    "PROBE_TEXTS",
    "SettingsMismatchError",
    "StoreRecord",
    "SwapTarget",
    "VectorSettings",
    "canonical_model_name",
    "check_search_settings",
    "search_options",
    "model_fingerprint",
    "model_truncate_dim",
    "record_for",
]

FORMAT = "densefit-store/1"
PROBE_TEXTS = (
    "densefit model fingerprint: the quick brown fox jumps over the lazy dog.",
    "What is the effect of vitamin D on bone density in older adults?",
    "def search(index, query, k=10): return index.top_k(query, k)",
)
# Every probe fits in this many tokens (with BERT's and MiniLM's tokenizers), so for models whose
# max_seq_length is at least this, fingerprints match those recorded before it was fixed.
PROBE_LENGTH = 64
# Same weights reproduce the probe embeddings to ~1e-7; a fine-tuned model moves them more.
SAME_WEIGHTS_COSINE = 1 - 1e-5


class SettingsMismatchError(StoreError):
    """Indexing would mix vectors made with different settings into one store."""


def canonical_model_name(name: str) -> str:
    """A model name that compares equal however the same model was named."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    lowered = name.strip().lower()
    return lowered.removeprefix("sentence-transformers/")


def model_fingerprint(model) -> np.ndarray:
    """The model's unit-length embeddings of :data:`PROBE_TEXTS`, ``(3, dim)`` float32.

    Made at :data:`PROBE_LENGTH` tokens whatever the model's ``max_seq_length``: the
    fingerprint identifies the weights, and a store re-embedded with another truncation
    length (``--reembed``) must still recognise its model.
    """

    length = getattr(model, "max_seq_length", None)
    model.max_seq_length = PROBE_LENGTH
    try:
        return encode_texts(model, list(PROBE_TEXTS), batch_size=1, normalize=True)
    finally:
        model.max_seq_length = length


def model_truncate_dim(model) -> int | None:
    """The size ``model`` cuts its embeddings to (``model.truncate_dim``), or None when it
    gives them whole (no ``truncate_dim``, or one at least the full size).

    >>> from densefit.testing import tiny_model
    >>> model = tiny_model()
    >>> model_truncate_dim(model)
    >>> model.truncate_dim = 16
    >>> model_truncate_dim(model)
    16
    """
    dim = getattr(model, "truncate_dim", None)
    if dim is None:
        return None
    model.truncate_dim = None
    try:
        full = embedding_dimension(model)
    finally:
        model.truncate_dim = dim
    return int(dim) if dim < full else None


@dataclass(frozen=True)
class VectorSettings:
    """The settings besides the weights that decide a model's vector for a text.

    ``None`` (in a store made before they were recorded) means unknown: not compared.

    >>> from densefit.testing import tiny_model
    >>> VectorSettings.of(tiny_model()).max_seq_length
    64
    """

    max_seq_length: int | None = None
    normalize: bool | None = None
    prompts: dict = field(default_factory=dict, hash=False)  # {"query": ..., "document": ...}
    truncate_dim: int | None = None  # Matryoshka: vectors cut to this size, re-normalised
    source: VectorSource = field(default_factory=VectorSource)  # the runtime that made them

    @classmethod
    def of(cls, model, runtime: Runtime | None = None) -> VectorSettings:
        """The settings ``model`` embeds documents with now (by ``runtime``; None: torch)."""
        length = getattr(model, "max_seq_length", None)
        return cls(
            max_seq_length=int(length) if length is not None else None,
            normalize=any(isinstance(module, Normalize) for module in model),
            prompts=model_prompts(model),
            truncate_dim=model_truncate_dim(model),
            source=runtime.source if runtime is not None else VectorSource(),
        )

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
        when the two may not write into one store (:func:`~densefit.retrieval.runtimes.
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


def check_search_settings(
    settings: VectorSettings | None, model, where: Path, runtime: Runtime | None = None
) -> None:
    """Raise :class:`SettingsMismatchError` when ``model`` would embed queries with other
    prompts than the store's documents were indexed with (None: not recorded, accepted), or
    by a ``runtime`` (None: torch) whose vectors may not meet the store's
    (:func:`check_runtime`).
    """
    if settings is None:
        return
    check_runtime(settings.source, runtime, where)
    given = model_prompts(model)
    if given != settings.prompts:
        raise SettingsMismatchError(
            f"{where}: the store was indexed with the prompts {settings.prompts!r}, but this "
            f"model has {given!r}: search with --query-prompt/--document-prompt as indexed "
            "(in Python: densefit.prompts.set_prompts), or re-index with these prompts"
        )


def check_runtime(stored: VectorSource, runtime: Runtime | None, where: Path) -> None:
    """Raise :class:`SettingsMismatchError` when queries embedded by ``runtime`` (None:
    torch) may not search documents embedded by ``stored``: the rule of
    :func:`~densefit.retrieval.runtimes.disagreement`.

    >>> int8 = VectorSource("onnx-int8", "int8:ab", "onnx/model_qint8_avx2.onnx", False)
    >>> check_runtime(int8, None, Path("store"))
    Traceback (most recent call last):
    ...
    densefit.retrieval.index.settings.SettingsMismatchError: store: the store's documents were embedded by onnx-int8 (onnx/model_qint8_avx2.onnx), this run embeds with torch: the check of onnx-int8 (onnx/model_qint8_avx2.onnx) did not find that its vectors rank like fp32 ones when mixed with them; search with --runtime onnx-int8 (runtime= in Python), or re-index with this runtime
    """
    given = runtime.source if runtime is not None else VectorSource()
    reason = disagreement(stored, given, mixing=False)
    if reason:
        raise SettingsMismatchError(
            f"{where}: {reason}; search with --runtime {stored.runtime} (runtime= in Python), "
            "or re-index with this runtime"
        )


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
            fingerprint=np.asarray(json.loads(meta["fingerprint"]), dtype=np.float32),
            settings=VectorSettings.from_meta(meta),
        )

    def same_vectors(self, other: StoreRecord) -> bool:
        """Whether ``other`` records the same vectors: same size, similarity and settings,
        and a fingerprint of the same weights (a model swap for it may resume this one's)."""
        if (self.dim, self.similarity) != (other.dim, other.similarity) or (
            self.fingerprint.shape != other.fingerprint.shape
        ):
            return False
        if (
            self.settings is not None
            and other.settings is not None
            and (self.settings.differences(other.settings))
        ):
            return False
        cosine = np.min(np.sum(self.fingerprint * other.fingerprint, axis=1))
        return bool(cosine >= SAME_WEIGHTS_COSINE)

    def check_model(self, model, where: Path) -> None:
        """Raise :class:`ModelMismatchError` unless ``model`` made these vectors.

        The dimension must match, and the model must reproduce the recorded fingerprint:
        a model of the same name whose weights changed (trained in place) is refused too, and
        the same weights under another name (a hub name vs its local folder) are accepted.
        """

        given = model_name_of(model)
        dim = embedding_dimension(model)
        if dim != self.dim and getattr(model, "truncate_dim", None) is not None:
            raise ModelMismatchError(
                f"{where}: the store holds {self.dim}-d vectors, but the queries are cut to "
                f"{dim} (--dim {dim}): drop --dim (a search uses the store's size) or pass "
                f"--dim {self.dim}"
            )
        if dim != self.dim:
            cut = (
                f"search with --dim {self.dim} (Python: model.truncate_dim = {self.dim}) if "
                "the store was indexed at that size, "
                if self.dim < dim
                else ""
            )
            raise ModelMismatchError(
                f"{where}: the store holds {self.dim}-d embeddings from "
                f"{self.model_name!r}, but model {given!r} makes {dim}-d embeddings: {cut}search "
                f"with --model {self.model_name}, or re-index into a new store with this model"
            )
        fingerprint = model_fingerprint(model)
        similarity = float(np.min(np.sum(fingerprint * self.fingerprint, axis=1)))
        same_name = canonical_model_name(given) == canonical_model_name(self.model_name)
        if similarity < SAME_WEIGHTS_COSINE:
            why = (
                "its weights changed since the store was indexed (was it trained?)"
                if same_name
                else "it is a different model"
            )
            raise ModelMismatchError(
                f"{where}: the store was indexed with {self.model_name!r}, but model "
                f"{given!r} does not reproduce its embeddings ({why}; probe cosine "
                f"{similarity:.4f}): search with the indexing model, or re-index the corpus "
                "with this one (`densefit index ... --store NEW_DIR`)"
            )

    def check_settings(self, settings: VectorSettings, where: Path) -> None:
        """Raise :class:`SettingsMismatchError` naming the first setting that differs.

        A store made before settings were recorded accepts any settings.
        """
        if self.settings is None:
            return
        differences = self.settings.differences(settings)
        if not differences:
            return
        name, stored, given = differences[0]
        fix = _FIXES[name].format(stored=stored, verb="does" if stored else "does not")
        raise SettingsMismatchError(
            f"{where}: the store's vectors were made with {name}={stored!r}, but this run "
            f"embeds with {name}={given!r}: {fix}, or pass --reembed (reembed=True in Python) to "
            "re-embed every document with the new settings, or index into a new --store"
        )


@dataclass
class SwapTarget:
    """The model a store is being re-embedded with (a model swap,
    :mod:`densefit.retrieval.index.swap`): its record, and the vector-file generation its
    vectors go to. Kept in the store's meta table until the switch."""

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


def record_for(model, vectors: str, runtime=None) -> StoreRecord:
    """What a store of ``vectors`` records about vectors ``model`` makes (by ``runtime``,
    None: torch): its name (a local folder's absolute path), dimension, similarity,
    fingerprint and settings."""
    name = model_name_of(model)
    if Path(name).expanduser().is_dir():
        name = str(Path(name).expanduser().resolve())
    similarity = model_similarity(model)
    if similarity not in SIMILARITIES:
        raise StoreError(
            f"model {name!r} scores by {similarity!r} similarity; the store searches by inner "
            "product and supports cosine and dot models only"
        )
    return StoreRecord(
        name,
        embedding_dimension(model),
        similarity,
        vectors,
        model_fingerprint(model),
        VectorSettings.of(model, runtime),
    )


def search_options(
    settings: VectorSettings | None,
    query_prompt: str | None = None,
    document_prompt: str | None = None,
    dim: int | None = None,
) -> dict:
    """The prompts and size to search a store with: each one given, else what the store
    recorded (its prompts, its ``truncate_dim``); keyword arguments of
    :func:`densefit.retrieval.encode.configure_model`.

    >>> search_options(VectorSettings(prompts={"query": "q: "}, truncate_dim=64))
    {'query_prompt': 'q: ', 'document_prompt': '', 'dim': 64}
    """
    recorded = settings.prompts if settings is not None else {}
    if settings is not None and query_prompt is None and document_prompt is None:
        query_prompt = recorded.get("query", "")
        document_prompt = recorded.get("document", "")
    if dim is None and settings is not None:
        dim = settings.truncate_dim
    return {"query_prompt": query_prompt, "document_prompt": document_prompt, "dim": dim}
