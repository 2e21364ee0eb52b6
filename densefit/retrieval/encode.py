"""Embedding texts with a SentenceTransformer: length-sorted batches, input order restored.

Texts are tokenized once, sorted by token count so that each batch pads to nearly the same
length, encoded under ``torch.inference_mode`` with the model in eval mode, and written back
in the order they came in. The result equals ``SentenceTransformer.encode`` (tests check it)
while processing fewer padding tokens and tokenizing each text once instead of per batch.

Models whose first module is not a plain text :class:`~sentence_transformers.base.modules.
Transformer` with a fast tokenizer (prompts, routers, custom processing kwargs) take the
general path: ``model.preprocess`` per batch, batches still sorted by length.

``prompt_name="query"`` / ``"document"`` puts the model's prompt of that name before each
text (:mod:`densefit.prompts`), as ``SentenceTransformer.encode(prompt_name=...)`` does. A
model with ``truncate_dim`` set (``densefit index --dim``) gives its first ``truncate_dim``
coordinates rescaled to the full vector's norm (:func:`densefit.losses.matryoshka.truncate`,
the cut training used).

``runtime`` (:data:`densefit.choices.RUNTIME_CHOICES`, or a resolved :class:`~densefit.
retrieval.runtimes.Runtime`) picks what runs the transformer: ``torch`` (the default here),
``onnx``, ``onnx-int8``, ``openvino``... (:mod:`densefit.retrieval.runtimes`); the batches,
prompts, pooling and everything else above stay the same, so ``onnx`` equals ``torch`` to
~1e-7 cosine. The jobs (indexing, search, evaluation, mining) default to ``auto``.

:func:`tokenize_texts` tokenizes texts as :func:`encode_texts` does (prompt, truncation) and
gives each one's token count; handed back to :func:`encode_texts` (``tokens=``), its token
ids are embedded as they are, without tokenizing again (``densefit serve`` counts a batch's
tokens before forming it, then embeds it).

On a GPU the batches flow through a pipeline (:func:`encode_with_callback`): a producer thread
tokenizes the next texts (in several threads, each with its own copy of the tokenizer) and
pads them into pinned memory while the GPU embeds the current batch; batches go to the GPU
with non-blocking copies, are cut by padded tokens rather than by texts, and their vectors
come back with one host synchronisation per window of texts instead of one per batch. The
vectors are those of the plain loop the CPU runs (bit for bit in fp32 for the same batches:
tests/test_encode.py).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import queue
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from tqdm.auto import tqdm

from densefit.losses.matryoshka import truncate
from densefit.models import eval_mode
from densefit.prompts import apply_prompt, model_prompts, set_prompts
from densefit.retrieval.runtimes import Runtime, resolve_runtime, set_precision

__all__ = [
    "TextTokens",
    "configure_model",
    "embedding_dimension",
    "encode_texts",
    "encode_with_callback",
    "fast_path_tokenizer",
    "fastest_runtime",
    "padding_aware_cuts",
    "tokenize_texts",
]

# Texts are tokenized in windows of this many batches: bounded memory on million-text inputs,
# and enough texts per window for the token-length sort to leave little padding.
_BATCHES_PER_WINDOW = 32
_FEATURE_KEYS = {"input_ids", "attention_mask", "token_type_ids"}
# The pipeline (on a GPU): at most this many texts per tokenizer thread's share of a window
# (fewer, smaller shares leave threads idle), and this many tokenizer threads at most.
_MIN_TOKENIZE_SHARE = 256
_MAX_TOKENIZE_THREADS = 8
# Per tokenizer: copies for the pipeline's tokenizer threads (a fast tokenizer's settings may
# not change while another thread encodes with it). Kept outside the model, weakly.
_TOKENIZER_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TextTokens:
    """One text tokenized as :func:`encode_texts` tokenizes it (:func:`tokenize_texts`).

    ``count``: its tokens, prompt and special tokens included; ``features``: its token ids
    (``input_ids``, ``attention_mask``...), which :func:`encode_texts` reuses when they were
    made by the tokenizer it would use (``key``) for the same ``text`` (prompt included), else
    None (the model's general path, or a text over ``max_seq_length`` counted untruncated).
    """

    text: str
    count: int
    features: dict | None = None
    key: tuple = ()


def embedding_dimension(model: SentenceTransformer) -> int:
    """The size of ``model``'s sentence embeddings.

    >>> from densefit.testing import tiny_model
    >>> embedding_dimension(tiny_model())
    32
    """
    getter = (
        getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    )
    dim = getter()
    if dim is None:  # some module chains only know their size after a forward pass
        dim = int(model.encode(["dimension probe"]).shape[1])
    return int(dim)


def encode_texts(
    model: SentenceTransformer,
    texts: Sequence[str],
    *,
    batch_size: int = 64,
    show_progress: bool = False,
    normalize: bool = False,
    prompt_name: str | None = None,
    pass_cost_tokens: int | None = None,
    runtime: str | Runtime = "torch",
    tokens: Sequence[TextTokens | None] | None = None,
) -> np.ndarray:
    """Embed ``texts`` into a ``(len(texts), dim)`` float32 array, row i for ``texts[i]``.

    Batches are formed from texts of similar token length (longest first) and the rows are
    put back in input order. ``normalize=True`` scales each row to unit length (cosine
    similarity becomes a dot product). ``prompt_name`` (``"query"``, ``"document"``): put
    the model's prompt of that name before each text (none when the model has none).
    ``pass_cost_tokens``: cut the length-sorted texts where padding would cost more than
    another forward pass (:func:`padding_aware_cuts`) instead of every ``batch_size`` texts.
    ``runtime``: what runs the transformer (:func:`~densefit.retrieval.runtimes.
    resolve_runtime`; ``"torch"``, ``"onnx"``, ``"auto"``...). ``tokens``: each text's
    :func:`tokenize_texts` (with the same ``prompt_name``), whose token ids are embedded
    instead of tokenizing the text again (one that does not match is tokenized as usual).

    >>> from densefit.testing import tiny_model
    >>> model = tiny_model()
    >>> encode_texts(model, ["a short text", "a much longer text about cells and genes"]).shape
    (2, 32)
    """
    texts = _checked_texts(texts, batch_size)

    with tqdm(total=len(texts), desc="Encoding", unit="text", disable=not show_progress) as bar:
        return encode_with_callback(
            model,
            texts,
            batch_size=batch_size,
            normalize=normalize,
            on_batch=bar.update,
            prompt_name=prompt_name,
            pass_cost_tokens=pass_cost_tokens,
            runtime=runtime,
            tokens=tokens,
        )


def encode_with_callback(
    model: SentenceTransformer,
    texts: list[str],
    *,
    batch_size: int = 64,
    normalize: bool = False,
    on_batch: Callable[[int], object] | None = None,
    prompt_name: str | None = None,
    pass_cost_tokens: int | None = None,
    runtime: str | Runtime = "torch",
    tokens: Sequence[TextTokens | None] | None = None,
    share: tuple[int, int] | None = None,
) -> np.ndarray:
    """:func:`encode_texts` reporting each finished batch's size to ``on_batch``.

    For callers that drive their own progress bar (indexing counts documents, not texts).

    ``share=(rank, world)``: embed only this process's share of the batches, for several
    processes embedding the same ``texts`` together. Every process cuts the batches one
    process would cut (so each vector is made in the very batch it would be made in alone)
    and takes every ``world``-th of them, from batch ``rank`` on, in longest-first order: a
    balanced share. The rows of the other processes' batches are left zero, so the sum of
    every process's array is the array of one process, exactly.

    >>> from densefit.testing import tiny_model
    >>> done = []
    >>> encode_with_callback(tiny_model(), ["a", "b", "c"], batch_size=2, on_batch=done.append).shape
    (3, 32)
    >>> done
    [2, 1]
    >>> mine = encode_with_callback(tiny_model(), ["a", "b", "c"], batch_size=2, share=(1, 2))
    >>> [bool(row.any()) for row in mine]  # batch 0 holds two of the texts, batch 1 the other
    [False, False, True]
    """
    texts = _checked_texts(texts, batch_size)
    if share is not None and not 0 <= share[0] < share[1]:
        raise ValueError(f"share must be (rank, world) with 0 <= rank < world, got {share}")
    runner = resolve_runtime(model, runtime)
    texts = _prompted(model, texts, prompt_name)
    if tokens is not None and len(tokens) != len(texts):
        raise ValueError(f"{len(tokens)} tokenized texts for {len(texts)} texts")
    dim = embedding_dimension(model)
    # Identical texts are encoded once and share one row: fewer forward passes, and copies
    # of a document get exactly equal scores (a float-level difference from landing in
    # batches of other widths would otherwise break their tie arbitrarily; trec_eval breaks
    # exact ties by id, which is how the published BEIR/MTEB numbers were computed).
    index_of: dict[str, int] = {}
    inverse = np.array([index_of.setdefault(t, len(index_of)) for t in texts], dtype=np.int64)
    if len(index_of) < len(texts):
        copy_of = {j: i for i, j in enumerate(inverse.tolist())}  # any copy: the same text
        distinct = encode_with_callback(
            model,
            list(index_of),
            batch_size=batch_size,
            normalize=normalize,
            on_batch=on_batch,
            pass_cost_tokens=pass_cost_tokens,
            runtime=runner,
            tokens=None if tokens is None else [tokens[copy_of[j]] for j in range(len(index_of))],
            share=share,
        )
        if on_batch is not None:
            on_batch(len(texts) - len(index_of))
        return distinct[inverse]
    out = (np.empty if share is None else np.zeros)((len(texts), dim), dtype=np.float32)
    if not texts:
        return out
    tokenizer = fast_path_tokenizer(model)
    reused = _reusable(model, tokenizer, texts, tokens)
    # Coarse order by characters (free); each window is then re-sorted by exact token count.
    order = np.argsort([-len(t) for t in texts], kind="stable")
    window = batch_size * _BATCHES_PER_WINDOW
    turns = itertools.count()  # batches dealt so far, all windows together (share)
    skip = None if share is None else lambda: next(turns) % share[1] != share[0]

    def finish(embeddings: torch.Tensor) -> torch.Tensor:  # (b, full dim) -> (b, dim)
        embeddings = truncate(embeddings, dim)  # truncate_dim: the Matryoshka cut
        if normalize:
            embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=1)
        return embeddings

    with eval_mode(model), torch.inference_mode():
        if not _pipelined(model):  # the CPU: one batch at a time, as plain as it gets
            for start in range(0, len(texts), window):
                rows = order[start : start + window]
                for batch_rows, features in _batches(
                    model, tokenizer, texts, rows, batch_size, pass_cost_tokens, reused, skip=skip
                ):
                    features = {
                        k: v.to(model.device) if isinstance(v, torch.Tensor) else v
                        for k, v in features.items()
                    }
                    embeddings = finish(runner.embed(model, features))
                    out[batch_rows] = embeddings.float().cpu().numpy()
                    if on_batch is not None:
                        on_batch(len(batch_rows))
            return out
        budget = None if pass_cost_tokens is not None else _batch_tokens(model, batch_size)
        with _tokenizer_threads(tokenizer, len(texts), window) as threads:
            batches = (
                batch
                for start in range(0, len(texts), window)
                for batch in _batches(
                    model, tokenizer, texts, order[start : start + window], batch_size,
                    pass_cost_tokens, reused, skip=skip, token_budget=budget, threads=threads,
                )
            )  # fmt: skip
            _embed_pipelined(model, runner, batches, out, finish, on_batch, gather=window)
    return out


def _pipelined(model: SentenceTransformer) -> bool:
    """Whether :func:`encode_with_callback` pipelines its batches: on a GPU (where the host's
    tokenizing, padding and copying would otherwise leave it idle between batches)."""
    return model.device.type == "cuda"


def _batch_tokens(model: SentenceTransformer, batch_size: int) -> int | None:
    """Padded tokens per batch in the pipeline: what ``batch_size`` texts of the model's
    maximum length hold, so that a batch of short texts takes more of them (fewer, fuller
    passes) and none takes more memory than a full batch of the longest."""
    limit = getattr(model, "max_seq_length", None)
    return batch_size * int(limit) if limit else None


def _embed_pipelined(
    model, runner, batches, out: np.ndarray, finish, on_batch, *, gather: int, cuda=None
):
    """Embed ``batches`` ((rows, features) on the host) into ``out``: a producer thread makes
    them (pinned on a GPU) while the device embeds, features go over with non-blocking copies,
    and the vectors of about ``gather`` texts come back together, one synchronisation each
    (the copy back of one gather overlaps the next one's batches). ``cuda``: whether the
    device is a GPU (None: the model's device says)."""
    device = model.device
    cuda = device.type == "cuda" if cuda is None else cuda
    pending: list[tuple[np.ndarray, torch.Tensor]] = []  # embedded, not yet gathered
    landing = None  # the gather on its way to the host
    with _prefetched(batches, pin=cuda, depth=_BATCHES_PER_WINDOW) as produced:
        for batch_rows, features in produced:
            features = {
                k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in features.items()
            }
            pending.append((batch_rows, finish(runner.embed(model, features))))
            if sum(len(r) for r, _ in pending) >= gather:
                _land(landing, out, on_batch)
                landing, pending = _gather(pending, cuda), []
    _land(landing, out, on_batch)
    _land(_gather(pending, cuda), out, on_batch)


def _gather(pending: list, cuda: bool):
    """Start the copy of ``pending``'s vectors to the host (one tensor; on a GPU into pinned
    memory, behind an event); :func:`_land` waits for it."""
    if not pending:
        return None
    stacked = torch.cat([e for _, e in pending]).float()  # (texts, dim)
    event = None
    if cuda:
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host = stacked.cpu()
    return [r for r, _ in pending], host, event


def _land(gathered, out: np.ndarray, on_batch) -> None:
    """Wait for a :func:`_gather` and write its rows into ``out``; report its batches."""
    if gathered is None:
        return
    rows, host, event = gathered
    if event is not None:
        event.synchronize()  # the one wait for this gather's batches
    out[np.concatenate(rows)] = host.numpy()
    if on_batch is not None:
        for batch_rows in rows:
            on_batch(len(batch_rows))


class _Failed:
    """What the producer thread raised, handed to the consumer."""

    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()


@contextlib.contextmanager
def _prefetched(items: Iterator, *, pin: bool, depth: int):
    """``items`` made in a producer thread, up to ``depth`` ahead (pinned when ``pin``); an
    error there is raised here, and leaving the block stops the producer."""
    box: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                box.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for rows, features in items:
                if pin:
                    features = {
                        k: v.pin_memory() if isinstance(v, torch.Tensor) else v
                        for k, v in features.items()
                    }
                if not put((rows, features)):
                    return
            put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            put(_Failed(exc))

    thread = threading.Thread(target=produce, name="densefit-encode-producer", daemon=True)
    thread.start()

    def consume():
        while True:
            item = box.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    try:
        yield consume()
    finally:
        stop.set()
        thread.join()


class _TokenizerThreads:
    """Threads that tokenize shares of a window at once, each with its own copy of the
    tokenizer (borrowed from :data:`_TOKENIZER_COPIES`, given back after)."""

    def __init__(self, tokenizer, workers: int):
        self.tokenizer = tokenizer
        self.workers = workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="densefit-tokenize")
        self.copies = _TOKENIZER_COPIES.setdefault(tokenizer, queue.SimpleQueue())

    def tokenize(self, texts: list[str]) -> dict:
        """:func:`_tokenize` of ``texts``, in shares of at least :data:`_MIN_TOKENIZE_SHARE`."""
        shares = min(self.workers, max(1, len(texts) // _MIN_TOKENIZE_SHARE))
        if shares < 2:
            return self._one(texts)
        size = -(-len(texts) // shares)
        parts = list(
            self.pool.map(self._one, [texts[i : i + size] for i in range(0, len(texts), size)])
        )
        return {
            k: list(itertools.chain.from_iterable(p[k] for p in parts)) for k in parts[0].keys()
        }

    def _one(self, texts: list[str]) -> dict:
        try:
            tokenizer = self.copies.get_nowait()
        except queue.Empty:
            tokenizer = copy.deepcopy(self.tokenizer)
        try:
            return _tokenize(tokenizer, texts)
        finally:
            self.copies.put(tokenizer)


@contextlib.contextmanager
def _tokenizer_threads(tokenizer, n_texts: int, window: int):
    """Tokenizer threads for the pipeline when they have shares to work on (a fast-path
    tokenizer, more than one share of texts in a ``window``, more than one core), else None;
    one core is left to the thread that drives the GPU."""
    shares = min(n_texts, window) // _MIN_TOKENIZE_SHARE
    workers = min(_MAX_TOKENIZE_THREADS, _cores() - 1, shares)
    if tokenizer is None or workers < 2:
        yield None
        return
    threads = _TokenizerThreads(tokenizer, workers)
    try:
        yield threads
    finally:
        threads.pool.shutdown(wait=True)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


# Query-like texts of a search box's lengths (3 to about 20 tokens) for fastest_runtime.
_TIMING_QUERIES = (
    "blood pressure",
    "how do I list open ports on linux",
    "What is the effect of vitamin D on bone density in older adults?",
    "python read a csv file into a dictionary keyed by the first column",
    "statin side effects muscle pain",
)


def fastest_runtime(
    model: SentenceTransformer,
    runtimes: Sequence[Runtime],
    *,
    calls: int = 15,
    warmup: int = 3,
    prompt_name: str | None = "query",
) -> tuple[Runtime, dict[str, float]]:
    """The one of ``runtimes`` that embeds a single query fastest here, and each one's median
    milliseconds per query: each is called ``warmup`` times, then ``calls`` times in turn
    with the others (so a busy moment costs them all), one query-like text per call through
    :func:`encode_texts`. Which runtime is fastest at one text depends on the CPU and
    differs from the fastest at a batch of documents (``bench/results/query_parts.json``):
    ``densefit serve`` asks this where its ``--runtime`` is ``auto``. A single runtime is
    returned untimed (``{}``).

    >>> from densefit.retrieval.runtimes import TORCH
    >>> from densefit.testing import tiny_model
    >>> fastest_runtime(tiny_model(), [TORCH])[0].name
    'torch'
    """
    if not runtimes:
        raise ValueError("fastest_runtime needs at least one runtime")
    if len(runtimes) == 1:
        return runtimes[0], {}
    times: dict[str, list[float]] = {r.name: [] for r in runtimes}
    for i in range(warmup + calls):
        text = _TIMING_QUERIES[i % len(_TIMING_QUERIES)]
        for runner in runtimes:
            start = time.perf_counter()
            encode_texts(model, [text], batch_size=1, prompt_name=prompt_name, runtime=runner)
            if i >= warmup:
                times[runner.name].append((time.perf_counter() - start) * 1000)
    medians = {name: statistics.median(ms) for name, ms in times.items()}
    best = min(runtimes, key=lambda r: medians[r.name])
    return best, medians


def tokenize_texts(
    model: SentenceTransformer,
    texts: Sequence[str],
    *,
    prompt_name: str | None = None,
    truncation: bool = True,
) -> list[TextTokens]:
    """Each text tokenized as :func:`encode_texts` tokenizes it with ``prompt_name``: its
    token count (prompt and special tokens included, truncated to the model's
    ``max_seq_length``) and its token ids, for :func:`encode_texts` (``tokens=``) to embed
    without tokenizing again. ``truncation=False`` counts the tokens of the whole text (a
    text over ``max_seq_length`` keeps no token ids: embedding it truncates it).

    >>> from densefit.testing import tiny_model
    >>> model = tiny_model()
    >>> [t.count for t in tokenize_texts(model, ["cells", "cells genes"])]
    [3, 4]
    >>> long = "cells " * 100
    >>> tokenize_texts(model, [long])[0].count, tokenize_texts(model, [long], truncation=False)[0].count
    (64, 102)
    """
    texts = _prompted(model, _checked_texts(texts, 1), prompt_name)
    if not texts:
        return []
    tokenizer = fast_path_tokenizer(model)
    if tokenizer is None:  # not the fast path: count what the model's own tokenize() makes
        if not truncation:
            first = model[0] if len(model) else None
            plain = getattr(first, "tokenizer", None) or getattr(model, "tokenizer", None)
            if plain is not None:
                ids = plain(texts, truncation=False, verbose=False)["input_ids"]
                return [TextTokens(t, len(row)) for t, row in zip(texts, ids, strict=True)]
        counts = model.tokenize(texts)["attention_mask"].sum(dim=1).tolist()
        return [TextTokens(t, int(n)) for t, n in zip(texts, counts, strict=True)]
    if truncation:
        encoded = _tokenize(tokenizer, texts)
    else:
        encoded = tokenizer(texts, truncation=False, padding=False, verbose=False)
    limit = model.max_seq_length or None
    key = _fast_path_key(model)
    keys = _FEATURE_KEYS & encoded.keys()
    out = []
    for i, text in enumerate(texts):
        count = len(encoded["input_ids"][i])
        keep = limit is None or count <= limit
        features = {k: encoded[k][i] for k in keys} if keep else None
        out.append(TextTokens(text, count, features, key))
    return out


def _prompted(model, texts: list[str], prompt_name: str | None) -> list[str]:
    """``texts`` with the model's ``prompt_name`` prompt in front, as they are embedded."""
    if prompt_name is None or not model_prompts(model).get(prompt_name):
        return texts
    if any(getattr(module, "include_prompt", True) is False for module in model):
        raise ValueError(
            "this model leaves the prompt out of its pooling (include_prompt=False), which "
            "densefit does not support: use it without --query-prompt/--document-prompt"
        )
    return apply_prompt(texts, model_prompts(model)[prompt_name])


def _reusable(model, tokenizer, texts: list[str], tokens) -> list[dict] | None:
    """The token ids of ``tokens`` when every one of them was made by ``tokenizer`` (the fast
    path's, with the model's current settings) for the text at its place, else None."""
    if tokens is None or tokenizer is None:
        return None
    key = _fast_path_key(model)
    for text, tokenized in zip(texts, tokens, strict=True):
        if (
            tokenized is None
            or tokenized.features is None
            or tokenized.key != key
            or tokenized.text != text
        ):
            return None
    return [t.features for t in tokens]


def configure_model(
    model: SentenceTransformer,
    *,
    query_prompt: str | None = None,
    document_prompt: str | None = None,
    dim: int | None = None,
    precision: str | None = None,
) -> SentenceTransformer:
    """Set how ``model`` embeds: its query/document prompts (``None``: keep the model's own,
    ``""``: none; :func:`densefit.prompts.set_prompts`), the Matryoshka size its vectors
    are cut to (``dim``: ``model.truncate_dim``; ``None``: the full size) and the precision
    of its transformer (``precision``: :func:`~densefit.retrieval.runtimes.set_precision`;
    ``None``: as it is). Returns ``model``.

    >>> from densefit.testing import tiny_model
    >>> model = configure_model(tiny_model(), query_prompt="query: ", dim=16)
    >>> model.prompts["query"], embedding_dimension(model)
    ('query: ', 16)
    """
    set_precision(model, precision)
    set_prompts(model, query=query_prompt, document=document_prompt)
    model.truncate_dim = None
    if dim is not None:
        full = embedding_dimension(model)
        if not 1 <= dim <= full:
            raise ValueError(
                f"--dim {dim}: the model makes {full}-d embeddings; give a size from 1 to {full}"
            )
        model.truncate_dim = None if dim == full else int(dim)
    return model


def _checked_texts(texts: Sequence[str], batch_size: int) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("encode_texts takes a list of texts; wrap a single text as [text]")
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(
                f"texts[{i}] is a {type(text).__name__}, not a str: pass the document text "
                "(Document.text), not the Document"
            )
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return texts


def padding_aware_cuts(lengths: np.ndarray, batch_size: int, pass_cost: int) -> list[int]:
    """Where to cut texts sorted longest first into batches (the start of each batch, then
    ``len(lengths)``), minimising the tokens a forward pass computes, padding included, plus
    ``pass_cost`` tokens per pass (its fixed cost: reading the weights, Python), with at
    most ``batch_size`` texts a batch.

    A batch is padded to its longest text: one query of 40 tokens among 15 of 10 makes the
    pass compute 640 tokens for 190 real ones; cut off, it costs 40 + 150 + one more pass.

    >>> padding_aware_cuts(np.array([40, 10, 10, 10]), 64, pass_cost=16)
    [0, 1, 4]
    >>> padding_aware_cuts(np.array([12, 11, 10, 10]), 64, pass_cost=16)
    [0, 4]
    """
    n = len(lengths)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    start_of = np.zeros(n + 1, dtype=np.int64)
    widths = lengths.astype(np.float64)
    for end in range(1, n + 1):
        starts = np.arange(max(0, end - batch_size), end)
        costs = best[starts] + pass_cost + (end - starts) * widths[starts]
        pick = int(np.argmin(costs))
        best[end], start_of[end] = costs[pick], starts[pick]
    cuts, end = [n], n
    while end > 0:
        end = int(start_of[end])
        cuts.append(end)
    return cuts[::-1]


def _batches(
    model,
    tokenizer,
    texts,
    rows: np.ndarray,
    batch_size: int,
    pass_cost: int | None = None,
    reused: list[dict] | None = None,
    *,
    skip: Callable[[], bool] | None = None,
    token_budget: int | None = None,
    threads: _TokenizerThreads | None = None,
):
    """Yield (rows, features) for one window of texts, batches of similar token length
    (cut by :func:`padding_aware_cuts` when ``pass_cost`` is given, else by
    :func:`token_cuts` when ``token_budget`` is); ``reused``: every text's token ids, already
    made (:func:`tokenize_texts`); a batch for which ``skip()`` is true (another process's)
    is cut but not padded nor yielded; ``threads``: tokenize the window in shares at once."""
    if tokenizer is None:
        # General path: the model's own preprocessing, per batch, in character-length order.
        for start in range(0, len(rows), batch_size):
            batch_rows = rows[start : start + batch_size]
            if skip is None or not skip():
                yield batch_rows, model.preprocess([texts[i] for i in batch_rows])
        return
    if reused is None:
        window = [texts[i] for i in rows]
        encoded = _tokenize(tokenizer, window) if threads is None else threads.tokenize(window)
    else:
        encoded = {k: [reused[i][k] for i in rows] for k in reused[rows[0]]}
    lengths = np.array([len(ids) for ids in encoded["input_ids"]])
    by_tokens = np.argsort(-lengths, kind="stable")
    if pass_cost is not None:
        cuts = padding_aware_cuts(lengths[by_tokens], batch_size, pass_cost)
    elif token_budget is not None:
        cuts = token_cuts(lengths[by_tokens], token_budget)
    else:
        cuts = [*range(0, len(rows), batch_size), len(rows)]
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        if skip is not None and skip():
            continue
        picks = by_tokens[start:end]
        yield rows[picks], _pad(encoded, picks, int(lengths[picks].max()), tokenizer)


def token_cuts(lengths: np.ndarray, token_budget: int) -> list[int]:
    """Where to cut texts sorted longest first into batches (the start of each batch, then
    ``len(lengths)``) of at most ``token_budget`` padded tokens each (at least one text).

    >>> token_cuts(np.array([100, 60, 50, 10, 10, 10, 10]), 120)
    [0, 1, 3, 7]
    """
    cuts, start, n = [0], 0, len(lengths)
    while start < n:
        start += max(1, token_budget // max(1, int(lengths[start])))  # padded to the first
        cuts.append(min(start, n))
    return cuts


def _tokenize(tokenizer, texts: list[str]) -> dict:
    # The same arguments as Transformer.preprocess, minus the padding (done per batch).
    return tokenizer(texts, truncation="longest_first", padding=False)


def _pad(encoded: dict, picks: np.ndarray, width: int, tokenizer) -> dict:
    """Right- or left-pad the picked rows of ``encoded`` to ``width`` tokens."""
    features: dict = {"modality": "text"}
    left = tokenizer.padding_side == "left"
    for key in _FEATURE_KEYS & encoded.keys():
        pad_value = tokenizer.pad_token_id if key == "input_ids" else 0
        if key == "token_type_ids":
            pad_value = tokenizer.pad_token_type_id
        block = np.full((len(picks), width), pad_value, dtype=np.int64)  # (b, width)
        for r, i in enumerate(picks):
            ids = encoded[key][i]
            if left:
                block[r, width - len(ids) :] = ids
            else:
                block[r, : len(ids)] = ids
        features[key] = torch.from_numpy(block)
    return features


def fast_path_tokenizer(model: SentenceTransformer) -> object | None:
    """The tokenizer, when tokenizing once up front gives exactly ``model.preprocess``'s input.

    Returns None (use the general path) for anything unusual. The answer is remembered on the
    model until its tokenizer, maximum length, prompt or padding side change (the check costs
    a few milliseconds: too much to pay on every single-query call).
    """
    key = _fast_path_key(model)
    cached = getattr(model, "_densefit_fast_path", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    decision = _check_fast_path(model)
    model._densefit_fast_path = (key, decision)
    return decision


def _fast_path_key(model: SentenceTransformer) -> tuple:
    """What the fast-path decision depends on: the tokenizer, maximum length, prompt and
    padding side (token ids made under another key are not reused)."""
    first = model[0] if len(model) else None
    tokenizer = getattr(first, "tokenizer", None)
    return (
        id(first),
        id(tokenizer),
        getattr(model, "max_seq_length", None),
        getattr(model, "default_prompt_name", None),
        getattr(tokenizer, "padding_side", None),
    )


def _check_fast_path(model: SentenceTransformer):
    """Run the model's own preprocessing on two probes (one over ``max_seq_length``), compare."""
    try:
        from sentence_transformers.base.modules import Transformer  # sentence-transformers >= 5.2
    except ImportError:  # pragma: no cover - older sentence-transformers
        return None
    first = model[0] if len(model) else None
    tokenizer = getattr(first, "tokenizer", None)
    if not isinstance(first, Transformer) or not getattr(tokenizer, "is_fast", False):
        return None
    if getattr(model, "default_prompt_name", None) or getattr(first, "processing_kwargs", None):
        return None
    if tokenizer.pad_token_id is None:
        return None
    probe = ["densefit probe", "long " * (2 * (model.max_seq_length or 512))]
    try:
        reference = model.preprocess(probe)
        ours = _pad(
            _tokenize(tokenizer, probe), np.arange(2), reference["input_ids"].shape[1], tokenizer
        )
    except Exception:  # noqa: BLE001 - any surprise means: use the general path
        return None
    keys = {k for k, v in reference.items() if isinstance(v, torch.Tensor)}
    if keys != _FEATURE_KEYS & ours.keys() or reference.get("modality", "text") != "text":
        return None
    if set(reference) - keys - {"modality"}:
        return None
    if not all(torch.equal(reference[k], ours[k]) for k in keys):
        return None
    return tokenizer
