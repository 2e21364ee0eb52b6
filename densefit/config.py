"""Typed configuration: the one source of truth, saved as JSON beside every trained model.

Every :class:`TrainConfig` field is declared once, with its help text, its command-line flag,
its choices and its allowed range (an :class:`Option` in the field's metadata). Everything
else is derived from that declaration: the checks in ``TrainConfig.__post_init__`` (so the
Python API, the CLI and ``densefit run``'s YAML get the same ones), the ``densefit train`` and
``densefit plan`` options (:mod:`densefit.cli.train`), the ``train.*`` keys of ``densefit run``
(:mod:`densefit.pipeline.config`) and the options table of the README
(:func:`options_markdown`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from densefit.choices import (
    AMP,
    GATHER_MODES,
    LOSSES,
    MEMORY_STRATEGIES,
    SIMILARITIES,
    SOURCE_BATCHES,
    SOURCE_SAMPLING,
    TRACKERS,
    parse_metric,
)
from densefit.errors import OptionError

__all__ = [
    "Option",
    "OptionError",
    "TrainConfig",
    "auto_learning_rate",
    "check_device",
    "check_learning_rate",
    "check_memory_budget",
    "check_metric",
    "check_probability",
    "check_report_to",
    "config_options",
    "option_of",
    "options_markdown",
    "parse_bytes",
]

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


# ----------------------------------------------------------------------------- declaration


Choices = Sequence[Any] | Callable[[], Sequence[Any]]


@dataclass(frozen=True)
class Option:
    """How one TrainConfig field is offered and checked: declared once, read everywhere.

    ``flag`` is the click declaration (``--warmup``; booleans ``--symmetric/--no-symmetric``
    unless given a single flag such as ``--no-duplicates``). ``choices`` is a sequence or a
    function returning the registry it comes from (read lazily: no import cycle).
    ``ge``/``gt`` bound numbers; ``check`` is a function that raises ``ValueError`` for a bad
    value (its message completes "OPTION ..."). ``cli=False``: not a ``densefit train``
    option; ``plan=False``: not a ``densefit plan`` option.
    """

    help: str
    flag: str | None = None
    choices: Choices | None = None
    ge: float | None = None
    gt: float | None = None
    check: Callable[[Any], None] | None = None
    metavar: str | None = None
    cli: bool = True
    plan: bool = True

    def choice_list(self) -> tuple:
        """The allowed values (the registry's, read now), or ``()`` when any value goes."""
        if self.choices is None:
            return ()
        return tuple(self.choices() if callable(self.choices) else self.choices)

    def allowed(self) -> str:
        """What the option accepts, in words (for errors, help and docs)."""
        choices = self.choice_list()
        if choices:
            return ", ".join("null" if c is None else str(c) for c in choices)
        if self.gt is not None:
            return f"> {self.gt:g}"
        if self.ge is not None:
            return f">= {self.ge:g}"
        return self.metavar or ""


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field carrying its :class:`Option` in ``metadata["option"]``."""
    return field(default=default, metadata={"option": Option(help=help, **kwargs)})


def check_metric(value: str) -> str:
    """``value`` as a metric name of :mod:`densefit.evaluate` (``ndcg@10``), lower-cased;
    raises ``ValueError`` naming the supported ones.

    >>> check_metric("nDCG@10")
    'ndcg@10'
    """
    kind, k = parse_metric(str(value))
    return f"{kind}@{k}"


def _matryoshka_dims(value: str | list[int]) -> list[int]:
    from densefit.losses.matryoshka import check_dims

    return check_dims(value)


def _matryoshka_weights(value: str | list[float]) -> list[float]:
    from densefit.losses.matryoshka import check_weights

    return check_weights(value)


def check_memory_budget(value: str | int | float | None) -> None:
    """Raise ``ValueError`` unless ``value`` is a size (``8GiB``, bytes) or a share of the
    free memory (``0.8``, ``80%``), as :func:`densefit.memory.planner.resolve_budget` reads it.

    >>> check_memory_budget("80%"), check_memory_budget(0.5), check_memory_budget("8GiB")
    (None, None, None)
    """
    text = None if value is None else str(value).strip()
    if not text:
        return
    wanted = (
        "must be a memory size such as 8GiB or 512MiB, or a share of the free memory such as "
        "0.8 or 80%"
    )
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        try:
            size = parse_bytes(text)
        except ValueError:
            raise ValueError(f"{wanted}, got {value!r}") from None
        share = None if size > 0 else 0.0
    if share is not None and not (share > 0):
        raise ValueError(f"{wanted} (above 0), got {value!r}")
    if share is not None and 1 < share and text.endswith("%"):
        raise ValueError(f"{wanted} (100% at most), got {value!r}")


_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")


def check_device(device: str | None) -> str | None:
    """``device`` checked against this machine, ``auto`` resolved (cuda if present, else cpu).

    Raises ``ValueError`` naming the choices, or saying which device is not present.

    >>> check_device("cpu"), check_device(None)
    ('cpu', None)
    """
    if device is None:
        return None
    text = str(device).strip().lower()
    if not _DEVICE.fullmatch(text):
        raise ValueError(f"must be one of {', '.join(DEVICES)}, got {device!r}")
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(text.partition(":")[2] or 0)
        if count == 0:
            raise ValueError(f"is {text}, but torch sees no CUDA device here: use cpu or auto")
        if index >= count:
            raise ValueError(
                f"is {text}, but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
            )
    if text == "mps" and not torch.backends.mps.is_available():
        raise ValueError("is mps, but MPS is not available here: use cpu or auto")
    return text


def check_probability(value: float) -> None:
    """Raise ``ValueError`` unless ``value`` is below 1 (a dropout probability; >= 0 is
    checked by the option's range).

    >>> check_probability(0.1)
    """
    if not value < 1:
        raise ValueError(f"must be below 1, got {value!r}")


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


# ----------------------------------------------------------------------------- the config


@dataclass
class TrainConfig:
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
        "Rows per step: every other row's texts are in-batch negatives. With several "
        "processes: the global batch, split across them.",
        ge=1,
    )
    epochs: int = option(1, "Passes over the training data.", ge=1)
    max_steps: int | None = option(
        None, "Stop after this many steps (overrides epochs); default: epochs decide.", ge=1
    )
    learning_rate: float | str = option(
        "auto",
        "Peak learning rate (AdamW); auto: 2e-5 x batch size / 32, at most 2e-4 "
        "(see Choosing a batch size).",
        flag="--lr",
        check=check_learning_rate,
        metavar="auto/NUMBER",
    )
    warmup_steps: int | None = option(
        None, "Linear warm-up steps; default: 10% of the steps.", flag="--warmup", ge=0
    )
    weight_decay: float = option(0.01, "AdamW weight decay (not on biases and norms).", ge=0)
    max_grad_norm: float | None = option(
        1.0, "Clip the gradient norm to this; null: no clipping.", gt=0, plan=False
    )
    seed: int = option(42, "Seed of the data order and dropout.")
    loss: str = option(
        "mnrl",
        "mnrl (in-batch + hard negatives) or margin_mse (needs a teacher score per row).",
        choices=LOSSES,
    )
    scale: float = option(20.0, "MNRL inverse temperature.", gt=0)
    symmetric: bool = option(False, "MNRL in both directions (query->doc, doc->query).")
    similarity: str | None = option(
        None,
        "Score of two embeddings in the loss, saved with the model (sentence-transformers' "
        "similarity_fn_name) and used by the stores it indexes; default: the model's own "
        "(cosine when it names none).",
        choices=(None, *SIMILARITIES),
    )
    # Matryoshka and prompts
    matryoshka_dims: list[int] | str | None = option(
        None,
        "Matryoshka: sum the loss over the embeddings cut to each of these sizes and "
        "re-normalised (e.g. 384,256,128,64), so that truncated vectors work too; default: off.",
        check=_matryoshka_dims,
        metavar="D1,D2,...",
    )
    matryoshka_weights: list[float] | str | None = option(
        None,
        "Weight of each --matryoshka-dims size in the summed loss; default: 1 each.",
        check=_matryoshka_weights,
        metavar="W1,W2,...",
    )
    query_prompt: str | None = option(
        None,
        'Text put before every query (in training: the anchors), e.g. "query: "; a trained '
        'model saves it as its "query" prompt. Default: the model\'s own, else none; "" for none.',
        metavar="TEXT",
    )
    document_prompt: str | None = option(
        None,
        'Text put before every document (in training: positives, negatives), e.g. "passage: "; '
        'a trained model saves it as its "document" prompt. Default: the model\'s own, else '
        'none; "" for none.',
        metavar="TEXT",
    )
    amp: str | None = option(
        None,
        "Mixed precision; default: off (fp32). bf16: on a GPU faster steps and less "
        "activation memory; on a CPU less activation memory, faster only where the CPU has "
        "bf16 instructions (AVX-512 BF16/AMX). fp16: CUDA only, with loss scaling.",
        choices=AMP,
    )
    gradient_checkpointing: bool = option(
        False,
        "Recompute activations in backward (with memory plain).",
        flag="--gradient-checkpointing",
    )
    memory: str = option(
        "plain",
        "Memory strategy; auto: the planner picks one from the memory budget.",
        choices=(*MEMORY_STRATEGIES, "auto"),
        plan=False,
    )
    chunk_size: int | None = option(
        None, "Rows per encoder chunk (cache strategies); default: planned.", ge=1
    )
    token_budget: int | None = option(
        None, "Padded tokens per encoder chunk; default: planned.", ge=1
    )
    loss_chunk_size: int | None = option(
        None, "Anchors per block of the MNRL score matrix; default: automatic.", ge=1
    )
    # cache: chunks whose first-pass graphs are kept, not re-embedded (1 costs no memory)
    keep_graphs: int | None = option(
        None,
        "Cache: chunks whose graphs are kept instead of re-embedded (1 costs no memory); "
        "default: 1, or as many as the memory budget allows with memory auto.",
        ge=0,
    )
    memory_budget: str | float | None = option(
        None,
        "For memory auto: a size (8GiB) or a share of the free memory (0.8, 80%); "
        "default: 0.8 of the free memory.",
        check=check_memory_budget,
        metavar="SIZE|SHARE",
    )
    sort_by_length: bool = option(True, "Length-sorted chunks (less padding; changes no result).")
    invariant_dropout: bool = option(
        True,
        "Dropout masks keyed by row, not by chunk: the same loss and gradients under any "
        "memory plan, dropout on; off: PyTorch's own dropout (bench/results/dropout.json).",
    )
    # CPU under glibc's malloc: fix the mmap threshold and trim the heap after each chunk
    # (less activation memory for the cache, slower steps: bench/results/allocator.md). Off by
    # default; the CLI trains under mimalloc on Linux, which needs none of it.
    release_cpu_memory: bool = option(
        False,
        "CPU under the system's glibc malloc (DENSEFIT_ALLOCATOR=system): return freed "
        "activations to the OS after each chunk (less memory, slower steps). Not needed "
        "under mimalloc, the CLI's default on Linux.",
    )
    mask_false_negatives: bool = option(
        True, "Mask duplicate texts and known positives (by id) among the MNRL negatives."
    )
    no_duplicates: bool = option(
        False,
        "Regroup batches so that no text repeats within a batch (same number of batches).",
        flag="--no-duplicates",
    )
    max_seq_length: int | None = option(
        None,
        "Truncate texts to this many tokens; default: the model's own. Above the model's "
        "limit (its position embeddings) is an error.",
        ge=1,
    )
    gradient_accumulation_steps: int = option(
        1,
        "Micro-batches per step (does NOT add in-batch negatives; prefer memory auto).",
        flag="--grad-accum",
        ge=1,
    )
    drop_last: bool = option(False, "Drop the last, smaller batch of each epoch.")
    # several training sources (densefit.data.sources, densefit.data.batching)
    source_batches: str = option(
        "same",
        "Several training sources: same = every step's rows come from one source (its "
        "in-batch negatives from its own domain, as BGE, GTE and E5 train); mixed = the rows of "
        "all sources shuffled together. No effect with one source.",
        choices=SOURCE_BATCHES,
    )
    source_sampling: str = option(
        "proportional",
        "With --source-batches same, the order of the sources' steps: proportional = each "
        "source's steps spread at random over the epoch (every row once per epoch); "
        "round_robin = one step of each source in turn until the smallest has given all its "
        "rows (the same number of steps each); temperature = each step's source drawn with "
        "probability proportional to rows^(1/--source-temperature).",
        choices=SOURCE_SAMPLING,
    )
    source_temperature: float = option(
        2.0,
        "With --source-sampling temperature: 1 = in proportion to the sources' rows, larger "
        "values draw small sources more often (toward equal shares).",
        gt=0,
    )
    log_every: int = option(
        1, "Write a line to the training log (train_log.jsonl) every N steps.", ge=1, plan=False
    )
    device: str | None = option(
        "auto",
        "auto: the GPU (cuda) when torch sees one, else the CPU; or cpu, cuda, cuda:N, mps.",
        check=check_device,
        metavar="|".join(DEVICES),
    )
    # LoRA (peft, the optional extra `lora`): train low-rank adapters, the base weights frozen
    lora_r: int | None = option(
        None,
        "LoRA: train rank-R adapters instead of every weight (needs peft: pip install "
        "'densefit[lora]'); default: full fine-tuning.",
        ge=1,
        metavar="R",
    )
    lora_alpha: float | None = option(
        None, "LoRA scaling numerator (updates scaled by alpha/r); default: 2 x lora_r.", gt=0
    )
    lora_dropout: float = option(
        0.0, "LoRA: dropout on the adapters' input (0 to 1).", ge=0, check=check_probability
    )
    lora_target_modules: str | None = option(
        None,
        "LoRA: comma-separated module names to adapt (query,value) or all-linear; default: "
        "peft's choice for the architecture (BERT: query,value).",
        metavar="NAMES",
    )
    save_adapter: bool = option(
        False,
        "LoRA: save only the adapter (PEFT format) instead of the merged model.",
        flag="--save-adapter",
        plan=False,
    )
    show_progress: bool = option(True, "Show progress bars.", cli=False, plan=False)
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
    )
    checkpoint_every: int | None = option(
        None,
        "Checkpoint every N steps (and at each epoch end) so that an interrupted run resumes; "
        "default: at epoch ends only.",
        ge=1,
        plan=False,
    )
    keep_checkpoints: int = option(
        2, "How many of the newest checkpoints to keep; 0: write none.", ge=0, plan=False
    )
    max_nonfinite: int = option(
        5,
        "Stop after this many steps in a row with a non-finite loss or gradient (each is "
        "skipped); 0: never.",
        ge=0,
        plan=False,
    )
    gather: str = option(
        "candidates",
        "Several processes: candidates = every device's texts are negatives for every anchor; "
        "both = anchors too, each device computes the whole loss; none = each device's rows only.",
        choices=GATHER_MODES,
        plan=False,
    )

    # evaluation during training
    eval_every: int | None = option(
        None,
        "Evaluate on --eval-data every N steps (also at step 0 and at each epoch end); "
        "default: at step 0 and epoch ends, when evaluation is on.",
        ge=1,
        plan=False,
    )
    eval_split: str = option(
        "dev", "qrels split of --eval-data evaluated during training.", plan=False
    )
    eval_metric: str = option(
        "ndcg@10",
        "Metric that picks the best step (ndcg@K, mrr@K, recall@K, map@K, precision@K).",
        check=check_metric,
        plan=False,
    )
    eval_max_docs: int | None = option(
        None,
        "Search every judged document plus random others (seeded by --seed), N documents "
        "in all, so an evaluation takes seconds; default: the whole corpus.",
        ge=1,
        plan=False,
    )
    keep_best: bool = option(
        False,
        "Save the evaluated step with the best --eval-metric as the model, not the last step.",
        flag="--keep-best",
        plan=False,
    )
    early_stopping_patience: int | None = option(
        None, "Stop after N evaluations in a row without a better --eval-metric.", ge=1, plan=False
    )

    def __post_init__(self) -> None:
        for f, opt in config_options():
            setattr(self, f.name, check_value(f.name, opt, getattr(self, f.name)))

    @property
    def peak_learning_rate(self) -> float:
        """The learning rate the run uses: ``learning_rate``, or the auto rule's value
        (:func:`auto_learning_rate` of ``batch_size``) when it is ``"auto"``."""
        if self.learning_rate == "auto":
            return auto_learning_rate(self.batch_size)
        return float(self.learning_rate)

    def to_dict(self) -> dict:
        """Every field by name (JSON-ready)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, ignore_extra: bool = False) -> TrainConfig:
        """Build from a mapping of field names; unknown keys are an error unless
        ``ignore_extra`` (e.g. what :meth:`save` adds: versions, steps, the memory plan).

        >>> TrainConfig.from_dict({"batch_size": 8, "steps": 3}, ignore_extra=True).batch_size
        8
        """
        known = {f.name for f in fields(cls)}
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


# ----------------------------------------------------------------------------- derived


def config_options() -> list[tuple[dataclasses.Field, Option]]:
    """(field, option) of every TrainConfig field, in declaration order."""
    return [(f, f.metadata["option"]) for f in fields(TrainConfig)]


def option_of(name: str) -> Option:
    """The :class:`Option` declared for the TrainConfig field ``name``."""
    return _options_by_name()[name]


@functools.cache
def _options_by_name() -> dict[str, Option]:
    return {f.name: opt for f, opt in config_options()}


@functools.cache
def field_types() -> dict[str, Any]:
    """Each field's type hint (``int | None`` ...), resolved."""
    return typing.get_type_hints(TrainConfig)


def flag_declaration(name: str) -> str:
    """The click declaration of field ``name``'s flag: the declared one, else ``--x`` (a
    boolean: ``--x/--no-x``).
    """
    declared = option_of(name).flag
    if declared:
        return declared
    flag = "--" + name.replace("_", "-")
    return f"{flag}/--no-{flag[2:]}" if field_types()[name] is bool else flag


def flag_of(name: str) -> str:
    """The CLI flag of field ``name`` (the first of ``--x/--no-x``), named in errors."""
    return flag_declaration(name).split("/")[0]


def check_value(name: str, opt: Option, value: Any) -> Any:
    """``value`` checked against ``opt``'s choices, range and check; raises :class:`OptionError`.

    Returns the value to store (``device="auto"`` becomes the device it names here).
    """

    def bad(requirement: str) -> OptionError:
        requirement = requirement.replace("{", "{{").replace("}", "}}")
        return OptionError(name, "{option} " + requirement, flag=flag_of(name))

    choices = opt.choice_list()
    if choices and value not in choices:
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        raise bad(f"must be one of {shown}, got {value!r}")
    if value is None or isinstance(value, bool):
        return value
    bounded = opt.ge is not None or opt.gt is not None
    if bounded and not isinstance(value, (int, float)):
        raise bad(f"must be {_type_words(field_types().get(name, float))}, got {value!r}")
    if opt.ge is not None and not value >= opt.ge:
        raise bad(f"must be >= {opt.ge:g}, got {value!r}")
    if opt.gt is not None and not value > opt.gt:
        raise bad(f"must be > {opt.gt:g}, got {value!r}")
    if opt.check is not None:
        try:
            checked = opt.check(value)
        except ValueError as exc:
            raise bad(str(exc)) from None
        return value if checked is None else checked
    return value


def _type_words(hint: Any) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "text"}
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    words = " or ".join(names.get(a, getattr(a, "__name__", str(a))) for a in args)
    return words + (" or null" if type(None) in typing.get_args(hint) else "")


def iter_option_rows() -> Iterator[dict[str, str]]:
    """One row per TrainConfig field: key, flag, default, allowed values, help."""
    for f, opt in config_options():
        default = f.default if isinstance(f.default, str) else json.dumps(f.default)
        yield {
            "key": f.name,
            "flag": flag_declaration(f.name) if opt.cli else "",
            "type": _type_words(field_types()[f.name]),
            "default": default,
            "allowed": opt.allowed(),
            "help": opt.help,
        }


def options_markdown() -> str:
    """The training options as a Markdown table (YAML key, CLI flag, default, allowed, meaning).

    The README's table is this function's output (``densefit options --markdown``).
    """
    lines = [
        "| `train.` key | `densefit train` flag | default | allowed | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in iter_option_rows():
        flag = f"`{row['flag']}`" if row["flag"] else ""
        allowed = row["allowed"] or row["type"]
        lines.append(
            f"| `train.{row['key']}` | {flag} | {row['default']} | {allowed} | {row['help']} |"
        )
    return "\n".join(lines) + "\n"
