"""The training options (:class:`TrainConfig`), saved as JSON beside every trained model.

Each field is declared once with :func:`~densefit.config.options.option`; ``densefit
train`` and ``densefit plan`` offer them as flags, ``densefit run`` as the keys of its
``train:`` section, and the Python API (``train(model, examples, TrainConfig(...))``) checks
them the same way (:mod:`densefit.config.options`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densefit.choices import (
    AMP,
    EXPORT_TARGETS,
    GATHER_MODES,
    LOSSES,
    MEMORY_STRATEGIES,
    SIMILARITIES,
    SOURCE_BATCHES,
    SOURCE_SAMPLING,
    TRACKERS,
    TRAINING_EVAL_RUNTIMES,
    parse_metric,
)
from densefit.config.options import Options, declared_options, default_of, flag_of, option
from densefit.config.shared import (
    DEVICE,
    DOCUMENT_PROMPT,
    MAX_SEQ_LENGTH,
    PROGRESS,
    QUERY_PROMPT,
    SEED,
)
from densefit.errors import OptionError

__all__ = [
    "AUTO_LR_BASE",
    "AUTO_LR_BATCH",
    "AUTO_LR_MAX",
    "MemoryBudget",
    "TrainConfig",
    "auto_learning_rate",
    "check_dims",
    "check_learning_rate",
    "check_metric",
    "check_probability",
    "check_report_to",
    "check_weights",
    "parse_bytes",
    "parse_memory_budget",
    "record_training_data",
    "training_data_record",
]

# ----------------------------------------------------------------------------- memory sizes

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20,
          "G": 2**30, "T": 2**40}  # fmt: skip


def parse_bytes(text: str | int | float) -> int:
    """Parse a memory size such as ``8GiB``, ``512MB`` or ``1.5G`` into bytes.

    >>> parse_bytes("8GiB")
    8589934592
    >>> parse_bytes("500MB")
    500000000
    """
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    unit = s[len(number) :]
    message = f"cannot read memory size {text!r}: write e.g. 8GiB, 512MiB or 2GB"
    if unit not in _UNITS or not number:
        raise ValueError(message)
    try:
        value = float(number)
    except ValueError:
        raise ValueError(message) from None
    return int(value * _UNITS[unit])


@dataclass(frozen=True)
class MemoryBudget:
    """A memory budget: a size in bytes, or a share of the memory free when the run plans."""

    size: int | None = None
    share: float | None = None

    def bytes_of(self, free: int) -> int:
        """The budget in bytes when ``free`` bytes are free."""
        return self.size if self.size is not None else int(free * (self.share or 0.8))


def parse_memory_budget(value: str | int | float | None) -> MemoryBudget:
    """The one reading of ``--memory-budget``: a size (``8GiB``, ``512MB``, or a whole number
    of bytes above 1), or a share of the free memory (``0.8``, ``80%``); ``None``: 0.8 of it.
    Anything else is a ``ValueError`` saying what to write.

    >>> parse_memory_budget("80%"), parse_memory_budget(0.5), parse_memory_budget("8GiB").size
    (MemoryBudget(size=None, share=0.8), MemoryBudget(size=None, share=0.5), 8589934592)
    >>> parse_memory_budget(None).share
    0.8
    """
    wanted = (
        "must be a memory size such as 8GiB or 512MiB, or a share of the free memory such as "
        "0.8 or 80%"
    )
    text = None if value is None else str(value).strip()
    if not text:
        return MemoryBudget(share=0.8)
    if isinstance(value, bool):
        raise ValueError(f"{wanted}, got {value!r}")
    try:
        number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        try:
            size = parse_bytes(text)
        except ValueError:
            raise ValueError(f"{wanted}, got {value!r}") from None
        if size <= 0:
            raise ValueError(f"{wanted} (above 0), got {value!r}") from None
        return MemoryBudget(size=size)
    if not number > 0 or math.isinf(number):
        raise ValueError(f"{wanted} (above 0), got {value!r}")
    if number <= 1:
        return MemoryBudget(share=number)
    if text.endswith("%"):
        raise ValueError(f"{wanted} (100% at most), got {value!r}")
    if number != int(number):
        raise ValueError(f"{wanted}: a share is at most 1, a number of bytes whole, got {value!r}")
    return MemoryBudget(size=int(number))


def _check_memory_budget(value: Any) -> None:
    parse_memory_budget(value)  # the value is kept as given (it is saved and compared)


def check_report_to(value: str | Sequence[str] | None) -> list[str] | None:
    """The experiment trackers named by ``value`` (``"tensorboard,mlflow"``, a list, or
    ``none``), in the order given, each once; None for none. Raises ``ValueError`` naming the
    supported ones.

    >>> check_report_to("tensorboard, mlflow"), check_report_to("none"), check_report_to([])
    (['tensorboard', 'mlflow'], None, None)
    """
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(item).strip().lower() for item in items if str(item).strip()]
    if names in ([], ["none"]):
        return None
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(
            f"must name trackers among {', '.join(TRACKERS)} (comma-separated) or none, got "
            f"{unknown[0]!r}"
        )
    return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------- learning rate

# learning_rate "auto": the rule below. Evidence and limits: bench/results/batch_size.md
# (manpages, SciFact; all-MiniLM-L6-v2) and the README's "Choosing a batch size".
AUTO_LR_BASE = 2e-5  # the peak learning rate at AUTO_LR_BATCH
AUTO_LR_BATCH = 32
AUTO_LR_MAX = 2e-4  # no batch size gets more


def auto_learning_rate(batch_size: int) -> float:
    """The peak learning rate that ``learning_rate="auto"`` (the default) uses at ``batch_size``.

    2e-5 at batch 32, scaled linearly with the batch size, at most 2e-4 (reached at batch
    320): a batch B times bigger takes B times fewer optimizer steps over the same data, and
    a proportionally larger step makes up for it. On manpages this made batch 512 better
    than batch 32 where the fixed 2e-5 and the square-root rule fell short
    (bench/results/batch_size.md).

    >>> [auto_learning_rate(b) for b in (4, 32, 128, 320, 512, 4096)]
    [2.5e-06, 2e-05, 8e-05, 0.0002, 0.0002, 0.0002]
    """
    rate = min(AUTO_LR_MAX, AUTO_LR_BASE * batch_size / AUTO_LR_BATCH)
    return float(f"{rate:.3g}")  # 3 significant digits: as printed, logged and saved


def check_learning_rate(value: str | float) -> str | float:
    """``"auto"``, or a number > 0 (``"3e-5"`` from a flag or YAML becomes ``3e-05``).

    >>> check_learning_rate("3e-5"), check_learning_rate("AUTO")
    (3e-05, 'auto')
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be auto or a number > 0 such as 3e-5, got {value!r}") from None
    if isinstance(value, bool) or not number > 0 or math.isinf(number):
        raise ValueError(f"must be auto or a number > 0 such as 3e-5, got {value!r}")
    return number


