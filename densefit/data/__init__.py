"""Training and corpus data: readers with file:line errors, and batching."""

from densefit.data.types import BadRowError, Document, ReadReport, TrainingExample

__all__ = ["BadRowError", "Document", "ReadReport", "TrainingExample"]

from densefit.data.corpus import (  # noqa: E402
    BeirDataset,
    Judgment,
    iter_corpus,
    load_beir,
    read_corpus,
    read_qrels,
    read_queries,
)
from densefit.data.readers import examples_from_records, read_training_data  # noqa: E402

__all__ += [
    "BeirDataset",
    "Judgment",
    "examples_from_records",
    "iter_corpus",
    "load_beir",
    "read_corpus",
    "read_qrels",
    "read_queries",
    "read_training_data",
]
