"""The automatic memory planner: pick the fastest strategy and chunk that fit a budget.

It probes the model on the data's real length distribution:

- CPU: the bytes the forward pass saves for backward (``saved_tensors_hooks``), at two
  sequence lengths, fitted to ``rows * (a*L + b*L^2)`` (the L^2 term is attention);
- CUDA: ``torch.cuda.max_memory_allocated`` around a forward and backward.

and adds what does not depend on the batch: parameters, gradients and AdamW's two moments.
Then the fastest candidate that fits: ``plain`` when the whole batch fits (in length-sorted
sub-batches of 16 rows, else of 8: smaller sub-batches trim more padding); else
``checkpoint`` or ``cache`` with the largest chunk that fits (chunks are capped in padded
tokens, so a chunk of long texts never exceeds the plan; with the run's batches known,
each chunk budget is costed by the largest chunk those batches really make), keeping as
many chunk graphs from the cache's first pass as the rest of the budget holds (those chunks
are not re-embedded); else ``cache+checkpoint``. Costs are relative step times measured on CPU (below).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from sentence_transformers import SentenceTransformer

from densefit.config import TrainConfig, parse_bytes
from densefit.data.types import TrainingExample
from densefit.memory.allocator import returning_freed_memory
from densefit.memory.chunking import group_rows, tokenize
from densefit.memory.process import ProcessBaseline, process_baseline
from densefit.memory.strategies import DEFAULT_SUB_BATCH
from densefit.models import (
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
    is_checkpointing,
    transformer_of,
)

__all__ = [
    "MemoryPlan",
    "ActivationModel",
    "plan_memory",
    "saved_bytes",
    "resolve_budget",
    "auto_loss_chunk",
]

# Score-matrix blocks above this many elements are computed in blocks of anchors.
_LOSS_BLOCK_ELEMENTS = 2**20  # 4 MiB of fp32 scores per block: the loss stays small next to a chunk


def auto_loss_chunk(batch_size: int, n_negatives: int = 0) -> int | None:
    """Anchors per score block so a block holds at most ~1M scores (None: no blocking).

    >>> auto_loss_chunk(64) is None, auto_loss_chunk(8192)
    (True, 128)
    """
    candidates = batch_size + n_negatives
    if batch_size * candidates <= _LOSS_BLOCK_ELEMENTS:
        return None
    return max(1, _LOSS_BLOCK_ELEMENTS // candidates)

# Relative cost of one step, in forward-pass units (plain: a forward and a backward ~ 3).
# Measured on CPU (bench/results/memory_speed.md, batches 32-128, 3 steps, SciFact@128 and
# pydoc@256): checkpointing 1.3-1.5x plain, the cache re-embedding every chunk 1.15-1.5x;
# each chunk whose graph the cache keeps is not re-embedded: with one
# kept chunk (no extra memory) 0.9-1.3x plain. A kept share s of the padded tokens saves
# _RECOMPUTE * s.
_RELATIVE_TIME = {"plain": 3.0, "checkpoint": 4.5, "cache": 4.5, "cache+checkpoint": 6.0}
_RECOMPUTE = 1.5
# Backward briefly holds activation gradients next to the saved tensors: keep headroom.
# Measured (bench/results/memory_speed.md, all-MiniLM-L6-v2 on CPU, batches 16-256): a
# training step's peak RSS above the model and optimizer is 1.15-1.27x the bytes saved for
# backward (activation gradients, transient attention scores, the optimizer step).
_HEADROOM = 1.35
# On CPU a gradient-cache chunk larger than this many rows (at the longest length) runs no
# faster (same benchmark): the planner leaves the rest of the budget unused there.
_CPU_MAX_CHUNK_ROWS = 32


def saved_bytes(fn, *, exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the distinct tensors ``fn()`` saves for backward (parameters excluded).

    >>> lin = torch.nn.Linear(4, 4)
    >>> x = torch.randn(8, 4, requires_grad=True)
    >>> saved_bytes(lambda: lin(x).relu().sum(), exclude=list(lin.parameters())) > 0
    True
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        # Detached: a saved output returned as itself would hold its own grad_fn in a cycle
        # through C++ that Python's GC cannot see; every probe leaked its activations.
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


@dataclass
class ActivationModel:
    """Activation bytes of one row of ``L`` tokens: ``a*L + b*L*L`` (fitted by a probe)."""

    per_token: float
    per_token_squared: float

    def bytes(self, rows: int, length: int) -> float:
        return rows * (self.per_token * length + self.per_token_squared * length * length)


@dataclass
class MemoryPlan:
    """The planner's decision and the numbers behind it."""

    strategy: str
    chunk_size: int | None
    token_budget: int | None
    loss_chunk_size: int | None
    batch_size: int
    budget_bytes: int
    predicted_peak_bytes: int
    static_bytes: int
    fits: bool
    reason: str
    lengths: dict = field(default_factory=dict)
    candidates: list[dict] = field(default_factory=list)
    chosen_by: str = "planner"
    process: dict = field(default_factory=dict)  # densefit.memory.process.ProcessBaseline
    keep_graphs: int = 1  # cache: chunks whose first-pass graphs are kept (not re-embedded)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        gib = 2**30
        lines = [
            f"batch size {self.batch_size}, budget {self.budget_bytes / gib:.2f} GiB for the "
            f"whole process; {ProcessBaseline.from_dict(self.process).describe()}"
            if self.process else f"batch size {self.batch_size}, budget "
            f"{self.budget_bytes / gib:.2f} GiB",
            f"{'strategy':<18}{'chunk':>8}{'tokens/chunk':>14}{'kept':>6}{'peak GiB':>10}"
            f"{'rel. time':>11}  fits",
        ]
        for c in self.candidates:
            lines.append(
                f"{c['strategy']:<18}{str(c['chunk_size'] or '-'):>8}"
                f"{str(c['token_budget'] or '-'):>14}{str(c.get('keep_graphs') or '-'):>6}"
                f"{c['peak_bytes'] / gib:>10.2f}{c.get('relative_time', 0):>11.2f}  "
                f"{'yes' if c['fits'] else 'no'}"
            )
        kept = f", {self.keep_graphs} graph(s) kept" if self.strategy.startswith("cache") else ""
        lines.append(
            f"-> {self.strategy}"
            + (f", chunk {self.chunk_size} rows / {self.token_budget} tokens{kept}"
               if self.chunk_size else "")
            + f", predicted peak {self.predicted_peak_bytes / gib:.2f} GiB: {self.reason}"
        )
        return "\n".join(lines)


