"""The Qdrant engine in qdrant-client's local mode: targets, filters equal to the embedded
store's on tests/test_filters.py's table and on random filters, dense search equal to the
embedded store's (exact, HNSW, float16), BM25 equal to Bm25Index's scores up to the fixed
average length, hybrid equal to the embedded store's, the record, writes, the refusals, model
swaps through the collection alias (equal to a fresh index of the new model, resumed, killed,
cancelled, with writes meanwhile, from a store made before aliases, by the CLI), and the
conformance suite."""

from __future__ import annotations

import json
import os
import random
import threading
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("qdrant_client", reason="qdrant-client is not installed (densefit[qdrant])")

import test_filters  # noqa: E402 - tests/test_filters.py: the filter table and random filters

from densefit.data.types import Document  # noqa: E402
from densefit.retrieval.bm25 import K1, B, Bm25Index, Tokens, tokenize  # noqa: E402
from densefit.retrieval.fusion import Fusion  # noqa: E402
from densefit.retrieval.index import qdrant  # noqa: E402
from densefit.retrieval.index.engines import open_store  # noqa: E402
from densefit.retrieval.index.locking import StoreLockedError  # noqa: E402
from densefit.retrieval.index.types import (  # noqa: E402
    CapabilityError,
    ModelMismatchError,
    StoreError,
    StoreRecord,  # noqa: E402
)
from densefit.testing import SWAP_QUERIES, save_swap_models, swap_corpus  # noqa: E402
from densefit.testing import assert_same_hits as _assert_same  # noqa: E402
from densefit.testing import hit_pairs as _pairs  # noqa: E402
from densefit.testing import random_vectors as _vectors  # noqa: E402
from densefit.testing.conformance import (  # noqa: E402
    StoreConformance,
    SwapConformance,
    make_corpus,
    with_meta,
)


def _record(dim: int = 8, similarity: str = "cosine", kind: str = "float32") -> StoreRecord:
    return StoreRecord("random", dim, similarity, kind, np.zeros((3, dim), np.float32), None)


def _pair(tmp_path, record: StoreRecord, **options):
    """An embedded store and a Qdrant store (local mode) for the same record."""
    embedded = open_store(tmp_path / "embedded", record=record)
    store = open_store(f"qdrant:{tmp_path}/q", record=record, **options)
    return embedded, store


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


# -- targets --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("qdrant://db:6334/docs", {"host": "db", "port": 6334, "collection": "docs"}),
        ("qdrant://db/docs?https=true", {"port": 6333, "https": True, "path": None}),
        ("qdrant:runs/q", {"path": "runs/q", "collection": "densefit", "host": None}),
        ("qdrant:/srv/q?collection=a-b_1", {"path": "/srv/q", "collection": "a-b_1"}),
        ("qdrant:///srv/q", {"path": "/srv/q", "collection": "densefit"}),
    ],
)
def test_targets(target, expected):
    parsed = qdrant.parse_target(target)
    assert parsed.location == target
    assert {key: getattr(parsed, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("qdrant://db/my docs", "collection name 'my docs' is not 1 to 64 letters"),
        ("qdrant:q?collection=" + "x" * 65, "is not 1 to 64 letters"),
        ("qdrant:q?collection=a.b", "collection name 'a.b'"),
        ("qdrant://db:6333", "no collection: write qdrant://db:6333/COLLECTION"),
        ("qdrant://key:secret@db/docs", "set the API key in the environment variable"),
        ("qdrant://db/docs?tls=1", "unknown option 'tls'"),
        ("qdrant://db:99999/docs", "the port is not a number"),
        ("qdrant:q?name=x", r"unknown option 'name': write qdrant:FOLDER\[\?collection=NAME\]"),
    ],
)
def test_bad_targets_are_one_line(target, message):
    with pytest.raises(StoreError, match=message) as caught:
        qdrant.parse_target(target)
    assert "secret" not in _one_line(caught)


def test_bad_collection_name_through_open_store(tmp_path):
    with pytest.raises(StoreError, match="collection name 'bad name'") as caught:
        open_store(f"qdrant:{tmp_path}/q?collection=bad name", record=_record())
    _one_line(caught)
    assert not (tmp_path / "q").exists()  # nothing created


def test_unreachable_server_is_one_line():
    with pytest.raises(StoreError, match="cannot use the Qdrant server at http://127.0.0.1:1") as c:
        open_store("qdrant://127.0.0.1:1/docs", record=_record())
    assert "start it" in _one_line(c)


