"""The ``densefit run`` configuration: one YAML file (or flags), checked key by key.

    data: scifact            # BEIR folder: corpus, queries, qrels/train.tsv, qrels/test.tsv
    model: all-MiniLM-L6-v2
    mine: {method: bm25, num_negatives: 1}
    train: {batch_size: 64, epochs: 1, max_seq_length: 128}
    eval: {split: test, max_seq_length: 128, distractors: 1500}

Every key is listed in :data:`KEY_DOCS` (``densefit run --keys`` prints them); an unknown
key is an error naming the file, the key, and the closest known one. Paths in a file are
relative to that file's folder; paths given as flags are relative to the current folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from densefit.config import TrainConfig, config_options, field_types
from densefit.errors import OptionError
from densefit.evaluate import DEFAULT_METRICS, parse_metric

__all__ = [
    "ConfigError",
    "EvalSettings",
    "KEY_DOCS",
    "MineSettings",
    "RunConfig",
    "TRAIN_DEFAULTS",
    "load_run_config",
    "options_reference",
    "apply_overrides",
]


class ConfigError(ValueError):
    """A configuration that cannot run: names the file, the key and what to write instead."""


@dataclass
class MineSettings:
    """Hard-negative mining before training (``method: null`` skips the stage)."""

    method: str | None = None
    num_negatives: int = 1
    range: str = "10:100"
    relative_margin: float | None = None
    sampling: str = "top"
    seed: int = 42
    batch_size: int = 64
    max_seq_length: int | None = None


@dataclass
class EvalSettings:
    """How the base and the trained model are evaluated (both with the same settings)."""

    split: str = "test"
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    max_seq_length: int | None = None
    batch_size: int = 64
    distractors: int | None = None
    sample_seed: int = 0
    cache_dir: str | None = None


# Pipeline defaults that differ from TrainConfig's own.
TRAIN_DEFAULTS: dict[str, Any] = {"memory": "auto", "checkpoint_every": 50}
# TrainConfig fields the train section does not take (set elsewhere in the pipeline).
_NOT_IN_TRAIN_SECTION = {"show_progress": "the top-level key `progress`"}


@dataclass
class RunConfig:
    """Everything ``densefit run`` does; see :data:`KEY_DOCS` for each key.

    >>> config = RunConfig(data="examples/scifact", train={"batch_size": 16})
    >>> config.train_config().memory, config.train_config().batch_size
    ('auto', 16)
    """

    data: str
    model: str = "all-MiniLM-L6-v2"
    output: str | None = None
    train_data: str | None = None
    train_split: str = "train"
    on_bad_row: str = "error"
    delete_checkpoints: bool = True
    progress: bool = True
    threads: int | None = None
    mine: MineSettings = field(default_factory=MineSettings)
    train: dict = field(default_factory=dict)
    eval: EvalSettings = field(default_factory=EvalSettings)
    source: str = field(default="<flags>", repr=False)  # where it was read from, for errors

    def __post_init__(self) -> None:
        check_run_config(self)

    def train_config(self) -> TrainConfig:
        """The TrainConfig of the train stage: pipeline defaults, then the train section."""
        options = {**TRAIN_DEFAULTS, **self.train, "show_progress": self.progress}
        try:
            return TrainConfig(**options)
        except OptionError as exc:
            raise ConfigError(f"{self.source}: {exc.named('train.' + exc.name)}") from None
        except ValueError as exc:
            raise ConfigError(f"{self.source}: train: {exc}") from None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("source")
        out["train"] = {**TRAIN_DEFAULTS, **self.train}
        return out


# The top-level, mine and eval keys; the train keys are added from TrainConfig's declaration.
KEY_DOCS: dict[str, str] = {
    "data": "BEIR folder (corpus.jsonl[.gz], queries.jsonl, qrels/<split>.tsv): the corpus to "
    "evaluate on and, unless `train_data` is set, the training pairs (its `train_split`).",
    "model": "Base model: a sentence-transformers folder or a name (all-MiniLM-L6-v2 is packaged).",
    "output": "Output folder (default: runs/<config file name>). Holds stages/, model/, eval/, "
    "report.md, report.json, plots/.",
    "train_data": "Optional training file (JSONL, CSV/TSV, Parquet) or BEIR folder instead of "
    "`data`'s train split; null: `data`.",
    "train_split": "qrels split of `data` (or of a BEIR `train_data`) to train on.",
    "on_bad_row": "error: stop at the first bad data row (file:line); skip: skip and report.",
    "delete_checkpoints": "Remove OUTPUT/model/checkpoints once training has finished (they "
    "only serve to resume an interrupted run; a MiniLM checkpoint is ~270 MB).",
    "progress": "Show progress bars.",
    "threads": "torch CPU threads for every stage; null: torch's default (one per core). On a "
    "CPU shared with other busy processes, 1 can be faster than 2.",
    "mine.method": "null: no mining (in-batch negatives only); bm25, dense (the base model) or "
    "hybrid: mine hard negatives from `data`'s corpus before training.",
    "mine.num_negatives": "Hard negatives per training row.",
    "mine.range": "MIN:MAX: skip the MIN best non-positive candidates, look no deeper than MAX.",
    "mine.relative_margin": "Skip candidates scoring above (1 - margin) x the positive's score "
    "(e.g. 0.05); null: keep all in range.",
    "mine.sampling": "top: the hardest in range; random: a seeded sample of them.",
    "mine.seed": "Seed for sampling: random.",
    "mine.batch_size": "Encoder batch size (dense, hybrid).",
    "mine.max_seq_length": "Truncate texts to this many tokens when mining (dense, hybrid); null: "
    "the model's own.",
    "eval.split": "Held-out qrels split of `data` to evaluate base and trained model on.",
    "eval.metrics": "Metrics: ndcg@K, mrr@K, recall@K, map@K, precision@K.",
    "eval.max_seq_length": "Truncate documents and queries to this many tokens for both "
    "evaluations; null: the base model's own (256 for all-MiniLM-L6-v2).",
    "eval.batch_size": "Encoder batch size.",
    "eval.distractors": "null: search the full corpus. N: search a fixed, seeded subsample: every "
    "document judged for the split's queries plus N random others (metrics are then higher "
    "than on the full corpus and not comparable with published numbers).",
    "eval.sample_seed": "Seed of the distractor sample.",
    "eval.cache_dir": "Folder where base-model evaluations are kept by fingerprint (model, "
    "data, settings) and reused by later runs, in any output folder; null: no cache.",
}


def _train_key_docs() -> dict[str, str]:
    """``train.<field>`` -> the field's help, declared once on TrainConfig."""
    docs = {}
    for f, opt in config_options():
        if f.name in _NOT_IN_TRAIN_SECTION:
            continue
        doc = opt.help
        if f.name in TRAIN_DEFAULTS:
            doc += f" Pipeline default: {TRAIN_DEFAULTS[f.name]}."
        docs[f"train.{f.name}"] = doc
    return docs


