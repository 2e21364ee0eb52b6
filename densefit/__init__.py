"""densefit: fine-tune and serve dense retrievers with batch size independent of memory.

The names below are exported lazily (PEP 562): ``import densefit`` loads no framework, and
``from densefit import Retriever`` imports torch and sentence-transformers only then.
"""

from __future__ import annotations

from densefit._lazy import lazy_exports
from densefit._version import __version__  # noqa: F401 - exported

_EXPORTS = {
    "BadRowError": "densefit.data.types",
    "Document": "densefit.data.types",
    "TrainingExample": "densefit.data.types",
    "Retriever": "densefit.api",
    "TrainConfig": "densefit.config",
    "TrainResult": "densefit.training.loop",
    "train": "densefit.training.loop",
    "load_model": "densefit.models",
    "margin_mse": "densefit.losses.contrastive",
    "mnrl": "densefit.losses.contrastive",
}
__all__ = sorted([*_EXPORTS, "__version__"])
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
