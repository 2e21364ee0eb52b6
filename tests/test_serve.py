"""``densefit serve``: routes, limits, API key, micro-batching, the writer, and the faults
(SIGKILL with acknowledged writes in flight, SIGTERM, hostile requests)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from densefit.data.types import Document  # noqa: E402
from densefit.retrieval.encode import encode_texts  # noqa: E402
from densefit.retrieval.index import LocalDocumentStore, index_documents, open_store  # noqa: E402
from densefit.serve.app import create_app  # noqa: E402
from densefit.serve.config import ServeConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORDS = "cells genes python functions rivers mountains protein kernel socket bread music".split()


def corpus(n: int, seed: int = 0) -> list[Document]:
    rng = random.Random(seed)
    return [
        Document(f"d{i}", " ".join(rng.choices(WORDS, k=8)), meta={"n": i, "lang": "en"})
        for i in range(n)
    ]


@pytest.fixture
def store_dir(tmp_path, model):
    path = tmp_path / "store"
    with open_store(path, model) as store:
        index_documents(store, model, corpus(40))
    return path


def client_for(store_dir, model, **config) -> TestClient:
    store = LocalDocumentStore(store_dir)
    return TestClient(create_app(store, model, ServeConfig(**config)))


def exact(store_dir, model, queries, k):
    with LocalDocumentStore(store_dir) as store:
        return store.search(encode_texts(model, queries), top_k=k)


# -- routes --------------------------------------------------------------------------------


def test_search_one_and_list_equal_exact_search(store_dir, model):
    queries = ["python functions", "rivers and mountains", "cells genes protein"]
    expected = exact(store_dir, model, queries, 5)
    with client_for(store_dir, model) as client:
        one = client.post("/search", json={"query": queries[0], "k": 5})
        many = client.post("/search", json={"query": queries, "k": 5})
    assert one.status_code == 200 and many.status_code == 200
    assert [h["id"] for h in one.json()["results"][0]["hits"]] == [h.id for h in expected[0]]
    for got, want in zip(many.json()["results"], expected, strict=True):
        assert [h["id"] for h in got["hits"]] == [h.id for h in want]
        np.testing.assert_allclose(
            [h["score"] for h in got["hits"]], [h.score for h in want], atol=1e-5
        )
        assert got["hits"][0]["meta"]["lang"] == "en" and got["hits"][0]["text"]


def test_filters_and_scale_score_equal_the_store_search(store_dir, model):
    flt = {"field": "meta.n", "operator": "<", "value": 10}
    with LocalDocumentStore(store_dir) as store:
        want = store.search(encode_texts(model, ["cells"]), 5, filters=flt, scale_score=True)[0]
    with client_for(store_dir, model) as client:
        r = client.post(
            "/search", json={"query": "cells", "k": 5, "filters": flt, "scale_score": True}
        )
    hits = r.json()["results"][0]["hits"]
    assert [h["id"] for h in hits] == [h.id for h in want] and all(
        h["meta"]["n"] < 10 for h in hits
    )
    np.testing.assert_allclose([h["score"] for h in hits], [h.score for h in want], atol=1e-5)
    assert all(0 <= h["score"] <= 1 for h in hits)


def test_upsert_visible_to_next_search_then_get_and_delete(store_dir, model):
    with client_for(store_dir, model) as client:
        new = {"id": "new/1", "text": "bread music kernel socket", "meta": {"src": "api"}}
        r = client.post("/documents", json={"documents": [new]})
        assert r.status_code == 200 and r.json() == {"added": 1, "updated": 0, "committed": True}
        hits = client.post("/search", json={"query": new["text"], "k": 1}).json()
        assert hits["results"][0]["hits"][0]["id"] == "new/1"
        got = client.get("/documents/new/1").json()
        assert got == {"id": "new/1", "text": new["text"], "title": "", "meta": {"src": "api"}}
        r = client.request("DELETE", "/documents", json={"ids": ["new/1", "missing"]})
        assert r.json() == {"deleted": 1, "committed": True}
        assert client.get("/documents/new/1").status_code == 404
        hits = client.post("/search", json={"query": new["text"], "k": 40}).json()
        assert "new/1" not in [h["id"] for h in hits["results"][0]["hits"]]
        assert client.get("/health").json()["documents"] == 40


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid"])
def test_search_modes_equal_the_store_search(store_dir, model, mode):
    queries = ["python functions", "rivers mountains", "zebra"]
    flt = {"field": "meta.n", "operator": ">=", "value": 5}
    with LocalDocumentStore(store_dir) as store:
        want = store.search(
            None if mode == "bm25" else encode_texts(model, queries),
            5,
            filters=flt,
            mode=mode,
            query_texts=queries,
        )
    with client_for(store_dir, model) as client:
        body = {"query": queries, "k": 5, "filters": flt, "mode": mode}
        mixed = [{"query": q, "k": 5, "filters": flt, "mode": m} for q in queries[:1]
                 for m in ("dense", "bm25", "hybrid")]  # fmt: skip
        got = client.post("/search", json=body)
        assert got.status_code == 200, got.text
        with ThreadPoolExecutor(3) as pool:  # modes mixed in one batch stay apart
            answers = list(pool.map(lambda b: client.post("/search", json=b).json(), mixed))
    for hits, expected in zip(got.json()["results"], want, strict=True):
        assert [h["id"] for h in hits["hits"]] == [h.id for h in expected]
        np.testing.assert_allclose(
            [h["score"] for h in hits["hits"]], [h.score for h in expected], atol=1e-5
        )
        assert all(h["meta"]["n"] >= 5 for h in hits["hits"])
    assert want[-1] == [] or mode != "bm25"  # no document holds the word
    by_mode = {b["mode"]: a["results"][0]["hits"] for b, a in zip(mixed, answers, strict=True)}
    assert [h["id"] for h in by_mode[mode]] == [h.id for h in want[0]]


@pytest.mark.parametrize("vectors", ["float16", "int8", "binary"])
def test_every_vector_kind_serves_searches_and_writes(tmp_path, model, vectors):
    path = tmp_path / vectors
    with open_store(path, model, vectors=vectors) as store:
        index_documents(store, model, corpus(40))
    queries = ["python functions", "rivers mountains"]
    # Every document a candidate: the tiny model's sign bits hardly tell its documents apart.
    rescore = None if vectors == "float16" else 64
    with LocalDocumentStore(path, rescore=rescore) as store:
        want = store.search(encode_texts(model, queries), 5)
    app = create_app(LocalDocumentStore(path, rescore=rescore), model, ServeConfig())
    with TestClient(app) as client:
        assert client.get("/health").json()["vectors"] == vectors
        got = client.post("/search", json={"query": queries, "k": 5}).json()["results"]
        for hits, expected in zip(got, want, strict=True):
            assert [h["id"] for h in hits["hits"]] == [h.id for h in expected]
        new = {"id": "n1", "text": "bread music kernel socket rivers"}
        assert client.post("/documents", json={"documents": [new]}).status_code == 200
        top = client.post("/search", json={"query": new["text"], "k": 1}).json()
        assert top["results"][0]["hits"][0]["id"] == "n1"


def test_bm25_search_sees_writes_and_deletes_at_once(store_dir, model):
    with client_for(store_dir, model) as client:
        search = {"query": "zebra", "k": 3, "mode": "bm25"}
        assert client.post("/search", json=search).json()["results"][0]["hits"] == []
        new = {"id": "z1", "text": "a zebra crossing the rivers"}
        assert client.post("/documents", json={"documents": [new]}).status_code == 200
        hits = client.post("/search", json=search).json()["results"][0]["hits"]
        assert [h["id"] for h in hits] == ["z1"]
        client.request("DELETE", "/documents", json={"ids": ["z1"]})
        assert client.post("/search", json=search).json()["results"][0]["hits"] == []
        hybrid = client.post("/search", json={**search, "mode": "hybrid"}).json()
        assert "z1" not in [h["id"] for h in hybrid["results"][0]["hits"]]
        store = client.app.state.store
        # Read from the file the index saved, then updated once per write: one text tokenised.
        assert store._bm25.updates == 2 and store._bm25.tokenised == 1
        bad = client.post("/search", json={**search, "mode": "sparse"})
        assert bad.status_code == 422 and "mode" in bad.json()["error"]


def test_health_metrics_and_docs(store_dir, model):
    with client_for(store_dir, model) as client:
        client.post("/search", json={"query": "cells", "k": 2})
        client.post("/search", json={"query": "cells", "k": 10_000})
        health = client.get("/health").json()
        text = client.get("/metrics").text
        assert client.get("/docs").status_code == 200
        assert "/search" in client.get("/openapi.json").json()["paths"]
    assert health["status"] == "ok" and health["documents"] == 40 and health["dim"] == 32
    assert health["runtime"] == "torch" and health["runtime_ms"] == {}  # auto, nothing exported
    assert 'densefit_requests_total{route="/search",method="POST",status="200"} 1' in text
    assert 'densefit_requests_total{route="/search",method="POST",status="422"} 1' in text
    assert 'densefit_request_seconds_bucket{route="/search",le="+Inf"} 2' in text
    assert 'densefit_errors_total{kind="client"} 1' in text
    assert "densefit_documents 40" in text and "densefit_query_batch_size_count 1" in text


# -- refusals ------------------------------------------------------------------------------


def test_refusals_are_4xx_with_a_message_and_the_server_keeps_serving(store_dir, model):
    with client_for(store_dir, model, max_body_bytes=10_000, max_k=20, max_queries=4) as client:
        cases = {
            "huge body": client.post("/search", content=b'{"query": "' + b"a" * 20_000 + b'"}'),
            "bad json": client.post(
                "/search", content=b'{"query": ', headers={"content-type": "application/json"}
            ),
            "wrong type": client.post("/search", json={"query": "x", "k": "3"}),
            "unknown field": client.post("/search", json={"query": "x", "top": 3}),
            "k limit": client.post("/search", json={"query": "x", "k": 21}),
            "k zero": client.post("/search", json={"query": "x", "k": 0}),
            "too many queries": client.post("/search", json={"query": ["x"] * 5}),
            "empty query": client.post("/search", json={"query": " "}),
            "bad filter": client.post("/search", json={"query": "x", "filters": {"field": 3}}),
            "duplicate ids": client.post(
                "/documents", json={"documents": [{"id": "a", "text": "x"}] * 2}
            ),
            "no text": client.post("/documents", json={"documents": [{"id": "a"}]}),
            "not found": client.get("/documents/nope"),
        }
        statuses = {name: r.status_code for name, r in cases.items()}
        assert statuses["huge body"] == 413 and statuses["too many queries"] == 413
        assert statuses["bad json"] == 400 and "not valid JSON" in cases["bad json"].json()["error"]
        assert "k must be between 1 and 20" in cases["k limit"].json()["error"]
        assert cases["unknown field"].json()["error"].startswith("top: ")
        assert all(400 <= s < 500 for s in statuses.values()), statuses
        assert all(r.json()["error"] for r in cases.values())
        assert client.get("/health").status_code == 200
        assert client.post("/search", json={"query": "cells"}).status_code == 200


def test_chunked_body_over_the_limit_is_413(store_dir, model):
    def chunks():
        for _ in range(20):
            yield b" " * 1000

    with client_for(store_dir, model, max_body_bytes=10_000) as client:
        r = client.post("/search", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413


def test_api_key_required_on_every_request(store_dir, model):
    with client_for(store_dir, model, api_key="s3cret") as client:
        assert client.get("/health").status_code == 401
        assert client.post("/search", json={"query": "x"}).status_code == 401
        assert client.get("/health", headers={"X-API-Key": "wrong"}).status_code == 401
        assert client.get("/health", headers={"X-API-Key": "s3cret"}).status_code == 200
        auth = {"Authorization": "Bearer s3cret"}
        assert client.post("/search", json={"query": "x"}, headers=auth).status_code == 200


def test_read_only_server_refuses_writes(store_dir, model):
    with client_for(store_dir, model, allow_writes=False) as client:
        r = client.post("/documents", json={"documents": [{"id": "z", "text": "x"}]})
        assert r.status_code == 403 and "--api-key" in r.json()["error"]
        assert client.post("/search", json={"query": "x"}).status_code == 200


# -- the writer and the batcher --------------------------------------------------------------


def test_write_acknowledged_only_after_commit(store_dir, model):
    store = LocalDocumentStore(store_dir)
    release, entered = threading.Event(), threading.Event()
    write = store.write

    def slow_write(docs, embeddings):
        entered.set()
        assert release.wait(10)
        return write(docs, embeddings)

    store.write = slow_write
    with TestClient(create_app(store, model)) as client, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            client.post, "/documents", json={"documents": [{"id": "late", "text": "x y"}]}
        )
        assert entered.wait(10)
        time.sleep(0.2)
        assert not pending.done()  # not acknowledged before the commit
        # searches do not wait for the write either
        assert client.post("/search", json={"query": "cells"}).status_code == 200
        release.set()
        assert pending.result(10).status_code == 200
        with LocalDocumentStore(store_dir) as other:  # another connection sees it committed
            assert other.get(["late"])[0].text == "x y"


def test_searches_do_not_wait_for_a_long_embedding_write(store_dir, model):
    """A search is answered while a write is held inside its embedding: the write is
    released by the test only after the search returned (its wait never times out)."""
    store = LocalDocumentStore(store_dir)
    app = create_app(store, model)
    release, entered, timed_out = threading.Event(), threading.Event(), []
    embed = app.state.writer.embed

    def held(texts):
        entered.set()
        timed_out.append(not release.wait(120))
        return embed(texts)

    app.state.writer.embed = held
    with TestClient(app) as client, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            client.post, "/documents", json={"documents": [{"id": "w", "text": "music"}]}
        )
        assert entered.wait(60)
        assert client.post("/search", json={"query": "music"}).status_code == 200
        assert not pending.done()
        release.set()
        assert pending.result(60).json()["added"] == 1
    assert timed_out == [False]  # released by the test, after the search: it did not wait


def test_concurrent_queries_share_forward_passes(store_dir, model):
    queries = [f"{a} {b}" for a in WORDS[:6] for b in WORDS[6:10]]  # 24 distinct queries
    expected = exact(store_dir, model, queries, 3)
    with client_for(store_dir, model, max_wait_ms=50) as client:
        before = client.app.state.batcher.batches
        with ThreadPoolExecutor(len(queries)) as pool:
            responses = list(
                pool.map(lambda q: client.post("/search", json={"query": q, "k": 3}), queries)
            )
        batches = client.app.state.batcher.batches - before
    assert batches < len(queries) / 2, batches
    for r, want in zip(responses, expected, strict=True):
        hits = r.json()["results"][0]["hits"]
        assert [h["id"] for h in hits] == [h.id for h in want]
        np.testing.assert_allclose([h["score"] for h in hits], [h.score for h in want], atol=1e-5)


def test_queries_and_documents_get_the_prompts_the_store_was_indexed_with(tmp_path, model):
    import copy

    from densefit.retrieval.encode import configure_model
    from densefit.retrieval.index.searching import search_batch
    from densefit.retrieval.index.types import SettingsMismatchError

    prompted = configure_model(
        copy.deepcopy(model), query_prompt="query: ", document_prompt="passage: "
    )
    with open_store(tmp_path / "p", prompted) as store:
        index_documents(store, prompted, corpus(30))
    queries = ["cells genes", "python kernel socket"]
    with LocalDocumentStore(tmp_path / "p") as store:
        want = search_batch(store, prompted, queries, top_k=5)
        with pytest.raises(SettingsMismatchError, match="prompts"):
            create_app(store, model, close_store=False)  # no prompts: refused
    with TestClient(create_app(LocalDocumentStore(tmp_path / "p"), prompted)) as client:
        r = client.post("/search", json={"query": queries, "k": 5})
        got = [[h["id"] for h in res["hits"]] for res in r.json()["results"]]
        assert got == [[h.id for h in hits] for hits in want]
        doc = {"id": "new", "text": "bread music rivers"}
        assert client.post("/documents", json={"documents": [doc]}).status_code == 200
    with LocalDocumentStore(tmp_path / "p") as store:
        expected = encode_texts(prompted, [doc["text"]], prompt_name="document", normalize=True)
        np.testing.assert_allclose(store.vectors(["new"]), expected, atol=1e-5)


class _CountedWaits:
    """asyncio for the batcher module, counting its waits for more queries (wait_for)."""

    def __init__(self):
        import asyncio

        self._asyncio, self.waits = asyncio, 0

    def __getattr__(self, name):
        return getattr(self._asyncio, name)

    def wait_for(self, awaitable, timeout):
        self.waits += 1
        return self._asyncio.wait_for(awaitable, timeout)


def test_a_lone_query_does_not_wait_for_company(store_dir, model, monkeypatch):
    """Nothing else is on its way, so the batch starts at once: the batcher never waits for
    more queries (its waits are counted, not timed)."""
    import densefit.serve.batcher as batcher_module

    counted = _CountedWaits()
    monkeypatch.setattr(batcher_module, "asyncio", counted)
    with client_for(store_dir, model, max_wait_ms=3000) as client:
        client.post("/search", json={"query": "warm up"})
        assert client.post("/search", json={"query": "cells"}).status_code == 200
        assert client.post("/search", json={"query": "x", "k": 0}).status_code == 422
        assert client.app.state.batcher._arriving == 0  # refused requests do not linger
        assert client.post("/search", json={"query": "genes"}).status_code == 200
        assert client.app.state.batcher.batches == 3
    assert counted.waits == 0


def test_batch_waits_for_announced_requests():
    import asyncio

    from densefit.serve.batcher import MicroBatcher, Query

    sizes = []

    def run_batch(queries):
        sizes.append(len(queries))
        return [q.text for q in queries]

    async def demo():
        batcher = MicroBatcher(run_batch, max_wait=5.0)
        await batcher.start()
        arrived = batcher.announce()  # a request still being read
        first = asyncio.ensure_future(batcher.search([Query("a")], batcher.announce()))
        await asyncio.sleep(0.1)
        assert sizes == []  # the batch waits for the announced request
        second = asyncio.ensure_future(batcher.search([Query("b"), Query("c")], arrived))
        out = await asyncio.wait_for(asyncio.gather(first, second), 20)
        await batcher.stop()
        return out

    assert asyncio.run(demo()) == [["a"], ["b", "c"]]
    assert sizes == [3]


def test_batcher_runs_its_workers_at_the_same_time():
    import asyncio

    from densefit.serve.batcher import MicroBatcher, Query

    both = threading.Barrier(2, timeout=10)

    def run_batch(queries):
        both.wait()  # returns only when the two workers are inside run_batch together
        return [q.text for q in queries]

    async def demo():
        batcher = MicroBatcher(run_batch, max_wait=0, workers=2)
        await batcher.start()
        first = asyncio.ensure_future(batcher.submit(Query("a")))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(batcher.submit(Query("b")))
        out = await asyncio.wait_for(asyncio.gather(first, second), 20)
        await batcher.stop()
        return out

    assert asyncio.run(demo()) == ["a", "b"]


def test_batch_forms_when_a_worker_is_free_and_takes_all_waiting_queries():
    import asyncio

    from densefit.serve.batcher import MicroBatcher, Query

    release, sizes = threading.Event(), []

    def run_batch(queries):
        sizes.append(len(queries))
        assert release.wait(10)
        return [q.text for q in queries]

    async def demo():
        batcher = MicroBatcher(run_batch, max_wait=0, workers=1)
        await batcher.start()
        tasks = [asyncio.ensure_future(batcher.submit(Query("first")))]
        await asyncio.sleep(0.05)  # the only worker is busy with "first"
        for text in "bcde":  # arriving one by one while it is busy
            tasks.append(asyncio.ensure_future(batcher.submit(Query(text))))
            await asyncio.sleep(0.02)
        release.set()
        out = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        await batcher.stop()
        return out

    assert asyncio.run(demo()) == ["first", "b", "c", "d", "e"]
    assert sizes == [1, 4]  # not one batch frozen early with "b" while c, d, e queue behind


def test_query_workers_run_with_their_share_of_torch_threads(store_dir, model):
    import torch

    from densefit.serve.config import worker_threads

    seen = []
    with client_for(store_dir, model, query_workers=2, threads_per_worker=3) as client:
        run_batch = client.app.state.batcher.run_batch
        client.app.state.batcher.run_batch = lambda qs: (
            seen.append(torch.get_num_threads()),
            run_batch(qs),
        )[1]
        assert client.post("/search", json={"query": "cells"}).status_code == 200
    assert seen == [3]
    assert worker_threads(ServeConfig(query_workers=4), 16) == 4
    assert worker_threads(ServeConfig(query_workers=4), 2) == 1


def test_hostile_requests_never_5xx(store_dir, model):
    rng = random.Random(1)
    bodies = [
        b"",
        b"null",
        b"[]",
        b"{}",
        b'"x"',
        b"{" * 5000,
        b"[" * 100_000,
        b"\xff\xfe",
        b'{"query": {"$ne": 1}}',
        b'{"query": "x", "k": 1e309}',
        b'{"query": "x", "k": -1}',
        b'{"query": "x", "filters": {"field": "meta.a\\"); DROP TABLE documents; --", "operator": "==", "value": 1}}',
        b'{"query": "x", "filters": {"operator": "AND", "conditions": "x"}}',
        b'{"query": "x", "filters": {"field": "meta.n", "operator": "LIKE", "value": "%"}}',
        b'{"documents": [{"id": "../../etc/passwd", "text": "x", "meta": {"a": [1, {"b": null}]}}]}',
        b'{"documents": [{"id": "", "text": "x"}]}',
        b'{"ids": [1, 2]}',
        b'{"ids": "x"}',
    ]
    for _ in range(40):
        bodies.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))))
    paths = [("POST", "/search"), ("POST", "/documents"), ("DELETE", "/documents")]
    with client_for(store_dir, model, max_body_bytes=50_000) as client:
        statuses = [
            client.request(
                m, p, content=b, headers={"content-type": "application/json"}
            ).status_code
            for b in bodies
            for m, p in paths
        ]
        statuses.append(client.get("/documents/%2e%2e%2f%2e%2e%2fetc%2fpasswd").status_code)
        assert max(statuses) < 500, sorted(set(statuses))
        assert client.get("/health").status_code == 200
    with LocalDocumentStore(store_dir) as store:  # nothing reached the file system
        assert store.count() <= 41 and "documents" not in os.listdir(store_dir)


# -- the command, in a real process --------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store_dir, model_path, *extra) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("DENSEFIT_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "densefit", "serve", "--store", str(store_dir),
         "--model", str(model_path), "--port", str(port), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # a hang guard: starting takes seconds, more under load
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode())
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start in 300 s")


def test_cli_refuses_a_store_of_another_model(store_dir, tiny_models):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", "densefit", "serve", "--store", str(store_dir),
         "--model", str(tiny_models / "tiny-other"), "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "model" in last


def test_sigkill_keeps_every_acknowledged_write(store_dir, tiny_models, model):
    """Four clients write at once; the server is SIGKILLed the moment a randomly chosen
    acknowledgement arrives, while other writes are in flight. Every acknowledged write is
    in the store with its text and its vector, every other write is there whole or not at
    all, and the server restarts on the store."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    kill_at = rng.randint(4, 20)  # the acknowledgement that triggers the kill
    jitter = rng.uniform(0, 0.005)
    proc, url = start_server(store_dir, tiny_models / "tiny")
    lock = threading.Lock()
    acked: list[list[str]] = []
    sent: list[list[str]] = []
    in_flight = [0]
    killed_with: list[int] = []  # writes in flight when the kill was sent

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            for i in range(100):  # bounded; the kill ends it long before
                ids = [f"c{c}-{i}-{j}" for j in range(rng.randint(1, 8))]
                docs = [{"id": d, "text": f"kill test {d} cells"} for d in ids]
                with lock:
                    if killed_with:
                        return
                    sent.append(ids)
                    in_flight[0] += 1
                try:
                    r = http.post("/documents", json={"documents": docs})
                except httpx.HTTPError:
                    return
                with lock:
                    in_flight[0] -= 1
                    if r.status_code != 200 or killed_with:
                        return
                    acked.append(ids)
                    if len(acked) == kill_at:
                        time.sleep(jitter)  # a random moment of the next write
                        proc.send_signal(signal.SIGKILL)
                        killed_with.append(in_flight[0])

    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(client, range(4)))
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL and killed_with, (seed, killed_with)
    assert killed_with[0] >= 1, f"seed {seed}: no write was in flight at the kill"
    with LocalDocumentStore(store_dir) as store:
        for ids in sent:
            found = store.get(ids)
            present = [d is not None for d in found]
            if ids in acked:
                assert all(present), f"seed {seed}: acknowledged write {ids} lost"
            else:
                assert len(set(present)) == 1, f"seed {seed}: write {ids} half there"
            texts = [d.text for d in found if d is not None]
            assert texts == [f"kill test {d} cells" for d, ok in zip(ids, present) if ok]
            if texts:  # each with the vector of its own text
                want = encode_texts(model, texts, prompt_name="document", normalize=True)
                np.testing.assert_allclose(store.vectors(ids), want, atol=1e-5)
        assert store.count() == 40 + sum(len(ids) for ids in sent if store.get(ids)[0])
    proc, url = start_server(store_dir, tiny_models / "tiny")  # restarts on the same store
    try:
        last = acked[-1][0]
        r = httpx.post(f"{url}/search", json={"query": f"kill test {last} cells", "k": 5})
        assert r.status_code == 200 and r.json()["results"][0]["hits"]
        after = [{"id": "after", "text": "written after the restart"}]
        assert httpx.post(f"{url}/documents", json={"documents": after}).status_code == 200
    finally:
        proc.kill()
        proc.wait(10)
    with LocalDocumentStore(store_dir) as store:  # appended after whatever the kill left
        want = encode_texts(model, [after[0]["text"]], prompt_name="document", normalize=True)
        np.testing.assert_allclose(store.vectors(["after"]), want, atol=1e-5)


