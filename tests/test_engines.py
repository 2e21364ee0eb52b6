"""Every command on every engine: ``densefit index``, ``search``, ``eval``, ``mine`` and
``serve`` on the embedded store, PostgreSQL + pgvector (a real server, started by the
``postgres_uri`` fixture) and Qdrant (its local mode), each checked against the embedded
store's answers; the move of an embedded store into an engine (``densefit index
--from-store``); the one-line refusals of what an engine cannot do."""

from __future__ import annotations

import json

import pytest
from conftest import STORE_ENGINES
from typer.testing import CliRunner

from densefit.retrieval.index import open_store
from densefit.testing.conformance import make_corpus, with_meta

runner = CliRunner()


@pytest.fixture(params=STORE_ENGINES)
def engine(request) -> str:
    return request.param


@pytest.fixture
def target(new_target, engine) -> str:
    """A new store on each engine (tests/conftest.py's new_target)."""
    return new_target(engine)


@pytest.fixture(scope="module")
def app():
    from densefit.cli.app import app

    return app


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A corpus with metadata, queries and qrels, and training pairs, as files."""
    folder = tmp_path_factory.mktemp("data")
    docs = with_meta(make_corpus(40))
    with open(folder / "corpus.jsonl", "w") as fh:
        for d in docs:
            fh.write(json.dumps({"_id": d.id, "title": d.title, "text": d.text, "meta": d.meta}))
            fh.write("\n")
    with open(folder / "queries.jsonl", "w") as fh:
        for i in range(0, 40, 4):
            fh.write(json.dumps({"_id": f"q{i}", "text": docs[i].text}) + "\n")
    rows = ["query-id\tcorpus-id\tscore"] + [f"q{i}\t{docs[i].id}\t1" for i in range(0, 40, 4)]
    (folder / "qrels.tsv").write_text("\n".join(rows) + "\n")
    with open(folder / "pairs.jsonl", "w") as fh:
        for i in range(0, 40, 5):
            fh.write(json.dumps({"query": docs[i].text[:40], "positive": docs[i].text}) + "\n")
    return folder


def invoke(app, args, code: int = 0):
    result = runner.invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == code, result.output
    return result


def index(app, data, model, store, *extra):
    return invoke(app, ["index", data / "corpus.jsonl", "--model", model, "--store", store, *extra])


def search(app, store, *args) -> list:
    result = invoke(app, ["search", "--store", store, "--json", "-k", "5", *args])
    return [[(h["id"], round(h["score"], 4)) for h in q["hits"]] for q in json.loads(result.stdout)]


def test_index_search_eval_on_every_engine(app, tiny_models, data, target, tmp_path):
    model = tiny_models / "tiny"
    reference = tmp_path / "reference"
    index(app, data, model, reference)
    index(app, data, model, target, "--backend", "exact")
    again = index(app, data, model, target, "--json")  # resumes: nothing to embed
    assert json.loads(again.stdout)["report"]["unchanged"] == 40
    queries = ["cells genes", "python function", "vaccine memory"]
    for args in ([], ["--filter", '{"field": "meta.lang", "operator": "!=", "value": "de"}']):
        expected = search(app, reference, *queries, *args)
        assert search(app, target, *queries, "--backend", "exact", *args) == expected
    with open_store(target, create=False) as store:
        lexical, hybrid = store.capabilities.lexical, store.capabilities.hybrid
        assert store.get(["doc-0007"])[0].meta == with_meta(make_corpus(40))[7].meta
    if lexical:
        found = search(app, target, "banana cells", "--mode", "bm25")
        assert found[0] and all(h[0] for h in found[0])
    if hybrid:
        assert search(app, target, "banana cells", "--mode", "hybrid")[0]
    scores = []
    for store in (reference, target):
        result = invoke(
            app,
            ["eval", "--store", store, "--queries", data / "queries.jsonl"]
            + ["--qrels", data / "qrels.tsv", "--json", "--backend", "exact"],
        )
        scores.append(json.loads(result.stdout)["results"][0]["metrics"]["ndcg@10"])
    assert scores[0] == pytest.approx(scores[1], abs=1e-6) and scores[0] > 0.5


def test_mine_from_every_engine(app, tiny_models, data, target, tmp_path):
    model = tiny_models / "tiny"
    index(app, data, model, target)
    common = ["--method", "dense", "--num-negatives", "2", "--range", "0:6"]
    invoke(
        app, ["mine", data / "pairs.jsonl", "--store", target, "-o", tmp_path / "a.jsonl"] + common
    )
    invoke(
        app,
        ["mine", data / "pairs.jsonl", "--corpus", data / "corpus.jsonl", "--model", model]
        + ["-o", tmp_path / "b.jsonl"]
        + common,
    )
    mined = [
        [json.loads(line)["negative_ids"] for line in open(tmp_path / name)]
        for name in ("a.jsonl", "b.jsonl")
    ]
    assert mined[0] == mined[1] and all(len(n) == 2 for n in mined[0])


def test_move_an_embedded_store_into_every_engine(app, tiny_models, data, target, tmp_path):
    model = tiny_models / "tiny"
    folder = tmp_path / "embedded"
    index(app, data, model, folder)
    moved = invoke(app, ["index", "--from-store", folder, "--store", target, "--json"])
    report = json.loads(moved.stdout)["report"]
    assert (report["added"], report["encoded"]) == (40, 0)
    with open_store(folder, create=False) as source, open_store(target, create=False) as copy:
        ids = sorted(source.ids())
        assert sorted(copy.ids()) == ids
        assert copy.get(ids) == source.get(ids)  # text, title and metadata
        assert copy.record.same_vectors(source.record)
    queries = ["cells genes", "banana", "python search"]
    assert search(app, target, *queries, "--backend", "exact") == search(app, folder, *queries)
    again = invoke(app, ["index", "--from-store", folder, "--store", target, "--json"])
    assert json.loads(again.stdout)["report"]["unchanged"] == 40  # a second run resumes


def test_serve_on_every_engine(tiny_models, target):
    """The HTTP API over each engine; where the engine is shared, a second server on the same
    store sees the first one's writes (replicas behind a load balancer)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from densefit.models import load_model
    from densefit.serve.app import create_app

    model = load_model(str(tiny_models / "tiny"))
    docs = [{"id": d.id, "text": d.text, "meta": d.meta} for d in with_meta(make_corpus(12))]
    first = open_store(target, model)
    with TestClient(create_app(first, model)) as client:
        assert client.post("/documents", json={"documents": docs}).status_code == 200
        hits = client.post("/search", json={"query": docs[3]["text"], "k": 2}).json()
        assert hits["results"][0]["hits"][0]["id"] == docs[3]["id"]
        assert client.get(f"/documents/{docs[5]['id']}").json()["meta"] == docs[5]["meta"]
        if not first.capabilities.shared:
            return
        second = open_store(target, model)
        with TestClient(create_app(second, model)) as replica:
            assert replica.get("/health").json()["documents"] == 12
            client.request("DELETE", "/documents", json={"ids": [docs[0]["id"]]})
            extra = {"id": "late", "text": "banana vaccine memory", "meta": {}}
            client.post("/documents", json={"documents": [extra]})
            found = replica.post("/search", json={"query": extra["text"], "k": 1}).json()
            assert found["results"][0]["hits"][0]["id"] == "late"
            assert replica.get(f"/documents/{docs[0]['id']}").status_code == 404


def test_what_an_engine_cannot_do_is_one_line(app, tiny_models, data, target, new_target, engine):
    model = tiny_models / "tiny"
    index(app, data, model, target)
    with open_store(target, create=False) as store:
        capabilities = store.capabilities
    if not capabilities.model_swap:
        result = invoke(
            app, ["reembed", "--store", target, "--model", tiny_models / "tiny-other"], code=2
        )
        assert "cannot swap models" in result.output and "the embedded store" in result.output
    missing = [k for k in ("int8", "binary", "float16") if k not in capabilities.vector_kinds]
    if missing:
        result = invoke(
            app,
            ["index", data / "corpus.jsonl", "--model", model, "--store", new_target(engine)]
            + ["--vectors", missing[0]],
            code=2,
        )
        assert f"cannot store {missing[0]} vectors" in result.output


def test_docs_list_every_engines_capabilities():
    """docs/search.md's table is what the engines declare (regenerate it from
    densefit.retrieval.index.engines.capabilities_table when an engine changes)."""
    from pathlib import Path

    from densefit.retrieval.index.engines import capabilities_table

    docs = (Path(__file__).resolve().parents[1] / "docs" / "search.md").read_text()
    assert capabilities_table() in docs
