"""Training and corpus data: readers with file:line errors, and batching."""

from __future__ import annotations

from densefit._lazy import lazy_exports

_EXPORTS = {
    "BadRowError": "densefit.data.types",
    "Document": "densefit.data.types",
    "ReadReport": "densefit.data.types",
    "TrainingExample": "densefit.data.types",
    "BeirDataset": "densefit.data.corpus",
    "Judgment": "densefit.data.corpus",
    "find_corpus_file": "densefit.data.corpus",
    "iter_corpus": "densefit.data.corpus",
    "load_beir": "densefit.data.corpus",
    "read_corpus": "densefit.data.corpus",
    "read_qrels": "densefit.data.corpus",
    "read_queries": "densefit.data.corpus",
    "examples_from_records": "densefit.data.readers",
    "load_training_examples": "densefit.data.sources",
    "load_training_data": "densefit.data.sources",
    "TrainingData": "densefit.data.sources",
    "ArrowExamples": "densefit.data.arrow",
    "read_training_data": "densefit.data.readers",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
