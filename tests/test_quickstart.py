"""The README's main job, end to end on a tiny model and a generated BEIR folder."""

import json
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_beir(folder: Path) -> None:
    topics = ["cell protein", "python function", "vaccine dose", "heart blood", "gene cancer", "search index"]
    (folder / "qrels").mkdir(parents=True)
    with (folder / "corpus.jsonl").open("w") as f:
        for i, t in enumerate(topics * 4):
            f.write(json.dumps({"_id": f"d{i}", "title": t, "text": f"{t} text number {i}"}) + "\n")
    with (folder / "queries.jsonl").open("w") as f:
        for i, t in enumerate(topics * 4):
            f.write(json.dumps({"_id": f"q{i}", "text": f"what about {t} {i}"}) + "\n")
    for split, ids in (("train", range(0, 16)), ("test", range(16, 24))):
        lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in ids]
        (folder / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")


def test_quickstart_trains_and_prints_before_after(tiny, tmp_path, monkeypatch, capsys):
    data, model_dir, out = tmp_path / "beir", tmp_path / "model", tmp_path / "run"
    write_beir(data)
    tiny.save(str(model_dir))
    monkeypatch.setattr(sys, "argv", [
        "quickstart.py", "--data", str(data), "--model", str(model_dir), "--output", str(out),
        "--batch-size", "8", "--epochs", "1", "--max-seq-length", "32", "--memory-budget", "2GiB",
    ])
    runpy.run_path(str(REPO / "examples" / "quickstart.py"), run_name="__main__")
    report = json.loads((out / "report.json").read_text())
    assert report["train"]["steps"] == 2
    for side in ("before", "after"):
        assert 0.0 <= report[side]["metrics"]["ndcg@10"] <= 1.0
    printed = capsys.readouterr().out
    assert "before / after" in printed and "ndcg@10" in printed.lower()
    assert (out / "model" / "model.safetensors").exists()
