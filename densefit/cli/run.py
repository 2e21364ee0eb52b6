"""``densefit run``: argument parsing (:class:`~densefit.config.run.RunCommand`, and a flag
for the keys of :class:`~densefit.config.run.RunConfig` declared ``run_flag``), one
pipeline call (:func:`densefit.pipeline.run_pipeline`), printing.

Stage messages and progress go to stderr; the before/after table goes to stdout.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from densefit.cli.common import err, out, progress_wanted, quiet_libraries, rerun_for_training
from densefit.cli.options import options_command
from densefit.config.options import iter_rows
from densefit.config.run import RunCommand, RunConfig, config_from_flags, load_run_config
from densefit.wording import plural

__all__ = ["register", "run"]


def print_keys() -> None:
    """Every key of the configuration file: its default (as YAML writes it) and meaning."""

    for row in iter_rows(RunConfig, yaml=True):
        out.print(f"[bold]{row['key']}[/] (default {row['default']}): {row['help']}")


@options_command(RunCommand, overrides=RunConfig)
def run(options: RunCommand, overrides: dict) -> None:
    """Mine (optional) -> train (memory auto) -> evaluate base and trained -> report.

    Every stage writes OUTPUT/stages/<stage>.json when done: a rerun skips finished stages, redoes those whose inputs changed, and resumes an interrupted training from its checkpoint. Writes OUTPUT/report.md, report.json and plots/*.png. The flags set the file's keys (--batch-size sets train.batch_size, --eval-distractors eval.distractors); --set reaches any key.

    Example: densefit run examples/scifact.yaml --output runs/scifact
    """  # noqa: E501
    if options.keys:
        print_keys()
        return
    overrides = {**overrides, **options.set_values()}
    if overrides.get("output") is not None and Path(overrides["output"]).is_file():
        raise FileExistsError(
            f"{overrides['output']}: exists and is not a folder; choose another --output"
        )
    started = time.perf_counter()
    if options.config is not None:
        config = load_run_config(options.config, overrides)
    else:
        config = config_from_flags(overrides)
    progress = progress_wanted(config.progress, explicit="progress" in overrides)
    if progress != config.progress:
        config = config.replace(progress=progress)
    if not progress:
        quiet_libraries()
    rerun_for_training()  # the configuration is checked: now the work starts

    from densefit.pipeline.stages import run_pipeline  # the framework: only when running

    result = run_pipeline(config, force=options.force, console=err)
    name = Path(config.data).name
    out.print(result.table(title=f"{name} {config.eval.split_name}: base vs trained"))
    report = result.report
    t = report["train"]
    skipped = f"; skipped: {', '.join(result.skipped)}" if result.skipped else ""
    out.print(
        f"trained {plural(t['steps'], 'step')} on {plural(t['rows'], 'row')}; memory plan "
        f"{report['memory_plan']['strategy']}; stages ran: {', '.join(result.ran) or 'none'}"
        f"{skipped}",
        markup=False,
    )
    out.print(
        f"report: {result.output / 'report.md'} (+ report.html, report.json, plots/); "
        f"{time.perf_counter() - started:.0f}s this run",
        markup=False,
    )


def register(app: typer.Typer) -> None:
    """Add the ``run`` command to ``app``."""
    app.command("run")(run)
