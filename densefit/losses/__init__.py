"""Losses: pure functions of embeddings (MNRL, MarginMSE) and the false-negative mask."""

from __future__ import annotations

from densefit._lazy import lazy_exports

_EXPORTS = {
    "chunked_cross_entropy": "densefit.losses.contrastive",
    "margin_mse": "densefit.losses.contrastive",
    "mnrl": "densefit.losses.contrastive",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
