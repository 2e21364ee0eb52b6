"""bench/quality.py resumes by key: a rerun skips finished points and reruns changed ones."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def quality():
    sys.path.insert(0, str(BENCH))
    try:
        import quality

        yield quality
    finally:
        sys.path.remove(str(BENCH))


def _settings(quality, **changes):
    args = argparse.Namespace(
        model="all-MiniLM-L6-v2",
        max_seq_length=64,
        epochs=1,
        learning_rate=2e-5,
        nfcorpus_pairs=1024,
        cache_from=1024,
    )
    for name, value in changes.items():
        setattr(args, name, value)
    return quality.settings_of(args)


def test_key_changes_with_every_training_setting_but_the_base_key_does_not(quality):
    base = _settings(quality)
    key = quality.point_key("nfcorpus", 64, 42, base)
    for change in [
        dict(max_seq_length=128),
        dict(epochs=2),
        dict(learning_rate=1e-5),
        dict(nfcorpus_pairs=2048),
        dict(cache_from=64),
    ]:
        other = _settings(quality, **change)
        assert quality.point_key("nfcorpus", 64, 42, other) != key, change
    assert quality.point_key("nfcorpus", 64, 43, base) != key
    assert quality.point_key("nfcorpus", 256, 42, base) != key
    assert quality.point_key("scifact", 64, 42, base) != key
    # The base model is not trained: only the model and the length decide its metrics.
    assert quality.point_key(
        "nfcorpus", 0, None, _settings(quality, epochs=3)
    ) == quality.point_key("nfcorpus", 0, None, base)
    assert quality.point_key(
        "nfcorpus", 0, None, _settings(quality, max_seq_length=128)
    ) != quality.point_key("nfcorpus", 0, None, base)


def test_rerun_skips_finished_points_only(quality, tmp_path):
    settings = _settings(quality)
    specs = quality.plan(["scifact", "nfcorpus"], [16, 64, 256, 1024], [42, 43], settings, tmp_path)
    assert len(specs) == 2 + 2 * 4 * 2
    assert len({s["key"] for s in specs}) == len(specs)
    # Bases first, then the extremes of the first seed, then the middle, then other seeds.
    assert [(s["dataset"], s["batch_size"]) for s in specs[:4]] == [
        ("scifact", 0),
        ("nfcorpus", 0),
        ("scifact", 16),
        ("nfcorpus", 16),
    ]
    assert [s["batch_size"] for s in specs[4:10:2]] == [1024, 256, 64]
    assert {s["seed"] for s in specs[10:]} == {43}
    assert [s["memory"] for s in specs[2:10:2]] == ["plain", "cache", "plain", "plain"]

    jsonl = tmp_path / "quality.jsonl"
    lines = [
        json.dumps({**specs[0], "status": "ok"}),
        json.dumps({**specs[2], "status": "failed"}),  # a failed point is run again
        json.dumps({**specs[3], "status": "ok"}),
        '{"key": "nfcorpus|bs1024',  # an interrupted write
    ]
    jsonl.write_text("\n".join(lines) + "\n")
    done = quality.finished(jsonl)
    assert set(done) == {specs[0]["key"], specs[3]["key"]}
    todo = quality.pending(specs, done)
    assert [s["key"] for s in todo] == [s["key"] for s in specs if s["key"] not in done]
    assert specs[2] in todo

    # Another learning rate is another experiment: nothing of it is finished.
    other = quality.plan(["scifact"], [16], [42], _settings(quality, learning_rate=1e-5), tmp_path)
    assert quality.pending(other, done) == [other[1]]  # its base is shared, its bs16 is not


def test_nfcorpus_subsample_is_seeded(quality):
    from densefit.data.corpus import BeirDataset
    from densefit.data.types import Document, ReadReport

    corpus = {f"d{i}": Document(f"d{i}", f"doc {i}") for i in range(50)}
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(50)}
    judgments = [quality_judgment(q, d) for q, docs in qrels.items() for d in docs]
    beir = BeirDataset(corpus, {q: f"query {q}" for q in qrels}, qrels, judgments, ReadReport("x"))
    first = quality.training_rows(beir, 10, 0)
    assert [r.query for r in first] == [r.query for r in quality.training_rows(beir, 10, 0)]
    assert [r.query for r in first] != [r.query for r in quality.training_rows(beir, 10, 1)]
    assert len(quality.training_rows(beir, None, 0)) == 50
    assert len(quality.training_rows(beir, 500, 0)) == 50


def quality_judgment(query_id: str, doc_id: str):
    from densefit.data.corpus import Judgment

    return Judgment(f"qrels/train.tsv:{query_id}", query_id, doc_id, 1)
