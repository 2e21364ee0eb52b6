"""The device by default: ``auto`` everywhere (cuda when torch sees one, else cpu), resolved
by one function, offered by every command that runs a model, printed in the run summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from densefit.cli import app
from densefit.config.train import TrainConfig
from densefit.models import resolve_device
from densefit.testing import tiny_model

runner = CliRunner()
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
MODEL_COMMANDS = ("train", "plan", "mine", "index", "search", "eval", "run", "serve")


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("device")
    tiny_model(root / "model")
    rows = [{"question": f"what is cell {i}", "pos_doc": f"the cell protein {i}"} for i in range(8)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    beir = root / "beir"
    (beir / "qrels").mkdir(parents=True)
    docs = [json.dumps({"_id": f"d{i}", "text": f"the cell protein {i}"}) for i in range(8)]
    (beir / "corpus.jsonl").write_text("\n".join(docs) + "\n")
    queries = [json.dumps({"_id": f"q{i}", "text": f"what is cell {i}"}) for i in range(8)]
    (beir / "queries.jsonl").write_text("\n".join(queries) + "\n")
    for split in ("train", "test"):
        lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in range(8)]
        (beir / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(autouse=True)
def no_progress_bars():
    from transformers.utils import logging

    logging.disable_progress_bar()
    yield
    logging.enable_progress_bar()


@NO_CUDA
def test_the_default_is_auto_and_resolves_to_the_cpu_here():
    assert TrainConfig.__dataclass_fields__["device"].default == "auto"
    assert TrainConfig().device == "auto"  # the name: resolved when a job starts
    assert resolve_device() == resolve_device("auto") == resolve_device(None) == "cpu"


def test_auto_resolves_to_cuda_when_torch_sees_a_gpu(monkeypatch):
    """Only the answer is checked: no tensor moves (there is no GPU here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(TrainConfig().device) == "cuda"
    assert resolve_device() == "cuda"
    assert TrainConfig(device="cpu").device == "cpu"  # --device cpu forces the CPU
    assert resolve_device("cpu") == "cpu"


def test_every_command_that_runs_a_model_offers_device_auto():
    for name in MODEL_COMMANDS:
        result = runner.invoke(app, [name, "--help"], terminal_width=200)
        assert result.exit_code == 0, (name, result.output)
        text = " ".join(result.output.split())
        assert "--device" in text, name
        if name != "run":  # run's flags are unset (the config file's key decides)
            assert "[default: auto]" in text, name


def test_amp_help_says_what_bf16_gives_on_cpu_and_gpu():
    from densefit.config import option_of

    help_text = option_of(TrainConfig, "amp").help
    assert "GPU" in help_text and "CPU" in help_text and "default: off" in help_text


@NO_CUDA
@pytest.mark.parametrize("name", MODEL_COMMANDS)
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(ws, name):
    m = str(ws / "model")
    args = {
        "train": ["train", str(ws / "pairs.jsonl"), "-m", m, "-o", str(ws / "out"), "--no-progress"],
        "plan": ["plan", str(ws / "pairs.jsonl"), "-m", m, "--batch-size", "4"],
        "mine": ["mine", str(ws / "beir"), "--corpus", str(ws / "beir"), "-o",
                 str(ws / "mined.jsonl"), "--no-progress"],
        "index": ["index", str(ws / "beir"), "-m", m, "--store", str(ws / "store"), "--no-progress"],
        "search": ["search", "cell", "--store", str(ws / "store")],
        "eval": ["eval", "--dataset", str(ws / "beir"), "-m", m, "--no-progress"],
        "run": ["run", "--data", str(ws / "beir"), "-m", m, "-o", str(ws / "run"), "--no-progress"],
        "serve": ["serve", "--store", str(ws / "store")],
    }[name]  # fmt: skip
    result = runner.invoke(app, [*args, "--device", "cuda"])
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "device is cuda, but torch sees no CUDA device here: use cpu or auto" in lines[0]
    assert "Traceback" not in result.output


@NO_CUDA
def test_the_run_summary_and_the_plan_print_the_device(ws, tmp_path):
    m = str(ws / "model")
    args = ["train", str(ws / "pairs.jsonl"), "-m", m, "-o", str(tmp_path / "o"),
            "--max-steps", "1", "--batch-size", "4", "--no-progress"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert " -> " in result.stderr and f"{tmp_path / 'o'} on cpu" in result.stderr
    assert " on cpu, final loss " in " ".join(result.stderr.split())
    saved = json.loads((tmp_path / "o" / "densefit_config.json").read_text())
    assert saved["device"] == "cpu"
    plan = runner.invoke(app, ["plan", str(ws / "pairs.jsonl"), "-m", m, "--batch-size", "4"])
    assert plan.exit_code == 0, plan.output
    assert "planned for cpu" in plan.stdout
    as_json = runner.invoke(
        app, ["plan", str(ws / "pairs.jsonl"), "-m", m, "--batch-size", "4", "--json"]
    )
    assert json.loads(as_json.stdout)["device"] == "cpu"


def test_the_device_option_is_one_declaration_everywhere():
    from densefit.config.commands import EvalJob, IndexJob, MineJob, SearchJob
    from densefit.config.options import option_of
    from densefit.serve.config import ServeJob

    declared = option_of(TrainConfig, "device")
    for cls in (EvalJob, IndexJob, MineJob, SearchJob, ServeJob):
        assert option_of(cls, "device") is declared
        assert cls.__dataclass_fields__["device"].default == "auto"