def resolve_budget(budget: str | int | None, device: torch.device) -> int:
    """Bytes from ``8GiB``-style sizes, or a fraction (``0.8`` / ``80%``) of free memory."""
    text = None if budget is None else str(budget).strip()
    fraction = 0.8
    if text:
        if text.endswith("%"):
            fraction = float(text[:-1]) / 100
        else:
            try:
                value = float(text)
            except ValueError:
                return parse_bytes(text)
            if value > 1:
                return int(value)
            fraction = value
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    import psutil

    return int(psutil.virtual_memory().available * fraction)


def _release_freed_memory() -> None:
    """Give the probe's freed buffers back to the OS (glibc keeps them otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _static_bytes(model: torch.nn.Module) -> int:
    """Parameters + gradients + AdamW exp_avg and exp_avg_sq (all fp32)."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return n * 4 * 4 + frozen


def _token_lengths(model: SentenceTransformer, texts: list[str], block: int = 1024) -> list[int]:
    """Token length of each text after the model's own truncation (tokenised in blocks)."""
    out: list[int] = []
    for i in range(0, len(texts), block):
        out += tokenize(model, texts[i : i + block])["attention_mask"].sum(1).tolist()
    return out


@dataclass
class _RowLengths:
    """Token lengths per row: anchors, positives, and each row's negatives."""

    anchors: list[int]
    positives: list[int]
    negatives: list[list[int]]
    exact: bool  # every row measured (else a sample)

    def column(self, name: str) -> list[int]:
        if name == "negatives":
            return [n for row in self.negatives for n in row]
        return getattr(self, name)


