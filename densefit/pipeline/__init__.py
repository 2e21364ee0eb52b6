"""``densefit run``: mine -> train -> evaluate base and trained -> report, every stage resumable.

>>> from densefit.config.run import load_run_config
>>> from densefit.pipeline import run_pipeline
>>> result = run_pipeline(load_run_config("examples/scifact.yaml"))  # doctest: +SKIP
>>> result.ran  # doctest: +SKIP
['train', 'eval_base', 'eval_trained', 'report']
"""

from __future__ import annotations

from densefit._lazy import lazy_exports

_EXPORTS = {
    "STAGES": "densefit.pipeline.stages",
    "Pipeline": "densefit.pipeline.stages",
    "RunResult": "densefit.pipeline.stages",
    "run_pipeline": "densefit.pipeline.stages",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
