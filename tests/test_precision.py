"""--precision: the torch runtime at fp16 / bf16 from a cast copy of the weights, checked
against fp32, chosen by ``auto`` per device or by the store, recorded in the store."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from densefit.choices import AUTO_PRECISION, PRECISION_CHOICES
from densefit.data.types import Document
from densefit.retrieval.encode import configure_model, encode_texts
from densefit.retrieval.index import open_store
from densefit.retrieval.index.indexing import index_documents
from densefit.retrieval.index.searching import search_batch
from densefit.retrieval.runtimes import (
    HALF_COSINE,
    TORCH,
    RuntimeUnavailableError,
    VectorSource,
    auto_candidates,
    model_precision,
    resolve_precision,
    resolve_runtime,
    set_precision,
)
from densefit.testing import tiny_model

TEXTS = [f"cells divide {i} " * (i % 7 + 1) + "python memory batch" for i in range(40)]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_reproduces_fp32_and_leaves_the_model_alone(tiny, precision):
    weights = {k: v.clone() for k, v in tiny.state_dict().items()}
    fp32 = encode_texts(tiny, TEXTS, batch_size=8)
    set_precision(tiny, precision)
    runner = resolve_runtime(tiny, "torch")
    assert runner.source == VectorSource("torch", precision, None, True, precision)
    assert runner.record["probe_cosine"] >= HALF_COSINE
    half = encode_texts(tiny, TEXTS, batch_size=8)
    assert half.dtype == np.float32 and np.isfinite(half).all()
    assert _cosines(half, fp32).min() >= HALF_COSINE
    assert not np.array_equal(half, fp32)  # it did run at the lower precision
    for name, value in tiny.state_dict().items():  # the model's own weights: untouched
        assert value.dtype == weights[name].dtype and torch.equal(value, weights[name])
    assert resolve_runtime(tiny, "auto") is runner  # remembered while the weights stay


def test_the_copy_follows_the_weights(tiny):
    set_precision(tiny, "bf16")
    first = resolve_runtime(tiny, "torch")
    with torch.no_grad():
        next(tiny.parameters()).mul_(1.5)  # an optimizer step, say
    assert resolve_runtime(tiny, "torch") is not first


def test_fp32_is_the_plain_torch_runtime(tiny):
    assert model_precision(tiny) == "fp32"  # nothing set: as before
    assert resolve_runtime(tiny, "torch") is TORCH
    set_precision(tiny, "fp32")
    assert resolve_runtime(tiny, "auto") is TORCH


def test_auto_is_the_devices_default_or_the_stores(tiny, monkeypatch):
    set_precision(tiny, "auto")
    assert resolve_precision(tiny) == AUTO_PRECISION["cpu"] == "fp32"
    monkeypatch.setattr(type(tiny), "device", property(lambda self: torch.device("cuda")))
    assert resolve_precision(tiny) == AUTO_PRECISION["cuda"]
    monkeypatch.undo()
    stored = VectorSource("torch", "bf16", None, True, "bf16")
    assert resolve_precision(tiny, stored=stored, mixing=True) == "bf16"  # adding documents
    assert resolve_precision(tiny, stored=stored, mixing=False) == "fp32"  # queries
    assert resolve_precision(tiny, "onnx", stored=stored, mixing=True) == "fp32"  # an export
    set_precision(tiny, "fp16")
    assert resolve_precision(tiny, stored=stored, mixing=True) == "fp16"  # asked for: kept


def test_a_named_export_with_half_precision_is_refused(tiny):
    set_precision(tiny, "fp16")
    with pytest.raises(RuntimeUnavailableError, match="--precision fp16 runs the model in torch"):
        resolve_runtime(tiny, "onnx")
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, fp16, bf16"):
        set_precision(tiny, "int4")


def test_a_failed_check_refuses_the_named_precision_and_auto_falls_back(tiny, monkeypatch):
    import densefit.retrieval.runtimes as runtimes

    monkeypatch.setattr(runtimes, "fp32_agreement", lambda model, runtime: float("nan"))
    set_precision(tiny, "fp16")
    with pytest.raises(RuntimeUnavailableError, match="do not reproduce fp32.*fp32 or bf16"):
        resolve_runtime(tiny, "torch")
    set_precision(tiny, "auto")  # auto asked for bf16 by a store: fp32 instead of failing
    stored = VectorSource("torch", "bf16", None, True, "bf16")
    assert resolve_runtime(tiny, "torch", stored=stored, mixing=True) is TORCH


def test_the_store_records_the_precision_and_auto_keeps_it(tiny):
    docs = [Document(f"d{i}", t) for i, t in enumerate(TEXTS)]
    model = configure_model(tiny, precision="bf16")
    store = open_store(None, model)
    report = index_documents(store, model, docs[:20])
    assert report.runtime == "torch bf16"
    assert store.settings.source.precision == "bf16" and store.settings.source.family == "bf16"
    set_precision(model, "auto")  # adding more: auto takes the store's precision
    assert index_documents(store, model, docs[20:]).runtime == "torch bf16"
    assert store.settings.source.precision == "bf16"
    set_precision(model, "fp32")  # queries in fp32 search bf16 documents (its check agreed)
    fp32_hits = search_batch(store, model, TEXTS[:5], top_k=3)
    set_precision(model, "bf16")
    bf16_hits = search_batch(store, model, TEXTS[:5], top_k=3)
    assert [h[0].id for h in fp32_hits] == [h[0].id for h in bf16_hits]
    set_precision(model, "fp32")  # but documents of one store are one precision
    with pytest.raises(
        ValueError, match="embedded in bf16, this run embeds in fp32.*--precision bf16"
    ):
        index_documents(store, model, [Document("x", "memory batch")])
    index_documents(store, model, docs, reembed=True)  # or every document again, in fp32
    assert store.settings.source == TORCH.source


def test_a_store_entry_without_a_precision_reads_as_fp32():
    old = json.dumps({"runtime": "torch", "family": "fp32", "file": None, "agrees_with_fp32": True})
    assert VectorSource.from_json(old) == VectorSource() == TORCH.source
    half = VectorSource("torch", "fp16", None, True, "fp16")
    assert VectorSource.from_json(half.to_json()) == half
    assert half.describe() == "torch fp16" and TORCH.source.describe() == "torch"


def test_serve_auto_times_only_the_half_runtime(tiny):
    set_precision(tiny, "bf16")
    assert [(r.name, r.source.precision) for r in auto_candidates(tiny)] == [("torch", "bf16")]


def test_the_option_is_one_declaration_everywhere():
    from densefit.config.commands import IndexJob, ReembedJob, SearchJob
    from densefit.config.evaluation import EvalConfig
    from densefit.config.mine import MineConfig
    from densefit.config.options import option_of
    from densefit.serve.config import ServeConfig

    declared = option_of(IndexJob, "precision")
    assert declared.choice_list() == PRECISION_CHOICES
    for cls in (ReembedJob, SearchJob, EvalConfig, MineConfig, ServeConfig):
        assert option_of(cls, "precision") is declared
        assert cls.__dataclass_fields__["precision"].default == "auto"
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, fp16, bf16"):
        SearchJob(queries=["q"], store="s", precision="fp8")


def test_index_and_search_commands_take_the_precision(tmp_path):
    from typer.testing import CliRunner

    from densefit.cli import app

    tiny_model(tmp_path / "build").save(str(tmp_path / "model"))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"_id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS))
    )
    store = str(tmp_path / "store")
    runner = CliRunner()
    index = ["index", str(corpus), "-m", str(tmp_path / "model"), "--store", store]
    result = runner.invoke(app, [*index, "--precision", "bf16", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "torch bf16" in result.stderr
    found = runner.invoke(
        app, ["search", TEXTS[3], "--store", store, "--precision", "fp16", "--json"]
    )
    assert found.exit_code == 0, found.output
    assert json.loads(found.stdout)[0]["hits"][0]["id"] == "d3"


def test_serve_embeds_queries_at_its_precision_and_refuses_writes_of_another(tiny):
    """serve --precision fp16 on an fp32 store: its queries search it, its writes are refused
    with the reason (documents of one store are one precision)."""
    from densefit.retrieval.index.types import SettingsMismatchError
    from densefit.serve.config import ServeConfig
    from densefit.serve.swap import query_state_maker

    store = open_store(None, tiny)
    index_documents(store, tiny, [Document(f"d{i}", t) for i, t in enumerate(TEXTS)])
    state = query_state_maker(store, ServeConfig(precision="fp16"))(tiny)
    assert resolve_runtime(tiny, state.runtime).source.precision == "fp16"
    with pytest.raises(SettingsMismatchError, match="cannot add documents: .*embedded in fp32"):
        state.encode_documents(["a new document"])
    state = query_state_maker(store, ServeConfig())(tiny)  # auto: the store's, writes allowed
    assert state.encode_documents(["a new document"]).shape == (1, 32)
