"""Evaluation during training: a BEIR split scored at step 0, every N steps and at epoch ends.

The loop asks :meth:`Evaluator.due`, then calls :meth:`Evaluator.run`, which scores the model
through :func:`densefit.evaluate.evaluate` (the same code as ``densefit eval`` and
``densefit run``), keeps the best step (``keep_best``: its model is saved to ``OUTPUT/best/``)
and counts evaluations without improvement (``early_stopping_patience``). Its state (history,
best step and value, patience count) goes into every checkpoint, so a resumed run makes the
same decisions as an uninterrupted one.

Why the best model goes to disk, not to a copy in memory: a CPU copy of the weights doubles
the model's host memory for the whole run and, to survive an interruption, would have to go
into every checkpoint too (doubling them); ``OUTPUT/best/`` costs one save per improvement,
is already a usable model while the run goes on, and is still there after a crash. At the end
its weights are loaded back into the model, which is then saved as the output.

The evaluation data is data, not a hyper-parameter: it is passed to ``train(eval_data=...)``
like the training examples, not stored in :class:`~densefit.config.TrainConfig`; the options
that decide *how* to evaluate (split, metric, how often, keep-best, patience) are TrainConfig
fields. :func:`eval_data_for` is the one place that decides whether a run evaluates and on
which folder (the CLI and ``densefit run`` both call it).

In a multi-process run (torchrun) rank 0 alone holds the :class:`Evaluator` and evaluates
(the weights are the same on every rank); :func:`evaluation_due`, a function of the options
and the step only, tells every rank when an evaluation happens, so the others wait for it
and receive its early-stopping decision (see :func:`densefit.training.loop.train`). They
wait within the process group's timeout (``init_distributed(timeout_s=)``, 30 minutes by
default): keep one evaluation shorter, with ``eval_max_docs`` if need be.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer
from transformers.utils import logging as hf_logging

from densefit.config.train import TrainConfig
from densefit.data.corpus import BeirDataset, load_beir
from densefit.evaluate import DEFAULT_METRICS, evaluate, subsample_corpus

__all__ = [
    "BEST",
    "Evaluator",
    "eval_data_for",
    "evaluation_asked",
    "evaluation_due",
    "make_evaluator",
]

BEST = "best"  # OUTPUT/best/: the best model so far, with keep_best
_BEST_INFO = "densefit_best.json"  # inside OUTPUT/best/: the step and value it holds


def evaluation_asked(config: TrainConfig) -> bool:
    """Whether ``config`` needs evaluation during training (eval_every, keep_best, patience)."""
    return bool(config.eval_every or config.keep_best or config.early_stopping_patience)


def evaluation_due(config: TrainConfig, step: int, *, epoch_end: bool, last: bool) -> bool:
    """The schedule: at step 0, every ``eval_every`` steps, at each epoch end and after the
    last step. The same on every rank of a multi-process run (options and step only).

    >>> [s for s in range(7) if evaluation_due(TrainConfig(eval_every=3), s, epoch_end=False,
    ...                                        last=s == 6)]
    [0, 3, 6]
    """
    every = config.eval_every
    return step == 0 or epoch_end or last or bool(every and step % every == 0)


def eval_data_for(
    config: TrainConfig,
    eval_data: str | os.PathLike | None = None,
    train_data: str | os.PathLike | None = None,
) -> Path | None:
    """The BEIR folder to evaluate on during training, or None when the run does not evaluate.

    A run evaluates when ``eval_data`` is given or ``config`` asks for it
    (:func:`evaluation_asked`); the folder is ``eval_data``, else the training data when it is
    a BEIR folder. Raises ``ValueError`` when evaluation is asked for but there is no folder.

    >>> eval_data_for(TrainConfig()) is None
    True
    """
    if eval_data is not None:
        return Path(eval_data)
    if not evaluation_asked(config):
        return None
    if train_data is not None and Path(train_data).is_dir():
        return Path(train_data)
    raise ValueError(
        "--eval-every, --keep-best and --early-stopping-patience evaluate on a BEIR folder "
        f"(corpus, queries, qrels/{config.eval_split}.tsv): pass --eval-data DIR "
        "(eval_data= in Python)"
        + (f" ({train_data} is not a BEIR folder)" if train_data is not None else "")
    )


def make_evaluator(
    config: TrainConfig,
    eval_data: str | os.PathLike | BeirDataset | None = None,
    *,
    output_dir: str | os.PathLike | None = None,
    main: bool = True,
) -> Evaluator | None:
    """The run's :class:`Evaluator`, or None when it does not evaluate (see
    :func:`eval_data_for`); ``eval_data`` is a BEIR folder or a loaded ``BeirDataset``.

    ``main=False`` (a rank other than 0 of a multi-process run): the same checks, so every
    rank refuses the same options, but None: rank 0 evaluates, the data is not loaded here.
    """
    if eval_data is None:
        if evaluation_asked(config):
            eval_data_for(config)  # raises: asked for, but no data
        return None
    if config.keep_best and output_dir is None:
        raise ValueError("keep_best needs output_dir (the best model goes to OUTPUT/best/)")
    return Evaluator(eval_data, config, output_dir=output_dir) if main else None


class Evaluator:
    """Scores the model on a BEIR split during training and keeps the best step.

    ``config.eval_runtime`` runs the model in each evaluation
    (:data:`densefit.choices.TRAINING_EVAL_RUNTIMES`): ``auto`` finds no export of weights
    that change every step and runs torch; ``onnx`` (``openvino``) exports the current
    weights in memory at each evaluation (seconds) and embeds with ONNX Runtime (OpenVINO),
    equal to torch to ~1e-7 cosine; quantized runtimes need a checked export of fixed
    weights, so TrainConfig does not offer them here.

    >>> evaluator = Evaluator("data/scifact", TrainConfig(eval_every=100))  # doctest: +SKIP
    >>> evaluator.due(0, epoch_end=False, last=False)  # doctest: +SKIP
    True
    >>> evaluator.run(model, 0)["eval"]["ndcg@10"]  # doctest: +SKIP
    0.6451
    """

    def __init__(
        self,
        data: str | os.PathLike | BeirDataset,
        config: TrainConfig,
        *,
        output_dir: str | os.PathLike | None = None,
    ):
        self.config = config
        self.runtime = config.eval_runtime
        self.metric = config.eval_metric
        self.metrics = tuple(dict.fromkeys((config.eval_metric, *DEFAULT_METRICS)))
        self.source = "<BeirDataset>" if isinstance(data, BeirDataset) else str(data)
        try:
            beir = data if isinstance(data, BeirDataset) else load_beir(data, config.eval_split)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{exc} (evaluation during training: choose the split with --eval-split, "
                "the folder with --eval-data)"
            ) from None
        distractors = None
        if config.eval_max_docs is not None:
            judged = {d for docs in beir.qrels.values() for d in docs}
            distractors = max(0, config.eval_max_docs - len(judged))
        self.dataset, self.corpus = subsample_corpus(beir, distractors, config.seed)
        self.best_dir = Path(output_dir) / BEST if config.keep_best and output_dir else None
        self.history: list[dict] = []  # one {"step", "eval", "eval_seconds"} per evaluation
        self.best_step: int | None = None
        self.best_value: float | None = None
        self.since_best = 0  # evaluations in a row without improvement
        self.stopped = False  # early stopping decided to end the run

    # -- when

    def due(self, step: int, *, epoch_end: bool, last: bool) -> bool:
        """When :func:`evaluation_due` says so, once per step (a resumed run has already
        evaluated its checkpoint's step)."""
        if self.history and self.history[-1]["step"] == step:
            return False
        return evaluation_due(self.config, step, epoch_end=epoch_end, last=last)

    # -- what

    def run(self, model: SentenceTransformer, step: int) -> dict:
        """Evaluate ``model`` after ``step``; update best and patience; return the log record.

        The model is put in eval mode and back, and the RNG states are restored afterwards,
        so evaluating does not change the run's dropout masks or batches.
        """
        training = model.training
        started = time.perf_counter()
        devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            model.eval()
            try:
                result = evaluate(
                    model, self.dataset, split=self.config.eval_split, metrics=self.metrics,
                    name=f"step {step}", runtime=self.runtime,
                )  # fmt: skip
            finally:
                model.train(training)
        metrics = {k: round(v, 6) for k, v in result.metrics.items()}
        seconds = round(time.perf_counter() - started, 3)
        record = {"step": step, "eval": metrics, "eval_seconds": seconds}
        self.history.append(dict(record))
        value = metrics[self.metric]
        if self.best_value is None or value > self.best_value:
            self.best_step, self.best_value, self.since_best = step, value, 0
            if self.best_dir is not None:
                self._save_best(model, step, value)
        else:
            self.since_best += 1
        patience = self.config.early_stopping_patience
        self.stopped = bool(patience and self.since_best >= patience)
        record.update(best_step=self.best_step, stop=self.stopped)
        return record

    def postfix(self) -> dict:
        """The progress bar's fields: the last value and the best (with its step)."""
        if not self.history:
            return {}
        last = self.history[-1]["eval"][self.metric]
        return {self.metric: f"{last:.4f}", "best": f"{self.best_value:.4f}@{self.best_step}"}

    # -- the best model

    def _save_best(self, model: SentenceTransformer, step: int, value: float) -> None:
        """Write OUTPUT/best/ atomically: into a temporary folder, then renamed over it."""
        assert self.best_dir is not None
        tmp = self.best_dir.with_name(f".{BEST}.tmp-{os.getpid()}")
        old = self.best_dir.with_name(f".{BEST}.old-{os.getpid()}")
        for leftover in (tmp, old):
            shutil.rmtree(leftover, ignore_errors=True)
        with _no_library_progress():  # the run's own bar is on screen
            model.save(str(tmp), safe_serialization=True)
        info = {"step": step, "metric": self.metric, "value": value}
        (tmp / _BEST_INFO).write_text(json.dumps(info), encoding="utf-8")
        if self.best_dir.exists():
            os.rename(self.best_dir, old)
        os.rename(tmp, self.best_dir)
        shutil.rmtree(old, ignore_errors=True)

    def restore_best(self, model: SentenceTransformer) -> int | None:
        """With keep_best: load the best step's weights into ``model`` and remove
        OUTPUT/best/; the step they come from (None when nothing to restore)."""
        if self.best_dir is None or self.best_step is None:
            return None
        info_path = self.best_dir / _BEST_INFO
        info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.is_file() else {}
        if info.get("step") != self.best_step:
            raise RuntimeError(
                f"{self.best_dir}: holds step {info.get('step')}, but the best evaluation was "
                f"step {self.best_step}; the folder was changed during the run"
            )
        with _no_library_progress():
            best = SentenceTransformer(str(self.best_dir), device="cpu")
        model.load_state_dict(best.state_dict())
        shutil.rmtree(self.best_dir)
        return self.best_step

    # -- checkpoints and results

    def state_dict(self) -> dict:
        """History, best step and value, patience count: what a resumed run continues from."""
        return {
            "history": self.history, "best_step": self.best_step, "best_value": self.best_value,
            "since_best": self.since_best, "stopped": self.stopped, "source": self.source,
            "documents": self.corpus["documents"],
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`; warns when the evaluation data differs."""

        if (state.get("source"), state.get("documents")) != (
            self.source,
            self.corpus["documents"],
        ):
            warnings.warn(
                f"the interrupted run evaluated on {state.get('source')} "
                f"({state.get('documents')} documents), this one on {self.source} "
                f"({self.corpus['documents']}): the best step may not be comparable",
                UserWarning,
                stacklevel=3,
            )
        self.history = [dict(h) for h in state["history"]]
        self.best_step, self.best_value = state["best_step"], state["best_value"]
        self.since_best, self.stopped = state["since_best"], state["stopped"]

    def summary(self) -> dict:
        """What the run's result and model card report: the metric, every evaluation, the
        best and the final one, whether the run stopped early, what was searched."""
        return {
            "data": self.source,
            "split": self.config.eval_split,
            "metric": self.metric,
            "corpus": self.corpus,
            "queries": len(self.dataset.qrels),
            "history": self.history,
            "best_step": self.best_step,
            "best": self.best_value,
            "final_step": self.history[-1]["step"] if self.history else None,
            "stopped_early": self.stopped,
            "kept_best": self.best_dir is not None,
        }


@contextlib.contextmanager
def _no_library_progress() -> Iterator[None]:
    """Hide transformers' own progress bars (saving, loading weights) for a moment."""

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()
