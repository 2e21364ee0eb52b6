"""The Milvus engine on Milvus Lite: targets, filters equal to the embedded store's (the
filter table and random filters), dense search equal to the embedded store's, BM25 and
hybrid over bm25s's tokens, model swaps through the collection alias, drop, every command,
the conformance suite and Haystack's suites. Each Milvus Lite server is stopped when its
last store closes (a test checks no server is left)."""

from __future__ import annotations

import json
import random
import uuid

import numpy as np
import pytest

pytest.importorskip("pymilvus", reason="pymilvus is not installed (densefit[milvus])")
pytest.importorskip("milvus_lite", reason="milvus-lite is not installed (densefit[milvus])")

import test_engines  # noqa: E402 - tests/test_engines.py: every command on an engine
import test_filters  # noqa: E402 - tests/test_filters.py: the filter table and random filters
import test_haystack  # noqa: E402 - tests/test_haystack.py: Haystack's suites

from densefit.data.types import Document  # noqa: E402
from densefit.retrieval.fusion import Fusion  # noqa: E402
from densefit.retrieval.index import milvus  # noqa: E402
from densefit.retrieval.index.engines import open_store  # noqa: E402
from densefit.retrieval.index.types import (  # noqa: E402
    CapabilityError,
    NoStoreError,
    StoreError,
    StoreRecord,
)
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


def _one_line(caught: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.fixture(scope="module", autouse=True)
def no_server_left():
    """Every store the tests opened is closed, and with the last one its Milvus Lite server."""
    yield
    from milvus_lite.server_manager import server_manager_instance

    assert milvus._LOCAL == {} and server_manager_instance._servers == {}


def _pair(tmp_path, record: StoreRecord):
    """An embedded store and a Milvus Lite store for the same record."""
    return open_store(tmp_path / "embedded", record=record), open_store(
        f"milvus:{tmp_path}/m.db", record=record
    )


# -- targets --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("milvus://db:19531/docs", {"url": "http://db:19531", "collection": "docs"}),
        ("milvus://db/docs?https=true", {"url": "https://db:19530", "path": None}),
        ("milvus:runs/m.db", {"path": "runs/m.db", "collection": "densefit", "host": None}),
        ("milvus:/srv/m.db?collection=a_1", {"path": "/srv/m.db", "collection": "a_1"}),
        ("milvus:///srv/m.db", {"path": "/srv/m.db", "collection": "densefit"}),
    ],
)
def test_targets(target, expected):
    parsed = milvus.parse_target(target)
    assert {key: getattr(parsed, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("milvus://db/my-docs", "collection name 'my-docs' is not"),
        ("milvus:m.db?collection=" + "x" * 201, "is not 1 to 200"),
        ("milvus://db:19530", "no collection: write milvus://db:19530/COLLECTION"),
        ("milvus://user:secret@db/docs", "set the token in the environment variable MILVUS"),
        ("milvus://db/docs?tls=1", "unknown option 'tls'"),
        ("milvus://db:99999/docs", "the port is not a number"),
        ("milvus:m.db?name=x", "write milvus:FILE.db"),
        ("milvus:folder", "write milvus:FILE.db"),
    ],
)
def test_bad_targets_are_one_line(target, message):
    with pytest.raises(StoreError, match=message) as caught:
        milvus.parse_target(target)
    assert "secret" not in _one_line(caught)


def test_unreachable_server_is_one_line():
    with pytest.raises(StoreError, match="Milvus at http://127.0.0.1:1 refused or failed") as c:
        open_store("milvus://127.0.0.1:1/docs", record=_record())
    assert "MILVUS_TOKEN" in _one_line(c)


def test_opening_nothing_creates_nothing(tmp_path):
    with pytest.raises(NoStoreError, match="no densefit store at"):
        open_store(f"milvus:{tmp_path}/m.db", create=False)
    assert not (tmp_path / "m.db").exists()


def test_capability_refusals(tmp_path):
    with pytest.raises(CapabilityError, match="cannot store float16 vectors") as caught:
        open_store(f"milvus:{tmp_path}/m.db", record=_record(kind="float16"))
    assert "the embedded store" in _one_line(caught)
    with pytest.raises(CapabilityError, match="cannot search by 'hnsw'"):
        open_store(f"milvus:{tmp_path}/m.db", record=_record(), backend="hnsw")


# -- filters: the embedded store's semantics -----------------------------------------------


