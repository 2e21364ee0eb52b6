"""One training row from one record: the column names densefit reads and the checks of each field.

Every source of training rows turns its records (a JSON object, a CSV row, a Parquet or Arrow
row, a Python dict) into :class:`~densefit.data.types.TrainingExample` here, so a file, a list
of dicts and a Hugging Face dataset accept the same columns and reject a bad row with the same
``source:row`` message (:func:`example_from_record`, :func:`examples_of`).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import Any

from densefit.data.rows import (
    SKIP_HINT,
    BadRows,
    Rows,
    check_columns,
    check_text,
    first_present,
    require_text,
    show_value,
)
from densefit.data.types import BadRowError, TrainingExample

__all__ = [
    "COLUMNS",
    "NEGATIVE_KEYS",
    "POSITIVE_KEYS",
    "QUERY_KEYS",
    "SCORE_KEYS",
    "check_training_columns",
    "example_from_record",
    "examples_of",
    "is_training_column",
]

QUERY_KEYS = ("anchor", "query", "question")
POSITIVE_KEYS = ("positive", "pos_doc")
NEGATIVE_KEYS = ("negative", "neg_doc")  # each a text or a list of texts
SCORE_KEYS = ("score", "label")
ID_KEYS = ("positive_ids", "positive_id", "negative_ids")
# Every column densefit reads (besides negative_1, negative_2, ...); other columns are ignored.
COLUMNS = (*QUERY_KEYS, *POSITIVE_KEYS, *NEGATIVE_KEYS, *SCORE_KEYS, *ID_KEYS)
_NUMBERED_NEGATIVE = re.compile(r"negative_(\d{1,9})")


def is_training_column(name: str) -> bool:
    """A column :func:`example_from_record` reads (the rest are ignored).

    >>> [is_training_column(c) for c in ("anchor", "negative_3", "source")]
    [True, True, False]
    """
    return name in COLUMNS or bool(_NUMBERED_NEGATIVE.fullmatch(name))


def check_training_columns(columns: Iterable[str], where: str) -> None:
    """ValueError naming the expected columns when none of the query or positive ones is
    there (likely the wrong file or dataset)."""
    check_columns(dict.fromkeys(columns), where, {"query": QUERY_KEYS, "positive": POSITIVE_KEYS})


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


def examples_of(rows: Rows, where: str, bad: BadRows) -> list[TrainingExample]:
    """The examples of ``(origin, record or BadRowError)`` rows; bad rows go to ``bad``.

    The first good record's columns are checked (:func:`check_training_columns`).
    """
    examples = []
    checked = False
    for origin, record in rows:
        if isinstance(record, BadRowError):
            bad(record)
            continue
        if not checked:
            check_training_columns(record, where)
            checked = True
        try:
            examples.append(example_from_record(record, origin))
        except BadRowError as error:
            bad(error)
    return examples


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
