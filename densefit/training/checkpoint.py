"""Crash-safe checkpoints: everything needed to continue a run and end with the same weights.

One checkpoint is one folder::

    OUTPUT/checkpoints/step-000123/
        model.pt       model.state_dict()
        trainer.pt     optimizer, scheduler, GradScaler, RNG states (Python, NumPy, torch CPU/CUDA;
                       every rank's, for a run of several processes)
        state.json     data position (epoch, next batch), counters, memory plan, config, and
                       the evaluator's history, best step and patience count
        manifest.json  size and sha256 of each file above; written last

A checkpoint is written into ``.tmp-step-000123-<pid>/``; every file and the folder are
fsynced, then the folder is renamed. A kill at any moment leaves either a complete
checkpoint or a temporary folder, which is ignored and removed by the next write. On
resume every file is checked against the manifest: a corrupt or partial checkpoint is
skipped with a warning and the one before it is used. The last ``keep`` are kept.

The data position is (epoch, index of the next micro-batch): ``batches()`` is a seeded
permutation per epoch, so with the RNG states restored a resumed run takes the same
batches, the same dropout masks and ends with the same weights as an uninterrupted one.

A run of N processes writes (from rank 0) one checkpoint holding every rank's RNG state
(the weights, optimizer and schedule are the same on every rank) and resumes on N processes,
each rank restoring its own. The global batches and the data order do not depend on N, but
each rank draws its dropout masks from its own stream and sums in its own order, so a resume
on another number of processes is refused rather than continued differently.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from densefit.config.options import declared_options
from densefit.memory.plan import MemoryPlan

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "Checkpointer",
    "checkpoint_due",
    "verify_checkpoint",
    "latest_checkpoint",
    "resume_checkpoint",
    "truncate_log",
    "data_fingerprint",
    "changed_weight_options",
    "memory_options",
    "write_part",
]

FORMAT = 1
FILES = ("model.pt", "trainer.pt", "state.json")
CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"step-(\d{6,})")
_SAFE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def changed_weight_options(saved: dict, config) -> list[str]:
    """The options of ``config`` that change the trained weights (declared
    ``affects_weights``) and differ from ``saved`` (a saved config's fields): what refuses a
    resume or a rerun into the same folder. An option still to be resolved (``similarity``
    None: the model's own; ``learning_rate`` auto: from the batch a step really has, which
    the data decides) is compared once the run has resolved it
    (:func:`densefit.training.setup.setup_run`): the command line checks the output folder
    before it reads the data or loads the model."""
    unresolved = {"similarity": None, "learning_rate": "auto"}
    return [
        k
        for k, v in config.weight_options().items()
        if k in saved and saved[k] != v and not (k in unresolved and v == unresolved[k])
    ]


def memory_options(config) -> list[str]:
    """The fields of ``config`` that are part of the memory plan (declared ``memory``): a
    resumed run takes them from the checkpoint's plan."""
    return [f.name for f, opt in declared_options(type(config)) if opt.memory]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, or from a different run."""


# ----------------------------------------------------------------------------- RNG, data


def rng_state() -> dict:
    """The Python, NumPy and torch (CPU and every CUDA device) random states."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(
                f"the checkpoint has RNG states for {len(cuda)} CUDA device(s), this machine "
                f"has {torch.cuda.device_count()}: dropout will differ from the original run",
                RuntimeWarning,
                stacklevel=3,
            )


def data_fingerprint(examples: Sequence) -> dict:
    """Row count and sha256 of the training texts (and, for several sources, their names and
    sizes: they decide the batches), to notice a resume on different data."""
    digest = hashlib.sha256()
    for ex in examples:
        for text in (ex.query, ex.positive, *ex.negatives, repr(ex.score)):
            digest.update(text.encode("utf-8", "surrogatepass"))
            digest.update(b"\0")
        digest.update(b"\1")
    out = {"rows": len(examples), "sha256": digest.hexdigest()}
    sources = getattr(examples, "sources", ())
    if len(sources) > 1:
        out["sources"] = [[source.name, source.rows] for source in sources]
    return out


