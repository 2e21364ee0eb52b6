"""``densefit mine``: added to the Typer app by :func:`register`."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from densefit.cli.common import (
    DOCUMENT_PROMPT_OPTION,
    ENCODE_BATCH_OPTION,
    ON_BAD_ROW_OPTION,
    PROGRESS_OPTION,
    QUERY_PROMPT_OPTION,
    OnBadRow,
    device_option,
    err,
)

__all__ = ["mine", "register"]


class MineMethod(str, Enum):
    bm25 = "bm25"
    dense = "dense"
    hybrid = "hybrid"


class Sampling(str, Enum):
    top = "top"
    random = "random"


def mine(
    pairs: Path = typer.Argument(
        ..., help="(query, positive) pairs: a BEIR folder (its --split) or a training file."
    ),
    corpus: Path = typer.Option(
        ..., "--corpus", "-c", help="Documents to mine from: a corpus file or a BEIR folder."
    ),
    output: Path = typer.Option(
        ..., "--output", "-o", help="The mined rows (JSON Lines, read by densefit train)."
    ),
    method: MineMethod = typer.Option(
        MineMethod.bm25, help="bm25, dense (the model's embeddings) or hybrid (both, rank-fused)."
    ),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Model for dense and hybrid mining."
    ),
    num_negatives: int = typer.Option(
        4,
        help="Negatives per row (1: question/pos_doc/neg_doc; more: anchor/positive/"
        "negative_1..k).",
    ),
    range_: str = typer.Option(
        "10:100",
        "--range",
        help="MIN:MAX: skip the MIN best non-positive candidates, look no deeper than MAX.",
    ),
    relative_margin: float | None = typer.Option(
        None, help="Skip candidates scoring above (1 - margin) x the positive's score, e.g. 0.05."
    ),
    sampling: Sampling = typer.Option(
        Sampling.top, help="top: the hardest in range; random: a seeded sample of them."
    ),
    batch_size: int = ENCODE_BATCH_OPTION,
    query_block: int = typer.Option(
        256, help="Queries searched at once (bounds the score memory)."
    ),
    max_seq_length: int | None = typer.Option(
        None,
        help="Truncate texts to this many tokens (dense, hybrid); above the model's limit "
        "is an error.",
    ),
    split: str = typer.Option("train", help="qrels split of a BEIR folder of pairs."),
    on_bad_row: OnBadRow = ON_BAD_ROW_OPTION,
    seed: int = typer.Option(42, help="Seed for --sampling random."),
    progress: bool = PROGRESS_OPTION,
    query_prompt: str | None = QUERY_PROMPT_OPTION,
    document_prompt: str | None = DOCUMENT_PROMPT_OPTION,
    device: str = device_option(),
) -> None:
    """Mine hard negatives for training pairs, skipping known positives (false negatives).

    Example: densefit mine scifact --corpus scifact --method bm25 --num-negatives 4 --range 10:100 --relative-margin 0.05 --output mined.jsonl
    """  # noqa: E501
    from densefit.mine import mine_files, parse_range
    from densefit.models import load_model, resolve_device
    from densefit.prompts import set_prompts

    device = resolve_device(device)
    range_min, range_max = parse_range(range_)
    st_model = None
    if method != MineMethod.bm25:
        if model is None:
            raise ValueError(
                f"--method {method.value} embeds the corpus: pass --model "
                "(e.g. --model all-MiniLM-L6-v2)"
            )
        st_model = load_model(model, max_seq_length=max_seq_length, device=device)
        set_prompts(st_model, query=query_prompt, document=document_prompt)
    report = mine_files(
        pairs, corpus, output, split=split, on_bad_row=on_bad_row.value,
        method=method.value, model=st_model, num_negatives=num_negatives,
        range_min=range_min, range_max=range_max, relative_margin=relative_margin,
        sampling=sampling.value, seed=seed, query_block=query_block,
        batch_size=batch_size, show_progress=progress,
    )  # fmt: skip
    err.print(f"wrote {output}: {report.summary()}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add the ``mine`` command to ``app``."""
    app.command("mine")(mine)