def _row_lengths(
    model: SentenceTransformer, examples: Sequence[TrainingExample], limit: int, seed: int
) -> _RowLengths:
    exact = len(examples) <= limit
    rows = list(examples) if exact else random.Random(seed).sample(list(examples), limit)
    negs = _token_lengths(model, [n for r in rows for n in r.negatives])
    per_row, at = [], 0
    for r in rows:
        per_row.append(negs[at : at + len(r.negatives)])
        at += len(r.negatives)
    return _RowLengths(
        _token_lengths(model, [r.query for r in rows]),
        _token_lengths(model, [r.positive for r in rows]),
        per_row,
        exact,
    )


def probe_activations(model: SentenceTransformer, max_length: int, rows: int = 4) -> ActivationModel:
    """Fit ``a*L + b*L^2`` bytes per row from forward probes at two lengths (train mode)."""
    device = model.device
    lengths = sorted({max(2, max_length // 2), max(4, max_length)})
    measured = []
    was_training = model.training
    model.train()
    params = list(model.parameters())
    vocab = getattr(transformer_of(model).config, "vocab_size", 1000)
    template = tokenize(model, ["x"] * rows)
    for length in lengths:
        generator = torch.Generator().manual_seed(length)
        low = 1000 if vocab > 2000 else 5  # skip special tokens
        features = {k: v for k, v in template.items() if not isinstance(v, torch.Tensor)}
        features["input_ids"] = torch.randint(low, vocab, (rows, length), generator=generator).to(device)
        features["attention_mask"] = torch.ones(rows, length, dtype=torch.long, device=device)
        if "token_type_ids" in template:
            features["token_type_ids"] = torch.zeros(rows, length, dtype=torch.long, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            out = model(features)["sentence_embedding"]
            out.float().pow(2).sum().backward()
            torch.cuda.synchronize(device)
            used = torch.cuda.max_memory_allocated(device) - before
            model.zero_grad(set_to_none=True)
        else:
            used = saved_bytes(lambda f=features: model(f)["sentence_embedding"], exclude=params)
        measured.append((length, used / rows))
    model.train(was_training)
    if len(measured) == 1:
        length, per_row = measured[0]
        return ActivationModel(per_row / length, 0.0)
    (l1, m1), (l2, m2) = measured
    # Solve m = a*L + b*L^2 through both points; keep both coefficients non-negative.
    b = max(0.0, (m2 / l2 - m1 / l1) / (l2 - l1))
    a = max(0.0, m1 / l1 - b * l1)
    if a == 0.0 and b == 0.0:
        a = max(m1 / l1, m2 / l2)
    return ActivationModel(a, b)


def plan_memory(
    model: SentenceTransformer,
    examples: Sequence[TrainingExample],
    config: TrainConfig,
    *,
    batches: Sequence[Sequence[int]] | None = None,
    exact_limit: int = 200_000,
    activation_model: ActivationModel | None = None,
    held_bytes: int | None = None,
) -> MemoryPlan:
    """Choose strategy and chunk for ``config.batch_size`` within ``config.memory_budget``.

    ``batches`` are the row indices of every forward-backward the run will do (the trainer
    passes them: the data order is seeded, so it is known in advance). With up to
    ``exact_limit`` rows every text is tokenised and ``plain`` is planned for the largest
    batch the run will actually see, chunked exactly as training will chunk it. Beyond
    that, or without ``batches``, it plans for the worst batch the data could produce (the
    longest texts of a sample). Cached chunks are capped in padded tokens, so they fit
    whatever the batch holds. Either way the plan holds for the whole run.

    The budget is for the whole process (:mod:`densefit.memory.process`): the predicted
    peak is what the process holds once the probe has run (``held_bytes`` pins it) plus
    gradients, AdamW and the step's activations.
    """
    device = torch.device(config.device or model.device)
    budget = resolve_budget(config.memory_budget, device)
    if config.max_seq_length is not None:
        model.max_seq_length = config.max_seq_length
    if not examples:
        raise ValueError("cannot plan memory: the training data has no rows")
    lengths = _row_lengths(model, examples, exact_limit, config.seed)
    columns = {c: lengths.column(c) for c in ("anchors", "positives", "negatives")}
    columns = {c: v for c, v in columns.items() if v}
    cap = int(getattr(model, "max_seq_length", 0) or max(max(v) for v in columns.values()))
    longest = {k: min(cap, max(v)) for k, v in columns.items()}
    if activation_model is None:
        was_checkpointing = is_checkpointing(model)
        disable_gradient_checkpointing(model)
        # The probe runs dropout: keep the run's random stream untouched by it.
        # its freed buffers go back to the OS: the process's resident set is then what it holds
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                returning_freed_memory():
            activation_model = probe_activations(model, max(longest.values()))
        if was_checkpointing:
            enable_gradient_checkpointing(model)
        _release_freed_memory()
    act = activation_model

    B = config.batch_size
    negs_per_row = len(columns.get("negatives", [])) / max(1, len(lengths.anchors))
    n_candidates = B + int(math.ceil(B * negs_per_row))
    get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    dim = int(get_dim() or 768)
    static = _static_bytes(model)
    process = process_baseline(model, device, held_bytes=held_bytes)
    hidden = int(getattr(transformer_of(model).config, "hidden_size", dim))
    layers = int(getattr(transformer_of(model).config, "num_hidden_layers", 12))

    def loss_bytes(loss_chunk: int | None) -> int:
        block = B if loss_chunk is None else min(B, loss_chunk)
        # scores, softmax and its gradient for one block of anchors x all candidates
        return int(3 * 4 * block * n_candidates * (2 if config.symmetric else 1))

    loss_chunk = config.loss_chunk_size or auto_loss_chunk(B, n_candidates - B)
    if config.loss_chunk_size is None and loss_bytes(loss_chunk) > 0.05 * budget:
        # keep the score blocks to a small share of a tight budget
        loss_chunk = max(1, int(0.05 * budget / (3 * 4 * n_candidates)))
    embeddings = 2 * 4 * dim * (B + n_candidates)  # values + cached grads
    # plain / checkpoint sub-batches: the user's, else the default, then half of it (a
    # smaller sub-batch trims more padding on heavy-tailed data: less memory, more calls)
    sub_batches = [config.chunk_size] if config.chunk_size else [DEFAULT_SUB_BATCH, DEFAULT_SUB_BATCH // 2]
    exact = batches is not None and lengths.exact  # every batch of the run, every row measured

    def graph_bytes(column_lengths: list[int], checkpoint: bool, sub_batch: int) -> float:
        """Activation bytes of one column embedded in sub-batches that keep their graphs."""
        total = 0.0
        for group in group_rows(column_lengths, chunk_size=sub_batch,
                                sort_by_length=config.sort_by_length):
            count, length = len(group), max(column_lengths[i] for i in group)
            full = act.bytes(count, length)
            if checkpoint:  # each layer's input is kept; one layer is recomputed at a time
                full = count * length * hidden * 4 * (layers + 1) + full / layers
            total += full
        return total

    def batch_columns(rows: Sequence[int]) -> list[list[int]]:
        """Token lengths of a batch's non-empty columns: anchors, positives, negatives."""
        cols = [[lengths.anchors[i] for i in rows], [lengths.positives[i] for i in rows],
                [n for i in rows for n in lengths.negatives[i]]]
        return [c for c in cols if c]

    def batch_bytes(rows: Sequence[int], checkpoint: bool, sub_batch: int) -> float:
        return sum(graph_bytes(c, checkpoint, sub_batch) for c in batch_columns(rows))

    def worst_case_bytes(checkpoint: bool, sub_batch: int) -> float:
        """No batch list or a sample: the longest texts the data holds, all in one batch."""
        total = 0.0
        for name, values in columns.items():
            n = B if name != "negatives" else n_candidates - B
            ranked = sorted(values, reverse=True)
            scale = len(examples) / len(lengths.anchors)  # > 1 when sampled
            picks = [ranked[min(len(ranked) - 1, int(r / scale))] for r in range(n)]
            total += graph_bytes(picks, checkpoint, sub_batch)
        return total

    def whole_batch(checkpoint: bool, sub_batch: int) -> float:
        if exact:
            return max(batch_bytes(b, checkpoint, sub_batch) for b in batches)
        return worst_case_bytes(checkpoint, sub_batch)

    cut_at: dict[int, list[list[tuple[int, int]]]] = {}

    def cut(cols: list[list[int]], token_budget: int) -> list[tuple[int, int]]:
        """(rows, padded length) of each chunk training cuts these columns into, in order."""
        return [(len(g), max(col[i] for i in g))
                for col in cols
                for g in group_rows(col, token_budget=token_budget,
                                    sort_by_length=config.sort_by_length)]

    def run_chunks(token_budget: int) -> list[list[tuple[int, int]]]:
        """The chunks of every batch of this run at this token budget (cut once, reused)."""
        if token_budget not in cut_at:
            cut_at[token_budget] = [cut(batch_columns(rows), token_budget) for rows in batches]
        return cut_at[token_budget]

    def chunk_tokens(token_budget: int) -> list[list[int]]:
        """Padded tokens of each chunk, in training's order, for each batch of this run.

        Chunks are formed as training forms them, for the batches of this run (the first
        64: the shares vary little), else for the longest texts of the data in one batch.
        """
        if exact:
            per_batch = run_chunks(token_budget)[:64]
        else:
            per_batch = [cut([sorted(v, reverse=True)[: B if k != "negatives" else n_candidates - B]
                              for k, v in columns.items()], token_budget)]
        return [[rows * length for rows, length in chunks] for chunks in per_batch]

    def kept_share(per_batch: list[list[int]], keep: int) -> float:
        """Mean share of a batch's padded tokens in its last ``keep`` chunks."""
        return sum(sum(t[len(t) - min(keep, len(t)):]) / max(1, sum(t))
                   for t in per_batch) / len(per_batch)

    def chunk_shapes(token_budget: int) -> set[tuple[int, int]]:
        """(rows, padded length) of each distinct chunk at this token budget.

        With the run's batches known, the chunks every one of them will be cut into (a
        chunk of short texts holds many rows but few tokens); else the worst case, a full
        chunk of the longest texts.
        """
        if exact:
            return {shape for chunks in run_chunks(token_budget) for shape in chunks}
        length = max(longest.values())
        return {(max(1, token_budget // length), length)}

    def chunk_peak(tokens: int, checkpoint: bool) -> float:
        """Activation bytes of the largest chunk at a budget of ``tokens`` padded tokens."""
        def one(rows: int, length: int) -> float:
            full = act.bytes(rows, length)
            if checkpoint:
                return rows * length * hidden * 4 * (layers + 1) + full / layers
            return full

        return max(one(rows, length) for rows, length in chunk_shapes(tokens))

    def peak(activations: float) -> int:
        base = process.total_bytes  # the whole process before activations (was: static)
        return int(base + _HEADROOM * activations + loss_bytes(loss_chunk) + embeddings)

    candidates = []
    for name in ("plain", "checkpoint"):
        # the largest sub-batch that fits (else the first, reported as not fitting)
        tried = []
        for sub in sub_batches:
            tried.append((sub, peak(whole_batch(name == "checkpoint", sub))))
            if tried[-1][1] <= budget:
                break
        sub, p = tried[-1] if tried[-1][1] <= budget else tried[0]
        candidates.append({"strategy": name, "chunk_size": sub, "token_budget": None,
                           "keep_graphs": None, "peak_bytes": p, "fits": p <= budget,
                           "relative_time": _RELATIVE_TIME[name]})
    length = max(longest.values())
    largest = B if device.type != "cpu" else min(B, _CPU_MAX_CHUNK_ROWS)
    sizes = [2**i for i in range(0, int(math.log2(max(1, largest))) + 1)]
    for name in ("cache", "cache+checkpoint"):
        best = None
        for size in sizes:
            p = peak(chunk_peak(size * length, name == "cache+checkpoint"))
            if p <= budget:
                best = (size, p)
        if best is None:
            p = peak(chunk_peak(length, name == "cache+checkpoint"))
            candidates.append({"strategy": name, "chunk_size": 1, "token_budget": length,
                               "keep_graphs": 1, "peak_bytes": p, "fits": False,
                               "relative_time": _RELATIVE_TIME[name]})
            continue
        # One kept graph costs nothing over the recompute (one chunk's graph is alive at a
        # time either way); each further kept graph adds a chunk's activations.
        size = best[0]
        graph = _HEADROOM * chunk_peak(size * length, name == "cache+checkpoint")
        per_batch = chunk_tokens(size * length)
        most = max(len(t) for t in per_batch)  # keeping more graphs than chunks saves nothing
        keep = min(most, 1 + max(0, int((budget - best[1]) // max(1.0, graph))))
        share = kept_share(per_batch, keep)
        candidates.append({"strategy": name, "chunk_size": size, "token_budget": size * length,
                           "keep_graphs": keep, "peak_bytes": int(best[1] + (keep - 1) * graph),
                           "fits": True,
                           "relative_time": _RELATIVE_TIME[name] - _RECOMPUTE * share})

    fitting = [c for c in candidates if c["fits"]]
    if not fitting:
        smallest = min(candidates, key=lambda c: c["peak_bytes"])
        raise MemoryError(
            f"batch size {B} does not fit in {budget / 2**30:.2f} GiB with any strategy "
            f"(smallest predicted peak {smallest['peak_bytes'] / 2**30:.2f} GiB with "
            f"{smallest['strategy']}): raise --memory-budget, lower --max-seq-length, or "
            "use a smaller model"
        )

    order = list(_RELATIVE_TIME)

    def cost(c: dict) -> tuple:
        # fewer, larger chunks run faster; on a tie the simpler strategy wins
        return (round(c["relative_time"], 3), order.index(c["strategy"]),
                -(c["token_budget"] or c["chunk_size"] or B))

    chosen = min(fitting, key=cost)
    basis = ("the largest batch of this run" if exact
             else "the longest texts of the data in one batch")
    if chosen["strategy"] == "plain":
        reason = f"{basis} fits whole: no recomputation needed"
    elif chosen["strategy"] == "checkpoint":
        reason = f"{basis} fits with checkpointing"
    else:
        reason = (f"plain needs {candidates[0]['peak_bytes'] / 2**30:.2f} GiB for {basis}; "
                  "largest chunk that fits")
    return MemoryPlan(
        strategy=chosen["strategy"],
        chunk_size=chosen["chunk_size"],
        token_budget=chosen["token_budget"],
        loss_chunk_size=loss_chunk,
        batch_size=B,
        budget_bytes=budget,
        predicted_peak_bytes=chosen["peak_bytes"],
        static_bytes=static,
        fits=True,
        reason=reason,
        lengths={k: {"max": max(v), "mean": round(sum(v) / len(v), 1), "cap": cap,
                     "rows_measured": len(lengths.anchors), "exact": lengths.exact}
                 for k, v in columns.items()},
        candidates=candidates,
        keep_graphs=chosen.get("keep_graphs") or 1,
        process=process.to_dict(),
    )
