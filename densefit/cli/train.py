"""``densefit train`` and ``densefit plan``: added to the Typer app by :func:`register`.

Their training options are generated from :class:`~densefit.config.TrainConfig`'s field
declarations (:func:`densefit.cli.common.train_options`); only the options that are not part
of a training configuration (data, model, output, resume...) are declared here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import typer

from densefit.cli.common import (
    OnBadRow,
    err,
    fail,
    invocation,
    print_error,
    train_options,
)

__all__ = ["plan", "register", "train"]


def _launch_torchrun(nproc: int) -> None:
    """Re-run this very command under torchrun with ``nproc`` processes, without --nproc."""
    argv = sys.argv[1:]
    if "train" not in argv:
        fail(
            "--nproc: cannot find the train command in the command line; run "
            "torchrun --nproc-per-node N -m densefit train ... yourself"
        )
    rest, skip = [], False
    for arg in argv[argv.index("train") :]:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "densefit", *rest]  # fmt: skip
    err.print(f"launching: {' '.join(cmd)}", highlight=False)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    raise typer.Exit(subprocess.call(cmd, env=env))


def _start_processes(config, nproc: int | None) -> tuple[int, bool]:  # noqa: ANN001
    """(processes, whether this is the main one); launches torchrun for ``--nproc N``."""
    from densefit.training import distributed

    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if nproc is not None and nproc > 1 and not distributed.launched_by_torchrun():
        _launch_torchrun(nproc)
    if distributed.launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        config.device = str(distributed.init_distributed(config.device))  # cuda -> cuda:RANK
        return distributed.world_size(), distributed.is_main_process()
    return 1, True


def _examples(data: Path, on_bad_row: OnBadRow, split: str) -> list:
    from densefit.data.readers import load_training_examples

    return load_training_examples(data, on_bad_row=on_bad_row.value, split=split)


def _interrupted(output: Path) -> typer.Exit:
    """Say where the newest checkpoint is and how to resume; the exit for Ctrl-C."""
    from densefit.training.checkpoint import latest_checkpoint

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


def _learning_rate_words(plan: dict) -> str:
    """``lr 8e-05 (auto, from the batch size)``: the peak learning rate and its origin."""
    if plan.get("learning_rate") is None:
        return "lr ?"
    auto = " (auto, from the batch size)" if plan.get("learning_rate_from") == "auto" else ""
    return f"lr {plan['learning_rate']:.3g}{auto}"


def _summary(result, output: Path) -> str:  # noqa: ANN001 - a TrainResult
    plan = result.plan
    cache = str(plan.get("strategy")).startswith("cache")
    return (
        f"done: {result.steps} steps, {result.examples} examples in {result.seconds:.1f}s, "
        f"final loss {result.final_loss:.4f}; "
        + _learning_rate_words(plan)
        + f"; memory: {plan.get('strategy')} "
        f"(chunk {plan.get('chunk_size')}, tokens {plan.get('token_budget')}"
        + (f", {plan.get('keep_graphs')} kept graph(s)" if cache else "")
        + (f", {plan['cpu_allocator']} malloc" if plan.get("cpu_allocator") else "")
        + f"); model saved to {output}, log {result.log_path}"
    )


@train_options(lambda name, opt: opt.cli)
def train(
    data: Path = typer.Argument(
        ..., help="Training data: JSONL, CSV/TSV, Parquet or a BEIR folder."
    ),
    model: str = typer.Option("all-MiniLM-L6-v2", "--model", "-m", help="Model folder or name."),
    output: Path = typer.Option(
        ..., "--output", "-o", help="Folder where the trained model is saved."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Train into an --output folder that holds something else."
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue an interrupted run from the newest good checkpoint in OUTPUT/checkpoints.",
    ),
    resume_from: Path | None = typer.Option(
        None, help="Continue from this checkpoint folder (OUTPUT/checkpoints/step-...)."
    ),
    split: str = typer.Option("train", help="qrels split to read from a BEIR folder."),
    on_bad_row: OnBadRow = typer.Option(
        OnBadRow.error, help="error: stop at a bad row; skip: skip and report."
    ),
    nproc: int | None = typer.Option(
        None,
        help="Train with N processes on this machine (launches torchrun; one GPU each with "
        "--device cuda).",
    ),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    options: dict | None = None,
) -> None:
    """Fine-tune a retriever and save it in sentence-transformers format.

    Example: densefit train examples/scifact --output runs/scifact --batch-size 64 --memory auto

    Several GPUs: densefit train ... --device cuda --nproc 4, or
    torchrun --nproc-per-node 4 -m densefit train ... --device cuda (and across nodes).
    Ctrl-C prints the command that resumes from the last checkpoint.
    """
    from densefit.config import TrainConfig
    from densefit.models import load_model
    from densefit.training import distributed
    from densefit.training.loop import train as run_train
    from densefit.training.setup import check_output_dir

    config = TrainConfig(**(options or {}), show_progress=progress)
    check_output_dir(output, config, resume=bool(resume or resume_from), overwrite=overwrite)
    world, main = _start_processes(config, nproc)
    examples = _examples(data, on_bad_row, split)
    st_model = load_model(model, max_seq_length=config.max_seq_length)
    if config.device:
        st_model.to(config.device)
    if main:
        scale_out = ""
        if world > 1:
            scale_out = (f"; global batch {config.batch_size} = {world} processes x "
                         f"{-(-config.batch_size // world)} rows at most, gather {config.gather}")  # fmt: skip
        err.print(
            f"training on {len(examples)} rows from {data} -> {output}{scale_out}; "
            + _learning_rate_words(
                {
                    "learning_rate": config.peak_learning_rate,
                    "learning_rate_from": "auto" if config.learning_rate == "auto" else "given",
                }
            ),
            highlight=False,
        )
    try:
        result = run_train(
            st_model, examples, config, output_dir=output, resume=resume_from or resume,
            overwrite=overwrite,
        )
    except KeyboardInterrupt:
        if main:
            raise _interrupted(output) from None
        raise typer.Exit(130) from None
    if world > 1:
        distributed.teardown_distributed()
    if main:
        err.print(_summary(result, output), highlight=False)


@train_options(lambda name, opt: opt.plan, required=("batch_size",))
def plan(
    data: Path = typer.Argument(..., help="Training data (the planner reads its real lengths)."),
    model: str = typer.Option("all-MiniLM-L6-v2", "--model", "-m", help="Model folder or name."),
    split: str = typer.Option("train", help="qrels split to read from a BEIR folder."),
    on_bad_row: OnBadRow = typer.Option(
        OnBadRow.error, help="error: stop at a bad row; skip: skip and report."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    options: dict | None = None,
) -> None:
    """Print the memory plan for a batch size and budget, with its predicted peak.

    Takes the training options of `densefit train` that change the plan. A plan that cannot
    fit the budget exits with status 3.

    Example: densefit plan data.jsonl --batch-size 4096 --memory-budget 8GiB
    """
    from densefit.config import TrainConfig
    from densefit.data.batching import planned_batches
    from densefit.memory.planner import plan_memory
    from densefit.models import load_model

    config = TrainConfig(**(options or {}), memory="auto")
    examples = _examples(data, on_bad_row, split)
    st_model = load_model(model, max_seq_length=config.max_seq_length)
    result = plan_memory(st_model, examples, config, batches=planned_batches(examples, config))
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        typer.echo(result.table())


def register(app: typer.Typer) -> None:
    """Add the ``train`` and ``plan`` commands to ``app``."""
    app.command("train")(train)
    app.command("plan")(plan)
