"""Haystack embedders on densefit's encoder: the vectors densefit makes (prompts, Matryoshka,
runtimes), the interface of sentence-transformers-haystack's embedders, serialisation,
pipelines into Haystack's in-memory store and Qdrant, and the errors for bad arguments."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

pytest.importorskip("haystack", reason="haystack-ai is not installed (densefit[haystack])")

from haystack import Document, Pipeline  # noqa: E402
from haystack.components.retrievers.in_memory import InMemoryEmbeddingRetriever  # noqa: E402
from haystack.components.writers import DocumentWriter  # noqa: E402
from haystack.document_stores.in_memory import InMemoryDocumentStore  # noqa: E402
from haystack.utils import ComponentDevice  # noqa: E402

from densefit.choices import RUNTIME_CHOICES  # noqa: E402
from densefit.config.shared import DEFAULT_MODEL, ENCODE_BATCH_SIZE, RUNTIME  # noqa: E402
from densefit.errors import ModelNotFoundError  # noqa: E402
from densefit.integrations.haystack_embedders import (  # noqa: E402
    DensefitDocumentEmbedder,
    DensefitTextEmbedder,
)
from densefit.losses.matryoshka import truncate  # noqa: E402
from densefit.models import load_model, resolve_model_path  # noqa: E402
from densefit.prompts import set_prompts  # noqa: E402
from densefit.retrieval.encode import configure_model, encode_texts  # noqa: E402
from densefit.testing import tiny_model  # noqa: E402

MODULE = "densefit.integrations.haystack_embedders"
QUERY_PROMPT, DOCUMENT_PROMPT = "query: ", "passage: "
QUERIES = ["how do cells divide?", "python read a file", "cells"]
DOCUMENTS = [
    Document(content="Cells divide by mitosis.", meta={"title": "Cells", "year": 2020}),
    Document(content="A python function reads the file.", meta={"title": None}),
    Document(content="Vaccine dose and memory.", meta={}),
    Document(content=None, meta={"title": "Only a title"}),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two saved tiny models: ``prompts`` (query and document prompts saved with it) and
    ``plain`` (none)."""
    root = tmp_path_factory.mktemp("embedders")
    with_prompts = tiny_model(root / "build")
    set_prompts(with_prompts, query=QUERY_PROMPT, document=DOCUMENT_PROMPT)
    with_prompts.save(str(root / "prompts"))
    tiny_model(root / "build2").save(str(root / "plain"))
    return {"prompts": str(root / "prompts"), "plain": str(root / "plain")}


@pytest.fixture(scope="module")
def reference(folders):
    """The prompted model, loaded as the embedders load it (densefit's reference)."""
    return load_model(folders["prompts"], device="cpu")


def _text(folder, **kwargs) -> DensefitTextEmbedder:
    return DensefitTextEmbedder(model=folder, device="cpu", progress_bar=False, **kwargs)


def _documents(folder, **kwargs) -> DensefitDocumentEmbedder:
    return DensefitDocumentEmbedder(model=folder, device="cpu", progress_bar=False, **kwargs)


def _cosines(a, b) -> np.ndarray:
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# ----------------------------------------------------------------------------- the vectors


def test_text_embedder_is_densefit_with_the_query_prompt(folders, reference):
    """The text embedder gives encode_texts' vector with the model's query prompt, and
    SentenceTransformer.encode's with the same prompt to 1e-5."""
    embedder = _text(folders["prompts"])
    got = np.array([embedder.run(q)["embedding"] for q in QUERIES], dtype=np.float32)
    want = [encode_texts(reference, [q], prompt_name="query", runtime="torch")[0] for q in QUERIES]
    np.testing.assert_array_equal(got, np.array(want))  # each query embedded alone
    st = reference.encode(QUERIES, prompt=QUERY_PROMPT, convert_to_numpy=True)
    np.testing.assert_allclose(got, st, atol=1e-5)
    unprompted = reference.encode(QUERIES, convert_to_numpy=True)
    assert np.abs(got - unprompted).max() > 1e-3  # the prompt made a difference
    out = embedder.run(QUERIES[0])
    assert set(out) == {"embedding"} and all(type(x) is float for x in out["embedding"])