@pytest.mark.filterwarnings("ignore:Api key is used with an insecure connection")
def test_a_refused_api_key_is_one_line(monkeypatch):
    """A server answering 401: the key went out in the api-key header, the line says to set
    QDRANT_API_KEY and does not show the key."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Refusing(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(self.headers.get("api-key"))
            body = b'{"status": {"error": "Must provide an API key"}}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("QDRANT_API_KEY", "not-the-key")
    try:
        target = f"qdrant://127.0.0.1:{server.server_address[1]}/docs"
        with pytest.raises(StoreError, match="refused the request \\(HTTP 401\\)") as caught:
            open_store(target, record=_record())
        message = _one_line(caught)
        assert message.startswith(target) and "QDRANT_API_KEY" in message
        assert "not-the-key" not in message and seen == ["not-the-key"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_folder_of_something_else_is_refused(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="holds no Qdrant storage") as caught:
        open_store(f"qdrant:{tmp_path}/other", record=_record())
    _one_line(caught)
    open_store(tmp_path / "embedded", record=_record()).close()
    with pytest.raises(StoreError, match="holds an embedded densefit store"):
        open_store(f"qdrant:{tmp_path}/embedded", record=_record())


def test_opening_nothing_creates_nothing(tmp_path):
    with pytest.raises(StoreError, match="no densefit store at"):
        open_store(f"qdrant:{tmp_path}/q", create=False)
    assert not (tmp_path / "q").exists()


# -- filters: the embedded store's semantics -----------------------------------------------


def _filter_table() -> list[tuple[dict, list[int]]]:
    """tests/test_filters.py's table of filters and the rows of METAS each matches."""
    mark = next(m for m in test_filters.test_filter_semantics.pytestmark if m.name == "parametrize")
    return mark.args[1]


def _meta_docs(metas: list[dict], ids: list[str] | None = None) -> list[Document]:
    ids = ids or [f"d{i}" for i in range(len(metas))]
    return [Document(ids[i], f"text {i}", meta=m) for i, m in enumerate(metas)]


@pytest.fixture(scope="module")
def filter_stores(tmp_path_factory):
    """An embedded and a Qdrant store holding tests/test_filters.py's METAS documents plus
    some with field names that need escaping in a payload path."""
    folder = tmp_path_factory.mktemp("filters")
    record = _record(4)
    embedded, store = _pair(folder, record)
    docs = _meta_docs(
        test_filters.METAS
        + [
            {"release date": "2024-01-02", "a-b": 1, "größe": 3.5, "x": {"y z": True}},
            {"release date": "2023-12-31T23:00:00-02:00", "a-b": "1", "x": {"y z": False}},
            {"tags": ["Straße", "日本"], "city": "München", "empty": "", "list": []},
        ]
    )
    for target in (embedded, store):
        target.write(docs, _vectors(len(docs), 4))
    yield embedded, store
    embedded.close()
    store.close()


def _ids(store, filters) -> list[str]:
    return [d.id for d in store.filter_documents(filters)]


@pytest.mark.parametrize(("filters", "expected"), _filter_table())
def test_filter_table_matches_as_the_embedded_store(filter_stores, filters, expected):
    embedded, store = filter_stores
    got = [i for i in _ids(store, filters) if int(i[1:]) < len(test_filters.METAS)]
    assert got == [f"d{i}" for i in expected]
    assert _ids(store, filters) == _ids(embedded, filters)
    assert store.count_matching(filters) == embedded.count_matching(filters)


@pytest.mark.parametrize(
    "filters",
    [
        {"field": "meta.release date", "operator": ">", "value": "2024-01-01T12:00:00"},
        {"field": "meta.release date", "operator": "<=", "value": "2024-01-01T01:00:00Z"},
        {"field": "meta.a-b", "operator": "==", "value": 1},
        {"field": "meta.a-b", "operator": "in", "value": ["1", True]},
        {"field": "meta.x.y z", "operator": "==", "value": False},
        {"field": "meta.x.y z", "operator": "!=", "value": True},
        {"field": "meta.x", "operator": "==", "value": {"y z": True}},
        {"field": "meta.tags", "operator": "==", "value": ["Straße", "日本"]},
        {"field": "meta.tags", "operator": "in", "value": [["Straße", "日本"], None]},
        {"field": "meta.city", "operator": "==", "value": "München"},
        {"field": "meta.empty", "operator": "==", "value": ""},
        {"field": "meta.list", "operator": "==", "value": []},
        {"field": "meta.list", "operator": "==", "value": None},
        {"field": "title", "operator": "==", "value": ""},
        {"field": "text", "operator": "in", "value": ["text 6", "text 9"]},
        {"field": "id", "operator": ">", "value": 3},
        {"field": "id", "operator": "!=", "value": 3},
        {"operator": "NOT", "conditions": []},
        {"operator": "NOT", "conditions": [{"operator": "OR", "conditions": []}]},
    ],
)
def test_escaped_names_and_edge_values_match_as_the_embedded_store(filter_stores, filters):
    embedded, store = filter_stores
    assert _ids(store, filters) == _ids(embedded, filters)


def test_non_ascii_metadata_names_are_found(filter_stores):
    """As Haystack finds them (the embedded store does not: it writes metadata with ASCII
    escapes, and SQLite 3.40 looks keys up unescaped)."""
    _, store = filter_stores
    assert _ids(store, {"field": "meta.größe", "operator": ">=", "value": 3}) == ["d6"]
    assert _ids(store, {"field": "meta.größe", "operator": "==", "value": None}) == [
        f"d{i}" for i in range(9) if i != 6
    ]


