import json

import pytest
from typer.testing import CliRunner

from densefit.cli import app

runner = CliRunner()


@pytest.fixture
def model_dir(tiny, tmp_path):
    path = tmp_path / "model"
    tiny.save(str(path))
    return path


@pytest.fixture
def pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"question": f"what is the cell {i}", "pos_doc": f"the cell protein {i} " * (i % 4 + 1)}
        for i in range(12)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_help_lists_commands_with_examples():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("train", "plan", "index", "search", "eval"):
        assert command in result.output
    train_help = runner.invoke(app, ["train", "--help"])
    assert "Example" in train_help.output and "--memory" in train_help.output


def test_train_writes_st_model(model_dir, pairs, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "train",
            str(pairs),
            "--model",
            str(model_dir),
            "--output",
            str(out),
            "--batch-size",
            "4",
            "--max-steps",
            "2",
            "--no-progress",
            "--memory",
            "cache",
            "--chunk-size",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").exists() and (out / "densefit_config.json").exists()
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 2


def test_bad_row_names_file_and_line_and_skip_mode_reports(model_dir, pairs, tmp_path):
    with pairs.open("a") as f:
        f.write('{"question": "q", "pos_doc": ""}\n')
    train = ["train", str(pairs), "--model", str(model_dir), "--output", str(tmp_path / "o")]
    train += ["--max-steps", "1", "--no-progress"]
    result = runner.invoke(app, train)
    assert result.exit_code == 2
    assert f"{pairs}:13" in result.output and "pos_doc" in result.output
    skipped = runner.invoke(app, [*train, "--on-bad-row", "skip"])
    assert skipped.exit_code == 0, skipped.output
    assert "1 bad rows skipped" in skipped.output


def test_missing_model_is_one_clear_line(pairs, tmp_path):
    result = runner.invoke(
        app,
        ["train", str(pairs), "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "o")],
    )
    assert result.exit_code == 2
    assert "error:" in result.output and "Traceback" not in result.output


def test_plan_prints_plan_and_json(model_dir, pairs, tmp_path):
    many = tmp_path / "many.jsonl"
    many.write_text(
        "".join(
            json.dumps({"anchor": f"query {i}", "positive": "the cell " * (i % 30 + 1)}) + "\n"
            for i in range(2048)
        )
    )
    from densefit.memory.process import resident_bytes

    budget = resident_bytes() + 64 * 2**20  # for the whole process: what it holds + 64 MiB
    result = runner.invoke(
        app,
        [
            "plan",
            str(many),
            "--model",
            str(model_dir),
            "--batch-size",
            "2048",
            "--memory-budget",
            str(budget),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output[result.output.index("{") :])
    assert plan["strategy"].startswith("cache") and plan["predicted_peak_bytes"] <= budget
    plan_8 = ["plan", str(pairs), "--model", str(model_dir), "--batch-size", "8"]
    roomy = str(resident_bytes() + 2**30)  # a GiB over what this process holds already
    table = runner.invoke(app, [*plan_8, "--memory-budget", roomy])
    assert "-> plain" in table.output
    impossible = runner.invoke(app, [*plan_8, "--memory-budget", "1KiB"])
    assert impossible.exit_code == 3 and "raise --memory-budget" in impossible.output
