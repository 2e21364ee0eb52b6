"""Hugging Face datasets in: a Dataset, a DatasetDict split, a save_to_disk folder and Parquet
shard folders, read like files (same columns, same source:row errors), the rows kept in
Arrow (issue 23)."""

from __future__ import annotations

import gc
import json
import tracemalloc

import pytest
import torch

from densefit import BadRowError, Retriever, TrainConfig, train
from densefit.data.arrow import ArrowExamples, parquet_shards
from densefit.data.readers import read_training_data
from densefit.data.sources import load_training_data
from densefit.testing import tiny_model

datasets = pytest.importorskip("datasets")

ROWS = [
    {
        "anchor": f"what is the cell {i}",
        "positive": f"the protein gene {i}",
        "negative": [f"python function {i}"] if i % 2 else [],
        "source": "ignored",  # a column densefit does not read
    }
    for i in range(8)
]


def as_file_rows(rows: list[dict]) -> list[tuple]:
    return [(r["anchor"], r["positive"], tuple(r["negative"])) for r in rows]


def texts(examples) -> list[tuple]:
    return [(e.query, e.positive, e.negatives) for e in examples]


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_dataset_trains_exactly_like_the_same_rows_from_a_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = TrainConfig(batch_size=4, epochs=2, learning_rate=1e-3, show_progress=False)
    from_file = tiny_model(tmp_path / "a")
    train(from_file, read_training_data(path)[0], config)
    from_dataset = tiny_model(tmp_path / "b")
    train(from_dataset, datasets.Dataset.from_list(ROWS), config)
    a, b = weights(from_file), weights(from_dataset)
    assert all(torch.equal(a[k], b[k]) for k in a)
    retriever = Retriever(tiny_model(tmp_path / "c"))
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:4])})
    result = retriever.train(splits, batch_size=4, split="train", show_progress=False)
    assert result.steps == 1 and result.examples == 4


def test_a_dataset_dict_split_and_its_column_names(tmp_path):
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(ROWS),
            "test": datasets.Dataset.from_dict({"question": ["q"], "pos_doc": ["d"]}),
        }
    )
    test = load_training_data(splits, split="test")
    assert texts(test) == [("q", "d", ())] and test[0].origin == "<dataset test>:row 0"
    with pytest.raises(ValueError, match=r"no split 'dev' \(its splits: 'train', 'test'\)"):
        load_training_data(splits, split="dev")
    wrong = datasets.Dataset.from_dict({"text": ["a"], "title": ["b"]})
    with pytest.raises(ValueError, match=r"found the columns \['text', 'title'\]"):
        load_training_data(wrong)
    streamed = datasets.Dataset.from_list(ROWS).to_iterable_dataset()
    with pytest.raises(ValueError, match="IterableDataset .* cannot be read by row"):
        load_training_data(streamed)
    # after select/shuffle a dataset's rows are in its own order, not its table's
    picked = datasets.Dataset.from_list(ROWS).select([5, 2, 7])
    assert [e.query for e in load_training_data(picked)] == [ROWS[i]["anchor"] for i in (5, 2, 7)]


