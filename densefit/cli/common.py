"""What every densefit command shares: one way to warn, one way to fail, the console, and
the output conventions (docs/architecture.md, "Output").

- Errors: one line, ``error: ...``, on stderr (:func:`print_error`); flags named as flags.
- Warnings: ``warning: ...`` on stderr (:func:`warn`); Python warnings are routed there.
- Status and summary lines go to stderr, results (tables, ``--json``) to stdout; long lines
  are not hard-wrapped (a log file gets each line whole).
- Progress bars: on a terminal by default; none when stderr is not a terminal unless
  ``--progress`` is given; ``--no-progress`` silences the libraries' bars too.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click
import typer
from rich.console import Console
from rich.markup import escape

from densefit.memory.allocator import rerun_with_mimalloc
from densefit.wording import plural

__all__ = [
    "err",
    "fail",
    "invocation",
    "launch_torchrun",
    "out",
    "plural",
    "print_error",
    "progress_wanted",
    "quiet_libraries",
    "rerun_for_training",
    "routed_warnings",
    "say",
    "set_invocation",
    "warn",
]

# stderr: status, warnings, errors; stdout: results. soft_wrap: no hard line breaks.
err = Console(stderr=True, soft_wrap=True, highlight=False)
out = Console(soft_wrap=True, highlight=False)

# True when this process is the `densefit` command itself (not a CliRunner in a test): a
# command that trains may then re-run the process under mimalloc (rerun_for_training).
STANDALONE = False

# The command line of this invocation (after the program name), set by the app's main: the
# Ctrl-C message of `densefit train` prints the exact command that resumes it.
_INVOCATION: list[str] = []


def print_error(message: str) -> None:
    """Print ``error: message`` in red on stderr, as one line."""
    err.print(f"[bold red]error:[/] {escape(message)}")


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code`` (no traceback)."""
    print_error(message)
    raise typer.Exit(code)


def warn(message: str) -> None:
    """Print ``warning: message`` in yellow on stderr: the one way a command warns."""
    err.print(f"[yellow]warning:[/] {escape(str(message))}")


def say(message: str) -> None:
    """A status line on stderr (the jobs' ``say``)."""
    err.print(escape(str(message)))


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


def progress_wanted(given: bool, *, explicit: bool) -> bool:
    """Whether to draw progress bars: ``--no-progress`` never; ``--progress`` always; by
    default only when stderr is a terminal (a log file gets no bars)."""
    if not given:
        return False
    return explicit or sys.stderr.isatty()


def quiet_libraries() -> None:
    """Silence the bars transformers and huggingface_hub draw (loading and writing weights):
    what ``--no-progress`` (or no terminal) promises. Called before any model loads."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers.utils import logging as hf_logging  # the framework: only here

    hf_logging.disable_progress_bar()


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


def launch_torchrun(command: str, nproc: int | None) -> None:
    """``--nproc N`` of ``densefit train`` and ``densefit index``: re-run this very command
    line under torchrun (its agent, in this process) with N processes on this machine,
    without ``--nproc``, and exit with the status of the process that failed first (2 for a
    bad input, whose one error line that process printed) or 0. Returns at once when N is
    None or 1, or when this process is one that torchrun started. The processes get
    ``OMP_NUM_THREADS=1`` unless it is set: N processes using every core each would
    oversubscribe the CPU."""
    if nproc is None or nproc <= 1:
        return
    from densefit.training.distributed import launched_by_torchrun  # torch: a run starts

    if launched_by_torchrun():
        return
    argv = sys.argv[1:]
    if command not in argv:
        fail(
            f"--nproc: cannot find the {command} command in the command line; run "
            f"torchrun --nproc-per-node N -m densefit {command} ... yourself"
        )
    rest, skip = [], False
    for arg in argv[argv.index(command) :]:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    from torch.distributed import run as torchrun  # torch's launcher: only when launching
    from torch.distributed.elastic.multiprocessing.api import SignalException  # the same
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # the same

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = ["--standalone", f"--nproc-per-node={nproc}", "-m", "densefit", *rest]
    err.print(f"launching {plural(nproc, 'process', 'processes')}: torchrun {shlex.join(args)}")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):  # the processes say what went wrong
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(args))
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        raise typer.Exit(failure.exitcode if failure.exitcode > 0 else 1) from None
    except SignalException:  # Ctrl-C: torchrun stopped every process
        raise typer.Exit(130) from None
    raise typer.Exit(0)


def rerun_for_training() -> None:
    """On Linux, re-run this very command under mimalloc before training starts (glibc's
    malloc fragments the heap freed activations leave: densefit.memory.allocator). Called
    once the options are parsed and checked, so --help and a bad option never pay for it."""
    if STANDALONE:
        rerun_with_mimalloc()  # returns when not needed or not possible


def explicitly_given(name: str) -> bool:
    """Whether the current command's parameter ``name`` came from the command line (not
    its default)."""

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def progress_of(options: Any, name: str = "show_progress", parameter: str | None = None) -> bool:
    """The progress setting a command runs with (see :func:`progress_wanted`); silences the
    libraries' bars when off."""
    wanted = progress_wanted(getattr(options, name), explicit=explicitly_given(parameter or name))
    if not wanted:
        quiet_libraries()
    return wanted
