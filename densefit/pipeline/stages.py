"""The stages of ``densefit run`` and what makes them resumable.

    mine          (optional) hard negatives for the training pairs   -> OUTPUT/mined.jsonl
    train         MNRL, memory auto, checkpoints                     -> OUTPUT/model/
    eval_base     the base model on the held-out split               -> OUTPUT/eval/base.json
    eval_trained  the trained model, the same settings               -> OUTPUT/eval/trained.json
    report        report.md, report.html, report.json, plots/*.png,
                  eval/per_query.jsonl (base and trained lined up per query)

A finished stage writes ``OUTPUT/stages/<name>.json``: its result, its outputs and the
*fingerprint* of everything it depends on (the config keys it reads, the sha256 of the data
and model files, the fingerprints of the stages before it). A rerun skips a stage whose
marker matches and whose outputs exist, and redoes it when anything it depends on changed;
since fingerprints chain, everything after a redone stage is redone too. An interrupted
train stage resumes from its newest checkpoint (``train(resume=True)``) when its
fingerprint is unchanged, and starts over otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console

from densefit.choices import embeds
from densefit.config.commands import EvalJob, MineJob, TrainJob
from densefit.config.run import RunConfig, train_paths
from densefit.config.shared import model_or_default
from densefit.data.corpus import find_beir_file, find_corpus_file
from densefit.evaluate import format_table, search_caption
from densefit.jobs import eval_job, mine_job, train_job
from densefit.models import load_model, resolve_device, resolve_model_path
from densefit.pipeline.report import describe_eval, load_eval_results, write_report
from densefit.training.checkpoint import latest_checkpoint, list_checkpoints
from densefit.training.evaluation import evaluation_asked
from densefit.wording import plan_words, plural

__all__ = [
    "STAGES",
    "Pipeline",
    "RunResult",
    "beir_digest",
    "file_digest",
    "fingerprint",
    "model_digest",
    "on_train_step",
    "run_pipeline",
    "tree_digest",
]

STAGES = ("mine", "train", "eval_base", "eval_trained", "report")


def on_train_step(record: dict) -> None:
    """Called with each step's log record during the train stage; does nothing.

    A hook: replace it (``monkeypatch.setattr(stages, "on_train_step", ...)``) to watch or
    interrupt a run; the tests raise ``KeyboardInterrupt`` from it to kill training mid-run.
    """


# ----------------------------------------------------------------------------- fingerprints


def fingerprint(value: Any) -> str:
    """A short sha256 of a JSON-able value (keys sorted).

    >>> fingerprint({"b": 1, "a": [1, 2]}) == fingerprint({"a": [1, 2], "b": 1})
    True
    """
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


_DIGESTS: dict[tuple, str] = {}


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (remembered per path, size and modification time)."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def tree_digest(folder: str | os.PathLike, skip: tuple[str, ...] = ("checkpoints",)) -> str:
    """sha256 over every file under ``folder`` (relative names and contents)."""
    folder = Path(folder)
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder)
        if rel.parts and rel.parts[0] in skip:
            continue
        h.update(str(rel).encode() + b"\0" + file_digest(path).encode() + b"\0")
    return h.hexdigest()


def beir_digest(folder: str | os.PathLike, split: str) -> dict:
    """Digests of the files of one BEIR split: corpus, queries and qrels/<split>.tsv."""
    folder = Path(folder)
    qrels = folder / "qrels" / f"{split}.tsv"
    if not qrels.is_file():
        splits = sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
        raise FileNotFoundError(f"{qrels}: no such file; the splits in {folder} are {splits}")
    return {
        "corpus": file_digest(find_corpus_file(folder)),
        "queries": file_digest(find_beir_file(folder, "queries")),
        f"qrels/{split}": file_digest(qrels),
    }


def model_digest(model: str) -> str:
    """Digest of a model folder's files, or the name itself when it is not local."""
    resolved = resolve_model_path(model)
    return tree_digest(resolved) if Path(resolved).is_dir() else f"name:{model}"


# ----------------------------------------------------------------------------- results


@dataclass
class RunResult:
    """What a run did: each stage's marker, which stages ran and which were skipped."""

    output: Path
    markers: dict[str, dict]
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    report: dict = field(default_factory=dict)

    def eval_results(self):
        """The base and trained :class:`~densefit.evaluate.EvalResult` from OUTPUT/eval."""
        return load_eval_results(self.output)

    def table(self, title: str | None = None):
        """The before/after table (rich), captioned with what was evaluated."""
        base, trained = self.eval_results()
        table = format_table([base, trained], title=title or "before / after")
        searched = search_caption([base, trained])
        table.caption = f"{describe_eval(base.info, base.n_queries)}; {searched}"
        per_query = self.report.get("per_query")
        if per_query:
            table.caption += (
                f"; per query ({per_query['metric']}): {per_query['better']} better, "
                f"{per_query['same']} same, {per_query['worse']} worse (report.html)"
            )
        return table