def test_save_to_disk_and_parquet_shard_folders_read_as_files_do(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "saved"))
    examples, report = read_training_data(tmp_path / "saved")
    assert isinstance(examples, ArrowExamples) and report.rows == 8
    assert texts(examples) == as_file_rows(ROWS)
    assert examples[3].origin == f"{tmp_path / 'saved'}:row 3"
    datasets.DatasetDict({"train": ds, "dev": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    dev, _ = read_training_data(tmp_path / "dd", split="dev")
    assert texts(dev) == as_file_rows(ROWS[:1]) and dev[0].origin.endswith("dd/dev:row 0")
    # the Hub's layout: data/<split>-NNNNN-of-NNNNN.parquet, split chosen by --split
    shards = tmp_path / "hub" / "data"
    shards.mkdir(parents=True)
    ds.select(range(5)).to_parquet(str(shards / "train-00000-of-00002.parquet"))
    ds.select(range(5, 8)).to_parquet(str(shards / "train-00001-of-00002.parquet"))
    ds.select([0]).to_parquet(str(shards / "test-00000-of-00001.parquet"))
    train_rows, report = read_training_data(tmp_path / "hub")
    assert texts(train_rows) == as_file_rows(ROWS) and report.rows == 8
    assert train_rows[6].origin == f"{shards / 'train-00001-of-00002.parquet'}:row 2"
    assert len(read_training_data(tmp_path / "hub", split="test")[0]) == 1
    with pytest.raises(ValueError, match=r"no Parquet shard of split 'dev' \(the splits here: "):
        read_training_data(tmp_path / "hub", split="dev")
    # the parquet conversion's layout (default/train/0000.parquet) and unnamed shards
    (tmp_path / "conv" / "default" / "train").mkdir(parents=True)
    ds.to_parquet(str(tmp_path / "conv" / "default" / "train" / "0000.parquet"))
    assert len(read_training_data(tmp_path / "conv")[0]) == 8
    (tmp_path / "parts").mkdir()
    for k in range(2):
        ds.select(range(4 * k, 4 * k + 4)).to_parquet(str(tmp_path / "parts" / f"part-{k}.parquet"))
    assert [p.name for p in parquet_shards(tmp_path / "parts")] == [
        "part-0.parquet",
        "part-1.parquet",
    ]
    assert texts(read_training_data(tmp_path / "parts")[0]) == as_file_rows(ROWS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a training data folder"):
        read_training_data(tmp_path / "empty")


BAD = [
    ({"anchor": None}, "missing 'anchor' or 'query' or 'question'"),
    ({"anchor": "  "}, "field 'anchor': is empty"),
    ({"negative": ["a virus", ""]}, "field 'negative': is empty"),
    ({"score": "abc"}, "field 'score': expected a number, got 'abc'"),
]


@pytest.mark.parametrize("change, problem", BAD)
def test_bad_rows_name_the_source_and_the_row(tmp_path, change, problem):
    rows = [dict(r, score="1.5") for r in ROWS]  # an Arrow column has one type: text here
    rows[2] = {**rows[2], **change}
    frames = {"score": [r["score"] for r in rows]} if "score" in change else {}
    ds = datasets.Dataset.from_dict(
        {k: [r.get(k) for r in rows] for k in ("anchor", "positive", "negative")} | frames
    )
    with pytest.raises(BadRowError, match=rf"^<dataset>:row 2: .*{problem}"):
        load_training_data(ds)
    ds.save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(BadRowError, match=rf"saved:row 2: .*{problem}"):
        read_training_data(tmp_path / "saved")
    (tmp_path / "shards").mkdir()
    ds.select(range(2)).to_parquet(str(tmp_path / "shards" / "train-00000-of-00002.parquet"))
    ds.select(range(2, 8)).to_parquet(str(tmp_path / "shards" / "train-00001-of-00002.parquet"))
    with pytest.raises(BadRowError, match=rf"train-00001-of-00002.parquet:row 1: .*{problem}"):
        read_training_data(tmp_path / "shards")
    with pytest.warns(
        UserWarning, match=r"<dataset>: 7 rows read, 1 bad rows skipped \(<dataset>:row 2"
    ):
        skipped = load_training_data(ds, on_bad_row="skip")
    assert len(skipped) == 7 and [e.origin for e in skipped][2] == "<dataset>:row 3"
    assert texts(skipped) == [texts([e])[0] for e in (skipped[i] for i in range(7))]
    assert skipped.sources[0].report.skipped[0][0] == "<dataset>:row 2"


def test_the_rows_stay_in_arrow_instead_of_becoming_python_objects(tmp_path, monkeypatch):
    """20,000 rows of 200-character texts: read from a save_to_disk folder, the rows hold
    well under a twentieth of the Python memory of the same rows read from a JSONL file
    (a list of TrainingExamples), and each row is built only when asked for."""
    n = 20_000
    pad = "x" * 180
    rows = {"anchor": [f"query {i} {pad}" for i in range(n)],
            "positive": [f"document {i} {pad}" for i in range(n)]}  # fmt: skip
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    path = tmp_path / "rows.jsonl"
    with path.open("w") as f:
        for a, p in zip(rows["anchor"], rows["positive"]):
            f.write(json.dumps({"anchor": a, "positive": p}) + "\n")
    del rows

    def held(read) -> tuple[int, object]:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        value = read()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return after - before, value

    listed, from_file = held(lambda: read_training_data(path)[0])
    kept, from_arrow = held(lambda: read_training_data(tmp_path / "saved")[0])
    assert type(from_file) is list and isinstance(from_arrow, ArrowExamples)
    assert listed > 8 * 2**20  # > 8 MiB of Python objects for the list
    assert kept < listed / 20, (kept, listed)
    assert texts([from_arrow[12_345]]) == texts([from_file[12_345]])
    import densefit.data.arrow as arrow

    built, original = [], arrow.example_from_record
    monkeypatch.setattr(
        arrow, "example_from_record", lambda r, origin: built.append(origin) or original(r, origin)
    )
    from_arrow[7], from_arrow[-1]
    assert built == [f"{tmp_path / 'saved'}:row 7", f"{tmp_path / 'saved'}:row {n - 1}"]
