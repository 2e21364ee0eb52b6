"""Kill a run (exception, SIGKILL at a random step, SIGKILL half-way through a checkpoint
write), resume it, and end with exactly the weights of a run that was never interrupted."""

from __future__ import annotations

import importlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sentence_transformers import SentenceTransformer
from typer.testing import CliRunner

from densefit import TrainConfig, train
from densefit.data.readers import read_training_data
from densefit.testing import tiny_model
from densefit.training.checkpoint import list_checkpoints

CHILD = Path(__file__).with_name("_train_child.py")
# 24 rows, 4 per step: 6 steps per epoch, 24 steps; checkpoints at 5, 6, 10, 12, 15, ...
CONFIG = dict(batch_size=4, epochs=4, learning_rate=1e-3, checkpoint_every=5, show_progress=False)


class Crash(Exception):
    pass


def rows() -> list[dict]:
    return [
        {"anchor": f"what is the cell {i} " * (i % 3 + 1), "positive": f"the protein gene {i}",
         "negative": f"python function {i} " * (i % 2 + 1)}
        for i in range(24)
    ]  # fmt: skip


def load(folder) -> SentenceTransformer:
    return SentenceTransformer(str(folder), device="cpu")


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ in {different[:3]}"


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def logged_steps(output: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output / "train_log.jsonl").open()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The base model, the data, and the uninterrupted reference runs (one per config)."""
    root = tmp_path_factory.mktemp("resume")
    tiny_model(root / "tiny").save(str(root / "base"))
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()), encoding="utf-8")
    examples, _ = read_training_data(data)
    references = {}

    def reference(**config) -> SimpleNamespace:
        key = json.dumps(config, sort_keys=True)
        if key not in references:
            model = load(root / "base")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # gradient accumulation adds no negatives: known
                result = train(
                    model,
                    examples,
                    TrainConfig(**config),
                    output_dir=root / f"ref{len(references)}",
                )
            references[key] = SimpleNamespace(weights=state(model), losses=result.losses)
        return references[key]

    return SimpleNamespace(root=root, base=root / "base", data=data, examples=examples,
                           reference=reference)  # fmt: skip


def resume(run, output: Path, config: dict, **kwargs):
    model = load(run.base)
    result = train(model, run.examples, TrainConfig(**config), output_dir=output, **kwargs)
    return model, result


@pytest.mark.parametrize(
    "crash_at, config",
    [
        (1, CONFIG),  # before the first checkpoint: starts again from step 0
        (6, CONFIG),  # right after an epoch-end checkpoint
        (11, CONFIG),
        (
            7,
            {
                **CONFIG,
                "epochs": 2,
                "memory": "cache",
                "chunk_size": 2,
                "gradient_accumulation_steps": 2,
            },
        ),
    ],
)
def test_resume_after_a_crash_ends_with_identical_weights(run, tmp_path, crash_at, config):
    output = tmp_path / "out"

    def crash(record):
        if record["step"] == crash_at:
            raise Crash

    with pytest.raises(Crash), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradient accumulation adds no negatives: known
        resume(run, output, config, on_step=crash)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, result = resume(run, output, config, resume=True)
    starting_over = [w for w in caught if "starting from step 0" in str(w.message)]
    assert bool(starting_over) == (crash_at < 5)
    reference = run.reference(**config)
    assert_same_weights(state(model), reference.weights)
    steps = 6 * config["epochs"]
    assert result.losses == reference.losses and result.steps == steps
    assert logged_steps(output) == list(range(1, steps + 1))  # each step once, in order


def test_a_resume_with_other_weight_neutral_options_ends_with_identical_weights(run, tmp_path):
    """Logging, checkpointing, guard and memory options may change on resume (the memory
    plan is the checkpoint's, with a warning): the run still ends bit for bit identical."""
    output = tmp_path / "out"

    def crash(record):
        if record["step"] == 11:
            raise Crash

    with pytest.raises(Crash):
        resume(run, output, CONFIG, on_step=crash)
    neutral = {**CONFIG, "log_every": 2, "checkpoint_every": 3, "keep_checkpoints": 4,
               "max_nonfinite": 2, "memory": "cache", "chunk_size": 2, "sort_by_length": False}  # fmt: skip
    with pytest.warns(UserWarning, match="resuming with the checkpoint's memory plan"):
        model, result = resume(run, output, neutral, resume=True)
    reference = run.reference(**CONFIG)
    assert_same_weights(state(model), reference.weights)
    assert result.losses == reference.losses and result.steps == 24


def test_a_resumed_run_keeps_the_planned_kept_graphs_and_token_budget(run, tmp_path, monkeypatch):
    """The strategy that runs after --resume is the checkpoint's plan, kept graphs included
    (they used to fall back to 1 while the plan still said 3), and the run ends identical."""
    from densefit.memory.strategies import CachedStrategy

    config = {**CONFIG, "epochs": 1, "memory": "cache", "token_budget": 40, "keep_graphs": 3}
    output = tmp_path / "out"

    def crash(record):
        if record["step"] == 5:
            raise Crash

    with pytest.raises(Crash):
        resume(run, output, config, on_step=crash)
    used, original = [], CachedStrategy.forward_backward

    def recording(self, *args, **kwargs):
        used.append((self.keep_graphs, self.token_budget, self.chunk_size))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CachedStrategy, "forward_backward", recording)
    model, result = resume(run, output, config, resume=True)
    assert used == [(3, 40, None)]  # step 6, the only one after the checkpoint at step 5
    assert (result.memory_plan.keep_graphs, result.plan["token_budget"]) == (3, 40)
    monkeypatch.undo()
    assert_same_weights(state(model), run.reference(**config).weights)