KEY_DOCS.update(_train_key_docs())


def _section_fields() -> dict[str, dict[str, Any]]:
    """Known keys per section with their type hints ("" = top level)."""
    train_hints = field_types()
    return {
        "": {
            f.name: typing.get_type_hints(RunConfig)[f.name]
            for f in fields(RunConfig)
            if f.name not in ("mine", "train", "eval", "source")
        },
        "mine": typing.get_type_hints(MineSettings),
        "train": {k: v for k, v in train_hints.items() if k not in _NOT_IN_TRAIN_SECTION},
        "eval": typing.get_type_hints(EvalSettings),
    }


def known_keys() -> list[str]:
    """Every key a config file may hold, dotted (``train.batch_size``)."""
    out = []
    for section, hints in _section_fields().items():
        out += [f"{section}.{k}" if section else k for k in hints]
    return out


def describe_keys() -> list[tuple[str, Any, str]]:
    """(key, default, documentation) of every key, in file order.

    >>> ("train.memory", "auto") in [(k, d) for k, d, _ in describe_keys()]
    True
    """
    defaults = {f.name: f.default for f in fields(RunConfig) if f.name in known_keys()}
    defaults["data"] = "(required)"
    for prefix, cls in (("mine", MineSettings), ("eval", EvalSettings)):
        for key, value in dataclasses.asdict(cls()).items():
            defaults[f"{prefix}.{key}"] = value
    for key, value in TrainConfig().to_dict().items():
        if key not in _NOT_IN_TRAIN_SECTION:
            defaults[f"train.{key}"] = TRAIN_DEFAULTS.get(key, value)
    return [(key, defaults.get(key), KEY_DOCS.get(key, "")) for key in known_keys()]


