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
  date and documents match whose value is a date string on the right side of it (one that
  starts as YYYY-MM-DD and SQLite's ``julianday()`` reads; timezones are honoured; a naive
  date is read as UTC); a list value is an error;
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
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from typing import Any

__all__ = [
    "COMPARISON_OPERATORS",
    "INT_RANGE",
    "LOGICAL_OPERATORS",
    "MAX_CONDITIONS",
    "MAX_DEPTH",
    "Comparison",
    "Logical",
    "compile_filters",
    "date_seconds",
    "meta_field_sql",
    "meta_index_sql",
    "normalise_filters",
    "parse_filter_text",
    "parse_filters",
    "typed_fields",
    "validate_filters",
]

COMPARISON_OPERATORS = ("==", "!=", ">", ">=", "<", "<=", "in", "not in")
LOGICAL_OPERATORS = ("AND", "OR", "NOT")
# Top-level fields and the document-table column holding each.
COLUMNS = {"id": "id", "content": "text", "text": "text", "title": "title"}
_NAME = re.compile(r"^[\w\- ]+$")
_ORDERING = {">": ">", ">=": ">=", "<": "<", "<=": "<="}
# What SQLite 3.40 compiles, measured with the filters that cost it most (tests/test_faults.py
# holds them; they run on every engine): its parser stack (100 entries) overflows at 22
# nested logical operators, its expression tree (1,000 levels deep) at about 990 conditions.
MAX_DEPTH = 20  # logical operators (AND, OR, NOT) nested in one another
MAX_CONDITIONS = 900  # comparisons, logical operators, and lists, objects and None in `in`
INT_RANGE = (-(2**63), 2**63 - 1)  # SQLite's integers; a larger number can be a float


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

    Raises ValueError for a malformed filter (:func:`parse_filters`). The clause is true
    exactly for the documents the filter matches (SQL's NULLs are folded so that ``NOT``
    negates as in Python).
    """
    if isinstance(filters, dict) and not filters:
        raise ValueError(
            "filter {} has neither 'field' nor 'operator': a comparison needs "
            "field/operator/value, a logical filter operator (AND, OR, NOT) and conditions"
        )
    params: list = []
    sql = _sql(parse_filters(filters), params)
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


# -- parsing: one checked tree every engine compiles -----------------------------------------


@dataclass(frozen=True)
class Comparison:
    """One checked comparison: ``field`` as the filter names it (``text`` read as
    ``content``), the document-table ``column`` of a top-level field (None for ``meta.*``),
    the metadata ``path`` (``("a", "b")`` for ``meta.a.b``; empty for a column)."""

    field: str
    operator: str
    value: Any
    column: str | None = None
    path: tuple[str, ...] = ()


@dataclass(frozen=True)
class Logical:
    """``AND``, ``OR`` or ``NOT`` (the negated AND) of checked ``conditions``."""

    operator: str
    conditions: tuple


def parse_filters(filters: dict | None) -> Comparison | Logical | None:
    """``filters`` checked and parsed into the tree the engines compile (SQL for the
    embedded store and PostgreSQL, a payload filter for Qdrant): the one place a filter is
    validated. None for no filter (``None`` or ``{}``); ValueError (one line: what is wrong
    and where) for a malformed one.

    >>> parse_filters({"field": "meta.a.b", "operator": "in", "value": [1, 2]})
    Comparison(field='meta.a.b', operator='in', value=[1, 2], column=None, path=('a', 'b'))
    """
    if filters is None or (isinstance(filters, dict) and not filters):
        return None
    if not isinstance(filters, dict):
        raise ValueError(
            f"filters must be a dict like {{'field': 'meta.lang', 'operator': '==', "
            f"'value': 'en'}}, got {type(filters).__name__}"
        )
    return _parse(filters, depth=0, counted=[0])


def _parse(node: Any, depth: int, counted: list[int]) -> Comparison | Logical:
    """``node`` checked and parsed; ``counted[0]`` counts the conditions met so far."""
    if depth > MAX_DEPTH:
        raise ValueError(
            f"filters nest deeper than {MAX_DEPTH} levels: flatten the AND, OR and NOT "
            "operators (an AND inside an AND is one AND)"
        )
    if not isinstance(node, dict):
        raise ValueError(f"a filter condition must be a dict, got {type(node).__name__} {node!r}")
    parsed = _parse_comparison(node) if "field" in node else None
    counted[0] += 1 if parsed is None else _conditions(parsed)
    if counted[0] > MAX_CONDITIONS:
        raise ValueError(
            f"the filter holds more than {MAX_CONDITIONS} conditions: match many values "
            "with one 'in' list of strings or numbers"
        )
    if parsed is not None:
        return parsed
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
    return Logical(operator, tuple(_parse(c, depth + 1, counted) for c in conditions))


def _conditions(node: Comparison) -> int:
    """The terms a comparison compiles to: one, and one more for each None, list or object
    in an ``in`` list (strings and numbers are matched as one term)."""
    if node.operator not in ("in", "not in"):
        return 1
    return 1 + sum(not isinstance(v, (str, bool, int, float)) for v in node.value)


def _parse_comparison(node: dict) -> Comparison:
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
    column, path = _field_parts(field)
    where = f"{field} {operator}"
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"filter {where} compares with {item}: use a finite number")
        if isinstance(item, int) and not INT_RANGE[0] <= item <= INT_RANGE[1]:
            raise ValueError(
                f"filter {where} compares with an integer outside the 64-bit range (-2**63 "
                "to 2**63-1): write it as a float (9.3e18, not 9300000000000000000)"
            )
    if operator in ("==", "!="):
        _check_equal_value(value)
    elif operator in ("in", "not in"):
        if not isinstance(value, list):
            raise ValueError(
                f"filter {where} needs a list value, got {type(value).__name__} {value!r}"
            )
        for item in value:
            _check_equal_value(item)
    else:
        _check_ordering_value(value, where)
    field = "content" if field == "text" else field
    return Comparison(field, operator, value, column, path)


def _field_parts(field: Any) -> tuple[str | None, tuple[str, ...]]:
    """``(column, meta path)`` of a filter field, its name checked."""
    if not isinstance(field, str):
        raise ValueError(f"filter field must be a string, got {type(field).__name__} {field!r}")
    if field in COLUMNS:
        return COLUMNS[field], ()
    if not field.startswith("meta.") or field == "meta.":
        raise ValueError(
            f"unknown filter field {field!r}: use meta.NAME for metadata, or id, content, title"
        )
    names = tuple(field[len("meta.") :].split("."))
    for name in names:
        if not _NAME.match(name):
            raise ValueError(
                f"filter field {field!r}: metadata names in filters may contain letters, "
                "digits, '_', '-' and spaces"
            )
    return None, names


def _check_equal_value(value: Any) -> None:
    if value is None or isinstance(value, (list, dict, bool, int, float, str)):
        return
    raise ValueError(
        f"filter value {value!r} has type {type(value).__name__}: filters compare None, "
        "bools, numbers, strings (ISO dates for ordering) and lists"
    )


def _check_ordering_value(value: Any, where: str) -> None:
    if value is None:
        return
    if isinstance(value, (list, dict, tuple)):
        raise ValueError(
            f"filter {where} got a {type(value).__name__} value {value!r}: '>', '>=', '<', "
            "'<=' compare numbers or ISO dates"
        )
    if isinstance(value, str):
        _utc_iso(value, where)
    elif not isinstance(value, (bool, int, float)):
        raise ValueError(
            f"filter {where} got a {type(value).__name__} value: compare numbers or ISO dates"
        )


# -- SQLite: the embedded store --------------------------------------------------------------


def _sql(node: Comparison | Logical, params: list, negated: bool = False) -> str:
    """The clause of ``node`` (of its negation when ``negated``), with NOTs pushed down to
    the comparisons: a negated AND is the OR of the negated conditions and the reverse, so
    that a chain of NOTs adds no nesting. A comparison's NULL means false (the negation of a
    comparison folds it: :func:`_negate`), so these laws hold as in Python."""
    if isinstance(node, Logical):
        operator = node.operator
        if operator == "NOT":  # NOT is the negated AND
            operator, negated = "AND", not negated
        if negated:
            operator = "OR" if operator == "AND" else "AND"
        parts = [_sql(c, params, negated) for c in node.conditions]
        if not parts:
            return "1" if operator == "AND" else "0"
        return parts[0] if len(parts) == 1 else "(" + f" {operator} ".join(parts) + ")"
    value_sql, type_sql = _sql_of(node.column, node.path)
    operator, value = node.operator, node.value
    if operator in ("==", "!="):
        sql = _scalar_equal(value_sql, type_sql, value, params)
        return _negate(sql) if (operator == "!=") != negated else sql
    if operator in ("in", "not in"):
        sql = _member(value_sql, type_sql, value, params)
        return _negate(sql) if (operator == "not in") != negated else sql
    sql = _ordering(value_sql, type_sql, operator, value, params, f"{node.field} {operator}")
    return _negate(sql) if negated else sql


def _negate(sql: str) -> str:
    """NOT of a clause whose NULLs mean false (a monotone AND/OR of comparisons)."""
    return f"NOT COALESCE({sql}, 0)"


def _field_sql(field: Any) -> tuple[str, str]:
    """SQL for the field's value and for its JSON type (``'text'`` for columns)."""
    return _sql_of(*_field_parts(field))


