"""The one option mechanism: every option of every command is a field declared with
:func:`option` on an :class:`Options` dataclass, and everything else is derived from it.

A declaration carries the option's default, help, flag, choices, range and check, and the
facts other code asks about it (does it change the trained weights? the memory plan? which
group of ``--help`` and of the model card is it in?). From the declarations come:

- the checks, run when the dataclass is built (:meth:`Options.__post_init__`): the Python
  API, the command line and ``densefit run``'s YAML get the same ones, and an
  :class:`~densefit.errors.OptionError` names the option as its caller knows it (the flag on
  the command line, ``train.batch_size`` in a YAML file);
- the command-line options (:mod:`densefit.cli.options` turns the fields into typer
  parameters), the YAML sections and keys (:meth:`Options.from_mapping`), ``densefit run
  --keys`` and ``docs/options.md``.

An :class:`Options` class may hold another as a *section* (:func:`section`): ``densefit
run``'s ``train:`` key is a :class:`~densefit.config.train.TrainConfig`, and the ``densefit
train`` command offers the fields of its ``train`` section as flags.

A declaration shared by several classes (``--model``, ``--device``, ``--output``...) is
written once with :func:`shared` and used as ``model: str | None = MODEL()``.

>>> from dataclasses import dataclass
>>> @dataclass(kw_only=True)
... class Demo(Options):
...     top_k: int = option(10, "Results per query.", flag="-k", ge=1)
>>> Demo(top_k=0)
Traceback (most recent call last):
...
densefit.errors.OptionError: top_k must be >= 1, got 0
>>> Demo.from_mapping({"top_k": 5}).top_k
5
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from densefit.errors import OptionError

__all__ = [
    "REQUIRED",
    "Option",
    "Options",
    "Section",
    "check_value",
    "coerce",
    "declared_options",
    "flag_declaration",
    "flag_of",
    "option",
    "option_of",
    "section",
    "sections_of",
    "shared",
    "type_words",
    "yaml_value",
]

REQUIRED = dataclasses.MISSING  # option(REQUIRED, ...): no default, the user must give it

Choices = Sequence[Any] | Callable[[], Sequence[Any]]


@dataclass(frozen=True)
class Option:
    """How one option is offered and checked: declared once, read everywhere.

    - ``flag``: the click declaration (``--warmup``; a boolean ``--x/--no-x`` unless given
      a single flag such as ``--keep-best``); default ``--<name>``. ``short``: e.g. ``-m``.
      ``positional``: a command-line argument, not a flag.
    - ``choices`` (a sequence, or a function returning one), ``ge``/``gt``/``le`` (numbers),
      ``check`` (a function raising ``ValueError`` whose message completes "OPTION ...",
      returning the value to keep or None to keep the given one).
    - ``group``: the ``--help`` panel and the docs section it is listed under (the model
      card lists the ``loss`` group's values beside the loss).
    - ``cli``: offered on the command line; ``yaml``: a key where its class is a YAML section.
    - ``affects_weights``: a different value trains other weights (a resume or a rerun into
      the same folder must keep it; ``densefit run`` fingerprints it). ``plan``: offered by
      ``densefit plan`` (it can change the memory plan); ``memory``: part of the memory plan
      itself (a resumed run takes it from the checkpoint's plan).
    - ``run_flag``: ``densefit run`` offers it as a flag (every key is reachable with --set).
    """

    help: str
    flag: str | None = None
    short: str | None = None
    positional: bool = False
    choices: Choices | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    check: Callable[[Any], Any] | None = None
    metavar: str | None = None
    group: str | None = None
    envvar: str | None = None
    cli: bool = True
    yaml: bool = True
    affects_weights: bool = True
    plan: bool = True
    memory: bool = False
    run_flag: bool = False

    def choice_list(self) -> tuple:
        """The allowed values, or ``()`` when any value of the type goes."""
        if self.choices is None:
            return ()
        return tuple(self.choices() if callable(self.choices) else self.choices)

    def bounds(self) -> str:
        """The range in words (``>= 1``, ``> 0``, ``0 to 1``), or ``""``."""
        low = f">= {self.ge:g}" if self.ge is not None else (f"> {self.gt:g}" if self.gt else "")
        if self.gt == 0:
            low = "> 0"
        if self.le is not None:
            return f"{self.ge:g} to {self.le:g}" if self.ge is not None else f"<= {self.le:g}"
        return low

    def allowed(self) -> str:
        """What the option accepts, in words (for errors, help and docs)."""
        choices = self.choice_list()
        if choices:
            return ", ".join(yaml_value(c) for c in choices)
        return self.bounds() or self.metavar or ""


def option(default: Any = REQUIRED, help: str = "", *, factory: Callable[[], Any] | None = None,
           **kwargs: Any) -> Any:  # fmt: skip
    """A dataclass field declaring an option: its default (``REQUIRED`` for none; ``factory``
    for a mutable default), its help and the :class:`Option` attributes in ``kwargs``."""
    metadata = {"option": Option(help=help, **kwargs)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def shared(default: Any = REQUIRED, help: str = "", **kwargs: Any) -> Callable[[], Any]:
    """One declaration for an option several classes take (``--model``, ``--device``...):
    call the result to get the field, ``model: str | None = MODEL()`` (``STORE(required=True)``
    where a class cannot do without it). The declaration, default included, is the same
    object everywhere."""
    opt = Option(help=help, **kwargs)

    def make(*, required: bool = False) -> Any:
        """The field; ``required``: this class has no default for it (the user must give it)."""
        return field(default=REQUIRED if required else default, metadata={"option": opt})

    make.option = opt  # type: ignore[attr-defined]
    make.default = default  # type: ignore[attr-defined] # for a Python signature's default
    return make


@dataclass(frozen=True)
class Section:
    """An :class:`Options` class held by another: a YAML section and (some of) its flags.

    ``flags`` picks the section's fields the command line offers (``"all"``, ``"none"``,
    ``"run"``: those declared ``run_flag``, ``"plan"``: those declared ``plan``); ``prefix``
    is put before their flags (``--eval-max-seq-length``); ``exclude`` maps fields the
    holder sets itself (not YAML keys of the section) to what sets them. ``optional``: the section may be
    None (its default): ``densefit run`` mines only when its ``mine:`` section is given.
    """

    cls: type
    help: str
    flags: str = "all"
    prefix: str | None = None
    exclude: Mapping[str, str] = field(default_factory=dict)  # field -> who sets it
    optional: bool = False  # None (the default) leaves the section out: e.g. run's mine

    def offers(self, name: str, opt: Option) -> bool:
        """The command line offers the section's field ``name`` as a flag."""
        if name in self.exclude or not opt.cli:
            return False
        return {"all": True, "none": False, "run": opt.run_flag, "plan": opt.plan}[self.flags]


def section(cls: type, help: str, **kwargs: Any) -> Any:
    """A dataclass field holding an :class:`Options` section (default: ``cls()``, or None
    when ``optional``)."""
    held = Section(cls, help, **kwargs)
    if held.optional:
        return field(default=None, metadata={"section": held})
    return field(default_factory=cls, metadata={"section": held})


# ----------------------------------------------------------------------------- reading


@functools.cache
def declared_options(cls: type) -> tuple[tuple[dataclasses.Field, Option], ...]:
    """(field, option) of every option field of ``cls``, in declaration order."""
    return tuple((f, f.metadata["option"]) for f in fields(cls) if "option" in f.metadata)


@functools.cache
def sections_of(cls: type) -> tuple[tuple[dataclasses.Field, Section], ...]:
    """(field, section) of every section field of ``cls``."""
    return tuple((f, f.metadata["section"]) for f in fields(cls) if "section" in f.metadata)


@functools.cache
def _options_by_name(cls: type) -> dict[str, Option]:
    return {f.name: opt for f, opt in declared_options(cls)}


def option_of(cls: type, name: str) -> Option:
    """The :class:`Option` declared for field ``name`` of ``cls``."""
    return _options_by_name(cls)[name]


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Each field's type hint of ``cls`` (``int | None`` ...), resolved."""
    return typing.get_type_hints(cls)


def default_of(cls: type, name: str) -> Any:
    """The declared default of field ``name`` (``REQUIRED`` when it has none)."""
    f = cls.__dataclass_fields__[name]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def flag_declaration(cls: type, name: str) -> str:
    """The click declaration of field ``name``'s flag: the declared one, else ``--x`` (a
    boolean: ``--x/--no-x``)."""
    declared = option_of(cls, name).flag
    if declared:
        return declared
    flag = "--" + name.replace("_", "-")
    return f"{flag}/--no-{flag[2:]}" if field_types(cls)[name] is bool else flag


def flag_of(cls: type, name: str) -> str:
    """The flag that names field ``name`` in errors (the first of ``--x/--no-x``)."""
    opt = option_of(cls, name)
    if opt.positional:
        return name.upper()
    return flag_declaration(cls, name).split("/")[0]


# ----------------------------------------------------------------------------- checking


class Options:
    """Base of every options dataclass (declare it ``@dataclass(kw_only=True)``, frozen or
    not): checks each field against its declaration when built, then :meth:`check` for
    rules between fields. Sections given as mappings are built from them."""

    def __post_init__(self) -> None:
        cls = type(self)
        for f, sec in sections_of(cls):
            value = getattr(self, f.name)
            if isinstance(value, Mapping):
                object.__setattr__(self, f.name, sec.cls(**value))
            elif not (isinstance(value, sec.cls) or (value is None and sec.optional)):
                raise TypeError(f"{f.name} must be a {sec.cls.__name__}, got {value!r}")
        for f, _ in declared_options(cls):
            object.__setattr__(self, f.name, check_value(cls, f.name, getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Rules between fields; raise :class:`~densefit.errors.OptionError` (overridden)."""

    def error(self, name: str, requirement: str) -> OptionError:
        """An :class:`OptionError` about field ``name``: "OPTION ``requirement``"."""
        return _error(type(self), name, requirement)

    def to_dict(self) -> dict:
        """Every field by name, sections as nested dicts (JSON-ready)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` (checked like a new one)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mapping(
        cls,
        data: Mapping,
        *,
        source: str = "<mapping>",
        prefix: str = "",
        exclude: Mapping[str, str] | None = None,
        ignore_extra: bool = False,
    ) -> Any:
        """Build from a parsed YAML/JSON mapping: unknown keys are an error naming the
        closest known one (unless ``ignore_extra``), values are converted as YAML gives them
        (:func:`coerce`), and every error names ``source`` and the dotted key. ``exclude``:
        fields the holder of this section sets itself (not keys here)."""
        if not isinstance(data, Mapping):
            where = prefix.rstrip(".") or "the file"
            raise ConfigError(f"{source}: {where} must be a mapping of keys, got {data!r}")
        exclude = exclude or {}
        known = [k for k in yaml_keys(cls) if k not in exclude]
        held = {f.name: sec for f, sec in sections_of(cls)}
        values: dict[str, Any] = {}
        for key, value in data.items():
            key = str(key)
            if key in exclude:
                raise ConfigError(f"{source}: {prefix}{key} is set by {exclude[key]}, not here")
            if key not in known:
                if ignore_extra:
                    continue
                raise _unknown_key(source, prefix, key, known, cls)
            if key in held and value is None and held[key].optional:
                values[key] = None
                continue
            if key in held:
                values[key] = held[key].cls.from_mapping(
                    value if value is not None else {},
                    source=source,
                    prefix=f"{prefix}{key}.",
                    exclude=held[key].exclude,
                )
                continue
            try:
                values[key] = coerce(field_types(cls)[key], value)
            except ValueError as exc:
                raise ConfigError(f"{source}: {prefix}{key} {exc}") from None
        try:
            return cls(**values)
        except OptionError as exc:
            raise ConfigError(f"{source}: {exc.named(prefix + exc.name)}") from None


class ConfigError(ValueError):
    """A configuration that cannot run: names the file, the key and what to write instead."""


def yaml_keys(cls: type) -> list[str]:
    """The keys a YAML mapping of ``cls`` may hold (its sections included)."""
    keys = [f.name for f, opt in declared_options(cls) if opt.yaml]
    return keys + [f.name for f, _ in sections_of(cls)]


def _unknown_key(source: str, prefix: str, key: str, known: list[str], cls: type) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
    return ConfigError(
        f"{source}: unknown key {prefix + key!r}{hint}; known keys"
        f"{' in ' + prefix.rstrip('.') if prefix else ''}: {', '.join(known)} "
        "(`densefit run --keys` lists them with their meaning)"
    )


def _error(cls: type, name: str, requirement: str) -> OptionError:
    requirement = requirement.replace("{", "{{").replace("}", "}}")
    return OptionError(name, "{option} " + requirement, flag=flag_of(cls, name))


def check_value(cls: type, name: str, value: Any) -> Any:
    """``value`` checked against the declaration of ``cls``'s field ``name``: its choices,
    type (numbers), range and check; raises :class:`OptionError`. Returns the value to
    keep (a check may normalise it: ``device="auto"`` becomes the device it names here)."""
    opt = option_of(cls, name)
    choices = opt.choice_list()
    if value is dataclasses.MISSING:
        raise _error(cls, name, "is required")
    if choices and value not in choices:
        shown = ", ".join(yaml_value(c) for c in choices)
        raise _error(cls, name, f"must be one of {shown}, got {value!r}")
    if value is None or isinstance(value, bool):
        return value
    hint = field_types(cls).get(name, Any)
    bounded = opt.ge is not None or opt.gt is not None or opt.le is not None
    if bounded and (not isinstance(value, (int, float)) or _wants_int(hint, value)):
        raise _error(cls, name, f"must be {type_words(hint)}, got {value!r}")
    if opt.ge is not None and not value >= opt.ge:
        raise _error(cls, name, f"must be >= {opt.ge:g}, got {value!r}")
    if opt.gt is not None and not value > opt.gt:
        raise _error(cls, name, f"must be > {opt.gt:g}, got {value!r}")
    if opt.le is not None and not value <= opt.le:
        raise _error(cls, name, f"must be <= {opt.le:g}, got {value!r}")
    if opt.check is not None:
        try:
            checked = opt.check(value)
        except ValueError as exc:
            raise _error(cls, name, str(exc)) from None
        return value if checked is None else checked
    return value


def _wants_int(hint: Any, value: Any) -> bool:
    """An integer option given a non-integral number (2.5 for a count)."""
    args = set(typing.get_args(hint)) or {hint}
    return int in args and float not in args and isinstance(value, float)


# ----------------------------------------------------------------------------- types


def _members(hint: Any) -> tuple:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def coerce(hint: Any, value: Any) -> Any:
    """``value`` as YAML or a flag gives it, converted to the type ``hint`` (``3e-5`` is a
    string in YAML 1.1: a float option takes it), or ``ValueError`` saying what it must be.

    >>> coerce(float | None, "3e-5"), coerce(int, 4), coerce(list[int], [1, 2])
    (3e-05, 4, [1, 2])
    """
    members = _members(hint)
    if value is None:
        if type(None) in members or hint is Any:
            return None
        raise ValueError(f"must be {type_words(hint)}, not null")
    for member in members:
        ok, converted = _convert(member, value)
        if ok:
            return converted
    raise ValueError(f"must be {type_words(hint)}, not {value!r}")


def _convert(hint: Any, value: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if hint is type(None):
        return False, value
    if hint is Any:
        return True, value
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
    if hint is Path:
        return isinstance(value, (str, Path)), Path(value) if isinstance(value, str) else value
    if origin is list or hint is list:
        if not isinstance(value, list):
            return False, value
        (item,) = typing.get_args(hint) or (Any,)
        try:
            return True, [coerce(item, v) for v in value]
        except ValueError:
            return False, value
    if origin is dict or hint is dict:
        return isinstance(value, dict), value
    return True, value


def type_words(hint: Any) -> str:
    """A type hint in words: ``int | None`` -> "an integer or null".

    >>> type_words(int | None), type_words(list[str])
    ('an integer or null', 'a list')
    """
    names = {bool: "true/false", int: "an integer", float: "a number", str: "text",
             Path: "a path", type(None): "null"}  # fmt: skip
    words = []
    for member in _members(hint):
        if typing.get_origin(member) is list or member is list:
            words.append("a list")
        elif typing.get_origin(member) is dict or member is dict:
            words.append("a mapping")
        else:
            words.append(names.get(member, getattr(member, "__name__", str(member))))
    nulls = [w for w in words if w == "null"]
    return " or ".join([w for w in words if w != "null"] + nulls)


def yaml_value(value: Any) -> str:
    """A value as YAML writes it: ``null``, ``true``, ``[1, 2]``, ``8GiB``.

    >>> yaml_value(None), yaml_value(True), yaml_value([384, 64]), yaml_value(2e-05)
    ('null', 'true', '[384, 64]', '2e-05')
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (dict,)):
        return json.dumps(value)
    return str(value)


# ----------------------------------------------------------------------------- docs rows


def iter_rows(cls: type, *, prefix: str = "", yaml: bool = False) -> Iterator[dict[str, str]]:
    """One row per option of ``cls`` (sections expanded, keys dotted): key, flag, type,
    default, allowed values, help, group. ``yaml=True``: only YAML keys."""
    for f, opt in declared_options(cls):
        if yaml and not opt.yaml:
            continue
        default = default_of(cls, f.name)
        yield {
            "key": prefix + f.name,
            "flag": "" if not opt.cli else _flag_words(cls, f.name),
            "type": type_words(field_types(cls)[f.name]),
            "default": "(required)" if default is REQUIRED else yaml_value(default),
            "allowed": opt.allowed(),
            "help": opt.help,
            "group": opt.group or "",
        }
    for f, sec in sections_of(cls):
        for row in iter_rows(sec.cls, prefix=f"{prefix}{f.name}.", yaml=yaml):
            if row["key"].rpartition(".")[2] in sec.exclude:
                continue
            yield row


def _flag_words(cls: type, name: str) -> str:
    opt = option_of(cls, name)
    if opt.positional:
        return name.upper()
    flag = flag_declaration(cls, name)
    return f"{opt.short}, {flag}" if opt.short else flag
