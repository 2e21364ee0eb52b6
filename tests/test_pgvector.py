"""The PostgreSQL engine against a real server (pgserver, started for the session and stopped
after: the ``postgres_uri`` fixture): filters equal to the embedded store's on the shared
filter table and on random filters, BM25 equal to a fresh Bm25Index, hybrid equal to the
fusion of both rankings, exact search equal to the embedded store's, HNSW recall, the model
record, two store objects sharing a table, locks, crashes, errors, model swaps (equal to a
fresh index of the new model through writes, deletes, replicas, cancels, SIGKILLs, a
server's admin swap and ``densefit reembed``), loads that build the HNSW index once, and
the conformance suite.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import traceback
import uuid
from contextlib import contextmanager

import numpy as np
import pytest

pytest.importorskip("psycopg", reason="psycopg is not installed (densefit[postgres])")
pytest.importorskip("pgvector", reason="pgvector is not installed (densefit[postgres])")

import psycopg  # noqa: E402
import test_filters  # noqa: E402 - a sibling test module: the shared filter table
import torch  # noqa: E402
from test_filters import METAS, _random_filter, _random_value  # noqa: E402

from densefit.data.types import Document  # noqa: E402
from densefit.models import load_model  # noqa: E402
from densefit.retrieval.bm25 import Bm25Index, Tokens  # noqa: E402
from densefit.retrieval.encode import encode_texts  # noqa: E402
from densefit.retrieval.fusion import Fusion  # noqa: E402
from densefit.retrieval.index import pgvector as engine  # noqa: E402
from densefit.retrieval.index.common import normalise_rows  # noqa: E402
from densefit.retrieval.index.engines import open_store  # noqa: E402
from densefit.retrieval.index.indexing import index_documents  # noqa: E402
from densefit.retrieval.index.locking import StoreLockedError  # noqa: E402
from densefit.retrieval.index.reembed import reembed_store  # noqa: E402
from densefit.retrieval.index.settings import record_for  # noqa: E402
from densefit.retrieval.index.types import (  # noqa: E402
    CapabilityError,
    ModelMismatchError,
    StoreError,
    StoreRecord,  # noqa: E402
)
from densefit.testing import SWAP_QUERIES, save_swap_models, swap_corpus, tiny_model  # noqa: E402
from densefit.testing.conformance import (  # noqa: E402
    StoreConformance,
    SwapConformance,
    make_corpus,
    reference_match,
    with_meta,
)
from densefit.testing.postgres import postgres_target  # noqa: E402


def _new_target(uri: str) -> str:
    return postgres_target(uri, f"t_{uuid.uuid4().hex[:16]}")


@pytest.fixture
def target(postgres_uri) -> str:
    """A table of its own for each test."""
    return _new_target(postgres_uri)


@pytest.fixture(params=["pgvector 0.8", "pgvector 0.6"])
def server(request) -> str:
    """The URI of each server a test runs on: the current pgvector, and 0.6.2 (no halfvec, no
    Hamming index: the paths that stand in for them)."""
    fixture = "old_postgres_uri" if request.param == "pgvector 0.6" else "postgres_uri"
    return request.getfixturevalue(fixture)


def _record(dim: int, kind: str = "float32") -> StoreRecord:
    """What a store of random ``dim``-d vectors records (no model made them)."""
    return StoreRecord("random", dim, "cosine", kind, np.zeros((3, dim), np.float32), None)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _pairs(results) -> list[list[tuple[str, float]]]:
    return [[(h.id, h.score) for h in hits] for hits in results]


def _same_ranking(got, expected, *, atol: float = 1e-5, rtol: float = 0.0) -> None:
    """Same scores in order (within tolerance) and the same ids wherever a score is not tied
    with another of the expected list."""
    assert len(got) == len(expected)
    for query_got, query_expected in zip(got, expected, strict=True):
        assert len(query_got) == len(query_expected), (query_got, query_expected)
        scores = np.array([s for _, s in query_expected])
        for (id_got, s_got), (id_expected, s_expected) in zip(
            query_got, query_expected, strict=True
        ):
            tolerance = atol + rtol * abs(s_expected)
            assert abs(s_got - s_expected) <= tolerance, (query_got, query_expected)
            tied = np.sum(np.abs(scores - s_expected) <= tolerance) > 1
            assert id_got == id_expected or tied, (query_got, query_expected)


# -- filters: the embedded store's semantics ---------------------------------------------------


def _filter_cases() -> list:
    """``(filters, expected rows of METAS)``: test_filters.py's table of filter semantics."""
    for mark in test_filters.test_filter_semantics.pytestmark:
        if mark.name == "parametrize":
            return list(mark.args[1])
    raise AssertionError("test_filters.test_filter_semantics lost its parametrize table")


@pytest.fixture(scope="module")
def metas_store(postgres_uri):
    """METAS (test_filters.py) as documents d0..d5 of a PostgreSQL store."""
    store = open_store(_new_target(postgres_uri), record=_record(4))
    docs = [Document(f"d{i}", f"text {i}", meta=m) for i, m in enumerate(METAS)]
    store.write(docs, np.eye(len(docs), 4, dtype=np.float32) + 0.1)
    yield store
    store.close()


