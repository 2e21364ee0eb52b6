"""Faults are answered, never crashed on: every bad request, bad file, full disk and read-only
folder gets one clear line or a 4xx, on every engine where it can happen.

Each fault of the tables below runs against the command line (one ``error:`` line, exit 2 for
bad input, 3 for the machine: a full disk, a read-only or damaged file; never a traceback or
``unexpected error``) and against the server (a 4xx, 507 for a full disk, in the project's
error shape), on each engine it applies to: bad input on the embedded store, PostgreSQL (a
real server, the ``postgres_uri`` fixture) and Qdrant's local mode; a full disk on the
embedded store and Qdrant's folder (a small tmpfs); read-only and damaged files on the
embedded store. A *situation* makes the store, brings the fault about, and afterwards checks
the store: its documents all there, a filtered search working, and a damaged file left as it
was (nothing written over it).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import STORE_ENGINES
from typer.testing import CliRunner

from densefit.retrieval.encode import encode_texts
from densefit.retrieval.index import open_store
from densefit.retrieval.index.filters import MAX_NESTING, parse_filters
from densefit.retrieval.index.registry import engine_of
from densefit.retrieval.index.sqlite_filters import MAX_CONDITIONS, MAX_DEPTH
from densefit.testing.conformance import make_corpus, with_meta

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from densefit.serve.app import create_app  # noqa: E402
from densefit.serve.config import ServeConfig  # noqa: E402

RUNNER = CliRunner()
DOCS = with_meta(make_corpus(40))
N = len(DOCS)
EN = {"field": "meta.lang", "operator": "==", "value": "en"}
NO_MATCH = {"field": "meta.lang", "operator": "==", "value": "zzz"}
JSON = {"content-type": "application/json"}
KEY = "s3cret"


@pytest.fixture(scope="module")
def app():
    from densefit.cli.app import app

    return app


# -- the filters that cost an engine most, at its limits and one past them ---------------------


def limits(capabilities) -> tuple[int, int]:
    """``(levels, conditions)``: the largest filter a store of ``capabilities`` takes (its
    own limits; nesting is bounded by the language's where the engine has no limit of its
    own). Every engine here declares a limit on conditions."""
    assert capabilities.filter_max_conditions is not None, capabilities.engine
    return capabilities.filter_max_depth or MAX_NESTING, capabilities.filter_max_conditions


def target_limits(target: str) -> tuple[int, int]:
    """:func:`limits` of the store at ``target``."""
    with open_store(target, create=False) as store:
        return limits(store.capabilities)


def _worst_leaf(operator: str) -> dict:
    """A comparison whose SQL nests deepest: ``not in`` (true for every document) or ``in``
    (false for every one) with a string, a number, a list and an object, each compiled its
    own way (and None with ``not in``)."""
    values = ["x", 1900, [1], {"a": 1}] + ([None] if operator == "not in" else [])
    return {"field": "meta.year", "operator": operator, "value": values}


def deepest(levels: int = MAX_DEPTH, conditions: int = MAX_CONDITIONS) -> dict:
    """Up to ``levels`` logical operators (as many as ``conditions`` allow), each holding a
    comparison before the nested one (the arrangement SQLite's parser needs most stack
    for): NOT, NOT, AND, OR in turn, with comparisons that leave the nested one's answer as
    it is, so the whole matches ``EN``."""
    nodes: list[dict] = [EN]
    for i in range(levels):
        operator = ("NOT", "NOT", "AND", "OR")[i % 4]
        leaf = _worst_leaf("in" if operator == "OR" else "not in")
        deeper = {"operator": operator, "conditions": [leaf, nodes[-1]]}
        if parse_filters(deeper).conditions > conditions:
            break
        nodes.append(deeper)
    return nodes[-2] if len(nodes) % 4 == 2 else nodes[-1]  # not after one NOT of a pair


def widest(conditions: int = MAX_CONDITIONS) -> dict:
    """An OR of ``conditions - 1`` comparisons, the language last (what matches)."""
    years = [
        {"field": "meta.year", "operator": "==", "value": 3000 + i} for i in range(conditions - 2)
    ]
    return {"operator": "OR", "conditions": [*years, EN]}


def deep_and_wide(levels: int = MAX_DEPTH, conditions: int = MAX_CONDITIONS) -> dict:
    """``levels`` operators, the nested one first and as many comparisons after it as the
    limit on conditions allows: SQLite's expression tree is deepest along the first one."""
    width = (conditions - 1) // levels - 1
    node: dict = EN
    for i in range(levels):
        operator, compare = [("OR", "=="), ("AND", "!=")][i % 2]  # leave the answer as it is
        years = [
            {"field": "meta.year", "operator": compare, "value": 3000 + j} for j in range(width)
        ]
        node = {"operator": operator, "conditions": [node, *years]}
    return node


