"""What needs the model: a store's record read from it (:func:`record_for`,
:func:`settings_of`: the model's name, dimension, *fingerprint*, its embeddings of
:data:`PROBE_TEXTS`, and the :class:`~densefit.retrieval.index.types.VectorSettings` that
change the vectors it makes from the same text), and the checks of a model against a record:
searching with another model raises :class:`~densefit.retrieval.index.types.
ModelMismatchError` (:func:`check_model`); indexing with other settings raises
:class:`~densefit.retrieval.index.types.SettingsMismatchError` (vectors made two ways must not
be mixed in one store), as does a query runtime the stored vectors may not meet
(:func:`check_runtime`, the rule of :func:`~densefit.retrieval.vector_source.disagreement`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sentence_transformers.models import Normalize

from densefit.choices import SIMILARITIES
from densefit.models import model_name_of, model_similarity
from densefit.prompts import model_prompts
from densefit.retrieval.encode import embedding_dimension, encode_texts
from densefit.retrieval.index.types import (
    SAME_WEIGHTS_COSINE,
    ModelMismatchError,
    SettingsMismatchError,
    StoreError,
    StoreRecord,
    VectorSettings,
)
from densefit.retrieval.runtimes import Runtime
from densefit.retrieval.vector_source import VectorSource, disagreement

__all__ = [
    "PROBE_TEXTS",
    "canonical_model_name",
    "check_model",
    "check_search_settings",
    "model_fingerprint",
    "model_truncate_dim",
    "record_for",
    "search_options",
    "settings_of",
]

PROBE_TEXTS = (
    "densefit model fingerprint: the quick brown fox jumps over the lazy dog.",
    "What is the effect of vitamin D on bone density in older adults?",
    "def search(index, query, k=10): return index.top_k(query, k)",
)
# Every probe fits in this many tokens (with BERT's and MiniLM's tokenizers), so for models whose
# max_seq_length is at least this, fingerprints match those recorded before it was fixed.
PROBE_LENGTH = 64


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


def settings_of(model, runtime: Runtime | None = None) -> VectorSettings:
    """The settings ``model`` embeds documents with now (by ``runtime``; None: torch).

    >>> from densefit.testing import tiny_model
    >>> settings_of(tiny_model()).max_seq_length
    64
    """
    length = getattr(model, "max_seq_length", None)
    return VectorSettings(
        max_seq_length=int(length) if length is not None else None,
        normalize=any(isinstance(module, Normalize) for module in model),
        prompts=model_prompts(model),
        truncate_dim=model_truncate_dim(model),
        source=runtime.source if runtime is not None else VectorSource(),
    )


def check_model(record: StoreRecord, model, where: Path | str) -> None:
    """Raise :class:`~densefit.retrieval.index.types.ModelMismatchError` unless ``model``
    made the vectors ``record`` describes.

    The dimension must match, and the model must reproduce the recorded fingerprint:
    a model of the same name whose weights changed (trained in place) is refused too, and
    the same weights under another name (a hub name vs its local folder) are accepted.
    """
    given = model_name_of(model)
    dim = embedding_dimension(model)
    if dim != record.dim and getattr(model, "truncate_dim", None) is not None:
        raise ModelMismatchError(
            f"{where}: the store holds {record.dim}-d vectors, but the queries are cut to "
            f"{dim} (--dim {dim}): drop --dim (a search uses the store's size) or pass "
            f"--dim {record.dim}"
        )
    if dim != record.dim:
        cut = (
            f"search with --dim {record.dim} (Python: model.truncate_dim = {record.dim}) if "
            "the store was indexed at that size, "
            if record.dim < dim
            else ""
        )
        raise ModelMismatchError(
            f"{where}: the store holds {record.dim}-d embeddings from "
            f"{record.model_name!r}, but model {given!r} makes {dim}-d embeddings: {cut}search "
            f"with --model {record.model_name}, or re-index into a new store with this model"
        )
    fingerprint = model_fingerprint(model)
    similarity = float(np.min(np.sum(fingerprint * record.fingerprint, axis=1)))
    same_name = canonical_model_name(given) == canonical_model_name(record.model_name)
    if similarity < SAME_WEIGHTS_COSINE:
        why = (
            "its weights changed since the store was indexed (was it trained?)"
            if same_name
            else "it is a different model"
        )
        raise ModelMismatchError(
            f"{where}: the store was indexed with {record.model_name!r}, but model "
            f"{given!r} does not reproduce its embeddings ({why}; probe cosine "
            f"{similarity:.4f}): search with the indexing model, or re-index the corpus "
            "with this one (`densefit index ... --store NEW_DIR`)"
        )


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
    :func:`~densefit.retrieval.vector_source.disagreement`.

    >>> int8 = VectorSource("onnx-int8", "int8:ab", "onnx/model_qint8_avx2.onnx", False)
    >>> check_runtime(int8, None, Path("store"))
    Traceback (most recent call last):
    ...
    densefit.retrieval.index.types.SettingsMismatchError: store: the store's documents were embedded by onnx-int8 (onnx/model_qint8_avx2.onnx), this run embeds with torch: the check of onnx-int8 (onnx/model_qint8_avx2.onnx) did not find that its vectors rank like fp32 ones when mixed with them; search with --runtime onnx-int8 (runtime= in Python), or re-index with this runtime
    """
    given = runtime.source if runtime is not None else VectorSource()
    reason = disagreement(stored, given, mixing=False)
    if reason:
        raise SettingsMismatchError(
            f"{where}: {reason}; search with --runtime {stored.runtime} (runtime= in Python), "
            "or re-index with this runtime"
        )


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
        settings_of(model, runtime),
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
