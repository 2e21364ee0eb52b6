"""The automatic memory planner: pick the fastest strategy and chunk that fit a budget.

It probes the model on the data's real length distribution:

- CPU: the bytes the forward pass saves for backward (``saved_tensors_hooks``), at two
  sequence lengths, fitted to ``rows * (a*L + b*L^2)`` (the L^2 term is attention);
- CUDA: ``torch.cuda.max_memory_allocated`` around a forward and backward.

and adds what does not depend on the batch: parameters, gradients and AdamW's two moments.
Then the fastest candidate that fits: ``plain`` when the whole batch fits (in length-sorted
chunks of 16 rows, else of 8: smaller chunks trim more padding); else
``checkpoint`` or ``cache`` with the largest chunk that fits (chunks are capped in padded
tokens, so a chunk of long texts never exceeds the plan; with the run's batches known,
each chunk budget is costed by the largest chunk those batches really make), keeping as
many chunk graphs from the cache's first pass as the rest of the budget holds (those chunks
are not re-embedded); else ``cache+checkpoint``. Costs are relative step times measured on CPU (below).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from sentence_transformers import SentenceTransformer

from densefit.config.train import TrainConfig, parse_memory_budget
from densefit.data.batching import effective_batch_size, planned_batches
from densefit.data.types import TrainingExample
from densefit.memory.allocator import returning_freed_memory, trim
from densefit.memory.chunking import group_rows, tokenize
from densefit.memory.dropout import dropout_rows
from densefit.memory.plan import MemoryPlan
from densefit.memory.process import ProcessBaseline, process_baseline
from densefit.memory.strategies import default_chunk, fixed_plan
from densefit.models import (
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
    is_checkpointing,
    resolve_device,
    transformer_of,
)
from densefit.prompts import apply_prompt, resolve_prompts

__all__ = [
    "for_the_data",
    "matryoshka_sizes",
    "CPU_MAX_CHUNK_ROWS",
    "HEADROOM",
    "MemoryPlan",
    "ActivationModel",
    "RELATIVE_TIME",
    "plan_for_run",
    "plan_memory",
    "saved_bytes",
    "resolve_budget",
    "loss_block_size",
]

# Score-matrix blocks above this many elements are computed in blocks of anchors.
_LOSS_BLOCK_ELEMENTS = 2**20  # 4 MiB of fp32 scores per block: the loss stays small next to a chunk


def loss_block_size(given: int | None, queries: int, n_negatives: int = 0) -> int | None:
    """Anchors per block of the MNRL score matrix: ``given`` (``--loss-block-size``), else
    as many as keep a block at ~1M scores (None: one block, no blocking). The one rule the
    planner and the loss use.

    >>> loss_block_size(None, 64) is None, loss_block_size(None, 8192), loss_block_size(16, 64)
    (True, 128, 16)
    """
    if given is not None:
        return given
    candidates = queries + n_negatives
    if queries * candidates <= _LOSS_BLOCK_ELEMENTS:
        return None
    return max(1, _LOSS_BLOCK_ELEMENTS // candidates)


# Relative cost of one step, in forward-pass units (plain: a forward and a backward ~ 3),
# from the CPU step times in bench/results/memory_speed.md: checkpointing and the cache that
# re-embeds every chunk cost about 1.5 forward passes more than plain; each chunk whose graph
# the cache keeps is not re-embedded: a kept share s of the padded tokens saves RECOMPUTE * s.
RELATIVE_TIME = {"plain": 3.0, "checkpoint": 4.5, "cache": 4.5, "cache+checkpoint": 6.0}
RECOMPUTE = 1.5
# Backward briefly holds activation gradients next to the saved tensors (and transient
# attention scores, the optimizer step): the peak above the static bytes is this multiple of
# the bytes saved for backward, with a margin over the ratios in bench/results/memory_speed.md.
HEADROOM = 1.35
# On CPU a gradient-cache chunk larger than this many rows (at the longest length) runs no
# faster (bench/results/memory_speed.md): the planner leaves the rest of the budget unused.
CPU_MAX_CHUNK_ROWS = 32


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


def resolve_budget(budget: str | int | None, device: torch.device) -> int:
    """The memory budget in bytes: a size as given, or a share (``0.8`` / ``80%``; default
    0.8) of the memory free on ``device`` now (:func:`densefit.config.parse_memory_budget`
    reads the value, the one reading every caller uses)."""
    parsed = parse_memory_budget(budget)
    if parsed.size is not None:
        return parsed.size
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        import psutil  # the free memory of this machine

        free = psutil.virtual_memory().available
    return parsed.bytes_of(free)


def _static_bytes(model: torch.nn.Module) -> int:
    """Trainable parameters x 4 (the weight, its gradient, AdamW's exp_avg and exp_avg_sq,
    all fp32) + frozen parameters once (LoRA's base weights: no gradient, no AdamW state)."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return n * 4 * 4 + frozen


def matryoshka_sizes(config: TrainConfig) -> list[int]:
    """The Matryoshka sizes whose loss is computed (weight above 0); ``[]``: not Matryoshka.

    >>> matryoshka_sizes(TrainConfig(matryoshka_dims=[64, 32], matryoshka_weights=[1, 0]))
    [64]
    """
    dims = config.matryoshka_dims or []
    weights = config.matryoshka_weights or [1.0] * len(dims)
    return [d for d, w in zip(dims, weights) if w > 0]


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
    model: SentenceTransformer,
    examples: Sequence[TrainingExample],
    limit: int,
    seed: int,
    prompts: dict[str, str],
) -> _RowLengths:
    exact = len(examples) <= limit
    # Sampled by index (the same rows as sampling the list): rows kept in Arrow
    # (densefit.data.arrow) are built only for the sample.
    picked = (
        range(len(examples)) if exact else random.Random(seed).sample(range(len(examples)), limit)
    )
    rows = [examples[i] for i in picked]
    query, document = prompts.get("query"), prompts.get("document")
    negs = _token_lengths(model, apply_prompt([n for r in rows for n in r.negatives], document))
    per_row, at = [], 0
    for r in rows:
        per_row.append(negs[at : at + len(r.negatives)])
        at += len(r.negatives)
    return _RowLengths(
        _token_lengths(model, apply_prompt([r.query for r in rows], query)),
        _token_lengths(model, apply_prompt([r.positive for r in rows], document)),
        per_row,
        exact,
    )


