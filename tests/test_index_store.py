"""The store conformance suite, run against every backend (FAISS skipped when absent) and
every vector kind."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from densefit.data.types import Document
from densefit.errors import ReadOnlyStoreError
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.index import LocalDocumentStore, StoreError, open_store
from densefit.testing.conformance import EmbeddedConformance, make_corpus

needs_faiss = pytest.mark.skipif(
    importlib.util.find_spec("faiss") is None, reason="faiss is not installed (densefit[index])"
)


class TestExactBackend(EmbeddedConformance):
    @pytest.fixture
    def backend(self):
        return "exact"


@needs_faiss
class TestFaissBackend(EmbeddedConformance):
    @pytest.fixture
    def backend(self):
        return "faiss"  # HNSW32: approximate, but exact on stores this small


class TestFloat16Vectors(EmbeddedConformance):
    vectors = "float16"
    vector_atol = 2e-3  # float16 keeps about 3 significant digits

    @pytest.fixture
    def backend(self):
        return "exact"


class TestInt8Vectors(EmbeddedConformance):
    """int8 codes in memory, float32 on disk; every document a candidate (``rescore x k``
    covers the store), so results are exact: rescoring with fewer candidates is
    tests/test_vectors.py's."""

    vectors, rescore = "int8", 64

    @pytest.fixture
    def backend(self):
        return "exact"


class TestBinaryVectors(EmbeddedConformance):
    vectors, rescore = "binary", 64

    @pytest.fixture
    def backend(self):
        return "exact"


# -- store behaviour that does not depend on the backend ------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from densefit.testing import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny"))


def test_temporary_store_is_removed_on_close(model):
    store = open_store(None, model)
    path = store.path
    assert path.is_dir()
    store.close()
    assert not path.exists()


def test_open_missing_store_says_how_to_create_it(tmp_path):
    with pytest.raises(StoreError, match="densefit index CORPUS --model MODEL --store"):
        open_store(tmp_path / "nothing-here")
    with pytest.raises(StoreError, match="not a densefit store"):
        LocalDocumentStore(tmp_path)


def test_refuses_to_create_in_a_non_empty_folder(tmp_path, model):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not empty"):
        open_store(tmp_path, model)


def test_drop_deletes_the_store_files_and_keeps_the_others(model, tmp_path):
    docs = make_corpus(12)
    embeddings = encode_texts(model, [d.text for d in docs])
    with open_store(tmp_path / "s", model, backend="faiss" if _has_faiss() else None) as store:
        store.write(docs, embeddings)
        store.delete([docs[0].id])
        store.search(None, 3, mode="bm25", query_texts=["cells"])
        store.flush()  # the BM25 (and FAISS) caches are files now
        made = {p.name for p in store.path.iterdir()}
        assert "store.sqlite" in made and any(n.startswith("bm25-") for n in made)
        (store.path / "notes.txt").write_text("mine")
        store.drop()
        assert [p.name for p in (tmp_path / "s").iterdir()] == ["notes.txt"]
        store.close()  # closed already: nothing to do
    (tmp_path / "s" / "notes.txt").unlink()
    with open_store(tmp_path / "s", model) as store:
        store.write(docs, embeddings)
        store.drop()
    assert not (tmp_path / "s").exists()  # nothing else was in it
    temporary = open_store(None, model)
    temporary.drop()
    assert not temporary.path.exists()


def test_a_read_only_store_is_not_dropped(model, tmp_path):
    with open_store(tmp_path / "s", model) as store:
        store.write(make_corpus(2), encode_texts(model, ["a", "b"]))
    with LocalDocumentStore(tmp_path / "s", read_only=True) as store:
        with pytest.raises(ReadOnlyStoreError, match="read-only"):
            store.drop()
    with open_store(tmp_path / "s", create=False) as store:
        assert store.count() == 2


def _has_faiss() -> bool:
    return importlib.util.find_spec("faiss") is not None


