"""Metadata filters: the SQL compiler against Haystack's reference semantics, malformed and
hostile filters, selective filters on a large store, the CLI and the Retriever."""

from __future__ import annotations

import importlib.util
import json
import random
import sqlite3
import time

import numpy as np
import pytest
from conftest import STORE_ENGINES  # noqa: E402

from densefit.data.types import Document
from densefit.retrieval.index import (
    LocalDocumentStore,
    open_store,
    search,
    sqlite_filters,
    validate_filters,
)
from densefit.retrieval.index import filters as filters_module
from densefit.retrieval.index.documents import DB_NAME
from densefit.retrieval.index.exact import ExactBackend, exact_search
from densefit.retrieval.index.filters import (
    INT_RANGE,
    date_seconds,
    json_text,
    parse_filter_text,
    parse_filters,
    typed_fields,
)
from densefit.retrieval.index.searching import scaled_scores
from densefit.retrieval.index.sqlite_filters import (
    MAX_CONDITIONS,
    MAX_DEPTH,
    compile_filters,
    meta_field_sql,
    meta_index_sql,
)
from densefit.retrieval.index.store import CAPABILITIES as EMBEDDED
from densefit.retrieval.index.types import StoreRecord
from densefit.retrieval.index.vectors import search_rows

needs_haystack = pytest.mark.skipif(
    importlib.util.find_spec("haystack") is None, reason="haystack-ai is not installed"
)
needs_faiss = pytest.mark.skipif(
    importlib.util.find_spec("faiss") is None, reason="faiss is not installed (densefit[index])"
)


# -- a document table in memory, to run compiled filters on -------------------------------


def _table(metas: list[dict], ids: list[str] | None = None) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    conn.execute(
        "CREATE TABLE documents (id TEXT PRIMARY KEY, row INTEGER, text TEXT, title TEXT, "
        "meta TEXT)"
    )
    ids = ids or [f"d{i}" for i in range(len(metas))]
    conn.executemany(
        "INSERT INTO documents VALUES (?, ?, ?, ?, ?)",
        [(ids[i], i, f"text {i}", "", json.dumps(m)) for i, m in enumerate(metas)],
    )
    return conn


def _matching(conn: sqlite3.Connection, filters: dict) -> list[int]:
    where, params = compile_filters(filters)
    return [
        r for (r,) in conn.execute(f"SELECT row FROM documents WHERE {where} ORDER BY row", params)
    ]


