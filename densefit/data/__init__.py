"""Training and corpus data: readers with file:line errors, and batching."""

from densefit.data.types import BadRowError, Document, ReadReport, TrainingExample

__all__ = ["BadRowError", "Document", "ReadReport", "TrainingExample"]