def test_random_filters_match_as_the_embedded_store(tmp_path):
    """tests/test_filters.py's random filters (the ones it checks against Haystack's
    evaluator), on documents made as it makes them: the Qdrant filter selects exactly the
    documents the embedded store's SQL selects."""
    rng = random.Random(0)
    metas = []
    for _ in range(40):
        meta = {}
        for key in ("a", "b"):
            if rng.random() < 0.8:
                meta[key] = test_filters._random_value(rng)
        if rng.random() < 0.5:
            meta["c"] = {"d": test_filters._random_value(rng)}
        metas.append(meta)
    ids = [rng.choice(["en", "1", f"doc{i}"]) + f"-{i}" for i in range(len(metas))]
    docs = _meta_docs(metas, ids)
    embedded, store = _pair(tmp_path, _record(4))
    try:
        for target in (embedded, store):
            target.write(docs, _vectors(len(docs), 4))
        differing = []
        for _ in range(1000):
            filters = test_filters._random_filter(rng)
            if _ids(store, filters) != _ids(embedded, filters):
                differing.append(filters)
        assert not differing, json.dumps(differing[:3])
    finally:
        embedded.close()
        store.close()


def test_filters_see_metadata_rewrites(tmp_path):
    embedded, store = _pair(tmp_path, _record(4))
    try:
        docs = _meta_docs([{"lang": "en", "old": 1}, {"lang": "de"}])
        for target in (embedded, store):
            target.write(docs, _vectors(2, 4))
            rewritten = [Document("d0", "ignored", title="T", meta={"lang": "fr"})]
            assert target.write_metadata([*rewritten, Document("zz", "x")]) == 1
        for filters in (
            {"field": "meta.old", "operator": "==", "value": None},
            {"field": "meta.lang", "operator": "==", "value": "fr"},
            {"field": "title", "operator": "==", "value": "T"},
            {"field": "content", "operator": "==", "value": "text 0"},  # the text stays
        ):
            assert _ids(store, filters) == _ids(embedded, filters) != [], filters
        assert store.get(["d0"])[0].text == "text 0"
        assert store.hashes(["d0"]) == embedded.hashes(["d0"])
    finally:
        embedded.close()
        store.close()


def test_metadata_statistics_equal_the_embedded_store(filter_stores):
    embedded, store = filter_stores
    filters = {"field": "meta.lang", "operator": "!=", "value": "de"}
    assert store.meta_fields() == embedded.meta_fields()
    for field in ("meta.n", "meta.lang", "meta.release date", "meta.x.y z"):
        assert sorted(map(repr, store.meta_values(field))) == sorted(
            map(repr, embedded.meta_values(field))
        )
        assert store.meta_range(field, filters) == embedded.meta_range(field, filters)


def test_index_meta_field_checks_the_name(filter_stores):
    _, store = filter_stores
    store.index_meta_field("meta.release date")  # local mode: checked, nothing to build
    with pytest.raises(ValueError, match="metadata fields are named meta.NAME"):
        store.index_meta_field("lang")


# -- dense search ----------------------------------------------------------------------------


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_exact_search_equals_the_embedded_store(tmp_path, similarity):
    record = _record(16, similarity)
    embedded, store = _pair(tmp_path, record, backend="exact")
    try:
        docs = with_meta(make_corpus(120))
        vectors = _vectors(len(docs), 16)
        for target in (embedded, store):
            target.write(docs[:80], vectors[:80])
            target.write(docs[80:], vectors[80:])
            target.write(docs[:5], _vectors(5, 16, seed=9))  # updates: last in the write order
            target.delete([docs[7].id, docs[90].id])
        queries = _vectors(6, 16, seed=1)
        for filters in (
            None,
            {"field": "meta.lang", "operator": "==", "value": "de"},
            {"field": "meta.rare", "operator": "==", "value": True},
        ):
            got = _pairs(store.search(queries, top_k=10, filters=filters))
            _assert_same(got, _pairs(embedded.search(queries, top_k=10, filters=filters)))
        scaled = store.search(queries, top_k=10, scale_score=True)
        _assert_same(_pairs(scaled), _pairs(embedded.search(queries, top_k=10, scale_score=True)))
        live = [d.id for d in docs[:20] if d.id != docs[7].id]
        np.testing.assert_allclose(store.vectors(live), embedded.vectors(live), atol=1e-6)
        assert [d.id for d in store.filter_documents()] == [
            d.id for d in embedded.filter_documents()
        ]
    finally:
        embedded.close()
        store.close()


def test_hnsw_results_equal_exact_ones(tmp_path):
    """Local mode searches exactly whatever the backend: on a server, HNSW approximates."""
    record = _record(16)
    docs = make_corpus(200)
    with open_store(f"qdrant:{tmp_path}/q", record=record, backend="exact") as exact:
        exact.write(docs, _vectors(len(docs), 16))
        queries = _vectors(5, 16, seed=2)
        expected = _pairs(exact.search(queries, top_k=10))
    with open_store(f"qdrant:{tmp_path}/q") as hnsw:
        assert hnsw.backend_name == "hnsw" and hnsw.info()["backend"] == "hnsw"
        _assert_same(_pairs(hnsw.search(queries, top_k=10)), expected)


