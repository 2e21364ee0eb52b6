"""Every text input is checked one way (densefit.data.text.text_problem): each route of
``densefit serve`` and each command that reads text refuses the same hostile texts (a lone
surrogate, NUL, too long, empty, not a string) with a 4xx or one line naming the field,
never a 5xx or a traceback."""

from __future__ import annotations

import json

import pytest

from densefit.data.text import text_problem

# -- the one check ---------------------------------------------------------------------------

HOSTILE = {  # name: (value, the kind text_problem gives, a piece of every message)
    "lone surrogate": ("bad \udcff byte", "unicode", "invalid UTF-8"),
    "lone high surrogate": ("\ud800", "unicode", "invalid UTF-8"),
    "NUL": ("a\x00b", "nul", "NUL character"),
    "empty": ("", "empty", "is empty"),
    "blank": (" \t\n", "empty", "is empty"),
    "integer": (7, "type", "expected text, got int"),
    "null": (None, "type", "expected text, got null"),
    "object": ({"text": "x"}, "type", "expected text, got an object"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_the_one_check(name):
    value, kind, words = HOSTILE[name]
    problem = text_problem(value)
    assert problem.kind == kind and words in problem.message
    assert text_problem("x" * 11, max_chars=10).kind == "length"
    assert text_problem("", empty_ok=True) is None and text_problem("ça va 東京 🙂") is None


# -- every route of densefit serve -----------------------------------------------------------

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

MAX_CHARS = 50
HUGE = ("x" * (MAX_CHARS + 1), "length", "the limit is")
# route: (method, path, body with the text at one place, the field the error names,
#         what the field accepts besides valid text: "" (empty), "any" (any JSON value))
ROUTES = {
    "search query": ("POST", "/search", lambda t: {"query": t}, "query", ""),
    "search query list": ("POST", "/search", lambda t: {"query": ["ok", t]}, "query[1]", ""),
    "search filter value": (
        "POST", "/search",
        lambda t: {"query": "ok", "filters": {"field": "meta.n", "operator": "==", "value": t}},
        "filters.value", "any",
    ),
    "document text": ("POST", "/documents", lambda t: {"documents": [{"id": "x", "text": t}]},
                      "documents[0].text", ""),
    "document id": ("POST", "/documents", lambda t: {"documents": [{"id": t, "text": "ok"}]},
                    "documents[0].id", ""),
    "document title": ("POST", "/documents",
                       lambda t: {"documents": [{"id": "x", "text": "ok", "title": t}]},
                       "documents[0].title", "empty"),
    "document meta": ("POST", "/documents",
                      lambda t: {"documents": [{"id": "x", "text": "ok", "meta": {"k": [t]}}]},
                      "documents[0].meta.k[0]", "any"),
    "delete ids": ("DELETE", "/documents", lambda t: {"ids": ["ok", t]}, "ids[1]", ""),
    "openai input": ("POST", "/v1/embeddings", lambda t: {"input": t}, "input", ""),
    "openai input list": ("POST", "/v1/embeddings", lambda t: {"input": ["ok", t]}, "input[1]", ""),
    "tei inputs": ("POST", "/embed", lambda t: {"inputs": t}, "inputs", ""),
    "tei inputs list": ("POST", "/embed", lambda t: {"inputs": ["ok", t]}, "inputs[1]", ""),
    "admin reembed model": ("POST", "/admin/reembed", lambda t: {"model": t}, "model", ""),
}  # fmt: skip
TEXTS = {**HOSTILE, "huge": HUGE}


def _message(response) -> str:
    body = response.json()
    error = body["error"]
    return error["message"] if isinstance(error, dict) else error  # OpenAI's shape, or ours


def _expected_status(route: str, kind: str) -> int:
    accepts = ROUTES[route][4]
    if accepts == "any" and kind in ("type", "empty", "length"):
        return 200  # metadata and filter values may be numbers, null, empty or long
    if accepts == "empty" and kind == "empty":
        return 200
    return 413 if kind == "length" else 422


@pytest.fixture(scope="module")
def client(tiny_models, tmp_path_factory):
    from fastapi.testclient import TestClient

    from densefit.data.types import Document
    from densefit.models import load_model
    from densefit.retrieval.index import LocalDocumentStore, index_documents, open_store
    from densefit.serve.app import create_app
    from densefit.serve.config import ServeConfig

    model = load_model(str(tiny_models / "tiny"))
    path = tmp_path_factory.mktemp("texts") / "store"
    with open_store(path, model) as store:
        index_documents(store, model, [Document(f"d{i}", f"cells genes {i}") for i in range(5)])
    config = ServeConfig(max_text_chars=MAX_CHARS, api_key="k")  # a key: the admin routes exist
    app = create_app(LocalDocumentStore(path), model, config)
    with TestClient(app, raise_server_exceptions=False, headers={"X-API-Key": "k"}) as test_client:
        yield test_client


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("route", ROUTES)
def test_every_route_refuses_hostile_texts_alike(client, route, text):
    method, path, body, field, _ = ROUTES[route]
    value, kind, words = TEXTS[text]
    # json.dumps escapes a lone surrogate as \udcff: valid JSON, invalid text
    raw = json.dumps(body(value)).encode()
    response = client.request(
        method, path, content=raw, headers={"content-type": "application/json"}
    )
    expected = _expected_status(route, kind)
    assert response.status_code == expected, (response.status_code, response.text)
    if expected == 200:
        return
    message = _message(response)
    assert message.startswith(f"{field}: ") or f"; {field}: " in message, message
    if kind == "type" and path != "/search" and route.endswith("list") and isinstance(value, int):
        assert "token arrays are not supported" in message  # OpenAI's and TEI's token ids
    else:
        assert words in message, message
    assert client.get("/health").status_code == 200


# -- every command that reads text -----------------------------------------------------------


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from densefit.testing import tiny_model

    root = tmp_path_factory.mktemp("text_commands")
    tiny_model(root / "model")
    return root


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # \udcff stays an escape
    return path


def _beir(folder, *, doc_text="the cell protein 1", query_text="what is cell 1"):
    docs = [{"_id": "d0", "text": "the cell protein 0"}, {"_id": "d1", "text": doc_text}]
    queries = [{"_id": "q0", "text": "what is cell 0"}, {"_id": "q1", "text": query_text}]
    _jsonl(folder / "corpus.jsonl", docs)
    _jsonl(folder / "queries.jsonl", queries)
    (folder / "qrels").mkdir(exist_ok=True)
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq0\td0\t1\nq1\td1\t1\n")
    return folder


FILE_TEXTS = {k: v for k, v in HOSTILE.items() if k != "blank"}


def _command(ws, name, value, case):
    """A command line of ``name`` whose input holds ``value`` at one text field, and the
    ``file:line: field`` the error must name."""
    model, folder = str(ws / "model"), ws / case
    if name == "train":
        rows = [
            {"question": "what is cell 0", "pos_doc": "cell 0"},
            {"question": value, "pos_doc": "x"},
        ]
        data = _jsonl(folder / "pairs.jsonl", rows)
        return ["train", str(data), "-m", model, "-o", str(folder / "out"), "--max-steps", "1",
                "--no-progress"], f"{data}:2: field 'question'"  # fmt: skip
    if name == "mine":
        beir = _beir(folder / "beir", doc_text=value)
        return ["mine", str(beir), "--corpus", str(beir), "-o", str(folder / "mined.jsonl"),
                "--no-progress"], f"{beir / 'corpus.jsonl'}:2: field 'text'"  # fmt: skip
    if name == "index":
        beir = _beir(folder / "beir", doc_text=value)
        return ["index", str(beir), "-m", model, "--store", str(folder / "store"),
                "--no-progress"], f"{beir / 'corpus.jsonl'}:2: field 'text'"  # fmt: skip
    if name == "eval":
        beir = _beir(folder / "beir", query_text=value)
        return ["eval", "--dataset", str(beir), "-m", model, "--split", "test",
                "--no-progress"], f"{beir / 'queries.jsonl'}:2: field 'text'"  # fmt: skip
    raise AssertionError(name)


@pytest.fixture(autouse=True)
def no_progress_bars():
    from transformers.utils import logging

    logging.disable_progress_bar()
    yield
    logging.enable_progress_bar()


@pytest.mark.parametrize("text", FILE_TEXTS)
@pytest.mark.parametrize("name", ["train", "mine", "index", "eval"])
def test_every_command_refuses_hostile_texts_in_its_files(ws, name, text):
    from typer.testing import CliRunner

    from densefit.cli import app

    value, kind, words = FILE_TEXTS[text]
    args, where = _command(ws, name, value, f"{name}-{text.replace(' ', '-')}")
    corpus = name in ("mine", "index")
    if corpus and (kind == "empty" or value is None):
        words = "empty document"  # a corpus text may be empty (or null) when a title is given
    elif value is None:  # the readers read a null field as a missing one
        where, words = where.split(" field ")[0], "missing"
    result = CliRunner().invoke(app, args)
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, (args, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert where in lines[0] and words in lines[0], lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "query, words",
    [("bad \udcff byte", "invalid UTF-8"), ("", "is empty"), ("  ", "is empty")],
    ids=["undecodable argument", "empty", "blank"],
)
def test_search_refuses_hostile_query_arguments(ws, tiny_models, query, words):
    """A command-line argument with bytes that are not UTF-8 arrives as a lone surrogate
    (Python's surrogateescape); it is refused before it reaches the tokenizer."""
    from typer.testing import CliRunner

    from densefit.cli import app
    from densefit.data.types import Document
    from densefit.models import load_model
    from densefit.retrieval.index import index_documents, open_store

    store = ws / "search-store"
    if not store.exists():
        model = load_model(str(ws / "model"))
        with open_store(store, model) as opened:
            index_documents(opened, model, [Document("d0", "cells"), Document("d1", "genes")])
    result = CliRunner().invoke(app, ["search", "cells", query, "--store", str(store)])
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: queries[1]: "), result.stderr
    assert words in lines[0]
