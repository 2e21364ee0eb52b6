"""`densefit export`, `--runtime` on index / search / eval and `densefit train --export`
through typer's CliRunner, offline, on the tiny model (ONNX Runtime, fp32 and int8)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from densefit.testing.conformance import make_corpus

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

runner = CliRunner()


@pytest.fixture(scope="module")
def app():
    from densefit.cli.app import app

    return app


def invoke(app, args):
    result = runner.invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture
def model_dir(tmp_path):
    """A saved tiny model of its own (exports are written into it)."""
    from densefit.testing import tiny_model

    tiny_model(tmp_path / "build", normalize=True).save(str(tmp_path / "model"))
    return tmp_path / "model"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    with open(folder / "corpus.jsonl", "w") as fh:
        for d in make_corpus(40):
            fh.write(json.dumps({"_id": d.id, "text": d.text}) + "\n")
    return folder / "corpus.jsonl"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Training pairs: 30 distinct queries and 60 documents (enough for an int8 check)."""
    folder = tmp_path_factory.mktemp("pairs")
    docs = make_corpus(60)
    with open(folder / "pairs.jsonl", "w") as fh:
        for i in range(30):
            row = {"query": f"question {i}: {docs[i].title}", "positive": docs[i].text}
            row["negative"] = docs[30 + i].text
            fh.write(json.dumps(row) + "\n")
    return folder / "pairs.jsonl"


def _one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def test_export_onnx_then_index_search_and_eval_with_it(app, model_dir, corpus, tmp_path):
    exported = invoke(app, ["export", model_dir, "--to", "onnx", "--json", "--no-progress"])
    assert exported.exit_code == 0, exported.output
    report = json.loads(exported.stdout)
    assert report["folder"] == str(model_dir)
    record = report["exports"]["onnx"]
    assert record["passed"] and record["file"] == "model.onnx"
    assert record["check"]["cosine_min"] >= 1 - 1e-5
    assert (model_dir / "onnx" / "model.onnx").is_file()
    manifest = json.loads((model_dir / "onnx" / "densefit_export.json").read_text())
    assert manifest["files"]["model.onnx"]["passed"]

    stores = {}
    for runtime in ("torch", "onnx"):
        store = tmp_path / f"store-{runtime}"
        args = ["index", corpus, "--model", model_dir, "--store", store, "--json"]
        result = invoke(app, [*args, "--runtime", runtime, "--no-progress"])
        assert result.exit_code == 0, result.output
        payload = json.loads(result.stdout)
        assert payload["report"]["runtime"].startswith(runtime)
        assert payload["store"]["runtime"].startswith(runtime)
        stores[runtime] = store
    assert "onnx/model.onnx" in json.loads(result.stdout)["report"]["runtime"]  # the file

    from densefit.retrieval.index.store import LocalDocumentStore

    with LocalDocumentStore(stores["torch"]) as a, LocalDocumentStore(stores["onnx"]) as b:
        ids = sorted(a.ids())
        np.testing.assert_allclose(a.vectors(ids), b.vectors(ids), atol=1e-5)

    query = make_corpus(40)[7].text
    hits = {}
    for runtime in ("torch", "onnx", "auto"):
        result = invoke(
            app, ["search", "--store", stores["onnx"], query, "--runtime", runtime, "--json"]
        )
        assert result.exit_code == 0, result.output
        hits[runtime] = [h["id"] for h in json.loads(result.stdout)[0]["hits"]]
    assert hits["torch"] == hits["onnx"] == hits["auto"]


