"""Metadata filters in Haystack's syntax, compiled to SQL over the store's document table.

A filter is a comparison or a logical combination of filters::

    {"field": "meta.lang", "operator": "==", "value": "en"}
    {"operator": "AND", "conditions": [
        {"field": "meta.year", "operator": ">=", "value": 2020},
        {"operator": "NOT", "conditions": [{"field": "id", "operator": "in", "value": ["d1"]}]},
    ]}

Fields are ``meta.NAME`` (nested: ``meta.a.b``) or the top-level ``id``, ``content`` (the
text; ``text`` is accepted too) and ``title``. Operators: ``== != > >= < <= in not in`` and
``AND OR NOT`` (``NOT`` negates the AND of its conditions). The semantics are Haystack's
(``haystack.utils.filters.document_matches_filter``, the reference of its document-store
test suite):

- a missing field is ``None``: ``== None`` matches it, ``!= x`` matches it;
- ``> >= < <=`` with ``None`` match nothing; with a number they compare numbers (bools
  count as 1 and 0, as in Python; a string in the document does not match); with a string the string must be an ISO 8601
  date and documents match whose value is an ISO date string on the right side of it
  (timezones are honoured; a naive date is read as UTC); a list value is an error;
- ``in`` / ``not in`` need a list (a tuple or another iterable is an error);
- ``==`` between numbers ignores int/float (``2 == 2.0``), and ``1 == True`` as in Python;
  strings never equal numbers. Strings are equal when they are the same string (Haystack
  also equates two spellings of one instant, ``...T10:00:00`` and ``...T10:00:00+00:00``).

:func:`compile_filters` turns a filter into a SQL ``WHERE`` clause with bound parameters:
values are never put into SQL text. Field names are part of the SQL (a JSON path), which
lets SQLite use an expression index on ``json_extract(meta, '$."lang"')``
(:func:`meta_index_sql`); they are therefore restricted to letters, digits, ``_``, ``-`` and
spaces and checked before they are used.

>>> compile_filters({"field": "meta.lang", "operator": "==", "value": "en"})
('json_extract(meta, \\'$."lang"\\') = ?', ['en'])
>>> validate_filters({"field": "meta.year", "operator": ">", "value": "last year"})
Traceback (most recent call last):
...
ValueError: filter value 'last year' for meta.year > is a string that is not an ISO 8601 date: '>', '>=', '<', '<=' compare numbers or ISO dates
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from typing import Any

__all__ = [
    "parse_filter_text",
    "COMPARISON_OPERATORS",
    "LOGICAL_OPERATORS",
    "compile_filters",
    "meta_field_sql",
    "meta_index_sql",
    "normalise_filters",
    "validate_filters",
]

COMPARISON_OPERATORS = ("==", "!=", ">", ">=", "<", "<=", "in", "not in")
LOGICAL_OPERATORS = ("AND", "OR", "NOT")
# Top-level fields and the document-table column holding each.
COLUMNS = {"id": "id", "content": "text", "text": "text", "title": "title"}
_NAME = re.compile(r"^[\w\- ]+$")
_ORDERING = {">": ">", ">=": ">=", "<": "<", "<=": "<="}
_MAX_DEPTH = 32


def normalise_filters(filters: dict | None) -> dict | None:
    """``filters`` checked (:func:`validate_filters`), or None when there is nothing to filter.

    ``None`` and ``{}`` mean no filter.

    >>> normalise_filters({}) is None
    True
    """
    if filters is None or (isinstance(filters, dict) and not filters):
        return None
    validate_filters(filters)
    return filters


def validate_filters(filters: dict | None) -> None:
    """Raise ValueError (one line saying what is wrong and where) unless ``filters`` is a
    well-formed filter (see the module docstring); ``None`` and ``{}`` are fine.

    >>> validate_filters({"field": "meta.n", "operator": "in", "value": 3})
    Traceback (most recent call last):
    ...
    ValueError: filter meta.n in needs a list value, got int 3
    """
    if filters is None or (isinstance(filters, dict) and not filters):
        return
    compile_filters(filters)


def parse_filter_text(text: str | None) -> dict | None:
    """A filter given as text (``--filter``): JSON, or ``@PATH`` of a JSON file; checked
    (:func:`validate_filters`), or a ``ValueError`` saying what to write.

    >>> parse_filter_text('{"field": "meta.lang", "operator": "==", "value": "en"}')
    {'field': 'meta.lang', 'operator': '==', 'value': 'en'}
    """
    if text is None:
        return None
    source = "--filter"
    if text.startswith("@"):
        source = text[1:]
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    try:
        filters = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{source} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): "
            'pass e.g. \'{"field": "meta.lang", "operator": "==", "value": "en"}\''
        ) from None
    validate_filters(filters)
    return filters


def compile_filters(filters: dict) -> tuple[str, list]:
    """``(sql, params)``: a ``WHERE`` clause over the ``documents`` table and its parameters.

    Raises ValueError for a malformed filter. The clause is true exactly for the documents
    the filter matches (SQL's NULLs are folded so that ``NOT`` negates as in Python).
    """
    if not isinstance(filters, dict):
        raise ValueError(
            f"filters must be a dict like {{'field': 'meta.lang', 'operator': '==', "
            f"'value': 'en'}}, got {type(filters).__name__}"
        )
    params: list = []
    sql = _compile(filters, params, depth=0)
    return sql, params


def meta_index_sql(field: str) -> tuple[str, str]:
    """``(index name, CREATE INDEX statement)`` for an expression index on a ``meta.`` field.

    >>> meta_index_sql("meta.lang")[1]
    'CREATE INDEX IF NOT EXISTS "filter_meta.lang" ON documents(json_extract(meta, \\'$."lang"\\'))'
    """
    value_sql, _ = _field_sql(field)
    if not field.startswith("meta."):
        raise ValueError(f"only meta.* fields need an index ({field} is a column), got {field!r}")
    name = f"filter_{field}"
    return name, f'CREATE INDEX IF NOT EXISTS "{name}" ON documents({value_sql})'


def meta_field_sql(field: str) -> tuple[str, str]:
    """``(value SQL, JSON type SQL)`` of the metadata field ``field`` (``"meta.lang"``,
    nested ``"meta.a.b"``), its name checked as filters check theirs; ValueError otherwise.

    >>> meta_field_sql("meta.lang")
    ('json_extract(meta, \\'$."lang"\\')', 'json_type(meta, \\'$."lang"\\')')
    """
    if not isinstance(field, str) or not field.startswith("meta."):
        raise ValueError(f"metadata fields are named meta.NAME, got {field!r}")
    return _field_sql(field)


# -- compilation ---------------------------------------------------------------------------


def _compile(node: Any, params: list, depth: int) -> str:
    if depth > _MAX_DEPTH:
        raise ValueError(f"filters nest deeper than {_MAX_DEPTH} levels")
    if not isinstance(node, dict):
        raise ValueError(f"a filter condition must be a dict, got {type(node).__name__} {node!r}")
    if "field" in node:
        return _comparison(node, params)
    if "operator" not in node:
        raise ValueError(
            f"filter {_short(node)} has neither 'field' nor 'operator': a comparison needs "
            "field/operator/value, a logical filter operator (AND, OR, NOT) and conditions"
        )
    operator = node["operator"]
    if operator not in LOGICAL_OPERATORS:
        raise ValueError(
            f"unknown logical operator {operator!r} in {_short(node)}: use AND, OR or NOT "
            "(a comparison needs a 'field')"
        )
    if "conditions" not in node:
        raise ValueError(f"logical filter {_short(node)} has no 'conditions' list")
    conditions = node["conditions"]
    if not isinstance(conditions, list):
        raise ValueError(
            f"'conditions' of {operator} must be a list, got {type(conditions).__name__}"
        )
    parts = [_compile(c, params, depth + 1) for c in conditions]
    if operator == "OR":
        return "(" + " OR ".join(parts) + ")" if parts else "0"
    conjunction = "(" + " AND ".join(parts) + ")" if parts else "1"
    return _negate(conjunction) if operator == "NOT" else conjunction


def _negate(sql: str) -> str:
    """NOT of a clause whose NULLs mean false (a monotone AND/OR of comparisons)."""
    return f"NOT COALESCE({sql}, 0)"


def _comparison(node: dict, params: list) -> str:
    field = node["field"]
    for key in ("operator", "value"):
        if key not in node:
            raise ValueError(f"filter on {field!r} has no {key!r} key: {_short(node)}")
    operator, value = node["operator"], node["value"]
    if operator not in COMPARISON_OPERATORS:
        raise ValueError(
            f"unknown operator {operator!r} for {field}: use one of "
            f"{', '.join(COMPARISON_OPERATORS)}"
        )
    value_sql, type_sql = _field_sql(field)
    where = f"{field} {operator}"
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"filter {where} compares with {item}: use a finite number")
    if operator in ("==", "!="):
        sql = _scalar_equal(value_sql, type_sql, value, params)
        return _negate(sql) if operator == "!=" else sql
    if operator in ("in", "not in"):
        if not isinstance(value, list):
            raise ValueError(
                f"filter {where} needs a list value, got {type(value).__name__} {value!r}"
            )
        sql = _member(value_sql, type_sql, value, params)
        return _negate(sql) if operator == "not in" else sql
    return _ordering(value_sql, type_sql, operator, value, params, where)


def _field_sql(field: Any) -> tuple[str, str]:
    """SQL for the field's value and for its JSON type (``'text'`` for columns)."""
    if not isinstance(field, str):
        raise ValueError(f"filter field must be a string, got {type(field).__name__} {field!r}")
    if field in COLUMNS:
        return COLUMNS[field], "'text'"
    if not field.startswith("meta.") or field == "meta.":
        raise ValueError(
            f"unknown filter field {field!r}: use meta.NAME for metadata, or id, content, title"
        )
    names = field[len("meta.") :].split(".")
    for name in names:
        if not _NAME.match(name):
            raise ValueError(
                f"filter field {field!r}: metadata names in filters may contain letters, "
                "digits, '_', '-' and spaces"
            )
    path = "$" + "".join(f'."{name}"' for name in names)
    return f"json_extract(meta, '{path}')", f"json_type(meta, '{path}')"


# In every comparison the value test comes before the type test: it fails for most rows, and
# each JSON function parses the document's metadata again (SQLite < 3.45 caches no parse).


def _scalar_equal(value_sql: str, type_sql: str, value: Any, params: list) -> str:
    if value is None:
        return f"{value_sql} IS NULL"
    if isinstance(value, (list, dict)):
        # ASCII escapes, as the store writes metadata (json.dumps' default): SQLite compares
        # a list or dict as JSON text, and keeps a string's escapes in it ("Stra\u00dfe")
        params.append(json.dumps(value))
        return f"({value_sql} = json(?) AND {type_sql} IN ('array', 'object'))"
    if isinstance(value, (bool, int, float)):
        if type_sql == "'text'":
            return "0"  # a column holds text, which never equals a number
        params.append(value)
        return f"({value_sql} = ? AND {type_sql} IN ('integer', 'real', 'true', 'false'))"
    if isinstance(value, str):
        params.append(value)
        return f"{value_sql} = ?"
    raise ValueError(
        f"filter value {value!r} has type {type(value).__name__}: filters compare None, "
        "bools, numbers, strings (ISO dates for ordering) and lists"
    )


def _member(value_sql: str, type_sql: str, values: list, params: list) -> str:
    """``value IN values``: strings and numbers each as one bound JSON array (no limit on
    the list's length), ``None`` as ``IS NULL``, lists and dicts one by one."""
    strings = [v for v in values if isinstance(v, str)]
    numbers = [v for v in values if isinstance(v, (bool, int, float))]
    others = [v for v in values if not isinstance(v, (str, bool, int, float))]
    parts = []
    if strings:
        params.append(json.dumps(strings, ensure_ascii=False))
        parts.append(f"{value_sql} IN (SELECT value FROM json_each(?))")
    if numbers and type_sql != "'text'":
        params.append(json.dumps(numbers))
        parts.append(
            f"({value_sql} IN (SELECT value FROM json_each(?)) AND "
            f"{type_sql} IN ('integer', 'real', 'true', 'false'))"
        )
    parts += [_scalar_equal(value_sql, type_sql, v, params) for v in others]
    return "(" + " OR ".join(parts) + ")" if parts else "0"


def _ordering(
    value_sql: str, type_sql: str, operator: str, value: Any, params: list, where: str
) -> str:
    if value is None:
        return "0"  # Haystack: None is not ordered
    if isinstance(value, (list, dict, tuple)):
        raise ValueError(
            f"filter {where} got a {type(value).__name__} value {value!r}: '>', '>=', '<', "
            "'<=' compare numbers or ISO dates"
        )
    if isinstance(value, str):
        params.append(_utc_iso(value, where))
        op = _ORDERING[operator]
        return f"(julianday({value_sql}) {op} julianday(?) AND {type_sql} = 'text')"
    if isinstance(value, (bool, int, float)):
        if type_sql == "'text'":
            return "0"
        params.append(value)
        numbers = "'integer', 'real', 'true', 'false'"  # bools are 1 and 0, as in Python
        return f"({value_sql} {_ORDERING[operator]} ? AND {type_sql} IN ({numbers}))"
    raise ValueError(
        f"filter {where} got a {type(value).__name__} value: compare numbers or ISO dates"
    )


def _utc_iso(value: str, where: str) -> str:
    """``value`` as the UTC ``YYYY-MM-DDTHH:MM:SS.SSS`` SQLite's ``julianday()`` reads (so
    both sides of a comparison are converted by SQLite alike; naive dates are UTC)."""
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"filter value {value!r} for {where} is a string that is not an ISO 8601 date: "
            "'>', '>=', '<', '<=' compare numbers or ISO dates"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).replace(tzinfo=None).isoformat(timespec="milliseconds")


def _short(node: Any, width: int = 120) -> str:
    text = json.dumps(node, default=repr, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 3] + "..."