def test_float16_vectors_equal_the_embedded_float16_store(tmp_path):
    record = _record(16, kind="float16")
    embedded, store = _pair(tmp_path, record)
    try:
        docs = make_corpus(50)
        vectors = _vectors(len(docs), 16)
        for target in (embedded, store):
            target.write(docs, vectors)
        ids = [d.id for d in docs]
        stored = store.vectors(ids)
        assert np.array_equal(stored, stored.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(stored, embedded.vectors(ids))
        queries = _vectors(4, 16, seed=3)
        _assert_same(_pairs(store.search(queries, 8)), _pairs(embedded.search(queries, 8)))
        assert store.info()["vectors"] == "float16"
    finally:
        embedded.close()
        store.close()


# -- BM25 and hybrid -------------------------------------------------------------------------

BM25_QUERIES = [
    "cells genes",
    "python function return",
    "banana apple memory",
    "the of",
    "vaccine dose trial mice",
    "search cancer cells cells",
]


def _bm25(store, queries=BM25_QUERIES, k=10, **options):
    return _pairs(store.search(None, k, mode="bm25", query_texts=queries, **options))


def _expected_bm25(docs: list[Document], queries, k: int, avgdl: float, mask=None):
    """bm25s's scores over ``docs`` (in write order) with the length average ``avgdl``."""
    tokens = [tokenize([d.text])[0] for d in docs]
    n = len(docs)
    results = []
    for query in tokenize(queries):
        scores = np.zeros(n)
        for token, count in zip(*np.unique(query, return_counts=True), strict=True):
            df = sum(token in t for t in tokens)
            idf = np.log(1 + (n - df + 0.5) / (df + 0.5))
            for i, t in enumerate(tokens):
                tf = t.count(token)
                if tf:
                    scores[i] += count * idf * tf / (tf + K1 * (1 - B + B * len(t) / avgdl))
        if mask is not None:
            scores[~mask] = 0
        order = sorted((i for i in range(n) if scores[i] > 0), key=lambda i: (-scores[i], i))
        results.append([(docs[i].id, float(scores[i])) for i in order[:k]])
    return results


def test_bm25_written_at_once_equals_bm25index(tmp_path):
    docs = make_corpus(40)
    with open_store(f"qdrant:{tmp_path}/q", record=_record()) as store:
        store.write(docs, _vectors(len(docs)))
        got = _bm25(store, k=12)
        index = Bm25Index(Tokens.of([d.text for d in docs]))
        expected = [
            [(docs[p].id, float(s)) for p, s in zip(*found, strict=True)]
            for found in index.search(BM25_QUERIES, 12)
        ]
        _assert_same(got, expected, atol=1e-5)
        assert got[3] == []  # stop words only
        lengths = [len(t) for t in tokenize([d.text for d in docs])]
        assert store.info()["bm25_avgdl"] == pytest.approx(np.mean(lengths))


@pytest.mark.skipif(
    tuple(int(p) for p in version("qdrant-client").split(".")[:2]) < (1, 20),
    reason="local mode's IDF follows updates and deletes from qdrant-client 1.20",
)
def test_bm25_keeps_the_first_average_length_and_follows_changes(tmp_path):
    """Later writes, updates and deletes: Qdrant's IDF follows the documents, the lengths
    stay normalised by the first write's average; scores are bm25s's with that average."""
    docs = make_corpus(40)
    first = docs[:10]
    with open_store(f"qdrant:{tmp_path}/q", record=_record()) as store:
        store.write(first, _vectors(10))
        avgdl = float(np.mean([len(t) for t in tokenize([d.text for d in first])]))
        store.write(docs[10:], _vectors(30, seed=1))
        changed = Document(docs[4].id, "vaccine dose trial mice", title="trial")
        store.write([changed], _vectors(1, seed=2))
        store.delete([docs[0].id, docs[9].id])
        current = store.filter_documents()
        assert store.info()["bm25_avgdl"] == pytest.approx(avgdl)
        _assert_same(_bm25(store, k=50), _expected_bm25(current, BM25_QUERIES, 50, avgdl))
        filters = {"field": "title", "operator": "in", "value": ["cells", "trial"]}
        mask = np.array([d.title in ("cells", "trial") for d in current])
        _assert_same(
            _bm25(store, k=50, filters=filters),
            _expected_bm25(current, BM25_QUERIES, 50, avgdl, mask),
        )
        assert _bm25(store, filters={"operator": "OR", "conditions": []}) == [[]] * 6


@pytest.mark.parametrize("fusion", [Fusion(), Fusion(method="weighted", alpha=0.3, depth=15)])
def test_hybrid_equals_the_embedded_store(tmp_path, fusion):
    """Written at once, both sides rank as the embedded store's, and so does their fusion
    (ties go to the earlier written document on both)."""
    embedded, store = _pair(tmp_path, _record(16))
    try:
        docs = with_meta(make_corpus(60))
        vectors = _vectors(len(docs), 16)
        for target in (embedded, store):
            target.write(docs, vectors)
        texts = BM25_QUERIES[:3]
        queries = _vectors(3, 16, seed=4)
        for filters in (None, {"field": "meta.year", "operator": ">=", "value": 2004}):
            options = {"mode": "hybrid", "query_texts": texts, "fusion": fusion, "filters": filters}
            for scale in (False, True):
                got = _pairs(store.search(queries, 7, scale_score=scale, **options))
                expected = _pairs(embedded.search(queries, 7, scale_score=scale, **options))
                _assert_same(got, expected)
    finally:
        embedded.close()
        store.close()


# -- the record, reopening, several handles ----------------------------------------------------


def test_reopen_finds_documents_and_record(tmp_path, model):
    target = f"qdrant:{tmp_path}/q?collection=docs"
    docs = make_corpus(12)
    with open_store(target, model) as store:
        record = store.record
        store.write(docs, _vectors(len(docs), 32))
        before = _pairs(store.search(_vectors(2, 32, seed=5), 4))
    assert (tmp_path / "q" / "collection" / "docs_g0").is_dir()  # "docs" is its alias
    with open_store(target) as again:  # no model: the record says what it holds
        assert again.count() == len(docs)
        assert (again.model_name, again.dim, again.similarity) == (
            record.model_name,
            record.dim,
            record.similarity,
        )
        np.testing.assert_array_equal(again.record.fingerprint, record.fingerprint)
        assert again.settings == record.settings
        again.check_model(model)
        _assert_same(_pairs(again.search(_vectors(2, 32, seed=5), 4)), before)
        assert sorted(again.ids()) == sorted(d.id for d in docs)


def test_another_model_is_refused(tmp_path, model, tiny_models):
    from densefit.models import load_model

    target = f"qdrant:{tmp_path}/q"
    open_store(target, model).close()
    other = load_model(str(tiny_models / "tiny-other"))
    with pytest.raises(ModelMismatchError, match="does not reproduce") as caught:
        open_store(target, other)
    assert _one_line(caught).startswith(target)


def test_another_dimension_or_a_foreign_collection_is_refused(tmp_path):
    from qdrant_client import QdrantClient, models

    folder = tmp_path / "q"
    open_store(f"qdrant:{folder}", record=_record(8)).close()
    client = QdrantClient(path=str(folder))
    metadata = client.get_collection("densefit").config.metadata
    client.create_collection(
        "narrow",
        vectors_config={"dense": models.VectorParams(size=4, distance=models.Distance.DOT)},
        sparse_vectors_config={"bm25": models.SparseVectorParams(modifier=models.Modifier.IDF)},
        metadata=metadata,
    )
    client.create_collection(
        "theirs", vectors_config=models.VectorParams(size=8, distance=models.Distance.COSINE)
    )
    client.close()
    with pytest.raises(StoreError, match="holds 4-d vectors but records 8-d") as caught:
        open_store(f"qdrant:{folder}?collection=narrow", record=_record(8))
    _one_line(caught)
    with pytest.raises(StoreError, match="'theirs' is not a densefit store") as caught:
        open_store(f"qdrant:{folder}?collection=theirs", record=_record(8))
    _one_line(caught)


def test_stores_of_one_process_share_the_folder(tmp_path):
    target = f"qdrant:{tmp_path}/q"
    first = open_store(target, record=_record())
    second = open_store(target)
    docs = make_corpus(5)
    first.write(docs, _vectors(5))
    assert second.count() == 5 and second.get([docs[2].id])[0] == docs[2]
    first.close()
    assert second.count() == 5  # the folder stays open for the other
    second.close()
    with pytest.raises(StoreError, match="the store is closed"):
        second.count()
    with open_store(target) as third:  # the last close let the folder go: opened afresh
        assert third.count() == 5


def test_another_process_is_refused_in_local_mode(tmp_path):
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    target = f"qdrant:{tmp_path}/q"
    with open_store(target, record=_record()) as store:
        assert store.capabilities.shared is False and qdrant.CAPABILITIES.shared is True
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: another process, with this one's modules loaded
            try:
                open_store(target).close()
                os.write(write_end, b"opened")
            except BaseException as exc:  # noqa: BLE001 - report it to the parent
                os.write(write_end, str(exc).encode())
            os._exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        with os.fdopen(read_end) as pipe:
            message = pipe.read()
        assert store.count() == 0  # still usable here
    assert "another process has this Qdrant folder open" in message, message
    assert "\n" not in message


# -- writes, re-embedding, locks, refusals -----------------------------------------------------


def test_write_and_delete_counts(tmp_path):
    with open_store(f"qdrant:{tmp_path}/q", record=_record()) as store:
        docs = make_corpus(10)
        result = store.write(docs[:6], _vectors(6))
        assert (result.added, result.updated) == (6, 0)
        result = store.write(docs[4:], _vectors(6, seed=1))
        assert (result.added, result.updated) == (4, 2)
        assert store.count() == 10
        assert store.delete([docs[0].id, docs[0].id, docs[1].id, "never-there"]) == 2
        assert store.delete([]) == 0 and store.count() == 8
        assert store.get([docs[0].id, docs[5].id]) == [None, docs[5]]
        with pytest.raises(KeyError, match="1 ids are not in the store"):
            store.vectors([docs[0].id])
        assert store.write([], np.zeros((0, 8), np.float32)).added == 0
        # the updated documents come last in the write order
        assert [d.id for d in store.filter_documents()][-6:] == [d.id for d in docs[4:]]
        copies = store.vectors_for_texts([store.hashes([docs[5].id])[docs[5].id][0], "x"])
        np.testing.assert_allclose(list(copies.values())[0], store.vectors([docs[5].id])[0])


def test_indexing_and_searching_by_model(tmp_path, model):
    """densefit's indexing (writer lock, hashes, runtime adoption) and model search."""
    from densefit.retrieval.index import index_documents, search

    docs = with_meta(make_corpus(30))
    with open_store(f"qdrant:{tmp_path}/q", model) as store:
        report = index_documents(store, model, docs, batch_size=8, commit_every=16)
        assert report.added == 30
        report = index_documents(store, model, docs, batch_size=8)
        assert report.unchanged == 30 and report.added == 0
        hits = search(store, model, docs[3].text, top_k=3)
        assert hits[0].id == docs[3].id and hits[0].meta == docs[3].meta


def test_write_order_keys_increase(tmp_path):
    with open_store(f"qdrant:{tmp_path}/q", record=_record()) as store:
        keys = store._next_seqs(3) + store._next_seqs(2)
        assert keys == sorted(keys) and len(set(keys)) == 5
        assert all(k % 1024 == store._tag for k in keys) and max(keys) < 2**63


def test_writer_lock(tmp_path):
    with open_store(f"qdrant:{tmp_path}/q", record=_record()) as store:
        with pytest.raises(ValueError, match="lock_timeout must be >= 0"):
            store.writer_lock(-1)
        with store.writer_lock(0):
            with store.writer_lock(0):  # the same thread may take it again
                pass
            failed = []

            def other():
                try:
                    with store.writer_lock(0.05):
                        pass
                except StoreLockedError as exc:
                    failed.append(str(exc))

            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
        assert failed and "another thread is still writing to this store" in failed[0]


def test_capability_refusals(tmp_path):
    for kind in ("int8", "binary"):
        with pytest.raises(CapabilityError, match=f"cannot store {kind} vectors") as caught:
            open_store(f"qdrant:{tmp_path}/{kind}", record=_record(kind=kind))
        assert "the embedded store" in _one_line(caught)
    with pytest.raises(CapabilityError, match="cannot search by 'faiss'"):
        open_store(f"qdrant:{tmp_path}/q", record=_record(), backend="faiss")
    with open_store(f"qdrant:{tmp_path}/q", record=_record()) as store:
        with pytest.raises(StoreError, match="a float32 store swaps to float32 vectors") as c:
            store.begin_swap(_record(kind="float16"))
        _one_line(c)
        with pytest.raises(ValueError, match="swap_embeddings need the swap_target"):
            store.write(make_corpus(2), _vectors(2), swap_embeddings=_vectors(2))
        assert store.swap_target() is None and store.cancel_swap() is False
        assert store.compact() == 0 and store.dead_rows() == 0


def test_closed_store_says_so(tmp_path):
    store = open_store(f"qdrant:{tmp_path}/q", record=_record())
    store.close()
    store.close()  # twice is fine
    with pytest.raises(StoreError, match="the store is closed"):
        store.search(_vectors(1), 3)


# -- model swaps: blue/green through the collection alias --------------------------------------


@pytest.fixture(scope="module")
def swap_models(tmp_path_factory) -> dict:
    """Saved tiny models, loaded: ``old``, ``new`` (another seed, same size) and ``wide``
    (48-d)."""
    from densefit.models import load_model

    folder = tmp_path_factory.mktemp("qdrant-swap-models")
    made = save_swap_models(folder)
    return {name: load_model(str(path)) for name, path in made.items()} | {"folder": folder}


def _embed(model, texts: list[str]) -> np.ndarray:
    from densefit.retrieval.encode import encode_texts

    return encode_texts(model, texts, prompt_name="document")


def _stored(model, texts: list[str]) -> np.ndarray:
    """The vectors a cosine store keeps for ``texts`` embedded by ``model``: unit length."""
    vectors = _embed(model, texts)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _ranking(store, model, **options) -> list[list[tuple[str, float]]]:
    from densefit.retrieval.encode import encode_texts

    queries = encode_texts(model, SWAP_QUERIES, prompt_name="query")
    return [
        [(h.id, round(h.score, 4)) for h in hits] for hits in store.search(queries, 5, **options)
    ]


def _bm25_ranking(store) -> list[list[tuple[str, float]]]:
    """Every match (a cut at k could fall inside a tie, which Qdrant breaks its own way)."""
    return _pairs(store.search(None, 50, mode="bm25", query_texts=SWAP_QUERIES))


def _collections(folder) -> list[str]:
    return sorted(p.name for p in (folder / "collection").iterdir())


def _assert_equals_fresh(store, model, documents: list[Document], folder) -> None:
    """The swapped store holds what a fresh Qdrant index of ``documents`` by ``model`` does:
    the same documents, vectors (up to the rounding of other batches: the swap embeds
    chunks in write order, indexing by length), dense and BM25 rankings."""
    from densefit.retrieval.index import index_documents

    with open_store(f"qdrant:{folder}", model) as fresh:
        index_documents(fresh, model, documents)
        ids = sorted(d.id for d in documents)
        assert sorted(store.ids()) == ids
        np.testing.assert_allclose(store.vectors(ids), fresh.vectors(ids), rtol=0, atol=1e-5)
        assert store.get(ids) == fresh.get(ids)
        assert _ranking(store, model) == _ranking(fresh, model)
        if store.info()["bm25_avgdl"] == fresh.info()["bm25_avgdl"]:
            _assert_same(_bm25_ranking(store), _bm25_ranking(fresh))
    store.check_model(model)
    assert store.swap_target() is None and store.info()["swap"] is None


@pytest.fixture
def swap_target(tmp_path, swap_models) -> str:
    """A Qdrant store (local mode) of 40 documents indexed by the ``old`` model."""
    from densefit.retrieval.index import index_documents

    target = f"qdrant:{tmp_path}/q"
    with open_store(target, swap_models["old"]) as store:
        index_documents(store, swap_models["old"], swap_corpus())
    return target


class TestQdrantSwap(SwapConformance):
    """Every swap behaviour the suite states, in local mode: its generations are the
    collections behind the store's alias (``NAME_g<N>``), one left after a switch or a cancel."""

    @pytest.fixture
    def target(self, tmp_path):
        return f"qdrant:{tmp_path}/q"

    def generations(self, target) -> list[str]:
        return _collections(Path(target[len("qdrant:") :]))


def test_a_swap_moves_the_alias_and_keeps_the_bm25_scores(swap_models, swap_target):
    from densefit.retrieval.index.reembed import reembed_store

    with open_store(swap_target) as store:
        bm25 = _bm25_ranking(store)
        assert store.info()["serving_collection"] == "densefit_g0"
        assert reembed_store(store, swap_models["wide"], commit_every=7).switched
        assert store.info()["serving_collection"] == "densefit_g1"
        assert _bm25_ranking(store) == bm25  # the same sparse vectors and average length


def _swap_after_a_chunk(store, new, size: int = 10):
    """Begin a swap to ``new`` and copy its first ``size`` documents; the swap and the
    chunk's ids."""
    from densefit.retrieval.index.settings import record_for

    target, _ = store.begin_swap(record_for(new, store.vector_kind))
    pending = store.swap_pending(-1, size)
    vectors = _embed(new, [text for *_, text in pending])
    assert store.write_swap(target, [(r, i) for r, i, _ in pending], vectors) == size
    return target, [doc_id for _, doc_id, _ in pending]


def test_changes_that_missed_the_swap_are_found_at_the_switch(tmp_path, swap_models, swap_target):
    """Writes by a process whose view of the store predates the swap (on a server, read up
    to a second before) reach the serving collection only: the swap finds the copies made
    from an older text or metadata by their ``seq`` and ``meta_hash`` and embeds them again,
    and drops the copies of deleted documents."""
    from densefit.retrieval.index.reembed import reembed_store

    old, new = swap_models["old"], swap_models["new"]
    with open_store(swap_target) as store:
        _, chunk = _swap_after_a_chunk(store, new)
        read_record = store._read_record

        def view_before_the_swap():
            read_record()
            store._swap = None

        store._read_record = view_before_the_swap
        rewritten = Document(chunk[2], "bone bone bone music", meta={"n": 2})
        store.write([rewritten], _embed(old, [rewritten.text]))
        store.write_metadata([Document(chunk[3], "", "t", {"n": 3})])
        store.delete([chunk[4]])
        del store._read_record
        assert store.info()["swap"]["remaining"] == 30 + 2  # the rest, the rewrite, the title
        report = reembed_store(store, new, commit_every=8)
        assert report.switched and report.embedded == 30 + 2
        np.testing.assert_allclose(
            store.vectors([rewritten.id])[0], _stored(new, [rewritten.text])[0], atol=1e-5
        )
        assert store.get([chunk[3]])[0].title == "t" and store.get([chunk[4]]) == [None]
        assert store.count() == 39 == len(list(store.ids()))


def _legacy_store(folder, model, documents: list[Document]) -> str:
    """A store as densefit made them before aliases: a plain collection named ``densefit``
    (its record and layout in the metadata), then ``documents`` indexed into it."""
    from qdrant_client import QdrantClient, models

    from densefit.retrieval.index import index_documents
    from densefit.retrieval.index.settings import record_for

    record = record_for(model, "float32")
    counters = ("n_rows", "generation", "stale_below_row")
    metadata = {k: v for k, v in record.to_meta().items() if k not in counters}
    client = QdrantClient(path=str(folder))
    client.create_collection(
        "densefit",
        vectors_config={
            "dense": models.VectorParams(size=record.dim, distance=models.Distance.DOT)
        },
        sparse_vectors_config={"bm25": models.SparseVectorParams(modifier=models.Modifier.IDF)},
        metadata=metadata | {"layout": qdrant.LAYOUT},
    )
    client.close()
    target = f"qdrant:{folder}"
    with open_store(target, model) as store:
        index_documents(store, model, documents)
    return target


def test_a_store_made_before_aliases_works_and_is_migrated_by_its_first_swap(tmp_path, swap_models):
    from qdrant_client import QdrantClient

    from densefit.retrieval.index.reembed import reembed_store

    old, new = swap_models["old"], swap_models["wide"]
    target = _legacy_store(tmp_path / "q", old, swap_corpus())
    with open_store(target, old) as store:
        assert store.info()["serving_collection"] == "densefit"  # the plain collection
        assert store.count() == 40 and store.model_generation == 0
        bm25 = _bm25_ranking(store)
        report = reembed_store(store, new, commit_every=16)
        assert report.switched and report.embedded == 40
        assert store.info()["serving_collection"] == "densefit_g1"
        assert _bm25_ranking(store) == bm25
        _assert_equals_fresh(store, new, swap_corpus(), tmp_path / "fresh")
    assert _collections(tmp_path / "q") == ["densefit_g1"]
    client = QdrantClient(path=str(tmp_path / "q"))
    assert [(a.alias_name, a.collection_name) for a in client.get_aliases().aliases] == [
        ("densefit", "densefit_g1")
    ]
    client.close()
    with pytest.raises(StoreError, match="holds a generation of the store 'densefit'") as c:
        open_store(f"{target}?collection=densefit_g1")
    _one_line(c)


def _killed_in(target: str, model, method: str, n: int, when: str, create: bool = False):
    """Run ``reembed_store`` of the store at ``target`` to ``model`` (``create``: create the
    store for ``model`` instead) in a forked child that SIGKILLs itself ``when`` ("before"
    or "after") qdrant-client's ``method`` is called the ``n``-th time."""
    from qdrant_client import QdrantClient

    from densefit.retrieval.index.reembed import reembed_store

    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            import signal

            import torch

            torch.set_num_threads(1)
            original, calls = getattr(QdrantClient, method), [0]

            def dying(self, *args, **kwargs):
                calls[0] += 1
                if calls[0] == n and when == "before":
                    os.kill(os.getpid(), signal.SIGKILL)
                result = original(self, *args, **kwargs)
                if calls[0] == n and when == "after":
                    os.kill(os.getpid(), signal.SIGKILL)
                return result

            setattr(QdrantClient, method, dying)
            store = open_store(target, model) if create else open_store(target)
            reembed_store(store, model, commit_every=7)
        except BaseException:  # noqa: BLE001 - report and leave without running pytest code
            import traceback

            traceback.print_exc()
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), f"the child was not killed (status {status})"


