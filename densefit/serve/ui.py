"""The search page of ``densefit serve``: ``GET /`` and its script and style, served from the
package (``densefit/serve/static/``; no CDN, no external font), off with ``--no-ui``.

The page is a client of the HTTP API and nothing else: it asks ``GET /health`` what the
store can do (``modes``), searches with ``POST /search`` and shows the server's own error
messages. Its three files need no API key (a browser cannot send a header when it opens a
page); every API call it makes does, sent as ``X-API-Key``. A Content-Security-Policy lets the
page load and call nothing but this server.
"""

from __future__ import annotations

import html
from functools import cache
from importlib.resources import files

from densefit.retrieval.bm25 import STOPWORDS, import_bm25s

__all__ = ["UI_PATHS", "add_ui_routes", "page"]

# path -> (file under static/, media type); no request value ever names a file
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/search.js": ("search.js", "text/javascript; charset=utf-8"),
    "/ui/search.css": ("search.css", "text/css; charset=utf-8"),
}
UI_PATHS = frozenset(_FILES)
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def page(path: str) -> bytes:
    """The bytes served at ``path`` (one of :data:`UI_PATHS`). The page carries BM25's stop
    words, so that it highlights the query words a BM25 search matched and no others.

    >>> b"<script src=\\"/ui/search.js\\"" in page("/")
    True
    """
    name, _ = _FILES[path]
    text = (files("densefit.serve") / "static" / name).read_text(encoding="utf-8")
    if name == "index.html":
        text = text.replace("{{stopwords}}", html.escape(" ".join(_stopwords())))
    return text.encode("utf-8")


def _stopwords() -> list[str]:
    import_bm25s()  # says what to install when it is missing
    from bm25s.stopwords import STOPWORDS_EN  # the optional extra `mine` (bm25s)

    return sorted({"en": STOPWORDS_EN}[STOPWORDS])  # densefit.retrieval.bm25's choice


def add_ui_routes(app) -> None:
    """``GET /``, ``/ui/search.js`` and ``/ui/search.css`` on ``app``."""
    from fastapi.responses import Response  # the optional extra `serve`

    def route(path: str, media_type: str):
        def serve() -> Response:
            return Response(page(path), media_type=media_type, headers=_HEADERS)

        return serve

    for path, (_, media_type) in _FILES.items():
        app.add_api_route(path, route(path, media_type), methods=["GET"], include_in_schema=False)
