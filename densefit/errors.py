"""Errors that name the option or the file at fault, shared by the configuration, the models,
the stores, the server and the CLI."""

from __future__ import annotations

import errno
import os
import shutil

__all__ = [
    "DamagedFileError",
    "DiskFullError",
    "ModelNotFoundError",
    "OptionError",
    "ReadOnlyStoreError",
    "StorageFault",
    "storage_fault",
]


class OptionError(ValueError):
    """A value outside an option's declared choices or range.

    ``str(error)`` names the option by its Python name (``warmup_steps must be >= 0, got
    -5``); :meth:`named` renders the same message under another name, such as the CLI flag
    (:meth:`for_cli`) or the YAML key ``train.warmup_steps``.

    >>> error = OptionError("warmup_steps", "{option} must be >= 0, got -5", flag="--warmup")
    >>> str(error), error.for_cli()
    ('warmup_steps must be >= 0, got -5', '--warmup must be >= 0, got -5')
    """

    def __init__(self, name: str, template: str, *, flag: str | None = None) -> None:
        self.name, self.template, self.flag = name, template, flag
        super().__init__(self.named(name))

    def __reduce__(self):  # noqa: ANN204 - picklable across processes
        return (_rebuild, (self.name, self.template, self.flag))

    def named(self, label: str) -> str:
        """The message with the option called ``label``."""
        return self.template.format(option=label)

    def for_cli(self) -> str:
        """The message with the option called by its command-line flag."""
        return self.named(self.flag or "--" + self.name.replace("_", "-"))


def _rebuild(name: str, template: str, flag: str | None) -> OptionError:
    return OptionError(name, template, flag=flag)


class ModelNotFoundError(RuntimeError):
    """A model that is neither a loadable local folder nor fetchable (offline, or absent)."""


class StorageFault(Exception):
    """The machine is at fault, not the input and not densefit: a full disk, a read-only
    folder or file system, a damaged file. The message names the file and what to do; the
    command line exits 3 with it, ``densefit serve`` answers :attr:`status` (507 for a full
    disk, 403 for writes to a read-only store, 503 for a damaged file)."""

    status = 503


class DiskFullError(StorageFault):
    """No space left on the device holding a file that had to be written."""

    status = 507


class ReadOnlyStoreError(StorageFault):
    """A write to a store that is open read-only (a read-only file system or folder, a file
    this user may not write, or opened so on purpose); searching it works."""

    status = 403


class DamagedFileError(StorageFault):
    """A file is not what the program wrote there: truncated, overwritten, or unreadable."""


# errno values of OSErrors that mean the machine is at fault
_FULL = {errno.ENOSPC, errno.EDQUOT}
_READ_ONLY = {errno.EROFS}
_BROKEN = {errno.EIO}
# SQLite's primary result codes (sqlite3.Error.sqlite_errorcode & 0xFF)
_SQLITE_FULL, _SQLITE_READONLY, _SQLITE_CANTOPEN = 13, 8, 14
_SQLITE_CORRUPT, _SQLITE_NOTADB, _SQLITE_IOERR = 11, 26, 10

FREE_SPACE = "free space on that disk (or use another) and run the command again"
RESTORE = (
    "restore the store from a backup, or build it again with `densefit index` into a new "
    "folder (densefit index --from-store copies what can still be read)"
)


def storage_fault(exc: BaseException, path: object = None) -> StorageFault | None:
    """The :class:`StorageFault` an ``OSError`` or an ``sqlite3`` error means (the file it
    names, else ``path``, in the message), or None when it means something else (a bug, a
    bad input: the caller lets it through).

    >>> import errno
    >>> print(storage_fault(OSError(errno.ENOSPC, "No space left on device", "s/vectors-0.f32")))
    s/vectors-0.f32: the disk is full (No space left on device): free space on that disk (or use another) and run the command again
    >>> storage_fault(ValueError("bad")) is None
    True
    """
    if isinstance(exc, StorageFault):
        return exc
    if isinstance(exc, OSError):
        where = _named(exc.filename if exc.filename is not None else path)
        why = exc.strerror or str(exc)
        if exc.errno in _FULL:
            return DiskFullError(f"{where}the disk is full ({why}): {FREE_SPACE}")
        if exc.errno in _READ_ONLY:
            return ReadOnlyStoreError(f"{where}cannot write ({why}): use a writable file system")
        if exc.errno in _BROKEN:
            return DamagedFileError(f"{where}the disk failed to read or write ({why}): {RESTORE}")
        return None
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None or type(exc).__module__ != "sqlite3":
        return None
    where, why, primary = _named(path), str(exc), code & 0xFF
    if primary == _SQLITE_FULL or (primary == _SQLITE_IOERR and _full(path)):
        return DiskFullError(f"{where}the disk is full ({why}): {FREE_SPACE}")
    if primary in (_SQLITE_READONLY, _SQLITE_CANTOPEN):
        return ReadOnlyStoreError(
            f"{where}cannot write ({why}): make the folder and its files writable by this "
            "user to change the store (it can still be searched)"
        )
    if primary in (_SQLITE_CORRUPT, _SQLITE_NOTADB, _SQLITE_IOERR):
        return DamagedFileError(f"{where}the database is damaged ({why}): {RESTORE}")
    return None


def _named(path: object) -> str:
    return "" if path is None else f"{path}: "


def _full(path: object) -> bool:
    """Whether the disk holding ``path`` has no room left (SQLite reports some writes to a
    full disk as an I/O error)."""
    if path is None:
        return False
    try:
        return shutil.disk_usage(os.path.dirname(os.fspath(path)) or ".").free < 1 << 16
    except (OSError, TypeError):
        return False
