"""Memory strategies: they wrap the encoder call, so every loss works with every strategy.

A strategy takes the batch's text columns and a loss over their embeddings, and leaves the
parameter gradients of that loss in ``.grad``:

- ``plain``: embed each column in length-sorted chunks that keep their graphs (same
  gradients as one padded batch, less padding), loss, backward.
- ``checkpoint``: the same with gradient checkpointing inside the transformer.
- ``cache``: the gradient cache (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch
  Size under Memory Limited Setup"): embed every chunk without a graph, compute the loss
  on all embeddings and back-propagate to the embeddings only (the cache), then re-embed
  each chunk with a graph and back-propagate its slice of the cache. Each chunk's RNG
  state is replayed, so dropout matches and gradients equal the full-batch ones.
- ``cache+checkpoint``: the cache, with checkpointing inside each re-embedded chunk.

Activation memory: plain is O(batch); cache is O(chunk) plus the (B, d) embeddings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from sentence_transformers import SentenceTransformer

from densefit.memory.allocator import trim
from densefit.memory.chunking import Chunk, make_chunks, padding_efficiency, tokenize
from densefit.memory.dropout import dropout_rows, step_key
from densefit.memory.plan import MemoryPlan
from densefit.models import disable_gradient_checkpointing, enable_gradient_checkpointing

__all__ = [
    "StepStats",
    "MemoryStrategy",
    "PlainStrategy",
    "CachedStrategy",
    "default_chunk",
    "fixed_plan",
    "make_strategy",
    "MemoryPlan",
]

LossFn = Callable[[list[torch.Tensor]], torch.Tensor]
# Rows per length-sorted chunk when none is given: small enough to trim most padding
# on heavy-tailed data, large enough to keep matrix products efficient.
DEFAULT_PLAIN_CHUNK = 16
DEFAULT_CACHE_CHUNK = 32
# On a GPU a pass of a few rows leaves it idle (the launch of its kernels costs more than
# their work): chunks of this many rows when none is given, as large as the mini-batches of
# sentence-transformers' CachedMNRL measured on one (../shared/gpu/README.md).
GPU_DEFAULT_CHUNK = 256


@dataclass
class StepStats:
    """What one forward-backward did (logged per step)."""

    loss: float
    padding_efficiency: float
    chunks: int
    real_tokens: int
    padded_tokens: int


def _embed(model: SentenceTransformer, features: dict, rows: tuple | None = None) -> torch.Tensor:
    # A copy: SentenceTransformer.forward writes its outputs (token_embeddings: rows x
    # length x d floats) into the dict it is given. Into the chunk's own features, they
    # would stay alive for the whole step, O(batch) memory that no strategy can plan for.
    # rows = (step key, column, Chunk.index): invariant dropout's masks follow the rows
    # (densefit.memory.dropout; a no-op when it is off).
    with dropout_rows(model, *(rows or (None, 0, None)), features["attention_mask"]):
        return model(dict(features))["sentence_embedding"]


def _to_device(features: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}


class _RngState:
    """The CPU (and current CUDA device) RNG state, to replay a chunk's dropout exactly."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.cpu_state = torch.get_rng_state()
        self.cuda_state = torch.cuda.get_rng_state(device) if self.cuda else None
        self.device = device

    @contextlib.contextmanager
    def replay(self):
        devices = [self.device] if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_state)
            if self.cuda:
                torch.cuda.set_rng_state(self.cuda_state, self.device)
            yield