def test_document_embedder_is_densefit_with_the_document_prompt(folders, reference):
    """Each document is embedded as its meta fields and content joined by the separator,
    after the document prompt: encode_texts' vectors, and SentenceTransformer.encode's to
    1e-5; the output holds copies, in order, the inputs untouched."""
    embedder = _documents(folders["prompts"], meta_fields_to_embed=["title", "year"])
    out = embedder.run(DOCUMENTS)
    assert set(out) == {"documents"}
    docs = out["documents"]
    texts = [
        "Cells\n2020\nCells divide by mitosis.",
        "A python function reads the file.",  # a None value is left out
        "Vaccine dose and memory.",
        "Only a title\n",  # no content: ""
    ]
    assert [embedder.text_to_embed(d) for d in DOCUMENTS] == texts
    got = np.array([d.embedding for d in docs], dtype=np.float32)
    want = encode_texts(reference, texts, prompt_name="document", runtime="torch")
    np.testing.assert_array_equal(got, want)
    st = reference.encode(texts, prompt=DOCUMENT_PROMPT, convert_to_numpy=True)
    np.testing.assert_allclose(got, st, atol=1e-5)
    assert [d.id for d in docs] == [d.id for d in DOCUMENTS]
    assert [(d.content, d.meta) for d in docs] == [(d.content, d.meta) for d in DOCUMENTS]
    assert all(d.embedding is None for d in DOCUMENTS)  # copies: the inputs are unchanged
    separated = _documents(folders["prompts"], meta_fields_to_embed=["title"])
    separated.embedding_separator = " | "
    assert separated.text_to_embed(DOCUMENTS[0]) == "Cells | Cells divide by mitosis."


def test_prompts_can_be_replaced_or_left_out(folders, reference):
    """query_prompt / document_prompt replace the model's prompt; "" leaves it out."""
    texts = ["cells divide", "a file"]
    none = np.array([_text(folders["prompts"], query_prompt="").run(t)["embedding"] for t in texts])
    np.testing.assert_allclose(none, reference.encode(texts), atol=1e-5)
    other = _text(folders["prompts"], query_prompt="search: ").run(texts[0])["embedding"]
    np.testing.assert_allclose(other, reference.encode([texts[0]], prompt="search: ")[0], atol=1e-5)
    docs = [Document(content=t) for t in texts]
    own = _documents(folders["prompts"], document_prompt="doc: ").run(docs)["documents"]
    np.testing.assert_allclose(
        [d.embedding for d in own], reference.encode(texts, prompt="doc: "), atol=1e-5
    )
    # a model without prompts: nothing put before the texts
    plain = load_model(folders["plain"], device="cpu")
    got = _text(folders["plain"]).run(texts[0])["embedding"]
    np.testing.assert_allclose(got, plain.encode([texts[0]])[0], atol=1e-5)


