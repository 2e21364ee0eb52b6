"""Experiment tracking: the training log's own records, also sent to TensorBoard, MLflow or W&B.

``report_to`` (``TrainConfig.report_to``: ``tensorboard``, ``mlflow``, ``wandb``, any of them)
adds trackers to the one logging path there is: :class:`~densefit.training.telemetry.StepLog`
hands every record it writes to ``train_log.jsonl`` (each step's: loss, lr, grad norm, step
time, memory, batch health; each evaluation's) to :meth:`Trackers.log`, which sends its
numbers as scalars (``train/loss``, ``train/grad_norm``, ``eval/ndcg@10``...; with several
sources also ``train/loss/<source>``). At the start each tracker gets the resolved config and
the memory plan; at the end the run's summary.

- ``tensorboard``: event files under ``OUTPUT/tensorboard`` (``tensorboard --logdir``);
- ``mlflow``: a run in experiment ``$MLFLOW_EXPERIMENT_NAME`` (default ``densefit``) at
  ``$MLFLOW_TRACKING_URI``, by default the file store ``file:OUTPUT/mlruns``; the config as
  params, the config and the plan as JSON artifacts;
- ``wandb``: a run in project ``$WANDB_PROJECT`` (default ``densefit``) under ``OUTPUT``;
  ``WANDB_MODE=offline`` works without a network (``wandb sync`` uploads it later).

Only rank 0 of a multi-process run reports. The run ids are kept in ``OUTPUT/tracking.json``
so that ``--resume`` reports into the same MLflow and W&B runs. Each backend is an optional
extra, imported only when asked for.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TENSORBOARD_DIR", "TRACKING_FILE", "Trackers", "check_trackers", "scalars"]

TRACKING_FILE = "tracking.json"
TENSORBOARD_DIR = "tensorboard"
_PACKAGES = {  # tracker: (module to import, extra to install)
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
# Fields of a step record that are not measurements (or are shown another way).
_NOT_SCALARS = frozenset({"step", "epoch", "source"})


def check_trackers(names: Sequence[str] | None, output_dir: str | os.PathLike | None) -> None:
    """Refuse, before any training, trackers whose package is missing, or that need an
    output folder when there is none (ValueError saying what to install or pass)."""
    for name in names or ():
        module, extra = _PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"report_to {name} needs the {module} package: pip install 'densefit[{extra}]'"
            )
        if output_dir is None and not _located_elsewhere(name):
            raise ValueError(
                f"report_to {name} writes under the output folder: pass output_dir (--output)"
                + (", or set MLFLOW_TRACKING_URI" if name == "mlflow" else "")
            )


def _located_elsewhere(name: str) -> bool:
    return name == "mlflow" and bool(os.environ.get("MLFLOW_TRACKING_URI"))


def scalars(record: dict, prefix: str = "train") -> dict[str, float]:
    """The numbers of a log record as tracker scalars: ``prefix/field``, nested dicts as
    ``field/key`` (evaluations: ``eval/metric``); texts, None and booleans left out, except
    ``skipped`` (0 or 1). A step of one source also gives ``prefix/loss/<source>``.

    >>> scalars({"step": 3, "loss": 0.5, "lr": 1e-5, "strategy": "cache", "source": "faq"})
    {'train/loss': 0.5, 'train/lr': 1e-05, 'train/loss/faq': 0.5}
    >>> scalars({"step": 0, "eval": {"ndcg@10": 0.4}, "eval_seconds": 1.5, "best_step": 0})
    {'eval/ndcg@10': 0.4, 'eval/seconds': 1.5, 'eval/best_step': 0.0}
    """
    out: dict[str, float] = {}
    evaluation = isinstance(record.get("eval"), dict)
    for key, value in record.items():
        if key in _NOT_SCALARS:
            continue
        if evaluation:  # an evaluation record: its metrics and its bookkeeping under eval/
            key = key.removeprefix("eval_")
            name = "eval" if key == "eval" else f"eval/{key}"
        else:
            name = f"{prefix}/{key}"
        if isinstance(value, dict):
            for sub, number in value.items():
                if _number(number):
                    out[f"{name}/{sub}"] = float(number)
        elif _number(value) or (key == "skipped" and isinstance(value, bool)):
            out[name] = float(value)
    if isinstance(record.get("source"), str) and _number(record.get("loss")):
        out[f"{prefix}/loss/{record['source']}"] = float(record["loss"])
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Trackers:
    """The trackers of one run (``names`` from ``report_to``); a no-op without any.
    ``resume``: continue the MLflow and W&B runs recorded in ``OUTPUT/tracking.json``;
    ``step``: the step the run resumes after (its later records are logged again).

    >>> trackers = Trackers(None, output_dir=None)
    >>> trackers.log({"step": 1, "loss": 0.5}); trackers.finish({})
    """

    def __init__(
        self,
        names: Sequence[str] | None,
        *,
        output_dir: str | os.PathLike | None,
        resume: bool = False,
        step: int = 0,
    ):
        self.output_dir = Path(output_dir) if output_dir is not None else None
        check_trackers(names, output_dir)
        ids = self._saved_ids() if resume else {}
        run_name = self.output_dir.resolve().name if self.output_dir else "densefit"
        makers = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _Wandb}
        self.trackers = [
            makers[name](self.output_dir, run_name, ids.get(name), step=step)
            for name in names or ()
        ]
        self._save_ids()

    def start(self, config: dict, plan: dict) -> None:
        """The resolved config and the memory plan, once at the start."""
        for tracker in self.trackers:
            tracker.start(config, plan)

    def log(self, record: dict) -> None:
        """One log record (a step's or an evaluation's), at its step."""
        values = scalars(record)
        if values:
            for tracker in self.trackers:
                tracker.log(values, int(record.get("step", 0)))

    def finish(self, summary: dict, *, failed: bool = False) -> None:
        """The run's summary (steps, final loss, per-source figures...); close each tracker."""
        for tracker in self.trackers:
            tracker.finish(summary, failed=failed)
        self.trackers = []

    def _saved_ids(self) -> dict:
        path = self.output_dir / TRACKING_FILE if self.output_dir else None
        try:
            return json.loads(path.read_text(encoding="utf-8")) if path else {}
        except (OSError, ValueError):
            return {}

    def _save_ids(self) -> None:
        ids = {t.name: t.run_id for t in self.trackers if t.run_id}
        if ids and self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / TRACKING_FILE).write_text(json.dumps(ids, indent=1) + "\n")


