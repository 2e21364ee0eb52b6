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
    ON_BAD_ROW_OPTION,
    PROGRESS_OPTION,
    OnBadRow,
    err,
    fail,
    invocation,
    lora_summary,
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
    return _read(data, on_bad_row, split)[0]


def _read(data: Path, on_bad_row: OnBadRow, split: str) -> tuple:
    """The examples and the reader's report (skipped rows, for the model card)."""
    import warnings

    from densefit.data.readers import read_training_data

    examples, report = read_training_data(data, on_bad_row=on_bad_row.value, split=split)
    if report.n_skipped:
        warnings.warn(report.summary(), UserWarning, stacklevel=2)
    return examples, report


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


def _summary(result, output: Path, device: str | None = None) -> str:  # noqa: ANN001
    plan = result.plan
    cache = str(plan.get("strategy")).startswith("cache")
    return (
        f"done: {result.steps} steps, {result.examples} examples in {result.seconds:.1f}s"
        + (f" on {device}" if device else "")
        + f", final loss {result.final_loss:.4f}; "
        + _learning_rate_words(plan)
        + f"; memory: {plan.get('strategy')} "
        f"(chunk {plan.get('chunk_size')}, tokens {plan.get('token_budget')}"
        + (f", {plan.get('keep_graphs')} kept graph(s)" if cache else "")
        + (f", {plan['cpu_allocator']} malloc" if plan.get("cpu_allocator") else "")
        + f"); model saved to {output}, log {result.log_path}"
        + _eval_summary(result.evaluation)
    )


def _eval_summary(ev: dict | None) -> str:
    """The best evaluation and, with --keep-best, that the model is that step's."""
    if not ev or ev.get("best_step") is None:
        return ""
    out = f"; best {ev['metric']} {ev['best']:.4f} at step {ev['best_step']}"
    if ev.get("kept_best"):
        out += " (the saved model is that step's: --keep-best)"
    if ev.get("stopped_early"):
        out += f"; stopped early after step {ev['final_step']}"
    return out


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
    eval_data: Path | None = typer.Option(
        None,
        help="BEIR folder to evaluate on during training (split --eval-split); default: DATA "
        "when it is a BEIR folder and --eval-every, --keep-best or --early-stopping-patience "
        "is given.",
    ),
    on_bad_row: OnBadRow = ON_BAD_ROW_OPTION,
    nproc: int | None = typer.Option(
        None,
        help="Train with N processes on this machine (launches torchrun; one GPU each when "
        "the device is cuda, as auto picks on a GPU machine).",
    ),
    progress: bool = PROGRESS_OPTION,
    options: dict | None = None,
) -> None:
    """Fine-tune a retriever and save it in sentence-transformers format.

    Example: densefit train examples/scifact --output runs/scifact --batch-size 64 --memory auto

    Several GPUs: densefit train ... --device cuda --nproc 4, or
    torchrun --nproc-per-node 4 -m densefit train ... --device cuda (and across nodes).
    Ctrl-C prints the command that resumes from the last checkpoint.
    """
    from densefit.config import TrainConfig
    from densefit.models import apply_lora, load_model
    from densefit.training import distributed
    from densefit.training.evaluation import eval_data_for
    from densefit.training.loop import train as run_train
    from densefit.training.setup import check_output_dir

    config = TrainConfig(**(options or {}), show_progress=progress)
    check_output_dir(output, config, resume=bool(resume or resume_from), overwrite=overwrite)
    evaluate_on = eval_data_for(config, eval_data, data)
    world, main = _start_processes(config, nproc)
    examples, report = _read(data, on_bad_row, split)
    st_model = load_model(model, max_seq_length=config.max_seq_length, device=config.device)
    apply_lora(st_model, config)  # its errors before any line of output
    if main:
        scale_out = ""
        if world > 1:
            scale_out = (f"; global batch {config.batch_size} = {world} processes x "
                         f"{-(-config.batch_size // world)} rows at most, gather {config.gather}")  # fmt: skip
        err.print(
            f"training on {len(examples)} rows from {data} -> {output} on {config.device}"
            f"{lora_summary(config)}{scale_out}; "
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
            st_model,
            examples,
            config,
            output_dir=output,
            resume=resume_from or resume,
            overwrite=overwrite,
            eval_data=evaluate_on,
            data_report=report,
        )
    except KeyboardInterrupt:
        if main:
            raise _interrupted(output) from None
        raise typer.Exit(130) from None
    if world > 1:
        distributed.teardown_distributed()
    if main:
        err.print(_summary(result, output, config.device), highlight=False)


@train_options(lambda name, opt: opt.plan, required=("batch_size",))
def plan(
    data: Path = typer.Argument(..., help="Training data (the planner reads its real lengths)."),
    model: str = typer.Option("all-MiniLM-L6-v2", "--model", "-m", help="Model folder or name."),
    split: str = typer.Option("train", help="qrels split to read from a BEIR folder."),
    on_bad_row: OnBadRow = ON_BAD_ROW_OPTION,
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
    from densefit.models import apply_lora, load_model

    config = TrainConfig(**(options or {}), memory="auto")
    examples = _examples(data, on_bad_row, split)
    st_model = load_model(model, max_seq_length=config.max_seq_length, device=config.device)
    apply_lora(st_model, config)  # the planner counts the frozen weights once
    result = plan_memory(st_model, examples, config, batches=planned_batches(examples, config))
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), "device": config.device}, indent=2))
    else:
        typer.echo(result.table())
        typer.echo(f"planned for {config.device}{lora_summary(config)}")


def register(app: typer.Typer) -> None:
    """Add the ``train`` and ``plan`` commands to ``app``."""
    app.command("train")(train)
    app.command("plan")(plan)
