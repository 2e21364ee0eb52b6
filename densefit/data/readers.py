"""Read training data from JSON Lines, CSV, TSV and Parquet files, BEIR folders, Hugging Face
dataset folders and Python dicts.

Files are streamed and decoded line by line, so a bad byte or a broken row is reported at
its own line (``data.jsonl:7: field 'anchor': expected text, got int (...)``) instead of
crashing the whole read. ``on_bad_row="skip"`` skips such rows and lists each of them in the
returned :class:`ReadReport`; nothing is dropped silently. The row layer (file formats,
field checks, bad rows) is :mod:`densefit.data.rows`, shared with :mod:`densefit.data.corpus`;
the columns of a training row are :mod:`densefit.data.records`'; folders written by
``Dataset.save_to_disk`` and Parquet shard folders are read by :mod:`densefit.data.arrow`
(their rows stay in Arrow). Several sources at once: :mod:`densefit.data.sources`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from densefit.data.arrow import (
    is_saved_dataset,
    parquet_folder_examples,
    parquet_shards,
    saved_dataset_examples,
)
from densefit.data.corpus import load_beir
from densefit.data.records import example_from_record, examples_of
from densefit.data.rows import SKIP_HINT, BadRows, OnBadRow, iter_rows, type_name, why_empty
from densefit.data.types import BadRowError, Document, ReadReport, TrainingExample

__all__ = [
    "example_from_record",
    "examples_from_records",
    "read_training_data",
]


# ----------------------------------------------------------------------------- training data


def read_training_data(
    path: str | os.PathLike,
    *,
    on_bad_row: OnBadRow = "error",
    split: str = "train",
    corpus: Mapping[str, Document] | None = None,
) -> tuple[Sequence[TrainingExample], ReadReport]:
    """Read (query, positive, negatives, score) rows from a file or a folder.

    Files are chosen by suffix: ``.jsonl``/``.json``/``.jsonl.gz`` (JSON Lines), ``.csv``
    and ``.tsv`` (header row required; TSV has no quoting), ``.parquet``. Column names:
    query ``anchor``/``query``/``question``; positive ``positive``/``pos_doc``; negatives
    ``negative`` or ``neg_doc`` (a text or a list of texts) and ``negative_1``, ``negative_2``,
    ... (in numeric order); score ``score``/``label``. Optional document ids (as written by
    ``densefit mine``, used to mask false negatives): ``positive_ids`` (every known positive
    of the query), ``positive_id`` and ``negative_ids`` (one per negative). Other columns are
    ignored.

    Folders:

    - a BEIR folder (``corpus.jsonl[.gz]``, ``queries.jsonl[.gz]``, ``qrels/<split>.tsv``) gives
      one (query, document) pair per judgment with score > 0, and every pair carries all
      positive document ids of its query in ``positive_ids``; ``corpus`` reuses an already
      read corpus of that folder instead of reading it again;
    - a folder written by ``Dataset.save_to_disk`` (``DatasetDict``: its ``split``), and a
      folder of Parquet shards (the Hub's ``data/train-00000-of-00002.parquet`` layout,
      ``split`` choosing the shards): same columns, rows kept in Arrow
      (:mod:`densefit.data.arrow`), bad rows ``FOLDER:row N`` / ``SHARD:row N``.

    Args:
        path: the file or folder.
        on_bad_row: ``"error"`` raises :class:`BadRowError` (``path:line: ...``) at the first
            bad row; ``"skip"`` skips bad rows and lists them in the report.
        split: the qrels split of a BEIR folder, the split of a dataset folder.
        corpus: BEIR folders only: documents by id, read earlier.

    Returns:
        The examples, each with ``origin == "path:line"``, and a :class:`ReadReport`.

    Example:
        >>> examples, report = read_training_data("train.jsonl")  # doctest: +SKIP
        >>> examples[0].query, examples[0].origin  # doctest: +SKIP
        ('what is a decorator?', 'train.jsonl:1')
    """
    path = Path(path)
    report = ReadReport(str(path))
    if corpus is not None and not path.is_dir():
        raise ValueError(f"{path}: corpus= is only used with BEIR folders; leave it out")
    if path.is_dir() and not _is_beir(path):
        if is_saved_dataset(path):
            return saved_dataset_examples(path, split=split, on_bad_row=on_bad_row)
        if parquet_shards(path, split):
            return parquet_folder_examples(path, split=split, on_bad_row=on_bad_row)
        if not (path / "qrels").is_dir():
            raise ValueError(
                f"{path}: not a training data folder; densefit reads a BEIR folder "
                "(corpus.jsonl[.gz], queries.jsonl[.gz], qrels/<split>.tsv), a folder written by "
                "Dataset.save_to_disk, or a folder of .parquet shards"
            )
    if path.is_dir():
        beir = load_beir(path, split, on_bad_row=on_bad_row, corpus=corpus)
        report.skipped = beir.report.skipped
        examples = beir.training_pairs()
    else:
        examples = examples_of(iter_rows(path), str(path), BadRows(on_bad_row, report))
    report.rows = len(examples)
    if not examples:
        raise ValueError(f"{path}: no training rows{why_empty(report)}")
    return examples, report


def _is_beir(path: Path) -> bool:
    """A folder with a BEIR corpus file."""
    return path.is_dir() and any((path / n).is_file() for n in ("corpus.jsonl", "corpus.jsonl.gz"))


def examples_from_records(
    records: Iterable[Mapping[str, Any]],
    *,
    origin: str = "<list>",
    on_bad_row: OnBadRow = "error",
) -> tuple[list[TrainingExample], ReadReport]:
    """Turn Python dicts (Haystack 1.x or sentence-transformers keys) into training examples.

    Same column names and checks as :func:`read_training_data`; each example's origin is
    ``"<origin>:<index>"`` with the 0-based index in ``records``.

    Example:
        >>> examples, _ = examples_from_records(
        ...     [{"question": "capital of France?", "pos_doc": "Paris", "neg_doc": ["Rome"]}]
        ... )
        >>> examples[0].negatives, examples[0].origin
        (('Rome',), '<list>:0')
    """
    report = ReadReport(origin)
    rows = (
        (f"{origin}:{i}", dict(r) if isinstance(r, Mapping) else _not_a_mapping(f"{origin}:{i}", r))
        for i, r in enumerate(records)
    )
    examples = examples_of(rows, origin, BadRows(on_bad_row, report))
    report.rows = len(examples)
    if not examples:
        raise ValueError(f"{origin}: no training rows{why_empty(report)}")
    return examples, report


def _not_a_mapping(origin: str, value: Any) -> BadRowError:
    return BadRowError(origin, None, f"expected a dict, got {type_name(value)}", SKIP_HINT)
