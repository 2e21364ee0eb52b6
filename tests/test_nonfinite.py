"""Numerical guards: a NaN step is skipped and counted; too many in a row stop the run."""

from __future__ import annotations

import importlib
import itertools
import json

import pytest
import torch
from typer.testing import CliRunner

from densefit import TrainConfig, TrainingExample, train
from densefit.training.guards import NonFiniteError, NonFiniteGuard, guarded_step

objective = importlib.import_module("densefit.training.objective")

ROWS = [
    TrainingExample(f"what is the cell {i}", f"the protein gene {i}", (f"python {i}",),
                    origin=f"data.jsonl:{i + 1}")
    for i in range(16)
]  # fmt: skip


def cfg(**kw) -> TrainConfig:
    return TrainConfig(
        **{"batch_size": 4, "learning_rate": 2e-5, "epochs": 2, "show_progress": False, **kw}
    )


def inject_nan(monkeypatch, steps: set[int]) -> None:
    """The test hook: the loss of these steps (1-based; one micro-batch per step) is NaN."""
    original = objective.make_loss_fn
    calls = itertools.count(1)

    def make_loss_fn(*args, **kwargs):
        loss_fn, call = original(*args, **kwargs), next(calls)
        return (lambda emb: loss_fn(emb) * float("nan")) if call in steps else loss_fn

    monkeypatch.setattr(objective, "make_loss_fn", make_loss_fn)


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_nan_step_is_skipped_counted_and_logged(tiny, tmp_path, monkeypatch):
    inject_nan(monkeypatch, {2, 5})
    after, records = {}, []

    def on_step(record):
        records.append(record)
        after[record["step"]] = weights(tiny).clone()

    out = tmp_path / "out"
    result = train(tiny, ROWS, cfg(), output_dir=out, on_step=on_step)
    assert result.steps == 8 and result.skipped_nonfinite == 2
    assert [r["skipped"] for r in records] == [False, True, False, False, True, False, False, False]
    assert [r["skipped_nonfinite"] for r in records] == [0, 1, 1, 1, 2, 2, 2, 2]
    assert torch.equal(after[2], after[1]) and torch.equal(after[5], after[4])  # no update
    assert not torch.equal(after[3], after[2])
    # the scheduler did not step either: the step after the skipped one runs at its rate
    assert records[2]["lr"] == records[1]["lr"] and records[3]["lr"] != records[2]["lr"]
    log = [json.loads(line) for line in (out / "train_log.jsonl").open()]
    assert [r["skipped_nonfinite"] for r in log] == [0, 1, 1, 1, 2, 2, 2, 2]
    assert all(torch.isfinite(weights(tiny)))


def test_too_many_nan_steps_in_a_row_stop_with_advice(tiny, tmp_path, monkeypatch):
    inject_nan(monkeypatch, {2, 3, 4})
    out = tmp_path / "out"
    with pytest.raises(NonFiniteError) as caught:
        train(tiny, ROWS, cfg(max_nonfinite=3, checkpoint_every=1), output_dir=out)
    message = str(caught.value)
    for part in ("step 4:", "3 steps in a row", "steps 2-4", "after step 1", "lower learning rate",
                 "--lr, now 2e-05", "data rows", "data.jsonl:", "--max-nonfinite"):  # fmt: skip
        assert part in message, part
    log = [json.loads(line) for line in (out / "train_log.jsonl").open()]
    assert [r["skipped"] for r in log] == [False, True, True, True]
    # the newest checkpoint is a good one to resume from after fixing the cause
    assert (out / "checkpoints" / "step-000003").is_dir()


def test_scattered_nan_steps_do_not_stop_the_run_and_zero_means_never(tiny, monkeypatch):
    inject_nan(monkeypatch, {1, 3, 5, 7})
    assert train(tiny, ROWS, cfg(max_nonfinite=2)).skipped_nonfinite == 4
    inject_nan(monkeypatch, set(range(1, 8)))  # 7 bad steps in a row, then a good one
    assert train(tiny, ROWS, cfg(max_nonfinite=0)).skipped_nonfinite == 7