# ----------------------------------------------------------------------------- files


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX; Windows cannot open folders)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_part(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write one file of a checkpoint and fsync it (tests replace this to simulate a kill)."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _json_bytes(value: Any) -> Callable[[IO[bytes]], None]:
    data = json.dumps(value, indent=1, default=str).encode("utf-8")
    return lambda f: f.write(data)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


# ----------------------------------------------------------------------------- reading


@dataclass
class Checkpoint:
    """A verified checkpoint folder and its ``state.json``."""

    path: Path
    state: dict

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def world_size(self) -> int:
        """How many processes wrote it (1 for a checkpoint that does not say)."""
        return int(self.state.get("world_size", 1))

    def check_world_size(self, world_size: int) -> None:
        """Refuse to resume on another number of processes than the run had."""
        if world_size == self.world_size:
            return
        then, now = self.world_size, world_size
        processes = lambda n: f"{n} process{'es' if n != 1 else ''}"  # noqa: E731
        raise CheckpointError(
            f"{self.path}: written by a run of {processes(then)}, resumed on {processes(now)}: "
            f"resume it on {processes(then)} (--nproc {then}), or train into a new output "
            "folder to start over. (The batches and the data order do not depend on the "
            "number of processes, but each process's dropout stream and summation order do, "
            "so another number would not continue the same run.)"
        )

    def plan(self) -> MemoryPlan:
        """The run's memory plan as it was, halvings after out-of-memory errors included."""
        if "memory_plan" in self.state:
            return MemoryPlan.from_dict(self.state["memory_plan"])
        saved, planned = self.state["strategy"], self.state.get("plan", {})  # before the plan
        return MemoryPlan(
            saved["name"],
            chunk_size=saved["chunk_size"],
            token_budget=saved["token_budget"],
            sort_by_length=saved["sort_by_length"],
            oom_retries=int(saved.get("oom_retries", 0)),
            keep_graphs=int(saved.get("keep_graphs", planned.get("keep_graphs") or 1)),
            loss_block_size=planned.get("loss_block_size"),
        )

    def check_matches(self, config, examples: Sequence) -> None:
        """Refuse a resume whose options would change the run; warn about other differences."""
        saved, current = self.state.get("config", {}), config.to_dict()
        differ = changed_weight_options(saved, config)
        if differ:
            shown = ", ".join(f"{k}={saved[k]!r} (now {current[k]!r})" for k in differ)
            raise CheckpointError(
                f"{self.path}: this checkpoint was written with {shown}; pass the same "
                "options to resume it, or train into a new output folder to start over"
            )
        memory = [k for k in memory_options(config) if k in saved and saved[k] != current[k]]
        if memory:
            warnings.warn(
                f"resuming with the checkpoint's memory plan ({self.plan().summary()}); "
                f"the new {', '.join(memory)} of this run are not used",
                UserWarning,
                stacklevel=3,
            )
        if self.state.get("data") not in (None, data_fingerprint(examples)):
            warnings.warn(
                f"{self.path}: the training data differs from the data of the interrupted run "
                f"({self.state['data']['rows']} rows then, {len(examples)} now): the run "
                "continues, but not with the batches it would have had",
                UserWarning,
                stacklevel=3,
            )

    def restore(
        self, model, optimizer, scheduler, scaler, guard, evaluator=None, *, rank: int = 0
    ) -> None:
        """Load weights, optimizer, scheduler, scaler, counters, the evaluator's best and
        patience and, last, the RNG states (``rank``'s, for a run of several processes)."""
        weights = torch.load(self.path / "model.pt", map_location="cpu", weights_only=True)
        try:
            model.load_state_dict(weights)
        except RuntimeError as exc:
            raise CheckpointError(
                f"{self.path}: the saved weights do not fit this model ({exc}); resume with "
                "the --model the run started from"
            ) from None
        trainer = torch.load(self.path / "trainer.pt", map_location="cpu", weights_only=True)
        optimizer.load_state_dict(trainer["optimizer"])
        scheduler.load_state_dict(trainer["scheduler"])
        if scaler is not None and trainer.get("scaler"):
            scaler.load_state_dict(trainer["scaler"])
        guard.load_state_dict(self.state["guard"])
        if evaluator is not None and self.state.get("evaluator"):
            evaluator.load_state_dict(self.state["evaluator"])
        per_rank = trainer.get("rng_ranks")
        set_rng_state(per_rank[rank] if per_rank else trainer["rng"])


def verify_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Check every file of a checkpoint against its manifest; raise CheckpointError if bad.

    >>> verify_checkpoint("runs/m/checkpoints/step-000100").step  # doctest: +SKIP
    100
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no manifest.json (the write was interrupted?)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not an object")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from None
    missing = [name for name in FILES if name not in files]
    if missing:
        raise CheckpointError(f"{manifest_path}: does not list {', '.join(missing)}")
    for name, meta in files.items():
        if not isinstance(name, str) or not _SAFE_FILE.fullmatch(name):
            raise CheckpointError(f"{manifest_path}: unsafe file name {name!r}")
        file = path / name
        if file.is_symlink() or not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if not isinstance(meta, dict) or file.stat().st_size != meta.get("bytes"):
            raise CheckpointError(
                f"{file}: {file.stat().st_size} bytes, the manifest says "
                f"{meta.get('bytes') if isinstance(meta, dict) else meta!r}"
            )
        if _sha256(file) != meta.get("sha256"):
            raise CheckpointError(f"{file}: sha256 does not match the manifest (corrupt)")
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path / 'state.json'}: unreadable ({exc})") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {state.get('format')!r}, expected {FORMAT}"
        )
    return Checkpoint(path, state)