class MemoryStrategy:
    """Base class: tokenise and chunk the columns; subclasses run forward and backward.

    A strategy is what its frozen :class:`MemoryPlan` says (``strategy.plan``); its name,
    chunk and token budget are read from the plan and never change. Build one with
    :func:`make_strategy`.
    """

    def __init__(self, plan: MemoryPlan):
        self.plan = plan

    name = property(lambda self: self.plan.strategy)
    chunk_size = property(lambda self: self.plan.chunk_size)
    token_budget = property(lambda self: self.plan.token_budget)
    sort_by_length = property(lambda self: self.plan.sort_by_length)
    checkpoint = property(lambda self: self.plan.checkpointed)

    def prepare(self, model: SentenceTransformer) -> None:
        """Switch gradient checkpointing on or off inside the transformer to match."""
        if self.checkpoint:
            enable_gradient_checkpointing(model)
        else:
            disable_gradient_checkpointing(model)

    def chunk_columns(
        self, model: SentenceTransformer, columns: Sequence[Sequence[str]]
    ) -> list[list[Chunk]]:
        out = []
        for texts in columns:
            if len(texts) == 0:
                out.append([])
                continue
            features = _to_device(tokenize(model, list(texts)), model.device)
            out.append(
                make_chunks(
                    features,
                    chunk_size=self.chunk_size,
                    token_budget=self.token_budget,
                    sort_by_length=self.sort_by_length,
                )
            )
        return out

    def forward_backward(
        self,
        model: SentenceTransformer,
        columns: Sequence[Sequence[str]],
        loss_fn: LossFn,
        *,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        scaler: torch.amp.GradScaler | None = None,
    ) -> StepStats:
        raise NotImplementedError

    @staticmethod
    def _stats(loss: torch.Tensor, chunked: list[list[Chunk]]) -> StepStats:
        flat = [c for col in chunked for c in col]
        return StepStats(
            loss=float(loss.detach()),
            padding_efficiency=padding_efficiency(flat),
            chunks=len(flat),
            real_tokens=sum(c.real_tokens for c in flat),
            padded_tokens=sum(c.padded_tokens for c in flat),
        )


def _scatter(pieces: list[torch.Tensor], chunks: list[Chunk], n: int) -> torch.Tensor:
    """Put chunk embeddings back in column order (differentiable)."""
    if not pieces:
        return torch.empty(0)
    order = torch.cat([c.index for c in chunks])  # (n,) column rows in chunk order
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=order.device)
    return torch.cat(pieces)[inverse]


class PlainStrategy(MemoryStrategy):
    """Embed every chunk with its graph kept; one loss, one backward."""

    def forward_backward(
        self, model, columns, loss_fn, *, autocast=contextlib.nullcontext, scaler=None
    ):
        chunked = self.chunk_columns(model, columns)
        key = step_key(model)  # None unless invariant dropout is on
        embeddings = []
        for col, (texts, chunks) in enumerate(zip(columns, chunked)):
            if not chunks:
                embeddings.append(torch.empty(0, device=model.device))
                continue
            with autocast():
                pieces = [_embed(model, c.features, (key, col, c.index)) for c in chunks]
            embeddings.append(_scatter(pieces, chunks, len(texts)).float())  # (n, d)
        loss = loss_fn(embeddings)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return self._stats(loss, chunked)


