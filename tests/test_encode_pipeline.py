"""The GPU's encode pipeline (a producer thread, tokenizer threads, token-sized batches, pinned
non-blocking copies, one synchronisation per gather) gives the plain loop's vectors.

Run on the CPU by switching the pipeline on (``encode._pipelined``); the CUDA-only calls
(pinning, events) are checked with stand-ins here and for real in tests/test_cuda.py.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

import densefit.retrieval.encode as encode
from densefit.retrieval.encode import encode_with_callback, fast_path_tokenizer, token_cuts

TEXTS = [f"cells divide {i} " * (i % 11 + 1) + "python memory batch" for i in range(600)]
TEXTS += ["the protein gene cancer risk " * 40, "a", TEXTS[5]]  # truncated, short, a copy


@pytest.fixture
def pipelined(monkeypatch):
    """Three tokenizer threads on this CPU; :func:`_encode` switches the pipeline on or off."""
    monkeypatch.setattr(encode, "_cores", lambda: 4)
    return monkeypatch


def _encode(model, texts, *, pipeline: bool, **kwargs) -> np.ndarray:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(encode, "_pipelined", lambda model: pipeline)
        return encode_with_callback(model, texts, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"normalize": True},
        {"share": (1, 2)},
        {"prompt_name": "query"},
        {"pass_cost_tokens": 16},
    ],
    ids=["plain", "normalize", "share", "prompt", "pass-cost"],
)
def test_the_pipeline_equals_the_plain_loop_bit_for_bit(tiny, pipelined, kwargs):
    tiny.prompts = {"query": "query: "}
    reference = _encode(tiny, TEXTS, pipeline=False, batch_size=8, **kwargs)
    pipelined.setattr(encode, "_batch_tokens", lambda model, batch_size: None)  # the same cuts
    ours = _encode(tiny, TEXTS, pipeline=True, batch_size=8, **kwargs)
    assert np.array_equal(ours, reference)  # fp32: the same batches, the same bits


def test_the_general_path_and_a_truncated_model_too(tiny, pipelined):
    tiny.truncate_dim = 16
    pipelined.setattr(encode, "fast_path_tokenizer", lambda model: None)
    reference = _encode(tiny, TEXTS[:100], pipeline=False, batch_size=8)
    assert np.array_equal(_encode(tiny, TEXTS[:100], pipeline=True, batch_size=8), reference)


def test_token_sized_batches_hold_more_short_texts_and_never_more_tokens(tiny, pipelined):
    reference = _encode(tiny, TEXTS, pipeline=False, batch_size=8)
    widths = []
    real = encode._batches

    def recording(*args, **kwargs):
        for rows, features in real(*args, **kwargs):
            widths.append(tuple(features["input_ids"].shape))
            yield rows, features

    pipelined.setattr(encode, "_batches", recording)
    ours = _encode(tiny, TEXTS, pipeline=True, batch_size=8)
    budget = 8 * tiny.max_seq_length
    assert all(rows * width <= budget or rows == 1 for rows, width in widths)
    assert max(rows for rows, _ in widths) > 8  # short texts: more than batch_size per pass
    np.testing.assert_allclose(ours, reference, atol=1e-6)  # other batches, same vectors


def test_token_cuts():
    assert token_cuts(np.array([100, 60, 50, 10, 10, 10, 10]), 120) == [0, 1, 3, 7]
    assert token_cuts(np.array([500, 400]), 120) == [0, 1, 2]  # longer than the budget: alone
    assert token_cuts(np.array([], dtype=int), 120) == [0]
    lengths = np.sort(np.random.default_rng(0).integers(1, 300, 1000))[::-1]
    cuts = token_cuts(lengths, 2048)
    assert cuts[0] == 0 and cuts[-1] == 1000
    assert all((b - a) * lengths[a] <= 2048 or b - a == 1 for a, b in zip(cuts, cuts[1:]))


def test_tokenizer_threads_give_the_one_threads_ids_with_their_own_copies(tiny, monkeypatch):
    monkeypatch.setattr(encode, "_cores", lambda: 4)
    tokenizer = fast_path_tokenizer(tiny)
    used = set()
    real = encode._tokenize

    def recording(tok, texts):
        used.add((id(tok), threading.current_thread().name.startswith("densefit-tokenize")))
        return real(tok, texts)

    monkeypatch.setattr(encode, "_tokenize", recording)
    with encode._tokenizer_threads(tokenizer, len(TEXTS), len(TEXTS)) as threads:
        assert threads is not None and threads.workers == 2
        together = threads.tokenize(TEXTS)
    assert together == dict(real(tokenizer, TEXTS))
    assert (id(tokenizer), True) not in used  # the threads never share the model's tokenizer
    with encode._tokenizer_threads(tokenizer, 300, 300) as threads:
        assert threads is None  # one share of texts: no threads


def test_a_producer_error_is_raised_in_the_caller_and_stops_it(tiny, pipelined):
    def broken(*args, **kwargs):
        yield from []
        raise RuntimeError("tokenizer broke")

    pipelined.setattr(encode, "_batches", broken)
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        _encode(tiny, TEXTS[:20], pipeline=True, batch_size=4)
    assert not [t for t in threading.enumerate() if t.name.startswith("densefit-")]


def test_leaving_early_stops_the_producer():
    made = []

    def endless():
        i = 0
        while True:
            made.append(i)
            yield np.array([i]), {}
            i += 1

    with encode._prefetched(endless(), pin=False, depth=2) as produced:
        first = next(iter(produced))
    assert first[0][0] == 0 and len(made) <= 4  # at most depth ahead
    assert not [t for t in threading.enumerate() if t.name == "densefit-encode-producer"]


def test_on_a_gpu_batches_are_pinned_copied_without_blocking_and_gathered_once(tiny, monkeypatch):
    """The CUDA calls of the pipeline, with stand-ins: pinned host memory for every batch,
    non-blocking copies, one event (one synchronisation) per gather of texts."""
    pinned, copies, events = [], [], []

    class Event:
        def record(self):
            events.append("record")

        def synchronize(self):
            events.append("synchronize")

    real_to, real_empty = torch.Tensor.to, torch.empty

    def to(self, *args, **kwargs):
        if sys._getframe(1).f_code.co_filename == encode.__file__:  # the pipeline's own copies
            copies.append(kwargs.get("non_blocking", False))
        return real_to(self, *args, **{k: v for k, v in kwargs.items() if k != "non_blocking"})

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(1) or self)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    texts = TEXTS[:100]
    reference = _encode(tiny, texts, pipeline=False, batch_size=8)
    rows = np.argsort([-len(t) for t in texts], kind="stable")
    tokenizer = fast_path_tokenizer(tiny)
    batches = list(encode._batches(tiny, tokenizer, texts, rows, 8))
    out = np.zeros_like(reference)
    reported = []
    copies.clear()
    with torch.inference_mode():
        encode._embed_pipelined(
            tiny, encode.resolve_runtime(tiny, "torch"), iter(batches), out, lambda e: e,
            reported.append, gather=32, cuda=True,
        )  # fmt: skip
    assert np.array_equal(out, reference)
    assert len(pinned) == 3 * len(batches)  # input ids, attention mask, token types
    assert copies and all(copies)  # every copy to the device: non-blocking
    gathers = -(-len(batches) // 4)  # 8 texts a batch, 32 a gather
    assert events == ["record", "synchronize"] * gathers or sorted(events) == sorted(
        ["record", "synchronize"] * gathers
    )
    assert events.count("synchronize") == gathers < len(batches)
    assert sum(reported) == len(texts)
