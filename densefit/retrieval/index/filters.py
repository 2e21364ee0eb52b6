"""Metadata filters in Haystack's syntax: the language, parsed once into a small checked
form that every engine turns into its own query.

A filter is a comparison or a logical combination of filters::

    {"field": "meta.lang", "operator": "==", "value": "en"}
    {"operator": "AND", "conditions": [
        {"field": "meta.year", "operator": ">=", "value": 2020},
        {"operator": "NOT", "conditions": [{"field": "id", "operator": "in", "value": ["d1"]}]},
    ]}

Fields are ``meta.NAME`` (nested: ``meta.a.b``; names of letters, digits, ``_``, ``-`` and
spaces) or the top-level ``id``, ``content`` (the text; ``text`` is accepted too) and
``title``. Operators: ``== != > >= < <= in not in`` and ``AND OR NOT`` (``NOT`` negates
the AND of its conditions). The semantics are Haystack's
(``haystack.utils.filters.document_matches_filter``, the reference of its document-store
test suite), on every engine:

- a missing field is ``None``: ``== None`` matches it, ``!= x`` matches it;
- ``> >= < <=`` with ``None`` match nothing; with a number they compare numbers (bools
  count as 1 and 0, as in Python; a string in the document does not match); with a string
  the string must be an ISO 8601 date and documents match whose value is a date string on
  the right side of it (one that starts as YYYY-MM-DD and SQLite's ``julianday()`` reads;
  timezones are honoured; a naive date is read as UTC); a list value is an error;
- ``in`` / ``not in`` need a list (a tuple or another iterable is an error);
- ``==`` between numbers ignores int/float (``2 == 2.0``), and ``1 == True`` as in Python;
  strings never equal numbers. Strings are equal when they are the same string (Haystack
  also equates two spellings of one instant, ``...T10:00:00`` and ``...T10:00:00+00:00``).

:func:`parse_filters` checks a filter and parses it into a :class:`Filter` (a tree of
:class:`Comparison` and :class:`Logical`): the one validation, which never compiles. The
parsed filter is what travels to an engine; each engine emits its own query from it with
:func:`emit` (the embedded store's SQL: :mod:`~densefit.retrieval.index.sqlite_filters`;
PostgreSQL's and Qdrant's beside their stores). An engine's limits on a filter's size are
in its :class:`~densefit.retrieval.index.types.Capabilities` (``filter_max_depth``,
``filter_max_conditions``), and the parse checks them for the engine it is given.

>>> parse_filters({"field": "meta.year", "operator": ">", "value": 2020}).root
Comparison(field='meta.year', operator='>', value=2020, column=None, path=('year',))
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
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from functools import cached_property
from typing import Any, Protocol, TypeVar

__all__ = [
    "COMPARISON_OPERATORS",
    "DATE_GLOB",
    "INT_RANGE",
    "LOGICAL_OPERATORS",
    "MAX_NESTING",
    "Comparison",
    "Emitter",
    "Filter",
    "Logical",
    "date_seconds",
    "emit",
    "folded",
    "json_text",
    "meta_path",
    "parse_filter_text",
    "parse_filters",
    "typed_fields",
    "utc_iso",
    "validate_filters",
]

COMPARISON_OPERATORS = ("==", "!=", ">", ">=", "<", "<=", "in", "not in")
LOGICAL_OPERATORS = ("AND", "OR", "NOT")
# Top-level fields and the embedded store's document-table column holding each.
COLUMNS = {"id": "id", "content": "text", "text": "text", "title": "title"}
_NAME = re.compile(r"^[\w\- ]+$")
# The language's own bound on nesting, whatever the engine: the parse and the emitters
# recurse once per level, well inside Python's 1,000 frames.
MAX_NESTING = 100
INT_RANGE = (-(2**63), 2**63 - 1)  # 64-bit integers; a larger number can be a float
_POSITIVE = {"!=": "==", "not in": "in"}  # what emit() hands an emitter, negated


# -- the parsed form ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """One checked comparison: ``field`` as the filter names it (``text`` read as
    ``content``), the embedded store's ``column`` of a top-level field (None for
    ``meta.*``), the metadata ``path`` (``("a", "b")`` for ``meta.a.b``; empty for a
    column). ``value`` is None, a bool, a 64-bit int, a finite float, a string (an ISO
    date for ``> >= < <=``: :func:`date_seconds`, :func:`utc_iso`) or, for ``== !=``, a
    list or dict; ``in`` / ``not in`` hold a list of those."""

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


@dataclass(frozen=True)
class Filter:
    """A checked filter: what a search, a count or a statistic takes to an engine.

    ``root``: the tree of :class:`Comparison` and :class:`Logical`; ``depth``: the most
    logical operators around one condition; ``conditions``: its size, as engines limit it
    (every comparison and logical operator, and each None, list or dict in an ``in`` list:
    strings and numbers in one list are matched as one term); ``source``: the filter as
    given.
    """

    root: Comparison | Logical
    depth: int
    conditions: int
    source: Any = field(default=None, compare=False, repr=False)

    @cached_property
    def key(self) -> str:
        """The filter as canonical JSON text: equal for equal filters (to group searches)."""
        return json.dumps(self.source, sort_keys=True, default=repr)

    @classmethod
    def all_of(cls, *filters: Filter) -> Filter:
        """The AND of parsed filters, without parsing them again."""
        root = Logical("AND", tuple(f.root for f in filters))
        source = {"operator": "AND", "conditions": [f.source for f in filters]}
        depth = 1 + max((f.depth for f in filters), default=0)
        return cls(root, depth, 1 + sum(f.conditions for f in filters), source)

    def within(self, capabilities) -> Filter:
        """This filter when it is within the limits of the engine of ``capabilities``
        (None: any engine); ValueError (one line naming the engine and its limit) otherwise."""
        _check_size(self.depth, self.conditions, capabilities)
        return self


def parse_filters(filters, capabilities=None) -> Filter | None:
    """``filters`` checked and parsed (:class:`Filter`): the one place a filter is
    validated, for the engine of ``capabilities`` (its limits on size; None: no engine's).
    None for no filter (``None`` or ``{}``); an already parsed :class:`Filter` comes back
    as it is, its size checked against ``capabilities``. ValueError (one line: what is
    wrong and where) for a malformed filter or one too large for the engine.

    >>> parse_filters({"field": "meta.a.b", "operator": "in", "value": [1, 2]}).root
    Comparison(field='meta.a.b', operator='in', value=[1, 2], column=None, path=('a', 'b'))
    """
    if isinstance(filters, Filter):
        return filters.within(capabilities)
    if filters is None or (isinstance(filters, dict) and not filters):
        return None
    if not isinstance(filters, dict):
        raise ValueError(
            f"filters must be a dict like {{'field': 'meta.lang', 'operator': '==', "
            f"'value': 'en'}}, got {type(filters).__name__}"
        )
    return _parse_tree(filters, capabilities)


def validate_filters(filters, capabilities=None) -> None:
    """Raise ValueError (one line saying what is wrong and where) unless ``filters`` is a
    well-formed filter (see the module docstring) within the limits of the engine of
    ``capabilities``; ``None`` and ``{}`` are fine. It parses (:func:`parse_filters`).

    >>> validate_filters({"field": "meta.n", "operator": "in", "value": 3})
    Traceback (most recent call last):
    ...
    ValueError: filter meta.n in needs a list value, got int 3
    """
    parse_filters(filters, capabilities)


def parse_filter_text(text: str | None, capabilities=None) -> Filter | None:
    """A filter given as text (``--filter``): JSON, or ``@PATH`` of a JSON file, parsed
    (:func:`parse_filters`), or a ``ValueError`` saying what to write.

    >>> parse_filter_text('{"field": "meta.lang", "operator": "==", "value": "en"}').source
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
    return parse_filters(filters, capabilities)


def meta_path(field: Any) -> tuple[str, ...]:
    """The path of the metadata field ``field`` (``"meta.a.b"`` -> ``("a", "b")``), its name
    checked as filters check theirs; ValueError otherwise.

    >>> meta_path("meta.a.b")
    ('a', 'b')
    """
    if not isinstance(field, str) or not field.startswith("meta."):
        raise ValueError(f"metadata fields are named meta.NAME, got {field!r}")
    return _field_parts(field)[1]


# -- emitting: what each engine writes -----------------------------------------------------------

T = TypeVar("T")


class Emitter(Protocol[T]):
    """How an engine spells a filter (:func:`emit` calls it): a comparison, the negation of
    one, and the AND and OR of terms. Nothing else reaches it: no NOT, ``!=`` or
    ``not in``."""

    def compare(self, comparison: Comparison) -> T:
        """``comparison``, whose operator is one of ``== in > >= < <=``: true exactly for
        the documents it matches (unknown, e.g. a missing field, must not count as true)."""

    def negate(self, term: T) -> T:
        """NOT of a :meth:`compare` term: true for every document it does not match."""

    def all_of(self, terms: list[T]) -> T:
        """AND of ``terms`` (at least two, or none: matches every document)."""

    def any_of(self, terms: list[T]) -> T:
        """OR of ``terms`` (at least two, or none: matches no document)."""


def folded(terms: list, absorbing: bool, join: Callable[[list], T]) -> T | bool:
    """The AND (``absorbing`` False) or the OR (True) of an emitter's ``terms``, where a term
    may be True or False (known to match every document or none): those folded away, and
    ``join`` making one term of two or more others.

    >>> folded([True, "a > 1", "b"], False, " and ".join), folded([], True, " or ".join)
    ('a > 1 and b', False)
    """
    if any(term is absorbing for term in terms):
        return absorbing
    terms = [term for term in terms if not isinstance(term, bool)]
    if not terms:
        return not absorbing
    return terms[0] if len(terms) == 1 else join(terms)


def emit(parsed: Filter, emitter: Emitter[T]) -> T:
    """``parsed`` spelled by ``emitter``, walked once: NOTs pushed down to the comparisons
    (a negated AND is the OR of the negated conditions, and the reverse), ``!=`` and
    ``not in`` given as the negations of ``==`` and ``in``, and an AND inside an AND (an OR
    inside an OR) spliced into one.

    >>> class Text:
    ...     def compare(self, c): return f"{c.field} {c.operator} {c.value!r}"
    ...     def negate(self, term): return f"not({term})"
    ...     def all_of(self, terms): return "(" + " and ".join(terms) + ")"
    ...     def any_of(self, terms): return "(" + " or ".join(terms) + ")"
    >>> emit(parse_filters({"operator": "NOT", "conditions": [
    ...     {"field": "id", "operator": "!=", "value": "a"},
    ...     {"operator": "NOT", "conditions": [{"field": "meta.n", "operator": ">", "value": 1}]},
    ... ]}), Text())
    "(id == 'a' or meta.n > 1)"
    """
    return _emit(parsed.root, emitter, False)


def _emit(node: Comparison | Logical, emitter: Emitter[T], negated: bool) -> T:
    if isinstance(node, Comparison):
        if node.operator in _POSITIVE:
            node, negated = replace(node, operator=_POSITIVE[node.operator]), not negated
        term = emitter.compare(node)
        return emitter.negate(term) if negated else term
    operator = _effective(node, negated)
    terms: list[T] = []
    _gather(node, operator, negated, emitter, terms)
    if len(terms) == 1:
        return terms[0]
    return emitter.all_of(terms) if operator == "AND" else emitter.any_of(terms)


def _effective(node: Logical, negated: bool) -> str:
    """AND or OR: what ``node`` is once its negation (and a NOT's) is pushed into it."""
    operator = "AND" if node.operator == "NOT" else node.operator
    return operator if negated == (node.operator == "NOT") else _FLIP[operator]


_FLIP = {"AND": "OR", "OR": "AND"}


def _gather(node: Logical, operator: str, negated: bool, emitter, terms: list) -> None:
    """The terms of ``node``'s conditions under ``operator``, nested ones of the same
    operator (and those of one condition, which are that condition) spliced in."""
    inner = negated != (node.operator == "NOT")  # what the conditions are seen through
    for condition in node.conditions:
        if isinstance(condition, Logical) and (
            len(condition.conditions) == 1 or _effective(condition, inner) == operator
        ):
            _gather(condition, operator, inner, emitter, terms)
        else:
            terms.append(_emit(condition, emitter, inner))


# -- parsing -------------------------------------------------------------------------------------


def _parse_tree(filters: dict, capabilities) -> Filter:
    """A dict parsed: the one parse of a filter (tests count its calls)."""
    counted = [0, 0]  # conditions, depth
    root = _parse(filters, 0, counted, capabilities)
    return Filter(root, counted[1], counted[0], filters)


def _parse(node: Any, depth: int, counted: list[int], capabilities) -> Comparison | Logical:
    """``node`` checked and parsed; ``counted`` holds the conditions met so far and the
    deepest level."""
    counted[1] = max(counted[1], depth)
    if not isinstance(node, dict):
        raise ValueError(f"a filter condition must be a dict, got {type(node).__name__} {node!r}")
    parsed = _parse_comparison(node) if "field" in node else None
    counted[0] += 1 if parsed is None else _conditions(parsed)
    _check_size(depth, counted[0], capabilities)
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
    return Logical(operator, tuple(_parse(c, depth + 1, counted, capabilities) for c in conditions))


def _check_size(depth: int, conditions: int, capabilities) -> None:
    """ValueError when a filter nests ``depth`` levels or holds ``conditions`` conditions,
    more than the engine of ``capabilities`` (None: none) or the language takes."""
    limit = getattr(capabilities, "filter_max_depth", None)
    if limit is not None and depth > limit:
        raise ValueError(
            f"filters nest deeper than {limit} levels, the most the "
            f"{capabilities.engine} engine takes: flatten the AND, OR and NOT operators (an "
            "AND inside an AND is one AND)"
        )
    if depth > MAX_NESTING:
        raise ValueError(
            f"filters nest deeper than {MAX_NESTING} levels: flatten the AND, OR and NOT "
            "operators (an AND inside an AND is one AND)"
        )
    limit = getattr(capabilities, "filter_max_conditions", None)
    if limit is not None and conditions > limit:
        raise ValueError(
            f"the filter holds more than {limit} conditions, the most the "
            f"{capabilities.engine} engine takes: match many values with one 'in' list of "
            "strings or numbers"
        )


def _conditions(node: Comparison) -> int:
    """The size of a comparison: one, and one more for each None, list or object in an
    ``in`` list (strings and numbers are matched as one term)."""
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
        utc_iso(value, where)
    elif not isinstance(value, (bool, int, float)):
        raise ValueError(
            f"filter {where} got a {type(value).__name__} value: compare numbers or ISO dates"
        )


def utc_iso(value: str, where: str = "filter") -> str:
    """``value`` (an ISO 8601 date) as the UTC ``YYYY-MM-DDTHH:MM:SS.SSS`` SQLite's
    ``julianday()`` reads (a naive date is UTC); ValueError naming ``where`` otherwise.

    >>> utc_iso("2024-01-02T03:00:00+01:00")
    '2024-01-02T02:00:00.000'
    """
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
# it: the embedded store's SQL holds to this (sqlite_filters.py), and typed_fields' "d" is
# julianday()'s reading, so that every engine agrees (julianday() alone also reads bare
# numbers and 'now').
DATE_GLOB = "[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*"  # fnmatchcase reads it as GLOB does
_UNIX_EPOCH_MS = 210_866_760_000_000  # the Julian day of 1970-01-01 (2440587.5) in ms


def typed_fields(doc_id: str, text: str, title: str, meta: dict) -> dict[str, dict[str, Any]]:
    """Every filterable field of a document with its value split by type, as an engine
    without SQLite's JSON functions stores it beside the document so that its filters
    (emitted from :func:`parse_filters`' form) keep the embedded store's semantics exactly:
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
    if fnmatchcase(value, DATE_GLOB):
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
    return datetime.fromisoformat(utc_iso(value, where)).replace(tzinfo=timezone.utc).timestamp()
