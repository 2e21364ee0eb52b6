"""The high-level API, familiar to Haystack 1.x ``EmbeddingRetriever`` users."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
from sentence_transformers import SentenceTransformer

from densefit.config import TrainConfig
from densefit.data.types import TrainingExample
from densefit.retrieval.encode import encode_texts
from densefit.models import load_model
from densefit.retrieval.api import RetrievalMixin, as_document
from densefit.training.loop import TrainResult, save_model, train

__all__ = ["Retriever", "load_training_examples"]


def load_training_examples(
    training_data: str | os.PathLike | Iterable[Mapping | TrainingExample],
    *,
    on_bad_row: str = "error",
    split: str = "train",
) -> list[TrainingExample]:
    """Training rows from a file or folder path, Haystack-style dicts, or TrainingExamples.

    >>> rows = load_training_examples([{"question": "q", "pos_doc": "d"}])
    >>> rows[0].query, rows[0].positive
    ('q', 'd')
    """
    from densefit.data.readers import examples_from_records, read_training_data

    if isinstance(training_data, (str, os.PathLike)):
        examples, report = read_training_data(training_data, on_bad_row=on_bad_row, split=split)
    else:
        records = list(training_data)
        if records and all(isinstance(r, TrainingExample) for r in records):
            return records
        examples, report = examples_from_records(records, on_bad_row=on_bad_row)
    if report.n_skipped:
        import warnings

        warnings.warn(report.summary(), UserWarning, stacklevel=2)
    return examples


class Retriever(RetrievalMixin):
    """A dense retriever around a SentenceTransformer: train, save, embed, index, retrieve.

    >>> from densefit.testing import tiny_model
    >>> retriever = Retriever(tiny_model())
    >>> retriever.embed_queries(["what is a cell"]).shape
    (1, 32)
    """

    def __init__(
        self,
        model: str | os.PathLike | SentenceTransformer = "all-MiniLM-L6-v2",
        *,
        device: str | None = None,
        max_seq_length: int | None = None,
        trust_remote_code: bool = False,
        batch_size: int = 32,
    ):
        self.model = load_model(
            model, device=device, trust_remote_code=trust_remote_code,
            max_seq_length=max_seq_length,
        )
        if max_seq_length is not None:
            self.model.max_seq_length = max_seq_length
        self.batch_size = batch_size
        self.store = None

    def train(
        self,
        training_data: str | os.PathLike | Sequence[Mapping | TrainingExample],
        learning_rate: float = 2e-5,
        n_epochs: int = 1,
        num_warmup_steps: int | None = None,
        batch_size: int = 16,
        train_loss: str = "mnrl",
        num_workers: int = 0,
        use_amp: bool | str = False,
        gradient_checkpointing: bool = False,
        *,
        save_dir: str | os.PathLike | None = None,
        on_bad_row: str = "error",
        **options,
    ) -> TrainResult:
        """Fine-tune on (query, positive[, negatives][, score]) rows; Haystack 1.x signature.

        ``training_data`` is a path (JSONL, CSV/TSV, Parquet, BEIR folder) or a list of dicts
        with ``question``/``pos_doc``/``neg_doc``/``score`` (or ``anchor``/``positive``/
        ``negative``...). ``use_amp``: True picks fp16 on CUDA, bf16 on CPU. Further
        :class:`~densefit.config.TrainConfig` fields (``memory="auto"``,
        ``memory_budget="8GiB"``, ``max_steps``, ``seed``...) go in ``options``.
        ``num_workers`` is accepted for compatibility: tokenisation happens in the step.
        """
        del num_workers  # batches are tokenised inside the step, per chunk
        amp = use_amp
        if use_amp is True:
            amp = "fp16" if self.model.device.type == "cuda" else "bf16"
        config = TrainConfig(
            batch_size=batch_size, epochs=n_epochs, learning_rate=learning_rate,
            warmup_steps=num_warmup_steps, loss=train_loss, amp=amp or None,
            gradient_checkpointing=gradient_checkpointing, **options,
        )
        examples = load_training_examples(training_data, on_bad_row=on_bad_row)
        self.last_config = config
        return train(self.model, examples, config, output_dir=save_dir)

    def save(self, save_dir: str | os.PathLike) -> Path:
        """Save in sentence-transformers format (loads with ``SentenceTransformer(path)``)."""
        return save_model(self.model, save_dir, getattr(self, "last_config", TrainConfig()))

    def _embed(self, texts: Sequence[str], batch_size: int | None) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("pass a list of texts, not a single string")
        return encode_texts(self.model, list(texts), batch_size=batch_size or self.batch_size)

    def embed_queries(self, queries: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """(n, d) float32 embeddings of ``queries``."""
        return self._embed(queries, batch_size)

    def embed_documents(self, documents: Sequence, batch_size: int | None = None) -> np.ndarray:
        """(n, d) float32 embeddings of documents (strings, Documents or dicts with content)."""
        texts = [as_document(d, i).text for i, d in enumerate(documents)]
        return self._embed(texts, batch_size)
