"""``densefit serve --max-batch-tokens``: micro-batches capped by the sum of their texts'
tokens as well as by count, a text over the budget served alone, the texts tokenized once
(counted before batching, embedded from the same token ids), results equal to the unbatched
path, and the option's refusals."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from test_serve import WORDS, client_for, corpus  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from densefit.cli.app import app as cli_app  # noqa: E402
from densefit.errors import OptionError  # noqa: E402
from densefit.retrieval.encode import TextTokens, encode_texts, tokenize_texts  # noqa: E402
from densefit.retrieval.index import LocalDocumentStore, index_documents, open_store  # noqa: E402
from densefit.serve.batcher import MicroBatcher, Query  # noqa: E402
from densefit.serve.config import ServeConfig  # noqa: E402


@pytest.fixture
def store_dir(tmp_path, model):
    path = tmp_path / "store"
    with open_store(path, model) as store:
        index_documents(store, model, corpus(40))
    return path


def true_tokens(model, text: str) -> int:
    """The tokens a forward pass reads for ``text``, counted here with the model's own
    tokenizer (not with what the server measured)."""
    ids = model.tokenizer(text, truncation=True, max_length=model.max_seq_length)["input_ids"]
    return len(ids)


# -- the batcher -------------------------------------------------------------------------------


def test_batches_never_exceed_the_token_budget_and_keep_the_order():
    """Queries queued at once are cut into batches of at most the budget (a query over it
    alone), in arrival order, nothing dropped or reordered."""
    costs = [3, 4, 2, 9, 1, 1, 12, 5, 5, 5, 0, 7, 2]  # 12 > budget; 0: a BM25 query
    budget = 10

    def measure(items):
        for item in items:
            item.tokens = TextTokens(item.text, int(item.text.split(":")[1]))

    batches: list[list[str]] = []

    def run_batch(items):
        batches.append([item.text for item in items])
        return [item.text for item in items]

    async def demo():
        batcher = MicroBatcher(
            run_batch, max_wait=0.2, workers=1, max_batch_tokens=budget, measure=measure
        )
        await batcher.start()
        queries = [Query(f"q{i}:{c}") for i, c in enumerate(costs)]
        out = await batcher.search(queries)
        await batcher.stop()
        return out

    texts = [f"q{i}:{c}" for i, c in enumerate(costs)]
    assert asyncio.run(demo()) == texts  # every query answered with its own result
    assert [t for batch in batches for t in batch] == texts  # in order, none twice
    cost = {t: int(t.split(":")[1]) for t in texts}
    for batch in batches:
        assert sum(cost[t] for t in batch) <= budget or len(batch) == 1, batches
    assert ["q6:12"] in batches  # over the budget by itself: a batch of its own
    # full batches: the next query would have taken each over the budget
    for batch, after in zip(batches, batches[1:], strict=False):
        assert sum(cost[t] for t in batch) + cost[after[0]] > budget, batches


def test_the_token_budget_is_checked():
    with pytest.raises(ValueError, match="max_batch_tokens must be at least 1, got 0"):
        MicroBatcher(lambda items: items, max_batch_tokens=0)


# -- the server ----------------------------------------------------------------------------


def test_served_batches_stay_within_the_budget_and_answer_as_unbatched(store_dir, model):
    """Concurrent /search and /v1/embeddings requests of many lengths, queued while the one
    worker is busy: every batch the batcher forms holds at most the budget's tokens (counted
    here by the tokenizer) unless it is one text, and each request gets what it would get
    alone."""
    budget = 24
    rng = np.random.default_rng(0)
    words = ["cells", "genes", "python", "protein", "kernel", "memory"]  # one token each
    texts = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(1, 12, size=20)]
    texts.append(" ".join(words * 5))  # over the budget alone
    long_tokens = true_tokens(model, texts[-1])
    assert long_tokens > budget
    want_hits = None
    with LocalDocumentStore(store_dir) as store:
        want_hits = store.search(encode_texts(model, texts), top_k=3)
    want_vectors = encode_texts(model, texts, normalize=True)
    batched: list[list[str]] = []
    with client_for(
        store_dir, model, max_wait_ms=100, query_workers=1, max_batch_tokens=budget
    ) as http:
        batcher = http.app.state.batcher
        release = threading.Event()
        run_batch = batcher.run_batch

        def recording(items):
            release.wait(20)
            batched.append([item.text for item in items])
            return run_batch(items)

        batcher.run_batch = recording

        def request(i):
            if i < 0:
                return http.post("/search", json={"query": "warm", "k": 1})  # holds the worker
            if i % 2:
                return http.post("/search", json={"query": texts[i], "k": 3})
            return http.post("/v1/embeddings", json={"input": texts[i]})

        with ThreadPoolExecutor(len(texts) + 1) as pool:
            first = pool.submit(request, -1)
            responses = [pool.submit(request, i) for i in range(len(texts))]
            threading.Timer(0.5, release.set).start()  # the others queue meanwhile
            assert first.result(30).status_code == 200
            responses = [r.result(30) for r in responses]
    batches = [[true_tokens(model, text) for text in batch] for batch in batched]
    assert sum(len(b) for b in batches) == len(texts) + 1
    for batch in batches:
        assert sum(batch) <= budget or len(batch) == 1, batches
    assert [long_tokens] in batches  # the long text ran alone
    assert sum(len(b) > 1 for b in batches) >= 2, batches  # ... and the others shared passes
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        if i % 2:
            hits = r.json()["results"][0]["hits"]
            assert [h["id"] for h in hits] == [h.id for h in want_hits[i]]
            np.testing.assert_allclose(
                [h["score"] for h in hits], [h.score for h in want_hits[i]], atol=1e-5
            )
        else:
            vector = r.json()["data"][0]["embedding"]
            np.testing.assert_allclose(vector, want_vectors[i], atol=1e-5)


def test_a_text_over_the_budget_is_served_alone(store_dir, model):
    long = " ".join(["cells", "genes", "python"] * 6)
    assert 8 < true_tokens(model, long) < model.max_seq_length  # TEI refuses longer ones
    with client_for(store_dir, model, max_batch_tokens=8) as http:
        found = http.post("/search", json={"query": long, "k": 3})
        embedded = http.post("/v1/embeddings", json={"input": [long, "cells"]})
        tei = http.post("/embed", json={"inputs": long, "normalize": False})
    assert found.status_code == 200 and embedded.status_code == 200, embedded.text
    want = exact_hits(store_dir, model, long)
    assert [h["id"] for h in found.json()["results"][0]["hits"]] == [h.id for h in want]
    vectors = encode_texts(model, [long, "cells"], normalize=True)
    got = [d["embedding"] for d in embedded.json()["data"]]
    np.testing.assert_allclose(got, vectors, atol=1e-5)
    assert embedded.json()["usage"]["prompt_tokens"] == true_tokens(model, long) + 3
    np.testing.assert_allclose(tei.json()[0], encode_texts(model, [long])[0], atol=1e-5)


def exact_hits(store_dir, model, query):
    with LocalDocumentStore(store_dir) as store:
        return store.search(encode_texts(model, [query]), top_k=3)[0]


def test_each_text_is_tokenized_once(store_dir, model, monkeypatch):
    """The server counts a text's tokens before batching and the forward pass embeds those
    token ids: one tokenizer call per request, not two."""
    import densefit.retrieval.encode as encode

    with client_for(store_dir, model) as http:
        assert http.post("/search", json={"query": "warm up", "k": 1}).status_code == 200
        calls: list[list[str]] = []
        tokenize = encode._tokenize
        monkeypatch.setattr(
            encode,
            "_tokenize",
            lambda tok, texts: (calls.append(list(texts)), tokenize(tok, texts))[1],
        )
        assert http.post("/search", json={"query": ["cells genes", "python"]}).status_code == 200
        assert calls == [["cells genes", "python"]], calls
        calls.clear()
        assert http.post("/v1/embeddings", json={"input": ["rivers bread"]}).status_code == 200
        assert calls == [["rivers bread"]], calls


def test_reused_token_ids_embed_exactly_as_tokenizing_again(model):
    """encode_texts(tokens=...) gives the same vectors as tokenizing afresh, with prompts and
    duplicates; token ids made for another text or prompt are not used."""
    import copy

    from densefit.retrieval.encode import configure_model

    prompted = configure_model(copy.deepcopy(model), query_prompt="query: ")
    texts = ["cells genes", "python", "cells genes", " ".join(WORDS * 8)]
    for m in (model, prompted):
        tokens = tokenize_texts(m, texts, prompt_name="query")
        plain = encode_texts(m, texts, prompt_name="query")
        np.testing.assert_array_equal(
            encode_texts(m, texts, prompt_name="query", tokens=tokens), plain
        )
    wrong = tokenize_texts(prompted, texts)  # made without the prompt: not reused
    np.testing.assert_array_equal(
        encode_texts(prompted, texts, prompt_name="query", tokens=wrong),
        encode_texts(prompted, texts, prompt_name="query"),
    )
    assert [t.count for t in tokenize_texts(prompted, texts[:2], prompt_name="query")] == [
        true_tokens(prompted, "query: cells genes"),
        true_tokens(prompted, "query: python"),
    ]


# -- the option ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -5])
def test_a_bad_budget_is_one_line_and_exit_2(tmp_path, bad):
    with pytest.raises(OptionError, match=rf"^max_batch_tokens must be >= 1, got {bad}$"):
        ServeConfig(max_batch_tokens=bad)
    result = CliRunner().invoke(
        cli_app, ["serve", "--store", str(tmp_path / "s"), "--max-batch-tokens", str(bad)]
    )
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.output
    assert lines == [f"error: --max-batch-tokens must be >= 1, got {bad}"], result.stderr