def probe_activations(
    model: SentenceTransformer, max_length: int, rows: int = 4
) -> ActivationModel:
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
        features["input_ids"] = torch.randint(low, vocab, (rows, length), generator=generator).to(
            device
        )
        features["attention_mask"] = torch.ones(rows, length, dtype=torch.long, device=device)
        if "token_type_ids" in template:
            features["token_type_ids"] = torch.zeros(rows, length, dtype=torch.long, device=device)
        if device.type == "cuda":
            used = _cuda_activation_bytes(model, features, params, device)
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


def _cuda_activation_bytes(model, features: dict, params: list, device: torch.device) -> int:
    """The CUDA allocator's peak over one forward and backward of ``features``, above what
    was held before: the activations (and backward's transients). The gradient buffers are
    made first, so that backward accumulates into them as in every step after the first:
    the static bytes count them, not the activations."""
    for param in params:
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = model(features)["sentence_embedding"]
    out.float().pow(2).sum().backward()
    torch.cuda.synchronize(device)
    used = torch.cuda.max_memory_allocated(device) - before
    model.zero_grad(set_to_none=True)
    return used


@dataclass
class _RunShape:
    """What the planner knows about a run: its budget, batch, lengths and model sizes.

    Its methods cost a candidate: activation bytes of a whole batch or of the largest chunk,
    and the peak that adds the static bytes, the loss and the embeddings.
    """

    budget: int
    batch_size: int
    n_candidates: int  # positives + hard negatives of one batch (the loss's columns)
    n_examples: int
    lengths: _RowLengths
    columns: dict[str, list[int]]  # non-empty columns' token lengths (all rows, or a sample)
    longest: dict[str, int]
    cap: int
    act: ActivationModel
    static: int
    process: ProcessBaseline  # what the process holds before the step's activations
    hidden: int
    layers: int
    loss_block: int | None
    embeddings: int  # bytes of every embedding and its cached gradient
    batches: Sequence[Sequence[int]] | None
    exact: bool  # every batch of the run known, every row measured
    sort_by_length: bool
    symmetric: bool
    score_copies: int  # Matryoshka sizes: unblocked, each size's scores are held for backward
    device: torch.device
    plain_chunks: list[int]  # plain / checkpoint chunk sizes to try, largest first
    cut_at: dict = dataclasses.field(default_factory=dict)

    @property
    def length(self) -> int:
        return max(self.longest.values())

    def loss_bytes(self, loss_block: int | None) -> int:
        """Scores, softmax and its gradient for one block of anchors x all candidates.

        A Matryoshka loss scores each size in turn: unblocked, every size's scores stay
        held for the backward pass (``score_copies`` of them); blocked, only each row's
        log-sum-exp is kept and one block lives at a time.
        """
        B = self.batch_size
        block = B if loss_block is None else min(B, loss_block)
        copies = self.score_copies if loss_block is None or loss_block >= B else 1
        return int(3 * 4 * block * self.n_candidates * (2 if self.symmetric else 1) * copies)

    def peak(self, activations: float) -> int:
        return int(
            self.process.total_bytes
            + HEADROOM * activations
            + self.loss_bytes(self.loss_block)
            + self.embeddings
        )

    def chunk_bytes(self, rows: int, length: int, checkpoint: bool) -> float:
        """Activation bytes of one chunk with its graph (checkpointing: each layer's input
        is kept and one layer is recomputed at a time)."""
        full = self.act.bytes(rows, length)
        if checkpoint:
            return rows * length * self.hidden * 4 * (self.layers + 1) + full / self.layers
        return full

    def graph_bytes(self, column_lengths: list[int], checkpoint: bool, chunk_rows: int) -> float:
        """Activation bytes of one column embedded in chunks that keep their graphs."""
        groups = group_rows(
            column_lengths, chunk_size=chunk_rows, sort_by_length=self.sort_by_length
        )
        return sum(
            self.chunk_bytes(len(g), max(column_lengths[i] for i in g), checkpoint) for g in groups
        )

    def batch_columns(self, rows: Sequence[int]) -> list[list[int]]:
        """Token lengths of a batch's non-empty columns: anchors, positives, negatives."""
        lengths = self.lengths
        cols = [
            [lengths.anchors[i] for i in rows],
            [lengths.positives[i] for i in rows],
            [n for i in rows for n in lengths.negatives[i]],
        ]
        return [c for c in cols if c]

    def worst_columns(self) -> list[list[int]]:
        """No batch list or a sample: the longest texts the data holds, all in one batch."""
        B, out = self.batch_size, []
        scale = self.n_examples / len(self.lengths.anchors)  # > 1 when sampled
        for name, values in self.columns.items():
            n = B if name != "negatives" else self.n_candidates - B
            ranked = sorted(values, reverse=True)
            out.append([ranked[min(len(ranked) - 1, int(r / scale))] for r in range(n)])
        return out

    def whole_batch(self, checkpoint: bool, chunk_rows: int) -> float:
        """Activation bytes of the run's largest batch embedded whole (plain, checkpoint)."""
        if self.exact:
            return max(
                sum(self.graph_bytes(c, checkpoint, chunk_rows) for c in self.batch_columns(b))
                for b in self.batches
            )
        return sum(self.graph_bytes(c, checkpoint, chunk_rows) for c in self.worst_columns())

    def cut(self, cols: list[list[int]], token_budget: int) -> list[tuple[int, int]]:
        """(rows, padded length) of each chunk training cuts these columns into, in order."""
        return [
            (len(g), max(col[i] for i in g))
            for col in cols
            for g in group_rows(col, token_budget=token_budget, sort_by_length=self.sort_by_length)
        ]

    def run_chunks(self, token_budget: int) -> list[list[tuple[int, int]]]:
        """The chunks of every batch of this run at this token budget (cut once, reused)."""
        if token_budget not in self.cut_at:
            self.cut_at[token_budget] = [
                self.cut(self.batch_columns(rows), token_budget) for rows in self.batches
            ]
        return self.cut_at[token_budget]

    def chunk_tokens(self, token_budget: int) -> list[list[int]]:
        """Padded tokens of each chunk, in training's order, for each batch of this run.

        Chunks are formed as training forms them, for the batches of this run (the first
        64: the shares vary little), else for the longest texts of the data in one batch.
        """
        B = self.batch_size
        if self.exact:
            per_batch = self.run_chunks(token_budget)[:64]
        else:
            longest = [
                sorted(v, reverse=True)[: B if k != "negatives" else self.n_candidates - B]
                for k, v in self.columns.items()
            ]
            per_batch = [self.cut(longest, token_budget)]
        return [[rows * length for rows, length in chunks] for chunks in per_batch]

    def chunk_peak(self, tokens: int, checkpoint: bool) -> float:
        """Activation bytes of the largest chunk at a budget of ``tokens`` padded tokens.

        With the run's batches known, the chunks every one of them will be cut into (a
        chunk of short texts holds many rows but few tokens); else the worst case, a full
        chunk of the longest texts.
        """
        if self.exact:
            shapes = {shape for chunks in self.run_chunks(tokens) for shape in chunks}
        else:
            shapes = {(max(1, tokens // self.length), self.length)}
        return max(self.chunk_bytes(rows, length, checkpoint) for rows, length in shapes)


def _kept_share(per_batch: list[list[int]], keep: int) -> float:
    """Mean share of a batch's padded tokens in its last ``keep`` chunks."""
    return sum(sum(t[len(t) - min(keep, len(t)) :]) / max(1, sum(t)) for t in per_batch) / len(
        per_batch
    )


def probe_run(
    model: SentenceTransformer,
    examples: Sequence[TrainingExample],
    config: TrainConfig,
    batches: Sequence[Sequence[int]] | None,
    exact_limit: int,
    activation_model: ActivationModel | None,
    held_bytes: int | None = None,
) -> _RunShape:
    """Step 1: measure the data's token lengths, the model's sizes and (unless given) its
    activation bytes per row; decide the loss's score blocks."""
    device = torch.device(resolve_device(config.device) if config.device else model.device)
    budget = resolve_budget(config.memory_budget, device)
    if config.max_seq_length is not None:
        model.max_seq_length = config.max_seq_length
    if not examples:
        raise ValueError("cannot plan memory: the training data has no rows")
    # training puts the prompts before the texts: count their tokens too
    prompts = resolve_prompts(model, query=config.query_prompt, document=config.document_prompt)
    lengths = _row_lengths(model, examples, exact_limit, config.seed, prompts)
    columns = {c: lengths.column(c) for c in ("anchors", "positives", "negatives")}
    columns = {c: v for c, v in columns.items() if v}
    cap = int(getattr(model, "max_seq_length", 0) or max(max(v) for v in columns.values()))
    longest = {k: min(cap, max(v)) for k, v in columns.items()}
    if activation_model is None:
        activation_model = _probe_untouched(model, max(longest.values()), device)

    B = config.batch_size
    negs_per_row = len(columns.get("negatives", [])) / max(1, len(lengths.anchors))
    n_candidates = B + int(math.ceil(B * negs_per_row))
    get_dim = (
        getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    )
    dim = int(get_dim() or 768)
    nested = matryoshka_sizes(config)
    inner = transformer_of(model).config
    # plain / checkpoint chunks: the user's, else the default, then half of it (a
    # smaller chunk trims more padding on heavy-tailed data: less memory, more calls)
    subs = (
        [config.chunk_size]
        if config.chunk_size
        else [default_chunk("plain", device.type), default_chunk("plain", device.type) // 2]
    )
    shape = _RunShape(
        budget=budget,
        batch_size=B,
        n_candidates=n_candidates,
        n_examples=len(examples),
        lengths=lengths,
        columns=columns,
        longest=longest,
        cap=cap,
        act=activation_model,
        static=_static_bytes(model),
        process=process_baseline(model, device, held_bytes=held_bytes),
        hidden=int(getattr(inner, "hidden_size", dim)),
        layers=int(getattr(inner, "num_hidden_layers", 12)),
        loss_block=None,
        # values + cached grads, and the Matryoshka cuts of every embedding (held for backward)
        embeddings=4 * (2 * dim + sum(d for d in nested if d < dim)) * (B + n_candidates),
        batches=batches,
        exact=batches is not None and lengths.exact,
        sort_by_length=config.sort_by_length,
        symmetric=config.symmetric,
        score_copies=max(1, len(nested)),
        device=device,
        plain_chunks=subs,
    )
    loss_block = loss_block_size(config.loss_block_size, B, n_candidates - B)
    if config.loss_block_size is None and shape.loss_bytes(loss_block) > 0.05 * budget:
        # keep the score blocks to a small share of a tight budget
        loss_block = max(1, int(0.05 * budget / (3 * 4 * n_candidates)))
    shape.loss_block = loss_block
    return shape


def _probe_untouched(
    model: SentenceTransformer, length: int, device: torch.device
) -> ActivationModel:
    """:func:`probe_activations` without checkpointing, leaving the run's RNG and the
    model's checkpointing as they were, and the probe's freed buffers given back."""
    was_checkpointing = is_checkpointing(model)
    disable_gradient_checkpointing(model)
    # The probe runs dropout: keep the run's random stream untouched by it; with
    # invariant dropout on, measure its (eager) attention, as training will run it.
    # Its freed buffers go back to the OS: the resident set is then what the process holds.
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        dropout_rows(model, 0),
        returning_freed_memory(),
    ):
        found = probe_activations(model, length)
    if was_checkpointing:
        enable_gradient_checkpointing(model)
    gc.collect()
    trim()
    return found


def plain_candidates(shape: _RunShape) -> list[dict]:
    """Step 2a: plain and checkpoint, each with the largest chunk that fits (else the
    first, reported as not fitting)."""
    out = []
    for name in ("plain", "checkpoint"):
        tried = []
        for sub in shape.plain_chunks:
            tried.append((sub, shape.peak(shape.whole_batch(name == "checkpoint", sub))))
            if tried[-1][1] <= shape.budget:
                break
        sub, p = tried[-1] if tried[-1][1] <= shape.budget else tried[0]
        out.append(
            {
                "strategy": name,
                "chunk_size": sub,
                "token_budget": None,
                "keep_graphs": None,
                "peak_bytes": p,
                "fits": p <= shape.budget,
                "relative_time": RELATIVE_TIME[name],
            }
        )
    return out


def cached_candidates(shape: _RunShape) -> list[dict]:
    """Step 2b: the cache (with and without checkpointing) with the largest chunk that fits,
    keeping as many first-pass graphs as the rest of the budget holds."""
    length, B = shape.length, shape.batch_size
    largest = B if shape.device.type != "cpu" else min(B, CPU_MAX_CHUNK_ROWS)
    sizes = [2**i for i in range(0, int(math.log2(max(1, largest))) + 1)]
    out = []
    for name in ("cache", "cache+checkpoint"):
        checkpoint = name == "cache+checkpoint"
        best = None
        for size in sizes:
            p = shape.peak(shape.chunk_peak(size * length, checkpoint))
            if p <= shape.budget:
                best = (size, p)
        if best is None:
            p = shape.peak(shape.chunk_peak(length, checkpoint))
            out.append(
                {
                    "strategy": name,
                    "chunk_size": 1,
                    "token_budget": length,
                    "keep_graphs": 1,
                    "peak_bytes": p,
                    "fits": False,
                    "relative_time": RELATIVE_TIME[name],
                }
            )
            continue
        # One kept graph costs nothing over the recompute (one chunk's graph is alive at a
        # time either way); each further kept graph adds a chunk's activations.
        size = best[0]
        graph = HEADROOM * shape.chunk_peak(size * length, checkpoint)
        per_batch = shape.chunk_tokens(size * length)
        most = max(len(t) for t in per_batch)  # keeping more graphs than chunks saves nothing
        keep = min(most, 1 + max(0, int((shape.budget - best[1]) // max(1.0, graph))))
        out.append(
            {
                "strategy": name,
                "chunk_size": size,
                "token_budget": size * length,
                "keep_graphs": keep,
                "peak_bytes": int(best[1] + (keep - 1) * graph),
                "fits": True,
                "relative_time": RELATIVE_TIME[name] - RECOMPUTE * _kept_share(per_batch, keep),
            }
        )
    return out


def choose(shape: _RunShape, candidates: list[dict], sort_by_length: bool) -> MemoryPlan:
    """Step 3: the fastest candidate that fits (MemoryError, saying what to change, if none)."""
    B, budget = shape.batch_size, shape.budget
    fitting = [c for c in candidates if c["fits"]]
    if not fitting:
        smallest = min(candidates, key=lambda c: c["peak_bytes"])
        raise MemoryError(
            f"batch size {B} does not fit in {budget / 2**30:.2f} GiB with any strategy "
            f"(smallest predicted peak {smallest['peak_bytes'] / 2**30:.2f} GiB with "
            f"{smallest['strategy']}): raise --memory-budget, lower --max-seq-length, or "
            "use a smaller model"
        )
    order = list(RELATIVE_TIME)

    def cost(c: dict) -> tuple:
        # fewer, larger chunks run faster; on a tie the simpler strategy wins
        return (
            round(c["relative_time"], 3),
            order.index(c["strategy"]),
            -(c["token_budget"] or c["chunk_size"] or B),
        )

    chosen = min(fitting, key=cost)
    basis = (
        "the largest batch of this run"
        if shape.exact
        else "the longest texts of the data in one batch"
    )
    if chosen["strategy"] == "plain":
        reason = f"{basis} fits whole: no recomputation needed"
    elif chosen["strategy"] == "checkpoint":
        reason = f"{basis} fits with checkpointing"
    else:
        reason = (
            f"plain needs {candidates[0]['peak_bytes'] / 2**30:.2f} GiB for {basis}; "
            "largest chunk that fits"
        )
    measured = len(shape.lengths.anchors)
    return MemoryPlan(
        strategy=chosen["strategy"],
        # cached chunks are capped in padded tokens only: chunks of short texts take more rows
        chunk_size=None if chosen["token_budget"] else chosen["chunk_size"],
        token_budget=chosen["token_budget"],
        keep_graphs=chosen.get("keep_graphs") or 1,
        sort_by_length=sort_by_length,
        loss_block_size=shape.loss_block,
        chosen_by="planner",
        batch_size=B,
        budget_bytes=budget,
        predicted_peak_bytes=chosen["peak_bytes"],
        static_bytes=shape.static,
        fits=True,
        reason=reason,
        lengths={
            k: {
                "max": max(v),
                "mean": round(sum(v) / len(v), 1),
                "cap": shape.cap,
                "rows_measured": measured,
                "exact": shape.lengths.exact,
            }
            for k, v in shape.columns.items()
        },
        candidates=candidates,
        process=shape.process.to_dict(),
    )


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

    Three steps: :func:`probe_run`, then the candidates (:func:`plain_candidates`,
    :func:`cached_candidates`), then :func:`choose`.
    """
    shape = probe_run(model, examples, config, batches, exact_limit, activation_model, held_bytes)
    candidates = plain_candidates(shape) + cached_candidates(shape)
    if config.gradient_checkpointing:  # asked for: only the strategies that recompute
        candidates = [c for c in candidates if "checkpoint" in c["strategy"]]
    return choose(shape, candidates, config.sort_by_length)


def for_the_data(examples: Sequence[TrainingExample], config: TrainConfig) -> TrainConfig:
    """``config`` planned for the batch a step of this run really has
    (:func:`~densefit.data.batching.effective_batch_size`: fewer rows than ``batch_size``
    when the data, or with same-source batches its largest source, has fewer)."""
    batch = effective_batch_size(examples, config)
    return config if batch >= config.batch_size else config.replace(batch_size=batch)


def plan_for_run(
    model: SentenceTransformer,
    examples: Sequence[TrainingExample],
    config: TrainConfig,
    batches: Sequence[Sequence[int]] | None = None,
) -> MemoryPlan:
    """The memory plan of a run: the user's strategy, or the planner's with ``memory="auto"``.

    ``batches`` (row indices of every forward-backward) default to the run's own
    (:func:`densefit.data.batching.planned_batches`). The user's ``keep_graphs`` overrides
    the planner's; ``gradient_checkpointing`` turns ``plain`` into ``checkpoint``.

    >>> plan_for_run(None, [], TrainConfig(memory="cache", keep_graphs=2)).keep_graphs
    2
    """
    if config.memory != "auto":
        name = config.memory
        if config.gradient_checkpointing and name == "plain":
            name = "checkpoint"
        return fixed_plan(
            name,
            config.chunk_size,
            token_budget=config.token_budget,
            sort_by_length=config.sort_by_length,
            keep_graphs=1 if config.keep_graphs is None else config.keep_graphs,
            loss_block_size=config.loss_block_size,
            device=resolve_device(config.device) if config.device else None,
        )
    config = for_the_data(examples, config)
    if batches is None:
        batches = planned_batches(examples, config)
    plan = plan_memory(model, examples, config, batches=batches)
    if config.keep_graphs is not None:
        plan = dataclasses.replace(plan, keep_graphs=config.keep_graphs)
    return plan
