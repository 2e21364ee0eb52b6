"""``densefit serve``'s embeddings endpoints: ``/v1/embeddings`` with OpenAI's own client over
loopback, ``/embed`` in text-embeddings-inference's shape, the prompt rule, Matryoshka
``dimensions``, the limits and the API key, and micro-batching with search queries."""

from __future__ import annotations

import base64
import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402
from test_serve import WORDS, corpus, start_server  # noqa: E402

from densefit.data.types import Document  # noqa: E402
from densefit.losses.matryoshka import truncate  # noqa: E402
from densefit.retrieval.encode import configure_model, encode_texts  # noqa: E402
from densefit.retrieval.index import LocalDocumentStore, index_documents, open_store  # noqa: E402
from densefit.serve.app import create_app  # noqa: E402
from densefit.serve.config import ServeConfig  # noqa: E402


@pytest.fixture
def store_dir(tmp_path, model):
    path = tmp_path / "store"
    with open_store(path, model) as store:
        index_documents(store, model, corpus(30))
    return path


@pytest.fixture
def prompted(model):
    """The tiny model with a query and a document prompt (as E5 models have)."""
    return configure_model(
        copy.deepcopy(model), query_prompt="query: ", document_prompt="passage: "
    )


@pytest.fixture
def prompted_store(tmp_path, prompted):
    path = tmp_path / "prompted"
    with open_store(path, prompted) as store:
        index_documents(store, prompted, corpus(30))
    return path


def client_for(store_dir, model, **config) -> TestClient:
    return TestClient(create_app(LocalDocumentStore(store_dir), model, ServeConfig(**config)))


def openai_client(http) -> openai.OpenAI:
    """OpenAI's client on an in-process server (the TestClient is an httpx.Client)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


def post(client, path, body: dict, **headers):
    """A JSON body as OpenAI's and TEI's clients send it (lone surrogates as \\u escapes)."""
    return client.post(
        path,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json", **headers},
    )


# -- OpenAI's client over loopback -----------------------------------------------------------


def test_openai_client_over_loopback_gets_the_stored_vectors(store_dir, tiny_models, model):
    """The real ``openai`` client against ``densefit serve`` on 127.0.0.1: the embedding of a
    stored document's text, as a document, is its stored vector; float and base64 agree;
    ``usage`` counts the tokens; errors arrive as the client's own exceptions."""
    texts = [d.text for d in corpus(30)[:5]]
    with LocalDocumentStore(store_dir) as store:
        stored = store.vectors([d.id for d in corpus(30)[:5]])
        name = store.model_name
    proc, url = start_server(store_dir, tiny_models / "tiny")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        as_floats = client.embeddings.create(
            input=texts,
            model="anything",
            encoding_format="float",
            extra_body={"input_type": "document"},
        )
        default = client.embeddings.create(input=texts, model="anything")  # base64 on the wire
        np.testing.assert_allclose([d.embedding for d in as_floats.data], stored, atol=1e-5)
        # base64 decodes to the same floats; the tiny model has no prompts, so the default
        # (query) and document embed alike
        np.testing.assert_array_equal(
            [d.embedding for d in default.data], [d.embedding for d in as_floats.data]
        )
        assert [d.index for d in as_floats.data] == list(range(5)) and as_floats.model == name
        tokens = sum(len(ids) for ids in model.tokenizer(texts)["input_ids"])
        assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == tokens
        with pytest.raises(openai.UnprocessableEntityError, match=r"input\[1\]: is empty"):
            client.embeddings.create(input=["fine", " "], model="m")
        broken = httpx.post(
            f"{url}/v1/embeddings", content=b"{", headers={"content-type": "application/json"}
        )
        assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    finally:
        proc.kill()
        proc.wait(10)


def test_api_key_and_limits_in_openais_error_shape(store_dir, model):
    with client_for(
        store_dir, model, api_key="s3cret", max_embed_inputs=3, max_text_chars=40
    ) as http:
        client = openai_client(http)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            client.embeddings.create(input="x", model="m")
        keyed = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=http)
        assert len(keyed.embeddings.create(input="cells", model="m").data) == 1
        with pytest.raises(
            openai.APIStatusError, match="4 input in one request; the limit is 3"
        ) as caught:
            keyed.embeddings.create(input=["a", "b", "c", "d"], model="m")
        assert caught.value.status_code == 413
        with pytest.raises(openai.APIStatusError, match=r"input: has 41 characters") as caught:
            keyed.embeddings.create(input="x" * 41, model="m")
        assert caught.value.status_code == 413
        with pytest.raises(openai.UnprocessableEntityError, match="token arrays are not supported"):
            keyed.embeddings.create(input=[[101, 2000]], model="m")
        r = post(http, "/v1/embeddings", {"input": "x"})  # no key: OpenAI's error object
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["message"]


