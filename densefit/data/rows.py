"""The row layer shared by every reader: rows of a file with ``path:line`` origins, field checks,
and what to do with a bad row.

:func:`iter_rows` streams JSON Lines, CSV, TSV and Parquet rows, decoding line by line so a bad
byte or a broken row is reported at its own line; :class:`BadRows` raises a bad row or lists it
in a :class:`~densefit.data.types.ReadReport`. Training data (:mod:`densefit.data.readers`) and
BEIR corpora (:mod:`densefit.data.corpus`) are both read through it.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import json
import os
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from densefit.data.text import text_problem, type_name
from densefit.data.types import BadRowError, ReadReport

OnBadRow = Literal["error", "skip"]
Record = dict[str, Any]
Rows = Iterator[tuple[str, "Record | BadRowError"]]  # (origin, the row or why it is bad)

SKIP_HINT = "fix the row, or pass --on-bad-row skip to skip bad rows"
SUPPORTED = ".jsonl, .json, .jsonl.gz, .csv, .tsv, .parquet, or a BEIR folder"

_ASCII_SPACE = " \t\n\r\x0b\x0c"  # what bytes.isspace() calls blank


def why_empty(report: ReadReport) -> str:
    """The end of a "no rows" message: the file was empty, or the first bad row skipped."""
    if not report.skipped:
        return ""
    origin, reason = report.skipped[0]
    return f" ({report.n_skipped} bad rows skipped; the first: {origin}: {reason})"


# ----------------------------------------------------------------------------- field checks


def first_present(record: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, Any]:
    """The first of ``keys`` whose value is not None, and that value (``(keys[0], None)`` if none)."""
    for key in keys:
        if record.get(key) is not None:
            return key, record[key]
    return keys[0], None


def require_text(record: Mapping[str, Any], keys: tuple[str, ...], origin: str) -> str:
    """The non-empty text under the first present of ``keys``, or :class:`BadRowError`."""
    key, value = first_present(record, keys)
    if value is None:
        names = " or ".join(repr(k) for k in keys)
        raise BadRowError(origin, None, f"missing {names}", SKIP_HINT)
    return check_text(value, origin, key)


def check_text(value: Any, origin: str, key: str, *, also: str = "", empty_ok: bool = False) -> str:
    """``value`` if it is a (non-empty) valid text, else :class:`BadRowError`: the checks of
    :func:`densefit.data.text.text_problem`, shared with every other text densefit reads."""
    problem = text_problem(value, expected=f"text {also}".strip(), empty_ok=empty_ok)
    if problem is not None:
        raise BadRowError(origin, key, problem.message, SKIP_HINT)
    return value


def check_columns(
    record: Mapping[str, Any], where: str, wanted: dict[str, tuple[str, ...]]
) -> None:
    """Raise ValueError when the first row has none of the wanted columns: likely the wrong file."""
    if any(key in record for keys in wanted.values() for key in keys):
        return
    expected = "; ".join(f"{role}: {' or '.join(map(repr, keys))}" for role, keys in wanted.items())
    raise ValueError(
        f"{where}: found the columns {list(record)!r} but none of the expected ones ({expected});"
        " rename the columns or check that this is the right file"
    )


def show_value(value: Any) -> str:
    """``repr(value)`` cut to 40 characters, for messages."""
    try:
        shown = repr(value)
    except ValueError:  # an int with more digits than Python will print
        return "a number too large to show"
    return shown if len(shown) <= 40 else shown[:37] + "..."


# ----------------------------------------------------------------------------- bad rows


class BadRows:
    """What to do with a bad row: raise it (``"error"``) or list it in ``report`` (``"skip"``).

    Example:
        >>> report = ReadReport("x.jsonl")
        >>> BadRows("skip", report)(BadRowError("x.jsonl:3", "anchor", "is empty"))
        >>> report.skipped
        [('x.jsonl:3', "field 'anchor': is empty")]
    """

    def __init__(self, on_bad_row: OnBadRow, report: ReadReport):
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
        self.skip = on_bad_row == "skip"
        self.report = report

    def __call__(self, error: BadRowError) -> None:
        if not self.skip:
            raise error
        reason = f"field {error.field!r}: {error.problem}" if error.field else error.problem
        self.report.skipped.append((error.origin, reason))


# ----------------------------------------------------------------------------- rows of a file


def file_format(path: Path) -> Literal["jsonl", "csv", "tsv", "parquet"]:
    """The format of ``path`` from its suffix, or ValueError listing the supported ones."""
    name = path.name.lower()
    for suffixes, kind in (
        ((".jsonl", ".json", ".jsonl.gz", ".json.gz"), "jsonl"),
        ((".csv", ".csv.gz"), "csv"),
        ((".tsv", ".tsv.gz"), "tsv"),
        ((".parquet",), "parquet"),
    ):
        if name.endswith(suffixes):
            return kind  # type: ignore[return-value]
    raise ValueError(f"{path}: unsupported file type; densefit reads {SUPPORTED}")


def iter_rows(path: str | os.PathLike) -> Rows:
    """Stream ``(origin, row)`` for each non-blank row of a JSONL, CSV, TSV or Parquet file.

    ``row`` is a dict, or a :class:`BadRowError` when the row cannot be parsed (invalid
    UTF-8 or JSON, not an object, wrong number of CSV fields). Empty CSV cells are None.
    ``origin`` is ``path:line`` (1-based physical line; the CSV header is line 1) or
    ``path:row N`` for Parquet. Problems with the whole file raise ValueError.

    Example:
        >>> for origin, row in iter_rows("train.csv"):  # doctest: +SKIP
        ...     print(origin, row)
        train.csv:2 {'anchor': 'q', 'positive': 'p'}
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    kind = file_format(path)
    if kind == "jsonl":
        return _jsonl_rows(path)
    if kind == "parquet":
        return _parquet_rows(path)
    return _delimited_rows(path, "\t" if kind == "tsv" else ",")