@pytest.mark.parametrize(
    ("method", "n", "when", "legacy", "switched"),
    [
        ("update_collection_aliases", 1, "before", False, False),  # promoted, alias not moved
        ("delete_collection", 1, "before", False, True),  # alias moved, old not dropped
        ("update_collection_aliases", 1, "before", True, True),  # plain deleted, no alias yet
    ],
    ids=["before-the-alias", "before-the-drop", "legacy-before-the-alias"],
)
def test_a_swap_killed_anywhere_serves_one_model_and_resumes(
    tmp_path, swap_models, method, n, when, legacy, switched
):
    from densefit.retrieval.index import index_documents
    from densefit.retrieval.index.reembed import reembed_store

    old, new = swap_models["old"], swap_models["wide"]
    if legacy:
        target = _legacy_store(tmp_path / "q", old, swap_corpus())
    else:
        target = f"qdrant:{tmp_path}/q"
        with open_store(target, old) as store:
            index_documents(store, old, swap_corpus())
    with open_store(target) as store:
        before = _ranking(store, old)
    _killed_in(target, new, method, n, when)
    with open_store(target) as store:  # a new client: what the killed process left on disk
        if switched:
            store.check_model(new)
            assert store.swap_target() is None
            assert _collections(tmp_path / "q") == ["densefit_g1"]  # the old one dropped
        else:  # the old generation serves, unchanged, and the swap is under way
            store.check_model(old)
            assert _ranking(store, old) == before
            assert store.swap_target().record.dim == 48
        report = reembed_store(store, new, commit_every=5)
        assert report.switched and report.resumed is not switched
        assert report.embedded == (40 if switched else 40 - (21 if method == "upsert" else 40))
        _assert_equals_fresh(store, new, swap_corpus(), tmp_path / "fresh")