def check_probability(value: float) -> None:
    """Raise ``ValueError`` unless ``value`` is below 1 (a dropout probability; >= 0 is
    checked by the option's range).

    >>> check_probability(0.1)
    """
    if not value < 1:
        raise ValueError(f"must be below 1, got {value!r}")


def check_metric(value: str) -> str:
    """``value`` as a metric name (``ndcg@10``), lower-cased; ``ValueError`` naming the
    supported ones.

    >>> check_metric("nDCG@10")
    'ndcg@10'
    """
    kind, k = parse_metric(str(value))
    return f"{kind}@{k}"


def check_dims(dims: Sequence[int] | str) -> list[int]:
    """``dims`` as distinct positive integers, in the order given; text ``"384,256"`` is read too.

    Raises ``ValueError`` saying what is wrong.

    >>> check_dims("384, 128,64")
    [384, 128, 64]
    """
    if isinstance(dims, str):
        parts = [p.strip() for p in dims.split(",") if p.strip()]
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            raise ValueError(
                f"must be embedding sizes separated by commas, e.g. 384,256,128,64; got {dims!r}"
            ) from None
    values = [int(d) for d in dims]
    if not values or any(d < 1 for d in values) or len(set(values)) != len(values):
        raise ValueError(f"must be distinct sizes >= 1, e.g. 384,256,128,64; got {list(dims)!r}")
    return values


