"""Training data as one or several named sources, read from whatever the user holds.

:func:`load_training_data` is the one entry point of ``train()``, :meth:`Retriever.train
<densefit.api.Retriever.train>` and the commands: a path (file, BEIR folder, ``save_to_disk``
folder, Parquet shard folder), a ``datasets.Dataset`` / ``DatasetDict``, a list of dicts or of
:class:`~densefit.data.types.TrainingExample`, or **several sources**: a list of those, or a
mapping ``{name: source}``. It returns a :class:`TrainingData`: the rows of every source one
after the other, with where each source starts, so the batching can keep each optimizer step
within one source (:mod:`densefit.data.batching`) and the log and the model card can report
each source.
"""

from __future__ import annotations

import bisect
import itertools
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densefit.data.arrow import ArrowExamples, dataset_examples, is_hf_dataset
from densefit.data.readers import examples_from_records, read_training_data
from densefit.data.rows import OnBadRow
from densefit.data.types import ReadReport, TrainingExample

__all__ = [
    "Source",
    "TrainingData",
    "load_training_data",
    "load_training_examples",
    "source_names",
]


@dataclass(frozen=True)
class Source:
    """One source of a :class:`TrainingData`: its name, its first row there and its rows."""

    name: str
    start: int
    rows: int
    report: ReadReport | None = None  # what its reader did (files, skipped rows), if it read


class TrainingData(Sequence[TrainingExample]):
    """The rows of one or several sources, one after the other.

    Row ``i`` is row ``i - start`` of the source that holds it (:meth:`source_of`); every
    row keeps its own ``origin`` (``file:line``). Each source's rows stay as its reader left
    them (a list, or an :class:`~densefit.data.arrow.ArrowExamples` over an Arrow table).

    >>> data = TrainingData([("a", [TrainingExample("q1", "p1")], None),
    ...                      ("b", [TrainingExample("q2", "p2"), TrainingExample("q3", "p3")], None)])
    >>> len(data), [s.name for s in data.sources], data.source_of(2), data[2].query
    (3, ['a', 'b'], 1, 'q3')
    """

    def __init__(self, parts: Sequence[tuple[str, Sequence[TrainingExample], ReadReport | None]]):
        if not parts:
            raise ValueError("no training data: give at least one source")
        names = [name for name, _, _ in parts]
        if len(set(names)) != len(names):
            repeated = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"two training sources are named {repeated[0]!r}: name each once")
        self._parts = [rows for _, rows, _ in parts]
        starts = list(itertools.accumulate((len(rows) for rows in self._parts), initial=0))
        self._starts = starts[:-1]
        self._n = starts[-1]
        self.sources = tuple(
            Source(name, start, len(rows), report)
            for (name, rows, report), start in zip(parts, self._starts)
        )

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # noqa: ANN001 - an int or a slice, as list's
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"row {i} of {self._n}")
        k = self.source_of(i)
        return self._parts[k][i - self._starts[k]]

    def __iter__(self) -> Iterator[TrainingExample]:
        for rows in self._parts:
            yield from rows

    def source_of(self, i: int) -> int:
        """The index (in :attr:`sources`) of the source that holds row ``i``."""
        return bisect.bisect_right(self._starts, i) - 1

    @property
    def names(self) -> list[str]:
        """The sources' names, in order."""
        return [s.name for s in self.sources]

    def describe(self) -> dict:
        """Files, rows and skipped rows (None: not recorded), and each source's when several:
        what the model card and the training summary show."""
        per_source = []
        for source, rows in zip(self.sources, self._parts):
            report = source.report
            per_source.append(
                {
                    "name": source.name,
                    "files": [report.path] if report is not None else _files_of(rows),
                    "rows": source.rows,
                    "skipped_rows": report.n_skipped if report is not None else None,
                }
            )
        skipped = [s["skipped_rows"] for s in per_source]
        out = {
            "files": sorted({f for s in per_source for f in s["files"]}),
            "rows": self._n,
            "skipped_rows": None if None in skipped else sum(skipped),
        }
        if len(per_source) > 1:
            out["sources"] = per_source
        return out


def _files_of(rows: Sequence[TrainingExample]) -> list[str]:
    """The files named by the rows' origins (``file:line``)."""
    if isinstance(rows, ArrowExamples):
        return [rows.source]
    return sorted({ex.origin.rpartition(":")[0] or ex.origin for ex in rows if ex.origin})


