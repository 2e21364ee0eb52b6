"""The engines: which target names which engine (:func:`engine_of`: a URL by its scheme,
anything else a folder, the embedded store's), and what each can do (:data:`ENGINES`; the
targets' forms and capabilities are docs/search.md's table, :func:`capabilities_table`).

Each engine's row names its module and URL schemes and declares its
:class:`~densefit.retrieval.index.types.Capabilities`, which the engine's module reads
(``CAPABILITIES = capabilities_of("qdrant")``). This module imports no engine: listing the
engines, checking a capability (:func:`require`) and printing the table need no client
library, and engine modules import it without a circle.

>>> engine_of("runs/store"), engine_of("postgresql://me@db/search/docs"), engine_of("qdrant:q")
('embedded', 'postgresql', 'qdrant')
>>> redacted("postgresql://me:secret@db:5432/search/docs")
'postgresql://me:***@db:5432/search/docs'
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import unquote

from densefit.choices import VECTOR_KINDS
from densefit.retrieval.index.sqlite_filters import MAX_CONDITIONS, MAX_DEPTH
from densefit.retrieval.index.types import Capabilities, CapabilityError

__all__ = [
    "ENGINES",
    "Engine",
    "capabilities_of",
    "capabilities_table",
    "engine_of",
    "redacted",
    "require",
    "scrubbed",
]


@dataclass(frozen=True)
class Engine:
    """One engine: its module, the URL schemes of its targets (none: a folder, the embedded
    store's), how a target is written, and what it can do."""

    module: str
    schemes: tuple[str, ...]
    form: str
    capabilities: Capabilities


ENGINES: dict[str, Engine] = {
    "embedded": Engine(
        "densefit.retrieval.index.store",
        (),
        "a folder",
        Capabilities(
            engine="embedded",
            vector_kinds=VECTOR_KINDS,
            backends=("exact", "faiss"),
            lexical="bm25 (a side index of the texts, bm25s's tokens and scores)",
            hybrid=True,
            model_swap=True,
            transactions=True,
            crash_safe=True,
            compaction=True,
            shared=False,  # one machine: several processes, but one folder
            reembedding=True,
            upkeep=True,
            metadata_stats=True,
            filter_max_depth=MAX_DEPTH,  # what SQLite compiles (sqlite_filters measures it)
            filter_max_conditions=MAX_CONDITIONS,
        ),
    ),
    "postgresql": Engine(
        "densefit.retrieval.index.pgvector",
        ("postgresql", "postgres"),
        "`postgresql://USER@HOST/DATABASE/TABLE`",
        Capabilities(
            engine="postgresql",
            # float16: halfvec, on servers with pgvector >= 0.7; binary: bit(dim) sign codes
            # searched for candidates, rescored against the float32 vectors kept beside them
            vector_kinds=("float32", "float16", "binary"),
            backends=("hnsw", "exact"),
            lexical="bm25 in SQL over a postings table (bm25s's tokens and scores)",
            hybrid=True,
            model_swap=True,  # the next generation's vector table, switched to in one transaction
            transactions=True,
            crash_safe=True,  # tests/test_pgvector.py kills a writer mid-transaction
            compaction=False,  # PostgreSQL reclaims updated and deleted rows itself (VACUUM)
            shared=True,
            reembedding=True,
            upkeep=True,
            metadata_stats=True,
            # it runs these within 1 to 2 s a search (bench/filter_limits.py); its hard
            # limit is 65,535 bound parameters (at most two a condition). Nesting: no limit of
            # its own (it took 488 levels; the language's bound applies)
            filter_max_conditions=10_000,
        ),
    ),
    "qdrant": Engine(
        "densefit.retrieval.index.qdrant",
        ("qdrant",),
        "`qdrant://HOST:PORT/COLLECTION`, `qdrant:FOLDER`",
        Capabilities(
            engine="qdrant",
            vector_kinds=("float32", "float16"),
            backends=("hnsw", "exact"),
            lexical=(
                "bm25 (Qdrant sparse vectors with its IDF modifier; document lengths normalised "
                "by the average length of the first documents written)"
            ),
            hybrid=True,
            model_swap=True,
            transactions=False,
            crash_safe=False,
            compaction=False,
            shared=True,  # a server's; a store in local mode says False
            reembedding=True,
            upkeep=True,
            metadata_stats=True,
        ),
    ),
    "milvus": Engine(
        "densefit.retrieval.index.milvus",
        ("milvus",),
        "`milvus://HOST:PORT/COLLECTION`, `milvus:FILE.db`",
        Capabilities(
            engine="milvus",
            vector_kinds=("float32",),
            backends=("exact",),
            lexical="bm25 (Milvus's BM25 function over bm25s's tokens)",
            hybrid=True,
            model_swap=True,  # the next generation's collection, switched to by its alias
            transactions=False,
            crash_safe=False,
            compaction=False,
            shared=True,  # a server's; a Milvus Lite file says False
            reembedding=True,
            upkeep=True,
            metadata_stats=True,
        ),
    ),
}
_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*):")


