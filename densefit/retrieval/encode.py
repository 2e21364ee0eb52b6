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
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from tqdm.auto import tqdm

from densefit.losses.matryoshka import truncate
from densefit.models import eval_mode
from densefit.prompts import apply_prompt, model_prompts, set_prompts
from densefit.retrieval.runtimes import Runtime, resolve_runtime

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
    with eval_mode(model), torch.inference_mode():
        for start in range(0, len(texts), window):
            rows = order[start : start + window]
            for batch_rows, features in _batches(
                model, tokenizer, texts, rows, batch_size, pass_cost_tokens, reused, skip=skip
            ):
                features = {
                    k: v.to(model.device) if isinstance(v, torch.Tensor) else v
                    for k, v in features.items()
                }
                embeddings = runner.embed(model, features)  # (b, full dim)
                embeddings = truncate(embeddings, dim)  # truncate_dim: the Matryoshka cut
                if normalize:
                    embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=1)
                out[batch_rows] = embeddings.float().cpu().numpy()
                if on_batch is not None:
                    on_batch(len(batch_rows))
    return out


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
) -> SentenceTransformer:
    """Set how ``model`` embeds: its query/document prompts (``None``: keep the model's own,
    ``""``: none; :func:`densefit.prompts.set_prompts`) and the Matryoshka size its vectors
    are cut to (``dim``: ``model.truncate_dim``; ``None``: the full size). Returns ``model``.

    >>> from densefit.testing import tiny_model
    >>> model = configure_model(tiny_model(), query_prompt="query: ", dim=16)
    >>> model.prompts["query"], embedding_dimension(model)
    ('query: ', 16)
    """
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
):
    """Yield (rows, features) for one window of texts, batches of similar token length
    (cut by :func:`padding_aware_cuts` when ``pass_cost`` is given); ``reused``: every text's
    token ids, already made (:func:`tokenize_texts`); a batch for which ``skip()`` is true
    (another process's) is cut but not padded nor yielded."""
    if tokenizer is None:
        # General path: the model's own preprocessing, per batch, in character-length order.
        for start in range(0, len(rows), batch_size):
            batch_rows = rows[start : start + batch_size]
            if skip is None or not skip():
                yield batch_rows, model.preprocess([texts[i] for i in batch_rows])
        return
    if reused is None:
        encoded = _tokenize(tokenizer, [texts[i] for i in rows])
    else:
        encoded = {k: [reused[i][k] for i in rows] for k in reused[rows[0]]}
    lengths = np.array([len(ids) for ids in encoded["input_ids"]])
    by_tokens = np.argsort(-lengths, kind="stable")
    if pass_cost is None:
        cuts = [*range(0, len(rows), batch_size), len(rows)]
    else:
        cuts = padding_aware_cuts(lengths[by_tokens], batch_size, pass_cost)
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        if skip is not None and skip():
            continue
        picks = by_tokens[start:end]
        yield rows[picks], _pad(encoded, picks, int(lengths[picks].max()), tokenizer)


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
