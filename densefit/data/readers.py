"""Read training data from JSON Lines, CSV, TSV and Parquet files, BEIR folders and Python dicts.

Files are streamed and decoded line by line, so a bad byte or a broken row is reported at
its own line (``data.jsonl:7: field 'anchor': expected text, got int (...)``) instead of
crashing the whole read. ``on_bad_row="skip"`` skips such rows and lists each of them in the
returned :class:`ReadReport`; nothing is dropped silently. The row layer (file formats,
field checks, bad rows) is :mod:`densefit.data.rows`, shared with :mod:`densefit.data.corpus`.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from densefit.data.corpus import load_beir
from densefit.data.rows import (
    SKIP_HINT,
    BadRows,
    OnBadRow,
    Rows,
    check_columns,
    check_text,
    first_present,
    iter_rows,
    require_text,
    show_value,
    type_name,
    why_empty,
)
from densefit.data.types import BadRowError, Document, ReadReport, TrainingExample

__all__ = [
    "example_from_record",
    "examples_from_records",
    "load_training_examples",
    "read_training_data",
]

QUERY_KEYS = ("anchor", "query", "question")
POSITIVE_KEYS = ("positive", "pos_doc")
NEGATIVE_KEYS = ("negative", "neg_doc")  # each a text or a list of texts
SCORE_KEYS = ("score", "label")
_NUMBERED_NEGATIVE = re.compile(r"negative_(\d{1,9})")


# ----------------------------------------------------------------------------- training data


def read_training_data(
    path: str | os.PathLike,
    *,
    on_bad_row: OnBadRow = "error",
    split: str = "train",
    corpus: Mapping[str, Document] | None = None,
) -> tuple[list[TrainingExample], ReadReport]:
    """Read (query, positive, negatives, score) rows from a file or a BEIR folder.

    Files are chosen by suffix: ``.jsonl``/``.json``/``.jsonl.gz`` (JSON Lines), ``.csv``
    and ``.tsv`` (header row required; TSV has no quoting), ``.parquet``. Column names:
    query ``anchor``/``query``/``question``; positive ``positive``/``pos_doc``; negatives
    ``negative`` or ``neg_doc`` (a text or a list of texts) and ``negative_1``, ``negative_2``,
    ... (in numeric order); score ``score``/``label``. Optional document ids (as written by
    ``densefit mine``, used to mask false negatives): ``positive_ids`` (every known positive
    of the query), ``positive_id`` and ``negative_ids`` (one per negative). Other columns are
    ignored.

    A BEIR folder (``corpus.jsonl[.gz]``, ``queries.jsonl``, ``qrels/<split>.tsv``) gives
    one (query, document) pair per judgment with score > 0, and every pair carries all
    positive document ids of its query in ``positive_ids``. ``corpus`` reuses an already read
    corpus of that folder instead of reading it again.

    Args:
        path: the file or BEIR folder.
        on_bad_row: ``"error"`` raises :class:`BadRowError` (``path:line: ...``) at the first
            bad row; ``"skip"`` skips bad rows and lists them in the report.
        split: the qrels split of a BEIR folder.
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
    if path.is_dir():
        beir = load_beir(path, split, on_bad_row=on_bad_row, corpus=corpus)
        report.skipped = beir.report.skipped
        examples = beir.training_pairs()
    else:
        if corpus is not None:
            raise ValueError(f"{path}: corpus= is only used with BEIR folders; leave it out")
        examples = _examples(iter_rows(path), str(path), BadRows(on_bad_row, report))
    report.rows = len(examples)
    if not examples:
        raise ValueError(f"{path}: no training rows{why_empty(report)}")
    return examples, report


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
    examples = _examples(rows, origin, BadRows(on_bad_row, report))
    report.rows = len(examples)
    if not examples:
        raise ValueError(f"{origin}: no training rows{why_empty(report)}")
    return examples, report