@pytest.fixture(scope="module")
def filter_stores(tmp_path_factory):
    """An embedded and a Milvus store holding tests/test_filters.py's METAS documents plus
    some with names and values that need escaping."""
    embedded, store = _pair(tmp_path_factory.mktemp("filters"), _record(4))
    metas = test_filters.METAS + [
        {"release date": "2024-01-02", "a-b": 1, "größe": 3.5, "x": {"y z": True}},
        {"release date": "2023-12-31T23:00:00-02:00", "a-b": "1", "q": 'say "hi"\\\n'},
        {"tags": ["Straße", "日本"], "city": "München", "empty": "", "list": []},
    ]
    docs = [Document(f"d{i}", f"text {i}", meta=m) for i, m in enumerate(metas)]
    for target in (embedded, store):
        target.write(docs, _vectors(len(docs), 4))
    yield embedded, store
    embedded.close()
    store.close()


def _ids(store, filters) -> list[str]:
    return [d.id for d in store.filter_documents(filters)]


def _filter_table() -> list[tuple[dict, list[int]]]:
    mark = next(m for m in test_filters.test_filter_semantics.pytestmark if m.name == "parametrize")
    return mark.args[1]


def test_filter_table_matches_as_the_embedded_store(filter_stores):
    embedded, store = filter_stores
    for filters, expected in _filter_table():
        got = [i for i in _ids(store, filters) if int(i[1:]) < len(test_filters.METAS)]
        assert got == [f"d{i}" for i in expected], filters
        assert _ids(store, filters) == _ids(embedded, filters), filters
        assert store.count_matching(filters) == embedded.count_matching(filters), filters


@pytest.mark.parametrize(
    "filters",
    [
        {"field": "meta.release date", "operator": ">", "value": "2024-01-01T12:00:00"},
        {"field": "meta.a-b", "operator": "in", "value": ["1", True]},
        {"field": "meta.x.y z", "operator": "!=", "value": True},
        {"field": "meta.x", "operator": "==", "value": {"y z": True}},
        {"field": "meta.tags", "operator": "==", "value": ["Straße", "日本"]},
        {"field": "meta.q", "operator": "==", "value": 'say "hi"\\\n'},
        {"field": "meta.q", "operator": "==", "value": '" or true or "'},
        {"field": "meta.list", "operator": "==", "value": None},
        {"field": "id", "operator": "not in", "value": ["d1", "d') or true"]},
        {"operator": "NOT", "conditions": [{"operator": "OR", "conditions": []}]},
    ],
)
def test_escaped_names_and_values_match_as_the_embedded_store(filter_stores, filters):
    embedded, store = filter_stores
    assert _ids(store, filters) == _ids(embedded, filters)


def test_non_ascii_metadata_names_are_found(filter_stores):
    """As Haystack finds them (the embedded store does not: SQLite 3.40 looks keys up
    unescaped)."""
    _, store = filter_stores
    assert _ids(store, {"field": "meta.größe", "operator": ">=", "value": 3}) == ["d6"]


def test_random_filters_match_as_the_embedded_store(tmp_path):
    """tests/test_filters.py's random filters (checked there against Haystack's evaluator)."""
    rng = random.Random(0)
    metas = []
    for _ in range(30):
        meta = {k: test_filters._random_value(rng) for k in ("a", "b") if rng.random() < 0.8}
        if rng.random() < 0.5:
            meta["c"] = {"d": test_filters._random_value(rng)}
        metas.append(meta)
    docs = [
        Document(f"{rng.choice(['en', '1', 'x'])}-{i}", "t", meta=m) for i, m in enumerate(metas)
    ]
    embedded, store = _pair(tmp_path, _record(4))
    try:
        for target in (embedded, store):
            target.write(docs, _vectors(len(docs), 4))
        differing = []
        for _ in range(300):
            filters = test_filters._random_filter(rng)
            if _ids(store, filters) != _ids(embedded, filters):
                differing.append(filters)
        assert not differing, json.dumps(differing[:3])
    finally:
        embedded.close()
        store.close()


def test_metadata_statistics_equal_the_embedded_store(filter_stores):
    embedded, store = filter_stores
    filters = {"field": "meta.lang", "operator": "!=", "value": "de"}
    assert store.meta_fields() == embedded.meta_fields()
    for field in ("meta.n", "meta.lang", "meta.release date"):
        assert sorted(map(repr, store.meta_values(field))) == sorted(
            map(repr, embedded.meta_values(field))
        )
        assert store.meta_range(field, filters) == embedded.meta_range(field, filters)