def engine_of(target: str | os.PathLike | None) -> str:
    """The engine a target names (see the module docstring)."""
    if target is None or isinstance(target, os.PathLike):
        return "embedded"
    found = _SCHEME.match(str(target))
    if found is not None:
        for name, engine in ENGINES.items():
            if found.group(1).lower() in engine.schemes:
                return name
    return "embedded"


def capabilities_of(engine: str) -> Capabilities:
    """What ``engine`` can do.

    >>> capabilities_of("qdrant").transactions
    False
    """
    return ENGINES[engine].capabilities


def capabilities_table() -> str:
    """Every engine's capabilities as a Markdown table (docs/search.md holds it; a test
    checks that it is current).

    >>> capabilities_table().splitlines()[0].startswith("| | the embedded store | postgresql |")
    True
    """

    def yes(value: bool) -> str:
        return "yes" if value else "no"

    rows = [
        ("target", lambda e, c: ENGINES[e].form),
        ("vector kinds", lambda e, c: ", ".join(c.vector_kinds)),
        ("`--backend`", lambda e, c: ", ".join(c.backends) + " (default " + c.backends[0] + ")"),
        ("`--mode bm25`", lambda e, c: c.lexical or "no"),
        ("`--mode hybrid`", lambda e, c: yes(c.hybrid)),
        ("model swap (`reembed`)", lambda e, c: yes(c.model_swap)),
        ("re-embedding (`index --reembed`)", lambda e, c: yes(c.reembedding)),
        ("metadata statistics", lambda e, c: yes(c.metadata_stats)),
        ("upkeep (BM25, metadata indexes)", lambda e, c: yes(c.upkeep)),
        ("transactions", lambda e, c: yes(c.transactions)),
        ("crash safe (tested by SIGKILL)", lambda e, c: yes(c.crash_safe)),
        ("`compact`", lambda e, c: yes(c.compaction)),
        ("several servers on one store", lambda e, c: yes(c.shared)),
    ]
    engines = {name: engine.capabilities for name, engine in ENGINES.items()}
    lines = ["| | " + " | ".join(_named(e) for e in engines) + " |"]
    lines.append("|---" * (len(engines) + 1) + "|")
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(e, c) for e, c in engines.items()) + " |")
    return "\n".join(lines) + "\n"


# Query parameters whose values are secrets (compared lower-case, ``-`` read as ``_``): any
# name holding one of SECRET_WORDS ("passw": password, passwd, a misspelling; libpq's
# password and sslpassword), and the names in SECRET_PARAMETERS.
SECRET_WORDS = ("passw", "secret", "token", "credential", "apikey", "api_key")
SECRET_PARAMETERS = ("pwd", "pass", "key", "auth", "authorization")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_QUERY_VALUE = re.compile(r"([?&;])([^=&;#]*)=([^&;#]*)")


def redacted(target: str | os.PathLike | None) -> str:
    """``target`` as everything outside the process shows it (messages, logs, summaries,
    result files, ``info()``, ``/health``): the secrets in it replaced by ``***``.

    A secret is a URL's password (``user:PASSWORD@``; a target of an engine that takes no
    user, Qdrant's or Milvus's, has its whole ``KEY@`` masked: an API key written there),
    and the value of a secret query parameter (:data:`SECRET_WORDS`,
    :data:`SECRET_PARAMETERS`). :func:`scrubbed` masks them in a client library's error text.

    >>> redacted("postgresql://me:secret@db/search/docs?sslpassword=k&sslmode=require")
    'postgresql://me:***@db/search/docs?sslpassword=***&sslmode=require'
    >>> redacted("postgresql://me@db/search/docs?password=secret")
    'postgresql://me@db/search/docs?password=***'
    >>> redacted("qdrant://KEY@localhost/docs?api-key=KEY")
    'qdrant://***@localhost/docs?api-key=***'
    >>> redacted("runs/store")
    'runs/store'
    """
    text = _text(target)
    for start, end in reversed(_secret_spans(text)):
        text = text[:start] + "***" + text[end:]
    return text


