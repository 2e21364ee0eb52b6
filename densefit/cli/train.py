"""``densefit train`` and ``densefit plan``: argument parsing, one job call, printing.

Their options are generated from :class:`~densefit.config.commands.TrainJob` and
:class:`~densefit.config.commands.PlanJob` (and the training options of their ``train``
section); :mod:`densefit.jobs` runs them.
"""

from __future__ import annotations

import json

import typer

from densefit.cli.common import (
    err,
    invocation,
    launch_torchrun,
    out,
    plural,
    print_error,
    progress_of,
    rerun_for_training,
    say,
)
from densefit.cli.options import options_command
from densefit.config.commands import PlanJob, TrainJob
from densefit.wording import plan_words

__all__ = ["plan", "register", "train"]


def _interrupted(output) -> typer.Exit:  # noqa: ANN001
    """Say where the newest checkpoint is and how to resume; the exit for Ctrl-C."""
    from densefit.training.checkpoint import latest_checkpoint  # the training framework

    checkpoint = latest_checkpoint(output / "checkpoints")
    if checkpoint is None:
        print_error(
            f"interrupted before the first checkpoint in {output / 'checkpoints'}: nothing to "
            f"resume; run the same command again (--checkpoint-every N checkpoints sooner)"
        )
    else:
        resume = invocation(drop=("--resume-from", "--overwrite"), add=("--resume",))
        print_error(
            f"interrupted: the last checkpoint is {checkpoint.path} (step {checkpoint.step}); "
            f"continue with: {resume}"
        )
    return typer.Exit(130)


def summary(outcome) -> str:  # noqa: ANN001
    """The one line a finished run prints: steps, time, loss, learning rate, memory plan,
    where the model and log are, the best evaluation, and what is left on disk."""
    from densefit.jobs import learning_rate_words  # with the job: the training framework

    result, plan = outcome.result, outcome.result.plan
    line = (
        f"done: {plural(result.steps, 'step')}, {plural(result.examples, 'example')} in "
        f"{result.seconds:.1f}s on {outcome.config.device}, final loss {result.final_loss:.4f}; "
        f"{learning_rate_words(outcome.config, plan)}; memory: {plan_words(plan)}; "
        f"model saved to {outcome.output}, log {result.log_path}"
    )
    if result.sources:
        line += "; per source: " + "; ".join(
            _source_words(name, each) for name, each in result.sources.items()
        )
    ev = result.evaluation
    if ev and ev.get("best_step") is not None:
        line += f"; best {ev['metric']} {ev['best']:.4f} at step {ev['best_step']}"
        if ev.get("kept_best"):
            line += " (the saved model is that step's: --keep-best)"
        if ev.get("stopped_early"):
            line += f"; stopped early after step {ev['final_step']}"
    kept = outcome.checkpoints
    if kept.get("kept"):
        line += (
            f"; {plural(kept['kept'], 'checkpoint')} kept in {kept['folder']} "
            f"({kept['bytes'] / 2**20:,.0f} MiB: delete them, or train with "
            "--delete-checkpoints)"
        )
    elif kept.get("deleted"):
        line += (
            f"; its {plural(kept['deleted'], 'checkpoint')} deleted "
            f"({kept['freed_bytes'] / 2**20:,.0f} MiB; --no-delete-checkpoints keeps them)"
        )
    return line


def _source_words(name: str, each: dict) -> str:
    """``faq: 12 rows, 3 steps, 48 rows trained, loss 1.2345`` (mixed batches: no steps)."""
    words = [plural(each["rows"], "row")]
    if each.get("steps") is not None:
        words.append(plural(each["steps"], "step"))
    words.append(f"{each['trained_rows']:,} rows trained")
    if each.get("mean_loss") is not None:
        words.append(f"mean loss {each['mean_loss']:.4f}")
    return f"{name}: {', '.join(words)}"


@options_command(TrainJob)
def train(options: TrainJob) -> None:
    """Fine-tune a retriever and save it in sentence-transformers format.

    Example: densefit train examples/scifact --output runs/scifact --batch-size 64 --memory auto

    Several GPUs: densefit train ... --device cuda --nproc 4, or
    torchrun --nproc-per-node 4 -m densefit train ... --device cuda (and across nodes).
    Ctrl-C prints the command that resumes from the last checkpoint.
    """
    rerun_for_training()
    progress = progress_of(options.train, parameter="train__show_progress")
    job = options.replace(train=options.train.replace(show_progress=progress))
    from densefit.jobs import train_job  # the training framework: only when a run starts
    from densefit.training import distributed  # torch.distributed: only when a run starts

    launch_torchrun("train", job.nproc)
    try:
        outcome = train_job(job, say=say if distributed.is_main_process() else None)
    except KeyboardInterrupt:
        if distributed.is_main_process():
            raise _interrupted(job.output) from None
        raise typer.Exit(130) from None
    if outcome.main:
        err.print(summary(outcome))


@options_command(PlanJob)
def plan(options: PlanJob) -> None:
    """Print the memory plan for a batch size and budget, with its predicted peak.

    Takes the training options of `densefit train` that change the plan. A plan that cannot
    fit the budget exits with status 3. A batch larger than the data is a warning.

    Example: densefit plan data.jsonl --batch-size 4096 --memory-budget 8GiB
    """
    progress_of(options.train, parameter="train__show_progress")
    from densefit.jobs import lora_words, plan_job  # the framework: only when planning

    result, config = plan_job(options)
    if options.json:
        out.print_json(json.dumps({**result.to_dict(), "device": config.device}))
    else:
        out.print(result.table(), markup=False)
        out.print(f"planned for {config.device}{lora_words(config)}", markup=False)


def register(app: typer.Typer) -> None:
    """Add the ``train`` and ``plan`` commands to ``app``."""
    app.command("train")(train)
    app.command("plan")(plan)