@pytest.mark.parametrize(("filters", "expected"), _filter_cases())
def test_filters_have_the_embedded_stores_semantics(metas_store, filters, expected):
    assert [d.id for d in metas_store.filter_documents(filters)] == [f"d{i}" for i in expected]
    assert metas_store.count_matching(filters) == len(expected)


def test_random_filters_match_what_the_embedded_store_matches(target):
    rng = random.Random(0)
    metas = []
    for _ in range(40):
        meta = {key: _random_value(rng) for key in ("a", "b") if rng.random() < 0.8}
        if rng.random() < 0.5:
            meta["c"] = {"d": _random_value(rng)}
        metas.append(meta)
    ids = [rng.choice(["en", "1", f"doc{i}"]) + f"-{i}" for i in range(len(metas))]
    docs = [Document(ids[i], f"text {i}", meta=m) for i, m in enumerate(metas)]
    vectors = np.random.default_rng(0).standard_normal((len(docs), 4)).astype(np.float32)
    embedded = open_store(None, record=_record(4))
    postgres = open_store(target, record=_record(4))
    try:
        for store in (embedded, postgres):
            store.write(docs, vectors)
        for _ in range(1500):
            filters = _random_filter(rng)
            expected = [d.id for d in embedded.filter_documents(filters)]
            assert [d.id for d in postgres.filter_documents(filters)] == expected, filters
    finally:
        embedded.close()
        postgres.close()


@pytest.mark.parametrize(
    "value", ["x' OR '1'='1", "en') OR 1=1 --", "'; DROP TABLE documents; --", '"]; SELECT 1; --']
)
def test_filter_values_are_bound_never_sql_text(target, value):
    clause, params = engine.where_clause({"field": "meta.lang", "operator": "==", "value": value})
    assert value not in clause.as_string() and params == [value]
    with open_store(target, record=_record(4)) as store:
        docs = [Document("a", "x", meta={"lang": value}), Document("b", "y", meta={"lang": "en"})]
        store.write(docs, np.eye(2, 4, dtype=np.float32))
        for operator, found in (("==", ["a"]), ("!=", ["b"]), ("in", ["a"])):
            filters = {"field": "meta.lang", "operator": operator, "value": value}
            if operator == "in":
                filters["value"] = [value]
            assert [d.id for d in store.filter_documents(filters)] == found
        assert store.count() == 2


def test_index_meta_field_makes_filters_use_an_index(target, postgres_uri):
    with open_store(target, record=_record(4)) as store:
        docs = [Document(f"d{i}", "x", meta={"bucket": i % 7, "lang": "en"}) for i in range(300)]
        store.write(docs, np.random.default_rng(0).standard_normal((300, 4)).astype(np.float32))
        store.index_meta_field("meta.bucket")
        store.index_meta_field("meta.bucket")  # idempotent
        with pytest.raises(ValueError, match="meta.NAME"):
            store.index_meta_field("bucket")
        filters = {"field": "meta.bucket", "operator": "==", "value": 3}
        assert store.count_matching(filters) == 43
        clause, params = engine.where_clause(filters)
        table = engine.parse_target(target).table
        with psycopg.connect(postgres_uri, autocommit=True) as conn, conn.transaction():
            conn.execute("SET LOCAL enable_seqscan = off")
            query = psycopg.sql.SQL("EXPLAIN SELECT id FROM {} WHERE {}")
            plan = conn.execute(query.format(psycopg.sql.Identifier(table), clause), params)
            plan = " ".join(row[0] for row in plan)
        assert f"{table}_f" in plan, plan


# -- BM25 and hybrid -----------------------------------------------------------------------------


def _fresh_bm25(store, queries, k, filters=None):
    """BM25 of an index built now, from scratch, over the stored documents (write order)."""
    docs = store.filter_documents()
    index = Bm25Index(Tokens.of([d.text for d in docs]))
    mask = None if filters is None else np.array([reference_match(filters, d) for d in docs])
    return [
        [(docs[p].id, float(s)) for p, s in zip(*found, strict=True)]
        for found in index.search(list(queries), k, mask)
    ]


def _bm25(store, queries, k, **options):
    return _pairs(store.search(None, k, mode="bm25", query_texts=list(queries), **options))


BM25_QUERIES = (
    "cells genes",
    "cells cells genes genes genes",  # repeated tokens count as often as they come
    "python function return",
    "the of and",  # stop words only: nothing
    "zebra unknownword",  # tokens no document holds: nothing
    "banana apple memory vaccine dose",
)


