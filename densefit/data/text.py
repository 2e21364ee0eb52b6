"""One check for every text densefit reads, wherever it comes from.

Rows of data files (:mod:`densefit.data.rows`), queries on the command line and in the Python
API, and every text field of ``densefit serve``'s requests go through :func:`text_problem`,
so a text is refused for the same reasons everywhere, with the same words:

- not a string (``expected text, got int``);
- longer than a limit, where the caller has one (the server's ``max_text_chars``);
- empty or only whitespace, unless the field may be empty (a title);
- not valid Unicode: a lone surrogate, which is what undecodable bytes become under
  ``surrogateescape`` (files, command-line arguments) and what a JSON ``"\\udcff"`` escape
  decodes to; UTF-8 cannot encode it, so the tokenizer, SQLite and JSON output would fail on it;
- a NUL character (U+0000): natural text never holds one (it marks binary data or a C string
  bug), and tokenizers drop it silently, so the text stored would not be the text embedded.

Callers add where the text was (``data.jsonl:7: field 'anchor'``, ``query[0]``,
``documents[2].text``) and turn the problem into their kind of error: a bad row, a 4xx, a
one-line CLI error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "InvalidText",
    "TextProblem",
    "checked_json_texts",
    "checked_text",
    "checked_texts",
    "text_problem",
    "type_name",
]

_SURROGATE = re.compile("[\ud800-\udfff]")  # invalid UTF-8 (surrogateescape) or a bad \u escape


@dataclass(frozen=True)
class TextProblem:
    """Why a value is not a usable text: ``kind`` is ``"type"``, ``"length"``, ``"empty"``,
    ``"unicode"`` or ``"nul"``; ``message`` says it in words (without the field)."""

    kind: str
    message: str


class InvalidText(ValueError):
    """A text that :func:`text_problem` refuses: ``str(error)`` is ``"FIELD: problem"``."""

    def __init__(self, field: str, problem: TextProblem):
        super().__init__(f"{field}: {problem.message}")
        self.field = field
        self.problem = problem


def type_name(value: Any) -> str:
    """How a value's type reads in a message: "an object", "a list", "null", "int"...

    >>> type_name({}), type_name(None), type_name(3)
    ('an object', 'null', 'int')
    """
    return {dict: "an object", list: "a list", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def text_problem(
    value: Any,
    *,
    expected: str = "text",
    empty_ok: bool = False,
    max_chars: int | None = None,
) -> TextProblem | None:
    """What is wrong with ``value`` as a text, or None when it is fine (see the module).

    ``expected`` names what was wanted in the type message (``"text or a list of texts"``).

    >>> text_problem("cells divide") is None
    True
    >>> text_problem("bad \\udcff byte").message
    "invalid UTF-8 or a broken \\\\u escape ('\\\\udcff' at character 4): send valid UTF-8 text"
    >>> text_problem(" ").kind, text_problem(7).message, text_problem("a\\x00b").kind
    ('empty', 'expected text, got int', 'nul')
    """
    if not isinstance(value, str):
        return TextProblem("type", f"expected {expected}, got {type_name(value)}")
    if max_chars is not None and len(value) > max_chars:
        return TextProblem(
            "length", f"has {len(value):,} characters; the limit is {max_chars:,}: split it"
        )
    if not empty_ok and not value.strip():
        return TextProblem("empty", "is empty")
    if bad := _SURROGATE.search(value):
        return TextProblem(
            "unicode",
            f"invalid UTF-8 or a broken \\u escape ({ascii(bad[0])} at character "
            f"{bad.start()}): send valid UTF-8 text",
        )
    if (at := value.find("\x00")) >= 0:
        return TextProblem(
            "nul", f"holds a NUL character (\\u0000) at character {at}: remove it (binary data?)"
        )
    return None


def checked_text(value: Any, field: str, **limits) -> str:
    """``value`` when :func:`text_problem` finds nothing wrong, else :class:`InvalidText`
    naming ``field``; ``limits`` are :func:`text_problem`'s keyword arguments.

    >>> checked_text("cells", "query")
    'cells'
    >>> checked_text("", "query")
    Traceback (most recent call last):
    ...
    densefit.data.text.InvalidText: query: is empty
    """
    problem = text_problem(value, **limits)
    if problem is not None:
        raise InvalidText(field, problem)
    return value


def checked_texts(values: Any, field: str, **limits) -> list[str]:
    """Every text of the list ``values`` checked by :func:`checked_text`, named
    ``field[i]``; a plain string (not a list) is refused as one.

    >>> checked_texts(["a", "b"], "queries")
    ['a', 'b']
    >>> checked_texts(["a", 3], "queries")
    Traceback (most recent call last):
    ...
    densefit.data.text.InvalidText: queries[1]: expected text, got int
    """
    if isinstance(values, str) or not isinstance(values, (list, tuple)):
        raise InvalidText(field, TextProblem("type", f"expected a list, got {type_name(values)}"))
    return [checked_text(v, f"{field}[{i}]", **limits) for i, v in enumerate(values)]


def checked_json_texts(value: Any, field: str) -> Any:
    """``value`` (a JSON-like object: metadata, a filter) when every string in it, keys
    included, is valid Unicode without NUL (empty strings are fine); else
    :class:`InvalidText` naming the path to the first bad one (``meta.lang``, ``meta.tags[2]``).

    >>> checked_json_texts({"lang": "en", "tags": ["a", ""]}, "meta")
    {'lang': 'en', 'tags': ['a', '']}
    >>> checked_json_texts({"tags": ["a", "\\udcff"]}, "meta")
    Traceback (most recent call last):
    ...
    densefit.data.text.InvalidText: meta.tags[1]: invalid UTF-8 or a broken \\u escape ('\\udcff' at character 0): send valid UTF-8 text
    """
    stack: list[tuple[Any, str]] = [(value, field)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            checked_text(item, path, empty_ok=True)
        elif isinstance(item, Mapping):
            for key, inner in reversed(list(item.items())):
                checked_text(key, f"{path} key {ascii(key)}", empty_ok=True)
                stack.append((inner, f"{path}.{key}"))
        elif isinstance(item, (list, tuple)):
            stack.extend((inner, f"{path}[{i}]") for i, inner in reversed(list(enumerate(item))))
    return value