def example_from_record(record: Mapping[str, Any], origin: str) -> TrainingExample:
    """One training row from a dict, or :class:`BadRowError` saying which field is wrong.

    Example:
        >>> example_from_record({"anchor": "q", "positive": "p", "negative_1": "n"}, "x:1")
        TrainingExample(query='q', positive='p', negatives=('n',), score=None, origin='x:1', positive_ids=(), positive_id='', negative_ids=())
    """
    query = require_text(record, QUERY_KEYS, origin)
    positive = require_text(record, POSITIVE_KEYS, origin)
    negatives: list[str] = []
    for key in NEGATIVE_KEYS:
        value = record.get(key)
        if isinstance(value, (list, tuple)):
            negatives += [check_text(item, origin, key) for item in value]
        elif value is not None:
            negatives.append(check_text(value, origin, key, also="or a list of texts"))
    numbered = sorted(
        (int(m[1]), key)
        for key in record
        if isinstance(key, str) and (m := _NUMBERED_NEGATIVE.fullmatch(key))
    )
    negatives += [check_text(record[k], origin, k) for _, k in numbered if record[k] is not None]
    score_key, score = first_present(record, SCORE_KEYS)
    negative_ids = _ids(record.get("negative_ids"), origin, "negative_ids")
    if negative_ids and len(negative_ids) != len(negatives):
        problem = f"{len(negative_ids)} id(s) for {len(negatives)} negative(s)"
        raise BadRowError(origin, "negative_ids", problem, "give one id per negative, or none")
    positive_id = _ids(record.get("positive_id"), origin, "positive_id")
    return TrainingExample(
        query=query,
        positive=positive,
        negatives=tuple(negatives),
        score=None if score is None else _check_score(score, origin, score_key),
        origin=origin,
        positive_ids=_ids(record.get("positive_ids"), origin, "positive_ids"),
        positive_id=positive_id[0] if positive_id else "",
        negative_ids=negative_ids,
    )


def _ids(value: Any, origin: str, key: str) -> tuple[str, ...]:
    """Document ids (written by ``densefit mine``): a list of ids, one id, or nothing."""
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    ids = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            item = str(item)
        ids.append(check_text(item, origin, key, also="id (or a list of ids)"))
    return tuple(ids)


def _examples(rows: Rows, where: str, bad: BadRows) -> list[TrainingExample]:
    examples = []
    checked = False
    for origin, record in rows:
        if isinstance(record, BadRowError):
            bad(record)
            continue
        if not checked:
            check_columns(record, where, {"query": QUERY_KEYS, "positive": POSITIVE_KEYS})
            checked = True
        try:
            examples.append(example_from_record(record, origin))
        except BadRowError as error:
            bad(error)
    return examples


def _check_score(value: Any, origin: str, key: str) -> float:
    score = _to_float(value)
    if score is None:
        raise BadRowError(origin, key, f"expected a number, got {show_value(value)}", SKIP_HINT)
    if not math.isfinite(score):
        raise BadRowError(origin, key, f"expected a finite number, got {score}", SKIP_HINT)
    return score


def _to_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        return None
    try:
        return float(value)
    except (ValueError, OverflowError):  # "abc", or an int too large for a float
        return None


def _not_a_mapping(origin: str, value: Any) -> BadRowError:
    return BadRowError(origin, None, f"expected a dict, got {type_name(value)}", SKIP_HINT)


def load_training_examples(
    training_data: str | os.PathLike | Iterable[Mapping | TrainingExample],
    *,
    on_bad_row: OnBadRow = "error",
    split: str = "train",
) -> list[TrainingExample]:
    """Training rows from a file or folder path, Haystack-style dicts, or TrainingExamples.

    The one entry point of the CLI, the pipeline and :meth:`Retriever.train
    <densefit.api.Retriever.train>`. Skipped bad rows are listed in a
    ``UserWarning`` (nothing is dropped silently).

    >>> rows = load_training_examples([{"question": "q", "pos_doc": "d"}])
    >>> rows[0].query, rows[0].positive
    ('q', 'd')
    """
    if isinstance(training_data, (str, os.PathLike)):
        examples, report = read_training_data(training_data, on_bad_row=on_bad_row, split=split)
    else:
        records = list(training_data)
        if records and all(isinstance(r, TrainingExample) for r in records):
            return records
        examples, report = examples_from_records(records, on_bad_row=on_bad_row)
    if report.n_skipped:
        warnings.warn(report.summary(), UserWarning, stacklevel=2)
    return examples
