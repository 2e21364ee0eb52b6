import copy
import json
import warnings

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from densefit import Retriever, TrainConfig, TrainingExample, train
from densefit.data.batching import batches

ROWS = [
    TrainingExample(
        f"what is the cell {i} " * (i % 3 + 1),
        f"the protein gene {i} " * (i % 5 + 1),
        (f"python function {i}",),
        score=float(i % 4),
        origin=f"mem:{i}",
    )
    for i in range(24)
]


def cfg(**kw):
    """The tests' config: plain memory (these tests are about one strategy; the planner has its
    own tests), no progress bars."""
    return TrainConfig(**{"batch_size": 8, "memory": "plain", "show_progress": False, **kw})


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_train_saves_st_model_log_and_config(tiny, tmp_path):
    out = tmp_path / "out"
    result = train(tiny, ROWS, cfg(epochs=2), output_dir=out)
    assert result.steps == 6 and result.examples == 48
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 7))
    for key in ("loss", "lr", "examples_per_s", "padding_efficiency", "peak_rss_mb", "grad_norm"):
        assert key in log[0]
    config = json.loads((out / "densefit_config.json").read_text())
    assert config["batch_size"] == 8 and config["steps"] == 6
    # loads unchanged in sentence-transformers, same embeddings
    loaded = SentenceTransformer(str(out), device="cpu")
    texts = ["what is the cell", "python"]
    np.testing.assert_allclose(loaded.encode(texts), tiny.encode(texts), atol=1e-6)


def test_same_seed_same_weights_and_cache_equals_plain(tiny):
    """Two steps with dropout on: the cached run ends with the plain run's weights, at a
    learning rate whose update (about 1e-3 per weight) is a thousand times the tolerance."""
    start = weights(tiny)
    a, b, c = copy.deepcopy(tiny), copy.deepcopy(tiny), copy.deepcopy(tiny)
    config = dict(max_steps=2, chunk_size=3, learning_rate=1e-3)
    train(a, ROWS, cfg(**config))
    train(b, ROWS, cfg(**config))
    train(c, ROWS, cfg(**config, memory="cache"))
    assert torch.equal(weights(a), weights(b))
    moved = (weights(a) - start).abs()
    assert moved.median() > 1e-4, moved.median()  # nearly every weight moved, by far more
    torch.testing.assert_close(weights(c), weights(a), atol=1e-6, rtol=0)


def test_margin_mse_trains_and_needs_scores():
    """The step's loss is margin-MSE of the first batch's embeddings (dropout off), by hand."""
    from densefit.data.batching import columns_of, epoch_batches
    from densefit.losses import margin_mse
    from densefit.testing import tiny_model

    model = tiny_model(dropout=0.0)
    config = cfg(loss="margin_mse", max_steps=2)
    rows = [ROWS[i] for i in epoch_batches(ROWS, config, 0)[0]]
    with torch.no_grad():
        a, p, n = (
            torch.as_tensor(model.encode(col, convert_to_tensor=True)) for col in columns_of(rows)
        )
    expected = margin_mse(a, p, n, torch.tensor([r.score for r in rows]))
    result = train(model, ROWS, config)
    assert result.losses[0] == pytest.approx(float(expected), rel=1e-4)
    assert result.losses[1] != result.losses[0]
    rows = [TrainingExample("q", "p", (), origin="data.jsonl:7")]
    with pytest.raises(ValueError, match=r"data.jsonl:7.*margin_mse"):
        train(model, rows, cfg(loss="margin_mse"))


def test_gradient_accumulation_warns_it_adds_no_negatives(tiny):
    with pytest.warns(UserWarning, match="does not add in-batch negatives"):
        result = train(tiny, ROWS, cfg(gradient_accumulation_steps=2, max_steps=1))
    assert result.examples == 8


def out_of_memory_after_the_work(monkeypatch, above: int) -> list[int]:
    """Make the cache raise CUDA's out-of-memory error *after* a forward-backward with a chunk
    above ``above`` rows has left its gradients in ``.grad``; the chunk sizes tried."""
    from densefit.memory.strategies import CachedStrategy

    original = CachedStrategy.forward_backward
    calls = []

    def flaky(self, *args, **kwargs):
        calls.append(self.chunk_size)
        stats = original(self, *args, **kwargs)  # the attempt's whole gradient is in .grad
        if self.chunk_size > above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return stats

    monkeypatch.setattr(CachedStrategy, "forward_backward", flaky)
    return calls


