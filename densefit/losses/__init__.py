"""Losses: pure functions of embeddings (MNRL, MarginMSE) and the false-negative mask."""

from densefit.losses.contrastive import chunked_cross_entropy, margin_mse, mnrl

__all__ = ["chunked_cross_entropy", "margin_mse", "mnrl"]
