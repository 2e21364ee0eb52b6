"""Checkpoint files: atomic writes, manifest checksums, fall-back past bad ones, pruning,
disk full, nothing outside the output folder. (Kill-and-resume runs: tests/test_resume.py.)"""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import random
import warnings

import numpy as np
import pytest
import torch

from densefit import TrainConfig, TrainingExample, train
from densefit.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    resume_checkpoint,
    rng_state,
    set_rng_state,
    truncate_log,
    verify_checkpoint,
)

checkpoint_module = importlib.import_module("densefit.training.checkpoint")

ROWS = [
    TrainingExample(f"what is the cell {i}", f"the protein gene {i}", (f"python {i}",),
                    origin=f"mem:{i}")
    for i in range(8)
]  # fmt: skip


def cfg(**kw) -> TrainConfig:
    # 8 rows, 4 per step: 2 steps per epoch
    return TrainConfig(**{"batch_size": 4, "epochs": 2, "show_progress": False, **kw})


def names(folder) -> list[str]:
    return [p.name for p in list_checkpoints(folder)]


def test_a_checkpoint_has_every_part_and_a_manifest_of_checksums(tiny, tmp_path):
    out = tmp_path / "out"
    train(tiny, ROWS, cfg(checkpoint_every=3, keep_checkpoints=5), output_dir=out)
    folder = out / "checkpoints"
    # every 3 steps, at each epoch end (2, 4), after the last step (4)
    assert names(folder) == ["step-000004", "step-000003", "step-000002"]
    assert sorted(p.name for p in folder.iterdir()) == names(folder)[::-1]  # no leftovers
    step3 = folder / "step-000003"
    manifest = json.loads((step3 / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["model.pt", "state.json", "trainer.pt"]
    for name, meta in manifest["files"].items():
        data = (step3 / name).read_bytes()
        assert meta == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    state = json.loads((step3 / "state.json").read_text())
    assert (state["step"], state["epoch"], state["batch"], state["seen"]) == (3, 1, 1, 12)
    assert state["memory_plan"]["strategy"] == "plain"
    assert state["guard"] == {"total": 0, "in_a_row": 0}
    assert state["config"]["checkpoint_every"] == 3 and state["data"]["rows"] == 8
    trainer = torch.load(step3 / "trainer.pt", weights_only=True)
    assert {"optimizer", "scheduler", "scaler", "rng"} <= trainer.keys()
    assert trainer["scheduler"]["last_epoch"] == 3
    assert verify_checkpoint(step3).step == 3


def test_only_the_newest_k_are_kept_and_zero_writes_none(tiny, tmp_path):
    train(tiny, ROWS, cfg(epochs=3, checkpoint_every=1), output_dir=tmp_path / "two")
    assert names(tmp_path / "two" / "checkpoints") == ["step-000006", "step-000005"]
    train(tiny, ROWS, cfg(keep_checkpoints=0), output_dir=tmp_path / "none")
    assert not (tmp_path / "none" / "checkpoints").exists()
    with pytest.raises(ValueError, match="checkpoint_every=2 needs output_dir"):
        train(tiny, ROWS, cfg(checkpoint_every=2))


def _flip_byte(folder):
    data = bytearray((folder / "model.pt").read_bytes())
    data[100] ^= 1
    (folder / "model.pt").write_bytes(bytes(data))


def _manifest(folder, **files):
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"].update(files)
    (folder / "manifest.json").write_text(json.dumps(manifest))


DAMAGE = {
    "flipped byte": (_flip_byte, "sha256 does not match"),
    "truncated file": (lambda f: (f / "trainer.pt").write_bytes((f / "trainer.pt").read_bytes()[:50]),
                       "bytes, the manifest says"),
    "no manifest": (lambda f: (f / "manifest.json").unlink(), "no manifest.json"),
    "garbled manifest": (lambda f: (f / "manifest.json").write_text('{"files": [1'), "unreadable"),
    "missing file": (lambda f: (f / "model.pt").unlink(), "model.pt: missing"),
    "unsafe name": (lambda f: _manifest(f, **{"../../escape": {"bytes": 1, "sha256": "0"}}),
                    "unsafe file name"),
}  # fmt: skip


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_bad_newest_checkpoint_is_skipped_with_a_warning(tiny, tmp_path, damage):
    out = tmp_path / "out"
    train(tiny, ROWS, cfg(checkpoint_every=1), output_dir=out)
    harm, reason = DAMAGE[damage]
    harm(out / "checkpoints" / "step-000004")
    with pytest.warns(RuntimeWarning, match=f"skipping checkpoint step-000004: .*{reason}"):
        found = latest_checkpoint(out / "checkpoints")
    assert found.step == 3


def test_no_usable_checkpoint_is_a_clear_error(tiny, tmp_path):
    out = tmp_path / "out"
    train(tiny, ROWS, cfg(checkpoint_every=1), output_dir=out)
    for folder in list_checkpoints(out / "checkpoints"):
        _flip_byte(folder)
    with (
        pytest.warns(RuntimeWarning),
        pytest.raises(CheckpointError, match="none of the checkpoints is usable"),
    ):
        resume_checkpoint(True, out)
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        resume_checkpoint(tmp_path / "nowhere", None)
    with pytest.raises(ValueError, match="pass output_dir"):
        resume_checkpoint(True, None)
    # a folder of checkpoints is also accepted as --resume-from: its newest good one
    train(tiny, ROWS, cfg(), output_dir=tmp_path / "good")
    assert resume_checkpoint(tmp_path / "good" / "checkpoints", None).step == 4


def test_disk_full_during_a_checkpoint_warns_cleans_up_and_training_goes_on(
    tiny, tmp_path, monkeypatch
):
    original = checkpoint_module.write_part

    def full_disk(path, write):
        if path.parent.name.startswith(".tmp-step-000003") and path.name == "trainer.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        original(path, write)

    monkeypatch.setattr(checkpoint_module, "write_part", full_disk)
    out = tmp_path / "out"
    with pytest.warns(
        RuntimeWarning, match=r"No space left.*newest checkpoint is still step-000002"
    ):
        result = train(tiny, ROWS, cfg(checkpoint_every=1, keep_checkpoints=3), output_dir=out)
    assert result.steps == 4 and (out / "model.safetensors").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-000001", "step-000002", "step-000004"
    ]  # fmt: skip
    assert verify_checkpoint(out / "checkpoints" / "step-000002").step == 2


def test_nothing_is_written_outside_the_output_folder(tiny, tmp_path):
    before = set(tmp_path.iterdir())
    out = tmp_path / "out"
    train(tiny, ROWS, cfg(checkpoint_every=1), output_dir=out)
    train(tiny, ROWS, cfg(checkpoint_every=1), output_dir=out, resume=True)
    assert set(tmp_path.iterdir()) == before | {out}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="not a link elsewhere"):
        train(tiny, ROWS, cfg(), output_dir=linked)
    assert not any(elsewhere.iterdir())