# ----------------------------------------------------------------------------- backends


class _TensorBoard:
    name = "tensorboard"
    run_id = None

    def __init__(self, output_dir: Path, run_name: str, run_id: str | None, *, step: int):
        from torch.utils.tensorboard import SummaryWriter  # the optional extra `tensorboard`

        # Resumed after step N: TensorBoard drops what an earlier attempt logged after N
        # (those steps are redone), as the training log does.
        self.writer = SummaryWriter(
            log_dir=str(output_dir / TENSORBOARD_DIR), purge_step=step + 1 if step else None
        )

    def start(self, config: dict, plan: dict) -> None:
        for tag, value in (("config", config), ("memory_plan", plan)):
            text = json.dumps(value, indent=1, default=str)
            self.writer.add_text(tag, f"```\n{text}\n```", global_step=0)

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)

    def finish(self, summary: dict, *, failed: bool) -> None:
        text = json.dumps({**summary, "failed": failed}, indent=1, default=str)
        self.writer.add_text("summary", f"```\n{text}\n```")
        self.writer.close()


_MLFLOW_NAME = re.compile(r"[^/\w.\- ]")  # what MLflow accepts in a metric or param name


class _MLflow:
    name = "mlflow"

    def __init__(self, output_dir: Path | None, run_name: str, run_id: str | None, *, step: int):
        from mlflow.tracking import MlflowClient  # the optional extra `mlflow`

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (output_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 asks for this opt-in before it uses a file store (its default here:
            # no database server, and nothing written outside the output folder).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        if run_id is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "densefit")
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def start(self, config: dict, plan: dict) -> None:
        from mlflow.entities import Param  # the optional extra `mlflow`

        params = [Param(_MLFLOW_NAME.sub("_", k), str(v)[:6000]) for k, v in config.items()]
        existing = self.client.get_run(self.run_id).data.params
        params = [p for p in params if p.key not in existing]  # a resumed run has them
        if params:
            self.client.log_batch(self.run_id, params=params)
        self.client.log_dict(self.run_id, config, "config.json")
        self.client.log_dict(self.run_id, plan, "memory_plan.json")

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # the optional extra `mlflow`

        stamp = int(time.time() * 1000)
        metrics = [
            Metric(_MLFLOW_NAME.sub("_", k), v, stamp, step)
            for k, v in values.items()
            if math.isfinite(v)  # MLflow stores NaN, but some stores refuse inf
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: dict, *, failed: bool) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class _Wandb:
    name = "wandb"

    def __init__(self, output_dir: Path, run_name: str, run_id: str | None, *, step: int):
        import wandb  # the optional extra `wandb`

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "densefit"),
            dir=str(output_dir),
            name=run_name,
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",
        )
        self.run_id = self.run.id

    def start(self, config: dict, plan: dict) -> None:
        self.run.config.update({**config, "memory_plan": plan}, allow_val_change=True)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict, *, failed: bool) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})
        self.run.finish(exit_code=1 if failed else 0)