# -- the prompt rule --------------------------------------------------------------------------


def test_input_type_and_prompt_name_choose_the_stores_prompt(prompted_store, prompted):
    texts = ["cells genes protein", "python kernel socket"]
    query = encode_texts(prompted, texts, prompt_name="query", normalize=True)
    document = encode_texts(prompted, texts, prompt_name="document", normalize=True)
    assert np.abs(query - document).max() > 1e-3  # the prompts change the vectors
    with client_for(prompted_store, prompted) as http:
        client = openai_client(http)

        def v1(**extra):
            data = client.embeddings.create(input=texts, model="m", **extra).data
            return np.array([d.embedding for d in data])

        np.testing.assert_allclose(v1(), query, atol=1e-5)  # the server's default: "query"
        np.testing.assert_allclose(v1(extra_body={"input_type": "query"}), query, atol=1e-5)
        np.testing.assert_allclose(v1(extra_body={"input_type": "document"}), document, atol=1e-5)
        tei = post(http, "/embed", {"inputs": texts, "prompt_name": "document"})
        np.testing.assert_allclose(tei.json(), document, atol=1e-5)
        np.testing.assert_allclose(post(http, "/embed", {"inputs": texts}).json(), query, atol=1e-5)
        wrong = post(http, "/embed", {"inputs": texts, "prompt_name": "passage"})
        assert wrong.status_code == 422 and "prompt_name" in wrong.json()["error"]
        assert wrong.json()["error_type"] == "validation"
        # usage counts the prompt's tokens too
        with_prompt = client.embeddings.create(input=texts, model="m")
        plain = sum(len(ids) for ids in prompted.tokenizer(texts)["input_ids"])
        assert with_prompt.usage.prompt_tokens > plain
    with client_for(prompted_store, prompted, embed_prompt="document") as http:
        data = openai_client(http).embeddings.create(input=texts, model="m").data
        np.testing.assert_allclose([d.embedding for d in data], document, atol=1e-5)
    with pytest.raises(ValueError, match="embed_prompt"):
        ServeConfig(embed_prompt="passage")


# -- /embed (TEI) ------------------------------------------------------------------------------


def test_tei_embed_shape_normalize_and_truncate(tmp_path, model):
    dot = copy.deepcopy(model)
    dot.similarity_fn_name = "dot"
    path = tmp_path / "dot"
    with open_store(path, dot) as store:
        index_documents(store, dot, corpus(10))
    raw = encode_texts(dot, ["cells divide", "rivers"])
    assert np.abs(np.linalg.norm(raw, axis=1) - 1).min() > 0.1  # the tiny model does not normalise
    with client_for(path, dot) as http:
        one = post(http, "/embed", {"inputs": "cells divide"})
        assert one.status_code == 200 and np.shape(one.json()) == (1, 32)
        unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
        np.testing.assert_allclose(
            post(http, "/embed", {"inputs": ["cells divide", "rivers"]}).json(), unit, atol=1e-5
        )
        unnormalised = post(
            http, "/embed", {"inputs": ["cells divide", "rivers"], "normalize": False}
        )
        np.testing.assert_allclose(unnormalised.json(), raw, atol=1e-5)
        # a dot store's /v1/embeddings gives the vectors as the store keeps them: not unit length
        data = (
            openai_client(http).embeddings.create(input=["cells divide", "rivers"], model="m").data
        )
        np.testing.assert_allclose([d.embedding for d in data], raw, atol=1e-5)
        long = " ".join(["cells"] * 100)  # 102 tokens; the tiny model reads 64
        refused = post(http, "/embed", {"inputs": ["fine", long]})
        assert refused.status_code == 413 and refused.json()["error_type"] == "validation"
        assert "102 tokens" in refused.json()["error"] and "truncate" in refused.json()["error"]
        cut = post(http, "/embed", {"inputs": [long], "truncate": True, "normalize": False})
        np.testing.assert_allclose(cut.json(), encode_texts(dot, [long]), atol=1e-5)
        left = post(http, "/embed", {"inputs": "x", "truncation_direction": "Left"})
        assert left.status_code == 422 and "right truncation" in left.json()["error"]
        assert post(http, "/embed", {"inputs": []}).status_code == 422
        assert post(http, "/embed", {"inputs": "x", "unknown": 1}).status_code == 422