def load_training_data(
    data: Any,
    *,
    on_bad_row: OnBadRow = "error",
    split: str = "train",
) -> TrainingData:
    """Training rows from a path, a Hugging Face dataset, Python rows, or several of them.

    - a path: a file or folder (:func:`~densefit.data.readers.read_training_data`: JSONL,
      CSV/TSV, Parquet, a BEIR folder, a ``save_to_disk`` folder, a Parquet shard folder);
    - a ``datasets.Dataset``, or a ``DatasetDict`` (its ``split``), kept in Arrow
      (:mod:`densefit.data.arrow`);
    - a list of dicts (sentence-transformers or Haystack column names) or of
      :class:`TrainingExample`: one source;
    - **several sources**: a list of the above (each named after its path, or ``source N``)
      or a mapping ``{name: source}``;
    - a :class:`TrainingData`, as it is.

    ``split`` is the BEIR qrels split, the DatasetDict split or the Parquet shards' split.
    Skipped bad rows (``on_bad_row="skip"``) are listed in a ``UserWarning`` per source.

    >>> data = load_training_data({"faq": [{"question": "q", "pos_doc": "d"}],
    ...                            "manual": [{"anchor": "a", "positive": "p"}]})
    >>> data.names, len(data), data[1].origin
    (['faq', 'manual'], 2, 'manual:0')
    """
    if isinstance(data, TrainingData):
        return data
    if isinstance(data, Mapping) and not is_hf_dataset(data):
        if not data:
            raise ValueError("no training data: the mapping of sources is empty")
        sources = list(data.items())
    elif _several(data):
        sources = list(zip(source_names(data), data))
    else:
        sources = [(None, data)]
    parts = []
    for name, source in sources:
        examples, report = _read(source, name, on_bad_row=on_bad_row, split=split)
        if report is not None and report.n_skipped:
            warnings.warn(report.summary(), UserWarning, stacklevel=2)
        parts.append((str(name) if name is not None else _default_name(source), examples, report))
    return TrainingData(parts)


def _is_source(value: Any) -> bool:
    """Something that is a whole source by itself (not a row)."""
    return (
        isinstance(value, (str, os.PathLike, TrainingData, ArrowExamples))
        or is_hf_dataset(value)
        or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)))
    )


def _several(data: Any) -> bool:
    """A list of sources (rather than a list of rows)."""
    if isinstance(data, (str, os.PathLike, ArrowExamples)) or not isinstance(data, Sequence):
        return False
    kinds = {_is_source(item) for item in data}
    if kinds == {True, False}:
        raise ValueError(
            "the training data mixes rows (dicts) and sources (paths, datasets, lists) in one "
            "list: give a list of rows, or a list (or a mapping) of sources"
        )
    return kinds == {True}


def source_names(sources: Sequence[Any]) -> list[str]:
    """Names for a list of sources: a path's name (``scifact``, ``pairs.jsonl``), else
    ``source N``; a repeated name gets `` #2``, `` #3``...

    >>> source_names(["data/scifact", "faq.jsonl", [{"anchor": "q", "positive": "p"}], "x/faq.jsonl"])
    ['scifact', 'faq.jsonl', 'source 3', 'faq.jsonl #2']
    """
    names, seen = [], {}
    for k, source in enumerate(sources, start=1):
        name = Path(source).name if isinstance(source, (str, os.PathLike)) else f"source {k}"
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return names


def _default_name(source: Any) -> str:
    return Path(source).name if isinstance(source, (str, os.PathLike)) else "data"


def _read(
    source: Any, name: str | None, *, on_bad_row: OnBadRow, split: str
) -> tuple[Sequence[TrainingExample], ReadReport | None]:
    """One source's rows and its reader's report (None for rows that were not read)."""
    if isinstance(source, TrainingData):
        if len(source.sources) > 1:
            raise ValueError(f"source {name!r}: holds several sources itself; list them instead")
        return source, source.sources[0].report
    if isinstance(source, ArrowExamples):
        return source, None
    if isinstance(source, (str, os.PathLike)):
        return read_training_data(source, on_bad_row=on_bad_row, split=split)
    if is_hf_dataset(source):
        return dataset_examples(source, split=split, on_bad_row=on_bad_row, name=name)
    if isinstance(source, Mapping):
        raise ValueError(
            f"source {name!r}: a single dict is one row, not a source; give a list of rows"
        )
    if not isinstance(source, Sequence) or isinstance(source, (str, bytes)):
        where = f"source {name!r}" if name else "training data"
        raise ValueError(
            f"{where}: expected a path, a datasets.Dataset, a list of dicts or of "
            f"TrainingExamples, or several of those; got {type(source).__name__}"
        )
    records = list(source)
    if records and all(isinstance(r, TrainingExample) for r in records):
        return records, None
    return examples_from_records(records, origin=name or "<list>", on_bad_row=on_bad_row)


def load_training_examples(
    training_data: Any, *, on_bad_row: OnBadRow = "error", split: str = "train"
) -> TrainingData:
    """:func:`load_training_data` under its earlier name (Python rows, paths, datasets, or
    several sources), for :meth:`Retriever.train <densefit.api.Retriever.train>`.

    >>> rows = load_training_examples([{"question": "q", "pos_doc": "d"}])
    >>> rows[0].query, rows[0].positive
    ('q', 'd')
    """
    return load_training_data(training_data, on_bad_row=on_bad_row, split=split)
