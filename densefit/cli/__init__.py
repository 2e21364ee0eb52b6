"""The ``densefit`` command line."""

from densefit.cli.app import app, main

__all__ = ["app", "main"]
