"""Errors that name the option at fault, shared by the configuration, the models and the CLI."""

from __future__ import annotations

__all__ = ["ModelNotFoundError", "OptionError"]


class OptionError(ValueError):
    """A value outside an option's declared choices or range.

    ``str(error)`` names the option by its Python name (``warmup_steps must be >= 0, got
    -5``); :meth:`named` renders the same message under another name, such as the CLI flag
    (:meth:`for_cli`) or the YAML key ``train.warmup_steps``.

    >>> error = OptionError("warmup_steps", "{option} must be >= 0, got -5", flag="--warmup")
    >>> str(error), error.for_cli()
    ('warmup_steps must be >= 0, got -5', '--warmup must be >= 0, got -5')
    """

    def __init__(self, name: str, template: str, *, flag: str | None = None) -> None:
        self.name, self.template, self.flag = name, template, flag
        super().__init__(self.named(name))

    def __reduce__(self):  # noqa: ANN204 - picklable across processes
        return (_rebuild, (self.name, self.template, self.flag))

    def named(self, label: str) -> str:
        """The message with the option called ``label``."""
        return self.template.format(option=label)

    def for_cli(self) -> str:
        """The message with the option called by its command-line flag."""
        return self.named(self.flag or "--" + self.name.replace("_", "-"))


def _rebuild(name: str, template: str, flag: str | None) -> OptionError:
    return OptionError(name, template, flag=flag)


class ModelNotFoundError(RuntimeError):
    """A model that is neither a loadable local folder nor fetchable (offline, or absent)."""
