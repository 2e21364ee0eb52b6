"""The ``densefit`` command line: run | train | plan | mine | index | search | eval."""

from __future__ import annotations

import json
import os
import sys
import warnings
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console

from densefit.cli.common import OnBadRow, fail
from densefit.cli.index import register as register_retrieval_commands
from densefit.cli.run import register as register_run_command
from densefit.cli.serve import register as register_serve_command

app = typer.Typer(
    name="densefit",
    help=(
        "Fine-tune and serve dense retrievers (sentence-transformers bi-encoders) with "
        "batch size independent of memory.\n\n"
        "Examples:\n\n"
        "  densefit run examples/scifact.yaml --output runs/scifact\n\n"
        "  densefit train examples/scifact --model all-MiniLM-L6-v2 --output runs/m --batch-size 64\n\n"
        "  densefit plan data.jsonl --model all-MiniLM-L6-v2 --batch-size 4096 --memory-budget 8GiB"
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console(stderr=True)


class Loss(str, Enum):
    mnrl = "mnrl"
    margin_mse = "margin_mse"


class Memory(str, Enum):
    plain = "plain"
    checkpoint = "checkpoint"
    cache = "cache"
    cache_checkpoint = "cache+checkpoint"
    auto = "auto"


class Amp(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"


class Gather(str, Enum):
    none = "none"
    candidates = "candidates"
    both = "both"


def _launch_torchrun(nproc: int) -> None:
    """Re-run this very command under torchrun with ``nproc`` processes, without --nproc."""
    import subprocess

    argv = sys.argv[1:]
    if "train" not in argv:
        fail("--nproc: cannot find the train command in the command line; run "
             "torchrun --nproc-per-node N -m densefit train ... yourself")
    rest, skip = [], False
    for arg in argv[argv.index("train"):]:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "densefit", *rest]
    console.print(f"launching: {' '.join(cmd)}", highlight=False)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    raise typer.Exit(subprocess.call(cmd, env=env))




def _load(model: str, max_seq_length: int | None, trust_remote_code: bool = False):
    from densefit.models import ModelNotFoundError, load_model

    try:
        return load_model(model, max_seq_length=max_seq_length, trust_remote_code=trust_remote_code)
    except ModelNotFoundError as exc:
        fail(str(exc))


def _examples(data: Path, on_bad_row: str, split: str):
    from densefit.data.readers import load_training_examples
    from densefit.data.types import BadRowError

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = load_training_examples(data, on_bad_row=on_bad_row, split=split)
        for w in caught:
            console.print(f"[yellow]warning:[/] {w.message}", highlight=False)
        return rows
    except (BadRowError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))


def _print_warnings(caught) -> None:
    for w in caught:
        if issubclass(w.category, (UserWarning, RuntimeWarning)):
            console.print(f"[yellow]warning:[/] {w.message}", highlight=False)


@app.command()
def train(
    data: Path = typer.Argument(..., help="Training data: JSONL, CSV/TSV, Parquet or a BEIR folder."),
    model: str = typer.Option("all-MiniLM-L6-v2", "--model", "-m", help="Model folder or name."),
    output: Path = typer.Option(..., "--output", "-o", help="Where to save the trained model."),
    batch_size: int = typer.Option(32, help="Rows per step: every other row's texts are negatives. With several processes: the global batch, split across them."),
    epochs: int = typer.Option(1, help="Passes over the data."),
    max_steps: int | None = typer.Option(None, help="Stop after this many steps (overrides epochs)."),
    lr: float = typer.Option(2e-5, "--lr", help="Peak learning rate (AdamW)."),
    warmup: int | None = typer.Option(None, help="Warm-up steps (default: 10% of the steps)."),
    loss: Loss = typer.Option(Loss.mnrl, help="mnrl (in-batch + hard negatives) or margin_mse (needs score)."),
    scale: float = typer.Option(20.0, help="MNRL inverse temperature."),
    symmetric: bool = typer.Option(False, help="MNRL in both directions (query->doc, doc->query)."),
    memory: Memory = typer.Option(Memory.plain, help="Memory strategy; auto plans from --memory-budget."),
    memory_budget: str | None = typer.Option(None, help="For --memory auto: e.g. 8GiB, or 0.8 of free memory."),
    chunk_size: int | None = typer.Option(None, help="Rows per encoder chunk (cache strategies)."),
    token_budget: int | None = typer.Option(None, help="Padded tokens per encoder chunk."),
    loss_chunk_size: int | None = typer.Option(None, help="Anchors per block of the score matrix."),
    keep_graphs: int | None = typer.Option(
        None, help="Cache: chunks whose graphs are kept, not re-embedded (default 1: no extra memory)."
    ),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing", help="Recompute activations in backward."),
    grad_accum: int = typer.Option(1, help="Gradient accumulation steps (does NOT add negatives)."),
    amp: Amp | None = typer.Option(None, help="Mixed precision: bf16 (CPU/CUDA) or fp16 (CUDA)."),
    max_seq_length: int | None = typer.Option(None, help="Truncate texts to this many tokens."),
    seed: int = typer.Option(42, help="Random seed (data order, dropout)."),
    split: str = typer.Option("train", help="qrels split to read from a BEIR folder."),
    on_bad_row: OnBadRow = typer.Option(OnBadRow.error, help="error: stop at a bad row; skip: skip and report."),
    device: str | None = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: cpu)."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    mask_false_negatives: bool = typer.Option(True, help="Mask duplicate texts and known positives (by id) among the MNRL negatives."),
    no_duplicates: bool = typer.Option(False, "--no-duplicates", help="Batches without repeated texts (same number of batches)."),
    checkpoint_every: int | None = typer.Option(None, help="Checkpoint every N steps to OUTPUT/checkpoints (always at each epoch end)."),
    keep_checkpoints: int = typer.Option(2, help="How many of the newest checkpoints to keep; 0: write none."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from the newest good checkpoint in OUTPUT/checkpoints."),
    resume_from: Path | None = typer.Option(None, help="Continue from this checkpoint folder (OUTPUT/checkpoints/step-...)."),
    max_nonfinite: int = typer.Option(5, help="Stop after this many steps in a row with a non-finite loss or gradient (each is skipped); 0: never."),
    release_cpu_memory: bool = typer.Option(False, help="CPU under the system's glibc malloc (DENSEFIT_ALLOCATOR=system): return freed activations to the OS after each chunk (less memory, slower steps). Not needed under mimalloc, the default on Linux."),
    nproc: int | None = typer.Option(None, help="Train with N processes on this machine (launches torchrun; one GPU each with --device cuda)."),
    gather: Gather = typer.Option(Gather.candidates, help="Several processes: candidates = every device's texts are negatives for every anchor; both = anchors too, each device computes the whole loss; none = each device's rows only."),
) -> None:
    """Fine-tune a retriever and save it in sentence-transformers format.

    Example: densefit train examples/scifact --output runs/scifact --batch-size 64 --memory auto

    Several GPUs: densefit train ... --device cuda --nproc 4, or
    torchrun --nproc-per-node 4 -m densefit train ... --device cuda (and across nodes).
    """
    from densefit.training import distributed
    from densefit.config import TrainConfig

    if nproc is not None and nproc < 1:
        fail("--nproc must be >= 1")
    if nproc is not None and nproc > 1 and not distributed.launched_by_torchrun():
        _launch_torchrun(nproc)
    from densefit.training.loop import train as run_train

    try:
        config = TrainConfig(
            batch_size=batch_size, epochs=epochs, max_steps=max_steps, learning_rate=lr,
            warmup_steps=warmup, loss=loss.value, scale=scale, symmetric=symmetric,
            memory=memory.value, memory_budget=memory_budget, chunk_size=chunk_size,
            token_budget=token_budget, loss_chunk_size=loss_chunk_size, keep_graphs=keep_graphs,
            gradient_checkpointing=gradient_checkpointing, gradient_accumulation_steps=grad_accum,
            amp=amp.value if amp else None, max_seq_length=max_seq_length, seed=seed,
            mask_false_negatives=mask_false_negatives, no_duplicates=no_duplicates,
            device=device, show_progress=progress, release_cpu_memory=release_cpu_memory,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints, max_nonfinite=max_nonfinite, gather=gather.value,
        )
    except ValueError as exc:
        fail(str(exc))
    world, main = 1, True
    if distributed.launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        resolved = distributed.init_distributed(device)  # cuda -> cuda:LOCAL_RANK
        device = str(resolved)
        config.device = device
        world, main = distributed.world_size(), distributed.is_main_process()
    examples = _examples(data, on_bad_row.value, split)
    st_model = _load(model, max_seq_length)
    if device:
        st_model.to(device)
    if main:
        scale_out = ""
        if world > 1:
            scale_out = (f"; global batch {batch_size} = {world} processes x "
                         f"{-(-batch_size // world)} rows at most, gather {gather.value}")
        console.print(f"training on {len(examples)} rows from {data} -> {output}{scale_out}",
                      highlight=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            result = run_train(st_model, examples, config, output_dir=output, resume=resume_from or resume)
        except (ValueError, MemoryError, FloatingPointError) as exc:  # FloatingPointError: NaN
            _print_warnings(caught)  # e.g. which checkpoints were skipped as corrupt
            fail(str(exc))
    if world > 1:
        distributed.teardown_distributed()
    if not main:
        return
    _print_warnings(caught)
    plan = result.plan
    console.print(
        f"done: {result.steps} steps, {result.examples} examples in {result.seconds:.1f}s, "
        f"final loss {result.final_loss:.4f}; memory: {plan.get('strategy')} "
        f"(chunk {plan.get('chunk_size')}, tokens {plan.get('token_budget')}"
        + (f", {plan.get('keep_graphs')} kept graph(s)"
           if str(plan.get("strategy")).startswith("cache") else "")
        + (f", {plan['cpu_allocator']} malloc" if plan.get("cpu_allocator") else "")
        + "); "
        f"model saved to {output}, log {result.log_path}",
        highlight=False,
    )


@app.command()
def plan(
    data: Path = typer.Argument(..., help="Training data (the planner reads its real lengths)."),
    model: str = typer.Option("all-MiniLM-L6-v2", "--model", "-m"),
    batch_size: int = typer.Option(..., help="The batch size you want."),
    memory_budget: str | None = typer.Option(None, help="e.g. 8GiB; default 0.8 of free memory."),
    max_seq_length: int | None = typer.Option(None),
    epochs: int = typer.Option(1, help="Epochs of the run to plan for (its batches are known)."),
    max_steps: int | None = typer.Option(None),
    chunk_size: int | None = typer.Option(None, help="Rows per sub-batch / chunk to plan with."),
    symmetric: bool = typer.Option(False),
    seed: int = typer.Option(42),
    split: str = typer.Option("train"),
    on_bad_row: OnBadRow = typer.Option(OnBadRow.error),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Print the memory plan for a batch size and budget, with its predicted peak.

    Example: densefit plan data.jsonl --batch-size 4096 --memory-budget 8GiB
    """
    from densefit.config import TrainConfig
    from densefit.memory.planner import plan_memory

    config = TrainConfig(batch_size=batch_size, memory="auto", memory_budget=memory_budget,
                         max_seq_length=max_seq_length, symmetric=symmetric, epochs=epochs,
                         max_steps=max_steps, chunk_size=chunk_size, seed=seed)
    examples = _examples(data, on_bad_row.value, split)
    st_model = _load(model, max_seq_length)
    from densefit.training.loop import planned_batches

    try:
        result = plan_memory(st_model, examples, config,
                             batches=planned_batches(examples, config))
    except MemoryError as exc:
        fail(str(exc), code=3)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        typer.echo(result.table())


class MineMethod(str, Enum):
    bm25 = "bm25"
    dense = "dense"
    hybrid = "hybrid"


class Sampling(str, Enum):
    top = "top"
    random = "random"


@app.command()
def mine(
    pairs: Path = typer.Argument(..., help="(query, positive) pairs: a BEIR folder (its --split) or a training file."),
    corpus: Path = typer.Option(..., "--corpus", "-c", help="Documents to mine from: a corpus file or a BEIR folder."),
    output: Path = typer.Option(..., "--output", "-o", help="The mined rows (JSON Lines, read by densefit train)."),
    method: MineMethod = typer.Option(MineMethod.bm25, help="bm25, dense (the model's embeddings) or hybrid (both, rank-fused)."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model for dense and hybrid mining."),
    num_negatives: int = typer.Option(4, help="Negatives per row (1: question/pos_doc/neg_doc; more: anchor/positive/negative_1..k)."),
    range_: str = typer.Option("10:100", "--range", help="MIN:MAX: skip the MIN best non-positive candidates, look no deeper than MAX."),
    relative_margin: float | None = typer.Option(None, help="Skip candidates scoring above (1 - margin) x the positive's score, e.g. 0.05."),
    sampling: Sampling = typer.Option(Sampling.top, help="top: the hardest in range; random: a seeded sample of them."),
    batch_size: int = typer.Option(64, help="Encoder batch size (dense, hybrid)."),
    query_block: int = typer.Option(256, help="Queries searched at once (bounds the score memory)."),
    max_seq_length: int | None = typer.Option(None, help="Truncate texts to this many tokens (dense, hybrid)."),
    split: str = typer.Option("train", help="qrels split of a BEIR folder of pairs."),
    on_bad_row: OnBadRow = typer.Option(OnBadRow.error, help="error: stop at a bad row; skip: skip and report."),
    seed: int = typer.Option(42, help="Seed for --sampling random."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """Mine hard negatives for training pairs, skipping known positives (false negatives).

    Example: densefit mine scifact --corpus scifact --method bm25 --num-negatives 4 --range 10:100 --relative-margin 0.05 --output mined.jsonl
    """
    from densefit.data.types import BadRowError
    from densefit.mine import mine_files, parse_range

    try:
        range_min, range_max = parse_range(range_)
    except ValueError as exc:
        fail(str(exc))
    if method != MineMethod.bm25 and model is None:
        fail(f"--method {method.value} embeds the corpus: pass --model (e.g. --model all-MiniLM-L6-v2)")
    st_model = _load(model, max_seq_length) if method != MineMethod.bm25 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            report = mine_files(
                pairs, corpus, output, split=split, on_bad_row=on_bad_row.value,
                method=method.value, model=st_model, num_negatives=num_negatives,
                range_min=range_min, range_max=range_max, relative_margin=relative_margin,
                sampling=sampling.value, seed=seed, query_block=query_block,
                batch_size=batch_size, show_progress=progress,
            )
        except (BadRowError, ValueError, FileNotFoundError, ImportError) as exc:
            fail(str(exc))
    for w in caught:
        if issubclass(w.category, UserWarning):
            console.print(f"[yellow]warning:[/] {w.message}", highlight=False)
    console.print(f"wrote {output}: {report.summary()}", highlight=False)


register_retrieval_commands(app)  # index, search, eval
register_run_command(app)  # run: the whole pipeline
register_serve_command(app)  # serve: the HTTP service


# Commands that train: on Linux they re-run under mimalloc (see densefit.memory.allocator).
_TRAINING_COMMANDS = ("train", "run")


def main() -> None:
    """Entry point of the ``densefit`` script and ``python -m densefit``."""
    if len(sys.argv) > 1 and sys.argv[1] in _TRAINING_COMMANDS:
        from densefit.memory.allocator import rerun_with_mimalloc

        rerun_with_mimalloc()  # returns when not needed or not possible
    app(prog_name="densefit")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