def _cell(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def options_reference() -> str:
    """docs/options.md: every option of ``densefit train`` and every key of ``densefit run``,
    generated from their declarations (``densefit options --markdown > docs/options.md``).

    >>> "| `train.batch_size` | `--batch-size` | 32 |" in options_reference()
    True
    """
    from densefit.config import options_markdown

    differs = ", ".join(f"`{k}: {_cell(v)}`" for k, v in TRAIN_DEFAULTS.items())
    lines = [
        "# Options",
        "",
        "<!-- Generated by `densefit options --markdown > docs/options.md` from the declarations",
        "in densefit/config.py (TrainConfig) and densefit/pipeline/config.py; do not edit. -->",
        "",
        "## Training",
        "",
        "`densefit train` takes each as a flag; `densefit run` as a `train.` key in its YAML file",
        f"or `--set train.KEY=VALUE`. `densefit run` changes two defaults: {differs}.",
        "",
        options_markdown().rstrip("\n"),
        "",
        "## `densefit run`",
        "",
        "| key | default | meaning |",
        "| --- | --- | --- |",
    ]
    for key, default, doc in describe_keys():
        if not key.startswith("train."):
            lines.append(f"| `{key}` | {_cell(default)} | {doc} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- checking


def _type_ok(value: Any, hint: Any) -> tuple[bool, Any]:
    """(ok, value converted): YAML 1.1 reads 3e-5 as a string, so floats accept strings."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for option in typing.get_args(hint):
            ok, converted = _type_ok(value, option)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if hint is str:
        return isinstance(value, str), value
    if origin is list or hint is list:
        return isinstance(value, list), value
    if hint is dict:
        return isinstance(value, dict), value
    return True, value


def _type_name(hint: Any) -> str:
    names = {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        type(None): "null",
        list: "a list",
    }
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        return "a list"
    if args:
        return " or ".join(names.get(a, str(a)) for a in args)
    return names.get(hint, str(hint))


def _unknown(source: str, section: str, key: str, known: list[str]) -> ConfigError:
    where = f"{section}.{key}" if section else key
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {section + '.' if section else ''}{close[0]}?)" if close else ""
    return ConfigError(
        f"{source}: unknown key {where!r}{hint}; known keys"
        f"{' in ' + section if section else ''}: {', '.join(known)} "
        "(`densefit run --keys` lists them with their meaning)"
    )


def _check_section(source: str, section: str, values: Any) -> dict:
    hints = _section_fields()[section]
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: {section!r} must be a mapping of keys, not {values!r}")
    out = {}
    for key, value in values.items():
        if section == "train" and key in _NOT_IN_TRAIN_SECTION:
            raise ConfigError(
                f"{source}: train.{key} is set by {_NOT_IN_TRAIN_SECTION[key]}, not in train"
            )
        if key not in hints:
            raise _unknown(source, section, str(key), list(hints))
        ok, converted = _type_ok(value, hints[key])
        if not ok:
            where = f"{section}.{key}" if section else key
            raise ConfigError(f"{source}: {where} must be {_type_name(hints[key])}, not {value!r}")
        out[key] = converted
    return out


def check_run_config(config: RunConfig) -> None:
    """Value checks beyond types: raise :class:`ConfigError` naming the key."""
    src = config.source

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(f"{src}: {message}")

    need(bool(config.data), "data is required: a BEIR folder (corpus, queries, qrels)")
    need(config.threads is None or config.threads >= 1, "threads must be >= 1 or null")
    need(
        config.on_bad_row in ("error", "skip"),
        f"on_bad_row must be error or skip, not {config.on_bad_row!r}",
    )
    m = config.mine
    need(
        m.method in (None, "bm25", "dense", "hybrid"),
        f"mine.method must be null, bm25, dense or hybrid, not {m.method!r}",
    )
    need(m.num_negatives >= 1, "mine.num_negatives must be >= 1")
    need(
        m.relative_margin is None or 0 <= m.relative_margin < 1,
        "mine.relative_margin must be in [0, 1) or null",
    )
    need(m.batch_size >= 1, "mine.batch_size must be >= 1")
    need(m.max_seq_length is None or m.max_seq_length >= 1, "mine.max_seq_length must be >= 1")
    need(
        m.sampling in ("top", "random"), f"mine.sampling must be top or random, not {m.sampling!r}"
    )
    from densefit.mine import parse_range

    try:
        parse_range(m.range)
    except ValueError as exc:
        need(False, f"mine.range: {exc}")
    e = config.eval
    need(bool(e.metrics), "eval.metrics is empty: list at least one, e.g. [ndcg@10]")
    for metric in e.metrics:
        try:
            parse_metric(str(metric))
        except ValueError as exc:
            need(False, f"eval.metrics: {exc}")
    need(e.distractors is None or e.distractors >= 0, "eval.distractors must be >= 0 or null")
    need(e.batch_size >= 1, "eval.batch_size must be >= 1")
    need(e.max_seq_length is None or e.max_seq_length >= 1, "eval.max_seq_length must be >= 1")
    if config.train_data is None:
        need(
            config.train_split != e.split,
            f"train_split and eval.split are both {e.split!r}: evaluate on a held-out split",
        )
    config.train_config()  # TrainConfig's own checks, named by section


def _resolve(
    base: Path, value: str | None, *, must_exist: bool, key: str, source: str
) -> str | None:
    if value is None:
        return None
    path = Path(os.path.expanduser(value))
    if path.is_absolute():
        candidate = path
    else:
        candidate = base / path
    if must_exist and not candidate.exists():
        raise ConfigError(f"{source}: {key}: {candidate} does not exist")
    return str(candidate)


def config_from_dict(
    raw: dict, *, source: str = "<flags>", base_dir: str | Path = "."
) -> RunConfig:
    """Build a :class:`RunConfig` from a parsed mapping, checking every key and type.

    Relative paths (``data``, ``train_data``, ``output``, ``eval.cache_dir``, and ``model``
    when such a folder exists) are taken relative to ``base_dir``.

    >>> config_from_dict({"data": ".", "train": {"batch_sise": 8}})
    Traceback (most recent call last):
    ...
    densefit.pipeline.config.ConfigError: <flags>: unknown key 'train.batch_sise' (did you mean train.batch_size?); ...
    """
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: expected a mapping of keys (data: ..., model: ...), got {type(raw).__name__}"
        )
    top = _check_section(
        source, "", {k: v for k, v in raw.items() if k not in ("mine", "train", "eval")}
    )
    sections = {s: _check_section(source, s, raw.get(s)) for s in ("mine", "train", "eval")}
    base = Path(base_dir)
    if "data" not in top:
        raise ConfigError(f"{source}: data is required: a BEIR folder (corpus, queries, qrels)")
    top["data"] = _resolve(base, top["data"], must_exist=True, key="data", source=source)
    top["train_data"] = _resolve(
        base, top.get("train_data"), must_exist=True, key="train_data", source=source
    )
    top["output"] = _resolve(base, top.get("output"), must_exist=False, key="output", source=source)
    if "model" in top and (base / os.path.expanduser(top["model"])).is_dir():
        top["model"] = str(base / os.path.expanduser(top["model"]))
    eval_values = dict(sections["eval"])
    if eval_values.get("cache_dir") is not None:
        eval_values["cache_dir"] = _resolve(
            base, eval_values["cache_dir"], must_exist=False, key="eval.cache_dir", source=source
        )
    if "metrics" in eval_values:
        eval_values["metrics"] = [str(m) for m in eval_values["metrics"]]
    return RunConfig(
        **top,
        mine=MineSettings(**sections["mine"]),
        train=sections["train"],
        eval=EvalSettings(**eval_values),
        source=source,
    )


def load_run_config(path: str | os.PathLike, overrides: dict | None = None) -> RunConfig:
    """Read a YAML config file; ``overrides`` (dotted keys, from flags) win over the file.

    Overrides' paths are relative to the current folder, the file's to the file's folder.
    """
    import yaml

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
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: expected a mapping of keys (data: ..., model: ...), got {type(raw).__name__}"
        )
    # Paths set by flags are relative to the current folder: make them absolute first.
    overrides = _absolute_paths(overrides or {})
    merged = apply_overrides(raw, overrides, source=str(path))
    config = config_from_dict(merged, source=str(path), base_dir=path.parent)
    if config.output is None:
        config.output = str(Path("runs") / path.stem)
    return config


_PATH_KEYS = ("data", "train_data", "output", "eval.cache_dir")


def _absolute_paths(overrides: dict) -> dict:
    out = dict(overrides)
    for key in _PATH_KEYS:
        if out.get(key) is not None:
            out[key] = str(Path(os.path.expanduser(out[key])).absolute())
    if out.get("model") is not None and Path(out["model"]).is_dir():
        out["model"] = str(Path(out["model"]).absolute())
    return out


def apply_overrides(raw: dict, overrides: dict, *, source: str = "<flags>") -> dict:
    """Set dotted keys (``{"train.batch_size": 8}``) in a copy of ``raw``.

    >>> apply_overrides({"train": {"epochs": 2}}, {"train.batch_size": 8})
    {'train': {'epochs': 2, 'batch_size': 8}}
    """
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        if section:
            if section not in ("mine", "train", "eval"):
                raise ConfigError(
                    f"{source}: unknown section in {key!r}: use mine., train. or eval."
                )
            if not isinstance(merged.get(section) or {}, dict):
                raise ConfigError(f"{source}: {section!r} must be a mapping of keys")
            merged[section] = {**(merged.get(section) or {}), name: value}
        else:
            merged[name] = value
    return merged


def config_from_flags(overrides: dict) -> RunConfig:
    """A :class:`RunConfig` from flags alone (no file): ``data`` is required."""
    overrides = _absolute_paths(overrides)
    config = config_from_dict(apply_overrides({}, overrides), source="<flags>", base_dir=Path.cwd())
    if config.output is None:
        config.output = str(Path("runs") / Path(config.data).name)
    return config
