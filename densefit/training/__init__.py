"""Training: the loop, one optimizer step, checkpoints, guards and several processes.

``train()`` is the loop; code that drives steps itself (benchmarks, tests) starts a run
with :func:`setup_run` and calls :func:`train_step` per step, as the loop does.
"""

from densefit.training.loop import TrainResult, train
from densefit.training.setup import TrainRun, setup_run
from densefit.training.step import train_step

__all__ = ["TrainResult", "TrainRun", "setup_run", "train", "train_step"]