def test_bm25_equals_a_fresh_bm25s_index_through_writes_updates_and_deletes(target, model):
    docs = with_meta(make_corpus(80))
    docs.append(Document("empty", "", meta={"lang": "en"}))  # no tokens: counts in N and avgdl
    with open_store(target, model) as store:
        store.write(docs, encode_texts(model, [d.text for d in docs]))
        got = _bm25(store, BM25_QUERIES, 20)
        _same_ranking(got, _fresh_bm25(store, BM25_QUERIES, 20), atol=0, rtol=1e-5)
        assert got[0] and got[3] == [] and got[4] == []
        changed = Document(docs[4].id, "vaccine dose trial mice", meta={"lang": "de"})
        extra = with_meta(make_corpus(7, seed=3, prefix="extra"))
        store.write(
            [changed, *extra], encode_texts(model, [changed.text, *(d.text for d in extra)])
        )
        store.delete([docs[0].id, docs[9].id, "never-there"])
        queries = [*BM25_QUERIES, "vaccine dose trial mice", extra[2].text]
        got = _bm25(store, queries, 100)
        _same_ranking(got, _fresh_bm25(store, queries, 100), atol=0, rtol=1e-5)
        found = {d for hits in got for d, _ in hits}
        assert docs[0].id not in found and changed.id == got[-2][0][0]
        for filters in (
            {"field": "meta.lang", "operator": "==", "value": "de"},
            {"field": "meta.year", "operator": ">=", "value": 2004},
            {"field": "meta.rare", "operator": "==", "value": True},
        ):
            got = _bm25(store, queries, 9, filters=filters)
            _same_ranking(got, _fresh_bm25(store, queries, 9, filters), atol=0, rtol=1e-5)


@pytest.mark.parametrize("method", ["rrf", "weighted"])
def test_hybrid_is_the_fusion_of_the_dense_and_bm25_rankings(target, model, method):
    docs = make_corpus(50)
    fusion = Fusion(method=method, depth=15, alpha=0.3)
    texts = ["cells genes", "python function return", "banana memory", "the of"]
    with open_store(target, model, backend="exact") as store:
        store.write(docs, encode_texts(model, [d.text for d in docs]))
        store.write(docs[:5], encode_texts(model, [d.text for d in docs[:5]]))  # moved last
        embeddings = encode_texts(model, texts)
        position = {d.id: i for i, d in enumerate(store.filter_documents())}
        ids = {i: d for d, i in position.items()}
        dense = _pairs(store.search(embeddings, 15))
        lexical = _bm25(store, texts, 15)
        got = _pairs(store.search(embeddings, 6, mode="hybrid", query_texts=texts, fusion=fusion))
        for q in range(len(texts)):
            keys = [np.array([position[d] for d, _ in side]) for side in (dense[q], lexical[q])]
            scores = [np.array([s for _, s in side]) for side in (dense[q], lexical[q])]
            rows, fused = fusion.fuse(keys, 6, scores)
            assert [d for d, _ in got[q]] == [ids[int(r)] for r in rows]
            np.testing.assert_allclose([s for _, s in got[q]], fused, rtol=1e-6)


# -- vector search ---------------------------------------------------------------------------