METAS = [
    {"lang": "en", "n": 2, "date": "1969-07-21T20:17:40", "ok": True, "tags": ["a", "b"]},
    {"lang": "de", "n": -2, "date": "1972-12-11T19:54:58", "ok": False, "nested": {"x": 1}},
    {"lang": "en", "n": 2.0, "date": "1989-11-09T17:53:00+01:00", "page": "100"},
    {"lang": None, "n": 10, "date": "2021-01-01"},
    {"n": "10", "ok": 1},
    {},
]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"field": "meta.lang", "operator": "==", "value": "en"}, [0, 2]),
        ({"field": "meta.lang", "operator": "==", "value": None}, [3, 4, 5]),
        ({"field": "meta.lang", "operator": "!=", "value": None}, [0, 1, 2]),
        ({"field": "meta.lang", "operator": "!=", "value": "en"}, [1, 3, 4, 5]),
        ({"field": "meta.n", "operator": "==", "value": 2}, [0, 2]),  # 2 == 2.0
        ({"field": "meta.n", "operator": "==", "value": 10}, [3]),  # not the string "10"
        ({"field": "meta.n", "operator": "==", "value": "10"}, [4]),
        ({"field": "meta.n", "operator": ">", "value": 0}, [0, 2, 3]),
        ({"field": "meta.n", "operator": "<=", "value": -2}, [1]),
        ({"field": "meta.n", "operator": ">", "value": None}, []),
        ({"field": "meta.ok", "operator": "==", "value": True}, [0, 4]),  # 1 == True
        ({"field": "meta.ok", "operator": "==", "value": False}, [1]),
        ({"field": "meta.date", "operator": ">", "value": "1972-12-11T19:54:58"}, [2, 3]),
        ({"field": "meta.date", "operator": ">=", "value": "1972-12-11T19:54:58"}, [1, 2, 3]),
        # timezones: 17:53+01:00 is 16:53 UTC
        ({"field": "meta.date", "operator": "<", "value": "1989-11-09T17:00:00"}, [0, 1, 2]),
        ({"field": "meta.date", "operator": "<", "value": "1989-11-09T16:00:00Z"}, [0, 1]),
        # "100" is a number in a string, not a date (SQLite's julianday() alone reads it as
        # Julian day 100): no engine orders it among dates
        ({"field": "meta.page", "operator": "<", "value": "2024-01-01"}, []),
        ({"field": "meta.page", "operator": ">", "value": "0001-01-01"}, []),
        ({"field": "meta.n", "operator": "in", "value": [10, -2]}, [1, 3]),
        ({"field": "meta.n", "operator": "in", "value": [2, "10"]}, [0, 2, 4]),
        ({"field": "meta.ok", "operator": "in", "value": [True]}, [0, 4]),
        ({"field": "meta.tags", "operator": "in", "value": [["a", "b"], 3]}, [0]),
        ({"field": "id", "operator": "in", "value": [1, "d2"]}, [2]),
        ({"field": "meta.lang", "operator": "in", "value": ["de", None]}, [1, 3, 4, 5]),
        ({"field": "meta.lang", "operator": "not in", "value": ["en"]}, [1, 3, 4, 5]),
        ({"field": "meta.lang", "operator": "in", "value": []}, []),
        ({"field": "meta.tags", "operator": "==", "value": ["a", "b"]}, [0]),
        ({"field": "meta.nested.x", "operator": "==", "value": 1}, [1]),
        ({"field": "meta.page", "operator": "==", "value": "100"}, [2]),
        ({"field": "id", "operator": "in", "value": ["d1", "d5", "zz"]}, [1, 5]),
        ({"field": "content", "operator": "==", "value": "text 3"}, [3]),
        (
            {
                "operator": "AND",
                "conditions": [
                    {"field": "meta.lang", "operator": "==", "value": "en"},
                    {"field": "meta.n", "operator": ">", "value": 1},
                ],
            },
            [0, 2],
        ),
        (
            {
                "operator": "NOT",
                "conditions": [
                    {"field": "meta.lang", "operator": "==", "value": "en"},
                    {"field": "meta.n", "operator": ">", "value": 1},
                ],
            },
            [1, 3, 4, 5],
        ),
        (
            {
                "operator": "OR",
                "conditions": [
                    {"field": "meta.ok", "operator": "==", "value": False},
                    {
                        "operator": "NOT",
                        "conditions": [{"field": "meta.n", "operator": "!=", "value": 10}],
                    },
                ],
            },
            [1, 3],
        ),
        ({"operator": "OR", "conditions": []}, []),
        ({"operator": "AND", "conditions": []}, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_filter_semantics(filters, expected):
    assert _matching(_table(METAS), filters) == expected


@pytest.mark.parametrize(
    ("filters", "message"),
    [
        ("lang == en", "filters must be a dict"),
        ({"conditions": [{"field": "meta.a", "operator": "==", "value": 1}]}, "neither 'field'"),
        ({"operator": "AND"}, "no 'conditions'"),
        ({"operator": "XOR", "conditions": []}, "unknown logical operator 'XOR'"),
        ({"operator": "AND", "conditions": {"field": "meta.a"}}, "must be a list"),
        ({"operator": "AND", "conditions": [{"operator": "==", "value": 1}]}, "unknown logical"),
        ({"field": "meta.a", "value": 1}, "no 'operator'"),
        ({"field": "meta.a", "operator": "=="}, "no 'value'"),
        ({"field": "meta.a", "operator": "=", "value": 1}, "unknown operator '='"),
        ({"field": "meta.n", "operator": ">", "value": "1"}, "not an ISO 8601 date"),
        ({"field": "meta.n", "operator": ">", "value": [1]}, "compare numbers or ISO dates"),
        ({"field": "meta.n", "operator": "in", "value": 9}, "needs a list"),
        ({"field": "meta.n", "operator": "not in", "value": (9, 10)}, "needs a list"),
        ({"field": "name", "operator": "==", "value": 1}, "unknown filter field 'name'"),
        ({"field": "meta.", "operator": "==", "value": 1}, "unknown filter field"),
        ({"field": 3, "operator": "==", "value": 1}, "field must be a string"),
        ({"field": "meta.a", "operator": "==", "value": object()}, "has type object"),
        ({"field": "meta.a", "operator": "in", "value": [1, float("nan")]}, "finite number"),
    ],
)
def test_malformed_filters_say_what_is_wrong(filters, message):
    with pytest.raises(ValueError, match=message) as caught:
        validate_filters(filters)
    assert "\n" not in str(caught.value)


def test_no_filter():
    validate_filters(None)
    validate_filters({})


@pytest.mark.parametrize(
    "field",
    [
        "meta.a') OR 1=1 --",
        'meta.a"] OR 1',
        "meta.a'; DROP TABLE documents; --",
        "meta.a.b'c",
        "id; DROP TABLE documents",
    ],
)
def test_hostile_field_names_are_refused(field):
    with pytest.raises(ValueError, match="filter field"):
        validate_filters({"field": field, "operator": "==", "value": 1})


@pytest.mark.parametrize(
    "value",
    [
        "x' OR '1'='1",
        "en') OR 1=1 --",
        "'; DROP TABLE documents; --",
        '"]; SELECT 1; --',
    ],
)
def test_hostile_values_are_bound_not_interpolated(value):
    conn = _table(METAS + [{"lang": value}])
    for operator in ("==", "!="):
        where, params = compile_filters(
            {"field": "meta.lang", "operator": operator, "value": value}
        )
        assert value not in where  # a parameter, never SQL text
    assert _matching(conn, {"field": "meta.lang", "operator": "==", "value": value}) == [6]
    assert _matching(conn, {"field": "meta.lang", "operator": "in", "value": [value]}) == [6]
    assert conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0] == 7


# -- the reference: Haystack's own evaluator ------------------------------------------------


def _random_value(rng: random.Random):
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            1,
            2,
            -3,
            2.5,
            "en",
            "de",
            "",
            "1972-12-11T19:54:58",
            "1989-11-09T17:53:00",
            ["a"],
            {"k": 1},
        ]
    )


def _random_comparison(rng: random.Random) -> dict:
    operator = rng.choice(["==", "!=", ">", ">=", "<", "<=", "in", "not in"])
    field = rng.choice(["meta.a", "meta.b", "meta.c.d", "id"])
    if operator in ("in", "not in"):
        value = [_random_value(rng) for _ in range(rng.randint(0, 3))]
        value = [v for v in value if not isinstance(v, (list, dict))]
    elif operator in ("==", "!="):
        value = _random_value(rng)
    else:
        value = rng.choice([None, 0, 1, -3, 2.5, "1972-12-11T19:54:58", "2000-01-01"])
    return {"field": field, "operator": operator, "value": value}


