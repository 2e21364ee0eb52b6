"""``densefit run``'s configuration (:class:`RunConfig`): one YAML file (or flags), its keys
declared here and in the sections' classes.

    data: scifact            # BEIR folder: corpus, queries, qrels/train.tsv, qrels/test.tsv
    model: all-MiniLM-L6-v2
    mine: {method: bm25}     # optional: null (the default) trains on in-batch negatives only
    train: {batch_size: 64, epochs: 1, max_seq_length: 128}
    eval: {split: test, max_seq_length: 128, distractors: 1500}

An unknown key is an error naming the file, the key and the closest known one; the types and
ranges are the options' own (:meth:`~densefit.config.options.Options.from_mapping`). Paths
in a file are relative to that file's folder; paths given as flags to the current folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densefit.config.evaluation import EvalConfig
from densefit.config.mine import MineConfig
from densefit.config.options import ConfigError, Options, option, section
from densefit.config.shared import MODEL, ON_BAD_ROW_OPTION, OUTPUT, PROGRESS
from densefit.config.train import TrainConfig

__all__ = [
    "RunCommand",
    "RunConfig",
    "apply_overrides",
    "check_train_data",
    "config_from_flags",
    "load_run_config",
    "train_paths",
]

# TrainConfig fields the pipeline sets from its own keys (not keys of the train section)
_SET_BY_RUN = {"show_progress": "the top-level key `progress`"}


def check_train_data(value: Any) -> Any:
    """``train_data`` as given: a path, a non-empty list of paths, or a non-empty mapping
    name -> path; ``ValueError`` saying what to write.

    >>> check_train_data({"faq": "faq.jsonl"})
    {'faq': 'faq.jsonl'}
    """
    if isinstance(value, (str, os.PathLike)):
        return value
    if isinstance(value, dict):
        paths, wanted = list(value.values()), "a mapping name -> path"
        if any(not str(name).strip() for name in value):
            raise ValueError("names an empty source: give each source a name")
    elif isinstance(value, list):
        paths, wanted = value, "a list of paths"
    else:
        raise ValueError(
            f"must be a path, a list of paths or a mapping name -> path, got {value!r}"
        )
    if not paths:
        raise ValueError(f"is an empty list or mapping: give {wanted}, or leave it out")
    bad = [p for p in paths if not isinstance(p, (str, os.PathLike))]
    if bad:
        raise ValueError(f"must be {wanted}, got {bad[0]!r} among them")
    return value


def train_paths(train_data: Any) -> list[Path]:
    """The paths ``train_data`` names (one, a list's, a mapping's values), in order."""
    if train_data is None:
        return []
    if isinstance(train_data, dict):
        return [Path(p) for p in train_data.values()]
    if isinstance(train_data, list):
        return [Path(p) for p in train_data]
    return [Path(train_data)]


def _map_paths(value: Any, convert) -> Any:  # noqa: ANN001 - a function of one path
    """``value`` (a path, a list or a mapping of paths) with ``convert`` applied to each."""
    if isinstance(value, dict):
        return {name: convert(p, f".{name}") for name, p in value.items()}
    if isinstance(value, list):
        return [convert(p, f"[{k}]") for k, p in enumerate(value)]
    return convert(value, "")


@dataclass(kw_only=True)
class RunConfig(Options):
    """Everything ``densefit run`` does: mine (optional) -> train -> evaluate -> report.

    ``output`` defaults to ``runs/<config file name>`` (``runs/<data folder name>`` without a
    file) and holds stages/, model/, eval/, report.md, report.json and plots/.

    >>> config = RunConfig(data="examples/scifact", train={"batch_size": 16})
    >>> config.train.memory, config.train.batch_size
    ('auto', 16)
    """

    data: str = option(
        help="BEIR folder (corpus.jsonl[.gz], queries.jsonl[.gz], qrels/<split>.tsv): the corpus "
        "to evaluate on and, unless --train-data is set, the training pairs (its --train-split).",
    )
    model: str | None = MODEL()
    output: str | None = OUTPUT()
    train_data: str | list[str] | dict[str, str] | None = option(
        None,
        "Training data instead of DATA's train split: a file (JSONL, CSV/TSV, Parquet), a "
        "BEIR folder, a Dataset.save_to_disk or Parquet shard folder; or several sources, a "
        "list of those or a mapping name -> path (each step's rows from one source: "
        "train.source_batches).",
        check=check_train_data,
        metavar="PATH",
    )
    train_split: str = option(
        "train", "qrels split of DATA (or of a BEIR --train-data) to train on."
    )
    on_bad_row: str = ON_BAD_ROW_OPTION()
    progress: bool = PROGRESS()
    threads: int | None = option(
        None,
        "torch CPU threads for every stage; default: torch's (one per core). On a CPU shared "
        "with other busy processes, 1 can be faster than 2.",
        ge=1,
    )
    mine: MineConfig | None = section(
        MineConfig,
        "Mine hard negatives from DATA's corpus before training; null (the default): train on "
        "in-batch negatives only.",
        flags="run",
        prefix="mine",
        optional=True,
    )
    train: TrainConfig = section(
        TrainConfig, "The training options.", flags="run", exclude=_SET_BY_RUN
    )
    eval: EvalConfig = section(
        EvalConfig, "How the base and the trained model are evaluated.", flags="run", prefix="eval"
    )
    source: str = option("<flags>", "Where the configuration was read from.", cli=False, yaml=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.train.show_progress != self.progress:
            self.train = self.train.replace(show_progress=self.progress)

    def check(self) -> None:
        """The evaluation split must be held out from training; mining takes one source."""
        if self.mine is not None and isinstance(self.train_data, (list, dict)):
            if len(self.train_data) > 1:
                raise self.error(
                    "train_data",
                    "names several sources, and the mine section mines one: mine each "
                    "(densefit mine) and list the mined files as train_data, or drop mine",
                )
        if self.train_data is None and self.train_split == self.eval.split_name:
            raise self.error(
                "train_split",
                f"and eval.split are both {self.train_split!r}: evaluate on a held-out split",
            )


@dataclass(kw_only=True)
class RunCommand(Options):
    """``densefit run``'s own options; its other flags set :class:`RunConfig` keys."""

    config: Path | None = option(None, "YAML config (see --keys); or give --data.", positional=True)
    set: list[str] = option(
        help="Any key: --set train.warmup_steps=10 (repeatable; see --keys).",
        flag="--set",
        factory=list,
        metavar="KEY=VALUE",
    )
    force: bool = option(False, "Redo every stage, even finished ones.", flag="--force")
    keys: bool = option(
        False, "List every config key, its default and meaning, then exit.", flag="--keys"
    )

    def set_values(self) -> dict[str, Any]:
        """``--set KEY=VALUE`` as dotted keys, each value read as YAML (``null``, ``3e-5``)."""
        import yaml  # only to read the values

        values = {}
        for item in self.set:
            key, sep, text = item.partition("=")
            if not sep or not key.strip():
                raise self.error(
                    "set", f"{item!r}: write KEY=VALUE, e.g. --set train.warmup_steps=10"
                )
            try:
                values[key.strip()] = yaml.safe_load(text)
            except yaml.YAMLError:
                values[key.strip()] = text
        return values


