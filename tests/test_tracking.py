"""report_to: the training log's records, read back from TensorBoard event files, an MLflow
file store and an offline W&B run (issue 23)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_eval_during_training import make_beir  # noqa: I001 - a sibling test module

from densefit import TrainConfig, train
from densefit.testing import tiny_model
from densefit.training.tracking import TRACKING_FILE, Trackers, check_trackers


def run_training(tmp_path: Path, report_to: str, *, on_step=None, resume=False, **config):
    beir = make_beir(tmp_path / "beir")
    out = tmp_path / "out"
    settings = dict(batch_size=4, epochs=1, learning_rate=1e-3, show_progress=False, seed=3,
                    report_to=report_to, eval_every=2)  # fmt: skip
    result = train(
        tiny_model(tmp_path / "tiny"),
        beir,  # its 16 train pairs: 4 steps
        TrainConfig(**{**settings, **config}),
        output_dir=out,
        eval_data=beir,
        on_step=on_step,
        resume=resume,
    )
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "eval" not in r]
    evals = [r for r in records if "eval" in r]
    return out, result, steps, evals


def test_tensorboard_event_files_hold_the_logs_records_the_config_and_the_plan(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, result, steps, evals = run_training(tmp_path, "tensorboard", log_every=2)
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    for field in ("loss", "lr", "grad_norm", "step_time_s", "peak_rss_mb", "pos_score",
                  "unique_candidates", "padding_efficiency"):  # fmt: skip
        assert f"train/{field}" in scalars, field
    # the same records as the log file: every 2nd step (log_every), the same values
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in steps] == [2, 4]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    ndcg = events.Scalars("eval/ndcg@10")
    assert [e.step for e in ndcg] == [r["step"] for r in evals] == [0, 2, 4]
    assert [e.value for e in ndcg] == pytest.approx([r["eval"]["ndcg@10"] for r in evals])
    texts = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode()
             for tag in events.Tags()["tensors"]}  # fmt: skip
    assert '"batch_size": 4' in texts["config/text_summary"]
    assert f'"strategy": "{result.plan["strategy"]}"' in texts["memory_plan/text_summary"]
    assert '"steps": 4' in texts["summary/text_summary"]


class Crash(Exception):
    pass


def test_an_mlflow_file_store_run_holds_the_metrics_params_and_plan_and_a_resume_continues_it(
    tmp_path, monkeypatch
):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    def crash(record):
        if record["step"] == 2:
            raise Crash

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(Crash):
        run_training(tmp_path, "mlflow", checkpoint_every=1, on_step=crash)
    client = MlflowClient(tracking_uri=(tmp_path / "out" / "mlruns").resolve().as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "densefit"]
    [crashed] = client.search_runs([experiment.experiment_id])
    assert crashed.info.status == "FAILED"
    # resumed, it reports into the same run (its id is kept in the output folder)
    out, result, steps, evals = run_training(tmp_path, "mlflow", checkpoint_every=1, resume=True)
    [run] = client.search_runs([experiment.experiment_id])
    assert (
        run.info.run_id
        == crashed.info.run_id
        == json.loads((out / TRACKING_FILE).read_text())["mlflow"]
    )
    assert run.info.status == "FINISHED" and run.info.run_name == "out"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in steps])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/ndcg_10")] == [
        0, 2, 4
    ]  # fmt: skip
    assert run.data.params["batch_size"] == "4" and run.data.params["report_to"] == "['mlflow']"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "memory_plan.json", "summary.json"} <= artifacts
    plan = json.loads(Path(client.download_artifacts(run.info.run_id, "memory_plan.json",
                                                     str(tmp_path))).read_text())  # fmt: skip
    assert plan["strategy"] == result.plan["strategy"]


def read_wandb_records(path: Path) -> list:
    """The records of a W&B ``.wandb`` file: a 7-byte header, then LevelDB-log records
    (crc32, length, type: full/first/middle/last) in 32 KiB blocks, each a protobuf Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, pos, pending, out = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            out.append(pending + chunk)
            pending = b""
        elif kind in (2, 3):
            pending += chunk
    return [Record.FromString(chunk) for chunk in out]


def test_a_wandb_offline_run_holds_the_logs_records_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    out, result, steps, evals = run_training(tmp_path, "wandb")
    [run_file] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    for _ in range(300):  # W&B's service may still be writing the file: wait for its exit record
        records = read_wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    history = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # fmt: skip
            history.append(items)
    losses = [h for h in history if "train/loss" in h]
    assert [h["_step"] for h in losses] == [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [h["train/loss"] for h in losses] == pytest.approx([r["loss"] for r in steps])
    assert [h["_step"] for h in history if "eval/ndcg@10" in h] == [r["step"] for r in evals]
    config = {}
    for record in records:
        if record.WhichOneof("record_type") == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    assert (
        config["batch_size"] == 4 and config["memory_plan"]["strategy"] == result.plan["strategy"]
    )


def test_missing_packages_and_folders_are_refused_before_training(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"report_to mlflow needs the mlflow package: pip install "
                       r"'densefit\[mlflow\]'"):  # fmt: skip
        train(tiny_model(tmp_path / "t"), [{"anchor": "q", "positive": "p"}],
              TrainConfig(report_to="mlflow", show_progress=False), output_dir=tmp_path / "o")  # fmt: skip
    assert not (tmp_path / "o").exists()  # refused before anything was written
    monkeypatch.undo()
    if real("tensorboard") is not None:
        with pytest.raises(
            ValueError, match="report_to tensorboard writes under the output folder"
        ):
            check_trackers(["tensorboard"], None)
    trackers = Trackers(None, output_dir=None)  # report_to none: nothing at all
    trackers.start({}, {})
    trackers.log({"step": 1, "loss": 0.5})
    trackers.finish({})


def test_report_to_is_declared_as_changing_neither_the_weights_nor_the_plan():
    """A resume or a rerun may add or drop trackers; ``densefit plan`` does not offer it;
    a bad name is one line naming the flag."""
    from densefit.cli.options import command_flags
    from densefit.config.commands import PlanJob, TrainJob
    from densefit.errors import OptionError
    from densefit.training.checkpoint import changed_weight_options

    config = TrainConfig(report_to="tensorboard, mlflow")
    assert config.report_to == ["tensorboard", "mlflow"]
    assert "report_to" not in config.weight_options()
    assert changed_weight_options(TrainConfig().to_dict(), config) == []
    assert "--report-to" in {f.declaration for f in command_flags(TrainJob)}
    assert "--report-to" not in {f.declaration for f in command_flags(PlanJob)}
    with pytest.raises(OptionError, match="report_to must name trackers among tensorboard"):
        TrainConfig(report_to="tensorbord")
