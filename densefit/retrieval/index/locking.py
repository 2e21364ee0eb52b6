"""One writer at a time: an advisory lock file in the store folder (``fcntl.flock``).

Creating a store and indexing into it hold this lock, so two ``densefit index`` runs on one
store never both create it and never both embed the same documents: the second waits for
the first (saying so), then finds every document already stored. The operating system drops
the lock when its holder exits, killed or not, so a crash never leaves a store locked.
Searches do not take it.

The lock file is there while the lock is held: its holder removes it before letting go, so
a finished command leaves nothing behind (one killed while holding it leaves the file,
unlocked: the next holder takes it and removes it). A waiter that gets the lock of a file
removed meanwhile opens the path again, so two holders never lock two different files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from densefit.retrieval.index.types import StoreError

__all__ = ["LOCK_NAME", "StoreLockedError", "wait_for_lock", "writer_lock"]

LOCK_NAME = "densefit.lock"


class StoreLockedError(StoreError):
    """Another process kept the store's writer lock longer than we were willing to wait."""


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def writer_lock(
    folder: str | os.PathLike,
    *,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = _say,
    poll: float = 0.1,
    name: str = LOCK_NAME,
    doing: str = "writing to this store",
) -> Iterator[None]:
    """Hold the writer lock of the store folder ``folder`` (created if missing) in the block,
    waiting for another holder as :func:`wait_for_lock` does.

    >>> import tempfile
    >>> with writer_lock(tempfile.mkdtemp()):
    ...     pass
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name  # LOCK_NAME; a model swap holds its own (swap.LOCK_NAME)
    fd = -1

    def lock() -> bool:
        nonlocal fd
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = _try_lock(fd)
                if locked and _is_the_file_at(fd, path):
                    return True
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            if not locked:
                return False  # else its holder removed it as it let go: lock the file there now

    def holder() -> str:
        try:
            return path.read_text("utf-8", "replace")[:200].strip() or "unknown"
        except OSError:  # let go and removed meanwhile
            return "unknown"

    wait_for_lock(lock, holder, str(folder), doing, timeout, on_wait=on_wait, poll=poll)
    try:
        with contextlib.suppress(OSError):  # a full disk: the lock holds all the same
            os.ftruncate(fd, 0)  # who holds it, for a waiting process's message: a courtesy
            os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):  # gone already, or a folder we may not change
            os.unlink(path)  # while held: whoever locks this file next sees it gone
        os.close(fd)  # releases the lock


def wait_for_lock(
    lock: Callable[[], bool],
    holder: Callable[[], str],
    where: str,
    doing: str,
    timeout: float | None,
    *,
    on_wait: Callable[[str], None] | None = _say,
    poll: float = 0.1,
) -> None:
    """Return once ``lock()`` (one try) took a lock, trying every ``poll`` seconds up to
    ``timeout`` seconds (None: no limit); ``on_wait`` is told once that it waits and for whom
    (``holder()``), :class:`StoreLockedError` (``where`` first) after the timeout."""
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"lock_timeout must be >= 0 seconds (None: no limit), got {timeout!r}")
    if lock():
        return
    who = holder()
    if on_wait is not None:
        limit = "" if timeout is None else f" (up to {timeout:g}s)"
        on_wait(f"{where}: another process is {doing} ({who}); waiting for it to finish{limit}")
    deadline = None if timeout is None else time.monotonic() + timeout
    while not lock():
        if deadline is not None and time.monotonic() >= deadline:
            raise StoreLockedError(
                f"{where}: another process ({who}) is still {doing} after {timeout:g}s: "
                "wait for it to finish, or raise --lock-timeout"
            )
        time.sleep(poll)


def _is_the_file_at(fd: int, path: Path) -> bool:
    """Whether ``fd`` is the file ``path`` names now (not one removed since it was opened)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