def scrubbed(message: str, target: str | os.PathLike | None) -> str:
    """``message`` with each secret of ``target`` in it (as written and percent-decoded)
    replaced by ``***``: for a client library's error text, which may quote the target.

    >>> scrubbed('invalid percent-encoded token: "a%zzb"', "postgresql://me:a%zzb@db/d/t")
    'invalid percent-encoded token: "***"'
    """
    text = _text(target)
    for start, end in _secret_spans(text):
        for secret in sorted({text[start:end], unquote(text[start:end])}, key=len, reverse=True):
            if secret:
                message = message.replace(secret, "***")
    return message


def _text(target: str | os.PathLike | None) -> str:
    return os.fspath(target) if isinstance(target, os.PathLike) else str(target)


def _secret_spans(text: str) -> list[tuple[int, int]]:
    """Where ``text`` (a target) holds secrets (see :func:`redacted`), in order."""
    found = _URL.match(text)
    if found is None:
        return []  # a folder, or a target with no authority (qdrant:FOLDER)
    spans = []
    start = found.end()
    end = min((i for i in (text.find(c, start) for c in "?#") if i >= 0), default=len(text))
    at = text.rfind("@", start, end)
    userinfo = text[start:at]
    # a "/" before the "@": a path holding "@", unless a password (unencoded) holds the "/"
    if at >= 0 and ("/" not in userinfo or ":" in userinfo.split("/", 1)[0]):
        user, colon, _ = userinfo.partition(":")
        if found.group(1).lower() not in ENGINES["postgresql"].schemes:
            spans.append((start, at))  # an engine that takes no user: a key written there
        elif colon:
            spans.append((start + len(user) + 1, at))
    for parameter in _QUERY_VALUE.finditer(text, end):
        name = parameter.group(2).lower().replace("-", "_")
        if name in SECRET_PARAMETERS or any(word in name for word in SECRET_WORDS):
            spans.append(parameter.span(3))
    return spans


def require(
    capabilities: Capabilities,
    ability: str,
    doing: str,
    value: str | None = None,
    location: str | None = None,
) -> None:
    """Raise :class:`~densefit.retrieval.index.types.CapabilityError` (one line naming the
    engines that can) unless the engine of ``capabilities`` has ``ability`` (a
    :class:`~densefit.retrieval.index.types.Capabilities` field: true, set, or holding
    ``value``); ``doing`` says what was asked, as the user asked it. Commands call it before
    they start, for each optional role they need (``"reembedding"``, ``"model_swap"``,
    ``"upkeep"``, ``"metadata_stats"``).

    >>> require(capabilities_of("embedded"), "vector_kinds", "store int8 vectors", "int8")
    >>> require(capabilities_of("qdrant"), "transactions", "write all or nothing")
    Traceback (most recent call last):
    ...
    densefit.retrieval.index.types.CapabilityError: (qdrant) cannot write all or nothing: the embedded store and postgresql can
    """
    if _has(capabilities, ability, value):
        return
    able = [e for e in ENGINES if _has(capabilities_of(e), ability, value)]
    where = f"{location} " if location else ""
    offered = ""
    if value is not None:
        offered = f" (it offers {', '.join(getattr(capabilities, ability))})"
    others = f": {_listed([_named(e) for e in able])} can" if able else ""
    raise CapabilityError(f"{where}({_named(capabilities.engine)}) cannot {doing}{offered}{others}")


def _has(capabilities: Capabilities, ability: str, value: str | None) -> bool:
    held = getattr(capabilities, ability)
    if value is not None:
        return value in held
    return bool(held)


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _named(engine: str) -> str:
    return "the embedded store" if engine == "embedded" else engine
