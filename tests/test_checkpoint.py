"""Checkpoint files: atomic writes, manifest checksums, fall-back past bad ones, pruning,
disk full, nothing outside the output folder. (Kill-and-resume runs: tests/test_resume.py.)"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import importlib
import json
import os
import random
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

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


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


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


# Paths Python opened for writing, created, renamed, copied or removed while a test watches
# (None: nobody watches). sys.addaudithook cannot be undone, so the hook is added once and
# does nothing unless a test sets this list.
_WRITTEN: list[str] | None = None
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# audit event: (argument that is the written path, arguments that are directory descriptors)
_DESTINATION = {"os.rename": (1, (2, 3)), "os.link": (1, (2, 3)), "os.symlink": (1, (2,)),
                "os.remove": (0, (1,)), "os.rmdir": (0, (1,)), "os.mkdir": (0, (2,)),
                "os.truncate": (0, ()), "shutil.copyfile": (1, ()), "shutil.copytree": (1, ()),
                "shutil.rmtree": (0, ())}  # fmt: skip
_AUDIT_ADDED = False


def _audit(event: str, args: tuple) -> None:
    if _WRITTEN is None:
        return
    if event == "open":
        path, _, flags = args
        if not flags & _WRITE_FLAGS:
            return
    elif event in _DESTINATION:
        where, descriptors = _DESTINATION[event]
        if any(args[i] not in (None, -1) for i in descriptors if i < len(args)):
            return  # relative to a directory descriptor: shutil.rmtree's walk (audited above)
        path = args[where]
    else:
        return
    if not isinstance(path, int):
        _WRITTEN.append(os.path.abspath(os.fsdecode(path)))


@contextlib.contextmanager
def watched_writes() -> Iterator[list[str]]:
    """Record every path Python writes (see :data:`_WRITTEN`) inside the block."""
    global _WRITTEN, _AUDIT_ADDED
    if not _AUDIT_ADDED:
        sys.addaudithook(_audit)
        _AUDIT_ADDED = True
    _WRITTEN = written = []
    try:
        yield written
    finally:
        _WRITTEN = None


def test_nothing_is_written_outside_the_output_folder(tiny, tmp_path, monkeypatch):
    """Train with checkpoints, resume, train again with overwrite: every path Python writes,
    creates, renames or removes, and every path given to torch.save, is inside the output
    folder (an audit hook sees them wherever they are), and the working directory, HOME and
    TMPDIR, pointed at watched folders, stay empty (that shows writes of native code, such as
    safetensors', there too).
    """
    for name in ("cwd", "home", "tmp"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for variable in ("TMPDIR", "TEMP", "TMP"):
        monkeypatch.setenv(variable, str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert tempfile.gettempdir() == str(tmp_path / "tmp")

    def everything() -> set:
        return {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}

    before = everything()
    out = tmp_path / "out"
    save = torch.save  # a path given to torch.save is written by native code: record it

    def recorded_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and _WRITTEN is not None:
            _WRITTEN.append(os.path.abspath(os.fsdecode(f)))
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", recorded_save)
    with watched_writes() as written:
        train(tiny, ROWS, cfg(checkpoint_every=1), output_dir=out)
        train(tiny, ROWS, cfg(checkpoint_every=1), output_dir=out, resume=True)
        with pytest.warns(UserWarning, match="checkpoints of an earlier run"):
            train(tiny, ROWS, cfg(checkpoint_every=1, epochs=1), output_dir=out, overwrite=True)
    outside = sorted({p for p in written if "__pycache__" not in p and not _inside(Path(p), out)})
    assert not outside, outside
    assert any(p.endswith("trainer.pt") for p in written)  # the hook saw the checkpoints
    new = everything() - before
    assert new and all(p.parts[0] == "out" for p in new), sorted(map(str, new))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="not a link elsewhere"):
        train(tiny, ROWS, cfg(), output_dir=linked)
    assert not any(elsewhere.iterdir())


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


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
    changed = dict(batch_size=2, learning_rate=1e-3, scale=10.0, seed=3, symmetric=True)
    with pytest.raises(CheckpointError, match="pass the same options") as refused:
        train(tiny, ROWS, cfg(max_steps=2, **changed), output_dir=out, resume=True)
    for shown in (
        "batch_size=4 (now 2)",
        "learning_rate=2.5e-06 (now 0.001)",
        "scale=20.0 (now 10.0)",
        "seed=42 (now 3)",
        "symmetric=False (now True)",
    ):
        assert shown in str(refused.value), shown  # every changed option is named
    with pytest.warns(UserWarning, match="training data differs"):
        train(tiny, ROWS[::-1], cfg(max_steps=2), output_dir=out, resume=True)


# Another valid value of every option that changes the weights (a resume with it is refused);
# the others are declared affects_weights=False (accepted). A new TrainConfig field must be added
# to one or the other: test_each_option_is_refused_or_accepted_on_resume fails until it is.
OTHER_VALUE = {
    "batch_size": 2, "epochs": 3, "max_steps": 3, "learning_rate": 1e-3, "warmup_steps": 1,
    "weight_decay": 0.1, "max_grad_norm": None, "seed": 3, "loss": "margin_mse", "scale": 10.0,
    "symmetric": True, "similarity": "dot", "matryoshka_dims": [16, 8],
    "matryoshka_weights": [1.0, 0.5], "query_prompt": "query: ", "document_prompt": "passage: ",
    "amp": "bf16", "invariant_dropout": False, "mask_false_negatives": False,
    "no_duplicates": True, "max_seq_length": 16, "gradient_accumulation_steps": 2,
    "drop_last": True, "lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.1,
    "lora_target_modules": "query", "save_adapter": True, "gather": "both", "eval_every": 2,
    "eval_split": "test", "eval_metric": "mrr@10", "eval_max_docs": 10, "keep_best": True,
    "early_stopping_patience": 2, "source_batches": "mixed", "source_sampling": "round_robin",
    "source_temperature": 3.0,
}  # fmt: skip
NEEDS = {
    "matryoshka_weights": {"matryoshka_dims": [16, 8]},
    **{
        n: {"lora_r": 4}
        for n in ("lora_alpha", "lora_dropout", "lora_target_modules", "save_adapter")
    },
}
NEUTRAL_VALUE = {
    "show_progress": True, "log_every": 2, "device": "cpu", "checkpoint_every": 3,
    "keep_checkpoints": 5, "max_nonfinite": 2, "memory": "cache", "memory_budget": "1GiB",
    "chunk_size": 2, "token_budget": 64, "loss_block_size": 2, "sort_by_length": False,
    "gradient_checkpointing": True, "keep_graphs": 2, "release_cpu_memory": True,
    "delete_checkpoints": False, "report_to": ["tensorboard"], "eval_runtime": "torch",
    "export": "onnx",
}  # fmt: skip


def test_each_option_is_refused_or_accepted_on_resume(tiny, tmp_path):
    """Each TrainConfig field changed alone: refused, named, when it changes the weights;
    accepted (at most a warning) when it does not."""
    from densefit.config.options import declared_options

    declared = dict((f.name, opt) for f, opt in declared_options(TrainConfig))
    assert set(OTHER_VALUE) | set(NEUTRAL_VALUE) == set(declared)
    assert {n for n, opt in declared.items() if not opt.affects_weights} == set(NEUTRAL_VALUE)
    out = tmp_path / "out"
    train(tiny, ROWS, cfg(max_steps=2), output_dir=out)
    checkpoint = latest_checkpoint(out / "checkpoints")
    saved = checkpoint.state["config"]  # as the run resolved it (learning rate, similarity)
    checkpoint.check_matches(TrainConfig.from_dict(saved), ROWS)  # the same: accepted
    for name, value in OTHER_VALUE.items():
        partners = NEEDS.get(name, {})  # an option that is refused without another one
        config = TrainConfig.from_dict({**saved, **partners, name: value})
        with pytest.raises(CheckpointError, match=rf"[ ,]{name}=") as refused:
            checkpoint.check_matches(config, ROWS)
        named = str(refused.value).count("(now ")
        assert named == 1 + len(partners), refused.value  # that option (and its partners) alone
    for name, value in NEUTRAL_VALUE.items():
        config = TrainConfig.from_dict({**saved, name: value})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the memory plan's warning
            checkpoint.check_matches(config, ROWS)


def test_the_strategy_after_out_of_memory_halving_is_restored(tiny, tmp_path, monkeypatch):
    """Out of memory in step 1, each time after the attempt had accumulated gradients; the run
    is killed after step 1 and resumed: it ends with the weights of a run that used chunk 2
    from the start (the halved plan is restored, and the redone step was that run's step)."""
    from densefit.memory.strategies import CachedStrategy

    original = CachedStrategy.forward_backward

    def flaky(self, *args, **kwargs):
        stats = original(self, *args, **kwargs)  # gradients accumulated, then the error
        if self.chunk_size > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return stats

    reference = copy.deepcopy(tiny)
    out = tmp_path / "out"
    config = cfg(memory="cache", chunk_size=8, max_steps=3, checkpoint_every=1, learning_rate=1e-3)
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
    train(reference, ROWS, cfg(memory="cache", chunk_size=2, max_steps=3, learning_rate=1e-3))
    assert torch.equal(weights(tiny), weights(reference))


def test_a_tiny_model_without_a_folder_leaves_nothing_behind(tmp_path):
    """``tiny_model()`` with no folder writes to a temporary folder of its own, usable while
    the process runs (the model saves from it) and gone when the process exits."""
    import subprocess

    code = (
        "from densefit.testing import tiny_model\n"
        "import os, sys\n"
        "model = tiny_model()\n"
        "model.save(sys.argv[1])\n"
        "print(os.listdir(os.environ['TMPDIR']))\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "saved")],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "densefit-tiny-" in done.stdout  # it was there while the process ran
    assert (tmp_path / "saved" / "modules.json").exists()
    assert list((tmp_path / "tmp").iterdir()) == []
