"""Per-query comparison (densefit.comparison): ranks, hits, summaries, the JSON Lines file,
and `densefit eval --compare` writing it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densefit.comparison import (
    RANK_BUCKETS,
    compare_queries,
    per_query_path,
    rank_bucket,
    read_per_query,
)
from densefit.evaluate import EvalResult, evaluate_run

QRELS = {
    "q1": {"d1": 2, "d2": 1, "d9": 0},  # d9: judged not relevant
    "q2": {"d5": 1},
    "q3": {"d7": 1},
    "q4": {"d4": 1},
}
BASE = {
    "q1": {"d3": 0.9, "d1": 0.8, "d9": 0.7, "d2": 0.1},
    "q2": {"d5": 0.9, "x": 0.5},
    "q3": {"x": 0.9, "y": 0.8},  # d7 not retrieved
    "q4": {"d4": 0.5, "z": 0.4},
}
NEW = {
    "q1": {"d1": 0.9, "d2": 0.85, "d3": 0.5, "d9": 0.1},  # better: both relevant on top
    "q2": {"x": 0.9, "y": 0.8, "d5": 0.7},  # worse: d5 from 1 to 3
    "q3": {"d7": 0.9, "x": 0.2},  # d7 enters the top k
    "q4": {"z": 0.52, "d4": 0.5},  # worse; top hit z unjudged, within 5% of d4
}
METRICS = ["ndcg@10", "mrr@10", "recall@2"]


def results():
    base = evaluate_run(BASE, QRELS, METRICS, name="base")
    new = evaluate_run(NEW, QRELS, METRICS, name="tuned")
    return base, new


def test_rows_hold_ranks_scores_hits_and_the_change():
    base, new = results()
    queries = {"q1": "first", "q2": "second"}
    documents = {"d1": "one", "d3": "three", "x": "ex"}
    comparison = compare_queries(base, new, queries=queries, documents=documents, hits=3)
    rows = {r["query_id"]: r for r in comparison.rows}
    assert comparison.metric == "ndcg@10" and comparison.names == ("base", "tuned")

    q1 = rows["q1"]
    assert q1["query"] == "first" and q1["change"] == "better" and q1["delta"] > 0
    assert q1["relevant"] == [  # judged 0 (d9) is not relevant; by relevance, then id
        {"id": "d1", "relevance": 2, "base_rank": 2, "base_score": 0.8, "new_rank": 1,
         "new_score": 0.9},
        {"id": "d2", "relevance": 1, "base_rank": 4, "base_score": 0.1, "new_rank": 2,
         "new_score": 0.85},
    ]  # fmt: skip
    assert q1["base_hits"] == [
        {"id": "d3", "score": 0.9, "relevance": None},
        {"id": "d1", "score": 0.8, "relevance": 2},
        {"id": "d9", "score": 0.7, "relevance": 0},
    ]
    assert [h["id"] for h in q1["new_hits"]] == ["d1", "d2", "d3"]
    assert (q1["base_best_rank"], q1["new_best_rank"], q1["rank_change"]) == (2, 1, 1)
    assert q1["base_metrics"] == base.per_query["q1"] and q1["new_metrics"] == new.per_query["q1"]

    q2 = rows["q2"]
    assert q2["change"] == "worse" and q2["rank_change"] == -2 and q2["query"] == "second"
    q3 = rows["q3"]  # outside the top k counts as rank k + 1 (k: the longest ranking, 4)
    assert (q3["base_best_rank"], q3["new_best_rank"], q3["rank_change"]) == (None, 1, 4)
    assert q3["relevant"][0]["base_rank"] is None and q3["query"] is None
    assert rank_bucket(q3) == "entered the top k" and rank_bucket(q2) == "down 1-2"
    # Texts: only the documents the rows name, where known; on the summary's hits, not in rows.
    assert comparison.texts == {"d1": "one", "d3": "three", "x": "ex"}
    win = next(w for w in comparison.summary["wins"] if w["query_id"] == "q1")
    assert win["new_top"] == {"id": "d1", "score": 0.9, "relevance": 2, "text": "one"}
    assert win["base_top"]["text"] == "three" and win["query"] == "first"
    assert not any("text" in h for r in comparison.rows for h in r["base_hits"] + r["new_hits"])


def test_possible_missing_labels_are_close_unjudged_top_hits():
    base, new = results()
    comparison = compare_queries(base, new)
    flagged = {r["query_id"] for r in comparison.rows if r["possible_missing_label"]}
    # q4: z (unjudged) 0.52 vs d4 0.5: within 5% of 0.52. q2: x 0.9 vs d5 0.7: not close.
    # q1: the top hit is judged.
    assert flagged == {"q4"}
    assert compare_queries(base, new, close=0.5).summary["possible_missing_labels"][0][
        "query_id"
    ] in ("q2", "q4")
    assert {
        r["query_id"] for r in compare_queries(base, new, close=0.5).rows
        if r["possible_missing_label"]
    } == {"q2", "q4"}  # fmt: skip
    assert not any(r["possible_missing_label"] for r in compare_queries(base, new, close=0).rows)
    (entry,) = comparison.summary["possible_missing_labels"]
    assert entry["hit"] == {"id": "z", "score": 0.52, "relevance": None}
    assert entry["relevant"] == {"id": "d4", "new_rank": 2, "new_score": 0.5}


def test_summary_counts_and_orders_wins_and_losses():
    base, new = results()
    s = compare_queries(base, new, metric="mrr@10").summary
    assert (s["better"], s["same"], s["worse"], s["queries"]) == (2, 0, 2, 4)
    assert s["models"] == {"base": "base", "new": "tuned"}
    assert [w["query_id"] for w in s["wins"]] == ["q3", "q1"]  # +1.0, then +0.5
    assert [w["query_id"] for w in s["losses"]] == ["q2", "q4"]  # -0.667, then -0.5
    assert s["wins"][0]["new_top"] == {"id": "d7", "score": 0.9, "relevance": 1}
    assert list(s["rank_changes"]) == list(RANK_BUCKETS)
    assert sum(s["rank_changes"].values()) == 4
    assert s["rank_changes"]["entered the top k"] == 1 and s["rank_changes"]["up 1-2"] == 1
    assert s["rank_changes"]["down 1-2"] == 2


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**20), k=st.sampled_from([1, 3, 10]))
def test_per_query_values_average_to_the_reported_metrics_and_ranks_agree(seed, k):
    """Exactness: each model's per-query values average to its reported metric, and the
    best relevant rank gives pytrec_eval's MRR and recall (ties ordered as trec_eval)."""
    rng = np.random.default_rng(seed)
    docs = [f"d{i}" for i in range(30)]
    qrels = {}
    runs = ({}, {})
    for q in range(8):
        judged = rng.choice(docs, size=int(rng.integers(1, 6)), replace=False)
        qrels[f"q{q}"] = {d: int(rng.integers(0, 3)) for d in judged}
        for run in runs:
            if rng.random() < 0.9:  # some queries retrieve nothing
                retrieved = rng.choice(docs, size=int(rng.integers(1, 20)), replace=False)
                run[f"q{q}"] = {d: float(np.round(rng.random(), 1)) for d in retrieved}
    metrics = [f"mrr@{k}", f"recall@{k}", f"ndcg@{k}"]
    base, new = (evaluate_run(run, qrels, metrics, name=n) for run, n in zip(runs, "ab"))
    for metric in metrics:
        rows = compare_queries(base, new, metric=metric).rows
        assert np.mean([r["base"] for r in rows]) == pytest.approx(base.metrics[metric])
        assert np.mean([r["new"] for r in rows]) == pytest.approx(new.metrics[metric])
        assert sum(r["delta"] for r in rows) / len(rows) == pytest.approx(
            new.metrics[metric] - base.metrics[metric]
        )
    for row in compare_queries(base, new).rows:
        for role in ("base", "new"):
            best = row[f"{role}_best_rank"]
            mrr = 1 / best if best is not None and best <= k else 0.0
            assert row[f"{role}_metrics"][f"mrr@{k}"] == pytest.approx(mrr)
            ranks = [r[f"{role}_rank"] for r in row["relevant"]]
            found = sum(r is not None and r <= k for r in ranks)
            recall = found / len(ranks) if ranks else 0.0
            assert row[f"{role}_metrics"][f"recall@{k}"] == pytest.approx(recall)