# -- dense search, BM25, hybrid -------------------------------------------------------------


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_exact_search_equals_the_embedded_store(tmp_path, similarity):
    embedded, store = _pair(tmp_path, _record(16, similarity))
    try:
        docs = with_meta(make_corpus(120))
        vectors = _vectors(len(docs), 16)
        for target in (embedded, store):
            target.write(docs[:80], vectors[:80])
            target.write(docs[80:], vectors[80:])
            target.write(docs[:5], _vectors(5, 16, seed=9))  # updates: last in write order
            target.delete([docs[7].id, docs[90].id])
        queries = _vectors(6, 16, seed=1)
        for filters in (None, {"field": "meta.lang", "operator": "==", "value": "de"}):
            for scale in (False, True):
                options = {"top_k": 10, "filters": filters, "scale_score": scale}
                got = _pairs(store.search(queries, **options))
                _assert_same(got, _pairs(embedded.search(queries, **options)))
        live = [d.id for d in docs[:20] if d.id != docs[7].id]
        np.testing.assert_allclose(store.vectors(live), embedded.vectors(live), atol=1e-6)
        assert _ids(store, None) == _ids(embedded, None)
    finally:
        embedded.close()
        store.close()


BM25_QUERIES = ["cells genes", "python function return", "vaccine dose trial mice", "the of"]


@pytest.mark.parametrize("fusion", [Fusion(), Fusion(method="weighted", alpha=0.3, depth=15)])
def test_bm25_and_hybrid_equal_the_embedded_store(tmp_path, fusion):
    """Unfiltered, in one segment, BM25 scores are bm25s's and hybrid ranks as the embedded
    store's. (Filtered, Milvus Lite takes the IDF and average length from the matching
    documents: the conformance suite checks what such a search finds.)"""
    embedded, store = _pair(tmp_path, _record(16))
    try:
        docs = with_meta(make_corpus(60))
        for target in (embedded, store):
            target.write(docs, _vectors(len(docs), 16))
            target.write(docs[:3], _vectors(3, 16, seed=2))
            target.delete([docs[5].id])
        bm25 = {"mode": "bm25", "query_texts": BM25_QUERIES}
        _assert_same(
            _pairs(store.search(None, 8, **bm25)), _pairs(embedded.search(None, 8, **bm25))
        )
        queries = _vectors(4, 16, seed=4)
        options = {"mode": "hybrid", "query_texts": BM25_QUERIES, "fusion": fusion}
        for scale in (False, True):
            got = _pairs(store.search(queries, 7, scale_score=scale, **options))
            _assert_same(got, _pairs(embedded.search(queries, 7, scale_score=scale, **options)))
    finally:
        embedded.close()
        store.close()


# -- the store: reopening, writes, drop ----------------------------------------------------------


def test_reopen_shares_the_server_and_drop_removes_everything(tmp_path, model):
    target = f"milvus:{tmp_path}/m.db?collection=docs"
    docs = make_corpus(12)
    first = open_store(target, model)
    first.write(docs, _vectors(len(docs), 32))
    second = open_store(target)  # the same file: one client, one server
    assert second.count() == 12 and second.info()["serving_collection"] == "docs_g0"
    first.close()
    assert second.get([docs[2].id]) == [docs[2]]
    second.drop()
    with pytest.raises(NoStoreError):
        open_store(target, create=False)
    with open_store(target, model) as fresh:
        assert fresh.count() == 0
    with pytest.raises(StoreError, match="the store is closed"):
        second.count()


def test_texts_longer_than_a_varchar_are_refused(tmp_path):
    with open_store(f"milvus:{tmp_path}/m.db", record=_record()) as store:
        with pytest.raises(StoreError, match="longer than the 65535 bytes") as caught:
            store.write([Document("long", "é" * 40000)], _vectors(1))
        _one_line(caught)
        assert store.count() == 0


# -- the conformance suite, every command, Haystack's suites -------------------------------------


class TestMilvus(StoreConformance):
    """The behaviour every engine shows, on Milvus Lite (tests the suite skips by
    capability: compaction, crashes)."""

    bm25_exact = False  # Milvus Lite's BM25 statistics are per segment

    @pytest.fixture
    def target(self, tmp_path):
        return f"milvus:{tmp_path}/m.db"


@pytest.fixture
def engine() -> str:
    return "milvus"


@pytest.fixture
def new_target(tmp_path):
    """A new Milvus Lite store's target per call (tests/conftest.py's, for this engine)."""
    return lambda engine="milvus": f"milvus:{tmp_path}/m{uuid.uuid4().hex[:8]}.db"


