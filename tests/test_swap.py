"""A model swap (densefit reembed, POST /admin/reembed): the store keeps answering from its
current model while every document is embedded again with the new one, writes and deletes
during the swap reach both, the switch is one commit, and a SIGKILL at any point leaves the
old model serving and the swap resumable. After it, the store equals a fresh index."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from densefit.data.types import Document
from densefit.models import load_model
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.index import LocalDocumentStore, index_documents, open_store
from densefit.retrieval.index.base import ModelSwappedError, StoreError
from densefit.retrieval.index.settings import record_for
from densefit.retrieval.index.swap import reembed_store
from densefit.testing import SWAP_QUERIES, save_swap_models, swap_corpus

REPO = Path(__file__).resolve().parents[1]
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


# -- the store ------------------------------------------------------------------------------


@pytest.mark.parametrize("new_name", ["new", "wide"])
def test_a_swap_equals_a_fresh_index_with_the_new_model(indexed, models, new_name):
    old, new = load_model(str(models["old"])), load_model(str(models[new_name]))
    with LocalDocumentStore(indexed) as store:
        before = ranking(store, old)
        report = reembed_store(store, new, commit_every=7)
        assert report.switched and not report.resumed and report.embedded == 40
        assert store.dim == new.get_embedding_dimension()
        assert store.model_generation == 1
        assert_equals_fresh(store, new, corpus(40))
        with pytest.raises(StoreError):  # the old model no longer made these vectors
            store.check_model(old)
    # Another process opening the folder sees the new model, and only its vector file.
    with LocalDocumentStore(indexed) as store:
        assert_equals_fresh(store, new, corpus(40))
        assert ranking(store, new) != before
    assert sorted(p.name for p in indexed.glob("vectors-*")) == ["vectors-1.f32"]


def test_the_old_model_serves_until_the_switch_and_stale_queries_are_refused(indexed, models):
    old, new = load_model(str(models["old"])), load_model(str(models["new"]))
    with LocalDocumentStore(indexed) as store:
        before = ranking(store, old, model_generation=0)
        target, resumed = store.begin_swap(record_for(new, store.vector_kind))
        assert not resumed
        pending = store.swap_pending(-1, 25)
        vectors = encode_texts(new, [text for *_, text in pending], prompt_name="document")
        assert store.write_swap(target, [(r, i) for r, i, _ in pending], vectors) == 25
        assert store.info()["swap"] == {"model": target.record.model_name, "dim": 32,
                                        "remaining": 15}  # fmt: skip
        assert not store.finish_swap(target)  # documents left: nothing switches
        assert ranking(store, old, model_generation=0) == before  # the old generation serves
        store.check_model(old)
        assert reembed_store(store, new).resumed
        with pytest.raises(ModelSwappedError):  # queries embedded for the old model
            ranking(store, old, model_generation=0)
        assert ranking(store, new, model_generation=1) == ranking(fresh_index(new, corpus(40)), new)


def test_writes_and_deletes_during_a_swap_reach_both_generations(indexed, models):
    old, new = load_model(str(models["old"])), load_model(str(models["new"]))
    docs = {d.id: d for d in corpus(40)}
    with LocalDocumentStore(indexed) as store:
        target, _ = store.begin_swap(record_for(new, store.vector_kind))
        pending = store.swap_pending(-1, 30)
        texts = [text for *_, text in pending]
        vectors = encode_texts(new, texts, prompt_name="document")
        # Meanwhile: a document rewritten, one deleted, one added, one with new metadata,
        # a write embedded by both models (a server's writer) and one by the old only.
        changed = Document("d3", "zebra zebra music", meta={"n": 3})
        store.write([changed], encode_texts(old, [changed.text], prompt_name="document"))
        store.delete(["d5"])
        both = [Document("s1", "bread kernel signal"), Document("d7", "python python")]
        store.write(
            both,
            encode_texts(old, [d.text for d in both], prompt_name="document"),
            swap_embeddings=encode_texts(new, [d.text for d in both], prompt_name="document"),
            swap_target=target,
        )
        only_old = Document("o1", "river bone cell")
        store.write([only_old], encode_texts(old, [only_old.text], prompt_name="document"))
        store.write_metadata([Document("d9", docs["d9"].text, "a title", {"n": 99})])
        # The chunk embedded before those writes: d3, d5 and d7 moved or went, and are left.
        written = store.write_swap(target, [(r, i) for r, i, _ in pending], vectors)
        assert written == 27
        report = reembed_store(store, new, commit_every=4)
        assert report.resumed and report.switched
        assert report.embedded == 40 - 30 + 1 + 1  # the rest, d3 again, o1 (s1, d7: dual)
        docs.update({d.id: d for d in [changed, *both, only_old]})
        docs["d9"] = Document("d9", docs["d9"].text, "a title", {"n": 99})
        del docs["d5"]
        assert_equals_fresh(store, new, list(docs.values()))
        assert store.get(["d9"])[0].title == "a title"


def test_a_write_prepared_for_the_old_model_after_the_switch_is_refused(indexed, models):
    old, new = load_model(str(models["old"])), load_model(str(models["wide"]))
    writer = LocalDocumentStore(indexed)  # another connection, opened before the swap
    try:
        with LocalDocumentStore(indexed) as store:
            reembed_store(store, new)
        doc = Document("late", "python kernel")
        with pytest.raises(ModelSwappedError, match="switched to the model"):
            writer.write([doc], encode_texts(old, [doc.text]))
        assert writer.dim == 48  # it reloaded: the next write embeds with the new model
        writer.write([doc], encode_texts(new, [doc.text], prompt_name="document"))
        writer.check_model(new)
    finally:
        writer.close()


def test_a_swap_to_another_model_starts_afresh_and_cancel_drops_it(indexed, models):
    old, new, wide = (load_model(str(models[n])) for n in ("old", "new", "wide"))
    with LocalDocumentStore(indexed) as store:
        before = ranking(store, old)
        target, _ = store.begin_swap(record_for(new, store.vector_kind))
        pending = store.swap_pending(-1, 10)
        vectors = encode_texts(new, [t for *_, t in pending], prompt_name="document")
        store.write_swap(target, [(r, i) for r, i, _ in pending], vectors)
        assert store.compact() == 0  # no compaction while a swap is under way
        with pytest.raises(StoreError, match="model swap"):
            index_documents(store, old, corpus(40), reembed=True)
        assert store.cancel_swap()
        assert store.info()["swap"] is None and not store.cancel_swap()
        assert sorted(p.name for p in indexed.glob("vectors-*")) == ["vectors-0.f32"]
        assert ranking(store, old) == before
        store.begin_swap(record_for(new, store.vector_kind))
        report = reembed_store(store, wide)  # another model than the swap under way
        assert not report.resumed and report.embedded == 40
        assert_equals_fresh(store, wide, corpus(40))


@pytest.mark.parametrize(
    ("point", "n", "switched"),
    [("vectors", 1, False), ("committed", 3, False), ("vectors", 5, False),
     ("switch", 1, False), ("cleanup", 2, True)],
)  # fmt: skip
def test_a_sigkill_anywhere_leaves_the_old_model_serving_and_the_swap_resumable(
    indexed, models, point, n, switched
):
    old, new = load_model(str(models["old"])), load_model(str(models["wide"]))
    with LocalDocumentStore(indexed) as store:
        before = ranking(store, old)
    child = subprocess.run(
        [sys.executable, str(REPO / "tests" / "_swap_child.py"), str(indexed),
         str(models["wide"]), point, str(n)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    with LocalDocumentStore(indexed) as store:
        if switched:
            store.check_model(new)
        else:  # nothing of the current generation changed
            store.check_model(old)
            assert ranking(store, old) == before
            assert store.info()["swap"]["dim"] == 48
        report = reembed_store(store, new, commit_every=5)
        assert report.switched and report.resumed is not switched
        assert_equals_fresh(store, new, corpus(40))


# -- the server -------------------------------------------------------------------------------


def test_searches_during_an_admin_swap_all_succeed_and_end_on_the_new_model(indexed, models):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from densefit.serve.app import create_app
    from densefit.serve.config import ServeConfig

    old, new = load_model(str(models["old"])), load_model(str(models["wide"]))
    key = {"X-API-Key": "secret"}
    app = create_app(LocalDocumentStore(indexed), old, ServeConfig(api_key="secret"))
    statuses: list[int] = []
    stop = threading.Event()
    with TestClient(app) as client:

        def search_until_stopped():
            while not stop.is_set():
                r = client.post("/search", json={"query": QUERIES, "k": 5}, headers=key)
                statuses.append(r.status_code)

        searchers = [threading.Thread(target=search_until_stopped) for _ in range(2)]
        for thread in searchers:
            thread.start()
        started = client.post("/admin/reembed", json={"model": str(models["wide"])}, headers=key)
        assert started.status_code == 202, started.text
        again = client.post("/admin/reembed", json={"model": str(models["wide"])}, headers=key)
        assert again.status_code in (409, 202)  # 202 only if the first had finished already
        new_doc = {"id": "w1", "text": "zebra kernel bread"}
        assert (
            client.post("/documents", json={"documents": [new_doc]}, headers=key).status_code == 200
        )
        app.state.admin._thread.join(timeout=120)
        stop.set()
        for thread in searchers:
            thread.join()
        status = client.get("/admin/reembed", headers=key).json()
        assert status["state"] == "done", status
        assert statuses and set(statuses) == {200}, statuses[:20]
        assert client.get("/health", headers=key).json()["dim"] == 48
        got = client.post("/search", json={"query": QUERIES, "k": 5}, headers=key).json()
    docs = [*corpus(40), Document("w1", new_doc["text"])]
    want = ranking(fresh_index(new, docs), new)
    assert [[(h["id"], round(h["score"], 4)) for h in r["hits"]] for r in got["results"]] == want


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