def test_jsonl_reads_with_pandas_and_round_trips(tmp_path):
    pandas = pytest.importorskip("pandas")
    base, new = results()
    comparison = compare_queries(base, new)
    path = comparison.write_jsonl(per_query_path(tmp_path / "eval.json"))
    assert path.name == "eval.per_query.jsonl"
    assert read_per_query(path) == comparison.rows
    frame = pandas.read_json(path, lines=True, dtype={"query_id": str})
    assert list(frame["query_id"]) == ["q1", "q2", "q3", "q4"]
    assert frame["new"].mean() == pytest.approx(new.metrics["ndcg@10"])
    assert list(frame["change"]) == ["better", "worse", "better", "worse"]


def test_saved_results_compare_like_fresh_ones():
    base, new = results()
    saved = [EvalResult.from_dict(json.loads(json.dumps(r.to_dict(per_query=True, rankings=True))))
             for r in (base, new)]  # fmt: skip
    assert compare_queries(*saved).rows == compare_queries(base, new).rows
    bare = EvalResult.from_dict(base.to_dict(per_query=True))  # no rankings kept
    with pytest.raises(ValueError, match="kept no rankings"):
        compare_queries(bare, new)
    with pytest.raises(ValueError, match="different queries"):
        compare_queries(base, evaluate_run(NEW, {"q1": QRELS["q1"]}, METRICS))
    with pytest.raises(ValueError, match="has no map@100"):
        compare_queries(base, new, metric="map@100")


