"""Haystack embedders that run densefit's encoder: fast runtimes for any document store.

:class:`DensefitTextEmbedder` and :class:`DensefitDocumentEmbedder` are Haystack components
with the inputs and outputs of sentence-transformers-haystack's
``SentenceTransformersTextEmbedder`` (``run(text)`` -> ``{"embedding": [floats]}``) and
``SentenceTransformersDocumentEmbedder`` (``run(documents)`` -> ``{"documents": [...]}``,
copies of the documents with ``embedding`` set), so they replace them in any pipeline and
feed any Haystack document store (in memory, Qdrant, pgvector, Elasticsearch, densefit's
own). What they add:

- ``runtime``: what runs the transformer, the vocabulary of ``densefit --runtime``:
  ``auto`` (the default: the fastest runtime exported for the model's weights whose check
  passed, else torch), ``torch``, ``onnx`` (fp32, exported in memory when no file is),
  ``onnx-int8``, ``openvino``, ``openvino-int8`` (files ``densefit export MODEL --to ...``
  writes; :mod:`densefit.retrieval.runtimes`). Texts go through densefit's one encoder
  (:func:`densefit.retrieval.encode.encode_texts`: length-sorted batches, each distinct
  text embedded once), so the vectors are the ones ``densefit index`` and ``densefit
  search`` make.
- Prompts from the model: the text embedder puts the model's query prompt before the text,
  the document embedder the model's document prompt before each document
  (:mod:`densefit.prompts`; a densefit-trained model saves both). ``query_prompt=`` /
  ``document_prompt=`` replace it (``""``: none), as ``--query-prompt`` /
  ``--document-prompt`` do.
- ``truncate_dim``: the Matryoshka cut densefit trains and indexes with, the first
  ``truncate_dim`` coordinates rescaled to the full vector's norm (unit vectors stay unit;
  :func:`densefit.losses.matryoshka.truncate`). Its cosines equal those of
  sentence-transformers' ``truncate_dim``, which does not rescale.

The model is loaded (:func:`densefit.models.load_model`, safetensors only) and the runtime
resolved in :meth:`~DensefitTextEmbedder.warm_up`, which a pipeline calls before its first
run; ``__init__`` only checks and keeps its serialisable arguments (``to_dict`` /
``from_dict``, pipeline YAML: ``Pipeline.loads(text, allowed_modules=[
"densefit.integrations.haystack_embedders"])``, Haystack's allowlist of trusted modules).
Each component loads its own copy of the model.

Give both embedders of a store the same model and runtime: ``auto`` picks the same export
for the same model folder, but an int8 export's vectors are not torch's, and a query
embedded by one runtime family against documents embedded by another ranks less well
(:func:`densefit.retrieval.vector_source.disagreement`).

An indexing pipeline and a query pipeline over Haystack's ``InMemoryDocumentStore``, here
with a tiny random model saved to the folder ``tiny`` (use your model's folder or name, e.g.
``"all-MiniLM-L6-v2"``)::

    >>> from haystack import Document, Pipeline
    >>> from haystack.components.retrievers.in_memory import InMemoryEmbeddingRetriever
    >>> from haystack.components.writers import DocumentWriter
    >>> from haystack.document_stores.in_memory import InMemoryDocumentStore
    >>> from densefit.testing import tiny_model
    >>> tiny_model("tiny-build").save("tiny")
    >>> store = InMemoryDocumentStore(embedding_similarity_function="cosine")
    >>> indexing = Pipeline()
    >>> embed = DensefitDocumentEmbedder(model="tiny", progress_bar=False)
    >>> _ = indexing.add_component("embed", embed)
    >>> _ = indexing.add_component("write", DocumentWriter(store))
    >>> _ = indexing.connect("embed.documents", "write.documents")
    >>> docs = [Document(content="cells divide by mitosis"), Document(content="a python function")]
    >>> indexing.run({"embed": {"documents": docs}})
    {'write': {'documents_written': 2}}
    >>> query = Pipeline()
    >>> _ = query.add_component("embed", DensefitTextEmbedder(model="tiny", progress_bar=False))
    >>> _ = query.add_component("retrieve", InMemoryEmbeddingRetriever(store, top_k=1))
    >>> _ = query.connect("embed.embedding", "retrieve.query_embedding")
    >>> found = query.run({"embed": {"text": "cells divide by mitosis"}})
    >>> found["retrieve"]["documents"][0].content
    'cells divide by mitosis'

With an export for speed (``densefit export runs/m --to onnx-int8`` writes it into the model
folder; ``runtime="auto"`` picks it too). Creating a component loads nothing: the model is
loaded when the pipeline warms it up::

    >>> embedder = DensefitDocumentEmbedder(
    ...     model="runs/m", runtime="onnx-int8", meta_fields_to_embed=["title"], truncate_dim=256
    ... )
    >>> embedder.to_dict()["init_parameters"]["runtime"], embedder.resolved_runtime is None
    ('onnx-int8', True)
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

try:
    from haystack import Document, component, default_from_dict, default_to_dict
    from haystack.utils import ComponentDevice
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError(
        "densefit.integrations.haystack_embedders needs Haystack: pip install 'densefit[haystack]'"
    ) from None

from densefit.choices import RUNTIME_CHOICES
from densefit.config.shared import (
    DEFAULT_MODEL,
    DEVICE,
    DOCUMENT_PROMPT,
    ENCODE_BATCH_SIZE,
    MAX_SEQ_LENGTH,
    PROGRESS,
    QUERY_PROMPT,
    RUNTIME,
    check_device,
)
from densefit.models import load_model
from densefit.prompts import DOCUMENT, QUERY
from densefit.retrieval.encode import configure_model, embedding_dimension, encode_texts
from densefit.retrieval.runtimes import Runtime, resolve_runtime

__all__ = ["DensefitDocumentEmbedder", "DensefitTextEmbedder"]


class _DensefitEmbedder:
    """What both embedders share: their checked settings, ``warm_up`` and the encoder call.

    A subclass sets ``_PROMPT`` (which of the model's prompts it embeds with, ``"query"`` or
    ``"document"``) and keeps its override of that prompt as ``self.query_prompt`` /
    ``self.document_prompt`` before calling :meth:`_setup`.
    """

    _PROMPT: str

    def _setup(
        self,
        *,
        model: str,
        runtime: str,
        device: str | ComponentDevice | None,
        truncate_dim: int | None,
        batch_size: int,
        progress_bar: bool,
        normalize_embeddings: bool,
        max_seq_length: int | None,
        trust_remote_code: bool,
    ) -> None:
        name = type(self).__name__
        if not isinstance(model, str) or not model:
            raise TypeError(
                f"{name}: model must be a model folder or name (a non-empty str), got "
                f"{model!r}: pass e.g. model={DEFAULT_MODEL!r}"
            )
        if runtime not in RUNTIME_CHOICES:
            raise ValueError(
                f"{name}: runtime {runtime!r} is not one of {', '.join(RUNTIME_CHOICES)}: "
                "pass one of them ('auto': the fastest exported runtime whose check passed, "
                "else torch)"
            )
        if isinstance(device, ComponentDevice):  # Haystack's device type, kept as its name
            device = device.to_torch_str()
        try:
            device = check_device(device)
        except ValueError as exc:
            raise ValueError(f"{name}: device {exc}") from None
        for key, value, optional in (
            ("batch_size", batch_size, False),
            ("truncate_dim", truncate_dim, True),
            ("max_seq_length", max_seq_length, True),
        ):
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                none = " (or None)" if optional else ""
                raise ValueError(f"{name}: {key} must be an int >= 1{none}, got {value!r}")
        if self._prompt is not None and not isinstance(self._prompt, str):
            raise TypeError(
                f'{name}: {self._PROMPT}_prompt must be a str ("" for none) or None for '
                f"the model's own, got {type(self._prompt).__name__}"
            )
        self.model = model
        self.runtime = runtime
        self.device = device
        self.truncate_dim = truncate_dim
        self.batch_size = batch_size
        self.progress_bar = progress_bar
        self.normalize_embeddings = normalize_embeddings
        self.max_seq_length = max_seq_length
        self.trust_remote_code = trust_remote_code
        self._model = None  # the SentenceTransformer, loaded by warm_up
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()

    @property
    def _prompt(self) -> str | None:
        return getattr(self, f"{self._PROMPT}_prompt")

    def _settings(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "runtime": self.runtime,
            "device": self.device,
            "truncate_dim": self.truncate_dim,
            "batch_size": self.batch_size,
            "progress_bar": self.progress_bar,
            "normalize_embeddings": self.normalize_embeddings,
            "max_seq_length": self.max_seq_length,
            "trust_remote_code": self.trust_remote_code,
        }

    @property
    def resolved_runtime(self) -> Runtime | None:
        """The :class:`~densefit.retrieval.runtimes.Runtime` that embeds (``auto``
        resolved; its ``source.file`` names the exported file), None before
        :meth:`warm_up`."""
        return self._runtime

    def warm_up(self) -> None:
        """Load the model, set its prompt and Matryoshka size, and resolve the runtime
        (once; a pipeline calls this before its first run). A runtime that cannot run
        here raises :class:`~densefit.retrieval.runtimes.RuntimeUnavailableError` (a
        ValueError) saying how to get it."""
        with self._lock:
            if self._model is not None:
                return
            model = load_model(
                self.model,
                device=self.device,
                trust_remote_code=self.trust_remote_code,
                max_seq_length=self.max_seq_length,
            )
            model.truncate_dim = None  # the full size, to check truncate_dim against
            full = embedding_dimension(model)
            if self.truncate_dim is not None and self.truncate_dim > full:
                raise ValueError(
                    f"{type(self).__name__}: truncate_dim={self.truncate_dim}, but "
                    f"{self.model} makes {full}-d embeddings: give a size from 1 to {full}, "
                    "or None for the full size"
                )
            configure_model(
                model, **{f"{self._PROMPT}_prompt": self._prompt}, dim=self.truncate_dim
            )
            self._runtime = resolve_runtime(model, self.runtime)
            self._model = model

    def _embed(self, texts: list[str]):
        """``texts`` embedded with the model's prompt through the resolved runtime."""
        self.warm_up()
        return encode_texts(
            self._model,
            texts,
            batch_size=self.batch_size,
            show_progress=self.progress_bar,
            normalize=self.normalize_embeddings,
            prompt_name=self._PROMPT,
            runtime=self._runtime,
        )