def _random_filter(rng: random.Random, depth: int = 0, deepest: int = 2) -> dict:
    if depth >= deepest or rng.random() < 0.5:
        return _random_comparison(rng)
    return {
        "operator": rng.choice(["AND", "OR", "NOT"]),
        "conditions": [
            _random_filter(rng, depth + 1, deepest)
            for _ in range(rng.randint(0 if depth else 1, 3))
        ],
    }


@needs_haystack
@pytest.mark.parametrize("deepest", [2, 6])
def test_sql_agrees_with_haystacks_evaluator_on_random_filters(deepest):
    """Depth 6 with empty conditions: NOT is pushed down to the comparisons (De Morgan) so
    that a chain of NOTs adds no nesting; the laws must hold with missing fields and None."""
    from haystack import Document as HaystackDocument
    from haystack.errors import FilterError
    from haystack.utils.filters import document_matches_filter

    rng = random.Random(0)
    metas = []
    for _ in range(40):
        meta = {}
        for key in ("a", "b"):
            if rng.random() < 0.8:
                meta[key] = _random_value(rng)
        if rng.random() < 0.5:
            meta["c"] = {"d": _random_value(rng)}
        metas.append(meta)
    ids = [rng.choice(["en", "1", f"doc{i}"]) + f"-{i}" for i in range(len(metas))]
    conn = _table(metas, ids)
    docs = [HaystackDocument(id=ids[i], content=f"text {i}", meta=m) for i, m in enumerate(metas)]
    checked = 0
    for _ in range(1500):
        filters = _random_filter(rng, deepest=deepest)
        if deepest > 2 and rng.random() < 0.3:  # a chain of NOTs around it
            for _ in range(rng.randint(1, 4)):
                filters = {"operator": "NOT", "conditions": [filters]}
        expected = []
        try:
            for i, doc in enumerate(docs):
                if document_matches_filter(filters, doc):
                    expected.append(i)
        except (FilterError, TypeError):
            # Haystack raises where an ordering meets a non-date string (or a date meets a
            # number) in some document; SQL says "no match" there instead.
            continue
        assert _matching(conn, filters) == expected, filters
        checked += 1
    assert checked > 700  # about half the random filters are comparable everywhere


# -- stores: the top k of the matches, at scale ----------------------------------------------


def _record(dim: int) -> StoreRecord:
    """What a store of random ``dim``-d vectors records (no model made them)."""
    return StoreRecord("random", dim, "cosine", "float32", np.zeros((3, dim), np.float32), None)


def _random_store(n: int, dim: int, *, rare_every: int, backend: str = "exact"):
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    store = LocalDocumentStore.create(None, _record(dim), backend=backend)
    docs = [
        Document(f"d{i:06d}", f"doc {i}", meta={"rare": i % rare_every == 0, "bucket": i % 7})
        for i in range(n)
    ]
    for start in range(0, n, 20000):
        store.write(docs[start : start + 20000], vectors[start : start + 20000])
    return store, vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


@pytest.mark.parametrize("backend", ["exact", pytest.param("faiss", marks=needs_faiss)])
def test_filter_matching_a_thousandth_of_100k_documents_returns_k_hits(backend, monkeypatch):
    """The best 10 of the 100 matches, and only those 100 vectors are scored (counted, not
    timed: the work does not grow with the 100k documents that do not match)."""
    import densefit.retrieval.index.vectors as vectors_module

    store, vectors = _random_store(100_000, 32, rare_every=1000, backend=backend)
    scored = []
    exact_search = vectors_module.exact_search

    def counted(block, queries, k, **kwargs):
        scored.append(len(block))
        return exact_search(block, queries, k, **kwargs)

    monkeypatch.setattr(vectors_module, "exact_search", counted)
    try:
        rng = np.random.default_rng(1)
        queries = rng.standard_normal((3, 32)).astype(np.float32)
        filters = {"field": "meta.rare", "operator": "==", "value": True}
        started = time.perf_counter()
        results = store.search(queries, top_k=10, filters=filters)
        elapsed = time.perf_counter() - started
        rare = np.arange(0, 100_000, 1000)
        expected = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ vectors[rare].T
        for q, hits in enumerate(results):
            assert len(hits) == 10 and all(h.meta["rare"] for h in hits)
            best = rare[np.argsort(-expected[q])[:10]]
            assert [h.id for h in hits] == [f"d{i:06d}" for i in best]
        print(f"\n{backend}: 0.1% filter over 100k docs, 3 queries: {elapsed * 1000:.1f} ms")
        assert sum(scored) == 100, scored  # the matches' vectors, not the 100k
    finally:
        store.close()


def test_filter_matching_everything_equals_no_filter():
    store, _ = _random_store(3000, 16, rare_every=10)
    try:
        queries = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
        everything = {"field": "id", "operator": "!=", "value": "nope"}
        plain = store.search(queries, top_k=20)
        filtered = store.search(queries, top_k=20, filters=everything)
        assert [[(h.id, h.score) for h in q] for q in filtered] == [
            [(h.id, h.score) for h in q] for q in plain
        ]
    finally:
        store.close()


