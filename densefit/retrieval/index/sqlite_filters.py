"""The embedded store's filters: a parsed filter (:mod:`~densefit.retrieval.index.filters`)
emitted as SQL over its ``documents`` table, and SQLite's limits on a filter's size.

:func:`compile_filters` gives a ``WHERE`` clause with bound parameters: values are never put
into SQL text. Field names are part of the SQL (a JSON path), which lets SQLite use an
expression index on ``json_extract(meta, '$."lang"')`` (:func:`meta_index_sql`); the parse
restricted them to letters, digits, ``_``, ``-`` and spaces.

>>> compile_filters({"field": "meta.lang", "operator": "==", "value": "en"})
('json_extract(meta, \\'$."lang"\\') = ?', ['en'])
"""

from __future__ import annotations

import json
from typing import Any

from densefit.retrieval.index.filters import (
    DATE_GLOB,
    Comparison,
    Filter,
    emit,
    meta_path,
    parse_filters,
    utc_iso,
)

__all__ = [
    "MAX_CONDITIONS",
    "MAX_DEPTH",
    "compile_filters",
    "meta_field_sql",
    "meta_index_sql",
]

# What SQLite 3.40 compiles, measured with the filters that cost it most (tests/test_faults.py
# holds them; bench/faults.py measures them): its parser stack (100 entries) overflows at 22
# nested logical operators, its expression tree (1,000 levels deep) at about 990 conditions.
# The embedded store declares them in its Capabilities (filter_max_depth, _conditions).
MAX_DEPTH = 20  # logical operators (AND, OR, NOT) nested in one another
MAX_CONDITIONS = 900  # comparisons, logical operators, and lists, objects and None in `in`
_NUMBERS = "'integer', 'real', 'true', 'false'"  # json_type of numbers; bools are 1 and 0


def compile_filters(filters: Filter | dict) -> tuple[str, list]:
    """``(sql, params)``: a ``WHERE`` clause over the ``documents`` table that is true
    exactly for the documents ``filters`` (parsed; a dict is parsed first) match, and its
    parameters. SQL's NULLs are folded so that a negation is true where a comparison is
    unknown (a missing field), as in Python."""
    parsed = parse_filters(filters)
    if parsed is None:
        return "1", []
    sql = _Sql()
    return emit(parsed, sql), sql.params


def meta_field_sql(field: str) -> tuple[str, str]:
    """``(value SQL, JSON type SQL)`` of the metadata field ``field`` (``"meta.lang"``,
    nested ``"meta.a.b"``), its name checked as filters check theirs; ValueError otherwise.

    >>> meta_field_sql("meta.lang")
    ('json_extract(meta, \\'$."lang"\\')', 'json_type(meta, \\'$."lang"\\')')
    """
    return _sql_of(None, meta_path(field))


def meta_index_sql(field: str) -> tuple[str, str]:
    """``(index name, CREATE INDEX statement)`` for an expression index on a ``meta.`` field.

    >>> meta_index_sql("meta.lang")[1]
    'CREATE INDEX IF NOT EXISTS "filter_meta.lang" ON documents(json_extract(meta, \\'$."lang"\\'))'
    """
    if field in ("id", "content", "text", "title"):
        raise ValueError(f"only meta.* fields need an index ({field} is a column), got {field!r}")
    value_sql, _ = meta_field_sql(field)
    name = f"filter_{field}"
    return name, f'CREATE INDEX IF NOT EXISTS "{name}" ON documents({value_sql})'


def _sql_of(column: str | None, path: tuple[str, ...]) -> tuple[str, str]:
    """SQL for a field's value and for its JSON type (``'text'`` for columns)."""
    if column is not None:
        return column, "'text'"
    json_path = "$" + "".join(f'."{name}"' for name in path)
    return f"json_extract(meta, '{json_path}')", f"json_type(meta, '{json_path}')"


class _Sql:
    """The emitter (:class:`~densefit.retrieval.index.filters.Emitter`): SQL text, its
    parameters collected in ``params``. In every comparison the value test comes before the
    type test: it fails for most rows, and each JSON function parses the document's metadata
    again (SQLite < 3.45 caches no parse)."""

    def __init__(self) -> None:
        self.params: list = []

    def compare(self, c: Comparison) -> str:
        value_sql, type_sql = _sql_of(c.column, c.path)
        if c.operator == "==":
            return self._equal(value_sql, type_sql, c.value)
        if c.operator == "in":
            return self._member(value_sql, type_sql, c.value)
        return self._ordering(value_sql, type_sql, c)

    def negate(self, term: str) -> str:
        return f"NOT COALESCE({term}, 0)"  # a comparison's NULL (a missing field) is false

    def all_of(self, terms: list[str]) -> str:
        return "(" + " AND ".join(terms) + ")" if terms else "1"

    def any_of(self, terms: list[str]) -> str:
        return "(" + " OR ".join(terms) + ")" if terms else "0"

    def _equal(self, value_sql: str, type_sql: str, value: Any) -> str:
        if value is None:
            return f"{value_sql} IS NULL"
        if isinstance(value, (list, dict)):
            # ASCII escapes, as the store writes metadata (json.dumps' default): SQLite
            # compares a list or dict as JSON text, and keeps a string's escapes ("Stra\u00dfe")
            self.params.append(json.dumps(value))
            return f"({value_sql} = json(?) AND {type_sql} IN ('array', 'object'))"
        if isinstance(value, (bool, int, float)):
            if type_sql == "'text'":
                return "0"  # a column holds text, which never equals a number
            self.params.append(value)
            return f"({value_sql} = ? AND {type_sql} IN ({_NUMBERS}))"
        self.params.append(value)  # a string (the parse let nothing else through)
        return f"{value_sql} = ?"

    def _member(self, value_sql: str, type_sql: str, values: list) -> str:
        """``value IN values``: strings and numbers each as one bound JSON array (no limit
        on the list's length), ``None`` as ``IS NULL``, lists and dicts one by one."""
        strings = [v for v in values if isinstance(v, str)]
        numbers = [v for v in values if isinstance(v, (bool, int, float))]
        others = [v for v in values if not isinstance(v, (str, bool, int, float))]
        parts = []
        if strings:
            self.params.append(json.dumps(strings, ensure_ascii=False))
            parts.append(f"{value_sql} IN (SELECT value FROM json_each(?))")
        if numbers and type_sql != "'text'":
            self.params.append(json.dumps(numbers))
            parts.append(
                f"({value_sql} IN (SELECT value FROM json_each(?)) AND {type_sql} IN ({_NUMBERS}))"
            )
        parts += [self._equal(value_sql, type_sql, v) for v in others]
        return "(" + " OR ".join(parts) + ")" if parts else "0"

    def _ordering(self, value_sql: str, type_sql: str, c: Comparison) -> str:
        if c.value is None:
            return "0"  # Haystack: None is not ordered
        if isinstance(c.value, str):  # an ISO date, both sides read by julianday()
            self.params.append(utc_iso(c.value, f"{c.field} {c.operator}"))
            return (
                f"(julianday({value_sql}) {c.operator} julianday(?) AND {type_sql} = 'text' "
                f"AND {value_sql} GLOB '{DATE_GLOB}')"
            )
        if type_sql == "'text'":
            return "0"
        self.params.append(c.value)  # a number (the parse let nothing else through)
        return f"({value_sql} {c.operator} ? AND {type_sql} IN ({_NUMBERS}))"