def test_export_int8_with_calibration_and_its_refusals(app, model_dir, pairs, corpus, tmp_path):
    no_texts = invoke(app, ["export", model_dir, "--to", "onnx-int8", "--no-progress"])
    assert no_texts.exit_code == 2
    line = _one_error_line(no_texts)
    assert f"{model_dir} records no training data" in line and "--calibration DATA" in line

    exported = invoke(
        app,
        ["export", model_dir, "--to", "onnx-int8", "--calibration", pairs, "--json",
         "--on-check-failure", "warn", "--int8-recipe", "matmul-per-channel", "--no-progress"],
    )  # fmt: skip
    assert exported.exit_code == 0, exported.output
    record = json.loads(exported.stdout)["exports"]["onnx-int8"]
    assert record["file"].startswith("model_qint8_") and record["file"].endswith(".onnx")
    assert record["quantization"]["recipe"] == "matmul-per-channel"
    assert {"cosine_mean", "top10_overlap", "top10_overlap_mixed"} <= set(record["check"])
    assert (model_dir / "onnx" / record["file"]).is_file()

    store = tmp_path / "store"
    args = ["index", corpus, "--model", model_dir, "--store", store, "--json", "--no-progress"]
    result = invoke(app, [*args, "--runtime", "onnx-int8"])
    if record["passed"]:
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["store"]["runtime"].startswith("onnx-int8")
    else:  # kept with warn, recorded as failed: never used
        assert result.exit_code == 2 and "its check failed" in _one_error_line(result)


def test_int8_without_calibration_is_checked_on_the_training_data_the_model_records(
    app, model_dir, pairs, tmp_path
):
    """A model densefit trained records its training data; `densefit export M --to onnx-int8`
    checks on it, and says so. The same file given as --calibration is named as such."""
    out = tmp_path / "trained"
    train = ["train", pairs, "--model", model_dir, "--output", out, "--max-steps", 1]
    assert invoke(app, [*train, "--batch-size", 8, "--no-progress"]).exit_code == 0
    recorded = json.loads((out / "densefit_config.json").read_text())["training_data"]
    assert recorded == {"paths": [str(pairs.resolve())], "split": "train"}
    exported = invoke(app, ["export", out, "--to", "onnx-int8", "--on-check-failure", "warn"])
    assert exported.exit_code == 0, exported.output
    assert f"checked on 30 queries, 60 documents from the model's training data ({pairs})" in (
        exported.stderr
    )
    given = invoke(
        app, ["export", out, "--to", "onnx-int8", "--calibration", pairs, "--on-check-failure",
              "warn", "--json", "--no-progress"],
    )  # fmt: skip
    check = json.loads(given.stdout)["exports"]["onnx-int8"]["check"]
    assert check["texts"].endswith(f"from {pairs} (the model's training data)")
    pairs_moved = tmp_path / "moved.jsonl"
    data = json.loads((out / "densefit_config.json").read_text())
    data["training_data"]["paths"] = [str(pairs_moved)]
    (out / "densefit_config.json").write_text(json.dumps(data))
    gone = invoke(app, ["export", out, "--to", "onnx-int8", "--no-progress"])
    line = _one_error_line(gone)
    assert gone.exit_code == 2 and f"{pairs_moved} is not there any more" in line
    assert "--calibration DATA" in line