def test_large_and_small_subsets_agree_with_brute_force():
    store, vectors = _random_store(4000, 16, rare_every=3)
    try:
        queries = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)
        unit = queries / np.linalg.norm(queries, axis=1, keepdims=True)
        for bucket_filter, rows in [
            ({"field": "meta.rare", "operator": "==", "value": True}, np.arange(0, 4000, 3)),
            ({"field": "meta.bucket", "operator": "==", "value": 3}, np.arange(3, 4000, 7)),
        ]:
            hits = store.search(queries, top_k=15, filters=bucket_filter)
            expected = unit @ vectors[rows].T
            for q in range(2):
                best = rows[np.argsort(-expected[q])[:15]]
                assert [h.id for h in hits[q]] == [f"d{i:06d}" for i in best]
    finally:
        store.close()


class _ShortBackend(ExactBackend):
    """An approximate backend that misses matches: returns at most 2 results."""

    def search_masked(self, queries, k, mask):
        scores, rows = super().search_masked(queries, k, mask)
        scores[:, 2:], rows[:, 2:] = -np.inf, -1
        return scores, rows


def test_short_masked_results_fall_back_to_exact_search_of_the_subset():
    rng = np.random.default_rng(4)
    vectors = rng.standard_normal((100, 8)).astype(np.float32)
    backend = _ShortBackend()
    backend.update(vectors, np.ones(100, dtype=bool))
    queries = rng.standard_normal((2, 8)).astype(np.float32)
    rows = np.arange(0, 100, 2)  # half: the masked path is tried first
    scores, found = search_rows(backend, vectors, queries, 5, rows)
    expected_scores, local = exact_search(vectors[rows], queries, 5)
    assert (found == rows[local]).all()
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-6)


def test_meta_index_is_used_by_equality_filters():
    store, _ = _random_store(500, 8, rare_every=10)
    try:
        store.index_meta_field("meta.bucket")
        where, params = compile_filters({"field": "meta.bucket", "operator": "==", "value": 3})
        with sqlite3.connect(store.path / DB_NAME) as conn:
            plan = conn.execute(
                f"EXPLAIN QUERY PLAN SELECT row FROM documents WHERE {where}", params
            ).fetchall()
        assert any("filter_meta.bucket" in str(step) for step in plan), plan
        assert store.count_matching({"field": "meta.bucket", "operator": "==", "value": 3}) == 71
    finally:
        store.close()
    with pytest.raises(ValueError, match="only meta"):
        meta_index_sql("id")


def test_scaled_scores_match_haystack_1():
    np.testing.assert_allclose(
        scaled_scores(np.array([-1, 0, 0.5, 1]), "cosine"), [0, 0.5, 0.75, 1]
    )
    np.testing.assert_allclose(
        scaled_scores(np.array([-100.0, 0, 100]), "dot"), [0.26894142, 0.5, 0.73105858]
    )


# -- the model-level API and the CLI --------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from densefit.testing import tiny_model

    folder = tmp_path_factory.mktemp("tiny")
    tiny_model(folder / "build").save(str(folder / "model"))
    return folder / "model"


@pytest.fixture(scope="module")
def model(model_dir):
    from densefit.models import load_model

    return load_model(model_dir)


def _docs():
    from densefit.testing.conformance import make_corpus, with_meta

    return with_meta(make_corpus(30))


def test_search_and_retriever_filter_and_scale(model):
    from densefit.api import Retriever

    store = open_store(None, model)
    from densefit.retrieval.index import index_documents

    index_documents(store, model, _docs())
    filters = {"field": "meta.lang", "operator": "==", "value": "fr"}
    hits = search(store, model, "cells", top_k=4, filters=filters, scale_score=True)
    assert len(hits) == 4 and all(h.meta["lang"] == "fr" and 0 <= h.score <= 1 for h in hits)
    plain = {h.id: h.score for h in search(store, model, "cells", top_k=30)}
    for hit in hits:
        assert abs(hit.score - (plain[hit.id] + 1) / 2) < 1e-6

    retriever = Retriever(model)
    retriever.store = store
    got = retriever.retrieve("cells", top_k=4, filters=filters, scale_score=True)
    assert [(h.id, h.score) for h in got] == [(h.id, h.score) for h in hits]
    with pytest.raises(ValueError, match="needs a list"):
        retriever.retrieve("cells", filters={"field": "id", "operator": "in", "value": "x"})


def test_cli_search_filter(model_dir, tmp_path):
    from typer.testing import CliRunner

    from densefit.cli.app import app

    corpus = tmp_path / "corpus.jsonl"
    with corpus.open("w") as fh:
        for doc in _docs():
            row = {"_id": doc.id, "title": doc.title, "text": doc.text, "metadata": doc.meta}
            fh.write(json.dumps(row) + "\n")
    store = tmp_path / "store"
    runner = CliRunner()
    command = ["index", str(corpus), "--model", str(model_dir), "--store", str(store)]
    result = runner.invoke(app, [*command, "--no-progress", "--index-field", "meta.year"])
    assert result.exit_code == 0, result.output
    with sqlite3.connect(store / DB_NAME) as conn:
        indexes = conn.execute("SELECT name FROM sqlite_master WHERE type='index'")
        assert "filter_meta.year" in {name for (name,) in indexes}
    bad_field = runner.invoke(app, [*command, "--index-field", "year"])
    assert bad_field.exit_code == 2
    assert "metadata fields are named meta.NAME, got 'year'" in bad_field.output
    filters = '{"field": "meta.year", "operator": ">=", "value": 2008}'
    search = ["search", "--store", str(store), "cells", "-k", "3", "--json", "--scale-score"]
    result = runner.invoke(app, [*search, "--filter", filters])
    assert result.exit_code == 0, result.output
    hits = json.loads(result.stdout)[0]["hits"]
    assert len(hits) == 3 and all(h["meta"]["year"] >= 2008 and 0 <= h["score"] <= 1 for h in hits)
    filter_file = tmp_path / "filter.json"
    filter_file.write_text(filters)
    from_file = runner.invoke(app, [*search, "--filter", f"@{filter_file}"])
    assert json.loads(from_file.stdout)[0]["hits"] == hits
    for bad, message in [
        ("{not json", "not valid JSON"),
        ('{"field": "meta.year", "operator": ">", "value": "soon"}', "not an ISO 8601 date"),
    ]:
        result = runner.invoke(app, ["search", "--store", str(store), "cells", "--filter", bad])
        assert result.exit_code == 2 and message in result.output
        assert "Traceback" not in result.output


