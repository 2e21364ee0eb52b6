"""LoRA (peft): every memory strategy gives plain's gradients of the adapters, the planner
counts frozen weights once, the saved model (merged or adapter) embeds as the trained one,
and an interrupted LoRA run resumes to the uninterrupted weights."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from densefit import TrainConfig, train
from densefit.data.types import TrainingExample
from densefit.errors import OptionError
from densefit.losses import mnrl
from densefit.memory import make_strategy, tokenize
from densefit.memory.planner import plan_memory
from densefit.models import (
    apply_lora,
    has_lora,
    load_model,
    lora_parameter_count,
    merge_lora,
    merged_copy,
)

pytest.importorskip("peft")

QUERIES = [("what is the cell " * (i % 5 + 1)) + str(i) for i in range(12)]
DOCS = [("the protein gene cancer risk " * (i % 7 + 1)) + str(i) for i in range(12)]
NEGS = [("python function class " * (i % 3 + 1)) + str(i) for i in range(12)]
COLUMNS = [QUERIES, DOCS, NEGS]
LORA = TrainConfig(lora_r=4, lora_alpha=8, show_progress=False)


def loss_fn(emb):
    return mnrl(emb[0], emb[1], emb[2], symmetric=True)


def lora_model(tiny, config=LORA):
    """``tiny`` with adapters whose B matrices are not zero (so gradients reach A too)."""
    apply_lora(tiny, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in tiny.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return tiny


def trainable_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def run(model, strategy_name, chunk=None, seed=1, **kw):
    model = copy.deepcopy(model)
    model.train()
    strategy = make_strategy(strategy_name, chunk, **kw)
    strategy.prepare(model)
    torch.manual_seed(seed)
    stats = strategy.forward_backward(model, COLUMNS, loss_fn)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    return stats.loss, trainable_grads(model)


def no_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def test_only_the_adapters_train(tiny):
    trainable, total = lora_parameter_count(tiny)
    assert trainable == total
    apply_lora(tiny, LORA)
    trainable, total = lora_parameter_count(tiny)
    assert 0 < trainable < total / 10
    names = [n for n, p in tiny.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert has_lora(tiny)
    apply_lora(tiny, LORA)  # a second call attaches nothing more
    assert lora_parameter_count(tiny)[0] == trainable


@pytest.mark.parametrize("name", ["cache", "cache+checkpoint", "checkpoint"])
@pytest.mark.parametrize("chunk", [1, 5])
def test_strategies_equal_plain_with_dropout_and_identical_chunks(tiny, name, chunk):
    """LoRA dropout on as well: same chunks, RNG replayed, the same adapter gradients."""
    model = lora_model(tiny, dataclasses.replace(LORA, lora_dropout=0.1))
    ref_loss, ref = run(model, "plain", chunk)
    loss, got = run(model, name, chunk)
    assert abs(loss - ref_loss) < 1e-5
    assert ref.abs().sum() > 0
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["cache", "checkpoint", "cache+checkpoint"])
def test_strategies_equal_one_padded_batch_without_dropout(tiny, name):
    model = lora_model(tiny)
    no_dropout(model)
    reference = copy.deepcopy(model)
    reference.train()
    loss = loss_fn([reference(tokenize(reference, c))["sentence_embedding"] for c in COLUMNS])
    loss.backward()
    for chunk, kwargs in ((3, {}), (None, {"token_budget": 40})):
        got_loss, got = run(model, name, chunk, **kwargs)
        assert abs(got_loss - loss.item()) < 1e-5
        torch.testing.assert_close(got, trainable_grads(reference), atol=1e-5, rtol=1e-4)


def rows(n=16):
    return [TrainingExample(q, d) for q, d in zip(QUERIES * 2, DOCS * 2, strict=True)][:n]


def test_planner_counts_frozen_weights_once(tiny):
    config = TrainConfig(batch_size=8, memory="auto", memory_budget="4GiB", show_progress=False)
    base = lora_parameter_count(tiny)[1]
    # held_bytes=0: the plan of the model alone, whatever this process holds already
    full = plan_memory(copy.deepcopy(tiny), rows(), config, held_bytes=0).static_bytes
    adapted = plan_memory(apply_lora(tiny, LORA), rows(), config, held_bytes=0).static_bytes
    trainable, total = lora_parameter_count(tiny)
    assert total == base + trainable
    assert full == 16 * base  # weight, gradient, two AdamW moments: fp32 each
    assert adapted == 16 * trainable + 4 * base  # frozen: the weight alone


def test_the_optimizer_holds_the_adapters_only(tiny, tmp_path):
    config = dataclasses.replace(LORA, batch_size=4, max_steps=2, learning_rate=1e-2)
    apply_lora(tiny, config)
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    train(tiny, rows(), config)
    after = tiny.state_dict()
    changed = [k for k in after if k in before and not torch.equal(before[k], after[k])]
    assert changed and all("lora_" in k for k in changed)


def embed(model, texts=QUERIES):
    model.eval()
    with torch.no_grad():
        return model.encode(texts, convert_to_tensor=True)


def test_saved_merged_model_loads_anywhere_and_embeds_as_trained(tiny, tmp_path):
    from sentence_transformers import SentenceTransformer

    config = dataclasses.replace(LORA, batch_size=4, max_steps=3, learning_rate=1e-2)
    train(tiny, rows(), config, output_dir=tmp_path / "out")
    assert has_lora(tiny)  # the in-memory model keeps its adapters; the saved one is merged
    trained = embed(tiny)
    saved = SentenceTransformer(str(tmp_path / "out"), device="cpu")
    assert not any("lora" in k for k in saved.state_dict())
    torch.testing.assert_close(embed(saved), trained, atol=1e-5, rtol=1e-4)
    merge_lora(tiny)
    assert not has_lora(tiny) and all(p.requires_grad for p in tiny.parameters())
    torch.testing.assert_close(embed(tiny), trained, atol=1e-5, rtol=1e-4)


def test_saved_adapter_is_small_and_loads_with_its_base(tmp_path):
    from densefit.testing import tiny_model

    base = tiny_model(tmp_path / "base")
    config = dataclasses.replace(
        LORA, batch_size=4, max_steps=3, learning_rate=1e-2, save_adapter=True
    )
    model = load_model(tmp_path / "base")
    train(model, rows(), config, output_dir=tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files
    loaded = load_model(tmp_path / "adapter", device="cpu")
    assert not has_lora(loaded)
    torch.testing.assert_close(embed(loaded), embed(merged_copy(model)), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(embed(loaded), embed(base), atol=1e-4)


def test_lora_options_without_lora_r_are_an_error(tiny):
    with pytest.raises(OptionError) as caught:
        apply_lora(tiny, TrainConfig(lora_alpha=8))
    assert caught.value.for_cli().startswith(
        "--lora-alpha configure LoRA, which is off: add --lora-r"
    )
    with pytest.raises(OptionError, match="lora_dropout must be below 1"):
        TrainConfig(lora_r=4, lora_dropout=1.0)


def test_unknown_target_modules_are_a_one_line_error(tiny):
    with pytest.raises(OptionError) as caught:
        apply_lora(tiny, TrainConfig(lora_r=4, lora_target_modules="nope"))
    assert "--lora-target-modules" in caught.value.for_cli()
    assert "\n" not in caught.value.for_cli()


def test_missing_peft_is_the_pip_install_line(tiny, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(ImportError, match=r"pip install 'densefit\[lora\]'"):
        apply_lora(tiny, LORA)


def test_resumed_lora_run_ends_with_the_uninterrupted_weights(tmp_path):
    from densefit.testing import tiny_model

    config = dataclasses.replace(
        LORA, batch_size=4, epochs=2, learning_rate=1e-2, checkpoint_every=2
    )
    whole = tiny_model(tmp_path / "a")
    train(whole, rows(), config, output_dir=tmp_path / "whole")

    class Crash(Exception):
        pass

    def crash_at_3(record):
        if record["step"] == 3:
            raise Crash

    first = tiny_model(tmp_path / "b")
    with pytest.raises(Crash):
        train(first, rows(), config, output_dir=tmp_path / "cut", on_step=crash_at_3)
    resumed = tiny_model(tmp_path / "c")
    train(resumed, rows(), config, output_dir=tmp_path / "cut", resume=True)
    a, b = whole.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and any("lora_" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def no_progress_bars():
    """transformers draws a 'Loading weights' bar on stderr: not ours, not counted."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    yield
    logging.enable_progress_bar()