def test_openvino_int8_draws_no_bars_without_progress(app, model_dir, pairs):
    """NNCF draws its own bars on stdout: none with --no-progress, and --json stays JSON."""
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    result = invoke(
        app, ["export", model_dir, "--to", "openvino-int8", "--calibration", pairs, "--json",
              "--on-check-failure", "warn", "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["exports"]["openvino-int8"]["file"]
    for words in ("Statistics collection", "Applying", "━"):
        assert words not in result.output


TELEMETRY_PROBE = """
import json, os, sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper
from openvino_telemetry.backend import backend_ga4

sent = []  # what would go to Google Analytics (nothing leaves the machine here)
backend_ga4.GA4Backend.send = lambda self, message: sent.append(message)
from densefit.retrieval import export

x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
folder = Path(sys.argv[1])
onnx.save(helper.make_model(graph), folder / "m.onnx")
if sys.argv[2] == "densefit":
    export._convert_openvino(folder / "m.onnx", folder / "ov" / "m.xml")
    import nncf  # NNCF's import after an export keeps it off
else:  # the tools as they are, for the comparison
    import nncf
    import openvino as ov
    ov.save_model(ov.convert_model(str(folder / "m.onnx")), str(folder / "ov.xml"))
from openvino_telemetry import Telemetry

print(json.dumps({"sent": len(sent), "consent": Telemetry().consent, "ci": os.environ.get("CI")}))
"""


def test_openvino_exports_send_no_telemetry(tmp_path):
    """OpenVINO's converter and NNCF send usage events through openvino-telemetry unless the
    user opted out (its sender forked processes from a thread pool and deadlocked an export):
    densefit's exports send none, and leave CI as it was. Outside pytest (NNCF turns its own
    off under pytest), in a home without a consent file, where the tools alone do send."""
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    pytest.importorskip("openvino_telemetry")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"HOME": str(tmp_path)}
    runs = {}
    for how in ("tools", "densefit"):
        folder = tmp_path / how
        folder.mkdir()
        done = subprocess.run(
            [sys.executable, "-c", TELEMETRY_PROBE, str(folder), how],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs[how] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["tools"]["sent"] > 0 and runs["tools"]["consent"]  # the comparison holds
    assert runs["densefit"] == {"sent": 0, "consent": False, "ci": None}


@pytest.mark.parametrize(
    "args, words",
    [
        (["--to", "tflite"], "--to must be one of onnx, onnx-int8, openvino, openvino-int8"),
        (["--on-check-failure", "ignore"], "--on-check-failure must be one of error, warn"),
        (["--int8-recipe", "fp4"], "--int8-recipe must be one of matmul-per-channel"),
    ],
    ids=["to", "on-check-failure", "int8-recipe"],
)
def test_bad_export_options_are_one_line(app, model_dir, args, words):
    result = invoke(app, ["export", model_dir, *args])
    assert result.exit_code == 2
    assert words in _one_error_line(result)
    assert not (model_dir / "onnx").exists()  # refused before anything was written


def test_export_errors_the_user_can_fix(app, model_dir, tmp_path):
    missing = invoke(
        app, ["export", model_dir, "--to", "onnx-int8", "--calibration", tmp_path / "x"]
    )
    assert missing.exit_code == 2 and "x: no such file" in _one_error_line(missing)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    busy = invoke(app, ["export", model_dir, "--output", tmp_path / "busy"])
    assert busy.exit_code == 2 and "holds no sentence-transformers model" in _one_error_line(busy)
    elsewhere = invoke(app, ["export", model_dir, "--output", tmp_path / "copy", "--no-progress"])
    assert elsewhere.exit_code == 0, elsewhere.output
    assert (tmp_path / "copy" / "modules.json").is_file()
    assert (tmp_path / "copy" / "onnx" / "model.onnx").is_file()


def test_runtime_without_its_export_is_one_line(app, model_dir, corpus, tmp_path):
    args = ["index", corpus, "--model", model_dir, "--store", tmp_path / "s", "--no-progress"]
    unknown = invoke(app, [*args, "--runtime", "tensorrt"])
    assert unknown.exit_code == 2
    assert "--runtime must be one of auto, torch, onnx" in _one_error_line(unknown)
    missing = invoke(app, [*args, "--runtime", "onnx-int8"])
    assert missing.exit_code == 2
    assert "no checked onnx-int8 export" in _one_error_line(missing)
    assert "densefit export" in missing.stderr


def test_a_store_of_one_family_refuses_writes_of_another(app, model_dir, pairs, corpus, tmp_path):
    """Indexed by torch, then int8 asked for: refused with the rule, not mixed."""
    store = tmp_path / "store"
    base = ["index", corpus, "--model", model_dir, "--store", store, "--no-progress"]
    assert invoke(app, [*base, "--runtime", "torch"]).exit_code == 0
    exported = invoke(
        app, ["export", model_dir, "--to", "onnx-int8", "--calibration", pairs, "--no-progress"]
    )
    if exported.exit_code != 0:  # the tiny random model's int8 may fail its check: refused
        assert "ranks differently" in _one_error_line(exported)
        pytest.skip("the int8 export of the tiny model did not pass its check here")
    mixed = invoke(app, [*base, "--runtime", "onnx-int8", "--reembed"])
    assert mixed.exit_code == 0, mixed.output  # --reembed re-embeds every vector with it
    other = tmp_path / "other"
    again = ["index", corpus, "--model", model_dir, "--store", other, "--no-progress"]
    assert invoke(app, [*again, "--runtime", "torch"]).exit_code == 0
    refused = invoke(app, [*again, "--runtime", "onnx-int8"])
    # nothing new to embed: documents unchanged are skipped, but the runtime is still checked
    line = _one_error_line(refused)
    assert refused.exit_code == 2 and "runtime='torch'" in line and "pass --runtime torch" in line


def test_train_exports_at_save_time(app, model_dir, pairs, tmp_path):
    out = tmp_path / "trained"
    train = ["train", pairs, "--model", model_dir, "--output", out, "--max-steps", 1]
    train += ["--batch-size", 8, "--no-progress", "--export", "onnx"]
    result = invoke(app, train)
    assert result.exit_code == 0, result.output
    assert (out / "onnx" / "model.onnx").is_file()
    assert "exported" in result.stderr and "onnx/model.onnx (passed" in result.stderr
    from densefit.models import load_model
    from densefit.retrieval.runtimes import resolve_runtime

    trained = load_model(out, device="cpu")
    assert resolve_runtime(trained, "auto").name == "onnx"  # the export of these weights

    bad = invoke(app, [*train[:-2], "--export", "coreml"])
    assert bad.exit_code == 2 and "--export must be one of null, onnx" in _one_error_line(bad)
    lora = invoke(app, [*train, "--lora-r", 4, "--save-adapter", "--overwrite"])
    assert lora.exit_code == 2 and "--save-adapter saves the LoRA adapter" in lora.stderr


def test_serve_embeds_queries_and_inputs_with_its_runtime(model_dir, tmp_path, monkeypatch):
    """ServeConfig(runtime=...): the query workers embed /search queries and /v1/embeddings
    inputs with it (ONNX Runtime here, equal to torch), and a runtime that is not exported
    stops the app from starting with the fix."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    import densefit.retrieval.index.searching as searching
    import densefit.serve.app as serve_app
    import densefit.serve.embeddings as serve_embeddings
    from densefit.models import load_model
    from densefit.retrieval.index.engines import open_store
    from densefit.retrieval.index.indexing import index_documents
    from densefit.retrieval.index.store import LocalDocumentStore
    from densefit.retrieval.runtimes import RuntimeUnavailableError
    from densefit.serve.config import ServeConfig

    model = load_model(model_dir, device="cpu")
    with open_store(tmp_path / "store", model) as store:
        index_documents(store, model, make_corpus(40))
    used = []
    for module in (searching, serve_embeddings):  # /search queries, /v1/embeddings inputs
        real = module.encode_texts

        def spy(*args, _real=real, **kwargs):
            used.append(kwargs.get("runtime"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "encode_texts", spy)
    results = {}
    for runtime in ("torch", "onnx"):
        used.clear()
        app = serve_app.create_app(
            LocalDocumentStore(tmp_path / "store"), model, ServeConfig(runtime=runtime)
        )
        with TestClient(app) as client:
            found = client.post("/search", json={"query": "cells genes", "k": 5}).json()
            body = {"input": ["cells genes"], "model": "m"}
            vector = client.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
        results[runtime] = ([h["id"] for h in found["results"][0]["hits"]], vector)
        assert used and set(used) == {runtime}, used  # every query pass, by name
    assert results["torch"][0] == results["onnx"][0]
    np.testing.assert_allclose(results["torch"][1], results["onnx"][1], atol=1e-5)
    with pytest.raises(RuntimeUnavailableError, match="no checked onnx-int8 export"):
        serve_app.create_app(
            LocalDocumentStore(tmp_path / "store"), model, ServeConfig(runtime="onnx-int8")
        )
