"""Search modes (dense, bm25, hybrid) through the Python API: search_batch, Retriever,
evaluation by mode; and a quantized store behind them."""

from __future__ import annotations

import numpy as np
import pytest

from densefit.api import Retriever
from densefit.evaluate import evaluate, evaluate_run
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.fusion import Fusion
from densefit.retrieval.index.searching import search, search_batch
from densefit.testing.conformance import make_corpus, with_meta

QUERIES = ["cells and genes", "python function return", "vaccine dose mice"]
EN = {"field": "meta.lang", "operator": "==", "value": "en"}


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    from densefit.testing import tiny_model

    retriever = Retriever(tiny_model(tmp_path_factory.mktemp("tiny")))
    retriever.index(with_meta(make_corpus(50)))
    return retriever


def _pairs(results):
    return [[(h.id, round(h.score, 5)) for h in hits] for hits in results]


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid"])
@pytest.mark.parametrize("filters", [None, EN])
def test_retriever_modes_equal_the_store_search(retriever, mode, filters):
    fusion = Fusion(method="weighted", alpha=0.6) if mode == "hybrid" else None
    got = retriever.retrieve_batch(QUERIES, top_k=6, filters=filters, mode=mode, fusion=fusion)
    embeddings = encode_texts(retriever.model, QUERIES, prompt_name="query")
    want = retriever.store.search(
        None if mode == "bm25" else embeddings,
        6,
        filters=filters,
        mode=mode,
        query_texts=QUERIES,
        fusion=fusion,
    )
    assert _pairs(got) == _pairs(want) and all(got)
    one = retriever.retrieve(QUERIES[1], top_k=6, filters=filters, mode=mode, fusion=fusion)
    assert _pairs([one]) == _pairs(want[1:2])
    if filters:
        assert all(h.meta["lang"] == "en" for hits in got for h in hits)
    scaled = retriever.retrieve_batch(QUERIES, top_k=6, mode=mode, scale_score=True)
    assert all(0 <= h.score <= 1 for hits in scaled for h in hits)


def test_the_modes_rank_differently(retriever):
    by_mode = {
        mode: [h.id for h in retriever.retrieve(QUERIES[0], top_k=10, mode=mode)]
        for mode in ("dense", "bm25", "hybrid")
    }
    assert by_mode["dense"] != by_mode["bm25"]
    assert by_mode["hybrid"] not in (by_mode["dense"], by_mode["bm25"])


def test_bm25_needs_no_model_and_bad_modes_are_one_clear_error(retriever):
    hits = search(retriever.store, None, "banana apple", mode="bm25")
    assert hits and all("banana" in h.text or "apple" in h.text for h in hits)
    with pytest.raises(ValueError, match="mode must be one of dense, bm25, hybrid"):
        search_batch(retriever.store, retriever.model, ["x"], mode="lexical")
    with pytest.raises(ValueError, match="hybrid search embeds the queries"):
        search(retriever.store, None, "x", mode="hybrid")


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid"])
def test_evaluation_by_mode_scores_the_modes_run(retriever, mode):
    docs = retriever.store.filter_documents()
    queries = {f"q{i}": docs[i].text for i in range(0, 50, 5)}
    qrels = {f"q{i}": {docs[i].id: 1} for i in range(0, 50, 5)}
    result = retriever.evaluate(queries, qrels, metrics=["ndcg@10", "recall@20"], mode=mode)
    found = retriever.retrieve_batch(list(queries.values()), top_k=20, mode=mode)
    run = {q: {h.id: h.score for h in hits} for q, hits in zip(queries, found, strict=True)}
    assert result.metrics == evaluate_run(run, qrels, ["ndcg@10", "recall@20"]).metrics
    assert result.info["mode"] == mode
    if mode == "bm25":  # a document's own text finds it by its words
        assert result.metrics["recall@20"] == 1.0
        alone = evaluate(  # a BM25 evaluation of a store runs no model
            None, retriever.store, queries=queries, qrels=qrels, metrics=["ndcg@10"], mode=mode
        )
        assert alone.metrics["ndcg@10"] == result.metrics["ndcg@10"]


def test_evaluate_a_beir_folder_by_mode_on_a_quantized_store(tmp_path):
    import json

    from densefit.testing import tiny_model

    folder = tmp_path / "beir"
    (folder / "qrels").mkdir(parents=True)
    docs = make_corpus(40)
    with open(folder / "corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"_id": d.id, "text": d.text}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:  # each query is its document's text
        for i in range(0, 40, 4):
            f.write(json.dumps({"_id": f"q{i}", "text": docs[i].text}) + "\n")
    qrels = "".join(f"q{i}\t{docs[i].id}\t1\n" for i in range(0, 40, 4))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + qrels)
    model = tiny_model(tmp_path / "tiny")
    results = {
        (mode, vectors): evaluate(model, folder, mode=mode, vectors=vectors, metrics=["mrr@10"])
        for mode in ("dense", "hybrid")
        for vectors in ("float32", "int8", "binary")
    }
    for (mode, vectors), result in results.items():
        assert result.info["vectors"] == vectors and result.info["mode"] == mode
        assert result.metrics["mrr@10"] == pytest.approx(1.0)  # each query is its document
    assert np.isfinite(results[("hybrid", "binary")].metrics["mrr@10"])