def _too_deep(levels: int) -> dict:
    """``levels`` ANDs and ORs in turn around ``EN`` (few conditions: only nesting is past)."""
    node: dict = EN
    for i in range(levels):
        node = {"operator": ("AND", "OR")[i % 2], "conditions": [node, EN]}
    return node


# -- stores and what a user sees -----------------------------------------------------------------


def build(target: str, model, docs=DOCS) -> str:
    """A store at ``target`` holding ``docs``, written through the store API."""
    with open_store(target, model) as store:
        store.write(docs, encode_texts(model, [d.text for d in docs]))
    return target


def healthy(target: str, model, count: int = N) -> None:
    """The store holds ``count`` documents and answers a filtered search (dense, and BM25
    where the engine has it) with documents the filter matches."""
    with open_store(target, create=False) as store:
        assert store.count() == count
        query = encode_texts(model, ["cells genes"])
        modes = ["dense", "bm25"] if store.capabilities.lexical else ["dense"]
        for mode in modes:
            hits = store.search(query, 5, filters=EN, mode=mode, query_texts=["cells genes"])[0]
            assert hits and all(h.meta["lang"] == "en" for h in hits), mode


def one_line(result, code: int, words: str) -> None:
    """Exit ``code``; for a failure exactly one ``error:`` line holding ``words``; never a
    traceback or ``unexpected error``."""
    output = result.output
    assert result.exit_code == code, output
    assert "Traceback" not in output and "unexpected error" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == (code != 0), output
    assert words in (errors[0] if errors else output), output


def error_of(response) -> str:
    """The message of an error response in any of the project's shapes."""
    body = response.json()
    assert set(body) <= {"error", "detail", "error_type"}, body  # not FastAPI's {"detail": ...}
    error = body["error"]
    return error["message"] if isinstance(error, dict) else error


# -- situations: the store, the fault brought about, the store checked after ---------------------


@dataclass
class Ctx:
    engine: str
    new_target: Callable[[str], str]
    tmp_path: Path
    model: object
    data: Path

    def store(self) -> str:
        return build(self.new_target(self.engine), self.model)

    def store_in(self, folder: Path) -> str:
        """A store of this engine in ``folder`` (the embedded store or Qdrant's local mode)."""
        name = f"t_{uuid.uuid4().hex[:8]}"
        target = str(folder / name) if self.engine == "embedded" else f"qdrant:{folder}/{name}"
        return build(target, self.model)


@contextmanager
def bad_input(ctx: Ctx) -> Iterator[str]:
    """A store of every engine; the input is at fault. After: unchanged."""
    target = ctx.store()
    yield target
    healthy(target, ctx.model)


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here ({done.stderr.strip() or 'not root'})")


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextmanager
def read_only(ctx: Ctx) -> Iterator[str]:
    """The store seen through a read-only bind mount (EROFS for every write, root's too).
    After: it still searches there, and the store under the mount is unchanged."""
    source = ctx.tmp_path / "writable"
    source.mkdir()
    target = build(str(source / "store"), ctx.model)
    files = {p.name: p.read_bytes() for p in Path(target).iterdir()}
    mounted = ctx.tmp_path / "read-only"
    mounted.mkdir()
    _mount("--bind", str(source), str(mounted))
    try:
        _mount("-o", "remount,ro,bind", str(mounted))
        yield str(mounted / "store")
        healthy(str(mounted / "store"), ctx.model)
    finally:
        _unmount(mounted)
    assert {p.name: p.read_bytes() for p in Path(target).iterdir()} == files


