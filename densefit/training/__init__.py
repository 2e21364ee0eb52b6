"""Training: the loop, one optimizer step, checkpoints, guards and several processes."""

from densefit.training.loop import TrainResult, train

__all__ = ["TrainResult", "train"]