def _random_docs(n: int, dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    docs = [
        Document(f"d{i:05d}", f"doc {i}", meta={"bucket": i % 7, "rare": i % 50 == 0})
        for i in range(n)
    ]
    return docs, rng.standard_normal((n, dim)).astype(np.float32)


def test_exact_search_equals_the_embedded_stores(target):
    docs, vectors = _random_docs(500, 16)
    queries = np.random.default_rng(1).standard_normal((6, 16)).astype(np.float32)
    embedded = open_store(None, record=_record(16))
    postgres = open_store(target, record=_record(16), backend="exact")
    try:
        for store in (embedded, postgres):
            store.write(docs, vectors)
            store.write(docs[:20], vectors[20:40])  # updated: new vectors, written last
            store.delete([docs[30].id, docs[31].id])
        for filters in (
            None,
            {"field": "meta.bucket", "operator": "==", "value": 3},
            {"field": "meta.rare", "operator": "==", "value": True},  # 10 of 500
            {"field": "meta.bucket", "operator": "in", "value": [1, 2, 99]},
        ):
            for k in (1, 10, 600):
                expected = _pairs(embedded.search(queries, k, filters=filters))
                _same_ranking(_pairs(postgres.search(queries, k, filters=filters)), expected)
        kept = [d.id for d in docs[:30] + docs[32:40]]
        np.testing.assert_allclose(postgres.vectors(kept), embedded.vectors(kept), atol=1e-6)
        with pytest.raises(KeyError, match="d00030"):
            postgres.vectors([docs[30].id])
    finally:
        embedded.close()
        postgres.close()


def _index_scans(uri: str, index: str) -> int:
    with psycopg.connect(uri, autocommit=True) as conn:
        query = "SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelname = %s"
        return int(conn.execute(query, (index,)).fetchone()[0])


def test_hnsw_recall_at_10_against_exact_and_the_index_is_what_searches(target, postgres_uri):
    docs, vectors = _random_docs(400, 32)
    queries = np.random.default_rng(2).standard_normal((30, 32)).astype(np.float32)
    hnsw_index = f"{engine.parse_target(target).table}_v0_hnsw"  # generation 0's vectors
    with open_store(target, record=_record(32)) as store:  # hnsw: the default
        assert store.backend_name == "hnsw"
        store.write(docs, vectors)
        before = _index_scans(postgres_uri, hnsw_index)
        approximate = store.search(queries, 10)
        store._conn.execute("SELECT pg_stat_force_next_flush()")
        filters = {"field": "meta.bucket", "operator": "==", "value": 5}
        filtered = store.search(queries, 10, filters=filters)
    with open_store(target, backend="exact") as exact_store:
        exact = exact_store.search(queries, 10)
        filtered_exact = exact_store.search(queries, 10, filters=filters)
    scanned = 0
    for _ in range(50):  # statistics reach other sessions within a second
        scanned = _index_scans(postgres_uri, hnsw_index) - before
        if scanned >= len(queries):
            break
        time.sleep(0.05)
    assert scanned == len(queries)  # each unfiltered query walked the index; nothing else did
    recall = np.mean(
        [len({h.id for h in a} & {h.id for h in e}) / 10 for a, e in zip(approximate, exact)]
    )
    assert recall >= 0.9, recall
    # a filtered search scans the matches exactly, whatever the backend
    _same_ranking(_pairs(filtered), _pairs(filtered_exact))


@pytest.mark.parametrize("backend", ["exact", "hnsw"])
def test_binary_stores_rank_the_hamming_candidates_by_their_float32_vectors(server, backend):
    """``rescore x k`` candidates by the Hamming distance of the sign bits (ties in write
    order; HNSW on pgvector >= 0.7, ``bit_count`` over a scan before), ranked by their exact
    float32 scores."""
    docs, vectors = _random_docs(300, 32)
    queries = np.random.default_rng(3).standard_normal((8, 32)).astype(np.float32)
    record = _record(32, "binary")
    with open_store(_new_target(server), record=record, backend=backend, rescore=2) as store:
        store.write(docs, vectors)
        got = _pairs(store.search(queries, 10))
        assert store.vectors([docs[7].id])[0] == pytest.approx(_unit(vectors)[7], abs=1e-6)
        version = store.pgvector_version
    unit, positions = _unit(vectors), np.arange(len(docs))
    expected = []
    for query in _unit(queries):
        hamming = ((unit > 0) != (query > 0)).sum(axis=1)
        candidates = np.lexsort((positions, hamming))[:22]  # rescore x (k + 1): asked k + 1
        scores = unit[candidates] @ query
        best = np.lexsort((candidates, -scores))[:10]
        expected.append([(docs[candidates[i]].id, float(scores[i])) for i in best])
    if backend == "exact" or version < (0, 7):  # 0.6.2 has no Hamming index: a scan
        _same_ranking(got, expected)
    else:
        overlap = [len({d for d, _ in g} & {d for d, _ in e}) for g, e in zip(got, expected)]
        assert np.mean(overlap) >= 8, overlap  # 32-bit codes tie often at the cut


# -- the model, replicas, counts -----------------------------------------------------------


def test_another_model_is_refused(target, model, tiny_models, tmp_path):
    docs = make_corpus(10)
    with open_store(target, model) as store:
        store.write(docs, encode_texts(model, [d.text for d in docs]))
    other = load_model(str(tiny_models / "tiny-other"))
    with pytest.raises(ModelMismatchError, match="does not reproduce") as error:
        open_store(target, other)
    assert "\n" not in str(error.value) and engine.parse_target(target).location in str(error.value)
    wider = tiny_model(tmp_path / "wide", hidden_size=48, num_heads=2)
    with pytest.raises(ModelMismatchError, match="32-d.*48-d"):
        open_store(target, wider)
    with open_store(target, model) as store:  # the right model is accepted
        assert store.count() == len(docs)


def test_two_store_objects_see_each_others_writes(target, model):
    docs = make_corpus(30)
    with open_store(target, model) as first, open_store(target, model) as second:
        first.write(docs, encode_texts(model, [d.text for d in docs]))
        assert second.count() == len(docs)
        extra = make_corpus(2, seed=9, prefix="extra")
        second.write(extra, encode_texts(model, [d.text for d in extra]))
        first.delete([docs[0].id])
        for store in (first, second):
            assert store.count() == len(docs) + 1
            hit = store.search(encode_texts(model, [extra[0].text]), 1)[0][0]
            assert hit.id == extra[0].id
            assert _bm25(store, [extra[1].text], 1)[0][0][0] == extra[1].id
            assert store.get([docs[0].id]) == [None]
        second.start_reembedding(model)  # recorded settings and stale marks are shared
        assert first.stale_ids([docs[1].id, extra[0].id]) == {docs[1].id, extra[0].id}
        first.write(extra[:1], encode_texts(model, [extra[0].text]))
        assert second.stale_ids([extra[0].id]) == set()


def test_write_counts_added_and_updated_and_delete_counts_what_existed(target, model):
    docs = make_corpus(12)
    with open_store(target, model) as store:
        vectors = encode_texts(model, [d.text for d in docs])
        result = store.write(docs[:8], vectors[:8])
        assert (result.added, result.updated) == (8, 0)
        result = store.write(docs[4:], vectors[4:])
        assert (result.added, result.updated) == (4, 4)
        assert [d.id for d in store.filter_documents()][-8:] == [d.id for d in docs[4:]]
        assert store.delete([docs[0].id, docs[0].id, "never-there", docs[5].id]) == 2
        assert store.count() == 10 == len(list(store.ids()))
        assert list(store.ids()) == sorted(store.ids())
        renamed = Document(docs[2].id, "ignored text", title="renamed", meta={"lang": "de"})
        assert store.write_metadata([renamed, Document("never-there", "x")]) == 1
        got = store.get([docs[2].id])[0]
        assert (got.text, got.title, got.meta) == (docs[2].text, "renamed", {"lang": "de"})
        de = {"field": "meta.lang", "operator": "==", "value": "de"}
        assert [d.id for d in store.filter_documents(de)] == [docs[2].id]
        content = {"field": "content", "operator": "==", "value": docs[2].text}
        assert store.count_matching(content) == 1  # the text's filter field stays
        with pytest.raises(ValueError, match="NaN"):
            bad = Document("nan", "x", meta={"score": float("nan")})
            store.write([bad], encode_texts(model, ["x"]))
        with pytest.raises(ValueError, match="NUL"):
            store.write([Document("nul", "a\x00b")], encode_texts(model, ["x"]))
        assert store.count() == 10


# -- errors and capabilities -------------------------------------------------------------------


def _server_part(postgres_uri: str) -> tuple[str, str]:
    """``(user@host part, ?query)`` of the session server's URI."""
    netloc = postgres_uri.split("://", 1)[1].split("/", 1)[0]
    query = postgres_uri.split("?", 1)[1] if "?" in postgres_uri else ""
    return netloc.split("@", 1)[-1], query


def test_connection_errors_are_one_line_naming_the_target_and_the_fix(postgres_uri, tmp_path):
    host, query = _server_part(postgres_uri)
    cases = [
        (f"postgresql://me:secret@/postgres/docs?host={tmp_path}/no-server", "start the server"),
        (f"postgresql://postgres:secret@{host}/no_such_db/docs?{query}", "createdb no_such_db"),
        (f"postgresql://nobody:secret@{host}/postgres/docs?{query}", "existing user"),
    ]
    for target, fix in cases:
        with pytest.raises(StoreError) as error:
            open_store(target, record=_record(4))
        message = str(error.value)
        assert "\n" not in message and "secret" not in message, message
        assert message.startswith(engine.parse_target(target).location) and fix in message


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("Docs", "table name 'Docs' is not allowed"),
        ("a-b", "table name 'a-b' is not allowed"),
        ("x" * 42, "is not allowed"),
        ("docs/more", "more than a database and a table"),
    ],
)
def test_bad_table_names_are_one_line_errors(postgres_uri, table, message):
    with pytest.raises(StoreError, match=message) as error:
        open_store(postgres_target(postgres_uri, table), record=_record(4))
    assert "\n" not in str(error.value)