class CachedStrategy(MemoryStrategy):
    """The exact gradient cache: memory O(chunk), gradients equal to the full batch's.

    The last ``keep_graphs`` chunks of the first pass are embedded with their graphs kept,
    so the second pass back-propagates through them directly instead of re-embedding them.
    One kept chunk costs no memory over the classic cache (one chunk's graph is alive at a
    time either way, only earlier: next to the loss instead of after it) and saves one
    chunk's forward pass per step; more kept chunks trade memory for speed (the planner
    keeps as many as the budget allows). ``keep_graphs=0`` is the classic gradient cache.
    """

    keep_graphs = property(lambda self: self.plan.keep_graphs)

    def forward_backward(
        self, model, columns, loss_fn, *, autocast=contextlib.nullcontext, scaler=None
    ):
        chunked = self.chunk_columns(model, columns)
        key = step_key(model)  # None unless invariant dropout is on
        device = model.device
        order = [(col, i) for col, chunks in enumerate(chunked) for i in range(len(chunks))]
        kept_ids = set(order[len(order) - min(self.keep_graphs, len(order)) :])

        # 1. Embed every chunk without a graph, remembering its RNG state for the replay;
        #    the last keep_graphs chunks keep their graphs (they are not re-embedded).
        rng: list[list[_RngState]] = []
        kept: dict[tuple[int, int], torch.Tensor] = {}
        cache_inputs = []
        for col, (texts, chunks) in enumerate(zip(columns, chunked)):
            states, pieces = [], []
            for i, c in enumerate(chunks):
                states.append(_RngState(device))
                keep = (col, i) in kept_ids
                with torch.set_grad_enabled(keep), autocast():
                    emb = _embed(model, c.features, (key, col, c.index))
                if keep:
                    kept[col, i] = emb
                    emb = emb.detach()
                pieces.append(emb)
            rng.append(states)
            with torch.no_grad():
                if chunks:
                    reps = _scatter(pieces, chunks, len(texts)).float()
                else:
                    reps = torch.empty(0, device=device)
            cache_inputs.append(reps.requires_grad_(bool(chunks)))
            del pieces

        # 2. Loss on all embeddings; backward stops at the embeddings: that is the cache.
        loss = loss_fn(cache_inputs)
        (scaler.scale(loss) if scaler is not None else loss).backward()

        # 3. Push each chunk's cached gradient through its graph: the kept graphs first (to
        #    free them), then every other chunk re-embedded with a graph (same dropout).
        for col, i in sorted(kept_ids, reverse=True):
            emb, grad = kept.pop((col, i)), cache_inputs[col].grad
            if grad is not None:  # None: the loss does not use this column
                torch.dot(emb.float().flatten(), grad[chunked[col][i].index].flatten()).backward()
            del emb
            trim()
        for col, (chunks, states, reps) in enumerate(zip(chunked, rng, cache_inputs)):
            grad = reps.grad  # (n, d); scaled by the GradScaler when there is one
            if not chunks or grad is None:
                continue
            for i, (c, state) in enumerate(zip(chunks, states)):
                if (col, i) in kept_ids:
                    continue
                with state.replay(), autocast():
                    emb = _embed(model, c.features, (key, col, c.index))  # (c, d)
                # <emb, cached grad> has exactly the chunk's share of d(loss)/d(params).
                torch.dot(emb.float().flatten(), grad[c.index].flatten()).backward()
                trim()  # this chunk's activations are gone: give their heap pages back
        return self._stats(loss, chunked)


def make_strategy(
    plan: MemoryPlan | str,
    chunk_size: int | None = None,
    *,
    token_budget: int | None = None,
    sort_by_length: bool = True,
    keep_graphs: int = 1,
) -> MemoryStrategy:
    """The strategy a plan describes: the one place a strategy is built.

    ``make_strategy("cache", 32, ...)`` is short for ``make_strategy(fixed_plan("cache", 32,
    ...))``: a user's choice, with the default chunk filled in.

    >>> make_strategy("cache", 32).plan.strategy
    'cache'
    >>> make_strategy(MemoryPlan("checkpoint", chunk_size=8)).checkpoint
    True
    """
    if isinstance(plan, str):
        plan = fixed_plan(
            plan,
            chunk_size,
            token_budget=token_budget,
            sort_by_length=sort_by_length,
            keep_graphs=keep_graphs,
        )
    return (CachedStrategy if plan.cached else PlainStrategy)(plan)


def default_chunk(name: str, device: str | None = None) -> int:
    """Rows per chunk of strategy ``name`` when none is given, on ``device`` (None: the CPU).

    >>> default_chunk("plain"), default_chunk("cache"), default_chunk("cache", "cuda:1")
    (16, 32, 256)
    """
    if device is not None and str(device).startswith("cuda"):
        return GPU_DEFAULT_CHUNK
    return DEFAULT_CACHE_CHUNK if name.startswith("cache") else DEFAULT_PLAIN_CHUNK


def fixed_plan(
    name: str,
    chunk_size: int | None = None,
    *,
    token_budget: int | None = None,
    sort_by_length: bool = True,
    keep_graphs: int = 1,
    loss_block_size: int | None = None,
    device: str | None = None,
) -> MemoryPlan:
    """The plan of a strategy the user chose by name, with the default chunk on ``device``
    (:func:`default_chunk`) when none is given.

    >>> fixed_plan("plain").chunk_size, fixed_plan("cache").chunk_size
    (16, 32)
    """
    if chunk_size is None and token_budget is None:
        chunk_size = default_chunk(name, device)
    return MemoryPlan(
        name,
        chunk_size=chunk_size,
        token_budget=token_budget,
        keep_graphs=keep_graphs,
        sort_by_length=sort_by_length,
        loss_block_size=loss_block_size,
    )