def test_a_run_whose_every_step_was_skipped_ends_with_an_error(tiny, tmp_path, monkeypatch):
    """Shorter than --max-nonfinite (or with 0: never stop early), it still fails at the end:
    no 'final loss nan' success, and no model saved as if it had trained."""
    for limit in (5, 0):
        inject_nan(monkeypatch, set(range(1, 100)))
        records, out = [], tmp_path / f"out{limit}"
        with pytest.raises(NonFiniteError, match=r"all 3 steps of the run .*never updated") as err:
            train(
                tiny,
                ROWS,
                cfg(max_steps=3, max_nonfinite=limit),
                output_dir=out,
                on_step=records.append,
            )
        assert len(records) == 3 and all(r["skipped"] for r in records)  # ran to the end
        assert "data.jsonl:" in str(err.value) and "lower learning rate" in str(err.value)
        assert not (out / "densefit_config.json").exists()


def test_cli_stops_with_the_message_and_exit_code_2(tiny, tmp_path, monkeypatch):
    from densefit.cli import app

    tiny.save(str(tmp_path / "base"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"anchor": r.query, "positive": r.positive}) + "\n"
                            for r in ROWS))  # fmt: skip
    inject_nan(monkeypatch, set(range(1, 9)))
    result = CliRunner().invoke(app, ["train", str(data), "-m", str(tmp_path / "base"), "-o",
                                      str(tmp_path / "out"), "--batch-size", "4",
                                      "--max-nonfinite", "2", "--no-progress"])  # fmt: skip
    text = " ".join(result.output.split())
    assert (
        result.exit_code == 2 and "error: step 2: the loss or gradient norm was not finite" in text
    )
    # shorter than --max-nonfinite: the end of the run fails the same way
    inject_nan(monkeypatch, set(range(1, 9)))
    result = CliRunner().invoke(app, ["train", str(data), "-m", str(tmp_path / "base"), "-o",
                                      str(tmp_path / "short"), "--batch-size", "4",
                                      "--max-steps", "2", "--no-progress"])  # fmt: skip
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "error: all 2 steps of the run had a non-finite" in text


# ----------------------------------------------------------------------------- guarded_step


def linear_setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return model, optimizer, scheduler


def backward(model, x, scaler=None):
    loss = model(torch.tensor([x])).sum()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return float(loss.detach())


def test_a_finite_loss_with_an_infinite_gradient_is_skipped_without_a_scaler():
    model, optimizer, scheduler = linear_setup()
    before = [p.detach().clone() for p in model.parameters()]
    backward(model, [1.0, 2.0, 3.0])
    model.weight.grad.fill_(float("inf"))  # a finite loss, an overflowing gradient
    outcome = guarded_step(model, optimizer, scheduler, None, loss=1.0, max_grad_norm=None)
    assert outcome.skipped and outcome.counts and outcome.grad_norm == float("inf")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scheduler.last_epoch == 0 and not optimizer.state and model.weight.grad is None


def test_grad_scaler_skips_are_detected_and_count_only_below_scale_one():
    """fp16 path, on CPU: the real GradScaler does its own skip; we count it."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model, optimizer, scheduler = linear_setup()
    guard = NonFiniteGuard(limit=2)

    def step(grad: float, loss: float = 1.0):
        backward(model, [1.0, 2.0, 3.0], scaler)
        model.weight.grad.fill_(grad)
        outcome = guarded_step(model, optimizer, scheduler, scaler, loss=loss, max_grad_norm=1.0)
        guard.update(outcome)
        return outcome

    ok = step(0.5)
    assert not ok.skipped and scheduler.last_epoch == 1
    # overflow while the scale is above 1: the scaler searching for its scale, not a NaN run
    first, second = step(float("inf")), step(float("inf"))
    assert first.skipped and not first.counts and second.skipped and not second.counts
    assert scaler.get_scale() == 1.0 and scheduler.last_epoch == 1
    third = step(float("inf"))  # overflowing at scale 1: the gradient itself is not finite
    assert third.skipped and third.counts and guard.in_a_row == 1 and guard.total == 3
    # a non-finite loss is skipped without asking the scaler, which backs off as it would
    weight = model.weight.detach().clone()
    nan_loss = step(0.5, loss=float("nan"))
    assert nan_loss.skipped and nan_loss.counts and scaler.get_scale() == 0.25
    assert torch.equal(weight, model.weight) and scheduler.last_epoch == 1
    with pytest.raises(NonFiniteError, match="--amp bf16 instead of fp16"):
        guard.check(5, {"loss": float("nan")}, amp="fp16")
    assert not step(0.5).skipped and guard.in_a_row == 0