# -- what mutation testing found untested (bench/results/mutation.md) ------------------------


def test_non_ascii_values_match_as_written():
    conn = _table([{"city": "München", "tags": ["Straße", "日本"]}, {"city": "Munchen"}])
    assert _matching(conn, {"field": "meta.city", "operator": "==", "value": "München"}) == [0]
    assert _matching(conn, {"field": "meta.city", "operator": "in", "value": ["München"]}) == [0]
    tags = {"field": "meta.tags", "operator": "==", "value": ["Straße", "日本"]}
    assert _matching(conn, tags) == [0]
    assert _matching(
        conn, {"field": "meta.tags", "operator": "in", "value": [["Straße", "日本"]]}
    ) == [0]


def _nested(levels: int) -> dict:
    node = {"field": "meta.n", "operator": "==", "value": 2}
    for _ in range(levels):
        node = {"operator": "AND", "conditions": [node]}
    return node


def test_nesting_is_allowed_to_the_limit_and_refused_past_it():
    assert _matching(_table(METAS), _nested(MAX_DEPTH)) == [0, 2]
    with pytest.raises(ValueError, match=f"^filters nest deeper than {MAX_DEPTH} levels, "):
        parse_filters(_nested(MAX_DEPTH + 1), EMBEDDED)


def test_naive_dates_are_utc_whatever_the_machine_timezone(monkeypatch):
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+05:30
    time.tzset()
    try:
        conn = _table(METAS)
        # 17:53+01:00 is 16:53 UTC; 18:00+02:00 is 16:00 UTC, 21:00+05:30 is 15:30 UTC
        for value, expected in [("1989-11-09T17:00:00", [0, 1, 2]),
                                ("1989-11-09T18:00:00+02:00", [0, 1]),
                                ("1989-11-09T21:00:00+05:30", [0, 1]),
                                ("1989-11-09T16:55:00", [0, 1, 2])]:  # fmt: skip
            filters = {"field": "meta.date", "operator": "<", "value": value}
            assert _matching(conn, filters) == expected, value
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_error_messages_show_the_filter_cut_to_120_characters():
    node = {"junk": "x" * 300}
    shown = json.dumps(node)[:117] + "..."
    with pytest.raises(ValueError) as error:
        compile_filters(node)
    assert str(error.value) == (
        f"filter {shown} has neither 'field' nor 'operator': a comparison needs "
        "field/operator/value, a logical filter operator (AND, OR, NOT) and conditions"
    )
    short = {"operator": "XOR", "conditions": []}
    with pytest.raises(ValueError) as error:
        compile_filters(short)
    assert str(error.value) == (
        f"unknown logical operator 'XOR' in {json.dumps(short)}: use AND, OR or NOT "
        "(a comparison needs a 'field')"
    )


def test_empty_filters_are_no_filter_and_bad_ones_are_refused_when_parsed():
    assert parse_filters(None) is None and parse_filters({}) is None
    kept = {"field": "meta.n", "operator": "==", "value": 2}
    assert parse_filters(parse_filters(kept)) == parse_filters(kept)
    assert parse_filters(kept).source == kept
    with pytest.raises(ValueError, match="has neither 'field' nor 'operator'"):
        parse_filters({"junk": 1})


def test_a_stored_list_of_non_ascii_texts_matches_in_a_real_store(tmp_path):
    """The store's own metadata encoding and the compiled filter agree (list equality
    compares JSON text: both sides must escape alike)."""
    store = LocalDocumentStore.create(tmp_path / "s", _record(4))
    try:
        docs = [Document("a", "x", meta={"tags": ["Straße", "日本"], "city": "München"}),
                Document("b", "y", meta={"tags": ["Strasse"], "city": "Munchen"})]  # fmt: skip
        store.write(docs, np.eye(2, 4, dtype=np.float32))
        for filters in (
            {"field": "meta.tags", "operator": "==", "value": ["Straße", "日本"]},
            {"field": "meta.tags", "operator": "in", "value": [["Straße", "日本"]]},
            {"field": "meta.city", "operator": "==", "value": "München"},
        ):
            assert [d.id for d in store.filter_documents(filters)] == ["a"], filters
    finally:
        store.close()


def test_a_filter_holding_what_json_cannot_write_is_still_a_one_line_error():
    with pytest.raises(ValueError, match=r'^filter \{"junk": "\{1, 2\}"\} has neither'):
        compile_filters({"junk": {1, 2}})


# -- the limits, at their edges: what the validator passes, SQLite runs ----------------------


