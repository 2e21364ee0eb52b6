"""The ``densefit`` command line (:mod:`densefit.cli.app`; it loads no framework: a command
imports its job only when it runs)."""

from densefit.cli.app import app, main

__all__ = ["app", "main"]