@component
class DensefitTextEmbedder(_DensefitEmbedder):
    """Embeds one text (a query) with densefit's encoder: a drop-in
    ``SentenceTransformersTextEmbedder`` whose output feeds an embedding retriever.

    :param model: the model folder or name (:func:`densefit.models.load_model`).
    :param runtime: what runs the transformer (:data:`densefit.choices.RUNTIME_CHOICES`);
        ``"auto"``: the fastest exported runtime whose check passed, else torch.
    :param query_prompt: the text put before the query; None (default): the model's
        ``"query"`` prompt, if any; ``""``: none.
    :param truncate_dim: Matryoshka: keep the first ``truncate_dim`` coordinates, rescaled to
        the full vector's norm; None: the full size.
    :param device: ``"auto"`` (the GPU when torch sees one), ``"cpu"``, ``"cuda"``,
        ``"cuda:N"``, ``"mps"``, or a Haystack ``ComponentDevice``.
    :param batch_size: texts per forward pass.
    :param progress_bar: show a progress bar while embedding.
    :param normalize_embeddings: scale the vector to unit length.
    :param max_seq_length: truncate texts to this many tokens; None: the model's own.
    :param trust_remote_code: let the model's folder run its own code.

    >>> DensefitTextEmbedder(runtime="tensorrt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: DensefitTextEmbedder: runtime 'tensorrt' is not one of auto, torch, onnx, ...
    """

    _PROMPT = QUERY

    def __init__(
        self,
        *,
        model: str = DEFAULT_MODEL,
        runtime: str = RUNTIME.default,
        query_prompt: str | None = QUERY_PROMPT.default,
        truncate_dim: int | None = None,
        device: str | ComponentDevice | None = DEVICE.default,
        batch_size: int = ENCODE_BATCH_SIZE.default,
        progress_bar: bool = PROGRESS.default,
        normalize_embeddings: bool = False,
        max_seq_length: int | None = MAX_SEQ_LENGTH.default,
        trust_remote_code: bool = False,
    ) -> None:
        self.query_prompt = query_prompt
        self._setup(
            model=model,
            runtime=runtime,
            device=device,
            truncate_dim=truncate_dim,
            batch_size=batch_size,
            progress_bar=progress_bar,
            normalize_embeddings=normalize_embeddings,
            max_seq_length=max_seq_length,
            trust_remote_code=trust_remote_code,
        )

    def to_dict(self) -> dict[str, Any]:
        """Serialise the component's settings (not the loaded model)."""
        return default_to_dict(self, query_prompt=self.query_prompt, **self._settings())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DensefitTextEmbedder:
        """The component :meth:`to_dict` described (not warmed up)."""
        return default_from_dict(cls, data)

    @component.output_types(embedding=list[float])
    def run(self, text: str) -> dict[str, Any]:
        """Embed ``text``: ``{"embedding": [floats]}``.

        :raises TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(
                f"DensefitTextEmbedder takes one text (a str), got {type(text).__name__}: "
                "to embed Documents use DensefitDocumentEmbedder"
            )
        return {"embedding": self._embed([text])[0].tolist()}

    @component.output_types(embedding=list[float])
    async def run_async(self, text: str) -> dict[str, Any]:
        """:meth:`run` for ``AsyncPipeline``, in a worker thread (the event loop goes on)."""
        return await asyncio.to_thread(self.run, text)


@component
class DensefitDocumentEmbedder(_DensefitEmbedder):
    """Embeds documents with densefit's encoder: a drop-in
    ``SentenceTransformersDocumentEmbedder`` whose output a ``DocumentWriter`` writes to any
    document store.

    Each document is embedded as its ``meta_fields_to_embed`` values (those present and not
    None, as text) and its content joined by ``embedding_separator``, after the document
    prompt; the output holds copies of the documents with ``embedding`` set, in input order.

    :param model: the model folder or name (:func:`densefit.models.load_model`).
    :param runtime: what runs the transformer (:data:`densefit.choices.RUNTIME_CHOICES`);
        ``"auto"``: the fastest exported runtime whose check passed, else torch.
    :param document_prompt: the text put before each document; None (default): the model's
        ``"document"`` prompt, if any; ``""``: none.
    :param truncate_dim: Matryoshka: keep the first ``truncate_dim`` coordinates, rescaled to
        the full vector's norm; None: the full size.
    :param meta_fields_to_embed: metadata fields embedded with the content, in this order.
    :param embedding_separator: what joins the metadata values and the content.
    :param device: ``"auto"`` (the GPU when torch sees one), ``"cpu"``, ``"cuda"``,
        ``"cuda:N"``, ``"mps"``, or a Haystack ``ComponentDevice``.
    :param batch_size: texts per forward pass.
    :param progress_bar: show a progress bar while embedding.
    :param normalize_embeddings: scale each vector to unit length.
    :param max_seq_length: truncate texts to this many tokens; None: the model's own.
    :param trust_remote_code: let the model's folder run its own code.
    """

    _PROMPT = DOCUMENT

    def __init__(
        self,
        *,
        model: str = DEFAULT_MODEL,
        runtime: str = RUNTIME.default,
        document_prompt: str | None = DOCUMENT_PROMPT.default,
        truncate_dim: int | None = None,
        meta_fields_to_embed: list[str] | None = None,
        embedding_separator: str = "\n",
        device: str | ComponentDevice | None = DEVICE.default,
        batch_size: int = ENCODE_BATCH_SIZE.default,
        progress_bar: bool = PROGRESS.default,
        normalize_embeddings: bool = False,
        max_seq_length: int | None = MAX_SEQ_LENGTH.default,
        trust_remote_code: bool = False,
    ) -> None:
        fields = list(meta_fields_to_embed or [])
        if isinstance(meta_fields_to_embed, str) or not all(isinstance(f, str) for f in fields):
            raise TypeError(
                "DensefitDocumentEmbedder: meta_fields_to_embed must be a list of metadata "
                f"field names, got {meta_fields_to_embed!r}: e.g. ['title']"
            )
        if not isinstance(embedding_separator, str):
            raise TypeError(
                "DensefitDocumentEmbedder: embedding_separator must be a str, got "
                f"{type(embedding_separator).__name__}"
            )
        self.meta_fields_to_embed = fields
        self.embedding_separator = embedding_separator
        self.document_prompt = document_prompt
        self._setup(
            model=model,
            runtime=runtime,
            device=device,
            truncate_dim=truncate_dim,
            batch_size=batch_size,
            progress_bar=progress_bar,
            normalize_embeddings=normalize_embeddings,
            max_seq_length=max_seq_length,
            trust_remote_code=trust_remote_code,
        )

    def to_dict(self) -> dict[str, Any]:
        """Serialise the component's settings (not the loaded model)."""
        return default_to_dict(
            self,
            document_prompt=self.document_prompt,
            meta_fields_to_embed=self.meta_fields_to_embed,
            embedding_separator=self.embedding_separator,
            **self._settings(),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DensefitDocumentEmbedder:
        """The component :meth:`to_dict` described (not warmed up)."""
        return default_from_dict(cls, data)

    def text_to_embed(self, document: Document) -> str:
        """What is embedded for ``document`` (before the prompt): its
        ``meta_fields_to_embed`` values and its content, joined by ``embedding_separator``.

        >>> embedder = DensefitDocumentEmbedder(meta_fields_to_embed=["title"])
        >>> embedder.text_to_embed(Document(content="Mitosis is...", meta={"title": "Cells"}))
        'Cells\\nMitosis is...'
        """
        meta = [
            str(document.meta[key])
            for key in self.meta_fields_to_embed
            if document.meta.get(key) is not None
        ]
        return self.embedding_separator.join([*meta, document.content or ""])

    @component.output_types(documents=list[Document])
    def run(self, documents: list[Document]) -> dict[str, list[Document]]:
        """Embed ``documents``: ``{"documents": [...]}``, copies with ``embedding`` set.

        :raises TypeError: ``documents`` is not a list of Documents.
        """
        if not isinstance(documents, (list, tuple)):
            raise TypeError(
                "DensefitDocumentEmbedder takes a list of haystack Documents, got "
                f"{type(documents).__name__}: to embed one text use DensefitTextEmbedder"
            )
        for i, document in enumerate(documents):
            if not isinstance(document, Document):
                raise TypeError(
                    f"DensefitDocumentEmbedder: documents[{i}] is a "
                    f"{type(document).__name__}, not a haystack Document: wrap texts as "
                    "Document(content=text), or embed a text with DensefitTextEmbedder"
                )
        vectors = self._embed([self.text_to_embed(d) for d in documents])
        return {
            "documents": [
                replace(d, embedding=v.tolist()) for d, v in zip(documents, vectors, strict=True)
            ]
        }

    @component.output_types(documents=list[Document])
    async def run_async(self, documents: list[Document]) -> dict[str, list[Document]]:
        """:meth:`run` for ``AsyncPipeline``, in a worker thread (the event loop goes on)."""
        return await asyncio.to_thread(self.run, documents)