def _and_of(comparisons: int, last: dict | None = None) -> dict:
    """One AND of ``comparisons`` comparisons (the last one ``last`` when given)."""
    conditions = [{"field": "meta.n", "operator": "==", "value": i} for i in range(comparisons)]
    if last is not None:
        conditions[-1] = last
    return {"operator": "AND", "conditions": conditions}


TOO_MANY = (
    f"^the filter holds more than {MAX_CONDITIONS} conditions, the most the embedded engine "
    "takes: match many values with one 'in' list of strings or numbers$"
)


@pytest.mark.parametrize("operator", ["in", "not in"])
def test_the_condition_limit_counts_operators_comparisons_and_each_unlisted_in_value(operator):
    """An AND and its comparisons count one each; an ``in`` list of strings and numbers one
    in all, and one more for each None, list or object in it (each is its own SQL term):
    exactly MAX_CONDITIONS runs in SQLite, one more is refused."""
    conn = _table(METAS)
    full = _and_of(MAX_CONDITIONS - 1)
    assert _matching(conn, full) == []  # n == 0 and n == 1 and ...: nothing, but it runs
    with pytest.raises(ValueError, match=TOO_MANY):
        parse_filters(_and_of(MAX_CONDITIONS), EMBEDDED)
    scalars = {"field": "meta.lang", "operator": operator, "value": ["en", 2, 2.5, True] * 500}
    assert _matching(conn, _and_of(MAX_CONDITIONS - 1, scalars)) == []  # one condition
    assert parse_filters(_and_of(MAX_CONDITIONS - 1, scalars), EMBEDDED).conditions == (
        MAX_CONDITIONS
    )
    assert parse_filters(scalars).conditions == 1
    for unlisted in (None, ["en"], {"a": 1}):
        one_more = {"field": "meta.lang", "operator": operator, "value": ["en", unlisted]}
        assert _matching(conn, _and_of(MAX_CONDITIONS - 2, one_more)) == []  # two: runs
        with pytest.raises(ValueError, match=TOO_MANY):
            parse_filters(_and_of(MAX_CONDITIONS - 1, one_more), EMBEDDED)


def test_integers_are_compared_to_the_edges_of_64_bits_and_refused_past_them():
    conn = _table([{"n": -(2**63)}, {"n": 2**63 - 1}, {"n": 0}])
    for row, value in enumerate(INT_RANGE):
        assert _matching(conn, {"field": "meta.n", "operator": "==", "value": value}) == [row]
        assert _matching(conn, {"field": "meta.n", "operator": "in", "value": [value]}) == [row]
    message = (
        "^filter meta.n {} compares with an integer outside the 64-bit range \\(-2\\*\\*63 "
        "to 2\\*\\*63-1\\): write it as a float \\(9.3e18, not 9300000000000000000\\)$"
    )
    for value in (INT_RANGE[0] - 1, INT_RANGE[1] + 1):
        for operator, given in (("==", value), (">", value), ("not in", [0, value])):
            with pytest.raises(ValueError, match=message.format(operator)):
                compile_filters({"field": "meta.n", "operator": operator, "value": given})


def test_the_depth_limit_says_how_to_flatten():
    with pytest.raises(ValueError) as error:
        parse_filters(_nested(MAX_DEPTH + 1), EMBEDDED)
    assert str(error.value) == (
        f"filters nest deeper than {MAX_DEPTH} levels, the most the embedded engine takes: "
        "flatten the AND, OR and NOT operators (an AND inside an AND is one AND)"
    )


# -- the parsed tree every engine compiles ---------------------------------------------------


def test_the_parsed_tree_names_fields_as_the_engines_store_them():
    assert parse_filters(None) is None and parse_filters({}) is None
    text = parse_filters({"field": "text", "operator": "==", "value": "x"}).root
    assert (text.field, text.column, text.path) == ("content", "text", ())
    nested = parse_filters({"field": "meta.a.b", "operator": "==", "value": 1}).root
    assert (nested.field, nested.column, nested.path) == ("meta.a.b", None, ("a", "b"))
    with pytest.raises(ValueError, match="has type object"):
        parse_filters({"field": "meta.a", "operator": "in", "value": [1, object()]})
    with pytest.raises(ValueError, match="^filters must be a dict like .*, got list$"):
        parse_filters([1])


def test_metadata_field_sql_takes_meta_names_only():
    assert meta_field_sql("meta.a.b") == (
        'json_extract(meta, \'$."a"."b"\')',
        'json_type(meta, \'$."a"."b"\')',
    )
    for field in ("content", "id", 3, "metadata.a"):
        with pytest.raises(ValueError, match="^metadata fields are named meta.NAME, got "):
            meta_field_sql(field)


def test_filter_text_is_json_or_a_json_file_and_is_checked(tmp_path):
    given = {"field": "meta.city", "operator": "==", "value": "München"}
    assert parse_filter_text(None) is None
    assert parse_filter_text(json.dumps(given, ensure_ascii=False)).source == given
    path = tmp_path / "filter.json"
    path.write_text(json.dumps(given, ensure_ascii=False), encoding="utf-8")
    assert parse_filter_text(f"@{path}") == parse_filters(given)
    with pytest.raises(ValueError, match="^--filter is not valid JSON \\(Expecting value at "):
        parse_filter_text("{'field': 1}"[1:])
    path.write_text("{oops", encoding="utf-8")
    with pytest.raises(ValueError, match=f"^{path} is not valid JSON \\("):
        parse_filter_text(f"@{path}")
    with pytest.raises(ValueError, match="no 'operator' key"):
        parse_filter_text('{"field": "meta.a", "value": 1}')


