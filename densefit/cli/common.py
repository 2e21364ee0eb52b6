"""What every densefit command shares: one way to warn, one way to fail, the bad-row choice,
and the options generated from :class:`~densefit.config.TrainConfig`'s declaration.
"""

from __future__ import annotations

import functools
import inspect
import shlex
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

__all__ = [
    "OnBadRow",
    "DIM_OPTION",
    "DOCUMENT_PROMPT_OPTION",
    "QUERY_PROMPT_OPTION",
    "check_output_folder",
    "device_option",
    "err",
    "fail",
    "invocation",
    "lora_summary",
    "print_error",
    "routed_warnings",
    "train_options",
    "warn",
]

err = Console(stderr=True)

# The command line of this invocation (after the program name), set by the app's main: the
# Ctrl-C message of `densefit train` prints the exact command that resumes it.
_INVOCATION: list[str] = []


class OnBadRow(str, Enum):
    error = "error"
    skip = "skip"


def print_error(message: str) -> None:
    """Print ``error: message`` in red on stderr, as one line."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code`` (no traceback)."""
    print_error(message)
    raise typer.Exit(code)


def warn(message: str) -> None:
    """Print ``warning: message`` in yellow on stderr: the one way a command warns."""
    err.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    if issubclass(category, (UserWarning, RuntimeWarning)):
        warn(str(message))
    else:  # FutureWarning, DeprecationWarning...: say which kind
        warn(f"{category.__name__}: {message}")


@contextmanager
def routed_warnings() -> Iterator[None]:
    """Print every Python warning raised inside through :func:`warn`, as it happens."""
    with warnings.catch_warnings():
        warnings.simplefilter("default", UserWarning)
        warnings.simplefilter("default", RuntimeWarning)
        warnings.showwarning = _show_warning
        yield


def set_invocation(args: list[str]) -> None:
    """Remember this invocation's arguments (see :func:`invocation`)."""
    _INVOCATION[:] = list(args)


def invocation(*, drop: tuple[str, ...] = (), add: tuple[str, ...] = ()) -> str:
    """This command line as ``densefit ...``, without the options in ``drop`` (and their
    values) and with ``add`` appended when missing: e.g. the command that resumes a run.
    """
    args, skip = [], False
    for arg in _INVOCATION:
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif name in drop:
            skip = "=" not in arg
        else:
            args.append(arg)
    args += [a for a in add if a not in args]
    return shlex.join(["densefit", *args])


# ----------------------------------------------------------------------------- generated options


def _none_or(base: type) -> Callable[[str], Any]:
    def parse(text: Any) -> Any:
        if not isinstance(text, str):  # the default, already typed
            return text
        return None if text.strip().lower() in ("null", "none") else base(text)

    parse.__name__ = base.__name__
    return parse


def _config_parameter(name: str, *, required: bool, unset: bool) -> inspect.Parameter:
    """A typer option for the TrainConfig field ``name``, from its declaration."""
    import typing

    from densefit.config import TrainConfig, field_types, flag_declaration, option_of

    opt, hint = option_of(name), field_types()[name]
    default = TrainConfig.__dataclass_fields__[name].default
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = hint if not args else (args[0] if len(args) == 1 else str)
    optional = type(None) in typing.get_args(hint)
    help_text = opt.help
    choices = [c for c in opt.choice_list() if c is not None]
    if opt.ge is not None or opt.gt is not None:
        help_text += f" ({opt.allowed()})"
    info: dict[str, Any] = {"help": help_text, "rich_help_panel": "Training options"}
    if choices:
        info["metavar"] = "[" + "|".join(map(str, choices)) + "]"
    elif opt.metavar:
        info["metavar"] = opt.metavar
    if optional and default is not None and base is not bool:
        info["parser"] = _none_or(base)  # e.g. --max-grad-norm null: no clipping
    annotation: Any = base if not (optional or unset) else base | None
    value = ... if required else (None if unset else default)
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(value, flag_declaration(name), **info),
        annotation=annotation,
    )