def test_a_store_killed_before_its_alias_is_found(tmp_path, swap_models):
    target = f"qdrant:{tmp_path}/q"
    _killed_in(target, swap_models["old"], "update_collection_aliases", 1, "before", create=True)
    assert _collections(tmp_path / "q") == ["densefit_g0"]  # created, no alias yet
    with open_store(target) as store:  # the alias made on opening
        assert store.count() == 0 and store.info()["serving_collection"] == "densefit_g0"
        store.check_model(swap_models["old"])


def test_densefit_reembed_swaps_a_qdrant_store(tmp_path, swap_models, swap_target):
    from typer.testing import CliRunner

    from densefit.cli.app import app

    runner = CliRunner()
    new_path = str(swap_models["folder"] / "new")
    result = runner.invoke(app, ["reembed", "--store", swap_target, "-m", new_path, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["switched"] and report["embedded"] == 40 and report["documents"] == 40
    with open_store(swap_target) as store:
        assert store.info()["serving_collection"] == "densefit_g1"
        _assert_equals_fresh(store, swap_models["new"], swap_corpus(), tmp_path / "fresh")
    cancelled = runner.invoke(app, ["reembed", "--store", swap_target, "--cancel"])
    assert cancelled.exit_code == 0 and "no model swap under way" in cancelled.output


# -- the conformance suite ---------------------------------------------------------------------


class TestQdrant(StoreConformance):
    """The behaviour every engine shows, in local mode (tests the suite skips by capability:
    compaction, crashes)."""

    bm25_exact = False  # lengths normalised by the first write's average

    @pytest.fixture
    def target(self, tmp_path):
        return f"qdrant:{tmp_path}/q"