def test_eval_compare_writes_the_per_query_file(tmp_path):
    from test_evaluate import write_beir  # a sibling test module: its BEIR folder writer
    from typer.testing import CliRunner

    from densefit.cli.app import app
    from densefit.testing import tiny_model

    docs = [(f"d{i}", f"topic {i % 5}", f"body text number {i} about {i % 3}") for i in range(24)]
    queries = {f"q{i}": f"topic {i % 5} number {i}" for i in range(0, 24, 3)}
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(0, 24, 3)}
    beir = write_beir(tmp_path / "beir", docs, queries, qrels)
    tiny_model(tmp_path / "a", seed=1)
    tiny_model(tmp_path / "b", seed=2)
    output = tmp_path / "results" / "eval.json"
    args = ["eval", "--dataset", str(beir), "--model", str(tmp_path / "b"), "--compare",
            str(tmp_path / "a"), "--output", str(output), "--no-progress", "--top-k", "5"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "per query (ndcg@10):" in " ".join(result.output.split())
    payload = json.loads(output.read_text())
    rows = read_per_query(tmp_path / "results" / "eval.per_query.jsonl")
    assert payload["per_query_file"].endswith("eval.per_query.jsonl")
    assert [r["query_id"] for r in rows] == sorted(qrels)
    compared, model = payload["results"]  # --compare first: base; --model: new
    for metric, value in model["metrics"].items():
        assert np.mean([r["new_metrics"][metric] for r in rows]) == pytest.approx(value, abs=1e-6)
    for metric, value in compared["metrics"].items():
        assert np.mean([r["base_metrics"][metric] for r in rows]) == pytest.approx(value, abs=1e-6)
    assert rows[0]["query"] == queries[rows[0]["query_id"]]
    assert all(len(r["base_hits"]) == 5 and len(r["new_hits"]) == 5 for r in rows)
    summary = payload["per_query_summary"]
    assert summary["models"] == {"base": compared["name"], "new": model["name"]}
    assert summary["better"] + summary["same"] + summary["worse"] == len(qrels)
