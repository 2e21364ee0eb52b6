"""``densefit run``: mine -> train -> evaluate base and trained -> report, every stage resumable.

>>> from densefit.pipeline import load_run_config, run_pipeline
>>> result = run_pipeline(load_run_config("examples/scifact.yaml"))  # doctest: +SKIP
>>> result.ran  # doctest: +SKIP
['train', 'eval_base', 'eval_trained', 'report']
"""

from densefit.pipeline.config import (
    KEY_DOCS,
    ConfigError,
    EvalSettings,
    MineSettings,
    RunConfig,
    config_from_dict,
    config_from_flags,
    describe_keys,
    load_run_config,
)
from densefit.pipeline.stages import STAGES, Pipeline, RunResult, run_pipeline

__all__ = [
    "KEY_DOCS",
    "STAGES",
    "ConfigError",
    "EvalSettings",
    "MineSettings",
    "Pipeline",
    "RunConfig",
    "RunResult",
    "config_from_dict",
    "config_from_flags",
    "describe_keys",
    "load_run_config",
    "run_pipeline",
]
