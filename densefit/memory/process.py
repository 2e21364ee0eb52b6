"""What the whole process holds before training: the part of a memory budget the planner
does not probe.

A memory budget is a promise about the process, not about the training step: a user sets
it to the container's limit, and the kernel kills the process, not the step. So the
planner predicts the process's peak as

    peak = held now + still to come + what a step adds (activations, loss, embeddings)

where *held now* is measured when the plan is made (on CPU the resident set: interpreter,
torch, transformers and the tokenizer, the model, the data, the planner's own tokenised
lengths and probe), and *still to come* is what training allocates once and keeps: the
gradients, AdamW's two moments, and the weights a memory-mapped checkpoint has not paged
in yet. On CUDA the budget is the device's memory (``torch.cuda.max_memory_allocated``)
and *held now* is ``torch.cuda.memory_allocated``; host memory is not budgeted there.

Where the memory of a CPU run goes, phase by phase, is measured in
bench/results/budget_phases.txt (bench/budget_phases.py): most of what is held before
training is the interpreter and its libraries; the weights are mapped from the safetensors
file and paged in by the first forward pass; the first optimizer step adds the two AdamW
moments, which land in the memory the step's activations just freed, so the second step's
activations need that much fresh memory.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass

import psutil
import torch

__all__ = [
    "STEP_SETUP_BYTES",
    "ProcessBaseline",
    "peak_rss_bytes",
    "process_baseline",
    "resident_bytes",
    "unread_mapped_bytes",
]

# What the first training step adds besides its tensors: pages the allocator holds for the
# step's tensor sizes (small blocks share pages by size class, and a page serves one size
# until it is wholly free), and the backward pass's one-time setup (the planner's probe runs
# forward only). On the tiny model it outweighs the activations (tests/test_budget.py holds
# the prediction to the measured peak there, under glibc and mimalloc); with the real model
# it is within the activation headroom (bench/results/budget.md). Under mimalloc the pages a
# step frees are given back after a delay, later when another process keeps the CPU busy:
# 32 MiB was exceeded by 4.4 MiB in two of about ten runs of that test beside a second busy
# test worker, so the allowance is 40.
STEP_SETUP_BYTES = 40 * 2**20


def _status_bytes(key: str) -> int | None:
    """A size line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; None without /proc."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """Resident set size of this process now (``VmRSS``; psutil where /proc is missing).

    >>> resident_bytes() > 0
    True
    """
    found = _status_bytes("VmRSS")
    if found is not None:
        return found

    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started its program (``VmHWM``).

    Not ``getrusage``'s ``ru_maxrss``: on Linux that survives ``execve``, so a process that
    a large parent spawned with ``vfork`` (Python's ``subprocess`` does) or that re-ran itself
    (the CLI under mimalloc) would report the parent's or its earlier self's peak.

    >>> peak_rss_bytes() >= resident_bytes() // 2
    True
    """
    found = _status_bytes("VmHWM")
    if found is not None:
        return found

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _file_mappings() -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of each file-backed mapping of this process (Linux)."""
    out: list[tuple[int, int, int]] = []
    current = None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split()
                if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header
                    start, end = (int(x, 16) for x in head[0].split("-"))
                    current = [start, end, 0] if head[4] != "0" else None  # inode 0: anonymous
                    if current is not None:
                        out.append(current)  # Rss filled in below
                elif current is not None and head[0] == "Rss:":
                    current[2] = int(head[1]) * 1024
    except OSError:
        return []
    return [tuple(m) for m in out]


def unread_mapped_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of file-mapped mappings holding ``tensors`` that are not resident yet.

    Weights loaded from safetensors are mapped from the file and paged in when first read;
    each page counts once (the first optimizer step copies it to anonymous memory, and the
    file page leaves the process). Tensors in ordinary memory count as resident: 0 here.

    >>> unread_mapped_bytes([torch.zeros(4)])
    0
    """
    mappings = _file_mappings()
    if not mappings:
        return 0
    holding: dict[int, tuple[int, int, int]] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
            continue
        ptr = t.untyped_storage().data_ptr()
        for m in mappings:
            if m[0] <= ptr < m[1]:
                holding[m[0]] = m
                break
    return sum(max(0, end - start - rss) for start, end, rss in holding.values())