def test_agrees_with_sentence_transformers_haystack(folders):
    """Drop-in: the same vectors as sentence-transformers-haystack's embedders given the
    model's prompts as their prefix, through the same input and output sockets."""
    st_haystack = pytest.importorskip(
        "haystack_integrations.components.embedders.sentence_transformers",
        reason="sentence-transformers-haystack is not installed (densefit[haystack])",
    )
    cpu = ComponentDevice.from_str("cpu")
    common = {"model": folders["prompts"], "device": cpu, "progress_bar": False}
    theirs_text = st_haystack.SentenceTransformersTextEmbedder(
        prefix=QUERY_PROMPT, local_files_only=True, **common
    )
    theirs_docs = st_haystack.SentenceTransformersDocumentEmbedder(
        prefix=DOCUMENT_PROMPT, local_files_only=True, meta_fields_to_embed=["title"], **common
    )
    ours_text = DensefitTextEmbedder(**common)
    ours_docs = DensefitDocumentEmbedder(meta_fields_to_embed=["title"], **common)
    for ours, theirs in ((ours_text, theirs_text), (ours_docs, theirs_docs)):
        assert ours.__haystack_input__._sockets_dict.keys() == (
            theirs.__haystack_input__._sockets_dict.keys()
        )
        assert {k: s.type for k, s in ours.__haystack_output__._sockets_dict.items()} == {
            k: s.type for k, s in theirs.__haystack_output__._sockets_dict.items()
        }
    np.testing.assert_allclose(
        ours_text.run(QUERIES[0])["embedding"], theirs_text.run(QUERIES[0])["embedding"], atol=1e-5
    )
    ours = [d.embedding for d in ours_docs.run(DOCUMENTS)["documents"]]
    theirs = [d.embedding for d in theirs_docs.run(DOCUMENTS)["documents"]]
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_truncate_dim_is_densefits_matryoshka_cut(folders, reference):
    """truncate_dim keeps the first coordinates rescaled to the full vector's norm, as
    densefit indexes (configure_model(dim=...)); with normalize_embeddings, unit length."""
    full = np.array(_text(folders["prompts"]).run(QUERIES[0])["embedding"], dtype=np.float32)
    cut = np.array(
        _text(folders["prompts"], truncate_dim=8).run(QUERIES[0])["embedding"], dtype=np.float32
    )
    assert cut.shape == (8,)
    np.testing.assert_allclose(cut, truncate(full[None], 8)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(cut), np.linalg.norm(full), rtol=1e-5)
    assert _cosines(cut, full[:8])[0] >= 1 - 1e-6  # the same direction as the plain cut
    model = configure_model(load_model(folders["prompts"], device="cpu"), dim=8)
    np.testing.assert_array_equal(
        cut, encode_texts(model, QUERIES[:1], prompt_name="query", runtime="torch")[0]
    )
    docs = _documents(folders["prompts"], truncate_dim=8, normalize_embeddings=True)
    vectors = np.array([d.embedding for d in docs.run(DOCUMENTS)["documents"]])
    assert vectors.shape == (len(DOCUMENTS), 8)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    # the full size is no cut; more than the model makes is an error naming the range
    same = _text(folders["prompts"], truncate_dim=32).run(QUERIES[0])["embedding"]
    np.testing.assert_allclose(same, full, atol=1e-6)
    with pytest.raises(ValueError, match=r"truncate_dim=64, .* 32-d embeddings: give a size"):
        _text(folders["prompts"], truncate_dim=64).warm_up()


def test_empty_input_and_batches(folders, reference):
    """No documents: none out. Batches of any size give the same vectors, duplicates too."""
    assert _documents(folders["prompts"]).run([]) == {"documents": []}
    docs = [Document(content=f"cells {'divide ' * i}") for i in range(9)] + [DOCUMENTS[0]] * 2
    one = _documents(folders["prompts"], batch_size=1).run(docs)["documents"]
    many = _documents(folders["prompts"]).run(docs)["documents"]
    np.testing.assert_allclose([d.embedding for d in one], [d.embedding for d in many], atol=1e-5)
    assert one[-1].embedding == one[-2].embedding


def test_run_async_equals_run(folders):
    text = _text(folders["prompts"])
    docs = _documents(folders["prompts"])
    assert asyncio.run(text.run_async(QUERIES[0])) == text.run(QUERIES[0])
    assert asyncio.run(docs.run_async(DOCUMENTS)) == docs.run(DOCUMENTS)


# ----------------------------------------------------------------------------- the component


def test_init_is_light_and_defaults_come_from_densefit():
    """Creating a component loads nothing; its defaults are densefit's option defaults."""
    text, docs = DensefitTextEmbedder(), DensefitDocumentEmbedder()
    for embedder in (text, docs):
        assert embedder.resolved_runtime is None and embedder._model is None
        assert embedder.model == DEFAULT_MODEL
        assert embedder.runtime == RUNTIME.default
        assert embedder.batch_size == ENCODE_BATCH_SIZE.default
        assert embedder.device == "auto"
    assert docs.meta_fields_to_embed == [] and docs.embedding_separator == "\n"