def check_weights(weights: Sequence[float] | str) -> list[float]:
    """``weights`` as numbers >= 0 (not all 0); text ``"1,1,0.5"`` is read too.

    >>> check_weights("1, 0.5")
    [1.0, 0.5]
    """
    if isinstance(weights, str):
        try:
            weights = [float(p) for p in weights.split(",") if p.strip()]
        except ValueError:
            raise ValueError(
                f"must be numbers separated by commas, e.g. 1,1,1,1; got {weights!r}"
            ) from None
    values = [float(w) for w in weights]
    if not values or any(not w >= 0 for w in values) or not any(values):
        raise ValueError(f"must be numbers >= 0, not all 0; got {list(weights)!r}")
    return values


# ----------------------------------------------------------------------------- the config

_BATCH = "Batch and schedule"
_LOSS = "Loss"  # the model card lists this group's values beside the loss
_MATRYOSHKA = "Matryoshka"
_MEMORY = "Memory"
_LORA = "LoRA"
_RUN = "Checkpoints and logs"
_EVAL = "Evaluation during training"
_SOURCES = "Several sources"


@dataclass(kw_only=True)
class TrainConfig(Options):
    """Everything that decides a training run; each field declares its help, flag and range.

    >>> TrainConfig(batch_size=64, loss="mnrl").batch_size
    64
    >>> TrainConfig(warmup_steps=-5)
    Traceback (most recent call last):
    ...
    densefit.errors.OptionError: warmup_steps must be >= 0, got -5
    """

    batch_size: int = option(
        32,
        "Rows per optimizer step: every other row's texts are in-batch negatives. With several "
        "processes: the global batch, split across them.",
        ge=1,
        group=_BATCH,
        run_flag=True,
    )
    epochs: int = option(1, "Passes over the training data.", ge=1, group=_BATCH, run_flag=True)
    max_steps: int | None = option(
        None,
        "Stop after this many steps (overrides epochs); default: epochs decide.",
        ge=1,
        group=_BATCH,
        run_flag=True,
    )
    learning_rate: float | str = option(
        "auto",
        "Peak learning rate (AdamW); auto: 2e-5 x batch size / 32, at most 2e-4 "
        "(see Choosing a batch size).",
        flag="--lr",
        check=check_learning_rate,
        metavar="auto|NUMBER",
        group=_BATCH,
        run_flag=True,
    )
    warmup_steps: int | None = option(
        None,
        "Linear warm-up steps; default: 10% of the steps.",
        flag="--warmup",
        ge=0,
        group=_BATCH,
    )
    weight_decay: float = option(
        0.01, "AdamW weight decay (not on biases and norms).", ge=0, group=_BATCH
    )
    max_grad_norm: float | None = option(
        1.0, "Clip the gradient norm to this; null: no clipping.", gt=0, plan=False, group=_BATCH
    )
    seed: int = SEED()
    gradient_accumulation_steps: int = option(
        1,
        "Micro-batches per step (does NOT add in-batch negatives; prefer memory auto).",
        flag="--grad-accum",
        ge=1,
        group=_BATCH,
    )
    drop_last: bool = option(False, "Drop the last, smaller batch of each epoch.", group=_BATCH)
    no_duplicates: bool = option(
        False,
        "Regroup batches so that no text repeats within a batch (same number of batches).",
        flag="--no-duplicates",
        group=_BATCH,
    )
    # several training sources (densefit.data.sources, densefit.data.batching)
    source_batches: str = option(
        "same",
        "Several training sources: same = every step's rows come from one source (its "
        "in-batch negatives from its own domain, as BGE, GTE and E5 train); mixed = the rows of "
        "all sources shuffled together. No effect with one source.",
        choices=SOURCE_BATCHES,
        group=_SOURCES,
    )
    source_sampling: str = option(
        "proportional",
        "With --source-batches same, the order of the sources' steps: proportional = each "
        "source's steps spread at random over the epoch (every row once per epoch); "
        "round_robin = one step of each source in turn until the smallest has given all its "
        "rows (the same number of steps each); temperature = each step's source drawn with "
        "probability proportional to rows^(1/--source-temperature).",
        choices=SOURCE_SAMPLING,
        group=_SOURCES,
    )
    source_temperature: float = option(
        2.0,
        "With --source-sampling temperature: 1 = in proportion to the sources' rows, larger "
        "values draw small sources more often (toward equal shares).",
        gt=0,
        group=_SOURCES,
    )
    loss: str = option(
        "mnrl",
        "mnrl (in-batch + hard negatives) or margin_mse (needs a teacher score per row).",
        choices=LOSSES,
        group=_LOSS,
    )
    scale: float = option(20.0, "MNRL inverse temperature.", gt=0, group=_LOSS)
    symmetric: bool = option(
        False, "MNRL in both directions (query->doc, doc->query).", group=_LOSS
    )
    similarity: str | None = option(
        None,
        "Score of two embeddings in the loss, saved with the model (sentence-transformers' "
        "similarity_fn_name) and used by the stores it indexes; default: the model's own "
        "(cosine when it names none).",
        choices=(None, *SIMILARITIES),
        group=_LOSS,
    )
    mask_false_negatives: bool = option(
        True,
        "Mask duplicate texts and known positives (by id) among the MNRL negatives.",
        group=_LOSS,
    )
    matryoshka_dims: list[int] | str | None = option(
        None,
        "Matryoshka: sum the loss over the embeddings cut to each of these sizes and "
        "re-normalised (e.g. 384,256,128,64), so that truncated vectors work too; default: off.",
        check=check_dims,
        metavar="D1,D2,...",
        group=_MATRYOSHKA,
    )
    matryoshka_weights: list[float] | str | None = option(
        None,
        "Weight of each --matryoshka-dims size in the summed loss; default: 1 each.",
        check=check_weights,
        metavar="W1,W2,...",
        group=_MATRYOSHKA,
    )
    query_prompt: str | None = QUERY_PROMPT()
    document_prompt: str | None = DOCUMENT_PROMPT()
    max_seq_length: int | None = MAX_SEQ_LENGTH()
    device: str | None = DEVICE()
    amp: str | None = option(
        None,
        "Mixed precision; default: off (fp32). bf16: on a GPU faster steps and less "
        "activation memory; on a CPU less activation memory, faster only where the CPU has "
        "bf16 instructions (AVX-512 BF16/AMX). fp16: CUDA only, with loss scaling.",
        choices=AMP,
        group="Device",
    )
    memory: str = option(
        "auto",
        "Memory strategy; auto: the planner picks one (plain when it fits) from the memory budget.",
        choices=(*MEMORY_STRATEGIES, "auto"),
        plan=False,
        memory=True,
        affects_weights=False,
        group=_MEMORY,
    )
    memory_budget: str | float | None = option(
        None,
        "For memory auto: a size (8GiB) or a share of the free memory (0.8, 80%); "
        "default: 0.8 of the free memory.",
        check=_check_memory_budget,
        metavar="SIZE|SHARE",
        memory=True,
        affects_weights=False,
        run_flag=True,
        group=_MEMORY,
    )
    gradient_checkpointing: bool = option(
        False,
        "Recompute activations in backward: memory plain becomes checkpoint, and memory auto "
        "plans with the strategies that recompute only.",
        flag="--gradient-checkpointing",
        memory=True,
        affects_weights=False,
        group=_MEMORY,
    )
    chunk_size: int | None = option(
        None,
        "Rows per encoder chunk (cache strategies); default: planned.",
        ge=1,
        memory=True,
        affects_weights=False,
        group=_MEMORY,
    )
    token_budget: int | None = option(
        None,
        "Padded tokens per encoder chunk; default: planned.",
        ge=1,
        memory=True,
        affects_weights=False,
        group=_MEMORY,
    )
    loss_block_size: int | None = option(
        None,
        "Anchors per block of the MNRL score matrix; default: automatic.",
        ge=1,
        memory=True,
        affects_weights=False,
        group=_MEMORY,
    )
    # cache: chunks whose first-pass graphs are kept, not re-embedded (1 costs no memory)
    keep_graphs: int | None = option(
        None,
        "Cache: chunks whose graphs are kept instead of re-embedded (1 costs no memory); "
        "default: 1, or as many as the memory budget allows with memory auto.",
        ge=0,
        memory=True,
        affects_weights=False,
        group=_MEMORY,
    )
    sort_by_length: bool = option(
        True,
        "Length-sorted chunks (less padding; changes no result).",
        memory=True,
        affects_weights=False,
        group=_MEMORY,
    )
    invariant_dropout: bool = option(
        True,
        "Dropout masks keyed by row, not by chunk: the same loss and gradients under any "
        "memory plan, dropout on; off: PyTorch's own dropout (bench/results/dropout.json).",
        group=_MEMORY,
    )
    # CPU under glibc's malloc: fix the mmap threshold and trim the heap after each chunk
    # (less activation memory for the cache, slower steps: bench/results/allocator.md). Off by
    # default; the CLI trains under mimalloc on Linux, which needs none of it.
    release_cpu_memory: bool = option(
        False,
        "CPU under the system's glibc malloc (DENSEFIT_ALLOCATOR=system): return freed "
        "activations to the OS after each chunk (less memory, slower steps). Not needed "
        "under mimalloc, the CLI's default on Linux.",
        affects_weights=False,
        group=_MEMORY,
    )
    # LoRA (peft, the optional extra `lora`): train low-rank adapters, the base weights frozen
    lora_r: int | None = option(
        None,
        "LoRA: train rank-R adapters instead of every weight (needs peft: pip install "
        "'densefit[lora]'); default: full fine-tuning.",
        ge=1,
        metavar="R",
        group=_LORA,
    )
    lora_alpha: float | None = option(
        None,
        "LoRA scaling numerator (updates scaled by alpha/r); default: 2 x lora_r.",
        gt=0,
        group=_LORA,
    )
    lora_dropout: float = option(
        0.0,
        "LoRA: dropout on the adapters' input (0 to 1).",
        ge=0,
        check=check_probability,
        group=_LORA,
    )
    lora_target_modules: str | None = option(
        None,
        "LoRA: comma-separated module names to adapt (query,value) or all-linear; default: "
        "peft's choice for the architecture (BERT: query,value).",
        metavar="NAMES",
        group=_LORA,
    )
    save_adapter: bool = option(
        False,
        "LoRA: save only the adapter (PEFT format) instead of the merged model.",
        flag="--save-adapter",
        plan=False,
        group=_LORA,
    )
    gather: str = option(
        "candidates",
        "Several processes: candidates = every device's texts are negatives for every anchor; "
        "both = anchors too, each device computes the whole loss; none = each device's rows only.",
        choices=GATHER_MODES,
        plan=False,
        group="Several processes",
    )
    show_progress: bool = PROGRESS()
    log_every: int = option(
        1,
        "Write a line to the training log (train_log.jsonl) every N steps.",
        ge=1,
        plan=False,
        affects_weights=False,
        group=_RUN,
    )
    checkpoint_every: int | None = option(
        50,
        "Checkpoint every N steps (and at each epoch end) so that an interrupted run resumes; "
        "null: at epoch ends only.",
        ge=1,
        plan=False,
        affects_weights=False,
        group=_RUN,
    )
    keep_checkpoints: int = option(
        2,
        "How many of the newest checkpoints to keep while training; 0: write none.",
        ge=0,
        plan=False,
        affects_weights=False,
        group=_RUN,
    )
    delete_checkpoints: bool = option(
        True,
        "Delete the checkpoints once training has finished (they only serve to resume an "
        "interrupted run; a MiniLM checkpoint is ~270 MB); --no-delete-checkpoints keeps them.",
        plan=False,
        affects_weights=False,
        group=_RUN,
    )
    report_to: list[str] | str | None = option(
        None,
        "Send each step's record (loss, lr, grad norm, step time, memory, batch health), the "
        "evaluations, the resolved config and the memory plan to these trackers, "
        "comma-separated: tensorboard (OUTPUT/tensorboard), mlflow ($MLFLOW_TRACKING_URI, "
        "default file:OUTPUT/mlruns), wandb ($WANDB_MODE=offline works without a network); "
        "each needs its extra (pip install 'densefit[tensorboard]'...). Default: none.",
        check=check_report_to,
        metavar="TRACKERS",
        plan=False,
        affects_weights=False,
        group=_RUN,
    )
    max_nonfinite: int = option(
        5,
        "Stop after this many steps in a row with a non-finite loss or gradient (each is "
        "skipped); 0: never.",
        ge=0,
        plan=False,
        affects_weights=False,
        group=_RUN,
    )
    eval_every: int | None = option(
        None,
        "Evaluate on --eval-data every N steps (also at step 0 and at each epoch end); "
        "default: at step 0 and epoch ends, when evaluation is on.",
        ge=1,
        plan=False,
        group=_EVAL,
    )
    eval_split: str = option(
        "dev", "qrels split of --eval-data evaluated during training.", plan=False, group=_EVAL
    )
    eval_metric: str = option(
        "ndcg@10",
        "Metric that picks the best step (ndcg@K, mrr@K, recall@K, map@K, precision@K).",
        check=check_metric,
        plan=False,
        group=_EVAL,
    )
    eval_max_docs: int | None = option(
        None,
        "Search every judged document plus random others (seeded by --seed), N documents "
        "in all, so an evaluation takes seconds; default: the whole corpus.",
        ge=1,
        plan=False,
        group=_EVAL,
    )
    keep_best: bool = option(
        False,
        "Save the evaluated step with the best --eval-metric as the model, not the last step.",
        flag="--keep-best",
        plan=False,
        group=_EVAL,
    )
    early_stopping_patience: int | None = option(
        None,
        "Stop after N evaluations in a row without a better --eval-metric.",
        ge=1,
        plan=False,
        group=_EVAL,
    )
    eval_runtime: str = option(
        "auto",
        "What runs the model in each evaluation: auto (torch: no export matches weights "
        "that change every step), torch, or onnx / openvino (the current weights exported "
        "in memory at each evaluation, seconds; scores as torch does).",
        choices=TRAINING_EVAL_RUNTIMES,
        plan=False,
        affects_weights=False,
        group=_EVAL,
    )
    export: str | None = option(
        None,
        "When the model is saved, export it for an inference runtime into OUTPUT (as "
        "densefit export --to KIND does): onnx, onnx-int8, openvino, openvino-int8; the "
        "export's check runs on the training data's texts and a file that ranks differently "
        "is not kept (a warning with the numbers).",
        choices=(None, *EXPORT_TARGETS),
        metavar="KIND",
        plan=False,
        affects_weights=False,
        group=_RUN,
    )

    def check(self) -> None:
        """Rules between options, checked when the config is built (before any model loads)."""
        dims, weights = self.matryoshka_dims, self.matryoshka_weights
        if weights is not None and not dims:
            raise self.error("matryoshka_weights", "needs --matryoshka-dims (the sizes it weighs)")
        if weights is not None and len(weights) != len(dims):
            raise self.error(
                "matryoshka_weights",
                f"has {len(weights)} weight(s) for {len(dims)} --matryoshka-dims: give one "
                "weight per size",
            )
        if self.export is not None and self.save_adapter:
            raise self.error(
                "export",
                "needs the whole model saved; --save-adapter saves the LoRA adapter only: "
                "drop one of them",
            )
        if self.lora_r is None:
            stray = [
                flag_of(TrainConfig, name)
                for name in ("lora_alpha", "lora_dropout", "lora_target_modules", "save_adapter")
                if getattr(self, name) != default_of(TrainConfig, name)
            ]
            if stray:
                raise OptionError(
                    "lora_r",
                    f"{', '.join(stray)} configure LoRA, which is off: add {{option}} R "
                    "(e.g. 16), or drop them",
                    flag="--lora-r",
                )

    @property
    def peak_learning_rate(self) -> float:
        """The learning rate the run uses: ``learning_rate``, or the auto rule's value
        (:func:`auto_learning_rate` of ``batch_size``) when it is ``"auto"``."""
        if self.learning_rate == "auto":
            return auto_learning_rate(self.batch_size)
        return float(self.learning_rate)

    @property
    def effective_lora_alpha(self) -> float | None:
        """The LoRA scaling numerator the run uses: ``lora_alpha``, default 2 x ``lora_r``."""
        if self.lora_r is None:
            return None
        return float(self.lora_alpha) if self.lora_alpha is not None else 2.0 * self.lora_r

    def weight_options(self) -> dict:
        """The options that change the trained weights (declared ``affects_weights``): what a
        resume or a rerun into the same folder must keep, and ``densefit run``
        fingerprints."""
        return {
            f.name: getattr(self, f.name)
            for f, opt in declared_options(type(self))
            if opt.affects_weights
        }

    @classmethod
    def from_dict(cls, data: dict, *, ignore_extra: bool = False) -> TrainConfig:
        """Build from a mapping of field names; unknown keys are an error unless
        ``ignore_extra`` (e.g. what :meth:`save` adds: versions, steps, the memory plan).

        >>> TrainConfig.from_dict({"batch_size": 8, "steps": 3}, ignore_extra=True).batch_size
        8
        """
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown and not ignore_extra:
            raise ValueError(f"unknown training options: {', '.join(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """Read the ``densefit_config.json`` that :meth:`save` wrote (a file or its folder);
        ``overrides`` replace fields, e.g. ``device="cpu"`` for a model trained on a GPU.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "densefit_config.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls.from_dict({**data, **overrides}, ignore_extra=True)

    def save(self, path: str | Path, **extra: Any) -> None:
        """Write the fields and ``extra`` (versions, results) as JSON to ``path``."""
        Path(path).write_text(json.dumps({**self.to_dict(), **extra}, indent=2, default=str))


TRAINING_DATA = "training_data"  # densefit_config.json's record of where the data came from


def record_training_data(folder: str | Path, paths: Sequence[str | Path], split: str) -> None:
    """Add to a trained model folder's ``densefit_config.json`` where its training data is
    (absolute paths, and the split a BEIR folder was read at): ``densefit export`` checks a
    quantized file on those texts when given no ``--calibration``. A folder without the file
    (no model saved) is left alone.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> TrainConfig().save(folder / "densefit_config.json")
    >>> record_training_data(folder, ["/data/pairs.jsonl"], "train")
    >>> training_data_record(folder)
    {'paths': ['/data/pairs.jsonl'], 'split': 'train'}
    """
    path = Path(folder) / "densefit_config.json"
    if not path.is_file():  # not saved: nothing to add to
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    data[TRAINING_DATA] = {"paths": [str(Path(p).resolve()) for p in paths], "split": split}
    path.write_text(json.dumps(data, indent=2, default=str))


def training_data_record(folder: str | Path) -> dict | None:
    """``{"paths": [...], "split": ...}`` as :func:`record_training_data` wrote it in the model
    folder ``folder``; None when it records none (a model densefit did not train, or trained
    on rows in memory)."""
    path = Path(folder) / "densefit_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    record = data.get(TRAINING_DATA) if isinstance(data, dict) else None
    return record if isinstance(record, dict) and record.get("paths") else None