@dataclass
class ProcessBaseline:
    """The bytes a training process holds besides its activations, for the planner.

    ``held_bytes`` is measured now; the rest is what training will allocate and keep.
    """

    device: str
    held_bytes: int  # CPU: resident set now; CUDA: torch.cuda.memory_allocated
    unread_weight_bytes: int  # mapped weights not yet paged in (they will be)
    gradient_bytes: int  # one gradient per trainable parameter, allocated by backward
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq, allocated by the first step
    step_setup_bytes: int = 0  # allocator pages and one-time backward setup (CPU)

    @property
    def total_bytes(self) -> int:
        """What the process will hold before a step's activations: the planner's base."""
        return (
            self.held_bytes
            + self.unread_weight_bytes
            + self.gradient_bytes
            + self.optimizer_bytes
            + self.step_setup_bytes
        )

    def to_dict(self) -> dict:
        """The fields and ``total_bytes`` (for plans, logs and reports)."""
        return {**asdict(self), "total_bytes": self.total_bytes}

    @classmethod
    def from_dict(cls, data: dict) -> ProcessBaseline:
        """Back from :meth:`to_dict` (``total_bytes`` is derived, not stored)."""
        return cls(**{k: v for k, v in data.items() if k != "total_bytes"})

    def describe(self) -> str:
        """One line for the plan table: where the base of the prediction comes from."""
        mib = 2**20
        held = "resident now" if self.device == "cpu" else "allocated on the device now"
        return (
            f"process {self.total_bytes / mib:,.0f} MiB before activations: "
            f"{self.held_bytes / mib:,.0f} {held} (interpreter, libraries, model, data)"
            + (
                f" + {self.unread_weight_bytes / mib:,.0f} weights not paged in yet"
                if self.unread_weight_bytes
                else ""
            )
            + f" + {self.gradient_bytes / mib:,.0f} gradients"
            + f" + {self.optimizer_bytes / mib:,.0f} AdamW"
            + (
                f" + {self.step_setup_bytes / mib:,.0f} allocator pages and backward setup"
                if self.step_setup_bytes
                else ""
            )
        )


def process_baseline(
    model: torch.nn.Module,
    device: torch.device | str | None = None,
    *,
    held_bytes: int | None = None,
) -> ProcessBaseline:
    """Measure what the process holds now and add what training will allocate and keep.

    Call it once the model and data are loaded (the planner does, after its probe). The
    gradients and AdamW's moments have the parameters' dtype; parameters that already
    have a gradient or optimizer state are counted anyway (a bound, not an estimate).
    ``held_bytes`` replaces the measurement and the step setup: the caller says what the
    process holds besides the step's tensors (tests of the planner's choices pin it).

    >>> from densefit.testing import tiny_model
    >>> base = process_baseline(tiny_model(), "cpu")
    >>> base.total_bytes > base.held_bytes > 0
    True
    """
    device = torch.device(device or next(model.parameters()).device)
    params = list(model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    if device.type == "cuda":
        held = torch.cuda.memory_allocated(device) if held_bytes is None else held_bytes
        unread = 0
    else:
        held = resident_bytes() if held_bytes is None else held_bytes
        unread = unread_mapped_bytes(params) if os.name == "posix" else 0
    return ProcessBaseline(
        device=device.type,
        held_bytes=int(held),
        unread_weight_bytes=int(unread),
        gradient_bytes=trainable,
        optimizer_bytes=2 * trainable,
        step_setup_bytes=STEP_SETUP_BYTES if device.type == "cpu" and held_bytes is None else 0,
    )