# -- dimensions (Matryoshka) -------------------------------------------------------------------


def test_dimensions_cut_a_matryoshka_model_and_are_refused_otherwise(tmp_path, model):
    folder = tmp_path / "matryoshka-model"
    model.save(str(folder))
    path = tmp_path / "store"
    from densefit.models import load_model

    saved = load_model(str(folder))
    with open_store(path, saved) as store:
        index_documents(store, saved, corpus(10))
    texts = ["cells divide", "python kernel"]
    full = encode_texts(saved, texts, normalize=True)
    with client_for(path, saved) as http:  # no densefit_config.json: not Matryoshka-trained
        client = openai_client(http)
        with pytest.raises(openai.UnprocessableEntityError, match="--matryoshka-dims") as refused:
            client.embeddings.create(input=texts, model="m", dimensions=8)
        assert "serve it with `densefit serve --matryoshka`" in str(refused.value)  # the flag
        same = client.embeddings.create(input=texts, model="m", dimensions=32).data
        np.testing.assert_allclose([d.embedding for d in same], full, atol=1e-5)
    (folder / "densefit_config.json").write_text(json.dumps({"matryoshka_dims": [32, 16, 8]}))
    with client_for(path, saved) as http:
        client = openai_client(http)
        cut = client.embeddings.create(input=texts, model="m", dimensions=8).data
        assert all(len(d.embedding) == 8 for d in cut)
        unit = truncate(np.asarray(full), 8)
        unit = unit / np.linalg.norm(unit, axis=1, keepdims=True)
        np.testing.assert_allclose([d.embedding for d in cut], unit, atol=1e-5)
        with pytest.raises(openai.UnprocessableEntityError, match="between 1 and 32"):
            client.embeddings.create(input=texts, model="m", dimensions=33)
    with client_for(path, saved, matryoshka=False) as http:  # the server's setting wins
        with pytest.raises(openai.UnprocessableEntityError):
            openai_client(http).embeddings.create(input=texts, model="m", dimensions=8)


def test_base64_is_little_endian_float32(store_dir, model):
    with client_for(store_dir, model) as http:
        floats = post(http, "/v1/embeddings", {"input": "cells", "encoding_format": "float"}).json()
        packed = post(
            http, "/v1/embeddings", {"input": "cells", "encoding_format": "base64"}
        ).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.float32(floats["data"][0]["embedding"]))
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"


# -- micro-batched with the search queries -----------------------------------------------------


def test_embeddings_and_searches_share_forward_passes(store_dir, model):
    """Concurrent /search and /v1/embeddings requests are embedded in shared batches, and
    each gets what it would have got alone."""
    queries = [f"{a} {b}" for a in WORDS[:4] for b in WORDS[6:9]]  # 12 distinct texts
    with LocalDocumentStore(store_dir) as store:
        want_hits = store.search(encode_texts(model, queries), top_k=3)
    want_vectors = encode_texts(model, queries, normalize=True)
    with client_for(store_dir, model, max_wait_ms=50) as http:
        batcher = http.app.state.batcher
        before, calls = batcher.batches, []
        run_batch = batcher.run_batch
        batcher.run_batch = lambda items: (
            calls.append([type(item).__name__ for item in items]),
            run_batch(items),
        )[1]

        def request(i):
            if i % 2:
                return "search", http.post("/search", json={"query": queries[i], "k": 3})
            return "embed", http.post("/v1/embeddings", json={"input": queries[i]})

        with ThreadPoolExecutor(len(queries)) as pool:
            responses = list(pool.map(request, range(len(queries))))
        batches = batcher.batches - before
    assert batches < len(queries) / 2, batches
    assert sum(len(c) for c in calls) == len(queries)
    assert any({"Query", "EmbedInput"} <= set(c) for c in calls), calls  # mixed batches
    for i, (kind, r) in enumerate(responses):
        assert r.status_code == 200, r.text
        if kind == "search":
            hits = r.json()["results"][0]["hits"]
            assert [h["id"] for h in hits] == [h.id for h in want_hits[i]]
        else:
            got = r.json()["data"][0]["embedding"]
            np.testing.assert_allclose(got, want_vectors[i], atol=1e-5)


