"""One search request (issue 41, item 4): the mode decided in one place, the request made once
where a search comes in (CLI, Retriever, serve, Haystack) and handed to the store as it is,
engine hooks that return the documents they hold, and no engine overriding ``search()``."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from densefit.choices import MINE_METHODS, SEARCH_MODES, embeds, reads_texts, search_mode
from densefit.data.types import Document
from densefit.retrieval.index import filters as filters_module
from densefit.retrieval.index.common import StoreCommon
from densefit.retrieval.index.filters import Filter
from densefit.retrieval.index.registry import ENGINES
from densefit.retrieval.index.request import Ranked, SearchRequest
from densefit.testing import tiny_model

EN = {"field": "meta.lang", "operator": "==", "value": "en"}
DOCS = [
    Document("a", "cells divide and grow", meta={"lang": "en"}),
    Document("b", "python functions return values", meta={"lang": "en"}),
    Document("c", "cells in python notebooks", meta={"lang": "de"}),
]

# -- the mode decisions ------------------------------------------------------------------------

# mode: (embeds the queries, reads the query texts)
MODE_TABLE = {"dense": (True, False), "bm25": (False, True), "hybrid": (True, True)}


@pytest.mark.parametrize("mode", sorted(set(SEARCH_MODES) | set(MINE_METHODS)))
def test_each_mode_says_what_it_ranks_by(mode):
    assert (embeds(mode), reads_texts(mode)) == MODE_TABLE[mode]
    request = SearchRequest(mode)
    assert (request.embeds, request.reads_texts) == MODE_TABLE[mode]


def test_an_unknown_mode_is_one_line():
    assert set(MODE_TABLE) == set(SEARCH_MODES) == set(MINE_METHODS)
    for decide in (search_mode, embeds, reads_texts, SearchRequest):
        with pytest.raises(ValueError, match=r"^mode must be one of dense, bm25, hybrid, not 'x'$"):
            decide("x")


def test_the_request_parses_its_filter_once_and_checks_its_values(monkeypatch):
    parses = _count(monkeypatch, filters_module, "_parse_tree")
    request = SearchRequest("bm25", 3, EN)
    assert isinstance(request.filters, Filter) and parses() == 1
    again = request.embedded_for(4)
    assert again.filters is request.filters and again.model_generation == 4 and parses() == 1
    assert request.embedded_for(None) is request
    assert SearchRequest("bm25", 3, EN).key == request.key != again.key
    with pytest.raises(ValueError, match="top_k must be at least 1"):
        SearchRequest(top_k=0)
    with pytest.raises(ValueError, match="unknown operator '~' for meta.a"):
        SearchRequest(filters={"field": "meta.a", "operator": "~", "value": 1})


def test_the_store_takes_a_request_or_its_options_not_both():
    from densefit.retrieval.index import open_store

    store = open_store(None, tiny_model())
    vector = np.ones(store.dim, dtype=np.float32)
    assert store.search(vector, request=SearchRequest(top_k=2)) == [[]]
    with pytest.raises(TypeError, match="not both"):
        store.search(vector, 3, request=SearchRequest())
    with pytest.raises(TypeError, match="not both"):
        store.search(vector, request=SearchRequest(), mode="bm25")


# -- the request is made once per search, at each edge ------------------------------------------


def _count(monkeypatch, owner, name):
    """Count calls of ``owner.name`` (still calling it); returns the counter."""
    real = getattr(owner, name)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return lambda: len(calls)


@pytest.fixture
def spy(monkeypatch):
    """What one search did: filter parses, checks of a request against an engine (its mode and
    filters), and the requests the store's search got."""
    parses = _count(monkeypatch, filters_module, "_parse_tree")
    checks = _count(monkeypatch, SearchRequest, "within")
    requests = []
    real_search = StoreCommon.search

    def search(self, *args, **kwargs):
        requests.append(kwargs.get("request"))
        return real_search(self, *args, **kwargs)

    monkeypatch.setattr(StoreCommon, "search", search)
    return lambda: (parses(), checks(), requests)


def _once(spy, mode="hybrid"):
    parses, checks, requests = spy()
    assert (parses, checks, len(requests)) == (1, 1, 1)
    (request,) = requests
    assert isinstance(request, SearchRequest) and isinstance(request.filters, Filter)
    assert request.mode == mode and request.filters.source == EN


def _indexed(path, model):
    from densefit.retrieval.index import open_store
    from densefit.retrieval.index.indexing import index_documents

    with open_store(path, model) as store:
        index_documents(store, model, DOCS)


def test_the_retriever_makes_one_request(spy):
    from densefit.api import Retriever

    retriever = Retriever(tiny_model())
    retriever.index(DOCS)
    requests = spy()[2]
    requests.clear()
    parses_before, checks_before, _ = spy()
    hits = retriever.retrieve_batch(["cells", "python"], top_k=2, filters=EN, mode="hybrid")
    assert all(h.meta["lang"] == "en" for found in hits for h in found)
    parses, checks, requests = spy()
    assert (parses - parses_before, checks - checks_before, len(requests)) == (1, 1, 1)
    assert isinstance(requests[0].filters, Filter) and requests[0].mode == "hybrid"


