"""The Haystack retrievers embedding the query text themselves, through ``runtime=``: onnx
ranks as torch does, the runtime is serialised, a bad one is a ValueError, and the store's
rule for vectors of different runtimes applies as in ``densefit search --runtime``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("haystack")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from haystack import Document, Pipeline  # noqa: E402

from densefit.data.types import Document as DensefitDocument  # noqa: E402
from densefit.integrations.haystack import (  # noqa: E402
    DensefitDocumentStore,
    DensefitEmbeddingRetriever,
    DensefitHybridRetriever,
)
from densefit.models import load_model  # noqa: E402
from densefit.retrieval.encode import encode_texts  # noqa: E402
from densefit.retrieval.export import export_model  # noqa: E402
from densefit.retrieval.index import open_store  # noqa: E402
from densefit.retrieval.index.types import SettingsMismatchError  # noqa: E402
from densefit.retrieval.vector_source import VectorSource  # noqa: E402
from densefit.testing import tiny_model  # noqa: E402

WORDS = "cells genes python function memory batch vaccine dose search query protein".split()
QUERIES = ["cells genes", "python function memory", "vaccine dose", "search query batch"]


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny model with its onnx (fp32) export beside it."""
    root = tmp_path_factory.mktemp("haystack-runtime")
    tiny_model(root / "build", normalize=True).save(str(root / "model"))
    export_model(load_model(root / "model", device="cpu"), ["onnx"])
    return root / "model"


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, device="cpu")


def _documents(model) -> list[Document]:
    texts = _texts(40)
    vectors = encode_texts(model, texts, prompt_name="document")
    return [
        Document(id=f"d{i}", content=t, meta={"n": i}, embedding=v.tolist())
        for i, (t, v) in enumerate(zip(texts, vectors, strict=True))
    ]


@pytest.fixture
def store(tmp_path, model_dir, model):
    store = DensefitDocumentStore(tmp_path / "store", model=str(model_dir))
    store.write_documents(_documents(model))
    return store


def _ids(result) -> list[str]:
    return [d.id for d in result["documents"]]


def test_query_text_through_onnx_ranks_as_torch(store, model, monkeypatch):
    """Given only the query text, both retrievers embed it with the store's model through
    their runtime: onnx (and auto, which picks the onnx export) return the documents and
    scores a torch-embedded query gets."""
    import densefit.retrieval.index.searching as searching  # where every query is embedded

    used: list[str] = []

    def spying(model, texts, **kwargs):  # records which runtime embedded each query
        used.append(kwargs["runtime"].name)
        return encode_texts(model, texts, **kwargs)

    monkeypatch.setattr(searching, "encode_texts", spying)
    for query in QUERIES:
        vector = encode_texts(model, [query], prompt_name="query")[0].tolist()
        want = DensefitEmbeddingRetriever(store, top_k=5).run(query_embedding=vector)
        hybrid_want = DensefitHybridRetriever(store, top_k=5).run(
            query=query, query_embedding=vector
        )
        assert used == []  # an embedding given: nothing embedded here
        assert len(want["documents"]) == 5
        for runtime in ("torch", "onnx", "auto"):
            got = DensefitEmbeddingRetriever(store, top_k=5, runtime=runtime).run(query=query)
            assert _ids(got) == _ids(want), (query, runtime)
            np.testing.assert_allclose(
                [d.score for d in got["documents"]], [d.score for d in want["documents"]], atol=1e-5
            )
            hybrid = DensefitHybridRetriever(store, top_k=5, runtime=runtime).run(query=query)
            assert _ids(hybrid) == _ids(hybrid_want), (query, runtime)
        assert used == ["torch", "torch", "onnx", "onnx", "onnx", "onnx"], used
        used.clear()


def test_run_async_embeds_as_run(store):
    retriever = DensefitHybridRetriever(store, mode="dense", top_k=4, runtime="onnx")
    want = retriever.run(query="cells genes")
    assert asyncio.run(retriever.run_async(query="cells genes")) == want
    embedding = DensefitEmbeddingRetriever(store, top_k=4, runtime="onnx")
    assert asyncio.run(embedding.run_async(query="cells genes")) == embedding.run(
        query="cells genes"
    )


def test_runtime_is_serialised(store):
    for retriever in (
        DensefitEmbeddingRetriever(store, top_k=3, runtime="onnx"),
        DensefitHybridRetriever(store, top_k=3, runtime="onnx"),
    ):
        data = retriever.to_dict()
        assert data["init_parameters"]["runtime"] == "onnx"
        again = type(retriever).from_dict(data)
        assert again.runtime == "onnx"
        assert again.run(query="vaccine dose") == retriever.run(query="vaccine dose")
        pipeline = Pipeline()
        pipeline.add_component("retrieve", retriever)
        loaded = Pipeline.loads(
            pipeline.dumps(), allowed_modules=["densefit.integrations.haystack"]
        )
        assert loaded.get_component("retrieve").runtime == "onnx"
        result = loaded.run({"retrieve": {"query": "vaccine dose"}})
        assert _ids(result["retrieve"]) == _ids(retriever.run(query="vaccine dose"))
        del data["init_parameters"]["runtime"]  # a file written before runtime= existed
        assert type(retriever).from_dict(data).runtime == "auto"  # --runtime's default


def test_a_bad_runtime_is_a_value_error(store):
    for cls in (DensefitEmbeddingRetriever, DensefitHybridRetriever):
        with pytest.raises(ValueError, match=r"^runtime must be one of auto, torch, onnx, .*'gpu'"):
            cls(store, runtime="gpu")
    assert DensefitEmbeddingRetriever(store).runtime == "auto"


def test_the_stores_runtime_rule_applies(tmp_path, model_dir, model):
    """Documents embedded by an int8 export whose check did not find it agrees with fp32:
    a torch (or auto, finding no such export) query is refused as densefit search refuses
    it; a query embedding from outside is the caller's and is searched."""
    path = tmp_path / "int8-store"
    docs = [DensefitDocument(f"d{i}", t) for i, t in enumerate(_texts(10, seed=2))]
    with open_store(path, model) as densefit_store:
        assert densefit_store.adopt_runtime(
            VectorSource("onnx-int8", "int8:0123", "onnx/model_qint8_x.onnx", False)
        )
        densefit_store.write(docs, encode_texts(model, [d.text for d in docs]))
    store = DensefitDocumentStore(path, model=str(model_dir))
    for runtime in ("torch", "auto"):
        with pytest.raises(SettingsMismatchError, match="onnx-int8"):
            DensefitEmbeddingRetriever(store, runtime=runtime).run(query="cells genes")
        with pytest.raises(SettingsMismatchError, match="onnx-int8"):
            DensefitHybridRetriever(store, runtime=runtime).run(query="cells genes")
    vector = encode_texts(model, ["cells genes"])[0].tolist()
    assert DensefitEmbeddingRetriever(store, runtime="torch").run(query_embedding=vector)[
        "documents"
    ]


def test_a_store_of_external_embeddings_needs_the_query_embedding(tmp_path, model):
    store = DensefitDocumentStore(tmp_path / "external")
    assert DensefitEmbeddingRetriever(store).run(query="cells")["documents"] == []  # empty
    store.write_documents(_documents(model))
    with pytest.raises(ValueError, match="needs the query embedding.*model="):
        DensefitEmbeddingRetriever(store).run(query="cells")
    with pytest.raises(ValueError, match="needs the query embedding or the query text"):
        DensefitEmbeddingRetriever(store).run()
