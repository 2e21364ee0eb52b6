"""``densefit mine``: argument parsing (from :class:`~densefit.config.commands.MineJob`),
one job call (:func:`densefit.jobs.mine_job`), printing."""

from __future__ import annotations

import typer

from densefit.cli.common import progress_of, say
from densefit.cli.options import options_command
from densefit.config.commands import MineJob

__all__ = ["mine", "register"]


@options_command(MineJob)
def mine(options: MineJob) -> None:
    """Mine hard negatives for training pairs, skipping known positives (false negatives).

    Example: densefit mine scifact --corpus scifact --method bm25 --num-negatives 4 --range 10:100 --relative-margin 0.05 --output mined.jsonl
    """  # noqa: E501
    job = options.replace(show_progress=progress_of(options))
    from densefit.jobs import mine_job  # numpy, bm25s, maybe torch: only when mining

    mine_job(job, say=say)


def register(app: typer.Typer) -> None:
    """Add the ``mine`` command to ``app``."""
    app.command("mine")(mine)
