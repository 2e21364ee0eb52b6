"""Training rows that stay in Arrow: a Hugging Face ``datasets.Dataset`` (or one split of a
``DatasetDict``), a folder written by ``Dataset.save_to_disk``, and a folder of Parquet shards
as the Hub stores a dataset (``data/train-00000-of-00004.parquet``, ``train/0000.parquet``).

Every row is checked once, streamed batch by batch, with the checks and the ``source:row``
messages of files (:func:`densefit.data.records.example_from_record`); after that the rows stay
in the Arrow table (memory-mapped for a ``Dataset`` on disk): :class:`ArrowExamples` is a
``Sequence[TrainingExample]`` that builds a row's example when the trainer asks for it, so a
million rows never become a million Python objects. Only the columns densefit reads are kept.

``datasets`` is the optional extra ``datasets`` (``pip install 'densefit[datasets]'``): needed
for a ``Dataset`` folder; a Parquet shard folder is read with pyarrow alone.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from densefit.data.records import check_training_columns, example_from_record, is_training_column
from densefit.data.rows import BadRows, OnBadRow, why_empty
from densefit.data.types import BadRowError, ReadReport, TrainingExample

__all__ = [
    "ArrowExamples",
    "dataset_examples",
    "is_hf_dataset",
    "is_saved_dataset",
    "parquet_folder_examples",
    "parquet_shards",
    "saved_dataset_examples",
]

_BATCH = 1024  # rows converted at a time when checking or iterating
_HF_CLASSES = ("Dataset", "DatasetDict", "IterableDataset", "IterableDatasetDict")
# The split names the Hub recognises in shard names and folders (besides the one asked for).
_SPLIT_WORDS = frozenset(
    "train training validation valid val dev test testing eval evaluation".split()
)
_SHARD_STEM = re.compile(r"([A-Za-z][A-Za-z0-9]*)(?:[-_]\d.*)?")
INSTALL_HINT = "pip install 'densefit[datasets]'"


class ArrowExamples(Sequence[TrainingExample]):
    """The training rows of an Arrow table, each built when it is read.

    ``row(p)`` is the record at table position ``p``, ``records()`` every record in position
    order, ``origin(p)`` its ``source:row`` name; ``keep`` (a boolean mask, None: every row)
    leaves out the rows skipped as bad. Built by :func:`dataset_examples`,
    :func:`saved_dataset_examples` and :func:`parquet_folder_examples`.
    """

    def __init__(
        self,
        source: str,
        n: int,
        row: Callable[[int], dict],
        records: Callable[[], Iterator[dict]],
        origin: Callable[[int], str],
        keep: np.ndarray | None = None,
    ):
        self.source = source
        self._row, self._records, self._origin = row, records, origin
        self._keep = keep
        self._positions = None if keep is None else np.flatnonzero(keep)
        self._n = n if keep is None else len(self._positions)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # noqa: ANN001 - an int or a slice, as list's
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"row {i} of {self._n}")
        p = i if self._positions is None else int(self._positions[i])
        return example_from_record(self._row(p), self._origin(p))

    def __iter__(self) -> Iterator[TrainingExample]:
        for p, record in enumerate(self._records()):
            if self._keep is None or self._keep[p]:
                yield example_from_record(record, self._origin(p))

    def __repr__(self) -> str:
        return f"ArrowExamples({self.source!r}, {self._n} rows)"


def is_hf_dataset(value: Any) -> bool:
    """A ``datasets`` Dataset, DatasetDict or their iterable kinds (without importing datasets).

    >>> is_hf_dataset([{"anchor": "q", "positive": "p"}])
    False
    """
    return any(
        c.__module__.split(".")[0] == "datasets" and c.__name__ in _HF_CLASSES
        for c in type(value).__mro__
    )


def _kind(value: Any) -> str:
    return next(c.__name__ for c in type(value).__mro__ if c.__name__ in _HF_CLASSES)


def dataset_examples(
    dataset: Any,
    *,
    split: str = "train",
    on_bad_row: OnBadRow = "error",
    name: str | None = None,
) -> tuple[ArrowExamples, ReadReport]:
    """The training rows of a ``datasets.Dataset``, or of split ``split`` of a ``DatasetDict``.

    Column names and checks are those of files; a bad row is ``<dataset>:row 7`` (``name``
    instead of ``<dataset>`` when given; 7 is the row's index, ``dataset[7]``). The rows stay
    in the dataset's Arrow table (see :class:`ArrowExamples`).

    Example:
        >>> import datasets  # doctest: +SKIP
        >>> ds = datasets.Dataset.from_dict({"anchor": ["q"], "positive": ["p"]})  # doctest: +SKIP
        >>> examples, report = dataset_examples(ds)  # doctest: +SKIP
        >>> examples[0].origin  # doctest: +SKIP
        '<dataset>:row 0'
    """
    kind = _kind(dataset)
    source = name or "<dataset>"
    if kind in ("DatasetDict", "IterableDatasetDict"):
        if split not in dataset:
            splits = ", ".join(map(repr, dataset)) or "none"
            raise ValueError(
                f"{source}: this DatasetDict has no split {split!r} (its splits: {splits}); "
                "pass split= (--split) with one of them"
            )
        dataset = dataset[split]
        kind = _kind(dataset)
        source = name or f"<dataset {split}>"
    if kind == "IterableDataset":
        raise ValueError(
            f"{source}: an IterableDataset (streaming=True) cannot be read by row; load it "
            "without streaming=True, or write it with .save_to_disk() and train on that folder"
        )
    check_training_columns(dataset.column_names, source)
    view = dataset.select_columns([c for c in dataset.column_names if is_training_column(c)])
    view = view.with_format(None)  # plain Python values, whatever format the caller set

    def records() -> Iterator[dict]:
        for batch in view.iter(batch_size=_BATCH):
            names = list(batch)
            for values in zip(*batch.values()):
                yield dict(zip(names, values))

    return _checked(
        source, len(view), lambda p: view[p], records, lambda p: f"{source}:row {p}", on_bad_row
    )


def is_saved_dataset(folder: str | os.PathLike) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    folder = Path(folder)
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def saved_dataset_examples(
    folder: str | os.PathLike, *, split: str = "train", on_bad_row: OnBadRow = "error"
) -> tuple[ArrowExamples, ReadReport]:
    """The training rows of a ``save_to_disk`` folder (split ``split`` of a DatasetDict's),
    memory-mapped by ``datasets.load_from_disk``; bad rows are ``FOLDER:row N``."""
    try:  # the optional extra `datasets`
        import datasets  # the optional extra `datasets`
    except ImportError:
        raise ValueError(
            f"{folder}: a folder written by Dataset.save_to_disk needs the datasets library: "
            f"{INSTALL_HINT}"
        ) from None
    folder = Path(folder)
    loaded = datasets.load_from_disk(str(folder))
    name = str(folder / split) if _kind(loaded) == "DatasetDict" else str(folder)
    return dataset_examples(loaded, split=split, on_bad_row=on_bad_row, name=name)


def parquet_shards(folder: str | os.PathLike, split: str = "train") -> list[Path]:
    """The ``.parquet`` files of ``folder`` (and its subfolders) that hold split ``split``.

    Shards named by split as the Hub names them (``train-00000-of-00002.parquet``,
    ``train.parquet``, ``train/0000.parquet``) are chosen by ``split``; when no file is named
    by a split, every file is one split. ``[]`` when the folder has no Parquet file.
    """
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*.parquet") if p.is_file())
    splits = {f: _split_of(f.relative_to(folder), split) for f in files}
    named = sorted({s for s in splits.values() if s})
    if not named:
        return files
    chosen = [f for f, s in splits.items() if s == split]
    if not chosen:
        raise ValueError(
            f"{folder}: no Parquet shard of split {split!r} (the splits here: "
            f"{', '.join(named)}); pass --split (split=) with one of them"
        )
    return chosen


def _split_of(relative: Path, wanted: str) -> str | None:
    words = _SPLIT_WORDS | {wanted}
    match = _SHARD_STEM.fullmatch(relative.name[: -len(".parquet")])
    if match and match[1] in words:
        return match[1]
    return next((part for part in relative.parts[:-1] if part in words), None)


def parquet_folder_examples(
    folder: str | os.PathLike, *, split: str = "train", on_bad_row: OnBadRow = "error"
) -> tuple[ArrowExamples, ReadReport]:
    """The training rows of a folder of Parquet shards (:func:`parquet_shards`), read into
    one Arrow table (only the columns densefit reads); bad rows are ``SHARD:row N``, N from 1
    in each shard as for a single Parquet file."""
    import pyarrow as pa  # pyarrow: only to read Parquet shards
    import pyarrow.parquet as pq  # pyarrow: only to read Parquet shards

    files = parquet_shards(folder, split)
    if not files:
        raise ValueError(f"{folder}: no .parquet file in this folder")
    tables, starts = [], []
    for file in files:
        try:
            table = pq.read_table(file, memory_map=True)
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"{file}: cannot read this Parquet file ({error})") from error
        check_training_columns(table.column_names, str(file))
        starts.append(sum(t.num_rows for t in tables))
        tables.append(table.select([c for c in table.column_names if is_training_column(c)]))
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as error:
        raise ValueError(
            f"{folder}: the shards' columns do not agree ({error}); give every shard the "
            "same column types"
        ) from error
    names = [str(f) for f in files]

    def origin(p: int) -> str:
        k = bisect.bisect_right(starts, p) - 1
        return f"{names[k]}:row {p - starts[k] + 1}"

    def records() -> Iterator[dict]:
        for batch in table.to_batches(max_chunksize=_BATCH):
            yield from batch.to_pylist()

    return _checked(
        str(folder), table.num_rows, lambda p: table.slice(p, 1).to_pylist()[0], records,
        origin, on_bad_row,
    )  # fmt: skip


def _checked(
    source: str,
    n: int,
    row: Callable[[int], dict],
    records: Callable[[], Iterator[dict]],
    origin: Callable[[int], str],
    on_bad_row: OnBadRow,
) -> tuple[ArrowExamples, ReadReport]:
    """Check every row once (streamed); the rows that passed as :class:`ArrowExamples`."""
    report = ReadReport(source)
    bad = BadRows(on_bad_row, report)
    keep = None
    for p, record in enumerate(records()):
        try:
            example_from_record(record, origin(p))
        except BadRowError as error:
            bad(error)
            if keep is None:
                keep = np.ones(n, dtype=bool)
            keep[p] = False
    examples = ArrowExamples(source, n, row, records, origin, keep)
    report.rows = len(examples)
    if not examples:
        raise ValueError(f"{source}: no training rows{why_empty(report)}")
    return examples, report
