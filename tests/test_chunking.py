"""Tokenising a column in slices gives the tensors of one call."""

import torch

from densefit.memory import tokenize


def test_tokenize_in_slices_equals_one_call(tiny):
    texts = [("word " * n).strip() for n in (3, 40, 1, 7, 120, 2, 9, 60, 5)]
    whole = tiny.preprocess(texts)
    sliced = tokenize(tiny, texts, slice_size=2)
    assert set(sliced) == set(whole)
    for key, value in whole.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(sliced[key], value), key
        else:
            assert sliced[key] == value