def test_to_dict_from_dict_round_trip(folders):
    text = DensefitTextEmbedder(
        model=folders["prompts"],
        runtime="onnx",
        query_prompt="search: ",
        truncate_dim=16,
        device=ComponentDevice.from_str("cpu"),
        batch_size=8,
        progress_bar=False,
        normalize_embeddings=True,
        max_seq_length=32,
    )
    data = text.to_dict()
    assert data["type"] == f"{MODULE}.DensefitTextEmbedder"
    assert data["init_parameters"] == {
        "model": folders["prompts"],
        "runtime": "onnx",
        "query_prompt": "search: ",
        "truncate_dim": 16,
        "device": "cpu",
        "batch_size": 8,
        "progress_bar": False,
        "normalize_embeddings": True,
        "max_seq_length": 32,
        "trust_remote_code": False,
    }
    again = DensefitTextEmbedder.from_dict(data)
    assert again.to_dict() == data and again.resolved_runtime is None
    docs = DensefitDocumentEmbedder(
        model=folders["prompts"], document_prompt="", meta_fields_to_embed=["title"]
    )
    data = docs.to_dict()
    assert data["type"] == f"{MODULE}.DensefitDocumentEmbedder"
    assert data["init_parameters"]["meta_fields_to_embed"] == ["title"]
    assert data["init_parameters"]["document_prompt"] == ""
    assert DensefitDocumentEmbedder.from_dict(data).to_dict() == data


def test_pipeline_yaml_round_trip(folders):
    """A pipeline holding the embedders survives Haystack's YAML and still embeds."""
    pipeline = Pipeline()
    pipeline.add_component("embed", _text(folders["prompts"], truncate_dim=8))
    loaded = Pipeline.loads(pipeline.dumps(), allowed_modules=[MODULE])  # Haystack's allowlist
    embedder = loaded.get_component("embed")
    assert isinstance(embedder, DensefitTextEmbedder) and embedder.truncate_dim == 8
    out = loaded.run({"embed": {"text": "cells"}})
    assert len(out["embed"]["embedding"]) == 8


def test_max_seq_length_is_applied(folders):
    embedder = _text(folders["prompts"], max_seq_length=8)
    embedder.warm_up()
    assert embedder._model.max_seq_length == 8


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"runtime": "tensorrt"}, ValueError, "runtime 'tensorrt' is not one of auto, torch"),
        ({"runtime": "ONNX"}, ValueError, "pass one of them"),
        ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1, got 0"),
        ({"truncate_dim": 0}, ValueError, "truncate_dim must be an int >= 1 (or None), got 0"),
        ({"max_seq_length": -1}, ValueError, "max_seq_length must be an int >= 1 (or None), got"),
        ({"truncate_dim": 8.5}, ValueError, "truncate_dim must be an int >= 1"),
        ({"device": "gpu"}, ValueError, "device must be one of auto, cpu, cuda"),
        ({"query_prompt": 3}, TypeError, "query_prompt must be a str"),
        ({"model": None}, TypeError, "model must be a model folder or name"),
    ],
)
def test_bad_arguments_say_how_to_fix_them(kwargs, error, words):
    with pytest.raises(error, match=re.escape(words)) as caught:
        DensefitTextEmbedder(**kwargs)
    assert str(caught.value).startswith("DensefitTextEmbedder: ")


def test_bad_runtime_lists_every_choice():
    with pytest.raises(ValueError) as caught:
        DensefitDocumentEmbedder(runtime="tensorrt")
    assert ", ".join(RUNTIME_CHOICES) in str(caught.value)


def test_bad_document_embedder_arguments():
    with pytest.raises(TypeError, match=r"meta_fields_to_embed must be a list .* \['title'\]"):
        DensefitDocumentEmbedder(meta_fields_to_embed="title")
    with pytest.raises(TypeError, match="embedding_separator must be a str"):
        DensefitDocumentEmbedder(embedding_separator=None)
    with pytest.raises(TypeError, match="document_prompt must be a str"):
        DensefitDocumentEmbedder(document_prompt=["passage: "])


def test_wrong_inputs_name_the_other_embedder(folders):
    """A Document to the text embedder, a text or a list holding a non-Document to the
    document embedder: one TypeError saying which component or wrapper to use, before any
    model is loaded."""
    text, docs = _text(folders["prompts"]), _documents(folders["prompts"])
    with pytest.raises(TypeError, match="got Document: to embed Documents use DensefitDocument"):
        text.run(Document(content="cells"))
    with pytest.raises(TypeError, match="got list: to embed Documents use"):
        text.run(["cells"])
    with pytest.raises(TypeError, match="got str: to embed one text use DensefitTextEmbedder"):
        docs.run("cells")
    with pytest.raises(
        TypeError, match=r"documents\[1\] is a str, not a haystack Document: wrap texts as "
    ):
        docs.run([Document(content="cells"), "genes"])
    assert text.resolved_runtime is None and docs.resolved_runtime is None