def test_a_table_that_is_not_a_store_is_left_alone(target, postgres_uri):
    table = engine.parse_target(target).table
    with psycopg.connect(postgres_uri, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("CREATE TABLE {} (x int)").format(psycopg.sql.Identifier(table))
        )
    with pytest.raises(StoreError, match="exists and is not a densefit store"):
        open_store(target, record=_record(4))


def test_what_the_engine_cannot_do_is_refused_in_one_line(server, model):
    def one_line(call, kind=CapabilityError, match=""):
        with pytest.raises(kind, match=match) as error:
            call()
        assert "\n" not in str(error.value)
        return str(error.value)

    target = _new_target(server)
    message = one_line(lambda: open_store(target, model, vectors="int8"), match="int8")
    assert "the embedded store can" in message
    one_line(lambda: open_store(target, model, backend="faiss"), match="faiss")
    one_line(lambda: open_store(target, model, rescore=4), StoreError, "rescore")
    with open_store(target, model) as store:
        assert store.swap_target() is None and store.cancel_swap() is False
        assert store.compact() == 0 and store.dead_rows() == 0
    half = _new_target(server)
    with psycopg.connect(server) as conn:
        version = engine._pgvector_version(conn)
    if version < (0, 7):
        one_line(lambda: open_store(half, model, vectors="float16"), match="halfvec")
    else:
        with open_store(half, model, vectors="float16") as store:
            docs = make_corpus(20)
            vectors = encode_texts(model, [d.text for d in docs])
            store.write(docs, vectors)
            stored = store.vectors([d.id for d in docs])  # normalised (a cosine store)
            np.testing.assert_allclose(stored, normalise_rows(vectors), atol=2e-3)
            assert store.search(vectors[:1], 1)[0][0].id == docs[0].id


def test_the_writer_lock_waits_names_its_holder_and_gives_up(target, model, capsys):
    with open_store(target, model) as first, open_store(target, model) as second:
        with first.writer_lock(), pytest.raises(StoreLockedError) as error:
            with second.writer_lock(timeout=0.3):
                pass
        message = str(error.value)
        assert "\n" not in message and f"densefit pid {os.getpid()}" in message, message
        assert "after 0.3s" in message and "--lock-timeout" in message
        assert "waiting for it to finish (up to 0.3s)" in capsys.readouterr().err
        with second.writer_lock(timeout=0.3), first.writer_lock(name="swap.lock", timeout=0):
            pass  # free again; another name is another lock


def test_concurrent_creators_make_one_store(target, model):
    stores, errors = [], []

    def create():
        try:
            stores.append(open_store(target, model))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(stores) == 4
    docs = make_corpus(3)
    stores[0].write(docs, encode_texts(model, [d.text for d in docs]))
    assert all(store.count() == 3 for store in stores)
    for store in stores:
        store.close()


