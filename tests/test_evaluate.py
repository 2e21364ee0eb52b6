"""Metrics come from pytrec_eval: cross-checked on hand-made runs, random runs, and a BEIR folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import pytrec_eval
from hypothesis import given, settings
from hypothesis import strategies as st

from densefit.evaluate import (
    DEFAULT_METRICS,
    EvalResult,
    compare_results,
    evaluate,
    evaluate_run,
    format_markdown,
    format_table,
    paired_randomization_test,
)

QRELS = {
    "q1": {"d1": 2, "d2": 1, "d9": 0},
    "q2": {"d5": 1},
    "q3": {"d7": 1, "d8": 2},
}
RUN = {
    "q1": {"d3": 0.9, "d1": 0.8, "d9": 0.7, "d2": 0.1},
    "q2": {f"x{i}": 1.0 - i / 100 for i in range(10)} | {"d5": 0.05},  # relevant at rank 11
    "q3": {"d8": 0.5, "d7": 0.4},
}


def pytrec(run, qrels, measures):
    return pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(run)


def test_metrics_equal_pytrec_eval_per_query_and_mean():
    result = evaluate_run(RUN, QRELS)
    reference = pytrec(RUN, QRELS, {"ndcg_cut.10", "recall.10,100", "map_cut.100"})
    names = {
        "ndcg@10": "ndcg_cut_10",
        "recall@10": "recall_10",
        "recall@100": "recall_100",
        "map@100": "map_cut_100",
    }
    for ours, theirs in names.items():
        for query in QRELS:
            assert result.per_query[query][ours] == pytest.approx(reference[query][theirs])
        assert result.metrics[ours] == pytest.approx(np.mean([reference[q][theirs] for q in QRELS]))
    assert set(result.metrics) == set(DEFAULT_METRICS) and result.n_queries == 3


def test_hand_computed_values():
    result = evaluate_run(RUN, QRELS)
    # q1: relevant docs at ranks 2 (gain 2) and 4 (gain 1); ideal order gains 2, 1.
    dcg = 2 / np.log2(3) + 1 / np.log2(5)
    idcg = 2 / np.log2(2) + 1 / np.log2(3)
    assert result.per_query["q1"]["ndcg@10"] == pytest.approx(dcg / idcg, abs=1e-6)
    assert result.per_query["q1"]["mrr@10"] == pytest.approx(0.5)
    assert result.per_query["q1"]["map@100"] == pytest.approx((1 / 2 + 2 / 4) / 2)
    # q2: the only relevant document is 11th: outside every @10 metric, inside @100.
    assert result.per_query["q2"]["mrr@10"] == 0.0
    assert (
        result.per_query["q2"]["recall@10"] == 0.0 and result.per_query["q2"]["recall@100"] == 1.0
    )
    assert pytrec(RUN, QRELS, {"recip_rank"})["q2"]["recip_rank"] == pytest.approx(1 / 11)
    assert result.per_query["q3"]["ndcg@10"] == pytest.approx(1.0)
    assert result.metrics["mrr@10"] == pytest.approx((0.5 + 0 + 1) / 3)


def test_mrr_cut_breaks_ties_like_trec_eval():
    # Eleven documents tied; trec_eval ranks ties by document id, descending.
    run = {"q": {f"d{i:02d}": 1.0 for i in range(11)}}
    for relevant, rank in (("d10", 1), ("d01", 10), ("d00", 11)):
        qrels = {"q": {relevant: 1}}
        expected = 1 / rank if rank <= 10 else 0.0
        assert evaluate_run(run, qrels, ["mrr@10"]).metrics["mrr@10"] == pytest.approx(expected)
        full = pytrec(run, qrels, {"recip_rank"})["q"]["recip_rank"]
        assert full == pytest.approx(1 / rank)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    n_docs=st.integers(1, 30),
    k=st.sampled_from([1, 3, 5, 10]),
)
def test_random_runs_agree_with_pytrec_eval(seed, n_docs, k):
    rng = np.random.default_rng(seed)
    docs = [f"d{i}" for i in range(40)]
    qrels, run = {}, {}
    for q in range(5):
        judged = rng.choice(docs, size=int(rng.integers(1, 6)), replace=False)
        qrels[f"q{q}"] = {d: int(rng.integers(0, 3)) for d in judged}
        retrieved = rng.choice(docs, size=n_docs, replace=False)
        run[f"q{q}"] = {d: float(np.round(rng.random(), 1)) for d in retrieved}  # many ties
    metrics = [f"ndcg@{k}", f"recall@{k}", f"map@{k}", f"precision@{k}", f"mrr@{k}"]
    ours = evaluate_run(run, qrels, metrics)
    measures = {f"ndcg_cut.{k}", f"recall.{k}", f"map_cut.{k}", f"P.{k}"}
    reference = pytrec(run, qrels, measures)
    cut = {
        q: dict(sorted(d.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:k])
        for q, d in run.items()
    }
    reciprocal = pytrec(cut, qrels, {"recip_rank"})
    for q in qrels:
        got = ours.per_query[q]
        if q in reference:
            assert got[f"ndcg@{k}"] == pytest.approx(reference[q][f"ndcg_cut_{k}"])
            assert got[f"recall@{k}"] == pytest.approx(reference[q][f"recall_{k}"])
            assert got[f"map@{k}"] == pytest.approx(reference[q][f"map_cut_{k}"])
            assert got[f"precision@{k}"] == pytest.approx(reference[q][f"P_{k}"])
            assert got[f"mrr@{k}"] == pytest.approx(reciprocal[q]["recip_rank"])
        # Independent of pytrec_eval: the first relevant document in trec order, within k.
        ranked = [d for d, _ in sorted(run[q].items(), key=lambda kv: (kv[1], kv[0]), reverse=True)]
        first = next((i for i, d in enumerate(ranked[:k]) if qrels[q].get(d, 0) > 0), None)
        assert got[f"mrr@{k}"] == pytest.approx(0.0 if first is None else 1 / (first + 1))


def test_judged_queries_without_results_count_as_zero():
    run = {"q1": RUN["q1"], "q3": RUN["q3"]}  # q2 got no results
    result = evaluate_run(run, QRELS, ["ndcg@10"])
    assert result.missing_queries == ["q2"] and result.n_queries == 3
    reference = pytrec(run, QRELS, {"ndcg_cut.10"})
    assert set(reference) == {"q1", "q3"}  # pytrec_eval alone would average over two
    assert result.metrics["ndcg@10"] == pytest.approx(
        (reference["q1"]["ndcg_cut_10"] + reference["q3"]["ndcg_cut_10"]) / 3
    )


def test_identical_ids_are_ignored_like_beir():
    run = {"q1": {"q1": 9.0, "d1": 1.0}}
    qrels = {"q1": {"d1": 1}}
    assert evaluate_run(run, qrels, ["mrr@10"]).metrics["mrr@10"] == 1.0
    kept = evaluate_run(run, qrels, ["mrr@10"], ignore_identical_ids=False)
    assert kept.metrics["mrr@10"] == 0.5


def test_bad_metric_names_explain():
    with pytest.raises(ValueError, match="ndcg@K, mrr@K"):
        evaluate_run(RUN, QRELS, ["ndcg10"])
    with pytest.raises(ValueError, match="qrels are empty"):
        evaluate_run(RUN, {}, ["ndcg@10"])


def test_randomization_test_agrees_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    a = rng.random(12)
    b = a + rng.normal(0.08, 0.1, size=12)
    ours = paired_randomization_test(a, b, n_resamples=20_000)
    theirs = stats.permutation_test(
        (a, b), lambda x, y: np.mean(y - x), permutation_type="samples", n_resamples=np.inf
    ).pvalue
    assert ours == pytest.approx(theirs, abs=0.01)
    assert paired_randomization_test(a, a) == 1.0


def test_compare_and_tables():
    base = evaluate_run(RUN, QRELS, name="base")
    better = {q: dict(docs) for q, docs in RUN.items()}
    better["q2"]["d5"] = 2.0
    tuned = evaluate_run(better, QRELS, name="tuned")
    comparison = compare_results(base, tuned)
    assert comparison["mrr@10"]["wins"] == 1 and comparison["mrr@10"]["losses"] == 0
    assert comparison["mrr@10"]["delta"] == pytest.approx(1 / 3)
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(format_table([base, tuned], title="t"))
    text = console.export_text()
    assert "tuned" in text and "+0.3333" in text and "3 queries" in text
    assert format_markdown([base, tuned]).splitlines()[0] == "| metric | base | tuned |"
    assert json.loads(json.dumps(tuned.to_dict(per_query=True)))["per_query"]["q2"]["mrr@10"] == 1.0


def write_beir(folder, docs, queries, qrels):
    folder.mkdir(parents=True)
    with open(folder / "corpus.jsonl", "w") as fh:
        for doc_id, title, text in docs:
            fh.write(json.dumps({"_id": doc_id, "title": title, "text": text}) + "\n")
    with open(folder / "queries.jsonl", "w") as fh:
        for query_id, text in queries.items():
            fh.write(json.dumps({"_id": query_id, "text": text}) + "\n")
    (folder / "qrels").mkdir()
    lines = ["query-id\tcorpus-id\tscore"]
    lines += [f"{q}\t{d}\t{s}" for q, docs_ in qrels.items() for d, s in docs_.items()]
    (folder / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture
def beir_folder(tmp_path):
    from densefit.testing.conformance import make_corpus

    docs = [(d.id, d.title, d.text[len(d.title) + 1 :]) for d in make_corpus(40)]
    # Each query is exactly its document's text: a perfect retriever scores 1.0 everywhere.
    queries = {f"q{i}": f"{docs[i][1]} {docs[i][2]}" for i in range(0, 40, 4)}
    qrels = {f"q{i}": {docs[i][0]: 1} for i in range(0, 40, 4)}
    return write_beir(tmp_path / "beir", docs, queries, qrels)


def test_evaluate_beir_end_to_end(tiny, beir_folder, tmp_path):
    result = evaluate(tiny, beir_folder, split="test")
    assert result.n_queries == 10 and not result.missing_queries
    assert result.metrics["ndcg@10"] == pytest.approx(1.0)
    assert result.metrics["recall@100"] == 1.0
    assert result.info["index"]["added"] == 40 and result.info["split"] == "test"
    # With store_dir the index is kept and reused.
    evaluate(tiny, beir_folder, store_dir=tmp_path / "kept", metrics=["mrr@10"])
    again = evaluate(tiny, beir_folder, store_dir=tmp_path / "kept", metrics=["mrr@10"])
    assert again.info["index"]["unchanged"] == 40 and again.metrics == {"mrr@10": 1.0}


def test_evaluate_beir_names_a_missing_split(tiny, beir_folder):
    with pytest.raises(FileNotFoundError, match="dev.tsv: no such file; the splits here are test"):
        evaluate(tiny, beir_folder, split="dev")


def test_eval_result_json_roundtrip():
    result = EvalResult("m", {"ndcg@10": 0.5}, {"q": {"ndcg@10": 0.5}}, n_queries=1)
    assert json.loads(json.dumps(result.to_dict()))["metrics"] == {"ndcg@10": 0.5}


def reference_metrics(ranking: dict[str, float], judged: dict[str, int], k: int) -> dict:
    """nDCG, recall, precision, MAP and MRR at ``k`` of one query, from their definitions
    (numpy, no pytrec_eval): documents in trec_eval's order (score, then id, descending),
    linear gains (the relevance grade), the ideal ranking from every judged document, AP
    divided by all relevant documents, P by k."""
    ranked = [d for d, _ in sorted(ranking.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)]
    grades = np.array([max(judged.get(d, 0), 0) for d in ranked[:k]], dtype=float)
    hits = grades > 0
    relevant = sum(g > 0 for g in judged.values())
    discount = 1 / np.log2(np.arange(2, k + 2))
    ideal = np.sort([g for g in judged.values() if g > 0])[::-1][:k]
    dcg, idcg = (grades * discount[: len(grades)]).sum(), (ideal * discount[: len(ideal)]).sum()
    precision_at = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    first = np.flatnonzero(hits)
    return {
        f"ndcg@{k}": dcg / idcg if idcg else 0.0,
        f"recall@{k}": hits.sum() / relevant if relevant else 0.0,
        f"precision@{k}": hits.sum() / k,
        f"map@{k}": precision_at[hits].sum() / relevant if relevant else 0.0,
        f"mrr@{k}": 1 / (first[0] + 1) if len(first) else 0.0,
    }


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    n_docs=st.integers(0, 30),
    k=st.sampled_from([1, 3, 5, 10, 100]),
)
def test_random_runs_agree_with_the_metric_definitions(seed, n_docs, k):
    """evaluate_run against an independent reference: every query of the qrels (judged
    grades 0-3, some without a relevant or any retrieved document), per query and mean."""
    rng = np.random.default_rng(seed)
    docs = [f"d{i}" for i in range(40)]
    qrels, run = {}, {}
    for q in range(6):
        judged = rng.choice(docs, size=int(rng.integers(1, 8)), replace=False)
        qrels[f"q{q}"] = {d: int(rng.integers(0, 4)) for d in judged}
        if q < 5:  # q5 retrieves nothing
            retrieved = rng.choice(docs, size=n_docs, replace=False)
            run[f"q{q}"] = {d: float(np.round(rng.random(), 1)) for d in retrieved}
    metrics = [f"ndcg@{k}", f"recall@{k}", f"precision@{k}", f"map@{k}", f"mrr@{k}"]
    ours = evaluate_run(run, qrels, metrics)
    reference = {q: reference_metrics(run.get(q, {}), qrels[q], k) for q in qrels}
    for q in qrels:
        for metric in metrics:
            assert ours.per_query[q][metric] == pytest.approx(reference[q][metric], abs=1e-6), (
                q, metric
            )  # fmt: skip
    for metric in metrics:
        mean = np.mean([reference[q][metric] for q in qrels])
        assert ours.metrics[metric] == pytest.approx(mean, abs=1e-6)


@pytest.mark.parametrize("engine", ["embedded", "qdrant", "postgresql"])
def test_eval_results_name_the_store_target(engine, new_target, tiny, beir_folder):
    """A store's evaluation records where the store lives (folder, qdrant: target or
    PostgreSQL URL, its password masked), on every engine."""
    from densefit.data.corpus import load_beir
    from densefit.evaluate import store_target
    from densefit.retrieval.index import index_documents, open_store

    beir = load_beir(beir_folder, "test")
    target = new_target(engine)
    with open_store(target, tiny) as store:
        index_documents(store, tiny, beir.corpus.values())
        expected = store_target(store)
    result = evaluate(tiny, target, queries=beir.queries, qrels=beir.qrels, metrics=["mrr@10"])
    assert result.info["store"] == expected and target.rsplit("/", 1)[-1] in expected
    kept = evaluate(tiny, beir_folder, store_dir=target, metrics=["mrr@10"])
    assert kept.info["store"] == expected


def test_the_store_target_masks_a_password():
    from densefit.evaluate import store_target

    class Store:
        location = "postgresql://densefit:s3cret@db.example:5432/search/docs"

    assert store_target(Store()) == "postgresql://densefit:***@db.example:5432/search/docs"