# -- typed fields (engines without SQLite's JSON functions) against SQLite's own reading -----

TYPED_METAS = [
    *METAS,
    {
        "a": {"b": True, "c": {"d": 1.5}, "odd key!": 1, "e": None, "f": [1, "x", None]},
        "z": False,
        "i": -7,
        "big": 2**63 - 1,
        "r": 0.25,
        "not a date": "2024-13-45",
        "zulu": "2024-01-02 10:00:00Z",
        "offset": "1989-11-09T17:53:00.250+05:30",
        "day": "2024-02-29",
        "plain": "München",
        "feb 30": "2024-02-30",  # julianday() reads it as 1 March; Python refuses it
        "spaced": "2024-01-02 10:00 +01:00",
        "lower": "2024-01-02t10:00z",
        "now": "now",  # julianday() reads these two; neither starts as a date
        "number": "2460311.5",
        "empty": {},
        "list": [],
    },
]


def _paths(prefix: str, value) -> set[str]:
    """Every field name a filter can give for ``value`` at ``prefix`` (each key's path)."""
    if value is None:
        return set()
    names = {prefix}
    if isinstance(value, dict):
        for key, item in value.items():
            names |= _paths(f"{prefix}.{key}", item)
    return names


@pytest.mark.parametrize("meta", TYPED_METAS, ids=range(len(TYPED_METAS)))
def test_typed_fields_hold_what_sqlite_reads_from_the_stored_metadata(meta, monkeypatch):
    """Each field's entry agrees with SQLite's json_type, json_extract and julianday on the
    stored metadata (what the embedded store's filters read), in a non-UTC timezone."""
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    try:
        fields = typed_fields("d-1", "text 1", "2024-01-02", meta)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert fields["id"] == {"t": "text", "s": "d-1"}
    assert fields["content"] == {"t": "text", "s": "text 1"}
    assert fields["title"] == {"t": "text", "s": "2024-01-02", "d": 1704153600.0}
    expected = (_paths("meta", meta) - {"meta", "meta.a.odd key!"}) | {"id", "content", "title"}
    assert set(fields) == expected
    conn, stored = sqlite3.connect(":memory:"), json.dumps(meta)
    for name in expected - {"id", "content", "title"}:
        path = "$" + "".join(f'."{key}"' for key in name.split(".")[1:])
        kind, value, days = conn.execute(
            "SELECT json_type(?1, ?2), json_extract(?1, ?2), CASE WHEN json_extract(?1, ?2) "
            "GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*' THEN julianday(json_extract(?1, "
            "?2)) END",  # a date: starts as YYYY-MM-DD and julianday() reads it
            (stored, path),
        ).fetchone()
        typed = fields[name]
        assert typed["t"] == kind, name
        if kind in ("true", "false", "integer", "real"):
            assert typed == {"t": kind, "n": float(value)}, name
        elif kind == "text":
            assert typed["s"] == value and set(typed) <= {"t", "s", "d"}, name
            if days is None:
                assert "d" not in typed, name
            else:
                assert typed["d"] == pytest.approx((days - 2440587.5) * 86400, abs=1e-3), name
        else:  # array, object: the compact JSON text SQLite gives
            assert typed == {"t": kind, "j": value}, name
            assert json_text(json.loads(value)) == value


def test_date_seconds_are_utc_and_name_where_a_bad_date_came_from(monkeypatch):
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+05:30: a naive date is UTC all the same
    time.tzset()
    try:
        assert date_seconds("1970-01-02") == 86400.0
        assert date_seconds("1970-01-02T01:00:00+01:00") == 86400.0
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    with pytest.raises(ValueError, match="^filter value 'soon' for meta.when > is a string"):
        date_seconds("soon", "meta.when >")
    with pytest.raises(ValueError, match="^filter value 'soon' for filter is a string"):
        date_seconds("soon")


# -- one parse, each engine's emitter, each engine's limits ----------------------------------

EN = {"field": "meta.lang", "operator": "==", "value": "en"}
# every operator an emitter never sees: NOT, != and not in, nested
NESTED = {
    "operator": "OR",
    "conditions": [
        {"field": "meta.lang", "operator": "!=", "value": "de"},
        {
            "operator": "NOT",
            "conditions": [{"field": "meta.year", "operator": "not in", "value": [2001, None]}],
        },
    ],
}


def _wide(conditions: int) -> dict:
    """An OR of ``conditions`` conditions (itself and ``conditions - 2`` years, then EN)."""
    years = [
        {"field": "meta.year", "operator": "==", "value": 3000 + i} for i in range(conditions - 2)
    ]
    return {"operator": "OR", "conditions": [*years, EN]}


def _deep(levels: int) -> dict:
    node: dict = EN
    for i in range(levels):
        node = {"operator": ("AND", "OR")[i % 2], "conditions": [node, EN]}
    return node


class _Spelled:
    """An emitter that spells the filter as text and records what it was given."""

    def __init__(self):
        self.operators: set[str] = set()

    def compare(self, c):
        self.operators.add(c.operator)
        return f"{c.field} {c.operator} {json.dumps(c.value)}"

    def negate(self, term):
        assert not term.startswith(("not ", "(")), term  # only a comparison is negated
        return f"not {term}"

    def all_of(self, terms):
        assert len(terms) != 1 and not any(t.startswith("(all") for t in terms)  # spliced
        return "(all " + ", ".join(terms) + ")"

    def any_of(self, terms):
        assert len(terms) != 1 and not any(t.startswith("(any") for t in terms)
        return "(any " + ", ".join(terms) + ")"


