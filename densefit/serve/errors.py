"""How ``densefit serve`` refuses a request: one status rule, three error shapes, one text check.

Every route refuses with the same status for the same fault (400 unparseable JSON, 401 API
key, 403 writes disabled, 413 over a limit, 415 a body that is not declared JSON, 422 a field
that is wrong; the machine's faults, :class:`~densefit.errors.StorageFault`, their own: 507 a
full disk, 403 a read-only store, 503 a damaged file), and words it in the shape its clients
parse:

- ``/v1/...`` (OpenAI's API): ``{"error": {"message", "type", "param", "code"}}``, so that
  OpenAI's client libraries raise their usual exceptions with the message;
- ``/embed`` (text-embeddings-inference's API): ``{"error": "...", "error_type": "..."}``;
- every other route: ``{"error": "..."}`` (plus ``detail`` for field errors).

Texts in requests are checked by :func:`densefit.data.text.text_problem`, as the readers of
data files check theirs: :func:`checked_request_text` turns its verdict into a 413 (longer
than ``max_text_chars``) or a 422 naming the field (``query[0]``, ``documents[2].text``).
Importing this module does not need FastAPI.
"""

from __future__ import annotations

import re
from typing import Any

from densefit.data.text import InvalidText, checked_json_texts, text_problem, type_name

__all__ = [
    "ClientError",
    "JSON_BODY_HINT",
    "checked_request_json",
    "checked_request_text",
    "error_body",
    "field_path",
    "validation_message",
]

JSON_BODY_HINT = (
    "send the body as JSON with the header Content-Type: application/json "
    "(curl: -H 'Content-Type: application/json' -d '{...}', or curl --json '{...}')"
)


class ClientError(Exception):
    """A request the service refuses: ``status``, a message saying what is wrong, and the
    request field at fault (``param``, for OpenAI-shaped errors)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def field_path(loc: tuple | list) -> str:
    """A validation error's location as the field reads in JSON: ``documents[0].text``
    (FastAPI's leading ``body`` left out).

    >>> field_path(("body", "documents", 0, "text")), field_path(("body",))
    ('documents[0].text', 'body')
    """
    parts = list(loc)
    if len(parts) > 1 and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def checked_request_text(
    value: Any, field: str, *, max_chars: int | None = None, empty_ok: bool = False
) -> str:
    """``value`` if it is a valid text of a request, else :class:`ClientError`: 413 when it
    is longer than ``max_chars``, 422 otherwise (:func:`densefit.data.text.text_problem`).

    >>> checked_request_text("cells", "query[0]", max_chars=10)
    'cells'
    >>> try:
    ...     checked_request_text("x\\udcff", "query[0]")
    ... except ClientError as error:
    ...     print(error.status, error)
    422 query[0]: invalid UTF-8 or a broken \\u escape ('\\udcff' at character 1): send valid UTF-8 text
    """
    problem = text_problem(value, empty_ok=empty_ok, max_chars=max_chars)
    if problem is not None:
        status = 413 if problem.kind == "length" else 422
        raise ClientError(status, f"{field}: {problem.message}", param=field)
    return value


def checked_request_json(value: Any, field: str) -> Any:
    """``value`` (metadata, filters) when every string in it is valid text, else a 422
    :class:`ClientError` naming the path to the first bad one
    (:func:`densefit.data.text.checked_json_texts`)."""
    try:
        return checked_json_texts(value, field)
    except InvalidText as error:
        raise ClientError(422, str(error), param=error.field) from None


# Location parts pydantic adds for the branches of a union (``str``, ``list[str]``): not fields.
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|dict|list)$|\[")


def validation_message(errors: list[dict]) -> tuple[int, str, list[dict]]:
    """``(status, message, detail)`` for FastAPI's validation errors: 400 for a body that is
    not JSON, 422 otherwise; the message names each field at fault as :func:`field_path`
    writes it, once (of a union's failed branches, the one that got deepest into the
    value), and a string field given something else reads as the data readers say it
    (``query: expected text, got int``).

    >>> validation_message([
    ...     {"type": "string_type", "loc": ("body", "query", "str"), "input": 7, "msg": "..."},
    ...     {"type": "list_type", "loc": ("body", "query", "list[str]"), "input": 7, "msg": "..."},
    ... ])[:2]
    (422, 'query: expected text, got int')
    """
    located = []
    for e in errors:
        loc = tuple(
            p for p in e.get("loc", ()) if not (isinstance(p, str) and _UNION_BRANCH.search(p))
        )
        located.append((loc, e))
    deepest = [
        (loc, e)
        for loc, e in located
        if not any(len(other) > len(loc) and other[: len(loc)] == loc for other, _ in located)
    ]
    parts, seen = [], set()
    for loc, e in deepest[:10]:
        if loc in seen:
            continue
        seen.add(loc)
        where = field_path(loc)
        if e.get("type") == "json_invalid":
            reason = (e.get("ctx") or {}).get("error", "")
            parts.append(f"the body is not valid JSON ({reason or 'decode error'})")
        elif e.get("type") == "string_type":
            parts.append(f"{where}: expected text, got {type_name(e.get('input'))}")
        else:
            parts.append(f"{where}: {e.get('msg', 'invalid')}")
    detail = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
        for e in errors[:10]
    ]
    status = 400 if any(e.get("type") == "json_invalid" for e in errors) else 422
    return status, "; ".join(parts) or "invalid request", detail


_OPENAI_TYPES = {401: "invalid_request_error", 403: "permission_error", 404: "not_found_error"}
_OPENAI_CODES = {401: "invalid_api_key", 413: "request_too_large", 415: "unsupported_media_type"}
_TEI_TYPES = {401: "unauthorized", 403: "forbidden", 404: "not_found"}


def error_body(
    path: str, status: int, message: str, *, param: str | None = None, detail: Any = None
) -> dict:
    """The JSON body of an error response on ``path`` (see the module for the shapes).

    >>> error_body("/search", 422, "k: too large")
    {'error': 'k: too large'}
    >>> error_body("/v1/embeddings", 422, "input: is empty", param="input")["error"]["type"]
    'invalid_request_error'
    >>> error_body("/embed", 413, "inputs[0]: too long")
    {'error': 'inputs[0]: too long', 'error_type': 'validation'}
    """
    if path.startswith("/v1/"):
        kind = _OPENAI_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        return {
            "error": {
                "message": message,
                "type": kind,
                "param": param,
                "code": _OPENAI_CODES.get(status),
            }
        }
    if path == "/embed":
        kind = _TEI_TYPES.get(status, "backend" if status >= 500 else "validation")
        return {"error": message, "error_type": kind}
    body: dict = {"error": message}
    if detail is not None:
        body["detail"] = detail
    return body