def test_out_of_memory_halves_chunk_and_redoes_step(tiny, monkeypatch):
    """A step that ran out of memory twice, each time after its attempt had accumulated
    gradients (dropout on), ends as the same step of a run started with the halved chunk:
    each redone attempt starts from zeroed gradients and replays the random stream."""
    start = weights(tiny)
    halved = copy.deepcopy(tiny)
    calls = out_of_memory_after_the_work(monkeypatch, above=2)
    logged = []
    config = cfg(memory="cache", chunk_size=8, max_steps=2, learning_rate=1e-3)
    with pytest.warns(RuntimeWarning, match="out of memory"):
        result = train(tiny, ROWS, config, on_step=logged.append)
    assert result.steps == 2
    assert calls == [8, 4, 2, 2]
    assert logged[0]["chunk_size"] == 2 and logged[0]["oom_retries"] == 2
    monkeypatch.undo()
    reference = []
    train(halved, ROWS, cfg(memory="cache", chunk_size=2, max_steps=2, learning_rate=1e-3),
          on_step=reference.append)  # fmt: skip
    assert [r["grad_norm"] for r in logged] == [r["grad_norm"] for r in reference]
    assert [r["loss"] for r in logged] == [r["loss"] for r in reference]
    assert torch.equal(weights(tiny), weights(halved))  # exactly: 0.0 difference
    assert (weights(tiny) - start).abs().max() > 1e-4  # and the steps did move the model


def test_bf16_autocast_on_cpu_and_fp16_needs_cuda(tiny):
    """The encoder's matrix products really run in bf16 under --amp bf16, in fp32 without."""
    linear = next(m for m in tiny.modules() if isinstance(m, torch.nn.Linear))
    seen = []
    handle = linear.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    try:
        result = train(copy.deepcopy(tiny), ROWS, cfg(max_steps=1))  # the copy: no hook
        train(tiny, ROWS, cfg(max_steps=1))
        assert seen and set(seen) == {torch.float32}
        seen.clear()
        bf16 = train(tiny, ROWS, cfg(amp="bf16", max_steps=1))
        assert seen and set(seen) == {torch.bfloat16}
    finally:
        handle.remove()
    assert np.isfinite(bf16.final_loss) and bf16.final_loss != result.final_loss
    with pytest.raises(ValueError, match="fp16 needs a CUDA"):
        train(tiny, ROWS, cfg(amp="fp16", max_steps=1))


def test_gradient_checkpointing_switch(tiny):
    from densefit.models import is_checkpointing

    train(tiny, ROWS, cfg(gradient_checkpointing=True, max_steps=1))
    assert is_checkpointing(tiny)


def test_batches_cover_every_row_once_per_epoch():
    for epoch in range(3):
        order = [i for b in batches(23, 5, seed=1, epoch=epoch) for i in b]
        assert sorted(order) == list(range(23))
    assert batches(23, 5, seed=1, epoch=0) != batches(23, 5, seed=1, epoch=1)


def test_bad_config_values_are_clear():
    with pytest.raises(ValueError, match="loss must be"):
        TrainConfig(loss="triplet")
    with pytest.raises(ValueError, match="memory must be"):
        TrainConfig(memory="huge")
    with pytest.raises(ValueError, match="memory size"):
        TrainConfig(memory_budget="lots")


def test_retriever_haystack_style_api(tiny, tmp_path):
    retriever = Retriever(tiny)
    data = [
        {"question": "what is the cell", "pos_doc": "the cell is a unit", "neg_doc": "python"},
        {"question": "python list", "pos_doc": "a list is a python value", "neg_doc": "cells"},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, nothing to warn about
        result = retriever.train(
            data, n_epochs=2, batch_size=2, learning_rate=1e-4, show_progress=False
        )
    assert result.steps == 2
    saved = retriever.save(tmp_path / "saved")
    loaded = Retriever(str(saved))
    np.testing.assert_allclose(
        loaded.embed_queries(["what is the cell"]),
        retriever.embed_queries(["what is the cell"]),
        atol=1e-6,
    )
    assert retriever.embed_documents([{"content": "x", "title": "t"}, "y"]).shape == (2, 32)
    with pytest.raises(TypeError, match="list of texts"):
        retriever.embed_queries("one string")


@pytest.mark.slow
def test_real_minilm_loss_goes_down(minilm, shared_datasets):
    """A few steps on SciFact pairs: the training loss falls on the packaged MiniLM."""
    from densefit.data.readers import read_training_data

    rows, _ = read_training_data(shared_datasets / "scifact", split="train")
    model = copy.deepcopy(minilm)
    fixed = rows[:16]
    result = train(
        model,
        fixed,
        cfg(
            batch_size=16,
            max_steps=4,
            learning_rate=5e-5,
            max_seq_length=64,
            warmup_steps=0,
            seed=0,
        ),
    )
    assert result.losses[-1] < result.losses[0]