def _resolve(
    base: Path, value: str | None, *, must_exist: bool, key: str, source: str
) -> str | None:
    if value is None:
        return None
    path = Path(os.path.expanduser(value))
    candidate = path if path.is_absolute() else base / path
    if must_exist and not candidate.exists():
        raise ConfigError(f"{source}: {key}: {candidate} does not exist")
    return str(candidate)


_PATH_KEYS = ("data", "train_data", "output", "eval.cache_dir")


def _resolve_paths(raw: dict, base: Path, source: str) -> dict:
    """``raw`` with its paths taken relative to ``base`` (the YAML file's folder)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for key in _PATH_KEYS:
        section_name, _, name = key.rpartition(".")
        holder = out.get(section_name) if section_name else out
        if not isinstance(holder, dict):
            continue
        must_exist = name in ("data", "train_data")
        value = holder.get(name)
        if isinstance(value, str) or (name == "train_data" and isinstance(value, (list, dict))):
            holder[name] = _map_paths(
                value,
                lambda p, at, key=key, must_exist=must_exist: (
                    _resolve(base, p, must_exist=must_exist, key=key + at, source=source)
                    if isinstance(p, str)
                    else p  # not a path: the option's check says what to write
                ),
            )
    model = out.get("model")
    if isinstance(model, str) and (base / os.path.expanduser(model)).is_dir():
        out["model"] = str(base / os.path.expanduser(model))
    return out


def apply_overrides(raw: dict, overrides: dict, *, source: str = "<flags>") -> dict:
    """Set dotted keys (``{"train.batch_size": 8}``) in a copy of ``raw``.

    >>> apply_overrides({"train": {"epochs": 2}}, {"train.batch_size": 8})
    {'train': {'epochs': 2, 'batch_size': 8}}
    """
    sections = {"mine", "train", "eval"}
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for key, value in overrides.items():
        section_name, _, name = key.rpartition(".")
        if not section_name:
            merged[name] = value
            continue
        if section_name not in sections:
            raise ConfigError(f"{source}: unknown section in {key!r}: use mine., train. or eval.")
        current = merged.get(section_name)
        if current is not None and not isinstance(current, dict):
            raise ConfigError(f"{source}: {section_name!r} must be a mapping of keys")
        merged[section_name] = {**(current or {}), name: value}
    return merged


def _absolute(overrides: dict) -> dict:
    """Paths given as flags are relative to the current folder: made absolute."""
    out = dict(overrides)
    for key in _PATH_KEYS:
        if out.get(key) is not None:
            out[key] = _map_paths(
                out[key], lambda p, _: str(Path(os.path.expanduser(str(p))).absolute())
            )
    if out.get("model") is not None and Path(str(out["model"])).is_dir():
        out["model"] = str(Path(str(out["model"])).absolute())
    return out


def load_run_config(path: str | os.PathLike, overrides: dict | None = None) -> RunConfig:
    """Read a YAML config file; ``overrides`` (dotted keys, from flags) win over the file.

    Overrides' paths are relative to the current folder, the file's to the file's folder.
    """
    import yaml  # only to read a config file

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: expected a mapping of keys (data: ..., model: ...), got {type(raw).__name__}"
        )
    raw = _resolve_paths(raw, path.parent, str(path))
    merged = apply_overrides(raw, _absolute(overrides or {}), source=str(path))
    merged.setdefault("output", str(Path("runs") / path.stem))
    return _build(merged, str(path))


def config_from_flags(overrides: dict) -> RunConfig:
    """A :class:`RunConfig` from flags alone (no file): ``data`` is required."""
    merged = apply_overrides({}, _absolute(overrides))
    if merged.get("data") is None:
        raise ConfigError("give a config file (densefit run examples/scifact.yaml) or --data DIR")
    if not Path(merged["data"]).exists():
        raise ConfigError(f"<flags>: data: {merged['data']} does not exist")
    merged.setdefault("output", str(Path("runs") / Path(merged["data"]).name))
    return _build(merged, "<flags>")


def _build(merged: dict[str, Any], source: str) -> RunConfig:
    if "data" not in merged:
        raise ConfigError(f"{source}: data is required: a BEIR folder (corpus, queries, qrels)")
    config = RunConfig.from_mapping(merged, source=source)
    for path in train_paths(config.train_data):  # before any stage starts
        if not Path(path).exists():
            raise ConfigError(
                f"{source}: train_data: {path} does not exist; give a training file or folder "
                "(--train-data, or train_data in the file)"
            )
    config.source = source
    return config