@pytest.fixture(scope="class")
def lite_file(tmp_path_factory):
    """One Milvus Lite file for a class whose tests need a new store each, its server kept
    up between them by a store held open (a server starts in about a second). Not for the
    swap tests: a child forked while a server runs would inherit gRPC's threads."""
    folder = tmp_path_factory.mktemp("lite")
    keeper = open_store(f"milvus:{folder}/m.db?collection=keeper", record=_record())
    yield f"milvus:{folder}/m.db"
    keeper.close()


@pytest.fixture
def target(new_target) -> str:
    return new_target()


app, data = test_engines.app, test_engines.data  # the fixtures of the commands' tests
test_index_search_eval = test_engines.test_index_search_eval_on_every_engine
test_mine = test_engines.test_mine_from_every_engine
test_move_an_embedded_store_into_milvus = test_engines.test_move_an_embedded_store_into_every_engine
test_serve = test_engines.test_serve_on_every_engine
test_what_milvus_cannot_do_is_one_line = test_engines.test_what_an_engine_cannot_do_is_one_line


def test_densefit_reembed_swaps_a_milvus_store(app, tiny_models, data, target):
    test_engines.index(app, data, tiny_models / "tiny", target)
    new = tiny_models / "tiny-other"
    result = test_engines.invoke(app, ["reembed", "--store", target, "-m", new, "--json"])
    report = json.loads(result.stdout)
    assert report["switched"] and report["embedded"] == report["documents"] == 40
    with open_store(target, create=False) as store:
        assert store.model_generation == 1
        assert store.info()["serving_collection"] == f"{store.collection}_g1"


class TestMilvusSwap(SwapConformance):
    """Model swaps through the collection alias, killed anywhere and resumed (the killed
    child a new interpreter: a child forked from a process that ran Milvus Lite's gRPC
    threads could abort either process)."""

    backend = "exact"
    fork_child = False

    @pytest.fixture
    def target(self, tmp_path):
        return f"milvus:{tmp_path}/m.db"

    def generations(self, target) -> list[str]:
        """The store's collections (the process's server is up while a store is open)."""
        with open_store(target) as store:
            return sorted(c for c in store._client.list_collections() if c.startswith("densefit_g"))


class TestMilvusHaystack(test_haystack.TestHaystackSuite):
    """Haystack's document-store suites on Milvus Lite."""

    @pytest.fixture
    def document_store(self, lite_file):
        store = test_haystack._new_store(f"{lite_file}?collection=t_{uuid.uuid4().hex}", None)
        yield store
        if store.store is not None:
            store.store.drop()


class TestMilvusHaystackAsync(test_haystack.TestHaystackAsyncSuite):
    """Haystack's async document-store suites on Milvus Lite."""

    @pytest.fixture
    def document_store(self, lite_file):
        store = test_haystack._new_store(f"{lite_file}?collection=t_{uuid.uuid4().hex}", None)
        yield store
        if store.store is not None:
            store.store.drop()


@pytest.fixture
def filled(new_target):
    """tests/test_filters.py's store of 30 documents with metadata, on Milvus Lite."""
    store = open_store(new_target(), record=_record(4))
    docs = test_filters._docs()
    store.write(docs, _vectors(len(docs), 4))
    yield store
    store.close()


test_a_filter_is_parsed_once = test_filters.test_a_filter_is_parsed_once_on_every_engine
test_milvus_takes_filters_to_its_limits = (
    test_filters.test_each_engine_takes_filters_to_its_own_limits
)


def test_writer_locks_are_per_name_and_per_thread(tmp_path):
    """Another thread waits for a held writer lock; a model swap's lock (another name) does
    not stop writers; the same thread may take its lock again."""
    import threading

    from densefit.retrieval.index.locking import StoreLockedError
    from densefit.retrieval.index.swap import LOCK_NAME

    with open_store(f"milvus:{tmp_path}/m.db", record=_record()) as store:
        failed = []

        def other(name=None):
            try:
                with store.writer_lock(0.05, name=name):
                    pass
            except StoreLockedError as exc:
                failed.append(str(exc))

        with store.writer_lock(0), store.writer_lock(0):
            for name in (None, LOCK_NAME):
                thread = threading.Thread(target=other, args=(name,))
                thread.start()
                thread.join()
        assert len(failed) == 1 and "another thread is still writing" in failed[0]
