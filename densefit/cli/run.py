"""``densefit run``: added to the Typer app by :func:`register`.

Stage messages and progress go to stderr; the before/after table goes to stdout. Errors are
plain exceptions, printed by the app's one error handler (:mod:`densefit.cli.app`).
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console

from densefit.cli.common import err, train_options

__all__ = ["register", "run"]

out = Console(highlight=False)

# TrainConfig fields that `densefit run` offers as flags (train.<name>); --set reaches any key.
RUN_TRAIN_FLAGS = (
    "batch_size",
    "epochs",
    "max_steps",
    "learning_rate",
    "memory_budget",
    "max_seq_length",
    "device",
)


def _parse_set(items: list[str]) -> dict:
    import yaml

    values = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: write KEY=VALUE, e.g. --set train.warmup_steps=10")
        try:
            values[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError:
            values[key.strip()] = text
    return values


def _overrides(flags: dict, train: dict, mine: str | None, distractors: int | None,
               set_: list[str]) -> dict:  # fmt: skip
    """The dotted config keys the flags set (flags left unset set nothing)."""
    overrides = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in flags.items() if v is not None
    }
    overrides.update({f"train.{name}": value for name, value in train.items()})
    if mine is not None:
        overrides["mine.method"] = None if mine.lower() in ("none", "off", "null") else mine
    if distractors is not None:
        overrides["eval.distractors"] = None if distractors == -1 else distractors
    overrides.update(_parse_set(set_))
    return overrides


def _print_keys() -> None:
    from densefit.pipeline import describe_keys

    for key, default, doc in describe_keys():
        out.print(f"[bold]{key}[/] (default {default!r}): {doc}")


def _print_result(result, run_config, started: float) -> None:  # noqa: ANN001
    name = Path(run_config.data).name
    out.print(result.table(title=f"{name} {run_config.eval.split}: base vs trained"))
    report = result.report
    t = report["train"]
    out.print(
        f"trained {t['steps']} steps on {t['rows']} rows; memory plan "
        f"{report['memory_plan']['strategy']}; stages ran: {', '.join(result.ran) or 'none'}"
        f"{'; skipped: ' + ', '.join(result.skipped) if result.skipped else ''}"
    )
    out.print(
        f"report: {result.output / 'report.md'} (+ report.json, plots/); "
        f"{time.perf_counter() - started:.0f}s this run"
    )


@train_options(lambda name, opt: name in RUN_TRAIN_FLAGS, unset=True)
def run(
    config: Path | None = typer.Argument(None, help="YAML config (see --keys); or give --data."),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Output folder (default: runs/<config name>)."
    ),
    data: Path | None = typer.Option(
        None, help="BEIR folder: corpus, queries, qrels/<train and eval split>."
    ),
    model: str | None = typer.Option(None, "--model", "-m", help="Base model folder or name."),
    train_data: Path | None = typer.Option(
        None, help="Train on this file/folder instead of DATA's train split."
    ),
    mine: str | None = typer.Option(
        None, help="Mine hard negatives first: bm25, dense, hybrid, or none."
    ),
    eval_max_seq_length: int | None = typer.Option(
        None, help="eval.max_seq_length (both evaluations)"
    ),
    distractors: int | None = typer.Option(
        None,
        help="eval.distractors: evaluate on judged docs + N random others; -1: full corpus.",
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="Any key: --set train.warmup_steps=10 (repeatable; see --keys)."
    ),
    force: bool = typer.Option(False, "--force", help="Redo every stage, even finished ones."),
    progress: bool | None = typer.Option(None, "--progress/--no-progress", help="Progress bars."),
    keys: bool = typer.Option(
        False, "--keys", help="List every config key, its default and meaning, then exit."
    ),
    options: dict | None = None,
) -> None:
    """Mine (optional) -> train (memory auto) -> evaluate base and trained -> report.

    Every stage writes OUTPUT/stages/<stage>.json when done: a rerun skips finished stages, redoes those whose inputs changed, and resumes an interrupted training from its checkpoint. Writes OUTPUT/report.md, report.json and plots/*.png. The training options set the train section's keys (train.batch_size ...).

    Example: densefit run examples/scifact.yaml --output runs/scifact
    """  # noqa: E501
    from densefit.cli.common import check_output_folder
    from densefit.pipeline import config_from_flags, load_run_config
    from densefit.pipeline.stages import run_pipeline

    if keys:
        _print_keys()
        return
    flags = {"output": output, "data": data, "model": model, "train_data": train_data,
             "eval.max_seq_length": eval_max_seq_length, "progress": progress}  # fmt: skip
    overrides = _overrides(flags, options or {}, mine, distractors, set_)
    if output is not None:
        check_output_folder(output)
    started = time.perf_counter()
    if config is not None:
        run_config = load_run_config(config, overrides)
    elif "data" in overrides:
        run_config = config_from_flags(overrides)
    else:
        raise ValueError("give a config file (densefit run examples/scifact.yaml) or --data DIR")
    result = run_pipeline(run_config, force=force, console=err)
    _print_result(result, run_config, started)


def register(app: typer.Typer) -> None:
    """Add the ``run`` command to ``app``."""
    app.command("run")(run)