def test_a_missing_model_is_named_at_warm_up(tmp_path):
    embedder = _text(str(tmp_path / "no-such-model"))  # init loads nothing: no error yet
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        embedder.warm_up()


# ----------------------------------------------------------------------------- runtimes


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A saved tiny model (with prompts) and its onnx (fp32) export beside it."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (densefit[onnx])")
    pytest.importorskip("onnx", reason="onnx is not installed (densefit[onnx])")
    from densefit.retrieval.export import export_model

    root = tmp_path_factory.mktemp("exported")
    model = tiny_model(root / "build")
    set_prompts(model, query=QUERY_PROMPT, document=DOCUMENT_PROMPT)
    model.save(str(root / "model"))
    export_model(load_model(root / "model", device="cpu"), ["onnx"])
    return str(root / "model")


@pytest.mark.parametrize("runtime", ["onnx", "auto"])
def test_an_exported_runtime_embeds(exported, runtime):
    """runtime='onnx' (and 'auto', finding the export) embeds with the exported file, giving
    torch's vectors to 1e-5 with the same prompts and Matryoshka cut."""
    text = _text(exported, runtime=runtime, truncate_dim=16)
    docs = _documents(exported, runtime=runtime, truncate_dim=16)
    text.warm_up()
    docs.warm_up()
    for embedder in (text, docs):
        assert embedder.resolved_runtime.name == "onnx"
        assert embedder.resolved_runtime.source.file == "onnx/model.onnx"
    torch_text = _text(exported, runtime="torch", truncate_dim=16)
    torch_docs = _documents(exported, runtime="torch", truncate_dim=16)
    np.testing.assert_allclose(
        text.run(QUERIES[0])["embedding"], torch_text.run(QUERIES[0])["embedding"], atol=1e-5
    )
    ours = [d.embedding for d in docs.run(DOCUMENTS)["documents"]]
    theirs = [d.embedding for d in torch_docs.run(DOCUMENTS)["documents"]]
    assert _cosines(np.array(ours), np.array(theirs)).min() >= 1 - 1e-5
    assert torch_text.resolved_runtime.name == "torch"


