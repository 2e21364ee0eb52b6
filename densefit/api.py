"""The high-level API, familiar to Haystack 1.x ``EmbeddingRetriever`` users.

:class:`Retriever` holds a :class:`sentence_transformers.SentenceTransformer` (``model``) and,
once :meth:`Retriever.index` ran, a document store (``store``: a folder, a database's target
such as ``postgresql://.../TABLE``, or a store object; :func:`~densefit.retrieval.index.
engines.open_store`): train, save, embed, index, retrieve and evaluate.

The store remembers the model that embedded it, so retrieving after the model was trained in
place (or swapped) raises :class:`~densefit.retrieval.index.types.ModelMismatchError`: call
``index`` again to re-embed the documents with the current weights.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from sentence_transformers import SentenceTransformer

from densefit.choices import DEFAULT_METRICS
from densefit.config.commands import TrainJob
from densefit.config.shared import DEFAULT_MODEL, ENCODE_BATCH_SIZE, RUNTIME
from densefit.config.train import TrainConfig
from densefit.data.text import checked_text
from densefit.data.types import Document, TrainingExample
from densefit.evaluate import EvalResult, evaluate
from densefit.jobs import train_job
from densefit.models import load_model
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.fusion import Fusion
from densefit.retrieval.index.engines import open_store
from densefit.retrieval.index.indexing import index_documents
from densefit.retrieval.index.searching import search_batch
from densefit.retrieval.index.types import SearchHit, StoreError
from densefit.retrieval.runtimes import resolve_runtime
from densefit.training.loop import TrainResult, save_model

__all__ = ["Retriever", "as_document"]


def as_document(item, position: int = 0) -> Document:
    """A :class:`Document` from a Document, a Haystack-style dict or a plain string.

    Dicts use ``id`` (or ``_id``), ``content`` (or ``text``), ``title`` and ``meta``; strings
    and dicts without an id get a stable id from their text's hash.

    >>> as_document({"id": "7", "content": "Cells divide.", "title": "Biology"}).text
    'Biology Cells divide.'
    >>> as_document("some text").id
    'sha1:37aa63c77398d954'
    """
    if isinstance(item, Document):
        return item
    if isinstance(item, str):
        checked_text(item, f"documents[{position}]")
        return Document(id=_hash_id(item), text=item)
    if isinstance(item, Mapping):
        body = item.get("content", item.get("text"))
        if not isinstance(body, str):
            raise TypeError(
                f"documents[{position}] has no text: a dict needs 'content' (or 'text') "
                f"holding a string, got keys {sorted(item)}"
            )
        checked_text(body, f"documents[{position}].content", empty_ok=True)
        title = checked_text(item.get("title") or "", f"documents[{position}].title", empty_ok=True)
        doc_id = item.get("id", item.get("_id"))
        text = checked_text(f"{title} {body}".strip() if title else body, f"documents[{position}]")
        return Document(
            id=str(doc_id) if doc_id is not None else _hash_id(text),
            text=text,
            title=title,
            meta=dict(item.get("meta") or {}),
        )
    raise TypeError(
        f"documents[{position}] is a {type(item).__name__}: pass Documents, dicts with "
        "'content', or strings"
    )


def _hash_id(text: str) -> str:
    return "sha1:" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


class Retriever:
    """A dense retriever around a SentenceTransformer: train, save, embed, index, retrieve.

    ``runtime`` runs the model for every embedding it makes (:data:`densefit.choices.
    RUNTIME_CHOICES`): ``"auto"`` (the fastest runtime exported for the model's weights
    whose check passed, else torch), ``"torch"``, ``"onnx"``, ``"onnx-int8"``...
    (:mod:`densefit.retrieval.runtimes`; exports: :func:`densefit.retrieval.export.export_model`).

    >>> from densefit.testing import tiny_model
    >>> retriever = Retriever(tiny_model())
    >>> retriever.embed_queries(["what is a cell"]).shape
    (1, 32)
    """

    def __init__(
        self,
        model: str | os.PathLike | SentenceTransformer = DEFAULT_MODEL,
        *,
        device: str | None = None,
        max_seq_length: int | None = None,
        trust_remote_code: bool = False,
        batch_size: int = ENCODE_BATCH_SIZE.default,
        runtime: str = RUNTIME.default,
    ):
        self.model = load_model(
            model,
            device=device,
            trust_remote_code=trust_remote_code,
            max_seq_length=max_seq_length,
        )
        if max_seq_length is not None:
            self.model.max_seq_length = max_seq_length
        self.batch_size = batch_size
        # What runs the model for every embedding this retriever makes (index, retrieve,
        # embed_*, evaluate): densefit.choices.RUNTIME_CHOICES; "auto": the fastest exported
        # runtime whose check passed, else torch. An unknown or unavailable one fails here.
        if runtime != "auto":
            resolve_runtime(self.model, runtime)
        self.runtime = runtime
        self.store = None

    def train(
        self,
        training_data: str | os.PathLike | Sequence[Mapping | TrainingExample] | Any,
        learning_rate: float | str = "auto",  # TrainConfig's rule in the batch size
        n_epochs: int = 1,
        num_warmup_steps: int | None = None,
        batch_size: int | None = None,
        train_loss: str = "mnrl",
        num_workers: int = 0,
        use_amp: bool | str = False,
        gradient_checkpointing: bool = False,
        *,
        save_dir: str | os.PathLike | None = None,
        on_bad_row: str = "error",
        split: str = "train",
        **options,
    ) -> TrainResult:
        """Fine-tune on (query, positive[, negatives][, score]) rows; Haystack 1.x signature.

        ``training_data`` is a path (JSONL, CSV/TSV, Parquet, BEIR folder, a
        ``Dataset.save_to_disk`` folder, a folder of Parquet shards), a ``datasets.Dataset``
        (a ``DatasetDict``: its ``split``), a list of dicts with
        ``question``/``pos_doc``/``neg_doc``/``score`` (or ``anchor``/``positive``/
        ``negative``...), or several of these as a list or a mapping ``{name: source}``: each
        step then trains on one source (``source_batches``, ``source_sampling``; see
        :func:`densefit.data.sources.load_training_data`). ``batch_size`` defaults to
        TrainConfig's (32). ``use_amp``: True picks fp16 on CUDA, bf16 on CPU. Further
        :class:`~densefit.config.TrainConfig` fields (``memory_budget="8GiB"``,
        ``max_steps``, ``seed``...) go in ``options``.
        ``num_workers`` is accepted for compatibility: tokenisation happens in the step.
        Runs :func:`densefit.jobs.train_job`, as ``densefit train`` does.
        """
        del num_workers  # batches are tokenised inside the step, per chunk
        amp = use_amp
        if use_amp is True:
            amp = "fp16" if self.model.device.type == "cuda" else "bf16"
        given = dict(
            epochs=n_epochs,
            learning_rate=learning_rate,
            warmup_steps=num_warmup_steps,
            loss=train_loss,
            amp=amp or None,
            gradient_checkpointing=gradient_checkpointing,
            device=str(self.model.device),
            show_progress=False,
        )
        if batch_size is not None:
            given["batch_size"] = batch_size
        config = TrainConfig(**{**given, **options})
        job = TrainJob(
            data=training_data,
            model=self.model,
            output=save_dir,
            on_bad_row=on_bad_row,
            split=split,
            train=config,
        )
        outcome = train_job(job)
        self.last_config = outcome.config
        return outcome.result

    def save(self, save_dir: str | os.PathLike) -> Path:
        """Save in sentence-transformers format (loads with ``SentenceTransformer(path)``)."""
        return save_model(self.model, save_dir, getattr(self, "last_config", TrainConfig()))

    def _embed(
        self, texts: Sequence[str], batch_size: int | None, prompt_name: str | None = None
    ) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("pass a list of texts, not a single string")
        return encode_texts(
            self.model, list(texts), batch_size=batch_size or self.batch_size,
            prompt_name=prompt_name, runtime=self.runtime,
        )  # fmt: skip

    def embed_queries(self, queries: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """(n, d) float32 embeddings of ``queries`` (with the model's query prompt)."""
        return self._embed(queries, batch_size, "query")

    def embed_documents(self, documents: Sequence, batch_size: int | None = None) -> np.ndarray:
        """(n, d) float32 embeddings of documents (strings, Documents or dicts with content),
        with the model's document prompt."""
        texts = [as_document(d, i).text for i, d in enumerate(documents)]
        return self._embed(texts, batch_size, "document")

    def index(
        self,
        documents: Iterable[Document | Mapping | str],
        store: str | os.PathLike | object | None = None,
        batch_size: int | None = None,
        *,
        backend: str | None = None,
        show_progress: bool = False,
        reembed: bool = False,
        vectors: str = "float32",
        rescore: int | None = None,
    ):
        """Embed ``documents`` and write them to ``store`` (which becomes ``self.store``).

        ``store`` is a folder path or a database's target (``postgresql://...``, ``qdrant:...``;
        created for this model if new), a store object, or None:
        ``self.store`` if set, else a temporary store deleted when the retriever is. Documents
        already stored with the same text are skipped, so calling ``index`` again with a grown
        corpus only embeds the new documents. A store made with other settings (e.g. another
        ``max_seq_length``) is refused unless ``reembed`` re-embeds all of it. ``vectors`` is
        a new store's vector kind (``float32``, ``float16``, ``int8``, ``binary``; int8 and
        binary search codes in memory and rescore ``rescore x top_k`` candidates against
        float32 vectors on disk: :mod:`densefit.retrieval.index.quantized`). Returns an
        :class:`~densefit.retrieval.index.indexing.IndexReport`.
        """
        opening = {"backend": backend, "vectors": vectors, "rescore": rescore}
        if store is None:
            store = (
                self.store if self.store is not None else open_store(None, self.model, **opening)
            )
        elif isinstance(store, (str, os.PathLike)):
            store = open_store(store, self.model, **opening)
        store.check_model(self.model)
        self.store = store
        docs = (as_document(d, i) for i, d in enumerate(documents))
        total = len(documents) if isinstance(documents, Sequence) else None
        return index_documents(
            store,
            self.model,
            docs,
            batch_size=batch_size or self.batch_size,
            show_progress=show_progress,
            total=total,
            reembed=reembed,
            runtime=self.runtime,
        )

    def retrieve(
        self,
        query: str,
        top_k: int = 10,
        *,
        filters: dict | None = None,
        scale_score: bool = False,
        mode: str = "dense",
        fusion: Fusion | None = None,
    ) -> list[SearchHit]:
        """The ``top_k`` documents best matching ``query``, best first.

        Each :class:`~densefit.retrieval.index.types.SearchHit` has ``id``, ``score``, ``rank``,
        ``text``, ``title`` and ``meta``. ``mode`` is ``"dense"`` (embeddings), ``"bm25"``
        (BM25 over the texts) or ``"hybrid"`` (both, fused by ``fusion``:
        :class:`~densefit.retrieval.fusion.Fusion`, reciprocal rank by default). ``filters``
        takes Haystack's filter syntax, e.g. ``{"field": "meta.lang", "operator": "==",
        "value": "en"}``: the best ``top_k`` of the matching documents (both sides of a
        hybrid search are filtered before fusion). ``scale_score=True`` maps scores to
        [0, 1] as Haystack does (cosine: ``(score + 1) / 2``; BM25: ``expit(score / 8)``).

        >>> from densefit.testing import tiny_model
        >>> retriever = Retriever(tiny_model())
        >>> _ = retriever.index(["cells divide", "python functions"])
        >>> [hit.text for hit in retriever.retrieve("python", top_k=1, mode="bm25")]
        ['python functions']
        """
        if not isinstance(query, str):
            raise TypeError("retrieve takes one query string; use retrieve_batch for a list")
        hits = self.retrieve_batch(
            [query], top_k=top_k, filters=filters, scale_score=scale_score, mode=mode, fusion=fusion
        )
        return hits[0]

    def retrieve_batch(
        self,
        queries: Sequence[str],
        top_k: int = 10,
        *,
        filters: dict | None = None,
        scale_score: bool = False,
        mode: str = "dense",
        fusion: Fusion | None = None,
    ) -> list[list[SearchHit]]:
        """:meth:`retrieve` for many queries, embedded and searched together."""
        return search_batch(
            self._require_store(),
            self.model,
            queries,
            top_k=top_k,
            filters=filters,
            scale_score=scale_score,
            batch_size=self.batch_size,
            mode=mode,
            fusion=fusion,
            runtime=self.runtime,
        )

    def evaluate(
        self,
        queries: str | os.PathLike | Mapping[str, str] | None = None,
        qrels: str | os.PathLike | Mapping[str, Mapping[str, int]] | None = None,
        *,
        dataset: str | os.PathLike | None = None,
        split: str = "test",
        metrics: Sequence[str] | None = None,
        top_k: int | None = None,
        mode: str = "dense",
        fusion: Fusion | None = None,
    ) -> EvalResult:
        """nDCG@10, MRR@10, Recall@10/100 and MAP@100 (pytrec_eval) of this retriever.

        Either ``queries`` + ``qrels`` (files or mappings) scored against ``self.store``, or
        ``dataset=BEIR_FOLDER`` which indexes that corpus into a temporary store (leaving
        ``self.store`` alone): :func:`densefit.evaluate.evaluate`, the one evaluation entry.
        ``mode`` and ``fusion`` as in :meth:`retrieve`.
        """
        options = dict(
            metrics=tuple(metrics or DEFAULT_METRICS),
            top_k=top_k,
            batch_size=self.batch_size,
            mode=mode,
            fusion=fusion,
            runtime=self.runtime,
        )
        if dataset is not None:
            if queries is not None or qrels is not None:
                raise ValueError("pass either dataset= or queries and qrels, not both")
            return evaluate(self.model, dataset, split=split, **options)
        if queries is None or qrels is None:
            raise ValueError("evaluate needs queries and qrels, or dataset=BEIR_FOLDER")
        return evaluate(self.model, self._require_store(), queries=queries, qrels=qrels, **options)

    def _require_store(self):
        if self.store is None:
            raise StoreError(
                "this retriever has no document store yet: call retriever.index(documents) "
                "(or retriever.index(documents, store='path/to/store')) first"
            )
        return self.store
