"""Command-line options generated from the declarations (:mod:`densefit.config.options`).

:func:`options_command` turns an :class:`~densefit.config.options.Options` class into a
command's typer parameters: one per field (an argument where declared ``positional``) and
one per field of its sections that the section offers (``densefit train`` offers every
:class:`~densefit.config.train.TrainConfig` field, ``densefit plan`` those that shape the
plan, ``densefit run`` those declared ``run_flag``). The command function receives the
built object; building it runs every declared check, and an error names the flag.

>>> import typer
>>> from dataclasses import dataclass
>>> from densefit.config.options import Options, option
>>> @dataclass(kw_only=True)
... class Hello(Options):
...     name: str = option("world", "Who to greet.")
>>> @options_command(Hello)
... def hello(options: Hello) -> None:
...     print(f"hello {options.name}")
>>> from typer.testing import CliRunner
>>> app = typer.Typer()
>>> _ = app.command()(hello)
>>> CliRunner().invoke(app, ["--name", "you"]).output
'hello you\\n'
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from densefit.config.options import (
    REQUIRED,
    Option,
    Section,
    check_value,
    declared_options,
    default_of,
    field_types,
    flag_declaration,
    sections_of,
    yaml_value,
)
from densefit.errors import OptionError

__all__ = ["Flag", "command_flags", "options_command"]


@dataclass(frozen=True)
class Flag:
    """One generated command-line option: where its value goes and how it is spelt."""

    cls: type  # the Options class that declares the field
    name: str  # the field
    section: str | None  # the holder's field of the section, None for a top-level field
    declaration: str  # click's: "--batch-size", "--progress/--no-progress"
    short: str | None
    opt: Option

    @property
    def parameter(self) -> str:
        """The Python name of the typer parameter (unique within a command)."""
        return self.name if self.section is None else f"{self.section}__{self.name}"

    @property
    def flag(self) -> str:
        """How errors name it: the first spelling, or the argument's name."""
        return self.name.upper() if self.opt.positional else self.declaration.split("/")[0]

    @property
    def key(self) -> str:
        """The dotted key (``train.batch_size``) of ``densefit run``'s configuration."""
        return self.name if self.section is None else f"{self.section}.{self.name}"


def _prefixed(declaration: str, prefix: str | None) -> str:
    if not prefix:
        return declaration
    parts = []
    for spelling in declaration.split("/"):
        if spelling.startswith("--no-"):
            parts.append(f"--no-{prefix}-{spelling[5:]}")
        else:
            parts.append(f"--{prefix}-{spelling[2:]}")
    return "/".join(parts)


def command_flags(cls: type) -> list[Flag]:
    """Every flag (and argument) a command built on ``cls`` takes, in declaration order."""
    flags: list[Flag] = []
    for f, opt in declared_options(cls):
        if opt.cli:
            decl = flag_declaration(cls, f.name)
            flags.append(Flag(cls, f.name, None, decl, opt.short, opt))
    for f, sec in sections_of(cls):
        for g, opt in declared_options(sec.cls):
            if sec.offers(g.name, opt):
                decl = _prefixed(flag_declaration(sec.cls, g.name), sec.prefix)
                short = None if sec.prefix else opt.short
                flags.append(Flag(sec.cls, g.name, f.name, decl, short, opt))
    seen: dict[str, Flag] = {}
    for flag in flags:
        for spelling in [*flag.declaration.split("/"), flag.short]:
            if spelling and not flag.opt.positional:
                if spelling in seen:
                    raise TypeError(
                        f"{cls.__name__}: {spelling} is declared by {seen[spelling].key} and "
                        f"{flag.key}: rename one"
                    )
                seen[spelling] = flag
    return flags


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the type typer parses, whether None is allowed) of a field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    if not typing.get_args(hint):
        return hint, False
    if typing.get_origin(hint) is list:
        return hint, False
    if len(args) == 1:
        return args[0], optional
    return str, optional  # float | str, list[int] | str ...: the declared check parses text


class _Null:
    """``null`` given to an override flag (``densefit run --eval-distractors null``): the key
    is set to null, which "not given" (None) cannot say."""

    def __repr__(self) -> str:
        return "null"


NULL = _Null()


def _none_or(base: type, null: Any = None) -> Callable[[str], Any]:
    """A parser that reads ``null``/``none`` as ``null`` (None): ``--max-grad-norm null``."""

    def parse(text: Any) -> Any:
        if not isinstance(text, str):  # the default, already typed
            return text
        return null if text.strip().lower() in ("null", "none") else base(text)

    parse.__name__ = getattr(base, "__name__", "value")
    return parse