def spawn(run, output: Path, **spec) -> subprocess.Popen:
    spec = {"base": str(run.base), "data": str(run.data), "output": str(output),
            "config": CONFIG, "threads": torch.get_num_threads(), **spec}  # fmt: skip
    spec_path = output.with_suffix(".json")
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(output.with_suffix(".err"), "wb") as err:  # a file: a full pipe would block
        return subprocess.Popen(
            [sys.executable, str(CHILD), str(spec_path)],
            env=env,
            stdout=err,
            stderr=subprocess.STDOUT,
        )


def wait_for_step(child: subprocess.Popen, output: Path, step: int, timeout: float = 90) -> None:
    log = output / "train_log.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            pytest.fail(f"the run ended before step {step}: {stderr_of(output)}")
        if log.exists() and log.read_bytes().count(b"\n") >= step:
            return
        time.sleep(0.01)
    child.kill()
    pytest.fail(f"no step {step} after {timeout}s")


def stderr_of(output: Path) -> str:
    return output.with_suffix(".err").read_text(errors="replace")[-2000:]


def test_sigkill_at_a_random_step_then_resume_ends_with_identical_weights(run, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    kill_after = rng.randint(4, 18)
    output = tmp_path / "out"
    child = spawn(run, output, step_sleep=0.05)
    wait_for_step(child, output, kill_after)
    time.sleep(rng.uniform(0, 0.08))  # anywhere in the next step: compute, log, checkpoint
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL, f"seed {seed}: {stderr_of(output)}"

    model, result = resume(run, output, CONFIG, resume=True)
    reference = run.reference(**CONFIG)
    assert_same_weights(state(model), reference.weights)
    assert result.losses == reference.losses, f"seed {seed}, killed after step {kill_after}"
    assert logged_steps(output) == list(range(1, 25)), f"seed {seed}"


def test_sigkill_with_several_sources_then_resume_ends_with_identical_weights(run, tmp_path):
    """Three sources, same-source steps drawn by temperature (each source's stream of passes
    runs on across epochs): killed at a random step, resumed, the same weights, losses and
    per-step sources as a run never interrupted."""
    sources = {}
    for name, part in (("faq", rows()[:5]), ("manual", rows()[5:12]), ("code", rows()[12:])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
        sources[name] = str(path)
    config = {**CONFIG, "epochs": 3, "checkpoint_every": 3, "source_sampling": "temperature"}
    ref = load(run.base)
    reference = train(ref, sources, TrainConfig(**config), output_dir=tmp_path / "ref")
    assert reference.steps == 3 * (2 + 2 + 3)  # 5, 7 and 12 rows in steps of 4: a pass each
    seed = int.from_bytes(os.urandom(4), "little")
    kill_after = random.Random(seed).randint(4, 16)
    output = tmp_path / "out"
    child = spawn(run, output, data=sources, config=config, step_sleep=0.05)
    wait_for_step(child, output, kill_after)
    time.sleep(random.Random(seed).uniform(0, 0.08))
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL, f"seed {seed}: {stderr_of(output)}"

    model = load(run.base)
    result = train(model, sources, TrainConfig(**config), output_dir=output, resume=True)
    assert_same_weights(state(model), state(ref))
    assert result.losses == reference.losses, f"seed {seed}, killed after step {kill_after}"
    assert result.sources == reference.sources
    logged = [json.loads(line) for line in (output / "train_log.jsonl").open()]
    expected = [json.loads(line) for line in (tmp_path / "ref" / "train_log.jsonl").open()]
    assert [(r["step"], r["source"]) for r in logged] == [
        (r["step"], r["source"]) for r in expected
    ]


def test_sigkill_half_way_through_a_checkpoint_write_falls_back_to_the_previous_one(run, tmp_path):
    output = tmp_path / "out"
    child = spawn(run, output, kill_in_checkpoint=10)
    assert child.wait(timeout=120) == -signal.SIGKILL, stderr_of(output)
    folder = output / "checkpoints"
    assert [p.name for p in list_checkpoints(folder)] == ["step-000006", "step-000005"]
    [partial] = [p for p in folder.iterdir() if p.name.startswith(".tmp-step-000010")]
    assert (partial / "model.pt").exists() and not (partial / "manifest.json").exists()

    model, result = resume(run, output, CONFIG, resume=True)
    assert_same_weights(state(model), run.reference(**CONFIG).weights)
    assert sorted(p.name for p in folder.iterdir()) == ["step-000020", "step-000024"]


def test_a_corrupt_newest_checkpoint_is_skipped_and_the_run_still_ends_identical(run, tmp_path):
    output = tmp_path / "out"

    def crash(record):
        if record["step"] == 13:
            raise Crash

    with pytest.raises(Crash):
        resume(run, output, CONFIG, on_step=crash)
    newest = output / "checkpoints" / "step-000012" / "trainer.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))

    with pytest.warns(RuntimeWarning, match=r"skipping checkpoint step-000012: .*sha256"):
        model, _ = resume(run, output, CONFIG, resume=True)
    assert_same_weights(state(model), run.reference(**CONFIG).weights)


def test_cli_checkpoint_every_resume_and_resume_from(run, tmp_path, monkeypatch):
    from densefit.cli import app

    args = ["train", str(run.data), "-m", str(run.base), "--batch-size", "4", "--epochs", "2",
            "--lr", "1e-3", "--checkpoint-every", "3", "--keep-checkpoints", "3", "--no-delete-checkpoints",
            "--no-progress"]  # fmt: skip
    runner = CliRunner()
    done = runner.invoke(app, [*args, "-o", str(tmp_path / "ref")])
    assert done.exit_code == 0, done.output

    checkpoint = importlib.import_module("densefit.training.checkpoint")
    original = checkpoint.Checkpointer.save

    def save_then_crash(self, step, **kwargs):
        path = original(self, step, **kwargs)
        if step == 9:
            raise Crash  # killed right after writing step-000009
        return path

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save_then_crash)
    out = tmp_path / "out"
    crashed = runner.invoke(app, [*args, "-o", str(out)])
    # An unexpected exception is the CLI's one line "unexpected error: ...", status 1.
    assert crashed.exit_code == 1 and "\nunexpected error: Crash" in crashed.stderr
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [
        "step-000009", "step-000006", "step-000003"
    ]  # fmt: skip
    monkeypatch.undo()

    resumed = runner.invoke(app, [*args, "-o", str(out), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert_same_weights(state(load(out)), state(load(tmp_path / "ref")))

    again = runner.invoke(
        app, [*args, "-o", str(out), "--resume-from", str(out / "checkpoints" / "step-000006")]
    )
    assert again.exit_code == 0, again.output
    assert_same_weights(state(load(out)), state(load(tmp_path / "ref")))
    assert logged_steps(out) == list(range(1, 13))

    changed = runner.invoke(app, [*args, "--seed", "7", "-o", str(out), "--resume"])
    assert changed.exit_code == 2 and "seed=42 (now 7)" in " ".join(changed.output.split())
