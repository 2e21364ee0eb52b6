"""Every option of every command, declared once: the bottom layer (no framework imports).

:mod:`~densefit.config.options` is the mechanism (a declaration per field, checks, YAML
reading, the facts other code asks about an option); :mod:`~densefit.config.shared` the
options several commands take; :mod:`~densefit.config.train` the training options;
:mod:`~densefit.config.mine`, :mod:`~densefit.config.evaluation` the mining and evaluation
settings; :mod:`~densefit.config.commands` what each job takes besides its settings;
:mod:`~densefit.config.run` the ``densefit run`` file.
"""

from __future__ import annotations

from densefit._lazy import lazy_exports

_EXPORTS = {
    "ConfigError": "densefit.config.options",
    "Option": "densefit.config.options",
    "Options": "densefit.config.options",
    "option": "densefit.config.options",
    "option_of": "densefit.config.options",
    "OptionError": "densefit.errors",
    "DEFAULT_MODEL": "densefit.config.shared",
    "check_device": "densefit.config.shared",
    "model_or_default": "densefit.config.shared",
    "TrainConfig": "densefit.config.train",
    "auto_learning_rate": "densefit.config.train",
    "parse_bytes": "densefit.config.train",
    "parse_memory_budget": "densefit.config.train",
    "MineConfig": "densefit.config.mine",
    "EvalConfig": "densefit.config.evaluation",
    "EvalJob": "densefit.config.commands",
    "IndexJob": "densefit.config.commands",
    "MineJob": "densefit.config.commands",
    "PlanJob": "densefit.config.commands",
    "SearchJob": "densefit.config.commands",
    "TrainJob": "densefit.config.commands",
    "RunConfig": "densefit.config.run",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