def _binary_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of each line of a plain or gzipped file, ``\n`` included."""
    gzipped = path.name.lower().endswith(".gz")
    with gzip.open(path, "rb") if gzipped else open(path, "rb") as file:
        try:
            yield from enumerate(file, start=1)
        except (OSError, EOFError, zlib.error) as error:
            kind = "gzip file" if gzipped else "file"
            raise ValueError(
                f"{path}: cannot read this {kind} ({error}); is it complete?"
            ) from error


def _jsonl_rows(path: Path) -> Rows:
    for line, raw in _binary_lines(path):
        if raw.isspace():
            continue
        origin = f"{path}:{line}"
        yield origin, _parse_json_line(raw.removeprefix(codecs.BOM_UTF8), origin, line == 1)


def _parse_json_line(raw: bytes, origin: str, first: bool) -> Record | BadRowError:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return BadRowError(origin, None, f"invalid UTF-8 at byte {error.start + 1}", SKIP_HINT)
    try:
        value = json.loads(text)
    except RecursionError:
        return BadRowError(origin, None, "JSON nested too deeply", SKIP_HINT)
    except ValueError as error:
        if not raw.endswith(b"\n"):
            problem = (
                "truncated last line: not valid JSON and no final newline (was the file cut off?)"
            )
        elif first and text.lstrip().startswith("["):
            problem = "a JSON array, but densefit reads JSON Lines: one object per line"
            return BadRowError(
                origin, None, problem, "convert it with: jq -c '.[]' in.json > out.jsonl"
            )
        elif isinstance(error, json.JSONDecodeError):
            problem = f"invalid JSON at column {error.colno}: {error.msg}"
        else:
            problem = f"invalid JSON ({error})"
        return BadRowError(origin, None, problem, SKIP_HINT)
    if not isinstance(value, dict):
        problem = f"expected a JSON object, got {type_name(value)}"
        return BadRowError(origin, None, problem, SKIP_HINT)
    return value


def _delimited_rows(path: Path, delimiter: str) -> Rows:
    # Undecodable bytes become lone surrogates (surrogateescape) and are reported per row;
    # TSV is read without quoting, so one stray quote cannot swallow the rest of the file.
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # long documents are fine
    lines = (raw.decode("utf-8", "surrogateescape") for _, raw in _binary_lines(path))
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    reader = csv.reader(lines, delimiter=delimiter, quoting=quoting)
    header: list[str] | None = None
    while True:
        origin = f"{path}:{reader.line_num + 1}"  # a quoted row may span lines: its first
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as error:
            if header is None:
                raise ValueError(f"{origin}: cannot read the header row ({error})") from error
            yield origin, BadRowError(origin, None, f"malformed row ({error})", SKIP_HINT)
            continue
        if all(not cell.strip(_ASCII_SPACE) for cell in cells):
            continue  # a blank line
        if header is None:
            header = _header(cells, origin)
            continue
        if len(cells) != len(header):
            problem = f"{len(cells)} fields, but the header has {len(header)}"
            yield origin, BadRowError(origin, None, problem, SKIP_HINT)
            continue
        row = dict(zip(header, cells, strict=True))
        if bad := _undecodable_cell(row):
            yield origin, BadRowError(origin, bad[0], bad[1], SKIP_HINT)
        else:
            yield origin, {name: cell or None for name, cell in row.items()}


def _undecodable_cell(row: dict[str, str]) -> tuple[str, str] | None:
    """The first cell holding undecodable bytes (any column, read or not) and the problem."""
    for name, cell in row.items():
        problem = text_problem(cell, empty_ok=True)
        if problem is not None and problem.kind == "unicode":
            return name, problem.message
    return None


def _header(cells: list[str], origin: str) -> list[str]:
    names = [cell.strip() for cell in cells]
    names[0] = names[0].removeprefix("\ufeff")
    if any(getattr(text_problem(name, empty_ok=True), "kind", "") == "unicode" for name in names):
        raise ValueError(f"{origin}: the header row is not valid UTF-8; save the file as UTF-8")
    if duplicates := sorted(name for name, n in Counter(names).items() if n > 1):
        raise ValueError(
            f"{origin}: duplicate column names {duplicates!r} in the header row;"
            " give every column a unique name (the first line must be the header)"
        )
    return names


def _parquet_rows(path: Path) -> Rows:
    import pyarrow as pa  # pyarrow: only to read Parquet
    import pyarrow.parquet as pq  # pyarrow: only to read Parquet

    try:
        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield f"{path}:row {row}", record
    except (pa.ArrowException, OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read this Parquet file ({error})") from error
