"""``densefit run``: added to the Typer app by :func:`register`.

Stage messages and progress go to stderr; the before/after table goes to stdout.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console

from densefit.cli.common import err, fail

__all__ = ["register"]

out = Console(highlight=False)


def _parse_set(items: list[str]) -> dict:
    import yaml

    values = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            fail(f"--set {item!r}: write KEY=VALUE, e.g. --set train.warmup_steps=10")
        try:
            values[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError:
            values[key.strip()] = text
    return values


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        config: Path | None = typer.Argument(
            None, help="YAML config (see --keys); or give --data."
        ),
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
        batch_size: int | None = typer.Option(None, help="train.batch_size"),
        epochs: int | None = typer.Option(None, help="train.epochs"),
        max_steps: int | None = typer.Option(None, help="train.max_steps"),
        lr: float | None = typer.Option(None, "--lr", help="train.learning_rate"),
        memory_budget: str | None = typer.Option(None, help="train.memory_budget, e.g. 4GiB"),
        max_seq_length: int | None = typer.Option(None, help="train.max_seq_length"),
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
        progress: bool | None = typer.Option(
            None, "--progress/--no-progress", help="Progress bars."
        ),
        keys: bool = typer.Option(
            False, "--keys", help="List every config key, its default and meaning, then exit."
        ),
    ) -> None:
        """Mine (optional) -> train (memory auto) -> evaluate base and trained -> report.

        Every stage writes OUTPUT/stages/<stage>.json when done: a rerun skips finished stages, redoes those whose inputs changed, and resumes an interrupted training from its checkpoint. Writes OUTPUT/report.md, report.json and plots/*.png.

        Example: densefit run examples/scifact.yaml --output runs/scifact
        """  # noqa: E501
        from densefit.data.types import BadRowError
        from densefit.models import ModelNotFoundError
        from densefit.pipeline import ConfigError, config_from_flags, describe_keys, load_run_config
        from densefit.pipeline.stages import run_pipeline

        if keys:
            for key, default, doc in describe_keys():
                out.print(f"[bold]{key}[/] (default {default!r}): {doc}")
            return
        overrides: dict = {}
        flags = {
            "output": output,
            "data": data,
            "model": model,
            "train_data": train_data,
            "train.batch_size": batch_size,
            "train.epochs": epochs,
            "train.max_steps": max_steps,
            "train.learning_rate": lr,
            "train.memory_budget": memory_budget,
            "train.max_seq_length": max_seq_length,
            "eval.max_seq_length": eval_max_seq_length,
            "progress": progress,
        }
        overrides.update(
            {k: (str(v) if isinstance(v, Path) else v) for k, v in flags.items() if v is not None}
        )
        if mine is not None:
            overrides["mine.method"] = None if mine.lower() in ("none", "off", "null") else mine
        if distractors is not None:
            overrides["eval.distractors"] = None if distractors < 0 else distractors
        overrides.update(_parse_set(set_))
        started = time.perf_counter()
        try:
            if config is not None:
                run_config = load_run_config(config, overrides)
            elif "data" in overrides:
                run_config = config_from_flags(overrides)
            else:
                fail("give a config file (densefit run examples/scifact.yaml) or --data DIR")
            result = run_pipeline(run_config, force=force, console=err)
        except (
            ConfigError,
            BadRowError,
            ModelNotFoundError,
            FileNotFoundError,
            ImportError,
            ValueError,
            MemoryError,
        ) as exc:
            fail(str(exc))
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
