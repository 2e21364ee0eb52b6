"""Tests for two wrong implementations the rest of the suite let through.

- The export check's verdict: a quantized file that passes its own check (its queries on its
  documents rank like torch's) but ranks differently when its documents meet fp32 queries must
  not be recorded as agreeing with fp32, or a store embedded by it would be searched with
  fp32 queries (and the reverse) and rank wrongly.
- A rewrite during a model swap: a document rewritten after the swap committed its chunk must
  be embedded again by the new model; an upsert that kept its next-generation row would
  leave it, after the switch, with the new model's vector of its *old* text.

Each was shown to fail with the wrong implementation put back (``passed or ...`` in
``retrieval/export.py`` ``_verdict``; the plain upsert, which keeps ``next_row``, while a
swap is under way in ``retrieval/index/documents.py`` ``DocumentTable.upsert``).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from densefit.data.types import Document
from densefit.models import load_model
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.index import index_documents, open_store
from densefit.retrieval.index.reembed import reembed_store

WORDS = "cell protein python kernel socket river bread music zebra vitamin bone signal".split()


def corpus(n: int) -> list[Document]:
    rng = random.Random(0)
    return [Document(f"d{i}", " ".join(rng.choices(WORDS, k=6))) for i in range(n)]


# -- the export check's verdict --------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path):
    from densefit.testing import tiny_model

    tiny_model(tmp_path / "build", normalize=True).save(str(tmp_path / "model"))
    return tmp_path / "model"


def _export_checked_as(monkeypatch, model_dir, mixed: float) -> dict:
    """Export onnx-int8 for the model in ``model_dir``; its check keeps the measured numbers
    but reports a mixed top-10 overlap of ``mixed`` (fp32 queries on the file's documents
    and the reverse)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from densefit.retrieval import export

    measured = export.check_runtime

    def check(*args, **kwargs):
        numbers = measured(*args, **kwargs)
        return {**numbers, "top10_overlap_mixed": mixed}

    monkeypatch.setattr(export, "check_runtime", check)
    texts = [f"question {i} about {' '.join(corpus(60)[i].text.split()[:3])}" for i in range(60)]
    report = export.export_model(
        load_model(str(model_dir)), "onnx-int8", calibration=texts, on_check_failure="warn"
    )
    return report.exports["onnx-int8"]


def test_an_export_that_passes_its_check_but_ranks_apart_from_fp32_does_not_agree(
    monkeypatch, model_dir, tmp_path
):
    from densefit.retrieval.export import MIN_TOP10_OVERLAP
    from densefit.retrieval.runtimes import TORCH, resolve_runtime
    from densefit.retrieval.vector_source import disagreement

    apart = _export_checked_as(monkeypatch, model_dir, mixed=MIN_TOP10_OVERLAP / 2)
    assert apart["passed"] and apart["check"]["top10_overlap"] >= MIN_TOP10_OVERLAP
    assert apart["agrees_with_fp32"] is False
    model = load_model(str(model_dir))
    source = resolve_runtime(model, "onnx-int8").source
    assert source.agrees_with_fp32 is False
    # a store of fp32 vectors refuses queries from it, and the reverse, saying why
    for stored, given in ((TORCH.source, source), (source, TORCH.source)):
        why = disagreement(stored, given, mixing=False)
        assert why is not None and "did not find that its vectors rank like fp32" in why
    # end to end: torch's store, searched with the file's queries, is refused in one line
    store = tmp_path / "store"
    with open_store(store, model) as opened:
        index_documents(opened, model, corpus(20), runtime="torch")
    from typer.testing import CliRunner

    from densefit.cli.app import app

    result = CliRunner().invoke(
        app, ["search", "--store", str(store), "cell", "--runtime", "onnx-int8"]
    )
    assert result.exit_code == 2 and "rank like fp32" in result.output, result.output

    agreeing = _export_checked_as(monkeypatch, model_dir, mixed=MIN_TOP10_OVERLAP)
    assert agreeing["passed"] and agreeing["agrees_with_fp32"] is True


# -- a rewrite during a model swap ----------------------------------------------------------------


@pytest.fixture(scope="module")
def swap_models(tiny_models) -> tuple:
    return load_model(str(tiny_models / "tiny")), load_model(str(tiny_models / "tiny-other"))


@pytest.mark.parametrize("rewrite", ["text", "delete and write again"])
def test_a_document_rewritten_after_its_chunk_committed_gets_the_new_models_vector_of_its_new_text(
    tmp_path, swap_models, rewrite
):
    """The swap embeds chunks of 4 in row order; once the first chunk is committed (the
    swap asks ``should_stop`` before each next one) ``d1`` is rewritten by a plain upsert,
    the one a writer without the new model makes. After the switch ``d1`` holds the new
    model's vector of its new text, as a fresh index by the new model would."""
    old, new = swap_models
    docs = corpus(16)
    rewritten = Document("d1", "zebra zebra music bread kernel", meta={"v": 2})
    with open_store(tmp_path / "store", old) as store:
        index_documents(store, old, docs)
        asked = []

        def should_stop() -> bool:
            asked.append(True)
            if len(asked) == 2:  # the first chunk (d0..d3) is committed; d1 was in it
                assert store.info()["swap"]["remaining"] == 12
                if rewrite != "text":
                    store.delete(["d1"])
                store.write([rewritten], encode_texts(old, [rewritten.text]))
            return False

        report = reembed_store(store, new, commit_every=4, should_stop=should_stop)
        assert report.switched and store.get(["d1"])[0] == rewritten
        final = [rewritten if d.id == "d1" else d for d in docs]
        fresh = open_store(None, new)
        index_documents(fresh, new, final)
        ids = [d.id for d in docs]
        np.testing.assert_allclose(store.vectors(ids), fresh.vectors(ids), rtol=0, atol=1e-5)
        fresh_of_old_text = open_store(None, new)
        index_documents(fresh_of_old_text, new, docs[1:2])
        assert not np.allclose(store.vectors(["d1"]), fresh_of_old_text.vectors(["d1"]), atol=1e-3)
        assert len(asked) == 5  # four chunks of the 16 documents, then the rewritten one