def _sql_of(column: str | None, path: tuple[str, ...]) -> tuple[str, str]:
    if column is not None:
        return column, "'text'"
    json_path = "$" + "".join(f'."{name}"' for name in path)
    return f"json_extract(meta, '{json_path}')", f"json_type(meta, '{json_path}')"


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
    params.append(value)  # a string (parse_filters let nothing else through)
    return f"{value_sql} = ?"


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
    if isinstance(value, str):
        params.append(_utc_iso(value, where))
        op = _ORDERING[operator]
        return (
            f"(julianday({value_sql}) {op} julianday(?) AND {type_sql} = 'text' "
            f"AND {value_sql} GLOB '{_DATE_GLOB}')"
        )
    if type_sql == "'text'":
        return "0"
    params.append(value)  # a number (parse_filters let nothing else through)
    numbers = "'integer', 'real', 'true', 'false'"  # bools are 1 and 0, as in Python
    return f"({value_sql} {_ORDERING[operator]} ? AND {type_sql} IN ({numbers}))"


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


# -- typed fields: the same semantics on engines without SQLite's JSON functions ------------

# A stored string is a date when it starts as one (YYYY-MM-DD) and SQLite's julianday() reads
# it: the embedded store's SQL holds to this, and typed_fields' "d" is julianday()'s reading,
# so that every engine agrees (julianday() alone also reads bare numbers and 'now').
_DATE_GLOB = "[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*"  # fnmatchcase reads it as GLOB does
_UNIX_EPOCH_MS = 210_866_760_000_000  # the Julian day of 1970-01-01 (2440587.5) in ms
_JSON_TYPES = {
    bool: None,
    int: "integer",
    float: "real",
    str: "text",
    list: "array",
    dict: "object",
}