def test_densefit_search_makes_one_request(spy, tmp_path):
    from typer.testing import CliRunner

    from densefit.cli.app import app

    model = tiny_model(tmp_path / "model")
    _indexed(tmp_path / "store", model)
    args = ["search", "--store", tmp_path / "store", "--model", tmp_path / "model"]
    args += ["--mode", "hybrid", "--filter", json.dumps(EN), "-k", "2", "--json"]
    result = CliRunner().invoke(app, [str(a) for a in [*args, "cells", "python"]])
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert len(found) == 2 and {h["id"] for q in found for h in q["hits"]} <= {"a", "b"}
    _once(spy)


def test_serve_makes_one_request_per_http_request(spy, tmp_path):
    pytest.importorskip("fastapi", reason="densefit[serve] is not installed")
    from fastapi.testclient import TestClient

    from densefit.retrieval.index import open_store
    from densefit.serve.app import create_app
    from densefit.serve.config import ServeConfig

    model = tiny_model()
    _indexed(tmp_path / "store", model)
    body = {"query": ["cells", "python"], "k": 2, "filters": EN, "mode": "hybrid"}
    with TestClient(create_app(open_store(tmp_path / "store"), model, ServeConfig())) as client:
        answer = client.post("/search", json=body)
    assert answer.status_code == 200, answer.text
    assert all(h["meta"]["lang"] == "en" for r in answer.json()["results"] for h in r["hits"])
    _once(spy)  # two queries, one request: one search of the store
    assert spy()[2][0].model_generation is not None  # stamped with the served model's


def test_haystack_makes_one_request(spy, tmp_path):
    if importlib.util.find_spec("haystack") is None:
        pytest.skip("haystack-ai is not installed (densefit[haystack])")
    from haystack import Document as HaystackDocument

    from densefit.integrations.haystack import DensefitDocumentStore, DensefitHybridRetriever

    store = DensefitDocumentStore(tmp_path / "h")
    rng = np.random.default_rng(0)
    store.write_documents(
        [
            HaystackDocument(content=d.text, meta=d.meta, embedding=rng.normal(size=8).tolist())
            for d in DOCS
        ]
    )
    requests = spy()[2]
    parses_before, checks_before, _ = spy()
    retriever = DensefitHybridRetriever(store, top_k=2)
    found = retriever.run(query="cells", query_embedding=[0.1] * 8, filters=EN)["documents"]
    assert found and all(d.meta["lang"] == "en" for d in found)
    parses, checks, requests = spy()
    assert (parses - parses_before, checks - checks_before, len(requests)) == (1, 1, 1)
    assert isinstance(requests[0].filters, Filter) and requests[0].mode == "hybrid"


# -- the engines: one search, documents from the hooks ----------------------------------------


def _engine_file(name: str) -> Path:
    spec = importlib.util.find_spec(ENGINES[name].module)
    return Path(spec.origin)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_no_engine_overrides_search(engine):
    """StoreCommon.search runs every engine's search; an engine wraps it through
    ``_reading()``, not by defining ``search`` again."""
    tree = ast.parse(_engine_file(engine).read_text())
    defined = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "search":
                defined.append(f"{cls.name}.search (line {node.lineno})")
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "search" for t in targets):
                defined.append(f"{cls.name}.search = ... (line {node.lineno})")
    assert not defined, f"{ENGINES[engine].module} defines {defined}: use _reading() instead"


class _Held(StoreCommon):
    """An engine whose hooks hand back every document they rank (as Qdrant's payloads)."""

    def __init__(self, plain_pairs: bool = False):
        super().__init__()
        from densefit.retrieval.index.settings import record_for

        self._record = record_for(tiny_model(), "float32")
        self.location, self.plain_pairs, self.read = "held", plain_pairs, []

    def _where(self, filters):
        return filters

    def _rank(self, n):
        keys, scores = np.array([2, 1], np.int64), np.array([0.9, 0.5])
        if self.plain_pairs:
            return [(keys, scores)] * n
        return [Ranked(keys, scores, {2: ("b", "two", "", {}), 1: ("a", "one", "", {})})] * n

    def _dense(self, queries, k, where):
        return self._rank(len(queries))

    def _lexical(self, texts, k, where):
        return self._rank(len(texts))

    def _documents_at(self, keys):
        self.read.append(keys)
        return {k: (f"read-{k}", "", "", {}) for k in keys}


@pytest.mark.parametrize("mode", SEARCH_MODES)
def test_documents_that_came_with_the_ranking_are_not_read_again(mode):
    store = _Held()
    vector = np.ones((1, store.dim), np.float32)
    hits = store.search(vector, 2, mode=mode, query_texts=["x"])[0]
    assert [h.id for h in hits] == ["b", "a"] and store.read == []
    plain = _Held(plain_pairs=True)  # a hook answering (keys, scores): read back, as before
    hits = plain.search(vector, 2, mode=mode, query_texts=["x"])[0]
    assert [h.id for h in hits] == ["read-2", "read-1"] and plain.read == [[1, 2]]
