"""A model swap (densefit reembed, POST /admin/reembed) on the embedded store. The store's side
is the conformance suite's (:class:`~densefit.testing.conformance.SwapConformance`, which
every engine that swaps models runs); here, the server following a swap and the command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from densefit.data.types import Document
from densefit.models import load_model
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.index import LocalDocumentStore, index_documents, open_store
from densefit.retrieval.index.reembed import reembed_store
from densefit.testing import SWAP_QUERIES, save_swap_models, swap_corpus
from densefit.testing.conformance import SwapConformance

QUERIES = SWAP_QUERIES


def corpus(n: int, seed: int = 0, prefix: str = "d") -> list[Document]:
    return swap_corpus(n, seed, prefix)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Saved tiny models: ``old``, ``new`` (another seed, same size) and ``wide`` (48-d)."""
    return save_swap_models(tmp_path_factory.mktemp("swap-models"))


def ranking(store, model, **kwargs) -> list[list[tuple[str, float]]]:
    queries = encode_texts(model, QUERIES, prompt_name="query")
    return [
        [(h.id, round(h.score, 4)) for h in hits]
        for hits in store.search(queries, top_k=5, **kwargs)
    ]


def fresh_index(model, documents: list[Document]):
    store = open_store(None, model)
    index_documents(store, model, documents)
    return store


def assert_equals_fresh(store, model, documents: list[Document]) -> None:
    """The swapped store holds what a fresh index of ``documents`` by ``model`` does: the
    same documents, and the same vectors up to the float rounding of other batches (the swap
    embeds chunks in row order, an index the whole corpus by length)."""
    fresh = fresh_index(model, documents)
    ids = sorted(d.id for d in documents)
    assert sorted(store.ids()) == ids
    np.testing.assert_allclose(store.vectors(ids), fresh.vectors(ids), rtol=0, atol=1e-5)
    assert store.get(ids) == fresh.get(ids)
    assert ranking(store, model) == ranking(fresh, model)
    store.check_model(model)
    assert store.info()["swap"] is None


@pytest.fixture
def indexed(tmp_path, models):
    """A store of 40 documents indexed by the ``old`` model."""
    old = load_model(str(models["old"]))
    path = tmp_path / "store"
    with open_store(path, old) as store:
        index_documents(store, old, corpus(40))
    return path


# -- the store: the conformance suite's swap tests ---------------------------------------------


class TestEmbeddedSwap(SwapConformance):
    """Every swap behaviour the suite states, on the embedded store: its generations are
    vector files (``vectors-<g>.f32``), one left after a switch or a cancel."""

    def generations(self, target) -> list[str]:
        return sorted(p.name for p in Path(target).glob("vectors-*"))


# -- the server -------------------------------------------------------------------------------


def test_the_server_follows_a_swap_made_by_another_process(indexed, models):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from densefit.serve.app import create_app
    from densefit.serve.config import ServeConfig

    old, new = load_model(str(models["old"])), load_model(str(models["wide"]))
    app = create_app(LocalDocumentStore(indexed), old, ServeConfig())
    with TestClient(app) as client:
        assert client.post("/search", json={"query": QUERIES[0]}).status_code == 200
        with LocalDocumentStore(indexed) as other:  # densefit reembed, elsewhere
            reembed_store(other, new)
        got = client.post("/search", json={"query": QUERIES, "k": 5})
        assert got.status_code == 200, got.text
        written = client.post("/documents", json={"documents": [{"id": "x", "text": "bone"}]})
        assert written.status_code == 200, written.text
        embedded = client.post("/v1/embeddings", json={"input": "bone"}).json()
        assert len(embedded["data"][0]["embedding"]) == 48
    want = ranking(fresh_index(new, corpus(40)), new)
    assert [[(h["id"], round(h["score"], 4)) for h in r["hits"]]
            for r in got.json()["results"]] == want  # fmt: skip


def test_admin_routes_need_an_api_key(indexed, models):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from densefit.serve.app import create_app
    from densefit.serve.config import ServeConfig

    old = load_model(str(models["old"]))
    with TestClient(create_app(LocalDocumentStore(indexed), old, ServeConfig())) as client:
        refused = client.post("/admin/reembed", json={"model": str(models["new"])})
        assert refused.status_code == 403 and "--api-key" in refused.json()["error"]
    config = ServeConfig(api_key="k")
    with TestClient(create_app(LocalDocumentStore(indexed), old, config)) as client:
        assert client.post("/admin/reembed", json={"model": "x"}).status_code == 401
        bad = client.post("/admin/reembed", json={"model": 3}, headers={"X-API-Key": "k"})
        assert bad.status_code == 422
        missing = client.post(
            "/admin/reembed", json={"model": "/no/such/model"}, headers={"X-API-Key": "k"}
        )
        assert missing.status_code == 422 and "cannot load" in missing.json()["error"]
        status = client.get("/admin/reembed", headers={"X-API-Key": "k"}).json()
        assert status["state"] == "idle"
        searched = client.post("/search", json={"query": "cell"}, headers={"X-API-Key": "k"})
        assert searched.status_code == 200


# -- the command ------------------------------------------------------------------------------


def test_densefit_reembed_swaps_and_says_so(indexed, models):
    from typer.testing import CliRunner

    from densefit.cli.app import app

    runner = CliRunner()
    result = runner.invoke(
        app, ["reembed", "--store", str(indexed), "-m", str(models["new"]), "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["switched"] and report["embedded"] == 40 and report["documents"] == 40
    assert not list(indexed.glob("*.lock"))  # the swap's and the writers' locks: let go, removed
    with LocalDocumentStore(indexed) as store:
        assert_equals_fresh(store, load_model(str(models["new"])), corpus(40))
    missing = runner.invoke(app, ["reembed", "--store", str(indexed)])
    assert missing.exit_code == 2 and "--model" in missing.output
    assert len(missing.output.strip().splitlines()) == 1
    not_a_store = runner.invoke(app, ["reembed", "--store", str(indexed.parent), "-m", "x"])
    assert not_a_store.exit_code == 2 and "not a densefit store" in not_a_store.output
    cancelled = runner.invoke(app, ["reembed", "--store", str(indexed), "--cancel"])
    assert cancelled.exit_code == 0 and "no model swap under way" in cancelled.output