def test_a_creator_gives_up_after_its_lock_timeout_naming_the_holder(server, model, capsys):
    target = _new_target(server)
    with psycopg.connect(server, application_name="another creator") as other:
        with other.transaction():  # holds the database's create lock, as a creator does
            other.execute("SELECT pg_advisory_xact_lock(%s)", (engine._lock_key("create"),))
            with pytest.raises(StoreLockedError) as error:
                open_store(target, model, lock_timeout=0.3)
    message = str(error.value)
    assert "\n" not in message and "(another creator) is still creating a store" in message
    assert "after 0.3s" in message and "--lock-timeout" in message
    assert "waiting for it to finish (up to 0.3s)" in capsys.readouterr().err
    with open_store(target, model, lock_timeout=0.3) as store:  # free again: made now
        assert store.count() == 0


# -- crashes: a writer killed mid-transaction --------------------------------------------------


@contextmanager
def _forked(run):
    """Run ``run()`` in a forked child (its own connections), which must die by SIGKILL."""
    pid = os.fork()
    if pid == 0:
        try:
            torch.set_num_threads(1)
            run()
        except BaseException:  # noqa: BLE001 - report and leave without running pytest code
            traceback.print_exc()
        os._exit(1)
    try:
        yield pid
    finally:
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def _consistent(target, model) -> int:
    """The stored documents' vectors are their texts' embeddings, BM25 equals a fresh
    index, and the counts agree; returns how many documents there are."""
    with open_store(target, model) as store:
        docs = store.filter_documents()
        ids = [d.id for d in docs]
        assert store.count() == len(docs) == len(set(ids))
        np.testing.assert_allclose(
            store.vectors(ids),
            encode_texts(model, [d.text for d in docs], normalize=True),
            atol=1e-5,
        )
        queries = ["cells genes", docs[-1].text]
        _same_ranking(_bm25(store, queries, 50), _fresh_bm25(store, queries, 50), atol=0, rtol=1e-5)
        return len(docs)


def test_a_writer_killed_mid_transaction_leaves_the_last_commit_and_indexing_resumes(target, model):
    if not hasattr(os, "fork"):
        pytest.skip("the crash test needs os.fork")
    n = 96
    with open_store(target, model) as store:
        index_documents(store, model, make_corpus(16), batch_size=8, commit_every=16)

    def index_and_die_in_the_third_write():
        original, calls = engine.PostgresStore._writing, [0]

        @contextmanager
        def writing_then_die(self):
            with original(self) as cursor:
                yield cursor
                calls[0] += 1
                if calls[0] == 3:  # the third write's rows are sent, not committed
                    os.kill(os.getpid(), signal.SIGKILL)

        engine.PostgresStore._writing = writing_then_die
        with open_store(target, model) as store:
            index_documents(store, model, make_corpus(n), batch_size=8, commit_every=16)

    with _forked(index_and_die_in_the_third_write):
        pass
    # 16 unchanged documents skipped, two commits of 16, the third never committed
    assert _consistent(target, model) == 48
    with open_store(target, model) as store:  # the killed writer's locks went with it
        report = index_documents(store, model, make_corpus(n), batch_size=8, commit_every=16)
    assert (report.unchanged, report.added) == (48, n - 48)
    assert _consistent(target, model) == n


# -- a model swap (densefit reembed): the next generation's vector table ------------------------


@pytest.fixture(scope="module")
def swap_models(tmp_path_factory) -> dict[str, str]:
    """Saved tiny models: ``old``, ``new`` (another seed, same size) and ``wide`` (48-d)."""
    made = save_swap_models(tmp_path_factory.mktemp("swap-models"))
    return {name: str(path) for name, path in made.items()}


@pytest.fixture
def swap_store(target, swap_models) -> str:
    """A PostgreSQL store of 40 documents indexed by the ``old`` model; its target."""
    old = load_model(swap_models["old"])
    with open_store(target, old) as store:
        index_documents(store, old, swap_corpus(40))
    return target


def _embed(model, documents: list[Document]) -> np.ndarray:
    return encode_texts(model, [d.text for d in documents], prompt_name="document")


def _swap_ranking(store, model, **options) -> list[list[tuple[str, float]]]:
    queries = encode_texts(model, SWAP_QUERIES, prompt_name="query")
    return _pairs(store.search(queries, 5, **options))


def _fresh(model, documents: list[Document]):
    """An embedded store indexed from scratch by ``model``: what a swap must equal."""
    store = open_store(None, model)
    index_documents(store, model, documents)
    return store


def _equals_fresh(store, model, documents: list[Document]) -> None:
    """The swapped store holds what a fresh index of ``documents`` by ``model`` does: the same
    documents and vectors (up to the rounding of other batches), the same exact ranking."""
    fresh = _fresh(model, documents)
    ids = sorted(d.id for d in documents)
    assert sorted(store.ids()) == ids
    np.testing.assert_allclose(store.vectors(ids), fresh.vectors(ids), rtol=0, atol=1e-5)
    assert store.get(ids) == fresh.get(ids)
    _same_ranking(_swap_ranking(store, model), _swap_ranking(fresh, model))
    store.check_model(model)
    assert store.info()["swap"] is None