def typed_fields(doc_id: str, text: str, title: str, meta: dict) -> dict[str, dict[str, Any]]:
    """Every filterable field of a document with its value split by type, as an engine
    without SQLite's JSON functions stores it beside the document so that its filters
    (compiled from :func:`parse_filters`) keep the embedded store's semantics exactly:
    ``{field: {"t": JSON type, "n": number, "s": string, "d": date, "j": JSON text}}``.

    Fields are named as filters name them (``id``, ``content``, ``title``, ``meta.a.b``;
    nested objects give an entry for themselves and for each of their fields). ``t`` is
    SQLite's ``json_type`` name (a column is ``text``); ``n`` a number, bools as 1 and 0
    (``>``, ``==`` with numbers); ``s`` a string (``==``, ``in``); ``d`` the seconds since
    1970 (UTC) of a string that starts as a date (YYYY-MM-DD) and SQLite's ``julianday()``
    reads as one, as SQLite reads it (``>`` with an ISO date, naive dates UTC);
    ``j`` a list's or object's compact JSON (``==`` with a list or dict). A missing or null
    field has no entry: ``== None`` matches exactly the documents without one.

    >>> typed_fields("d1", "cells", "", {"year": 2020, "a": {"b": True}})["meta.a.b"]
    {'t': 'true', 'n': 1.0}
    >>> typed_fields("d1", "cells", "", {"when": "2024-01-02"})["meta.when"]
    {'t': 'text', 's': '2024-01-02', 'd': 1704153600.0}
    """
    fields = {
        name: _typed_text(value)
        for name, value in (("id", doc_id), ("content", text), ("title", title))
    }
    _add_typed(fields, "meta", meta)
    del fields["meta"]
    return fields


def _typed_text(value: str) -> dict[str, Any]:
    typed: dict[str, Any] = {"t": "text", "s": value}
    if fnmatchcase(value, _DATE_GLOB):
        seconds = _sqlite_date_seconds(value)
        if seconds is not None:  # else shaped like a date, not one (2024-13-45)
            typed["d"] = seconds
    return typed


def _sqlite_date_seconds(value: str) -> float | None:
    """The seconds since 1970 (UTC) of the moment SQLite's ``julianday()`` reads in
    ``value``, to the millisecond SQLite holds it to; None where it reads none."""
    with closing(sqlite3.connect(":memory:")) as conn:
        (days,) = conn.execute("SELECT julianday(?)", (value,)).fetchone()
    if days is None:
        return None
    return (round(days * 86_400_000) - _UNIX_EPOCH_MS) / 1000


def _add_typed(fields: dict, name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool):
        fields[name] = {"t": "true" if value else "false", "n": float(value)}
    elif isinstance(value, (int, float)):
        fields[name] = {"t": "integer" if isinstance(value, int) else "real", "n": float(value)}
    elif isinstance(value, str):
        fields[name] = _typed_text(value)
    elif isinstance(value, (list, dict)):
        kind = "array" if isinstance(value, list) else "object"
        fields[name] = {"t": kind, "j": json_text(value)}
        if isinstance(value, dict):
            for key, item in value.items():
                if _NAME.match(str(key)):  # other names cannot be filtered on
                    _add_typed(fields, f"{name}.{key}", item)


def json_text(value: Any) -> str:
    """The compact JSON text a list or dict is compared by (``==`` with a list or dict)."""
    return json.dumps(value, separators=(",", ":"))


def date_seconds(value: str, where: str = "filter") -> float:
    """The seconds since 1970 (UTC) of an ISO 8601 date string; a naive date is UTC.

    >>> date_seconds("1970-01-02T00:00:00+01:00")
    82800.0
    """
    return datetime.fromisoformat(_utc_iso(value, where)).replace(tzinfo=timezone.utc).timestamp()