@contextmanager
def full_disk(ctx: Ctx) -> Iterator[str]:
    """The store on a small tmpfs, filled up. After: space freed, every committed document
    is whole (its vector readable) and the store searches and takes writes again."""
    disk = ctx.tmp_path / "disk"
    disk.mkdir()
    _mount("-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk))
    try:
        target = ctx.store_in(disk)
        for cache in disk.glob("*/bm25-*.npz"):  # a BM25 search builds it and saves it at close
            cache.unlink()
        filler = disk / "filler"
        with open(filler, "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * (1 << 16))
                    fh.flush()
            except OSError:
                pass
        yield target
        filler.unlink()
        with open_store(target, create=False) as store:
            ids = list(store.ids())
            assert len(ids) >= N and np.isfinite(store.vectors(ids)).all()
            more = DOCS[:2]
            store.write(more, encode_texts(ctx.model, [d.text for d in more]))
        healthy(target, ctx.model, len(ids))
    finally:
        _unmount(disk)


def _damaged(how: Callable[[Path], None]):
    @contextmanager
    def situation(ctx: Ctx) -> Iterator[str]:
        # The embedded store, its files damaged (how). After: densefit wrote nothing over them
        # (SQLite may leave the empty side files a connection makes).
        target = ctx.store()
        how(Path(target))
        files = {p.name: p.read_bytes() for p in Path(target).iterdir()}
        yield target
        assert {name: (Path(target) / name).read_bytes() for name in files} == files

    return situation


def _garbage_header(store: Path) -> None:
    """garbage over SQLite's header"""
    db = store / "store.sqlite"
    data = bytearray(db.read_bytes())
    data[:100] = b"\xa5" * 100
    db.write_bytes(data)


def _truncated(store: Path) -> None:
    """store.sqlite cut in half"""
    db = store / "store.sqlite"
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 2])