def test_truncate_log_drops_later_steps_and_a_half_written_line(tmp_path):
    log = tmp_path / "train_log.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)]
    log.write_text("\n".join(lines) + '\n{"step": 5, "lo')
    assert truncate_log(log, 2) == 3
    assert log.read_text() == lines[0] + "\n" + lines[1] + "\n"
    assert truncate_log(tmp_path / "absent.jsonl", 2) == 0


def test_rng_states_round_trip():
    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


def test_a_fresh_run_into_an_old_output_warns_and_its_checkpoints_win(tiny, tmp_path):
    out = tmp_path / "out"
    train(tiny, ROWS, cfg(epochs=3), output_dir=out)
    with pytest.raises(ValueError, match="other options .*max_steps"):
        train(tiny, ROWS, cfg(epochs=3, max_steps=1), output_dir=out)  # not without overwrite
    with pytest.warns(UserWarning, match="checkpoints of an earlier run .*pass --resume"):
        train(tiny, ROWS, cfg(epochs=3, max_steps=1), output_dir=out, overwrite=True)
    # written later, so newest, though its step number is smaller
    assert latest_checkpoint(out / "checkpoints").step == 1


def test_resume_refuses_other_options_and_warns_about_other_data(tiny, tmp_path):
    out = tmp_path / "out"
    train(tiny, ROWS, cfg(max_steps=2), output_dir=out)
    with pytest.raises(CheckpointError, match=r"batch_size=4 \(now 2\).*pass the same options"):
        train(tiny, ROWS, cfg(max_steps=2, batch_size=2), output_dir=out, resume=True)
    with pytest.warns(UserWarning, match="training data differs"):
        train(tiny, ROWS[::-1], cfg(max_steps=2), output_dir=out, resume=True)


def test_the_strategy_after_out_of_memory_halving_is_restored(tiny, tmp_path, monkeypatch):
    from densefit.memory.strategies import CachedStrategy

    original = CachedStrategy.forward_backward

    def flaky(self, *args, **kwargs):
        if self.chunk_size > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, *args, **kwargs)

    out = tmp_path / "out"
    config = cfg(memory="cache", chunk_size=8, max_steps=3, checkpoint_every=1)
    monkeypatch.setattr(CachedStrategy, "forward_backward", flaky)

    def crash(record):
        raise KeyError("killed after step 1")

    with pytest.warns(RuntimeWarning, match="out of memory"), pytest.raises(KeyError):
        train(tiny, ROWS, config, output_dir=out, on_step=crash)
    monkeypatch.undo()
    saved = latest_checkpoint(out / "checkpoints").state["memory_plan"]
    assert (saved["chunk_size"], saved["oom_retries"]) == (2, 2)
    records = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no new out-of-memory halving
        train(tiny, ROWS, config, output_dir=out, resume=True, on_step=records.append)
    assert [(r["step"], r["chunk_size"], r["oom_retries"]) for r in records] == [
        (2, 2, 2),
        (3, 2, 2),
    ]