def test_emitters_get_comparisons_their_negations_and_and_or_only():
    spelled = _Spelled()
    assert filters_module.emit(parse_filters(NESTED), spelled) == (
        '(any not meta.lang == "de", meta.year in [2001, null])'
    )
    rng = random.Random(7)
    for _ in range(300):
        filters_module.emit(parse_filters(_random_filter(rng, deepest=4)), spelled)
    assert spelled.operators == {"==", "in", ">", ">=", "<", "<="}
    assert filters_module.emit(parse_filters({"operator": "AND", "conditions": []}), spelled) == (
        "(all )"
    )


def test_validating_parses_and_never_compiles(monkeypatch, tmp_path):
    def compile_(*args, **kwargs):
        raise AssertionError("a filter was compiled while it was validated")

    monkeypatch.setattr(filters_module, "emit", compile_)
    monkeypatch.setattr(sqlite_filters, "emit", compile_)
    for check in (validate_filters, parse_filters):
        check(NESTED)
        check(NESTED, EMBEDDED)
    assert parse_filter_text(json.dumps(NESTED), EMBEDDED) == parse_filters(NESTED)
    with pytest.raises(ValueError, match="needs a list"):
        validate_filters({"field": "meta.n", "operator": "in", "value": 3}, EMBEDDED)
    store = LocalDocumentStore.create(tmp_path / "s", _record(4))
    try:  # the patch is what a store compiles with: the checks above would have seen it
        with pytest.raises(AssertionError, match="compiled while it was validated"):
            store.count_matching(NESTED)
    finally:
        store.close()


@pytest.fixture(params=STORE_ENGINES)
def filled(request, new_target):
    """A store on each engine holding tests' 30 documents with metadata, random vectors."""
    store = open_store(new_target(request.param), record=_record(4))
    docs = _docs()
    store.write(docs, np.random.default_rng(0).standard_normal((len(docs), 4)).astype(np.float32))
    yield store
    store.close()


def test_a_filter_is_parsed_once_on_every_engine(filled, monkeypatch):
    parsed_trees = []
    real = filters_module._parse_tree
    monkeypatch.setattr(
        filters_module, "_parse_tree", lambda *a: parsed_trees.append(a[0]) or real(*a)
    )
    found = search(filled, None, "cells", filters=NESTED, mode="bm25")  # the library's edge
    assert parsed_trees == [NESTED] and found
    assert all(h.meta["lang"] != "de" or h.meta["year"] == 2001 for h in found)
    parsed_trees.clear()
    query = np.ones((1, 4), np.float32)
    filled.search(query, 3, filters=NESTED, mode="hybrid", query_texts=["cells"], dense_filters=EN)
    assert parsed_trees == [NESTED, EN]  # each once, their AND not parsed again
    parsed_trees.clear()
    (
        filled.count_matching(NESTED),
        filled.filter_documents(NESTED),
        filled.meta_values("meta.lang", NESTED),
    )
    assert parsed_trees == [NESTED] * 3
    parsed_trees.clear()
    once = parse_filters(NESTED)
    assert filled.count_matching(once) == len(filled.filter_documents(once)) > 0
    filled.search(query, 3, filters=once)
    assert parsed_trees == [NESTED]  # only the parse above: a parsed filter travels as it is


def test_each_engine_takes_filters_to_its_own_limits(filled):
    caps = filled.capabilities
    engine = caps.engine
    for size, limit, too_large, message in (
        (_wide, caps.filter_max_conditions, 1001, "the filter holds more than {} conditions"),
        (_deep, caps.filter_max_depth, 21, "filters nest deeper than {} levels"),
    ):
        given = size(too_large)  # past the embedded store's limits
        if limit is not None and limit < too_large:
            with pytest.raises(
                ValueError, match=f"^{message.format(limit)}, the most the {engine} engine takes: "
            ):
                filled.count_matching(given)
            with pytest.raises(ValueError, match=f"the most the {engine} engine takes"):
                filled.search(None, 3, filters=parse_filters(given), mode="bm25", query_texts=["x"])
        else:
            assert filled.count_matching(given) == filled.count_matching(EN) > 0
            hits = filled.search(None, 3, filters=given, mode="bm25", query_texts=["cells"])[0]
            assert hits and all(h.meta["lang"] == "en" for h in hits)
    assert (engine == "embedded") == (caps.filter_max_conditions == MAX_CONDITIONS)
    if engine == "postgresql":  # what SQLite cannot take, PostgreSQL does
        assert caps.filter_max_conditions is None or caps.filter_max_conditions > MAX_CONDITIONS
        assert caps.filter_max_depth is None or caps.filter_max_depth > MAX_DEPTH


def test_qdrant_matches_a_wide_in_list_of_strings_with_one_condition():
    """Qdrant's emitter sends the strings of an ``in`` list as one ``MatchAny`` (its local
    mode evaluates each condition in Python, per document)."""
    pytest.importorskip("qdrant_client", reason="qdrant-client is not installed")
    from densefit.retrieval.index.qdrant import compile_filter

    ids = [f"d{i}" for i in range(5000)]
    wide = compile_filter({"field": "id", "operator": "in", "value": [*ids, "d1", 7]})
    number, strings = wide.should
    assert number.key == "fields.id.n" and strings.key == "fields.id.s"
    assert strings.match.any == ids  # once each, in order