def test_the_cli_trains_lora_and_its_errors_are_one_line(tmp_path, no_progress_bars):
    import json

    from typer.testing import CliRunner

    from densefit.cli import app
    from densefit.testing import tiny_model

    tiny_model(tmp_path / "model")
    rows_file = tmp_path / "pairs.jsonl"
    rows_file.write_text("".join(json.dumps({"anchor": q, "positive": d}) + "\n"
                                 for q, d in zip(QUERIES, DOCS, strict=True)))  # fmt: skip
    base = ["train", str(rows_file), "-m", str(tmp_path / "model"), "--max-steps", "2",
            "--batch-size", "4", "--no-progress"]  # fmt: skip
    runner = CliRunner()
    ok = runner.invoke(app, [*base, "-o", str(tmp_path / "out"), "--lora-r", "4"])
    assert ok.exit_code == 0, ok.output
    assert "LoRA r=4 alpha=8 (saved merged)" in " ".join(ok.stderr.split())
    assert (tmp_path / "out" / "model.safetensors").is_file()
    for extra, expected in (
        (["--lora-alpha", "3"], "--lora-alpha configure LoRA, which is off: add --lora-r"),
        (["--lora-r", "4", "--lora-target-modules", "foo"], "--lora-target-modules"),
        (["--lora-r", "0"], "--lora-r must be >= 1"),
        (["--lora-r", "4", "--lora-dropout", "1"], "--lora-dropout must be below 1"),
    ):
        result = runner.invoke(app, [*base, "-o", str(tmp_path / "bad"), *extra])
        lines = result.stderr.splitlines()
        assert result.exit_code == 2, (extra, result.output)
        assert len(lines) == 1 and expected in lines[0], result.stderr