def _sequence(path: Path) -> int:
    """Write order of a checkpoint (-1 when unreadable): it decides which one is the latest."""
    try:
        return int(json.loads((path / "state.json").read_text(encoding="utf-8"))["sequence"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return -1


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Checkpoint folders under ``root``, newest first (write order, then step)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: (_sequence(p), int(p.name[5:])), reverse=True)


def latest_checkpoint(root: str | os.PathLike) -> Checkpoint | None:
    """The newest good checkpoint under ``root``; each bad one is skipped with a warning."""
    for path in list_checkpoints(root):
        try:
            return verify_checkpoint(path)
        except (CheckpointError, OSError) as exc:
            warnings.warn(
                f"skipping checkpoint {path.name}: {exc}; trying the previous one",
                RuntimeWarning,
                stacklevel=2,
            )
    return None


def resume_checkpoint(
    resume: bool | str | os.PathLike, output_dir: str | os.PathLike | None
) -> Checkpoint | None:
    """The checkpoint to resume from: ``True`` or ``"latest"`` for the newest good one in
    ``output_dir/checkpoints`` (None, with a warning, when there is none yet), or a path.
    """
    if resume is True or resume == "latest":
        if output_dir is None:
            raise ValueError(
                "resume=True looks in output_dir/checkpoints: pass output_dir, "
                "or resume=<a checkpoint folder>"
            )
        root = Path(output_dir) / CHECKPOINTS
    else:
        root = Path(resume)
        if (root / "manifest.json").exists() or not list_checkpoints(root):
            return verify_checkpoint(root)  # a checkpoint folder, not a folder of them
    found = latest_checkpoint(root)
    if found is None and list_checkpoints(root):
        raise CheckpointError(
            f"{root}: none of the checkpoints is usable (see the warnings); remove that "
            "folder to start over"
        )
    if found is None:
        warnings.warn(
            f"no checkpoint in {root} yet: starting from step 0", UserWarning, stacklevel=3
        )
    return found


def truncate_log(path: str | os.PathLike, step: int) -> int:
    """Drop JSONL log lines of steps after ``step`` (and a half-written last line).

    Returns how many lines were dropped; the file is replaced atomically.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += bool(line.strip())
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and record["step"] > step
        ):
            dropped += 1
            continue
        kept.append(line + b"\n")
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        write_part(tmp, lambda f: f.writelines(kept))
        os.replace(tmp, path)
    return dropped


# ----------------------------------------------------------------------------- writing


def checkpoint_due(config, step: int, *, epoch_end: bool, last: bool) -> bool:
    """A checkpoint is due after ``step``: every ``config.checkpoint_every`` steps, at the end
    of each epoch, and after the last step (the same answer on every rank)."""
    every = config.checkpoint_every
    return epoch_end or last or bool(every and step % every == 0)


class Checkpointer:
    """Writes the checkpoints of one run under ``output_dir/checkpoints``.

    >>> checkpoints = Checkpointer("runs/m", config, examples, model=model, optimizer=opt,
    ...     scheduler=sched, scaler=None, guard=guard)  # doctest: +SKIP
    >>> checkpoints.save(10, epoch=0, batch=10, seen=320, losses=losses,
    ...                  plan=plan)  # doctest: +SKIP
    PosixPath('runs/m/checkpoints/step-000010')
    """

    def __init__(
        self,
        output_dir,
        config,
        examples,
        *,
        model,
        optimizer,
        scheduler,
        scaler,
        guard,
        evaluator=None,
        resumed: Checkpoint | None = None,
        world_size: int = 1,
    ):
        self.output_dir = Path(output_dir)
        self.world_size = world_size
        self.root = self.output_dir / CHECKPOINTS
        self.config = config
        self.every, self.keep = config.checkpoint_every, config.keep_checkpoints
        self.parts = dict(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            guard=guard,
            evaluator=evaluator,
        )
        self.data = data_fingerprint(examples)
        if self.root.is_symlink() or (
            self.root.exists() and not _inside(self.root, self.output_dir)
        ):
            raise CheckpointError(
                f"{self.root}: must be a folder inside {self.output_dir}, "
                "not a link elsewhere; remove it"
            )
        existing = list_checkpoints(self.root)
        self.sequence = max((_sequence(p) for p in existing), default=0) + 1
        if existing and resumed is None:
            warnings.warn(
                f"{self.root} holds checkpoints of an earlier run (newest {existing[0].name}); "
                "this run starts from step 0 and replaces them as it writes its own. To "
                "continue the earlier run instead, pass --resume (resume=True)",
                UserWarning,
                stacklevel=3,
            )

    def due(self, step: int, *, epoch_end: bool, last: bool) -> bool:
        """Every ``checkpoint_every`` steps, at the end of each epoch, and after the last step."""
        return checkpoint_due(self.config, step, epoch_end=epoch_end, last=last)

    def save(
        self,
        step: int,
        *,
        epoch: int,
        batch: int,
        seen: int,
        losses: list[float],
        plan: MemoryPlan,
        rng_states: list[dict] | None = None,
    ) -> Path | None:
        """Write the checkpoint of the state after ``step``; ``(epoch, batch)`` is the next
        micro-batch, ``plan`` the run's :class:`MemoryPlan` now (after
        any out-of-memory halving), ``rng_states`` every rank's RNG state in a run of several
        processes (:func:`rng_state` of this one otherwise). On an OS error (disk full...)
        warn, clean up and return None."""
        p = self.parts
        name = f"step-{step:06d}"
        final = self.root / name
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        state = {
            "format": FORMAT, "step": step, "epoch": epoch, "batch": batch, "seen": seen,
            "losses": losses, "sequence": self.sequence, "guard": p["guard"].state_dict(),
            "memory_plan": plan.to_dict(), "config": self.config.to_dict(), "data": self.data,
            "world_size": self.world_size,
            "torch_version": torch.__version__, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "evaluator": p["evaluator"].state_dict() if p["evaluator"] is not None else None,
        }  # fmt: skip
        trainer = {
            "optimizer": p["optimizer"].state_dict(),
            "scheduler": p["scheduler"].state_dict(),
            "scaler": p["scaler"].state_dict() if p["scaler"] is not None else None,
            "rng": rng_states[0] if rng_states else rng_state(),
        }
        if rng_states and len(rng_states) > 1:
            trainer["rng_ranks"] = rng_states
        parts = {
            "model.pt": lambda f: torch.save(p["model"].state_dict(), f),
            "trainer.pt": lambda f: torch.save(trainer, f),
            "state.json": _json_bytes(state),
        }
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()
            tmp.mkdir()
            files = {}
            for filename, write in parts.items():
                write_part(tmp / filename, write)
                files[filename] = {
                    "bytes": (tmp / filename).stat().st_size,
                    "sha256": _sha256(tmp / filename),
                }
            write_part(tmp / "manifest.json", _json_bytes({"format": FORMAT, "files": files}))
            _fsync_dir(tmp)
            if final.exists() or final.is_symlink():  # the same step again, after a resume
                old = self.root / f".old-{name}-{os.getpid()}"
                os.rename(final, old)
                os.rename(tmp, final)
                _remove(old)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.root)
        except OSError as exc:
            with contextlib.suppress(OSError):
                _remove(tmp)
            newest = next((c.name for c in list_checkpoints(self.root)), "none")
            warnings.warn(
                f"could not write checkpoint {final}: {exc}. Training goes on; the newest "
                f"checkpoint is still {newest}. Free disk space, or lower how often "
                "checkpoints are written (--checkpoint-every) and kept (--keep-checkpoints)",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        self.sequence += 1
        self._prune()
        return final

    def _remove_leftovers(self) -> None:
        """Temporary folders of writes that were killed half-way."""
        for path in self.root.iterdir():
            if path.name.startswith((".tmp-step-", ".old-step-")):
                _remove(path)

    def _prune(self) -> None:
        for path in list_checkpoints(self.root)[self.keep :]:
            with contextlib.suppress(OSError):
                _remove(path)
