"""Typed configuration: the one source of truth, saved as JSON beside every trained model."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

__all__ = ["TrainConfig", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20,
          "G": 2**30, "T": 2**40}


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
    unit = s[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(f"cannot read memory size {text!r}: write e.g. 8GiB, 512MiB or 2GB")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot read memory size {text!r}: write e.g. 8GiB, 512MiB or 2GB") from None
    return int(value * _UNITS[unit])


@dataclass
class TrainConfig:
    """Everything that decides a training run.

    >>> TrainConfig(batch_size=64, loss="mnrl").batch_size
    64
    """

    batch_size: int = 32
    epochs: int = 1
    max_steps: int | None = None
    learning_rate: float = 2e-5
    warmup_steps: int | None = None  # None: 10% of the steps
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    seed: int = 42
    loss: str = "mnrl"  # mnrl | margin_mse
    scale: float = 20.0  # MNRL inverse temperature
    symmetric: bool = False
    similarity: str = "cos"
    amp: str | None = None  # None | bf16 | fp16
    gradient_checkpointing: bool = False
    memory: str = "plain"  # plain | checkpoint | cache | cache+checkpoint | auto
    chunk_size: int | None = None  # rows per encoder chunk
    token_budget: int | None = None  # padded tokens per encoder chunk
    loss_chunk_size: int | None = None  # anchors per block of the MNRL score matrix
    # cache: chunks whose first-pass graphs are kept, not re-embedded (1 costs no memory);
    # None: 1, or as many as memory_budget allows with --memory auto
    keep_graphs: int | None = None
    memory_budget: str | None = None  # e.g. "8GiB", for --memory auto
    sort_by_length: bool = True
    # dropout masks keyed by (step, column, row, module, position), not by chunk: the same loss
    # and gradients under any memory plan (densefit.memory.dropout). On by default: no
    # measurable CPU cost (bench/results/dropout.json); False: PyTorch's own dropout
    invariant_dropout: bool = True
    # CPU under glibc's malloc: fix the mmap threshold and trim the heap after each chunk
    # (less activation memory for the cache, slower steps: bench/results/allocator.md). Off by
    # default; the CLI trains under mimalloc on Linux, which needs none of it.
    release_cpu_memory: bool = False
    mask_false_negatives: bool = True  # mask duplicates / known positives in MNRL
    no_duplicates: bool = False  # batches without repeated texts (same count and sizes)
    max_seq_length: int | None = None
    gradient_accumulation_steps: int = 1
    drop_last: bool = False
    log_every: int = 1
    device: str | None = None
    show_progress: bool = True
    checkpoint_every: int | None = None  # steps; checkpoints are also written at epoch ends
    keep_checkpoints: int = 2  # 0: write no checkpoints
    max_nonfinite: int = 5  # stop after this many non-finite steps in a row; 0: never
    gather: str = "candidates"  # several processes: none | candidates | both (densefit.training.distributed)

    def __post_init__(self) -> None:
        checks = [
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.epochs >= 1, "epochs must be >= 1"),
            (self.max_steps is None or self.max_steps >= 1, "max_steps must be >= 1"),
            (self.learning_rate > 0, "learning rate must be > 0"),
            (self.loss in ("mnrl", "margin_mse"), f"loss must be mnrl or margin_mse, not {self.loss!r}"),
            (self.amp in (None, "bf16", "fp16"), f"amp must be bf16 or fp16, not {self.amp!r}"),
            (self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1"),
            (self.checkpoint_every is None or self.checkpoint_every >= 1,
             "checkpoint_every must be >= 1 (or None: only at epoch ends)"),
            (self.keep_checkpoints >= 0, "keep_checkpoints must be >= 0 (0: no checkpoints)"),
            (self.max_nonfinite >= 0, "max_nonfinite must be >= 0 (0: never stop)"),
            (self.gather in ("none", "candidates", "both"),
             f"gather must be none, candidates or both, not {self.gather!r}"),
            (self.memory in ("plain", "checkpoint", "cache", "cache+checkpoint", "auto"),
             f"memory must be plain, checkpoint, cache, cache+checkpoint or auto, not {self.memory!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training options: {', '.join(unknown)}")
        return cls(**data)

    def save(self, path: str | Path, **extra) -> None:
        Path(path).write_text(json.dumps({**self.to_dict(), **extra}, indent=2, default=str))