def test_write_validation(model, tmp_path):
    docs = make_corpus(3)
    with open_store(tmp_path / "s", model) as store:
        with pytest.raises(ValueError, match=r"shape \(3, 32\)"):
            store.write(docs, np.zeros((3, 16), dtype=np.float32))
        with pytest.raises(ValueError, match="appears twice"):
            store.write([docs[0], docs[0]], np.ones((2, 32), dtype=np.float32))
        bad = np.ones((3, 32), dtype=np.float32)
        bad[1, 4] = np.nan
        with pytest.raises(ValueError, match=docs[1].id):
            store.write(docs, bad)
        with pytest.raises(TypeError, match="not a Document"):
            store.write(["text"], np.ones((1, 32), dtype=np.float32))
        with pytest.raises(ValueError, match="32-d"):
            store.search(np.ones((1, 8), dtype=np.float32))
        assert store.count() == 0  # nothing half-written


def test_float16_store_ranks_like_float32(model, tmp_path):
    docs = make_corpus(60)
    embeddings = encode_texts(model, [d.text for d in docs])
    queries = encode_texts(model, ["cells genes", "python search", "banana apple"])
    with (
        open_store(tmp_path / "f32", model) as f32,
        open_store(tmp_path / "f16", model, vectors="float16") as f16,
    ):
        f32.write(docs, embeddings)
        f16.write(docs, embeddings)
        assert f16.vector_kind == "float16" and next(f16.path.glob("vectors-*")).suffix == ".f16"
        for a, b in zip(f32.search(queries, top_k=5), f16.search(queries, top_k=5), strict=True):
            assert a[0].id == b[0].id
            np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=2e-3)


def test_dot_product_store_keeps_norms(tmp_path):
    from densefit.testing import tiny_model

    model = tiny_model(tmp_path / "m")
    model.similarity_fn_name = "dot"
    docs = make_corpus(5)
    embeddings = encode_texts(model, [d.text for d in docs])
    with open_store(tmp_path / "s", model) as store:
        assert store.similarity == "dot"
        store.write(docs, embeddings)
        hits = store.search(embeddings[:1], top_k=5)[0]
        expected = np.sort(embeddings @ embeddings[0])[::-1]
        np.testing.assert_allclose([h.score for h in hits], expected, rtol=1e-5)


def test_unknown_backend_lists_the_choices(model, tmp_path):
    with pytest.raises(ValueError, match=r"cannot search by 'annoy' \(it offers exact, faiss\)"):
        open_store(tmp_path / "s", model, backend="annoy")


def test_snippet_and_hit_dict():
    from densefit.retrieval.index import SearchHit

    hit = SearchHit("d", 0.5, 1, text="word " * 100, title="t")
    assert hit.snippet(40).endswith(" ...") and len(hit.snippet(40)) <= 44
    assert hit.to_dict()["id"] == "d"


def test_store_satisfies_the_protocol(model):
    from densefit.retrieval.index import DocumentStore, ExactBackend, VectorBackend
    from densefit.retrieval.index.base import ROLES

    with open_store(None, model) as store:
        assert isinstance(store, DocumentStore)
        assert all(isinstance(store, role) for role in ROLES.values())  # it declares them all
        assert all(getattr(store.capabilities, name) for name in ROLES)
        assert isinstance(store.backend, VectorBackend)
    assert isinstance(ExactBackend(), VectorBackend)


def test_documents_roundtrip_unicode_and_meta(model, tmp_path):
    docs = [Document("ü-1", "naïve café — 東京", title="t", meta={"n": 1, "tags": ["a"]})]
    with open_store(tmp_path / "s", model) as store:
        store.write(docs, encode_texts(model, [d.text for d in docs]))
    with LocalDocumentStore(tmp_path / "s") as store:
        got = store.get(["ü-1"])[0]
        assert got.text == docs[0].text and got.meta == {"n": 1, "tags": ["a"]}


def test_one_store_shared_by_threads(model, tmp_path):
    import threading

    docs = make_corpus(60)
    embeddings = encode_texts(model, [d.text for d in docs])
    errors = []
    with open_store(tmp_path / "s", model) as store:
        store.write(docs[:20], embeddings[:20])

        def reader():
            try:
                for _ in range(15):
                    assert store.search(embeddings[:3], top_k=3)[0][0].id == docs[0].id
            except Exception as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)

        def writer():
            try:
                for start in range(20, 60, 5):
                    store.write(docs[start : start + 5], embeddings[start : start + 5])
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(3)] + [
            threading.Thread(target=writer)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors and store.count() == 60