def train_options(
    select: Callable[[str, Any], bool], *, required: tuple[str, ...] = (), unset: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command one option per TrainConfig field for which ``select(name, option)`` is
    true (``option``: the field's :class:`~densefit.config.Option`), generated from the declaration (flag, help, default, choices).

    The command receives them as one dict, ``options`` (field name -> value); ``unset=True``
    makes every default None and passes only the options given (``densefit run``'s flags
    override the config file's keys). Building the TrainConfig stays in the command, inside
    the CLI's error handling.
    """
    from densefit.config import config_options

    names = [f.name for f, opt in config_options() if select(f.name, opt)]

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = [
            p for p in inspect.signature(func, eval_str=True).parameters.values()
            if p.name != "options"
        ]  # fmt: skip
        generated = [_config_parameter(n, required=n in required, unset=unset) for n in names]

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            options = {n: kwargs.pop(n) for n in names}
            if unset:
                options = {n: v for n, v in options.items() if v is not None}
            return func(**kwargs, options=options)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + generated
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def check_output_folder(output: Path) -> None:
    """Refuse an ``--output`` that names an existing file (before any data or model loads)."""
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"{output}: exists and is not a folder; choose another --output")


# ----------------------------------------------------------------------------- embedding options
# The prompt and Matryoshka-size options of index, search, eval and mine: declared once here,
# the prompts' help taken from TrainConfig's declaration (densefit train has the same flags).


def _embedding_option(name: str) -> Any:
    from densefit.config import flag_of, option_of

    opt = option_of(name)
    return typer.Option(
        None, flag_of(name), help=opt.help, metavar=opt.metavar, rich_help_panel="Embedding"
    )


QUERY_PROMPT_OPTION: Any = _embedding_option("query_prompt")
DOCUMENT_PROMPT_OPTION: Any = _embedding_option("document_prompt")
DIM_OPTION: Any = typer.Option(
    None,
    "--dim",
    min=1,
    help="Matryoshka: cut every vector to its first DIM coordinates, re-normalised (for a "
    "model trained with --matryoshka-dims); a store records it. Default: the full size "
    "(search: the store's).",
    rich_help_panel="Embedding",
)


# --backend and --batch-size of the commands that embed or search a store: declared once.
BACKEND_OPTION: Any = typer.Option(
    "exact",
    "--backend",
    help="Vector search: exact, faiss (HNSW32) or faiss:FACTORY, e.g. faiss:IVF4096,Flat.",
)
ENCODE_BATCH_OPTION: Any = typer.Option(64, "--batch-size", min=1, help="Texts per forward pass.")
# --on-bad-row and --progress of every command that reads data files: declared once.
ON_BAD_ROW_OPTION: Any = typer.Option(
    OnBadRow.error,
    "--on-bad-row",
    help="error: stop at the first bad data row (file:line); skip: skip and report each.",
)
PROGRESS_OPTION: Any = typer.Option(True, "--progress/--no-progress", help="Show progress bars.")


def device_option() -> Any:
    """The ``--device`` option of every command that runs a model (index, search, eval,
    mine), generated from ``TrainConfig.device``'s declaration (its default, ``auto``, and
    help); the command passes the value to :func:`densefit.models.load_model`, which
    resolves it with :func:`densefit.models.resolve_device`.
    """
    from densefit.config import TrainConfig, option_of

    declared = option_of("device")
    return typer.Option(
        TrainConfig.__dataclass_fields__["device"].default,
        "--device",
        help=declared.help,
        metavar=declared.metavar,
    )


def lora_summary(config: Any) -> str:
    """``, LoRA r=16 alpha=32`` for a LoRA run's summary line; empty without LoRA."""
    if getattr(config, "lora_r", None) is None:
        return ""
    alpha = config.lora_alpha if config.lora_alpha is not None else 2 * config.lora_r
    saved = "adapter" if config.save_adapter else "merged"
    return f", LoRA r={config.lora_r} alpha={alpha:g} (saved {saved})"
