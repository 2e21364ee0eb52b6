"""Evaluation during training: when it runs, what it logs, keep-best, early stopping, resume."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from densefit.config.train import TrainConfig
from densefit.data.readers import read_training_data
from densefit.errors import OptionError
from densefit.evaluate import evaluate
from densefit.models import load_model
from densefit.testing import tiny_model
from densefit.training.evaluation import Evaluator, eval_data_for
from densefit.training.loop import train

TOPICS = ["cell", "python", "river", "music", "engine", "bread", "planet", "garden"]


def make_beir(root: Path) -> Path:
    """Eight topics, three documents each; train and dev queries judged against them."""
    root.mkdir(parents=True, exist_ok=True)
    docs = [
        {"_id": f"{t}{i}", "title": "", "text": f"{t} fact number {i} about the {t}"}
        for t in TOPICS
        for i in range(3)
    ]
    queries = [{"_id": f"{t}-q{i}", "text": f"question {i} on {t}"} for t in TOPICS for i in (0, 1)]
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (root / "qrels").mkdir(exist_ok=True)
    head = "query-id\tcorpus-id\tscore\n"
    train = "".join(f"{t}-q0\t{t}{i}\t1\n" for t in TOPICS for i in (0, 1))
    dev = "".join(f"{t}-q1\t{t}2\t1\n" for t in TOPICS)
    (root / "qrels" / "train.tsv").write_text(head + train)
    (root / "qrels" / "dev.tsv").write_text(head + dev)
    return root


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaltrain")
    beir = make_beir(root / "beir")
    tiny_model(root / "tiny").save(str(root / "base"))
    examples, _ = read_training_data(beir, split="train")  # 16 rows
    return root, beir, examples


def config(**kw) -> TrainConfig:
    base = dict(batch_size=4, epochs=2, learning_rate=5e-3, show_progress=False, seed=3)
    return TrainConfig(**{**base, **kw})


def fit(setting, output: Path | None, cfg: TrainConfig, **kw):
    root, beir, examples = setting
    model = load_model(root / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(model, examples, cfg, output_dir=output, eval_data=beir, **kw)
    return model, result


def eval_lines(output: Path) -> list[dict]:
    lines = [json.loads(line) for line in (output / "train_log.jsonl").open()]
    return [r for r in lines if "eval" in r]


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_at_step_0_every_n_and_each_epoch_end_is_logged(setting, tmp_path):
    model, result = fit(setting, tmp_path / "out", config(eval_every=3))  # 4 steps an epoch
    steps = [h["step"] for h in result.evaluation["history"]]
    assert steps == [0, 3, 4, 6, 8]  # step 0, every 3, the epoch ends 4 and 8
    logged = eval_lines(tmp_path / "out")
    assert [r["step"] for r in logged] == steps
    assert all(set(r["eval"]) >= {"ndcg@10", "mrr@10"} for r in logged)
    assert result.evaluation["best"] == max(r["eval"]["ndcg@10"] for r in logged)


def test_evaluating_does_not_change_the_trained_weights(setting, tmp_path):
    root, _, examples = setting
    plain = load_model(root / "base")
    train(plain, examples, config())
    evaluated, _ = fit(setting, None, config(eval_every=1))
    assert same(weights(plain), weights(evaluated))


def test_base_model_is_evaluated_at_step_0(setting):
    root, beir, _ = setting
    _, result = fit(setting, None, config(eval_every=2))
    base = evaluate(load_model(root / "base"), beir, split="dev", metrics=["ndcg@10"])
    first = result.evaluation["history"][0]
    assert first["step"] == 0 and first["eval"]["ndcg@10"] == round(base.metrics["ndcg@10"], 6)


def test_keep_best_saves_the_best_steps_model(setting, tmp_path):
    root, beir, _ = setting
    out = tmp_path / "out"
    cfg = config(eval_every=1, keep_best=True, checkpoint_every=1, keep_checkpoints=100)
    model, result = fit(setting, out, cfg)
    ev = result.evaluation
    values = {h["step"]: h["eval"]["ndcg@10"] for h in ev["history"]}
    assert ev["best"] == max(values.values()) and values[ev["best_step"]] == ev["best"]
    assert ev["best_step"] != ev["final_step"]  # else this test would not tell them apart
    saved = load_model(out)
    again = evaluate(saved, beir, split="dev", metrics=["ndcg@10"]).metrics["ndcg@10"]
    assert round(again, 6) == ev["best"]
    if ev["best_step"]:  # the checkpoint of that step holds the same weights
        ckpt = torch.load(out / "checkpoints" / f"step-{ev['best_step']:06d}" / "model.pt")
        assert same(weights(saved), ckpt)
    assert same(weights(saved), weights(model))  # the returned model is the saved one
    assert not (out / "best").exists()


def test_early_stopping_stops_after_patience_evaluations_without_improvement(setting, tmp_path):
    _, result = fit(setting, tmp_path / "out", config(eval_every=1, early_stopping_patience=2))
    ev = result.evaluation
    assert ev["stopped_early"] and result.steps < 8
    assert ev["final_step"] == result.steps == ev["best_step"] + 2
    later = [h["eval"]["ndcg@10"] for h in ev["history"] if h["step"] > ev["best_step"]]
    assert len(later) == 2 and all(v <= ev["best"] for v in later)


class Crash(Exception):
    pass


@pytest.mark.parametrize("crash_at", [2, 5])
def test_a_resumed_run_makes_the_same_decisions(setting, tmp_path, crash_at):
    cfg = config(epochs=3, eval_every=1, keep_best=True, early_stopping_patience=3,
                 checkpoint_every=2)  # fmt: skip
    reference, ref = fit(setting, tmp_path / "ref", cfg)

    def crash(record):
        if record["step"] == crash_at:
            raise Crash

    with pytest.raises(Crash):
        fit(setting, tmp_path / "out", cfg, on_step=crash)
    model, result = fit(setting, tmp_path / "out", cfg, resume=True)
    assert result.evaluation["best_step"] == ref.evaluation["best_step"]
    assert result.evaluation["history"] == [
        {**h, "eval_seconds": r["eval_seconds"]}
        for h, r in zip(ref.evaluation["history"], result.evaluation["history"], strict=True)
    ]
    assert (
        result.steps == ref.steps
        and result.evaluation["stopped_early"] == ref.evaluation["stopped_early"]
    )
    assert same(weights(model), weights(reference))
    steps = [r["step"] for r in eval_lines(tmp_path / "out")]
    assert steps == [h["step"] for h in ref.evaluation["history"]]  # each evaluation once


def test_eval_max_docs_searches_judged_documents_plus_seeded_others(setting):
    _, beir, _ = setting
    evaluator = Evaluator(beir, config(eval_max_docs=12))
    assert evaluator.corpus["documents"] == 12 and evaluator.corpus["judged_documents"] == 8
    again = Evaluator(beir, config(eval_max_docs=12))
    assert set(again.dataset.corpus) == set(evaluator.dataset.corpus)


def test_eval_options_are_checked_and_evaluation_needs_data(tmp_path):
    with pytest.raises(OptionError, match="unknown metric"):
        TrainConfig(eval_metric="ndcg")
    assert TrainConfig(eval_metric="nDCG@5").eval_metric == "ndcg@5"
    with pytest.raises(ValueError, match="pass --eval-data"):
        eval_data_for(TrainConfig(keep_best=True), None, tmp_path / "train.jsonl")
    assert eval_data_for(TrainConfig(keep_best=True), None, tmp_path) == tmp_path
    assert eval_data_for(TrainConfig(), None, tmp_path) is None  # not asked for: off


def test_cli_flags_end_to_end(setting, tmp_path):
    from typer.testing import CliRunner

    from densefit.cli.app import app

    root, beir, _ = setting
    out = tmp_path / "cli"
    args = ["train", str(beir), "--model", str(root / "base"), "--output", str(out),
            "--batch-size", "4", "--epochs", "2", "--lr", "5e-3", "--eval-every", "2",
            "--eval-metric", "mrr@10", "--eval-max-docs", "20", "--keep-best",
            "--early-stopping-patience", "5", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "best mrr@10" in result.output and "--keep-best" in result.output
    logged = eval_lines(out)
    assert [r["step"] for r in logged] == [0, 2, 4, 6, 8]
    saved = json.loads((out / "densefit_config.json").read_text())
    assert saved["eval_metric"] == "mrr@10" and saved["evaluation"]["corpus"]["documents"] == 20
    assert (out / "README.md").is_file()
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"query": "a", "positive": "b"}\n')
    bad = CliRunner().invoke(app, ["train", str(data), "--model", str(root / "base"),
                                   "--output", str(tmp_path / "x"), "--keep-best"])  # fmt: skip
    assert bad.exit_code == 2 and "pass --eval-data" in bad.output


def test_densefit_run_evaluates_during_training_and_plots_the_curve(setting, tmp_path):
    from typer.testing import CliRunner

    from densefit.cli.app import app

    root, beir, _ = setting
    path = tmp_path / "run.yaml"
    path.write_text(
        f"data: {beir}\nmodel: {root / 'base'}\nprogress: false\n"
        "train:\n  batch_size: 4\n  epochs: 2\n  learning_rate: 5.0e-3\n  memory: plain\n"
        "  eval_every: 3\n  keep_best: true\neval:\n  split: dev\n"
    )
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(path), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "plots" / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "report.json").read_text())
    during = report["eval_during_training"]
    assert during["evaluations"] == 5 and during["base"]["step"] == 0 and during["kept_best"]
    assert report["train"]["steps"] == 8  # the step records only, not the evaluations
    md = (out / "report.md").read_text()
    assert "## Evaluation during training" in md and f"best (step {during['best']['step']})" in md
    assert "## Evaluation during training" in (out / "model" / "README.md").read_text()


def test_an_interrupted_keep_best_run_can_be_rerun_from_scratch_and_a_missing_split_says_so(
    setting, tmp_path
):
    cfg = config(eval_every=1, keep_best=True)

    def crash(record):
        if record["step"] == 3:
            raise Crash

    with pytest.raises(Crash):
        fit(setting, tmp_path / "out", cfg, on_step=crash)
    assert (tmp_path / "out" / "best" / "modules.json").is_file()  # usable mid-run
    _, result = fit(setting, tmp_path / "out", cfg)  # no resume: starts over, no refusal
    assert result.steps == 8 and not (tmp_path / "out" / "best").exists()
    with pytest.raises(FileNotFoundError, match="--eval-split"):
        fit(setting, None, config(eval_every=1, eval_split="test"))
