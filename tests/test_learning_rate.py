"""learning_rate "auto" (a rule in the batch size) and the few-steps warning (issue 16)."""

import json
import warnings

import pytest
from typer.testing import CliRunner

from densefit import TrainConfig, TrainingExample, train
from densefit.cli import app
from densefit.config.train import auto_learning_rate
from densefit.errors import OptionError
from densefit.training.setup import FEW_STEPS, setup_run


def rows(n: int) -> list[TrainingExample]:
    return [
        TrainingExample(f"what is cell {i}", f"cell {i} is a protein " * (i % 3 + 1))
        for i in range(n)
    ]


def peak_lr(run) -> float:
    return run.optimizer.param_groups[0]["initial_lr"]  # before warm-up and decay


def test_the_rule_is_2e5_at_batch_32_grows_linearly_and_is_capped():
    assert auto_learning_rate(32) == pytest.approx(2e-5)
    assert auto_learning_rate(128) == pytest.approx(8e-5)
    assert auto_learning_rate(256) == pytest.approx(1.6e-4)
    assert auto_learning_rate(512) == pytest.approx(2e-4)  # the cap, from batch 320
    assert auto_learning_rate(8) == pytest.approx(5e-6)
    assert auto_learning_rate(2**20) == pytest.approx(2e-4)  # the cap
    sizes = [1, 2, 16, 32, 100, 512, 2048, 4096, 65536]
    values = [auto_learning_rate(b) for b in sizes]
    assert values == sorted(values)  # a bigger batch never gets a smaller step


def test_auto_is_the_default_and_a_given_learning_rate_is_read_and_checked():
    assert TrainConfig().learning_rate == "auto"
    assert TrainConfig(batch_size=128).peak_learning_rate == pytest.approx(8e-5)
    assert TrainConfig(learning_rate="3e-5").learning_rate == 3e-5  # from a flag or YAML
    assert TrainConfig(learning_rate="AUTO").learning_rate == "auto"
    for bad in ("fast", 0, -1e-5, "inf"):
        with pytest.raises(OptionError, match="learning_rate must be auto or a number > 0"):
            TrainConfig(learning_rate=bad)


def test_the_optimizer_uses_the_rule_and_the_run_records_it(tiny, tmp_path):
    config = TrainConfig(batch_size=8, max_steps=2, show_progress=False)
    run = setup_run(tiny, rows(16), config)
    assert peak_lr(run) == pytest.approx(auto_learning_rate(8))
    assert run.config.learning_rate == pytest.approx(auto_learning_rate(8))  # guards, checkpoints
    out = tmp_path / "out"
    result = train(tiny, rows(16), config, output_dir=out)
    assert result.plan["learning_rate"] == pytest.approx(auto_learning_rate(8))
    assert result.plan["learning_rate_from"] == "auto"
    saved = json.loads((out / "densefit_config.json").read_text())
    assert saved["learning_rate"] == pytest.approx(auto_learning_rate(8))
    assert saved["memory_plan"]["learning_rate_from"] == "auto"
    logged = [json.loads(line)["lr"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert 0 < max(logged) <= auto_learning_rate(8)


def test_a_rerun_with_auto_is_the_same_run_and_another_batch_size_is_not(tiny, tmp_path):
    out = tmp_path / "out"
    config = TrainConfig(batch_size=8, max_steps=1, keep_checkpoints=0, show_progress=False)
    train(tiny, rows(16), config, output_dir=out)
    train(tiny, rows(16), config, output_dir=out)  # auto gives the saved value again
    given = TrainConfig(**{**config.to_dict(), "learning_rate": auto_learning_rate(8)})
    train(tiny, rows(16), given, output_dir=out)  # the same value, given: the same run
    with pytest.raises(ValueError, match=r"learning_rate=5e-06 \(now 0.0001\)"):
        train(
            tiny,
            rows(16),
            TrainConfig(**{**config.to_dict(), "learning_rate": 1e-4}),
            output_dir=out,
        )


def test_a_given_learning_rate_wins_over_the_rule(tiny):
    run = setup_run(
        tiny,
        rows(16),
        TrainConfig(batch_size=8, learning_rate=1e-4, max_steps=1, show_progress=False),
    )
    assert peak_lr(run) == pytest.approx(1e-4)
    assert run.report()["learning_rate_from"] == "given"


def test_few_optimizer_steps_warn_with_what_to_do(tiny):
    data = rows(FEW_STEPS * 32 + 80)  # 400 rows: batch 128 is 4 steps an epoch
    with pytest.warns(
        UserWarning,
        match=r"batch 128 over 400 rows is 4 optimizer steps "
        r"\(1 epoch\).*--epochs 3 or more.*--batch-size",
    ):
        setup_run(tiny, data, TrainConfig(batch_size=128, show_progress=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        setup_run(tiny, data, TrainConfig(batch_size=32, show_progress=False))  # 13 steps
        setup_run(tiny, data, TrainConfig(batch_size=128, epochs=3, show_progress=False))
        setup_run(tiny, data, TrainConfig(batch_size=128, max_steps=2, show_progress=False))
    with warnings.catch_warnings(record=True) as caught:  # tiny data: not "few steps"
        warnings.simplefilter("always")
        setup_run(tiny, rows(40), TrainConfig(batch_size=128, show_progress=False))
    assert [str(w.message).split(":")[0] for w in caught] == [
        "batch_size 128 is larger than the data (40 rows)"
    ]


runner = CliRunner()


def test_cli_prints_the_learning_rate_and_an_explicit_lr_wins(tiny, tmp_path):
    model = tmp_path / "model"
    tiny.save(str(model))
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(json.dumps({"query": r.query, "positive": r.positive}) + "\n" for r in rows(12))
    )
    base = [
        "train",
        str(data),
        "--model",
        str(model),
        "--batch-size",
        "8",
        "--max-steps",
        "1",
        "--no-progress",
    ]
    auto = runner.invoke(app, [*base, "--output", str(tmp_path / "a")])
    assert auto.exit_code == 0, auto.output
    text = " ".join(auto.output.split())  # the console wraps long lines
    assert "on 12 rows" in text and text.count("lr 5e-06 (auto, from the batch size)") == 2
    given = runner.invoke(app, [*base, "--output", str(tmp_path / "b"), "--lr", "3e-5"])
    assert given.exit_code == 0, given.output
    text = " ".join(given.output.split())
    assert text.count("lr 3e-05") == 2 and "auto" not in text
    saved = json.loads((tmp_path / "b" / "densefit_config.json").read_text())
    assert saved["learning_rate"] == 3e-5
    bad = runner.invoke(app, [*base, "--output", str(tmp_path / "c"), "--lr", "fast"])
    assert bad.exit_code == 2 and "--lr must be auto or a number > 0" in " ".join(
        bad.output.split()
    )
