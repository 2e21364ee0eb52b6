"""What every densefit command shares: the bad-row choice and the one-line error exit."""

from __future__ import annotations

from enum import Enum

import typer
from rich.console import Console

err = Console(stderr=True)


class OnBadRow(str, Enum):
    error = "error"
    skip = "skip"


def fail(message: str, code: int = 2):
    """Print ``error: message`` in red on stderr and exit with ``code`` (no traceback)."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