def _parameter(flag: Flag, *, unset: bool) -> inspect.Parameter:
    opt, hint = flag.opt, field_types(flag.cls)[flag.name]
    base, optional = _base_type(hint)
    is_list = typing.get_origin(base) is list
    default = default_of(flag.cls, flag.name)
    help_text = opt.help + (f" ({opt.bounds()})" if opt.bounds() else "")
    info: dict[str, Any] = {"help": help_text}
    if opt.group and not opt.positional:
        info["rich_help_panel"] = opt.group
    choices = [c for c in opt.choice_list() if c is not None]
    if choices:
        info["metavar"] = "[" + "|".join(map(str, choices)) + "]"
    elif opt.metavar:
        info["metavar"] = opt.metavar
    if opt.envvar:
        info["envvar"] = opt.envvar
    if unset:
        value: Any = [] if is_list else None  # None: not given, the file's key stands
    elif default is REQUIRED:
        value = ...
    elif isinstance(default, list) and not is_list:  # a list read from text: "a,b,c"
        value = ",".join(map(str, default))
    else:
        value = list(default) if isinstance(default, list) else default
    if optional and default not in (None, REQUIRED) and not unset and base is not bool:
        info["parser"] = _none_or(base)  # e.g. --max-grad-norm null: no clipping
    elif optional and base in (int, float):  # null as the YAML key takes it
        # --distractors null: the default; densefit run's --eval-distractors null: the
        # file's eval.distractors set to null (the whole corpus)
        info["parser"] = _none_or(base, NULL if unset else None)
    if is_list:
        annotation: Any = base
    elif optional or value is None:
        annotation = base | None
    else:
        annotation = base
    if opt.positional:
        metavar = info.get("metavar") or flag.name.upper()
        maker: Any = typer.Argument(value, help=help_text, metavar=metavar)
    else:
        names = [flag.declaration] + ([flag.short] if flag.short else [])
        maker = typer.Option(value, *names, **info)
    return inspect.Parameter(
        flag.parameter, inspect.Parameter.KEYWORD_ONLY, default=maker, annotation=annotation
    )


def _values(
    flags: list[Flag], kwargs: dict[str, Any], *, unset: bool
) -> Iterator[tuple[Flag, Any]]:
    for flag in flags:
        value = kwargs.pop(flag.parameter)
        if isinstance(value, Path) and field_types(flag.cls)[flag.name] in (str, str | None):
            value = str(value)
        if unset and (value is None or value == []):
            continue
        yield flag, None if value is NULL else value


def build(cls: type, given: dict[str, Any], flags: list[Flag]) -> Any:
    """``cls`` built from the command line's values (``given``: parameter -> value); an
    :class:`OptionError` names the flag as the command line spells it."""
    by_field = {(f.section, f.name): f for f in flags}
    top: dict[str, Any] = {}
    held: dict[str, dict[str, Any]] = {}
    for flag in flags:
        if flag.parameter not in given:
            continue
        if flag.section is None:
            top[flag.name] = given[flag.parameter]
        else:
            held.setdefault(flag.section, {})[flag.name] = given[flag.parameter]
    try:
        sections = {}
        for f, sec in sections_of(cls):
            values = held.get(f.name, {})
            if sec.optional and not values:
                continue
            sections[f.name] = _build_section(sec, f.name, values, by_field)
        return cls(**top, **sections)
    except OptionError as exc:
        raise _renamed(exc, None, by_field) from None


def _build_section(sec: Section, name: str, values: dict, by_field: dict) -> Any:
    try:
        return sec.cls(**values)
    except OptionError as exc:
        raise _renamed(exc, name, by_field) from None


def _renamed(exc: OptionError, section: str | None, by_field: dict) -> OptionError:
    """``exc`` naming the option by the flag this command gives it (a prefixed one)."""
    flag = by_field.get((section, exc.name))
    if flag is None:
        return exc
    return OptionError(exc.name, exc.template, flag=flag.flag)


def _checked(flag: Flag, value: Any) -> Any:
    """An override flag's value checked against its declaration, so that its error names
    the flag (``--threads must be >= 1``), not the key of the merged configuration."""
    try:
        return check_value(flag.cls, flag.name, value)
    except OptionError as exc:
        raise OptionError(exc.name, exc.template, flag=flag.flag) from None


def options_command(
    cls: type, *, overrides: type | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command one option per declared field of ``cls`` (and of the sections it
    offers), generated from the declarations; the command receives the built object as
    ``options``. Its own parameters (other than ``options`` and ``overrides``) are kept.

    ``overrides``: a second class whose flags only override what a file says (``densefit
    run``): each defaults to "not given" and the command receives ``overrides``, a dict of
    the dotted keys given (``{"train.batch_size": 64}``).
    """
    flags = command_flags(cls)
    extra = command_flags(overrides) if overrides is not None else []
    clash = {f.parameter for f in flags} & {f.parameter for f in extra}
    if clash:
        raise TypeError(f"{cls.__name__} and {overrides.__name__} both declare {sorted(clash)}")

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(func, eval_str=True).parameters.values()
            if p.name not in ("options", "overrides")
        ]
        generated = [_parameter(flag, unset=False) for flag in flags]
        generated += [_parameter(flag, unset=True) for flag in extra]

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            given = dict(_values(flags, kwargs, unset=False))
            options = build(cls, {flag.parameter: v for flag, v in given.items()}, flags)
            if overrides is None:
                return func(**kwargs, options=options)
            keys = {flag.key: _checked(flag, v) for flag, v in _values(extra, kwargs, unset=True)}
            return func(**kwargs, options=options, overrides=keys)

        params = generated + own
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.declared_flags = [*flags, *extra]  # type: ignore[attr-defined] # docs read them
        return command

    return decorate


def describe_default(cls: type, name: str) -> str:
    """The declared default as YAML writes it (``null``, ``true``), for help and docs."""
    default = default_of(cls, name)
    return "(required)" if default is dataclasses.MISSING else yaml_value(default)
