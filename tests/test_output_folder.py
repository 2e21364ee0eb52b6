"""Output folders are never clobbered: foreign files, another run's options, an old log."""

from __future__ import annotations

import json

import pytest

from densefit import TrainConfig, TrainingExample, train
from densefit.training.setup import check_output_dir

ROWS = [TrainingExample(f"what is the cell {i}", f"the protein gene {i}") for i in range(8)]


def cfg(**kw) -> TrainConfig:
    return TrainConfig(
        **{
            "batch_size": 4,
            "learning_rate": 2e-5,
            "show_progress": False,
            "keep_checkpoints": 0,
            **kw,
        }
    )


def steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_folder_with_foreign_files_is_refused_unless_overwrite(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "bert"}')  # someone else's model
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError) as caught:
        train(tiny, ROWS, cfg(), output_dir=out)
    message = str(caught.value)
    assert "\n" not in message and str(out) in message
    assert "config.json, notes.txt" in message and "--overwrite" in message
    assert (out / "notes.txt").read_text() == "keep me" and not (out / "train_log.jsonl").exists()
    train(tiny, ROWS, cfg(), output_dir=out, overwrite=True)
    assert (out / "densefit_config.json").is_file() and (out / "notes.txt").exists()


def test_the_check_comes_before_anything_slow(tiny, tmp_path, monkeypatch):
    import densefit.training.setup as setup

    def no_planning(*args, **kwargs):
        raise AssertionError("planned before checking the output folder")

    monkeypatch.setattr(setup, "plan_for_run", no_planning)
    monkeypatch.setattr(setup, "make_optimizer", no_planning)
    (tmp_path / "data.csv").write_text("x")
    with pytest.raises(ValueError, match="not a densefit run"):
        train(tiny, ROWS, cfg(memory="auto"), output_dir=tmp_path)
    with pytest.raises(ValueError, match="is not a folder"):
        train(tiny, ROWS, cfg(), output_dir=tmp_path / "data.csv")


def test_a_rerun_of_the_same_config_keeps_the_old_log_renamed(tiny, tmp_path):
    out = tmp_path / "out"
    train(tiny, ROWS, cfg(epochs=2), output_dir=out)
    train(tiny, ROWS, cfg(epochs=2, show_progress=False, log_every=1), output_dir=out)
    train(tiny, ROWS, cfg(epochs=2), output_dir=out)
    assert steps(out / "train_log.jsonl") == [1, 2, 3, 4]  # never 1, 2, 3, 4, 1, 2, ...
    assert steps(out / "train_log.1.jsonl") == steps(out / "train_log.2.jsonl") == [1, 2, 3, 4]


def test_a_finished_run_of_other_options_is_refused(tiny, tmp_path):
    out = tmp_path / "out"
    train(tiny, ROWS, cfg(), output_dir=out)
    with pytest.raises(ValueError, match=r"other options \(learning_rate=2e-05 \(now 0.001\)\)"):
        train(tiny, ROWS, cfg(learning_rate=1e-3), output_dir=out)
    assert steps(out / "train_log.jsonl") == [1, 2]  # untouched
    train(tiny, ROWS, cfg(learning_rate=1e-3), output_dir=out, overwrite=True)
    assert steps(out / "train_log.jsonl") == [1, 2] and (out / "train_log.1.jsonl").exists()


def test_an_interrupted_run_and_empty_folders_are_fine(tmp_path):
    check_output_dir(None, cfg())
    check_output_dir(tmp_path / "new", cfg())
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", cfg())
    run = tmp_path / "interrupted"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "train_log.jsonl").write_text('{"step": 1}\n')
    (run / "train_log.1.jsonl").write_text('{"step": 1}\n')
    check_output_dir(run, cfg())
    (run / "train_log.old.jsonl").write_text("")
    with pytest.raises(ValueError, match="train_log.old.jsonl"):
        check_output_dir(run, cfg())
    check_output_dir(run, cfg(), resume=True)  # a resume: the checkpoint decides