def _middle_page(store: Path) -> None:
    """a page in the middle of store.sqlite overwritten"""
    db = store / "store.sqlite"
    data = bytearray(db.read_bytes())
    page = 4096 * (len(data) // 4096 // 2)
    data[page : page + 4096] = bytes(range(256)) * 16
    db.write_bytes(data)


def _nan_vector(store: Path) -> None:
    """a vector row set to NaN"""
    vectors = np.memmap(store / "vectors-0.f32", dtype="<f4", mode="r+")
    vectors[5 * 32 : 6 * 32] = np.nan
    vectors.flush()


def _short_vectors(store: Path) -> None:
    """the vector file cut short"""
    path = store / "vectors-0.f32"
    path.write_bytes(path.read_bytes()[:1000])


@contextmanager
def junk_appended(ctx: Ctx) -> Iterator[str]:
    """Bytes appended to the vector file (what a write that never committed leaves). After:
    dropped, the store whole."""
    target = ctx.store()
    vectors = Path(target) / "vectors-0.f32"
    size = vectors.stat().st_size
    with open(vectors, "ab") as fh:
        fh.write(b"\x7f" * 1001)
    yield target
    assert vectors.stat().st_size % 128 == 0 and vectors.stat().st_size >= size  # whole rows
    healthy(target, ctx.model)


@contextmanager
def nan_in_old_metadata(ctx: Ctx) -> Iterator[str]:
    """A document whose metadata an older densefit wrote with NaN (not JSON). After: the
    store searches without a filter; deleting the document (as the message says) brings
    filters back."""
    target = ctx.store()
    with sqlite3.connect(Path(target) / "store.sqlite") as conn:
        conn.execute(
            'UPDATE documents SET meta = \'{"lang": "en", "x": NaN}\' WHERE id = \'doc-0003\''
        )
    conn.close()
    yield target
    with open_store(target, create=False) as store:
        assert len(store.search(encode_texts(ctx.model, ["cells"]), 3)[0]) == 3
        store.delete(["doc-0003"])
    healthy(target, ctx.model, N - 1)


SITUATIONS = {
    "bad input": (bad_input, STORE_ENGINES),
    "read-only": (read_only, ("embedded",)),
    "full disk": (full_disk, ("embedded", "qdrant")),
    "garbage header": (_damaged(_garbage_header), ("embedded",)),
    "truncated database": (_damaged(_truncated), ("embedded",)),
    "damaged page": (_damaged(_middle_page), ("embedded",)),
    "NaN vector": (_damaged(_nan_vector), ("embedded",)),
    "short vector file": (_damaged(_short_vectors), ("embedded",)),
    "junk appended": (junk_appended, ("embedded",)),
    "NaN in old metadata": (nan_in_old_metadata, ("embedded",)),
}


# -- the command line ------------------------------------------------------------------------------

# name: (situation, the command (target, data folder) -> arguments, exit status, a piece of
#        its one error line, or with status 0 of its output)
CLI_FAULTS = {
    "NaN metadata in a corpus row": (
        "bad input", lambda t, d: ["index", d / "nan.jsonl", "--model", d / "model", "--store", t],
        2, "nan.jsonl:2: field 'meta.x': NaN or Infinity",
    ),
    "Infinity metadata in a corpus row": (
        "bad input", lambda t, d: ["index", d / "inf.jsonl", "--model", d / "model", "--store", t],
        2, "inf.jsonl:1: field 'metadata.deep.0': NaN or Infinity",
    ),
    "BM25 search, a filter matching nothing": (
        "bad input", lambda t, d: ["search", "--store", t, "cells", "--mode", "bm25", "--filter", json.dumps(NO_MATCH)],
        0, "no documents match the filter",
    ),
    "hybrid search, a filter matching nothing": (
        "bad input", lambda t, d: ["search", "--store", t, "cells", "--mode", "hybrid", "--filter", json.dumps(NO_MATCH)],
        0, "no documents match the filter",
    ),
    "a filter nesting past the store's limit": (
        "bad input", lambda t, d: ["search", "--store", t, "cells", "--filter", json.dumps(_too_deep(target_limits(t)[0] + 1))],
        2, lambda t: f"filters nest deeper than {target_limits(t)[0]} levels",
    ),
    "a filter past the store's limit on conditions": (
        "bad input", lambda t, d: ["search", "--store", t, "cells", "--mode", "bm25", "--filter", json.dumps(widest(target_limits(t)[1] + 1))],
        2, lambda t: f"more than {target_limits(t)[1]} conditions, the most the {engine_of(t)} engine takes",
    ),
    "an integer past 64 bits in a filter": (
        "bad input", lambda t, d: ["search", "--store", t, "cells", "--filter", json.dumps({"field": "meta.year", "operator": "==", "value": 2**63})],
        2, "outside the 64-bit range",
    ),
    "read-only: search": (
        "read-only", lambda t, d: ["search", "--store", t, "cells", "--json", "--filter", json.dumps(EN)], 0, '"doc-',
    ),
    "read-only: BM25 search": (
        "read-only", lambda t, d: ["search", "--store", t, "cells", "--json", "--mode", "bm25"], 0, '"doc-',
    ),
    "read-only: index": (
        "read-only", lambda t, d: ["index", d / "more.jsonl", "--model", d / "model", "--store", t],
        3, "is read-only (the folder is on a read-only file system",
    ),
    "read-only: reembed": (
        "read-only", lambda t, d: ["reembed", "--store", t, "--model", d / "model"],
        3, "is read-only",
    ),
    "full disk: index": (
        "full disk", lambda t, d: ["index", d / "more.jsonl", "--model", d / "model", "--store", t],
        3, "the disk is full",
    ),
    "full disk: index into a new store": (
        "full disk", lambda t, d: ["index", d / "more.jsonl", "--model", d / "model", "--store", _beside(t, "new")],
        3, "the disk is full",
    ),
    "full disk: BM25 search": (
        "full disk", lambda t, d: ["search", "--store", t, "cells", "--json", "--mode", "bm25"], 0, '"doc-',
    ),
    "garbage header: search": ("garbage header", lambda t, d: ["search", "--store", t, "cells"], 3, "store.sqlite: the database is damaged (file is not a database)"),
    "garbage header: serve": ("garbage header", lambda t, d: ["serve", "--store", t], 3, "store.sqlite: the database is damaged"),
    "truncated database: search": ("truncated database", lambda t, d: ["search", "--store", t, "cells", "--mode", "bm25"], 3, "store.sqlite: the database is damaged"),
    "damaged page: search": ("damaged page", lambda t, d: ["search", "--store", t, "cells"], 3, "store.sqlite: the database is damaged (SQLite's quick_check"),
    "damaged page: index": ("damaged page", lambda t, d: ["index", d / "more.jsonl", "--model", d / "model", "--store", t], 3, "the database is damaged"),
    "damaged page: serve": ("damaged page", lambda t, d: ["serve", "--store", t], 3, "the database is damaged"),
    "NaN vector: search": ("NaN vector", lambda t, d: ["search", "--store", t, "cells"], 3, "vectors-0.f32: vector row 5 holds NaN"),
    "short vector file: search": ("short vector file", lambda t, d: ["search", "--store", t, "cells"], 3, "vectors-0.f32: the file holds 7 vectors but the store committed 40"),
    "junk appended: search": ("junk appended", lambda t, d: ["search", "--store", t, "cells"], 0, "1,001 bytes past its 40 committed vectors"),
    "NaN in old metadata: filtered search": (
        "NaN in old metadata", lambda t, d: ["search", "--store", t, "cells", "--filter", json.dumps(EN)],
        3, "the metadata of 1 document ('doc-0003') is not valid JSON",
    ),
}  # fmt: skip


def _beside(target: str, name: str) -> str:
    """The target of a store called ``name`` in the folder of ``target``'s."""
    return target.rsplit("/", 1)[0] + "/" + name


def _cases(table: dict) -> list:
    return [
        pytest.param(name, engine, id=f"{name}-{engine}")
        for name, (situation, *_) in table.items()
        for engine in SITUATIONS[situation][1]
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_models) -> Path:
    """Corpus files (more documents; rows with NaN and Infinity in their metadata) and the
    model."""
    folder = tmp_path_factory.mktemp("data")
    shutil.copytree(tiny_models / "tiny", folder / "model")
    more = with_meta(make_corpus(600))[N:]
    with open(folder / "more.jsonl", "w") as fh:
        for d in more:
            fh.write(json.dumps({"_id": d.id, "text": d.text * 3, "meta": d.meta}) + "\n")
    (folder / "nan.jsonl").write_text(
        '{"_id": "n1", "text": "cells", "meta": {"x": 1}}\n'
        '{"_id": "n2", "text": "genes", "meta": {"x": NaN}}\n'
    )
    (folder / "inf.jsonl").write_text(
        '{"_id": "n1", "text": "cells", "metadata": {"deep": [Infinity]}}\n'
    )
    return folder


@pytest.fixture
def ctx(new_target, tmp_path, model, data):
    return lambda engine: Ctx(engine, new_target, tmp_path, model, data)


@pytest.mark.parametrize(("name", "engine"), _cases(CLI_FAULTS))
def test_the_command_line_answers_each_fault_in_one_line(app, ctx, name, engine):
    situation, arguments, code, words = CLI_FAULTS[name]
    with SITUATIONS[situation][0](ctx(engine)) as target:
        args = [str(a) for a in arguments(target, ctx(engine).data)]
        one_line(RUNNER.invoke(app, args), code, words(target) if callable(words) else words)


# -- the server ------------------------------------------------------------------------------------

NAN_BODY = b'{"documents": [{"id": "n1", "text": "cells", "meta": {"a": {"x": NaN}}}]}'
INF_BODY = b'{"documents": [{"id": "n1", "text": "cells", "meta": {"x": [-Infinity]}}]}'
NEW_DOCS = {"documents": [{"id": f"new-{i}", "text": "cells genes " * 50} for i in range(200)]}


def _search(filters, mode="dense"):
    return lambda c: c.post(
        "/search", json={"query": "cells", "k": 3, "filters": filters, "mode": mode}
    )


def _past(make, mode="dense"):
    """A search with the filter ``make(levels, conditions)`` of the served store's limits."""
    return lambda c: _search(make(*limits(c.app.state.store.capabilities)), mode)(c)


# name: (situation, the request (client) -> response, status, a piece of the message, or with
#        200 a check of the body)
HTTP_FAULTS = {
    "NaN metadata": ("bad input", lambda c: c.post("/documents", content=NAN_BODY, headers=JSON), 422, "documents[0].meta.a.x: NaN or infinite"),
    "-Infinity metadata": ("bad input", lambda c: c.post("/documents", content=INF_BODY, headers=JSON), 422, "documents[0].meta.x.0: NaN or infinite"),
    "BM25 search, a filter matching nothing": ("bad input", _search(NO_MATCH, "bm25"), 200, lambda body: body["results"][0]["hits"] == []),
    "hybrid search, a filter matching nothing": ("bad input", _search(NO_MATCH, "hybrid"), 200, lambda body: body["results"][0]["hits"] == []),
    "a filter nesting past the store's limit": ("bad input", _past(lambda depth, _: _too_deep(depth + 1)), 400, lambda depth, _: f"filters nest deeper than {depth} levels"),
    "a filter past the store's limit on conditions": ("bad input", _past(lambda _, most: widest(most + 1), "hybrid"), 400, lambda _, most: f"more than {most} conditions, the most the"),
    "an integer past 64 bits in a filter": ("bad input", _search({"field": "meta.year", "operator": "in", "value": [-(2**63) - 1]}), 400, "outside the 64-bit range"),
    "invalid UTF-8 to /v1/embeddings": ("bad input", lambda c: c.post("/v1/embeddings", content=b'{"input": "\xff\xfe"}', headers=JSON), 400, "byte 0xff at position 11 is not UTF-8"),
    "invalid UTF-8 to /embed": ("bad input", lambda c: c.post("/embed", content=b'{"inputs": "a\xc3"}', headers=JSON), 400, "byte 0xc3 at position 13 is not UTF-8"),
    "invalid UTF-8 to /documents": ("bad input", lambda c: c.post("/documents", content=b'{"documents": [{"id": "\xe9"}]}', headers=JSON), 400, "is not UTF-8"),
    "JSON nested 5,000 deep to /v1/embeddings": ("bad input", lambda c: c.post("/v1/embeddings", content=b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}", headers=JSON), 400, "nests deeper than the parser allows"),
    "JSON nested 5,000 deep to /embed": ("bad input", lambda c: c.post("/embed", content=b'{"inputs": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}", headers=JSON), 400, "nests deeper than the parser allows"),
    "no such route": ("bad input", lambda c: c.get("/nowhere"), 404, "no such route"),
    "read-only: write": ("read-only", lambda c: c.post("/documents", json=NEW_DOCS), 403, "is read-only"),
    "read-only: delete": ("read-only", lambda c: c.request("DELETE", "/documents", json={"ids": ["doc-0001"]}), 403, "is read-only"),
    "read-only: BM25 search": ("read-only", _search(EN, "bm25"), 200, lambda body: len(body["results"][0]["hits"]) == 3),
    "full disk: write": ("full disk", lambda c: c.post("/documents", json=NEW_DOCS), 507, "the disk is full"),
    "full disk: hybrid search": ("full disk", _search(EN, "hybrid"), 200, lambda body: len(body["results"][0]["hits"]) == 3),
    "junk appended: write": ("junk appended", lambda c: c.post("/documents", json={"documents": NEW_DOCS["documents"][:1]}), 200, lambda body: body["added"] == 1),
}  # fmt: skip


@pytest.mark.parametrize(("name", "engine"), _cases(HTTP_FAULTS))
def test_the_server_answers_each_fault_with_a_4xx(ctx, model, name, engine, capfd):
    situation, request, status, expected = HTTP_FAULTS[name]
    with SITUATIONS[situation][0](ctx(engine)) as target:
        store = open_store(target, model)
        with TestClient(create_app(store, model), raise_server_exceptions=False) as client:
            response = request(client)
            assert response.status_code == status, response.text
            if status == 200:
                assert expected(response.json()), response.text
            else:
                if callable(expected):  # the message names the served store's limits
                    expected = expected(*limits(store.capabilities))
                assert expected in error_of(response), response.text
            assert client.get("/health").status_code == 200  # serving on
        if name == "junk appended: write":  # the write landed where the junk was
            with open_store(target, create=False) as reopened:
                reopened.delete(["new-0"])
    logged = capfd.readouterr()
    assert "Traceback" not in logged.err + logged.out  # not at shutdown either


# -- the cases that need more than one request or command ------------------------------------------


def test_the_limits_of_filters_run_on_every_engine(app, ctx, engine_name_all, tmp_path):
    """The deepest and the widest filters each engine takes (its own limits) run there,
    dense and BM25, over the command line and the server, and find what the embedded store
    finds for the one condition they come down to (``EN``)."""
    c = ctx(engine_name_all)
    target, reference = c.store(), ctx("embedded").store()
    model = c.model
    with open_store(target, create=False) as store, open_store(reference, create=False) as ref:
        levels, conditions = limits(store.capabilities)
        filters = {
            "deepest": deepest(levels, conditions),
            "widest": widest(conditions),
            "deep and wide": deep_and_wide(min(levels, MAX_DEPTH), conditions),
        }
        for name, f in filters.items():
            parsed = parse_filters(f, store.capabilities)  # within the limits, at them
            assert parsed.conditions >= conditions - levels or name == "deepest", name
            query = encode_texts(model, ["cells genes"])
            for mode in ("dense", "bm25"):
                want = ref.search(query, 5, filters=EN, mode=mode, query_texts=["cells genes"])
                got = store.search(query, 5, filters=f, mode=mode, query_texts=["cells genes"])
                assert [h.id for h in got[0]] == [h.id for h in want[0]] != [], (name, mode)
            assert store.count_matching(f) == ref.count_matching(EN) > 0, name
    path = tmp_path / "deepest.json"
    path.write_text(json.dumps(filters["deepest"]))
    found = RUNNER.invoke(
        app, ["search", "--store", target, "cells", "--json", "--filter", f"@{path}"]
    )
    one_line(found, 0, '"doc-')
    store = open_store(target, model)
    with TestClient(create_app(store, model)) as client:
        for f in filters.values():
            found = client.post(
                "/search", json={"query": "cells", "k": 3, "filters": f, "mode": "hybrid"}
            )
            assert found.status_code == 200 and found.json()["results"][0]["hits"]


@pytest.fixture(params=STORE_ENGINES)
def engine_name_all(request) -> str:
    return request.param


def test_a_full_disk_during_indexing_keeps_what_committed_and_resumes(app, ctx, engine_full):
    """``densefit index`` onto a disk that fills up mid-way: exit 3 naming the file; after
    freeing space the same command resumes from the committed documents and finishes."""
    c = ctx(engine_full)
    disk = c.tmp_path / "disk"
    disk.mkdir()
    _mount("-t", "tmpfs", "-o", "size=900k", "tmpfs", str(disk))
    try:
        target = str(disk / "store") if engine_full == "embedded" else f"qdrant:{disk}/store"
        args = ["index", c.data / "more.jsonl", "--model", c.data / "model", "--store", target]
        args = [str(a) for a in args] + ["--commit-every", "50"]
        one_line(RUNNER.invoke(app, args), 3, "the disk is full")
        with open_store(target, create=False) as store:
            committed = store.count()
            assert 0 < committed < len(make_corpus(600)) - N
            assert np.isfinite(store.vectors(list(store.ids()))).all()
        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        resumed = RUNNER.invoke(app, [*args, "--json"])
        one_line(resumed, 0, "")
        report = json.loads(resumed.stdout)["report"]
        assert report["unchanged"] == committed and report["added"] == 560 - committed
        healthy(target, c.model, 560)
    finally:
        _unmount(disk)


@pytest.fixture(params=["embedded", "qdrant"])
def engine_full(request) -> str:
    if request.param == "qdrant":
        pytest.importorskip("qdrant_client")
    return request.param


def test_a_user_who_may_not_write_the_store_searches_it(tmp_path, model, data):
    """Read-only by permissions: the real ``densefit`` command as a user other than the
    store's owner (root ignores permissions): search works, index is refused in one line."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a command as another user")
    shared = Path(tempfile_dir())
    try:
        shutil.copytree(data / "model", shared / "model")
        shutil.copy(data / "more.jsonl", shared)
        from densefit.models import load_model

        model = load_model(str(shared / "model"))  # the store names the model it was made with
        target = build(str(shared / "store"), model)
        for path in [shared, *shared.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)  # the owner's (root's) alone to write
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        home = shared / "home"  # the one folder the user may write
        home.mkdir(mode=0o777)
        home.chmod(0o777)
        env = {**os.environ, "HOME": str(home), "HF_HOME": str(home / "hf")}
        densefit = [sys.executable, "-m", "densefit"]
        found = subprocess.run(
            [*nobody, *densefit, "search", "--store", target, "cells", "--mode", "bm25", "--json", "--filter", json.dumps(EN)],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert found.returncode == 0, found.stderr
        assert all(h["meta"]["lang"] == "en" for h in json.loads(found.stdout)[0]["hits"])
        refused = subprocess.run(
            [*nobody, *densefit, "index", str(shared / "more.jsonl"), "--model", str(shared / "model"), "--store", target],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        lines = refused.stderr.strip().splitlines()
        assert (
            refused.returncode == 3
            and lines[-1].startswith("error: ")
            and "is read-only" in lines[-1]
        )
        assert (
            "Traceback" not in refused.stderr
            and sum(line.startswith("error:") for line in lines) == 1
        )
        healthy(target, model)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def tempfile_dir() -> str:
    """A folder every user may enter (pytest's are root's alone)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="densefit-faults-")
    os.chmod(folder, 0o755)
    return folder


def test_the_read_only_flag_opens_a_writable_store_for_reading_only(tmp_path, model):
    from densefit.errors import ReadOnlyStoreError
    from densefit.retrieval.index.store import LocalDocumentStore

    target = build(str(tmp_path / "store"), model)
    files = {p.name: p.read_bytes() for p in Path(target).iterdir()}
    store = LocalDocumentStore(target, read_only=True)
    assert store.read_only == "opened read-only"
    with TestClient(create_app(store, model), raise_server_exceptions=False) as client:
        refused = client.post("/documents", json={"documents": [{"id": "x", "text": "cells"}]})
        assert refused.status_code == 403 and "read-only (opened read-only)" in error_of(refused)
        assert client.post("/search", json={"query": "cells", "mode": "hybrid"}).status_code == 200
    with LocalDocumentStore(target, read_only=True) as again:
        for write in (
            lambda: again.delete(["doc-0001"]),
            lambda: again.compact(),
            lambda: again.writer_lock(),
        ):
            with pytest.raises(ReadOnlyStoreError, match="is read-only"):
                write()
    assert {name: (Path(target) / name).read_bytes() for name in files} == files


def test_an_interrupted_admin_swap_is_reported_after_a_restart(ctx, engine_name_all, tiny_models):
    """GET /admin/reembed after a restart says ``interrupted`` (with the model and what is
    left), not ``idle``, while the store holds a half-done swap; a POST resumes it."""
    from densefit.models import load_model
    from densefit.retrieval.index.reembed import reembed_store

    c = ctx(engine_name_all)
    target, model = c.store(), c.model
    other = load_model(str(tiny_models / "tiny-other"))
    with open_store(target, create=False) as store:
        calls = iter(range(100))
        report = reembed_store(store, other, commit_every=8, should_stop=lambda: next(calls) >= 2)
        assert not report.switched
    store = open_store(target, model)
    headers = {"X-API-Key": KEY}
    with TestClient(create_app(store, model, ServeConfig(api_key=KEY))) as client:
        status = client.get("/admin/reembed", headers=headers).json()
        assert status["state"] == "interrupted" and status["model"] == str(
            tiny_models / "tiny-other"
        )
        assert 0 < status["remaining"] < N and "resumes" in status["resume"]
        started = client.post("/admin/reembed", json={"model": status["model"]}, headers=headers)
        assert started.status_code == 202
        for _ in range(600):
            status = client.get("/admin/reembed", headers=headers).json()
            if status["state"] != "running":
                break
            time.sleep(0.05)
        assert status["state"] == "done" and status["report"]["resumed"], status
    with open_store(target, create=False) as store:
        assert store.model_name == str(tiny_models / "tiny-other") and store.count() == N


def test_corpus_rows_give_meta_and_metadata_and_warn_once_about_other_fields(app, tmp_path, data):
    """``meta`` and ``metadata`` are both read; a field the reader does not read is warned
    about once, however many rows hold it."""
    rows = [
        {"_id": "a", "text": "cells divide", "meta": {"x": 1}},
        {"_id": "b", "text": "genes", "metadata": {"x": 2}, "url": "u"},
        {"_id": "c", "text": "python", "metadata": {"x": 3}, "url": "v"},
    ]
    corpus = tmp_path / "rows.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "store"
    result = RUNNER.invoke(
        app, ["index", str(corpus), "--model", str(data / "model"), "--store", str(store)]
    )
    one_line(result, 0, "")
    assert result.output.count("not read") == 1 and "'url' not read" in result.output
    with open_store(str(store), create=False) as opened:
        assert [d.meta for d in opened.get(["a", "b", "c"])] == [{"x": 1}, {"x": 2}, {"x": 3}]


def test_a_bug_is_a_500_naming_the_error_and_the_server_serves_on(tmp_path, model, caplog):
    """What is not the request's or the machine's fault is a bug: 500 naming the error (not
    only its class), the traceback in the server's log, the next request answered."""
    import errno

    target = build(str(tmp_path / "store"), model)
    store = open_store(target, model)
    raised = iter([RuntimeError("the writer broke"), OSError(errno.EBADF, "Bad file descriptor")])

    def broken(*args, **kwargs):
        raise next(raised)

    store.write = broken
    body = {"documents": [{"id": "x", "text": "cells"}]}
    with TestClient(create_app(store, model), raise_server_exceptions=False) as client:
        first, second = client.post("/documents", json=body), client.post("/documents", json=body)
        assert first.status_code == second.status_code == 500
        assert error_of(first).startswith("internal error: RuntimeError: the writer broke (a bug")
        assert error_of(second).startswith("internal error: OSError: [Errno 9] Bad file descriptor")
        assert client.post("/search", json={"query": "cells", "filters": EN}).status_code == 200
    assert any(r.name == "densefit.serve" and r.exc_info for r in caplog.records)
