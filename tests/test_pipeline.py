"""`densefit run` end to end on a tiny model and a generated BEIR folder: artefacts, report,
resume after an interruption, re-running what a config change affects, config errors."""

import importlib
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import densefit.jobs
from densefit.cli import app
from densefit.config.options import ConfigError
from densefit.config.run import load_run_config
from densefit.models import model_name_of
from densefit.pipeline import run_pipeline
from densefit.pipeline import stages as stages_module

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
TOPICS = [
    "cell protein",
    "python function",
    "vaccine dose",
    "heart blood",
    "gene cancer",
    "search index",
]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: tiny steps are dominated by thread sync on a shared 2-core CPU."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A BEIR folder (train: 16 queries, test: 8, 30 documents) and a saved tiny model."""
    from densefit.testing import tiny_model

    root = tmp_path_factory.mktemp("pipeline")
    beir = root / "beir"
    (beir / "qrels").mkdir(parents=True)
    with (beir / "corpus.jsonl").open("w") as f:
        for i, t in enumerate(TOPICS * 5):
            f.write(json.dumps({"_id": f"d{i}", "title": t, "text": f"{t} text number {i}"}) + "\n")
    with (beir / "queries.jsonl").open("w") as f:
        for i, t in enumerate(TOPICS * 5):
            f.write(json.dumps({"_id": f"q{i}", "text": f"what about {t} {i}"}) + "\n")
    for split, ids in (("train", range(0, 16)), ("test", range(16, 24))):
        lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in ids]
        (beir / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    tiny_model(root / "tiny-src").save(str(root / "model"))
    return root


def write_config(folder: Path, workspace: Path, extra: str = "", name: str = "run.yaml") -> Path:
    path = folder / name
    # memory_budget 16GiB: a size (not a share of what is free) far above what the tiny model
    # needs on top of what this test process holds, however long the suite ran before it
    path.write_text(
        f"data: {workspace / 'beir'}\n"
        f"model: {workspace / 'model'}\n"
        "progress: false\n"
        "train:\n  batch_size: 4\n  max_seq_length: 32\n  memory_budget: 16GiB\n"
        "eval:\n  distractors: 4\n  metrics: [ndcg@10, recall@10]\n" + extra
    )
    return path


def test_run_writes_every_artefact_and_the_report_parses(workspace, tmp_path):
    config = write_config(tmp_path, workspace, "mine:\n  method: bm25\n  range: '0:10'\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(config), "--output", str(out)])
    assert result.exit_code == 0, result.output

    for rel in (
        "report.md",
        "report.json",
        "config.yaml",
        "mined.jsonl",
        "eval/base.json",
        "eval/trained.json",
        "model/train_log.jsonl",
    ):
        assert (out / rel).is_file(), rel
    for png in ("training", "resources", "metrics"):
        assert (out / "plots" / f"{png}.png").read_bytes()[:8] == PNG
    assert not (out / "model" / "checkpoints").exists()  # delete_checkpoints: true
    from sentence_transformers import SentenceTransformer

    assert SentenceTransformer(str(out / "model"), device="cpu").encode(["cell"]).shape == (1, 32)

    report = json.loads((out / "report.json").read_text())
    assert set(report["metrics"]) == {"ndcg@10", "recall@10"}
    for m in report["metrics"].values():
        assert 0 <= m["base"] <= 1 and 0 <= m["trained"] <= 1
        assert m["delta"] == pytest.approx(m["trained"] - m["base"], abs=1e-5)
    data = report["data"]
    assert (data["train_rows"], data["eval_queries"], data["mined_rows"]) == (16, 8, 16)
    assert (data["eval_documents_searched"], data["judged_documents"], data["distractors"]) == (
        12,
        8,
        4,
    )
    assert data["eval_queries_also_in_training"] == 0
    assert report["memory_plan"]["strategy"] in ("plain", "cache", "checkpoint")
    assert report["train"]["steps"] == 4
    assert set(report["stages"]) == {"mine", "train", "eval_base", "eval_trained"}
    assert all(s["status"] == "ran" and s["seconds"] >= 0 for s in report["stages"].values())
    log = [
        json.loads(line) for line in (out / "model" / "train_log.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert all(0 <= r["in_batch_accuracy"] <= 1 for r in log)

    md = (out / "report.md").read_text()
    for text in (
        "## Results",
        "ndcg@10",
        "plots/training.png",
        "### Memory plan",
        "## Stages",
        "## Data",
        "## Config",
        "12 of the 30 documents",
    ):
        assert text in md, text
    # Per query: the rows average to the reported metrics; report.md sums them up, and
    # report.html holds them, self-contained (tests/test_report_html.py drives it in a browser).
    rows = [json.loads(line) for line in (out / "eval" / "per_query.jsonl").open()]
    assert sorted(r["query_id"] for r in rows) == [f"q{i}" for i in range(16, 24)]
    for name, role in (("base", "base"), ("trained", "new")):
        for metric, value in report["eval"][name]["metrics"].items():
            mean = sum(r[f"{role}_metrics"][metric] for r in rows) / len(rows)
            assert mean == pytest.approx(value, abs=1e-6), (name, metric)
    assert all(r["query"] == f"what about {TOPICS[int(r['query_id'][1:]) % 6]} "
               f"{r['query_id'][1:]}" for r in rows)  # fmt: skip
    per_query = report["per_query"]
    assert per_query["metric"] == "ndcg@10" and per_query["queries"] == 8
    assert per_query["better"] + per_query["same"] + per_query["worse"] == 8
    assert "## Per query" in md and f"{per_query['better']} of 8 queries got better" in md
    page = (out / "report.html").read_text()
    assert 'id="per-query-data"' in page and "data:image/png;base64," in page
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", page)
    assert "## Results" not in page and '<h2 id="results">Results</h2>' in page
    # The printed table says what was evaluated.
    assert "base vs trained" in result.stdout and "8 queries" in result.stdout
    assert "12 of 30" in result.stdout and "4 random distractors" in result.stdout
    printed = " ".join(result.stdout.split())
    assert f"per query (ndcg@10): {per_query['better']} better" in printed

    again = run_pipeline(load_run_config(config, {"output": str(out)}))
    assert again.ran == [] and again.skipped == [
        "mine",
        "train",
        "eval_base",
        "eval_trained",
        "report",
    ]


def test_the_report_names_its_base_model_and_prints_p_values_as_the_console(
    workspace, tmp_path, monkeypatch
):
    """Without `model:` the run trains the default model, and the report names it; the report
    and the console print each p-value by one function (< 0.001 below it); the console's
    training line says the plan without an unset chunk."""
    import shutil

    from rich.console import Console

    from densefit.config.run import config_from_flags
    from densefit.evaluate import EvalResult, compare_results, format_p_value
    from densefit.pipeline.report import write_report

    shutil.copytree(workspace / "model", tmp_path / "all-MiniLM-L6-v2")  # the default, by name
    monkeypatch.chdir(tmp_path)
    args = ["run", "--data", str(workspace / "beir"), "--output", str(tmp_path / "out"),
            "--batch-size", "4", "--max-steps", "1", "--max-seq-length", "32",
            "--memory-budget", "16GiB", "--eval-distractors", "4", "--no-progress",
            "--set", "train.memory=cache", "--set", "train.token_budget=64"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    trained = next(line for line in result.output.splitlines() if "final loss" in line)
    assert "memory: cache (64 tokens per chunk, 1 kept graph" in trained and "None" not in trained
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["model"] is None and report["base_model"] == "all-MiniLM-L6-v2"
    assert "Base model `all-MiniLM-L6-v2`, fine-tuned" in (out / "report.md").read_text()

    # Evaluations whose p-values are small: every query better by a different amount.
    queries = [f"q{i}" for i in range(24)]
    base = EvalResult("base", {}, {q: {} for q in queries}, len(queries))
    better = EvalResult("trained", {}, {q: {} for q in queries}, len(queries))
    for metric, gain in (("ndcg@10", 0.05), ("recall@10", 0.0)):
        for i, q in enumerate(queries):
            base.per_query[q][metric] = 0.5
            better.per_query[q][metric] = 0.5 + gain * (i + 1) * (1 if i % 5 else -0.3)
        for r in (base, better):
            r.metrics[metric] = sum(r.per_query[q][metric] for q in queries) / len(queries)
    for name, r in (("base", base), ("trained", better)):
        path = out / "eval" / f"{name}.json"
        r.info = json.loads(path.read_text())["info"]  # what was searched, as the run saved it
        path.write_text(json.dumps(r.to_dict(per_query=True)))
    markers = {p.stem: json.loads(p.read_text()) for p in (out / "stages").glob("*.json")}
    stages = ["mine", "train", "eval_base", "eval_trained"]
    config = config_from_flags({"data": str(workspace / "beir"), "output": str(out)})
    written = write_report(out, config, markers, ran=[], stages=stages)
    comparison = compare_results(base, better)
    assert comparison["ndcg@10"]["p_value"] < 0.001
    console = Console(record=True, width=200)
    console.print(stages_module.RunResult(out, markers).table())
    printed = console.export_text()
    md = (out / "report.md").read_text()
    for metric, c in comparison.items():
        shown = format_p_value(c["p_value"])
        assert written["metrics"][metric]["p_value"] == c["p_value"]  # not rounded twice
        row = next(line for line in md.splitlines() if line.startswith(f"| {metric} |"))
        assert row.endswith(f"| {shown} |"), row
        assert f" {shown} " in next(line for line in printed.splitlines() if metric in line)
    assert "| < 0.001 |" in md


def test_the_memory_plot_draws_the_budget_and_the_predicted_peak():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from densefit.pipeline.report import _draw_memory

    fig, ax = plt.subplots()
    log = [{"step": 1, "peak_rss_mb": 600.0}, {"step": 2, "peak_rss_mb": 640.0}]
    _draw_memory(ax, log, {"budget_mib": 4096.0, "predicted_peak_mib": 700.0})
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    plt.close(fig)
    assert lines["budget 4,096 MiB"] == [4096.0, 4096.0]
    assert lines["predicted peak 700 MiB"] == [700.0, 700.0]
    assert lines["peak RSS (process)"] == [600.0, 640.0]


def test_interrupted_after_training_the_rerun_skips_finished_stages(
    workspace, tmp_path, monkeypatch
):
    config = load_run_config(write_config(tmp_path, workspace), {"output": str(tmp_path / "out")})
    real_evaluate = densefit.jobs.evaluate
    trained = str(tmp_path / "out" / "model")

    def dies_on_the_trained_model(model, source, **kw):
        if model_name_of(model) == trained:
            raise KeyboardInterrupt  # as if killed during the second evaluation
        return real_evaluate(model, source, **kw)

    monkeypatch.setattr(densefit.jobs, "evaluate", dies_on_the_trained_model)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(config)
    markers = tmp_path / "out" / "stages"
    assert {p.name for p in markers.glob("*.json")} == {
        "train.json",
        "train.started.json",
        "eval_base.json",
    }
    base_written = (tmp_path / "out" / "eval" / "base.json").stat().st_mtime_ns

    monkeypatch.setattr(densefit.jobs, "evaluate", real_evaluate)
    calls = []
    monkeypatch.setattr(
        importlib.import_module("densefit.training.loop"), "train", lambda *a, **k: calls.append(a)
    )  # a spy
    result = run_pipeline(config)
    assert calls == []  # training was not redone
    assert result.skipped == ["train", "eval_base"] and result.ran == ["eval_trained", "report"]
    assert (tmp_path / "out" / "eval" / "base.json").stat().st_mtime_ns == base_written
    assert (tmp_path / "out" / "report.json").is_file()


def test_training_killed_mid_run_resumes_from_its_checkpoint(workspace, tmp_path, monkeypatch):
    config = load_run_config(
        write_config(tmp_path, workspace),
        {
            "output": str(tmp_path / "out"),
            "train.checkpoint_every": 1,
            "train.delete_checkpoints": False,
        },
    )

    def interrupt(record):
        if record["step"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(stages_module, "on_train_step", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(config)
    assert not (tmp_path / "out" / "stages" / "train.json").exists()
    monkeypatch.setattr(stages_module, "on_train_step", lambda record: None)

    result = run_pipeline(config)
    train = result.markers["train"]["result"]
    assert train["resumed_from_step"] == 2 and train["steps"] == 4
    log = (tmp_path / "out" / "model" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == [1, 2, 3, 4]  # each step logged once
    assert "Resumed after an interruption" in (tmp_path / "out" / "report.md").read_text()


def test_a_changed_config_reruns_the_stages_it_affects(workspace, tmp_path):
    path = write_config(tmp_path, workspace)
    out = {"output": str(tmp_path / "out")}
    first = run_pipeline(load_run_config(path, out))
    assert first.ran == ["train", "eval_base", "eval_trained", "report"]

    metrics = run_pipeline(load_run_config(path, {**out, "eval.metrics": ["ndcg@10", "mrr@10"]}))
    assert metrics.skipped == ["train"] and metrics.ran == ["eval_base", "eval_trained", "report"]
    assert set(metrics.report["metrics"]) == {"ndcg@10", "mrr@10"}

    lr = run_pipeline(
        load_run_config(
            path, {**out, "eval.metrics": ["ndcg@10", "mrr@10"], "train.learning_rate": 1e-3}
        )
    )
    assert lr.skipped == ["eval_base"] and lr.ran == ["train", "eval_trained", "report"]
    assert lr.report["config"]["train"]["learning_rate"] == 1e-3


def test_flags_alone_run_and_reuse_the_base_evaluation_of_another_folder(workspace, tmp_path):
    path = write_config(tmp_path, workspace, f"  cache_dir: {tmp_path / 'cache'}\n")
    first = run_pipeline(load_run_config(path, {"output": str(tmp_path / "a")}))
    assert "eval_base" in first.ran
    args = ["run", "--data", str(workspace / "beir"), "--model", str(workspace / "model"),
            "--output", str(tmp_path / "b"), "--batch-size", "4", "--max-steps", "1",
            "--max-seq-length", "32", "--memory-budget", "16GiB", "--eval-distractors", "4",
            "--set", "eval.metrics=[ndcg@10, recall@10]",
            "--set", f"eval.cache_dir={tmp_path / 'cache'}", "--no-progress"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    second = json.loads((tmp_path / "b" / "report.json").read_text())
    assert second["train"]["steps"] == 1  # the flags were used
    assert second["stages"]["eval_base"]["status"] == (
        f"reused from {tmp_path / 'cache'}/eval-{first.markers['eval_base']['fingerprint']}.json"
    )
    assert second["metrics"]["ndcg@10"]["base"] == first.report["metrics"]["ndcg@10"]["base"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("train:\n  batch_sise: 8\n", ["train.batch_sise", "did you mean train.batch_size"]),
        ("evaluation:\n  split: test\n", ["'evaluation'", "known keys"]),
        ("eval:\n  distractors: many\n", ["eval.distractors must be an integer or null"]),
        ("train: {batch_size: 4\n", ["not valid YAML"]),
        ("mine:\n  method: tfidf\n", ["mine.method must be one of bm25, dense, hybrid"]),
        ("train:\n  show_progress: false\n", ["top-level key `progress`"]),
        ("eval:\n  split: train\n", ["evaluate on a held-out split"]),
    ],
)
def test_bad_config_is_a_clear_error_naming_file_and_key(workspace, tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(f"data: {workspace / 'beir'}\n{text}")
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    message = str(info.value)
    assert message.startswith(str(path))
    for part in expected:
        assert part in message, message
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and "error:" in result.output and "Traceback" not in result.output


def test_null_on_the_command_line_sets_a_key_of_the_file_to_null():
    """`densefit run examples/scifact.yaml --eval-distractors null`: the whole corpus, though
    the file says 500; a flag not given leaves the file's value; -1 is refused by name."""
    import typer

    from densefit.cli.options import options_command
    from densefit.config.run import RunCommand, RunConfig

    given: list[dict] = []

    @options_command(RunCommand, overrides=RunConfig)
    def command(options: RunCommand, overrides: dict) -> None:
        given.append(overrides)

    cli = typer.Typer()
    cli.command()(command)
    assert runner.invoke(cli, ["--eval-distractors", "null"]).exit_code == 0
    assert runner.invoke(cli, ["--eval-max-seq-length", "256"]).exit_code == 0
    assert given == [{"eval.distractors": None}, {"eval.max_seq_length": 256}]
    example = REPO / "examples" / "scifact.yaml"
    assert load_run_config(example, given[0]).eval.distractors is None
    assert load_run_config(example, given[1]).eval.distractors == 500
    refused = runner.invoke(cli, ["--eval-distractors", "-1"]).exception  # densefit's app: exit 2
    assert refused.for_cli() == "--eval-distractors must be >= 0, got -1"


def test_the_bundled_example_config_loads():
    config = load_run_config(REPO / "examples" / "scifact.yaml")
    assert Path(config.data) == REPO / "examples" / "scifact"
    assert config.train.memory == "auto" and config.eval.distractors is not None


def test_train_data_as_a_mapping_of_sources_trains_same_source_batches(workspace, tmp_path):
    """``train_data: {name: path}`` (paths relative to the file): several sources, each step
    from one source; the fingerprint covers every source (a rerun skips, a changed source
    retrains)."""
    for name, n in (("faq", 8), ("manual", 12)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pairs.jsonl").write_text(
            "".join(
                json.dumps({"anchor": f"{name} question {i}", "positive": f"{name} answer {i}"})
                + "\n"
                for i in range(n)
            )
        )
    extra = "train_data:\n  faq: faq/pairs.jsonl\n  manual: manual/pairs.jsonl\n"
    config = write_config(tmp_path, workspace, extra)
    loaded = load_run_config(config)
    assert loaded.train_data == {
        "faq": str(tmp_path / "faq" / "pairs.jsonl"),
        "manual": str(tmp_path / "manual" / "pairs.jsonl"),
    }
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(config), "--output", str(out)])
    assert result.exit_code == 0, result.output
    log = [
        json.loads(line) for line in (out / "model" / "train_log.jsonl").read_text().splitlines()
    ]
    steps = [r for r in log if "loss" in r]
    assert sorted({r["source"] for r in steps}) == ["faq", "manual"]
    assert sum(r["examples"] for r in steps) == 20  # 2 + 3 steps of 4 rows
    assert [r["source"] for r in steps].count("faq") == 2
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["train_rows"] == 20
    assert "2 sources (faq 8 rows, manual 12 rows)" in report["data"]["train_source"]
    saved = json.loads((out / "model" / "densefit_config.json").read_text())
    assert set(saved["sources"]) == {"faq", "manual"}

    again = run_pipeline(load_run_config(config, {"output": str(out)}))
    assert "train" in again.skipped
    with (tmp_path / "manual" / "pairs.jsonl").open("a") as f:
        f.write(json.dumps({"anchor": "manual question x", "positive": "manual answer x"}) + "\n")
    changed = run_pipeline(load_run_config(config, {"output": str(out)}))
    assert "train" in changed.ran


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("train_data:\n  faq: nowhere.jsonl\n", ["train_data.faq:", "does not exist"]),
        ("train_data: []\n", ["train_data is an empty list or mapping"]),
        ("train_data: [a.jsonl, 3]\n", ["train_data must be text or a list or a mapping"]),
        (
            "train_data: [a.jsonl, b.jsonl]\nmine: {method: bm25}\n",
            ["train_data names several sources", "densefit mine"],
        ),
    ],
)
def test_bad_train_data_is_a_clear_error(workspace, tmp_path, text, expected):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text(json.dumps({"anchor": "q", "positive": "p"}) + "\n")
    path = tmp_path / "bad.yaml"
    path.write_text(f"data: {workspace / 'beir'}\n{text}")
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    for part in expected:
        assert part in str(info.value), str(info.value)
