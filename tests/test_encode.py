"""encode_texts equals SentenceTransformer.encode, in input order, on both code paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from densefit.retrieval.encode import encode_texts, encode_with_callback, fast_path_tokenizer

TEXTS = [
    "cells",
    "",
    "the protein gene cancer risk " * 40,  # longer than max_seq_length: truncated
    "What does a vaccine dose do?",
    "python function return value list string file error data model train",
    "a b c",
    "banana apple",
] * 3


def test_matches_sentence_transformers_encode(tiny):
    assert fast_path_tokenizer(tiny) is not None  # the tokenize-once path is taken
    ours = encode_texts(tiny, TEXTS, batch_size=4)
    reference = tiny.encode(TEXTS, batch_size=4, convert_to_numpy=True)
    assert ours.dtype == np.float32 and ours.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_general_path_matches_too(tiny, monkeypatch):
    import densefit.retrieval.encode as encode

    monkeypatch.setattr(encode, "fast_path_tokenizer", lambda model: None)
    np.testing.assert_allclose(
        encode_texts(tiny, TEXTS, batch_size=3), tiny.encode(TEXTS, batch_size=3), atol=1e-5
    )


def test_rows_follow_input_order_whatever_the_batching(tiny):
    alone = np.stack([encode_texts(tiny, [t])[0] for t in TEXTS[:7]])
    for batch_size in (1, 2, 5, 64):
        np.testing.assert_allclose(
            encode_texts(tiny, TEXTS[:7], batch_size=batch_size), alone, atol=1e-5
        )


def test_normalize(tiny):
    vectors = encode_texts(tiny, TEXTS[:5], normalize=True)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_eval_mode_inside_training_mode_restored(tiny):
    tiny.train()  # dropout 0.1: train-mode outputs would differ run to run
    first = encode_texts(tiny, TEXTS[:4])
    assert tiny.training
    np.testing.assert_array_equal(first, encode_texts(tiny, TEXTS[:4]))


def test_each_module_gets_its_own_mode_back(tiny):
    tiny.train()
    frozen = tiny[0].auto_model.embeddings
    frozen.eval()  # a half-frozen model: its embeddings in eval mode while the rest trains
    reference = encode_texts(tiny, TEXTS[:4])
    modes = {name: m.training for name, m in tiny.named_modules()}
    tiny.eval()
    np.testing.assert_array_equal(encode_texts(tiny, TEXTS[:4]), reference)  # eval ran
    tiny.train()
    frozen.eval()
    encode_texts(tiny, TEXTS[:4])
    assert {name: m.training for name, m in tiny.named_modules()} == modes
    assert not frozen.training and tiny[0].auto_model.encoder.training


def test_a_model_in_eval_mode_is_left_alone(tiny, monkeypatch):
    # Setting every submodule's mode costs about a millisecond on a 6-layer model, twice a
    # call: a one-query search would pay it each time.
    tiny.eval()
    calls = []
    monkeypatch.setattr(torch.nn.Module, "train", lambda self, mode=True: calls.append(mode))
    encode_texts(tiny, TEXTS[:4])
    assert calls == []


def test_no_autograd_graph(tiny):
    seen = []
    tiny.register_forward_hook(
        lambda module, inputs, output: seen.append(torch.is_inference_mode_enabled())
    )
    encode_texts(tiny, ["cells"])
    assert seen == [True]


def test_empty_input_and_errors(tiny):
    assert encode_texts(tiny, []).shape == (0, 32)
    with pytest.raises(TypeError, match="list of texts"):
        encode_texts(tiny, "one string")
    with pytest.raises(TypeError, match=r"texts\[1\] is a int"):
        encode_texts(tiny, ["ok", 3])
    with pytest.raises(ValueError, match="batch_size"):
        encode_texts(tiny, ["ok"], batch_size=0)


def record_widths(model, monkeypatch) -> list[tuple]:
    """Every forward pass's real lengths (tokens per row), in the order the passes ran."""
    widths = []
    original = model.forward

    def spy(features, **kwargs):
        widths.append(tuple(features["attention_mask"].sum(dim=1).tolist()))
        return original(features, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    return widths


def test_batches_are_length_sorted(tiny, monkeypatch):
    widths = record_widths(tiny, monkeypatch)
    texts = [("cells " * n).strip() for n in (1, 30, 2, 29, 3, 28, 4, 27)]
    encode_texts(tiny, texts, batch_size=2)
    # Longest first, and each batch pairs texts of neighbouring lengths.
    assert all(max(w) - min(w) <= 1 for w in widths)
    assert [max(w) for w in widths] == sorted((max(w) for w in widths), reverse=True)


def test_padding_aware_batches_split_off_long_texts(tiny, monkeypatch):
    widths = record_widths(tiny, monkeypatch)
    texts = [("cells " * n + f"gene{i}").strip() for i, n in enumerate((40, 2, 3, 2, 3, 2, 3, 2))]
    got = encode_texts(tiny, texts, batch_size=len(texts), pass_cost_tokens=8)
    # The long text goes alone: padding seven short ones to its width costs more than a pass.
    assert [len(w) for w in widths] == [1, 7]
    assert sum(len(w) for w in widths) == len(texts)
    np.testing.assert_allclose(got, encode_texts(tiny, texts, batch_size=1), atol=1e-5)
    widths.clear()
    encode_texts(tiny, texts[1:], batch_size=len(texts), pass_cost_tokens=8)
    assert len(widths) == 1  # similar lengths stay in one pass


def test_padding_aware_cuts_respect_batch_size():
    from densefit.retrieval.encode import padding_aware_cuts

    cuts = padding_aware_cuts(np.full(10, 5), 4, pass_cost=1000)
    assert cuts[0] == 0 and cuts[-1] == 10
    assert max(b - a for a, b in zip(cuts, cuts[1:])) <= 4 and len(cuts) == 4
    assert padding_aware_cuts(np.array([], dtype=int), 4, pass_cost=1) == [0]


def test_callback_counts_every_text(tiny):
    done = []
    encode_with_callback(tiny, TEXTS[:7], batch_size=4, on_batch=done.append)  # distinct
    assert done == [4, 3]


def test_show_progress_does_not_change_results(tiny, capsys):
    np.testing.assert_array_equal(
        encode_texts(tiny, TEXTS, show_progress=True), encode_texts(tiny, TEXTS)
    )


@pytest.mark.slow
def test_matches_minilm(minilm):
    texts = TEXTS[:7] + ["0-dimensional biomaterials show inductive properties."]
    np.testing.assert_allclose(
        encode_texts(minilm, texts), minilm.encode(texts, batch_size=64), atol=1e-5
    )


def test_changing_max_seq_length_is_noticed(tiny):
    encode_texts(tiny, TEXTS[:3])  # the fast-path decision is cached on the model...
    tiny.max_seq_length = 8  # ...and must be revisited when truncation changes
    np.testing.assert_allclose(encode_texts(tiny, TEXTS), tiny.encode(TEXTS), atol=1e-5)


def test_identical_texts_get_identical_rows(tiny):
    texts = ["cells divide", "python", "cells divide", "a b c " * 20, "python", "cells divide"]
    done = []
    vectors = encode_with_callback(tiny, texts, batch_size=2, on_batch=done.append)
    assert (vectors[0] == vectors[2]).all() and (vectors[0] == vectors[5]).all()
    assert (vectors[1] == vectors[4]).all()
    assert sum(done) == len(texts)  # duplicates still count as done
    np.testing.assert_allclose(vectors, tiny.encode(texts), atol=1e-5)