def _vector_tables(uri: str, target: str) -> list[str]:
    """The store's vector tables, as the catalog lists them."""
    table = engine.parse_target(target).table
    with psycopg.connect(uri, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname FROM pg_class WHERE relkind = 'r' AND relname ~ %s ORDER BY relname",
            (f"^{table}_v[0-9]+$",),
        ).fetchall()
    return [name[len(table) + 1 :] for (name,) in rows]


class TestPostgresSwap(SwapConformance):
    """Every swap behaviour the suite states, on a fresh table of the session's server: its
    generations are vector tables (``TABLE_v<g>``), one left after a switch or a cancel."""

    backend = "exact"

    @pytest.fixture
    def target(self, postgres_uri):
        return _new_target(postgres_uri)

    @pytest.fixture(autouse=True)
    def _uri(self, postgres_uri):
        self.uri = postgres_uri

    def generations(self, target) -> list[str]:
        return _vector_tables(self.uri, target)


def test_a_swap_builds_the_next_tables_hnsw_index_before_the_switch(
    swap_store, swap_models, postgres_uri
):
    """Another store object (a server's) sees the new model and the HNSW index the swap
    built for it, valid; the old table is dropped."""
    new = load_model(swap_models["wide"])
    with open_store(swap_store, backend="exact") as store:
        assert reembed_store(store, new, commit_every=7).switched
    with open_store(swap_store, new) as store:
        assert store.info()["hnsw_deferred"] is False
    index = f"{engine.parse_target(swap_store).table}_v1_hnsw"
    assert _vector_tables(postgres_uri, swap_store) == ["v1"]  # the old one dropped
    with psycopg.connect(postgres_uri, autocommit=True) as conn:
        assert engine._index_valid(conn, index) is True


def test_a_binary_store_swaps_its_vectors_and_codes(target, swap_models):
    old, new = load_model(swap_models["old"]), load_model(swap_models["wide"])
    with open_store(target, old, vectors="binary", rescore=64) as store:  # rescores all 40
        index_documents(store, old, swap_corpus(40))
        assert reembed_store(store, new, commit_every=9).switched
        assert store.vector_kind == "binary" and store.dim == 48
        _equals_fresh(store, new, swap_corpus(40))  # float32 kept beside the codes
        with pytest.raises(StoreError, match="binary store swaps to binary vectors"):
            store.begin_swap(record_for(old, "float32"))


def _kill_after(function, n: int, when=lambda *args, **kwargs: True):
    """``function`` that SIGKILLs its process after its ``n``-th call that ``when`` picks
    (before it returns: inside the caller's transaction when the call is)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        result = function(*args, **kwargs)
        if when(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
        return result

    return wrapped


def test_densefit_reembed_swaps_a_postgresql_store(swap_store, swap_models):
    from typer.testing import CliRunner

    from densefit.cli.app import app

    runner = CliRunner()
    args = ["reembed", "--store", swap_store, "-m", swap_models["new"], "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["switched"] and report["embedded"] == 40 and report["documents"] == 40
    with open_store(swap_store, backend="exact") as store:
        _equals_fresh(store, load_model(swap_models["new"]), swap_corpus(40))
        assert store.info()["model_swaps"] == 1
    cancelled = runner.invoke(app, ["reembed", "--store", swap_store, "--cancel"])
    assert cancelled.exit_code == 0 and "no model swap under way" in cancelled.output


# -- a load: the HNSW index built once, after the rows --------------------------------------


def _index_state(uri: str, target: str, generation: int = 0) -> bool | None:
    """Whether generation ``generation``'s HNSW index is valid (None: there is none)."""
    table = engine.parse_target(target).table
    with psycopg.connect(uri, autocommit=True) as conn:
        return engine._index_valid(conn, f"{table}_v{generation}_hnsw")


def _recall(got, expected) -> float:
    return float(np.mean([len({h.id for h in g} & {h.id for h in e}) / len(e)
                          for g, e in zip(got, expected)]))  # fmt: skip


def test_a_load_builds_the_hnsw_index_once_at_its_end(target, postgres_uri, monkeypatch):
    monkeypatch.setattr(engine, "BULK_MIN", 100)
    docs, vectors = _random_docs(700, 16)
    queries = np.random.default_rng(4).standard_normal((12, 16)).astype(np.float32)
    with (
        open_store(target, record=_record(16)) as store,
        open_store(target, backend="exact") as exact,
    ):
        assert _index_state(postgres_uri, target) is True  # made with the table
        with store.writer_lock():  # densefit index: chunks under the writer lock, then flush
            store.write(docs[:200], vectors[:200])  # a load: 200 documents into none
            assert _index_state(postgres_uri, target) is None
            assert store.info()["hnsw_deferred"] and exact.info()["hnsw_deferred"]
            # meanwhile every search scans exactly, whatever its backend
            _same_ranking(_pairs(store.search(queries, 10)), _pairs(exact.search(queries, 10)))
            store.write(docs[200:600], vectors[200:600])  # the load goes on: no index to keep
            assert _index_state(postgres_uri, target) is None
            store.flush()
        assert _index_state(postgres_uri, target) is True
        assert not store.info()["hnsw_deferred"] and not exact.info()["hnsw_deferred"]
        assert _recall(store.search(queries, 10), exact.search(queries, 10)) >= 0.9
        # a write smaller than the store is kept in the index row by row; one as large is a
        # load, and outside the writer lock it builds the index before it returns
        store.write(docs[600:650], vectors[600:650])
        assert _index_state(postgres_uri, target) is True and not store.info()["hnsw_deferred"]
        store.write(docs[:650], vectors[50:700])
        assert _index_state(postgres_uri, target) is True and not store.info()["hnsw_deferred"]
        assert store.count() == 650
        _same_ranking(_pairs(exact.search(queries, 10)), _pairs(_reference(docs, vectors, queries)))
        assert _recall(store.search(queries, 10), exact.search(queries, 10)) >= 0.9