# ----------------------------------------------------------------------------- the pipeline


class Pipeline:
    """Runs the stages of a :class:`RunConfig` into its output folder, skipping finished ones.

    >>> result = Pipeline(config).run()  # doctest: +SKIP
    >>> result.ran, result.skipped  # doctest: +SKIP
    (['eval_trained', 'report'], ['mine', 'train', 'eval_base'])
    """

    def __init__(self, config: RunConfig, *, force: bool = False, console=None):

        self.config = config
        self.out = Path(config.output or "runs/densefit")
        self.force = force
        self.console = console or Console(stderr=True, highlight=False)
        self.markers: dict[str, dict] = {}
        self.result = RunResult(self.out, self.markers)
        self._beir = None
        self._digests: dict[str, Any] = {}

    # -- markers

    def _marker_path(self, name: str) -> Path:
        return self.out / "stages" / f"{name}.json"

    def _valid_marker(self, name: str, fp: str) -> dict | None:
        path = self._marker_path(name)
        if self.force or not path.is_file():
            return None
        try:
            marker = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if marker.get("fingerprint") != fp:
            return None
        if not all((self.out / rel).exists() for rel in marker.get("outputs", [])):
            return None
        return marker

    def _write_json(self, path: Path, value: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(value, indent=2, default=str))
        os.replace(tmp, path)  # never a half-written marker

    def _stage(self, index: int, name: str, fp: str, inputs: dict, run, outputs: list[str]) -> dict:
        """Skip ``name`` when its marker matches, else run it and write its marker."""
        title = f"[{index}/{len(STAGES)}] {name}"
        marker = self._valid_marker(name, fp)
        if marker is not None:
            self.console.rule(
                f"{title}: done at {marker['finished_at']}, inputs unchanged: skipped"
            )
            self.result.skipped.append(name)
            self.markers[name] = marker
            return marker
        self.console.rule(title)
        self._marker_path(name).unlink(missing_ok=True)
        started, load = time.time(), _load()
        t0 = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - t0
        marker = {
            "stage": name,
            "fingerprint": fp,
            "inputs": inputs,
            "outputs": outputs,
            "result": result,
            "seconds": round(seconds, 2),
            "started_at": _stamp(started),
            "finished_at": _stamp(time.time()),
            "load_average": {"start": load, "end": _load()},
        }
        self._write_json(self._marker_path(name), marker)
        self.result.ran.append(name)
        self.markers[name] = marker
        self.console.print(f"{name}: {seconds:.1f}s")
        return marker

    # -- fingerprints of the inputs

    def _digest(self, key: str, compute) -> Any:
        if key not in self._digests:
            self._digests[key] = compute()
        return self._digests[key]

    def _model_digest(self) -> str:
        return self._digest("model", lambda: model_digest(self.model))

    @property
    def model(self) -> str:
        """The base model (the configuration's, or the default one)."""
        return model_or_default(self.config.model)

    def _train_source(self) -> tuple[Any, dict]:
        """The training data (a path, a list or a mapping of paths) and its fingerprint."""
        c = self.config
        data = c.train_data if c.train_data is not None else c.data
        if isinstance(data, dict):
            return data, {"sources": {name: self._path_digest(p) for name, p in data.items()}}
        if isinstance(data, list):
            return data, {"sources": [self._path_digest(p) for p in data]}
        return data, self._path_digest(data)

    def _path_digest(self, value: str | os.PathLike) -> dict:
        c, path = self.config, Path(value)
        if path.is_dir():
            if not (path / "qrels").is_dir():  # a save_to_disk or Parquet shard folder
                return {
                    "folder": self._digest(f"folder:{path}", lambda: tree_digest(path, skip=()))
                }
            return self._digest(
                f"beir:{path}:{c.train_split}", lambda: beir_digest(path, c.train_split)
            )
        return {"file": self._digest(f"file:{path}", lambda: file_digest(path))}

    def _eval_inputs(self) -> dict:
        c = self.config
        settings = dataclasses.asdict(c.eval)
        settings.pop("cache_dir")
        return {
            "data": self._digest(
                "eval_data", lambda: beir_digest(c.data, self.config.eval.split_name)
            ),
            "eval": settings,
            "on_bad_row": c.on_bad_row,
            "keeps": "rankings",  # eval/*.json keep each query's ranking for the report
        }

    # -- the run

    def run(self) -> RunResult:
        """Run (or skip) every stage in order; the result lists what ran."""
        self._prepare()
        mine_fp = self._run_mine()
        train_fp = self._run_train(mine_fp)
        self._run_evals(train_fp)
        self._run_report()
        self.result.report = json.loads((self.out / "report.json").read_text())
        return self.result

    def _prepare(self) -> None:
        """Check dependencies, apply the threads setting, write OUTPUT/config.yaml."""

        _check_dependencies(self.config)
        resolve_device(self.config.train.device)  # a device that is not here: before any stage
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(
            yaml.safe_dump(self.config.to_dict(), sort_keys=False), encoding="utf-8"
        )

    def _run_mine(self) -> str | None:
        """Stage 1 when ``mine.method`` is set; its fingerprint, or None when mining is off."""
        c = self.config
        if c.mine is None:
            self.console.rule(f"[1/{len(STAGES)}] mine: off (no mine section)")
            self._marker_path("mine").unlink(missing_ok=True)
            return None
        _, train_source = self._train_source()
        inputs = {
            "pairs": train_source,
            "corpus": self._digest("corpus", lambda: file_digest(find_corpus_file(c.data))),
            "mine": dataclasses.asdict(c.mine),
            "model": self._model_digest() if embeds(c.mine.method) else None,
            "on_bad_row": c.on_bad_row,
        }
        mine_fp = fingerprint(inputs)
        self._stage(1, "mine", mine_fp, inputs, self._mine, ["mined.jsonl"])
        return mine_fp

    def _run_train(self, mine_fp: str | None) -> str:
        """Stage 2; its fingerprint (model, data or mined file, training options)."""
        c = self.config
        _, train_source = self._train_source()
        train_options = c.train.weight_options()  # what changes the weights
        inputs = {
            "model": self._model_digest(),
            "data": {"mined": mine_fp} if mine_fp else train_source,
            "train": train_options,
            "on_bad_row": c.on_bad_row,
        }
        if c.train.export is not None:  # the stage writes the export beside the model
            inputs["export"] = c.train.export
        if evaluation_asked(c.train):  # keep_best and patience read the eval split
            split = c.train.eval_split
            inputs["eval_data"] = self._digest(
                f"beir:{c.data}:{split}", lambda: beir_digest(c.data, split)
            )
        train_fp = fingerprint(inputs)
        outputs = ["model/modules.json", "model/train_log.jsonl"]
        self._stage(2, "train", train_fp, inputs, lambda: self._train(train_fp), outputs)
        return train_fp

    def _run_evals(self, train_fp: str) -> None:
        """Stages 3 and 4: the base model, then the trained one, with the same settings."""
        eval_inputs = self._eval_inputs()
        base_inputs = {"model": self._model_digest(), **eval_inputs}
        base_fp = fingerprint(base_inputs)
        self._stage(
            3,
            "eval_base",
            base_fp,
            base_inputs,
            lambda: self._eval_base(base_fp),
            ["eval/base.json"],
        )
        trained_inputs = {"model": {"train": train_fp}, **eval_inputs}
        self._stage(
            4,
            "eval_trained",
            fingerprint(trained_inputs),
            trained_inputs,
            lambda: self._evaluate(self.out / "model", "trained"),
            ["eval/trained.json"],
        )

    def _run_report(self) -> None:
        """Stage 5: redone when any stage before it (or the config) changed."""
        inputs = {s: self.markers[s]["fingerprint"] for s in STAGES[:-1] if s in self.markers}
        inputs["config"] = self.config.to_dict()
        plots = ("training", "resources", "metrics")
        outputs = ["report.md", "report.html", "report.json"]
        outputs += [f"plots/{name}.png" for name in plots]
        self._stage(5, "report", fingerprint(inputs), inputs, self._report, outputs)

    # -- stages

    def _mine(self) -> dict:
        c = self.config
        job = MineJob(
            pairs=(train_paths(c.train_data) or [Path(c.data)])[0],  # one source (checked)
            corpus=Path(c.data),
            output=self.out / "mined.jsonl",
            model=self.model,
            split=c.train_split,
            on_bad_row=c.on_bad_row,
            device=c.train.device,
            show_progress=c.progress,
            mine=c.mine,
        )
        report = mine_job(job)
        self.console.print(f"mined: {report.summary()}")
        return report.to_dict()

    def _train(self, fp: str) -> dict:
        c = self.config
        model_dir = self.out / "model"
        started = self.out / "stages" / "train.started.json"
        resume = False
        resumed_from = None
        previous = json.loads(started.read_text()) if started.is_file() else {}
        if (
            not self.force
            and previous.get("fingerprint") == fp
            and list_checkpoints(model_dir / "checkpoints")
        ):
            found = latest_checkpoint(model_dir / "checkpoints")
            if found is not None:
                resume, resumed_from = True, found.step
                self.console.print(f"resuming the interrupted training from step {found.step}")
        if not resume and model_dir.exists():
            shutil.rmtree(model_dir)  # another run's model, log and checkpoints: start over
        self._write_json(started, {"fingerprint": fp, "started_at": _stamp(time.time())})
        source = self.out / "mined.jsonl" if c.mine is not None else self._train_source()[0]
        job = TrainJob(
            data=source,
            model=self.model,
            output=model_dir,
            resume=resume,
            split=c.train_split,
            eval_data=Path(c.data) if evaluation_asked(c.train) else None,
            on_bad_row=c.on_bad_row,
            train=c.train,
        )
        outcome = train_job(
            job, on_step=lambda record: on_train_step(record), say=self.console.print
        )
        result, plan = outcome.result, outcome.result.plan
        self.console.print(
            f"{plural(result.steps, 'step')}, {plural(result.examples, 'example')} in "
            f"{result.seconds:.0f}s, final "
            f"loss {result.final_loss:.4f}; memory: {plan_words(plan)}; model saved to {model_dir}"
        )
        return {
            "rows": outcome.rows,
            "source": outcome.source,
            "steps": result.steps,
            "examples": result.examples,
            "final_loss": result.final_loss,
            "train_seconds": round(result.seconds, 2),
            "plan": plan,
            "skipped_nonfinite": result.skipped_nonfinite,
            "resumed_from_step": resumed_from,
            "config": outcome.config.to_dict(),
            "evaluation": result.evaluation,
        }

    def _eval_base(self, fp: str) -> dict:
        cache_dir = self.config.eval.cache_dir
        cached = Path(cache_dir) / f"eval-{fp}.json" if cache_dir else None
        if cached is not None and cached.is_file():
            self.console.print(f"base evaluation reused from {cached} (same model, data, settings)")
            full = json.loads(cached.read_text())
            self._write_json(self.out / "eval" / "base.json", full)
            return {**_summary(full), "reused_from": str(cached)}
        summary = self._evaluate(self.model, "base")
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.out / "eval" / "base.json", cached)
        return summary

    @property
    def eval_split(self) -> str:
        """The held-out split both evaluations score."""
        return self.config.eval.split_name

    def _eval_max_seq_length(self) -> int:
        """Both evaluations use the same length: eval.max_seq_length, else the base model's."""
        if self.config.eval.max_seq_length is not None:
            return self.config.eval.max_seq_length
        base = self.markers.get("eval_base")
        if base is not None:
            return base["result"]["info"]["max_seq_length"]
        return load_model(self.model, device="cpu").max_seq_length

    def _evaluate(self, model_ref, name: str) -> dict:
        c = self.config
        settings = c.eval.replace(
            max_seq_length=self._eval_max_seq_length(), split=self.config.eval.split_name
        )
        job = EvalJob(
            dataset=Path(c.data),
            model=str(model_ref),
            device=c.train.device,
            on_bad_row=c.on_bad_row,
            show_progress=c.progress,
            eval=settings,
        )
        t0 = time.perf_counter()
        (result,) = eval_job(job).results
        result.name = name
        result.info.update(
            model=str(model_ref), max_seq_length=settings.max_seq_length,
            seconds=round(time.perf_counter() - t0, 2),
        )  # fmt: skip
        full = result.to_dict(per_query=True, rankings=True)
        self._write_json(self.out / "eval" / f"{name}.json", full)
        self.console.print(
            f"{name}: "
            + ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items())
            + f" ({describe_eval(result.info, result.n_queries)})"
        )
        return _summary(full)

    def _report(self) -> dict:
        report = write_report(
            self.out, self.config, self.markers, ran=list(self.result.ran), stages=STAGES[:-1]
        )
        files = ["report.md", "report.html", "report.json", "plots/", "eval/per_query.jsonl"]
        return {"files": files, "metrics": report["metrics"]}


def _summary(full: dict) -> dict:
    """A saved evaluation without its per-query parts: what a stage marker keeps."""
    return {k: v for k, v in full.items() if k not in ("per_query", "rankings", "qrels")}


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _check_dependencies(config: RunConfig) -> None:
    """Fail before any work when an optional dependency of a stage is missing."""

    needed = [("pytrec_eval", "eval"), ("matplotlib", "report")]
    if config.mine is not None and config.mine.method in ("bm25", "hybrid"):
        needed.append(("bm25s", "mine"))
    for module, extra in needed:
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"densefit run needs {module}: pip install 'densefit[{extra}]'")


def run_pipeline(config: RunConfig, *, force: bool = False, console=None) -> RunResult:
    """Run every stage of ``config`` (skipping finished ones) and return what happened.

    >>> from densefit.config.run import load_run_config
    >>> result = run_pipeline(load_run_config("examples/scifact.yaml"))  # doctest: +SKIP
    >>> result.report["metrics"]["ndcg@10"]["delta"]  # doctest: +SKIP
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        return Pipeline(config, force=force, console=console).run()
