"""Training: the loop, one optimizer step, checkpoints, guards and several processes.

``train()`` is the loop; code that drives steps itself (benchmarks, tests) starts a run
with :func:`setup_run` and calls :func:`train_step` per step, as the loop does.
"""

from __future__ import annotations

from densefit._lazy import lazy_exports

_EXPORTS = {
    "TrainResult": "densefit.training.loop",
    "train": "densefit.training.loop",
    "TrainRun": "densefit.training.setup",
    "setup_run": "densefit.training.setup",
    "train_step": "densefit.training.step",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