def _reference(docs, vectors, queries):
    """The embedded store's exact search over the final state of the load test."""
    reference = open_store(None, record=_record(16))
    reference.write(docs[600:650], vectors[600:650])
    reference.write(docs[:650], vectors[50:700])
    return reference.search(queries, 10)


def test_a_load_killed_anywhere_leaves_a_store_that_answers_and_builds_later(
    target, postgres_uri, monkeypatch
):
    """Killed after the index was dropped and a chunk committed: searches scan exactly and
    equal the embedded store's; the next write outside a load builds the index. A build
    that died (an invalid index) is dropped and made again."""
    if not hasattr(os, "fork"):
        pytest.skip("the crash test needs os.fork")
    monkeypatch.setattr(engine, "BULK_MIN", 100)
    docs, vectors = _random_docs(400, 16)
    queries = np.random.default_rng(5).standard_normal((12, 16)).astype(np.float32)
    open_store(target, record=_record(16)).close()

    def load_and_die():
        cls = engine.PostgresStore
        cls._after_write = _kill_after(cls._after_write, 2)  # the second chunk committed
        with open_store(target) as store, store.writer_lock():
            for start in range(0, 400, 150):
                store.write(docs[start : start + 150], vectors[start : start + 150])
            store.flush()

    with _forked(load_and_die):
        pass
    reference = open_store(None, record=_record(16))
    reference.write(docs[:300], vectors[:300])
    with open_store(target) as store:
        assert store.count() == 300 and store.info()["hnsw_deferred"]
        assert _index_state(postgres_uri, target) is None
        _same_ranking(_pairs(store.search(queries, 10)), _pairs(reference.search(queries, 10)))
        store.write(docs[300:310], vectors[300:310])  # not a load: it builds what one left
        assert _index_state(postgres_uri, target) is True and not store.info()["hnsw_deferred"]
        # a build that died leaves an invalid index (CREATE INDEX CONCURRENTLY): searches
        # ignore it, and the next build drops it and starts again
        table = engine.parse_target(target).table
        with psycopg.connect(postgres_uri, autocommit=True) as conn:
            conn.execute(
                "UPDATE pg_index SET indisvalid = FALSE WHERE indexrelid = to_regclass(%s)",
                (f"{table}_v0_hnsw",),
            )
            conn.execute(
                psycopg.sql.SQL("INSERT INTO {} (key, value) VALUES ('hnsw', 'deferred')").format(
                    psycopg.sql.Identifier(f"{table}_record")
                )
            )
        assert _index_state(postgres_uri, target) is False
        reference.write(docs[300:310], vectors[300:310])
        _same_ranking(_pairs(store.search(queries, 10)), _pairs(reference.search(queries, 10)))
        store.flush()
        assert _index_state(postgres_uri, target) is True and not store.info()["hnsw_deferred"]


# -- the conformance suite ---------------------------------------------------------------------


class TestPostgres(StoreConformance):
    """Every behaviour the suite states, on a fresh table of the session's server (HNSW)."""

    @pytest.fixture
    def target(self, postgres_uri):
        return _new_target(postgres_uri)


class TestPostgresExact(StoreConformance):
    """The same with exact search."""

    @pytest.fixture
    def target(self, postgres_uri):
        return _new_target(postgres_uri)

    @pytest.fixture
    def backend(self):
        return "exact"


class TestPostgresFloat16(StoreConformance):
    """float16 vectors (halfvec), where the server's pgvector has them (0.7 and later)."""

    vectors = "float16"
    vector_atol = 2e-3  # float16 keeps about 3 significant digits

    @pytest.fixture
    def target(self, postgres_uri):
        with psycopg.connect(postgres_uri) as conn:
            version = engine._pgvector_version(conn)
        if version < (0, 7):
            pytest.skip(f"the server's pgvector {version} has no halfvec (0.7 added it)")
        return _new_target(postgres_uri)


class TestPostgresBinary(StoreConformance):
    """Binary codes: candidates by Hamming distance, rescored against float32 vectors (the
    suite compares with exact search: 64 candidates per result rescore every document)."""

    vectors, rescore = "binary", 64

    @pytest.fixture
    def target(self, postgres_uri):
        return _new_target(postgres_uri)