def test_a_mixed_batch_embeds_no_bm25_query_and_each_mode_gets_its_own_hits(
    store_dir, model, monkeypatch
):
    """One micro-batch of embedding inputs and dense, BM25 and hybrid queries: every result
    equals that item searched or embedded alone, and the BM25 query is never embedded."""
    from densefit.retrieval.index.request import SearchRequest
    from densefit.serve.app import search_queries
    from densefit.serve.batcher import Query
    from densefit.serve.embeddings import EmbedInput, run_batch

    texts = [f"{WORDS[1]} {WORDS[7]}", f"{WORDS[2]} {WORDS[5]}", f"{WORDS[3]} {WORDS[8]}"]
    items = [
        EmbedInput(texts[0]),
        Query(texts[1], SearchRequest("bm25", 4)),
        Query(texts[0], SearchRequest("dense", 4)),
        Query(texts[2], SearchRequest("hybrid", 4)),
    ]
    with LocalDocumentStore(store_dir) as store:
        results = run_batch(store, model, items, search_queries)
        alone = [
            store.search(None, top_k=4, mode="bm25", query_texts=[texts[1]])[0],
            store.search(encode_texts(model, [texts[0]]), top_k=4)[0],
            store.search(
                encode_texts(model, [texts[2]]), top_k=4, mode="hybrid", query_texts=[texts[2]]
            )[0],
        ]
        assert all(alone), alone  # the words are in the corpus: each mode finds documents
        for got, want in zip(results[1:], alone, strict=True):
            assert [h.id for h in got] == [h.id for h in want]
        np.testing.assert_allclose(results[0].vector, encode_texts(model, [texts[0]])[0], atol=1e-5)
        embedded: list[str] = []

        def counting(model, texts, *args, **kwargs):  # records every text embedded
            embedded.extend(texts)
            return encode_texts(model, texts, *args, **kwargs)

        monkeypatch.setattr("densefit.serve.embeddings.encode_texts", counting)
        monkeypatch.setattr("densefit.retrieval.index.searching.encode_texts", counting)
        again = run_batch(store, model, items, search_queries)
        assert sorted(embedded) == sorted([texts[0], texts[0], texts[2]]), embedded
        embedded.clear()
        alone_bm25 = run_batch(store, model, items[1:2], search_queries)  # a BM25 query alone
        assert embedded == [], embedded
    assert [h.id for h in again[1]] == [h.id for h in alone_bm25[0]] == [h.id for h in alone[0]]


def test_a_failing_text_fails_only_its_own_request(store_dir, model):
    """One request's over-long text (TEI, truncate false) is refused; the request batched
    with it is answered."""
    with client_for(store_dir, model, max_wait_ms=200) as http:
        release = threading.Event()
        run_batch = http.app.state.batcher.run_batch
        http.app.state.batcher.run_batch = lambda items: (release.wait(10), run_batch(items))[1]
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(post, http, "/embed", {"inputs": "warm"})  # holds the worker
            bad = pool.submit(post, http, "/embed", {"inputs": " ".join(["x"] * 100)})
            good = pool.submit(post, http, "/search", {"query": "cells", "k": 2})
            release.set()
            assert first.result(20).status_code == 200
            assert bad.result(20).status_code == 413 and good.result(20).status_code == 200


def test_documents_embedded_through_the_endpoint_can_be_written_back(store_dir, model):
    """An external pipeline embedding documents through /v1/embeddings gets the vectors
    the store itself makes (what a Haystack store over the same model would hold)."""
    docs = [Document("e1", "bread music rivers"), Document("e2", "genes python socket")]
    with client_for(store_dir, model) as http:
        data = (
            openai_client(http)
            .embeddings.create(
                input=[d.text for d in docs], model="m", extra_body={"input_type": "document"}
            )
            .data
        )
        assert (
            http.post(
                "/documents", json={"documents": [{"id": d.id, "text": d.text} for d in docs]}
            ).status_code
            == 200
        )
    with LocalDocumentStore(store_dir) as store:
        np.testing.assert_allclose(
            [d.embedding for d in data], store.vectors(["e1", "e2"]), atol=1e-5
        )
