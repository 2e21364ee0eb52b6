"""densefit: fine-tune and serve dense retrievers with batch size independent of memory."""

__version__ = "0.1.0"

from densefit.config import TrainConfig  # noqa: E402
from densefit.data.types import BadRowError, Document, TrainingExample  # noqa: E402
from densefit.losses import margin_mse, mnrl  # noqa: E402
from densefit.models import load_model  # noqa: E402
from densefit.retrieval import Retriever  # noqa: E402
from densefit.training import TrainResult, train  # noqa: E402

__all__ = [
    "BadRowError",
    "Document",
    "Retriever",
    "TrainConfig",
    "TrainResult",
    "TrainingExample",
    "__version__",
    "load_model",
    "margin_mse",
    "mnrl",
    "train",
]