def test_sigterm_finishes_in_flight_requests_and_closes_the_store(store_dir, tiny_models):
    proc, url = start_server(store_dir, tiny_models / "tiny")

    def write(i):
        try:
            docs = [{"id": f"t{i}-{j}", "text": f"term {i} {j} music"} for j in range(20)]
            return i, httpx.post(
                f"{url}/documents", json={"documents": docs}, timeout=30
            ).status_code
        except httpx.HTTPError as exc:
            return i, type(exc).__name__

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(write, i) for i in range(8)]
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in futures]
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0, output
    assert "Traceback" not in output
    acked = [i for i, status in results if status == 200]
    assert all(status == 200 or isinstance(status, str) for _, status in results), results
    with LocalDocumentStore(store_dir) as store:  # opens cleanly, acknowledged writes are in
        assert all(store.get([f"t{i}-0"])[0] is not None for i in acked)


def test_serve_config_refuses_limits_below_their_smallest_value():
    """Every numeric limit declares its smallest value; below it, ServeConfig names the field."""
    import dataclasses

    from densefit.config.options import option_of
    from densefit.errors import OptionError

    numbers = {
        f.name: f.type for f in dataclasses.fields(ServeConfig) if f.type in ("int", "float")
    }
    assert {"max_k", "max_wait_ms", "threads_per_worker", "max_embed_inputs"} <= set(numbers)
    for name, kind in numbers.items():
        low = option_of(ServeConfig, name).ge
        assert low is not None, f"{name}: a limit without a smallest value"
        ServeConfig(**{name: low})  # the smallest value is fine
        with pytest.raises(OptionError, match=rf"^{name} must be >= {low:g}, got -?[\d.]+$"):
            ServeConfig(**{name: low - (0.5 if kind == "float" else 1)})
