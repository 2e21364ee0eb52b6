"""The Haystack 3 integration: Haystack's own document-store test suite, the retriever
component, and a pipeline over a densefit-trained model ranking as ``densefit search`` does."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

pytest.importorskip("haystack", reason="haystack-ai is not installed (densefit[haystack])")

from conftest import STORE_ENGINES  # noqa: E402
from haystack import Document, Pipeline  # noqa: E402
from haystack.document_stores.errors import DuplicateDocumentError  # noqa: E402
from haystack.document_stores.types import DuplicatePolicy  # noqa: E402
from haystack.errors import FilterError  # noqa: E402
from haystack.testing import document_store as sync_suites  # noqa: E402
from haystack.testing import document_store_async as async_suites  # noqa: E402
from haystack.testing.document_store import (  # noqa: E402
    CountDocumentsByFilterTest,
    CountUniqueMetadataByFilterTest,
    DocumentStoreBaseExtendedTests,
    GetMetadataFieldMinMaxTest,
    GetMetadataFieldsInfoTest,
    GetMetadataFieldUniqueValuesTest,
)
from haystack.testing.document_store_async import (  # noqa: E402
    CountDocumentsAsyncTest,
    CountDocumentsByFilterAsyncTest,
    CountUniqueMetadataByFilterAsyncTest,
    DeleteAllAsyncTest,
    DeleteByFilterAsyncTest,
    DeleteDocumentsAsyncTest,
    FilterDocumentsAsyncTest,
    GetMetadataFieldMinMaxAsyncTest,
    GetMetadataFieldsInfoAsyncTest,
    GetMetadataFieldUniqueValuesAsyncTest,
    UpdateByFilterAsyncTest,
    WriteDocumentsAsyncTest,
)

from densefit.data.text import InvalidText
from densefit.integrations.haystack import (  # noqa: E402
    RESERVED_KEY,
    DensefitDocumentStore,
    DensefitEmbeddingRetriever,
    DensefitHybridRetriever,
)

needs_faiss = pytest.mark.skipif(
    importlib.util.find_spec("faiss") is None, reason="faiss is not installed (densefit[index])"
)


def _new_store(target, backend: str | None, vectors: str = "float32") -> DensefitDocumentStore:
    # The suites' documents carry 768-d embeddings, and some carry none.
    return DensefitDocumentStore(target, embedding_dim=768, backend=backend, vectors=vectors)


class TestHaystackSuite(
    DocumentStoreBaseExtendedTests,
    CountDocumentsByFilterTest,
    CountUniqueMetadataByFilterTest,
    GetMetadataFieldsInfoTest,
    GetMetadataFieldMinMaxTest,
    GetMetadataFieldUniqueValuesTest,
):
    """Every suite of ``haystack.testing.document_store`` (count, write, delete, filter,
    delete all, delete / update / count by filter, the metadata methods), on every engine
    (the embedded store with both vector backends and the quantized vector kinds,
    PostgreSQL + pgvector on a real server, Qdrant's local mode)."""

    @pytest.fixture(
        params=[
            ("embedded", "exact", "float32"),
            pytest.param(("embedded", "faiss", "float32"), marks=needs_faiss),
            ("embedded", "exact", "int8"),
            ("embedded", "exact", "binary"),
            ("postgresql", None, "float32"),
            ("qdrant", None, "float32"),
        ],
        ids=["exact", "faiss", "int8", "binary", "postgresql", "qdrant"],
    )
    def document_store(self, request, new_target):
        engine, backend, vectors = request.param
        store = _new_store(new_target(engine), backend, vectors)
        yield store
        if store.store is not None:
            store.store.close()

    def test_write_documents(self, document_store):
        """The default policy (NONE) is FAIL, as in Haystack's InMemoryDocumentStore."""
        doc = Document(content="test doc", meta={"a": 1})
        assert document_store.write_documents([doc]) == 1
        with pytest.raises(DuplicateDocumentError):
            document_store.write_documents([doc])
        self.assert_documents_are_equal(document_store.filter_documents(), [doc])


class TestHaystackAsyncSuite(
    CountDocumentsAsyncTest,
    CountDocumentsByFilterAsyncTest,
    CountUniqueMetadataByFilterAsyncTest,
    DeleteAllAsyncTest,
    DeleteByFilterAsyncTest,
    DeleteDocumentsAsyncTest,
    FilterDocumentsAsyncTest,
    GetMetadataFieldMinMaxAsyncTest,
    GetMetadataFieldsInfoAsyncTest,
    GetMetadataFieldUniqueValuesAsyncTest,
    UpdateByFilterAsyncTest,
    WriteDocumentsAsyncTest,
):
    """Every suite of ``haystack.testing.document_store_async`` on every engine (the
    ``*_async`` methods run their sync twin in a worker thread; backends and vector kinds are
    the sync suite's business)."""

    @pytest.fixture(params=STORE_ENGINES)
    def document_store(self, request, new_target):
        store = _new_store(new_target(request.param), None)
        yield store
        if store.store is not None:
            store.store.close()

    @pytest.mark.asyncio
    async def test_write_documents_async(self, document_store):
        """The default policy (NONE) is FAIL, as in the sync suite."""
        doc = Document(content="test doc", meta={"a": 1})
        assert await document_store.write_documents_async([doc]) == 1
        with pytest.raises(DuplicateDocumentError):
            await document_store.write_documents_async([doc])
        self.assert_documents_are_equal(await document_store.filter_documents_async(), [doc])


def _suite_classes(module) -> set[type]:
    """The test-suite classes a module of ``haystack.testing`` defines (``...Test``)."""
    return {
        value
        for name, value in vars(module).items()
        if isinstance(value, type)
        and value.__module__ == module.__name__
        and name.endswith("Test")
        and any(attr.startswith("test_") for attr in dir(value))
    }


def test_every_haystack_suite_is_run():
    """The installed Haystack's suites, listed from its modules: each one is a base of ours
    (a Haystack release that adds a suite fails here until it is run too)."""
    sync, asynchronous = _suite_classes(sync_suites), _suite_classes(async_suites)
    assert len(sync) >= 12 and len(asynchronous) >= 12, (sync, asynchronous)
    assert not {c for c in sync if not issubclass(TestHaystackSuite, c)}
    assert not {c for c in asynchronous if not issubclass(TestHaystackAsyncSuite, c)}


# -- the store beyond the suite --------------------------------------------------------------


def test_round_trip_of_every_field(tmp_path):
    from haystack.dataclasses import ByteStream, SparseEmbedding

    docs = [
        Document(content="text", meta={"lang": "en", "n": [1, 2]}, embedding=[3.0, 4.0, 0.1]),
        Document(content=None, blob=ByteStream(b"\x00\xffbytes", mime_type="x/y"), meta={}),
        Document(
            content="unit",
            embedding=[1.0, 0.0, 0.0],  # exactly what a cosine store keeps: no copy needed
            sparse_embedding=SparseEmbedding(indices=[1, 5], values=[0.5, 0.25]),
        ),
    ]
    store = DensefitDocumentStore(tmp_path / "s")  # dimension from the first embedding
    assert store.write_documents(docs) == 3
    assert store.filter_documents() == docs
    again = DensefitDocumentStore.from_dict(store.to_dict())  # reopens the same folder
    assert again.filter_documents() == docs
    extra = store.store.get([docs[2].id])[0].meta[RESERVED_KEY]
    assert (
        "embedding" not in extra
        and "embedding" in store.store.get([docs[0].id])[0].meta[RESERVED_KEY]
    )


def test_write_policies_within_one_call(tmp_path):
    store = DensefitDocumentStore(tmp_path / "s", embedding_dim=2)
    first, second = Document(id="1", content="a"), Document(id="1", content="b")
    with pytest.raises(DuplicateDocumentError):
        store.write_documents([first, second])
    assert store.count_documents() == 0  # nothing half-written
    assert store.write_documents([first, second], policy=DuplicatePolicy.SKIP) == 1
    assert store.filter_documents()[0].content == "a"
    assert store.write_documents([first, second], policy=DuplicatePolicy.OVERWRITE) == 1
    assert store.filter_documents()[0].content == "b"


def test_store_errors(tmp_path):
    with pytest.raises(ValueError, match="embedding dimension"):
        DensefitDocumentStore(tmp_path / "a").write_documents([Document(content="x")])
    store = DensefitDocumentStore(tmp_path / "b", embedding_dim=3)
    with pytest.raises(ValueError, match="2-d embedding but the store holds 3-d"):
        store.write_documents([Document(content="x", embedding=[1.0, 2.0])])
    with pytest.raises(ValueError, match="reserved"):
        store.write_documents([Document(content="x", meta={RESERVED_KEY: 1})])
    with pytest.raises(FilterError, match="needs a list"):
        store.filter_documents({"field": "meta.a", "operator": "in", "value": "x"})
    with pytest.raises(ValueError, match="similarity"):
        DensefitDocumentStore(similarity="l2")


def test_texts_are_checked_like_every_other_text(tmp_path):
    store = DensefitDocumentStore(tmp_path / "s", embedding_dim=2)
    for bad, field in [("bad \udcff", "content"), ("a\x00b", "content")]:
        with pytest.raises(ValueError, match=rf"document 'd1': {field}: .*(UTF-8|NUL)"):
            store.write_documents([Document(id="d1", content=bad)])
    with pytest.raises(ValueError, match="id: invalid UTF-8"):
        store.write_documents([Document(id="\udcff", content="fine")])
    assert store.count_documents() == 0


def _meta_corpus(n: int = 80, seed: int = 3) -> list[Document]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        meta = {
            "lang": str(rng.choice(["en", "de", "fr", "En"])),
            "year": int(rng.integers(1990, 2030)),
            "score": float(np.round(rng.normal(), 3)),
            "flag": bool(rng.integers(2)),
        }
        if i % 7 == 0:
            del meta["year"]  # a missing field
        if i % 11 == 0:
            meta["lang"] = None  # a null
        docs.append(Document(content=f"doc {i}", meta=meta))
    return docs


def test_metadata_methods_agree_with_haystacks_in_memory_store(tmp_path):
    """Against Haystack's reference implementation, on fields of one type each (where
    their min/max rules coincide), with and without filters, paging and a search term."""
    from haystack.document_stores.in_memory import InMemoryDocumentStore

    docs = _meta_corpus()
    ours, theirs = DensefitDocumentStore(tmp_path / "s", embedding_dim=4), InMemoryDocumentStore()
    ours.write_documents(docs)
    theirs.write_documents(docs)
    fields = ["lang", "meta.year", "score", "flag"]
    for filters in [{}, {"field": "meta.lang", "operator": "in", "value": ["en", "de"]}]:
        got = ours.count_unique_metadata_by_filter(filters, fields)
        assert got == theirs.count_unique_metadata_by_filter(filters, fields)
        assert got["lang"] == (4 if not filters else 2) and got["flag"] == 2
        for field in fields:
            for page in [dict(), dict(from_=3, size=5), dict(search_term="E", size=100)]:
                assert ours.get_metadata_field_unique_values(
                    field, filters=filters or None, **page
                ) == theirs.get_metadata_field_unique_values(field, filters=filters or None, **page)
    assert ours.get_metadata_fields_info() == theirs.get_metadata_fields_info()
    for field in ["year", "meta.score", "lang"]:
        assert ours.get_metadata_field_min_max(field) == theirs.get_metadata_field_min_max(field)
    assert ours.get_metadata_field_min_max("nowhere") == {"min": None, "max": None}


def test_min_max_of_mixed_fields_prefers_numbers_and_ignores_booleans(tmp_path):
    store = DensefitDocumentStore(tmp_path / "s", embedding_dim=2)
    store.write_documents(
        [Document(content="a", meta={"v": x}) for x in [3, "zz", True, 2.5, "aa", None, [9]]]
    )
    assert store.get_metadata_field_min_max("v") == {"min": 2.5, "max": 3}
    store.write_documents(
        [Document(content="b", meta={"w": w}) for w in ["2021-05-01", "1999-12-31"]]
    )
    assert store.get_metadata_field_min_max("w") == {"min": "1999-12-31", "max": "2021-05-01"}
    assert store.get_metadata_fields_info()["v"] == {"type": "keyword"}  # most values: text...
    values, total = store.get_metadata_field_unique_values("v", size=100)
    assert total == 6 and [9] in values and True in values  # lists and bools keep their type


# -- async: the event loop keeps running -------------------------------------------------------


@pytest.mark.asyncio
async def test_async_methods_do_not_block_the_event_loop(tmp_path):
    import asyncio
    import threading

    store = DensefitDocumentStore(tmp_path / "s", embedding_dim=2)
    await store.write_documents_async([Document(content="x", embedding=[1.0, 0.0])])
    released, ticks = threading.Event(), []
    slow = store.store.filter_documents

    def blocked(filters=None):
        assert released.wait(10), "the event loop was blocked while the store worked"
        return slow(filters)

    store.store.filter_documents = blocked
    pending = asyncio.ensure_future(store.filter_documents_async())
    for _ in range(3):  # the loop runs other tasks while the call waits in its thread
        await asyncio.sleep(0.01)
        ticks.append(pending.done())
    released.set()
    assert [d.content for d in await pending] == ["x"]
    assert ticks == [False, False, False]


@pytest.mark.asyncio
async def test_concurrent_async_writes_are_not_interleaved(tmp_path):
    """DuplicatePolicy.FAIL checks, then writes: under the store's lock, of eight
    concurrent writes of one id exactly one succeeds and seven raise, even when the time
    between check and write is long enough for all of them to check before any writes."""
    import asyncio
    import time

    store = DensefitDocumentStore(tmp_path / "s", embedding_dim=2)
    await store.write_documents_async([Document(id="seed", content="s")])
    hashes = store.store.hashes
    store.store.hashes = lambda ids: (hashes(ids), time.sleep(0.05))[0]  # a stale answer
    doc = Document(id="same", content="one")
    outcomes = await asyncio.gather(
        *(store.write_documents_async([doc], DuplicatePolicy.FAIL) for _ in range(8)),
        return_exceptions=True,
    )
    assert outcomes.count(1) == 1
    assert sum(isinstance(o, DuplicateDocumentError) for o in outcomes) == 7
    assert await store.count_documents_async() == 2


# -- the retriever ----------------------------------------------------------------------------


def _embedded_docs(n: int = 60, dim: int = 8, seed: int = 0) -> list[Document]:
    rng = np.random.default_rng(seed)
    return [
        Document(
            content=f"doc {i}",
            meta={"lang": ("en", "de")[i % 2], "year": 2000 + i},
            embedding=rng.standard_normal(dim).tolist(),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("similarity", ["cosine", "dot_product"])
def test_retriever_matches_haystacks_in_memory_retriever(similarity):
    from haystack.components.retrievers.in_memory import InMemoryEmbeddingRetriever
    from haystack.document_stores.in_memory import InMemoryDocumentStore

    docs = _embedded_docs() + [Document(content="no embedding", meta={"lang": "en"})]
    ours = DensefitDocumentStore(similarity=similarity)
    theirs = InMemoryDocumentStore(embedding_similarity_function=similarity)
    ours.write_documents(docs)
    theirs.write_documents(docs)
    query = np.random.default_rng(9).standard_normal(8).tolist()
    filters = {"field": "meta.lang", "operator": "==", "value": "en"}
    for kwargs in [{}, {"filters": filters}, {"scale_score": True, "top_k": 3}]:
        got = DensefitEmbeddingRetriever(ours, top_k=5).run(query_embedding=query, **kwargs)
        want = InMemoryEmbeddingRetriever(theirs, top_k=5).run(query_embedding=query, **kwargs)
        got, want = got["documents"], want["documents"]
        assert [d.id for d in got] == [d.id for d in want]
        np.testing.assert_allclose([d.score for d in got], [d.score for d in want], rtol=1e-5)
        assert all(d.embedding is None for d in got)
    with_embedding = DensefitEmbeddingRetriever(ours, top_k=1, return_embedding=True)
    top = with_embedding.run(query_embedding=query)["documents"][0]
    assert top.embedding == next(d.embedding for d in docs if d.id == top.id)


@pytest.mark.asyncio
async def test_retriever_run_async_equals_run_and_works_in_an_async_pipeline(tmp_path):
    store = DensefitDocumentStore(tmp_path / "s")
    await store.write_documents_async(_embedded_docs())
    query = _embedded_docs(seed=5)[0].embedding
    retriever = DensefitEmbeddingRetriever(store, top_k=4, scale_score=True)
    recent = {"field": "meta.year", "operator": ">=", "value": 2030}
    for kwargs in [{}, {"filters": recent, "top_k": 2, "return_embedding": True}]:
        want = retriever.run(query_embedding=query, **kwargs)
        got = await retriever.run_async(query_embedding=query, **kwargs)
        assert got == want and got["documents"]
    calls = []
    searched = store.embedding_retrieval_async
    store.embedding_retrieval_async = lambda **kw: (calls.append(kw), searched(**kw))[1]
    pipeline = Pipeline()
    pipeline.add_component("retrieve", retriever)
    result = await pipeline.run_async({"retrieve": {"query_embedding": query, "filters": recent}})
    assert result["retrieve"] == retriever.run(query_embedding=query, filters=recent)
    assert len(calls) == 1  # the pipeline awaited run_async, which awaited the async search


def test_retriever_filter_policy_and_serialisation(tmp_path):
    store = DensefitDocumentStore(tmp_path / "s", similarity="cosine")
    store.write_documents(_embedded_docs())
    query = _embedded_docs()[4].embedding
    retriever = DensefitEmbeddingRetriever(
        store,
        filters={"field": "meta.lang", "operator": "==", "value": "en"},
        top_k=4,
        scale_score=True,
        filter_policy="merge",
    )
    recent = {"field": "meta.year", "operator": ">=", "value": 2040}
    docs = retriever.run(query_embedding=query, filters=recent)["documents"]
    assert len(docs) == 4 and all(d.meta["lang"] == "en" and d.meta["year"] >= 2040 for d in docs)
    assert all(0 <= d.score <= 1 for d in docs)

    data = retriever.to_dict()
    assert data["init_parameters"]["document_store"]["init_parameters"]["path"] == str(
        tmp_path / "s"
    )
    json.dumps(data)  # a pipeline file can hold it
    again = DensefitEmbeddingRetriever.from_dict(data)
    assert again.run(query_embedding=query, filters=recent) == {"documents": docs}
    pipeline = Pipeline()
    pipeline.add_component("retrieve", retriever)
    # Haystack deserialises only modules it trusts: name ours.
    loaded = Pipeline.loads(pipeline.dumps(), allowed_modules=["densefit.integrations.haystack"])
    result = loaded.run({"retrieve": {"query_embedding": query, "filters": recent}})
    assert [d.id for d in result["retrieve"]["documents"]] == [d.id for d in docs]
    with pytest.raises(ValueError, match="top_k"):
        DensefitEmbeddingRetriever(store, top_k=0)
    with pytest.raises(TypeError):
        DensefitEmbeddingRetriever(object())


def _worded_docs() -> list[Document]:
    docs = _embedded_docs(40)
    words = ["cells genes", "python kernel", "rivers", "bread music", "vaccine dose"]
    worded = [
        Document(content=f"{words[i % 5]} doc {i}", meta=d.meta, embedding=d.embedding)
        for i, d in enumerate(docs)
    ]
    return worded + [Document(content="cells without an embedding", meta={"lang": "en"})]


@pytest.mark.parametrize("vectors", ["float32", "int8", "binary"])
def test_hybrid_retriever_modes_equal_the_store_search(tmp_path, vectors):
    rescore = None if vectors == "float32" else 64  # every document a candidate: exact
    store = DensefitDocumentStore(tmp_path / "s", vectors=vectors, rescore=rescore)
    docs = _worded_docs()
    store.write_documents(docs)
    query, embedding = "cells genes", docs[3].embedding
    filters = {"field": "meta.lang", "operator": "==", "value": "en"}
    bare = store.store
    # Documents without an embedding: in BM25, never on the dense side.
    no_embedding = {"field": f"meta.{RESERVED_KEY}.embedded", "operator": "!=", "value": False}
    for run_filters in (None, filters):
        for mode in ("dense", "bm25", "hybrid"):
            retriever = DensefitHybridRetriever(store, mode=mode, top_k=6)
            got = retriever.run(query=query, query_embedding=embedding, filters=run_filters)
            got = got["documents"]
            want = bare.search(
                np.asarray(embedding, dtype=np.float32) if mode != "bm25" else None,
                6,
                filters=run_filters,
                mode=mode,
                query_texts=[query],
                dense_filters=no_embedding,
            )[0]
            if mode == "dense":
                want_docs = store.embedding_retrieval(embedding, filters=run_filters, top_k=6)
                assert [d.id for d in got] == [d.id for d in want_docs]
            assert [d.id for d in got] == [h.id for h in want], (mode, run_filters)
            np.testing.assert_allclose([d.score for d in got], [h.score for h in want])
            assert all(d.embedding is None for d in got)
    bm25 = DensefitHybridRetriever(store, mode="bm25", top_k=50).run(query="cells")["documents"]
    assert "cells without an embedding" in [d.content for d in bm25]
    assert all("cells" in d.content for d in bm25)


def test_hybrid_retriever_contract(tmp_path):
    store = DensefitDocumentStore(tmp_path / "s")
    store.write_documents(_worded_docs())
    retriever = DensefitHybridRetriever(
        store, fusion="weighted", alpha=0.7, depth=20, top_k=3, scale_score=True
    )
    embedding = _worded_docs()[7].embedding
    docs = retriever.run(query="python kernel", query_embedding=embedding)["documents"]
    assert len(docs) == 3 and all(0 <= d.score <= 1 for d in docs)
    data = retriever.to_dict()
    json.dumps(data)
    again = DensefitHybridRetriever.from_dict(data)
    assert again.run(query="python kernel", query_embedding=embedding) == {"documents": docs}
    pipeline = Pipeline()
    pipeline.add_component("retrieve", retriever)
    loaded = Pipeline.loads(pipeline.dumps(), allowed_modules=["densefit.integrations.haystack"])
    result = loaded.run({"retrieve": {"query": "python kernel", "query_embedding": embedding}})
    assert [d.id for d in result["retrieve"]["documents"]] == [d.id for d in docs]
    with pytest.raises(ValueError, match="needs the query embedding"):
        DensefitHybridRetriever(store).run(query="x")
    with pytest.raises(ValueError, match="needs the query text"):
        DensefitHybridRetriever(store, mode="bm25").run(query_embedding=embedding)
    with pytest.raises(ValueError, match="mode must be one of"):
        DensefitHybridRetriever(store, mode="sparse")
    with pytest.raises(ValueError, match="fusion must be one of"):
        DensefitHybridRetriever(store, fusion="max")


@pytest.mark.asyncio
async def test_hybrid_retriever_run_async_equals_run_in_every_mode(tmp_path):
    store = DensefitDocumentStore(tmp_path / "s")
    await store.write_documents_async(_worded_docs())
    embedding = _worded_docs()[7].embedding
    filters = {"field": "meta.lang", "operator": "==", "value": "en"}
    for mode in ("dense", "bm25", "hybrid"):
        retriever = DensefitHybridRetriever(store, mode=mode, top_k=4)
        for kwargs in [{}, {"filters": filters, "top_k": 2, "scale_score": True}]:
            want = retriever.run(query="python kernel", query_embedding=embedding, **kwargs)
            got = await retriever.run_async(
                query="python kernel", query_embedding=embedding, **kwargs
            )
            assert got == want and got["documents"], (mode, kwargs)
    calls = []
    searched = store.hybrid_retrieval_async
    store.hybrid_retrieval_async = lambda **kw: (calls.append(kw), searched(**kw))[1]
    pipeline = Pipeline()
    pipeline.add_component("retrieve", DensefitHybridRetriever(store, top_k=3))
    result = await pipeline.run_async(
        {"retrieve": {"query": "python kernel", "query_embedding": embedding}}
    )
    assert len(result["retrieve"]["documents"]) == 3
    assert len(calls) == 1  # the pipeline awaited run_async, which awaited the async search
    with pytest.raises(InvalidText, match="query"):
        await store.bm25_retrieval_async(query="bad \udcff text")


# -- end to end: a densefit-trained model in a Haystack pipeline -----------------------------


@pytest.fixture(scope="module")
def trained_model_dir(tmp_path_factory):
    from densefit.api import Retriever
    from densefit.testing import tiny_model

    folder = tmp_path_factory.mktemp("trained")
    retriever = Retriever(tiny_model(folder / "base"))
    pairs = [
        {"question": f"{topic} question", "pos_doc": f"{topic} answer about {topic}"}
        for topic in ["cells", "genes", "python", "search", "cancer", "memory", "vaccine", "banana"]
    ]
    retriever.train(pairs, batch_size=4, n_epochs=1, max_steps=2, seed=0)
    return retriever.save(folder / "model")


def test_pipeline_ranks_as_densefit_search(trained_model_dir, tmp_path):
    pytest.importorskip("haystack_integrations.components.embedders.sentence_transformers")
    from haystack.components.writers import DocumentWriter
    from haystack_integrations.components.embedders.sentence_transformers import (
        SentenceTransformersDocumentEmbedder,
        SentenceTransformersTextEmbedder,
    )
    from typer.testing import CliRunner

    from densefit.cli.app import app
    from densefit.testing.conformance import make_corpus, with_meta

    model = str(trained_model_dir)
    corpus = [Document(id=d.id, content=d.text, meta=d.meta) for d in with_meta(make_corpus(40))]
    store = DensefitDocumentStore(tmp_path / "haystack-store", model=model)
    indexing = Pipeline()
    indexing.add_component(
        "embed", SentenceTransformersDocumentEmbedder(model=model, progress_bar=False)
    )
    indexing.add_component("write", DocumentWriter(store))
    indexing.connect("embed.documents", "write.documents")
    assert indexing.run({"embed": {"documents": corpus}})["write"]["documents_written"] == 40

    querying = Pipeline()
    querying.add_component(
        "embed", SentenceTransformersTextEmbedder(model=model, progress_bar=False)
    )
    querying.add_component("retrieve", DensefitEmbeddingRetriever(store, top_k=5))
    querying.connect("embed.embedding", "retrieve.query_embedding")

    # densefit's own index of the same corpus, searched from the command line
    corpus_file = tmp_path / "corpus.jsonl"
    corpus_file.write_text(
        "".join(
            json.dumps({"_id": d.id, "text": d.content, "metadata": d.meta}) + "\n" for d in corpus
        )
    )
    runner = CliRunner()
    densefit_store = tmp_path / "densefit-store"
    result = runner.invoke(
        app, ["index", str(corpus_file), "-m", model, "-s", str(densefit_store), "--no-progress"]
    )
    assert result.exit_code == 0, result.output

    filters = {"field": "meta.lang", "operator": "in", "value": ["en", "fr"]}
    for query, query_filters in [("cells and genes", None), ("python search", filters)]:
        got = querying.run({"embed": {"text": query}, "retrieve": {"filters": query_filters}})[
            "retrieve"
        ]["documents"]
        args = ["search", "-s", str(densefit_store), query, "-k", "5", "--json"]
        if query_filters:
            args += ["--filter", json.dumps(query_filters)]
        for store_dir in (densefit_store, tmp_path / "haystack-store"):
            args[2] = str(store_dir)  # also densefit search over the Haystack-built store
            result = runner.invoke(app, args)
            assert result.exit_code == 0, result.output
            hits = json.loads(result.stdout)[0]["hits"]
            assert [h["id"] for h in hits] == [d.id for d in got]
            np.testing.assert_allclose(
                [h["score"] for h in hits], [d.score for d in got], atol=1e-5
            )
