"""``densefit run``: mine -> train -> evaluate base and trained -> report, every stage resumable.

>>> from densefit.pipeline import load_run_config, run_pipeline
>>> result = run_pipeline(load_run_config("examples/scifact.yaml"))  # doctest: +SKIP
>>> result.ran  # doctest: +SKIP
['train', 'eval_base', 'eval_trained', 'report']
"""

from __future__ import annotations

from densefit._lazy import lazy_exports

_EXPORTS = {
    "KEY_DOCS": "densefit.pipeline.config",
    "ConfigError": "densefit.pipeline.config",
    "EvalSettings": "densefit.pipeline.config",
    "MineSettings": "densefit.pipeline.config",
    "RunConfig": "densefit.pipeline.config",
    "config_from_dict": "densefit.pipeline.config",
    "config_from_flags": "densefit.pipeline.config",
    "describe_keys": "densefit.pipeline.config",
    "load_run_config": "densefit.pipeline.config",
    "STAGES": "densefit.pipeline.stages",
    "Pipeline": "densefit.pipeline.stages",
    "RunResult": "densefit.pipeline.stages",
    "run_pipeline": "densefit.pipeline.stages",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
