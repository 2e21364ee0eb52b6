"""Training and corpus data: readers with file:line errors, and batching."""

from densefit.data.types import BadRowError, Document, ReadReport, TrainingExample

__all__ = ["BadRowError", "Document", "ReadReport", "TrainingExample"]

from densefit.data.corpus import (  # noqa: E402
    BeirDataset,
    Judgment,
    find_corpus_file,
    iter_corpus,
    load_beir,
    read_corpus,
    read_qrels,
    read_queries,
)
from densefit.data.readers import (  # noqa: E402
    examples_from_records,
    load_training_examples,
    read_training_data,
)

__all__ += [
    "BeirDataset",
    "Judgment",
    "examples_from_records",
    "find_corpus_file",
    "iter_corpus",
    "load_beir",
    "load_training_examples",
    "read_corpus",
    "read_qrels",
    "read_queries",
    "read_training_data",
]