def test_an_unavailable_runtime_says_how_to_get_it(folders):
    """onnx-int8 without an export: warm_up raises the runtime's own error (a ValueError)
    naming the command that makes one."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (densefit[onnx])")
    with pytest.raises(ValueError, match="densefit export"):
        _text(folders["plain"], runtime="onnx-int8").warm_up()


# ----------------------------------------------------------------------------- pipelines

CORPUS = [
    Document(id="mitosis", content="Cells divide by mitosis into two daughter cells."),
    Document(id="python", content="A python function reads a csv file into a dictionary."),
    Document(id="vaccine", content="The vaccine dose was doubled for older adults."),
    Document(id="ports", content="List the open ports on a linux machine with ss."),
]


def _index_and_query(folder, store, retriever_class, **retriever_kwargs):
    """Index CORPUS into ``store`` through DensefitDocumentEmbedder, then query each
    document's text through DensefitTextEmbedder -> the store's embedding retriever; the ids
    found first."""
    indexing = Pipeline()
    indexing.add_component("embed", _documents(folder))
    indexing.add_component("write", DocumentWriter(store))
    indexing.connect("embed.documents", "write.documents")
    assert indexing.run({"embed": {"documents": CORPUS}}) == {
        "write": {"documents_written": len(CORPUS)}
    }
    query = Pipeline()
    query.add_component("embed", _text(folder))
    query.add_component("retrieve", retriever_class(document_store=store, **retriever_kwargs))
    query.connect("embed.embedding", "retrieve.query_embedding")
    found = []
    for doc in CORPUS:
        hits = query.run({"embed": {"text": doc.content}})["retrieve"]["documents"]
        found.append(hits[0].id)
    return found


def test_pipeline_into_the_in_memory_store(folders):
    """Documents embedded by DensefitDocumentEmbedder, written to InMemoryDocumentStore,
    found by DensefitTextEmbedder -> InMemoryEmbeddingRetriever (a model without prompts:
    each document's own text is its nearest query)."""
    store = InMemoryDocumentStore(embedding_similarity_function="cosine")
    found = _index_and_query(folders["plain"], store, InMemoryEmbeddingRetriever, top_k=2)
    assert found == [d.id for d in CORPUS]
    stored = store.filter_documents()
    assert all(len(d.embedding) == 32 for d in stored)


def test_pipeline_into_qdrant(folders):
    """The same through qdrant-haystack's in-memory QdrantDocumentStore."""
    qdrant = pytest.importorskip(
        "haystack_integrations.document_stores.qdrant",
        reason="qdrant-haystack is not installed (pip install qdrant-haystack)",
    )
    from haystack_integrations.components.retrievers.qdrant import QdrantEmbeddingRetriever

    store = qdrant.QdrantDocumentStore(
        location=":memory:", embedding_dim=32, similarity="cosine", progress_bar=False
    )
    found = _index_and_query(folders["plain"], store, QdrantEmbeddingRetriever, top_k=2)
    assert found == [d.id for d in CORPUS]
    assert store.count_documents() == len(CORPUS)


# ----------------------------------------------------------------------------- the real model


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["torch", "onnx"])
def test_minilm_agrees_with_sentence_transformers_haystack(minilm, runtime):
    """all-MiniLM-L6-v2 through densefit's embedders against sentence-transformers-haystack's
    own: cosine >= 0.9999 for queries and documents, run by torch and by ONNX Runtime (no
    export in the packaged folder: exported in memory)."""
    if runtime == "onnx":
        pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (densefit[onnx])")
    st_haystack = pytest.importorskip(
        "haystack_integrations.components.embedders.sentence_transformers",
        reason="sentence-transformers-haystack is not installed (densefit[haystack])",
    )
    del minilm  # the fixture skips when the packaged model is missing
    path = resolve_model_path(DEFAULT_MODEL)
    cpu = ComponentDevice.from_str("cpu")
    theirs_text = st_haystack.SentenceTransformersTextEmbedder(
        model=path, device=cpu, progress_bar=False, local_files_only=True
    )
    theirs_docs = st_haystack.SentenceTransformersDocumentEmbedder(
        model=path,
        device=cpu,
        progress_bar=False,
        local_files_only=True,
        meta_fields_to_embed=["title"],
    )
    ours_text = DensefitTextEmbedder(
        model=DEFAULT_MODEL, runtime=runtime, device="cpu", progress_bar=False
    )
    ours_docs = DensefitDocumentEmbedder(
        model=DEFAULT_MODEL,
        runtime=runtime,
        device="cpu",
        progress_bar=False,
        meta_fields_to_embed=["title"],
    )
    queries = [
        "what lowers blood pressure?",
        "how do I list open ports on linux",
        "What is the effect of vitamin D on bone density in older adults?",
    ]
    ours = np.array([ours_text.run(q)["embedding"] for q in queries])
    theirs = np.array([theirs_text.run(q)["embedding"] for q in queries])
    assert _cosines(ours, theirs).min() >= 0.9999
    docs = [*DOCUMENTS, *CORPUS]
    ours = np.array([d.embedding for d in ours_docs.run(docs)["documents"]])
    theirs = np.array([d.embedding for d in theirs_docs.run(docs)["documents"]])
    assert _cosines(ours, theirs).min() >= 0.9999


def test_pipeline_into_pgvector(folders, postgres_uri):
    """The same through pgvector-haystack's PgvectorDocumentStore, on the real PostgreSQL
    server the tests start (the postgres_uri fixture)."""
    pgvector = pytest.importorskip(
        "haystack_integrations.document_stores.pgvector",
        reason="pgvector-haystack is not installed (pip install pgvector-haystack)",
    )
    from haystack.utils import Secret
    from haystack_integrations.components.retrievers.pgvector import PgvectorEmbeddingRetriever

    store = pgvector.PgvectorDocumentStore(
        connection_string=Secret.from_token(postgres_uri),
        table_name="haystack_embedders",
        embedding_dimension=32,
        recreate_table=True,
    )
    found = _index_and_query(folders["plain"], store, PgvectorEmbeddingRetriever, top_k=2)
    assert found == [d.id for d in CORPUS]
    assert store.count_documents() == len(CORPUS)
