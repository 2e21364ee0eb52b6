"""The search page of ``densefit serve`` (densefit.serve.ui): served from the package with no
external URL, off with ``--no-ui``, and used in a real headless Chromium against a server
on 127.0.0.1: a query, the modes, a filter and a bad one, an API key."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from conftest import STORE_ENGINES  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from densefit.data.types import Document  # noqa: E402
from densefit.retrieval.bm25 import tokenize  # noqa: E402
from densefit.retrieval.index import index_documents, open_store  # noqa: E402
from densefit.serve.app import create_app, search_modes  # noqa: E402
from densefit.serve.config import ServeConfig  # noqa: E402
from densefit.serve.ui import UI_PATHS, add_ui_routes, page  # noqa: E402
from densefit.testing.browser import requests_outside, serve_in_thread  # noqa: E402

# words of the tiny model's vocabulary (densefit.testing.WORDS), so that each is one token
WORDS = (
    "cells protein gene cancer blood brain heart virus vaccine drug python function data".split()
)
KEY = "s3cret-key"


def corpus(n: int = 30) -> list[Document]:
    return [
        Document(
            f"d{i}",
            f"the {WORDS[i % len(WORDS)]} and {WORDS[(3 * i + 1) % len(WORDS)]} of study {i}",
            meta={"year": 2000 + i, "lang": "en" if i % 2 else "fr"},
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def store_path(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("ui") / "store"
    with open_store(path, model) as store:
        index_documents(store, model, corpus())
    return path


def client(store_path, model, **config) -> TestClient:
    return TestClient(create_app(open_store(store_path), model, ServeConfig(**config)))


# -- without a browser ---------------------------------------------------------------------


def test_the_page_is_served_from_the_package_and_no_ui_removes_it(store_path, model):
    with client(store_path, model) as http:
        r = http.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in r.headers["content-security-policy"]
        assert '<script src="/ui/search.js"' in r.text and 'href="/ui/search.css"' in r.text
        assert http.get("/ui/search.js").headers["content-type"].startswith("text/javascript")
        assert http.get("/ui/search.css").status_code == 200
    with client(store_path, model, ui=False) as http:
        assert [http.get(p).status_code for p in sorted(UI_PATHS)] == [404, 404, 404]
        assert http.get("/health").status_code == 200


# an absolute or protocol-relative URL with a host name, an @import, or a CSS url() that is
# not a data: URL: whatever would make the browser fetch from somewhere else
EXTERNAL = re.compile(r"(?:https?:)?//[a-z0-9-]+(?:\.[a-z0-9-]+)+|@import|url\((?!['\"]?data:)")


def test_the_page_references_no_external_url():
    assert EXTERNAL.search('<link href="https://cdn.example.com/x.css">')  # the check works
    assert EXTERNAL.search("src='//fonts.gstatic.com/a.woff2'")
    for path in UI_PATHS:
        text = page(path).decode()
        assert not EXTERNAL.search(text), f"{path}: {EXTERNAL.search(text).group(0)}"


def test_the_page_needs_no_key_but_the_api_does(store_path, model):
    with client(store_path, model, api_key=KEY) as http:
        assert all(http.get(p).status_code == 200 for p in UI_PATHS)
        assert http.get("/health").status_code == 401
        assert http.post("/search", json={"query": "cells"}).status_code == 401
        assert http.get("/health", headers={"X-API-Key": KEY}).status_code == 200


@pytest.mark.parametrize("engine", STORE_ENGINES)
def test_health_lists_the_modes_of_each_engine(new_target, model, engine):
    with open_store(new_target(engine), model) as store:
        index_documents(store, model, corpus(4))
        with TestClient(create_app(store, model, close_store=False)) as http:
            health = http.get("/health").json()
    assert health["engine"] == engine
    assert health["modes"] == search_modes(store.capabilities) and health["modes"][0] == "dense"


def test_search_modes_are_the_capabilities():
    assert search_modes(SimpleNamespace(lexical="bm25", hybrid=True)) == ["dense", "bm25", "hybrid"]
    assert search_modes(SimpleNamespace(lexical="bm25", hybrid=False)) == ["dense", "bm25"]
    assert search_modes(SimpleNamespace(lexical=None, hybrid=False)) == ["dense"]


def test_the_page_knows_the_stop_words_bm25_drops():
    body = re.search(r'data-stopwords="([^"]*)"', page("/").decode()).group(1)
    stopwords = body.split()
    assert "the" in stopwords and "cells" not in stopwords
    assert tokenize([" ".join(stopwords) + " cells"]) == [["cells"]]


@pytest.mark.parametrize("flags, status", [([], 200), (["--no-ui"], 404)])
def test_densefit_serve_no_ui(store_path, model, monkeypatch, flags, status):
    """The command line's --no-ui reaches the app that ``densefit serve`` runs."""
    from typer.testing import CliRunner

    from densefit.cli import app as cli

    served = []
    monkeypatch.setattr("densefit.serve.server.run_server", lambda app, **_: served.append(app))
    result = CliRunner().invoke(cli, ["serve", "--store", str(store_path), *flags])
    assert result.exit_code == 0, result.output
    with TestClient(served[0]) as http:
        assert http.get("/").status_code == status
        assert http.get("/health").status_code == 200


# -- in a browser --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(store_path, model):
    with serve_in_thread(create_app(open_store(store_path), model)) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_server(store_path, model, tmp_path_factory):
    import shutil

    copy = tmp_path_factory.mktemp("keyed") / "store"
    shutil.copytree(store_path, copy)
    with serve_in_thread(create_app(open_store(copy), model, ServeConfig(api_key=KEY))) as url:
        yield url


def api_search(url: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    return httpx.post(f"{url}/search", json=body, headers=headers, timeout=30)


def wait(browser, condition, seconds: float = 30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, seconds).until(lambda d: condition())


def by_id(browser, element_id: str):
    return browser.find_element("id", element_id)


def shown_hits(browser) -> list[dict]:
    """Each hit the page lists: rank, score, id, text, marked words, metadata."""
    hits = []
    for li in browser.find_elements("css selector", "#hits > li"):
        meta = dict(
            zip(
                [dt.text for dt in li.find_elements("css selector", "dt")],
                [json.loads(dd.text) for dd in li.find_elements("css selector", "dd")],
                strict=True,
            )
        )
        hits.append(
            {
                "rank": int(li.find_element("class name", "rank").text.lstrip("#")),
                "score": float(li.find_element("class name", "score").text),
                "id": li.find_element("class name", "id").text,
                "text": li.find_element("class name", "text").text,
                "marks": [m.text for m in li.find_elements("css selector", ".text mark")],
                "meta": meta,
            }
        )
    return hits


def open_page(browser, url: str) -> None:
    requests_outside(browser)  # what earlier tests left in the log
    browser.get(url + "/")
    wait(
        browser,
        lambda: (
            by_id(browser, "store").text != "connecting…" or by_id(browser, "error").is_displayed()
        ),
    )


def run_search(browser, query: str, *, mode: str | None = None, filters: str = "", k: int = 5):
    """Fill the form and submit it; returns when the page shows an answer or an error."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    for element_id, value in (("query", ""), ("filters", filters), ("k", str(k))):
        box = by_id(browser, element_id)
        box.clear()
        box.send_keys(value)
    if mode is not None:  # with the query box empty, a new mode does not search by itself
        Select(by_id(browser, "mode")).select_by_value(mode)
    browser.execute_script(  # what the last search left: the wait below sees the new answer
        "document.getElementById('error').hidden = true;"
        "document.getElementById('summary').textContent = '';"
    )
    by_id(browser, "query").send_keys(query, Keys.ENTER)
    wait(browser, lambda: by_id(browser, "error").is_displayed() or by_id(browser, "summary").text)


def test_type_a_query_and_see_the_hits(browser, server):
    open_page(browser, server)
    assert "30 documents" in by_id(browser, "store").text
    run_search(browser, "cells and protein", k=5)
    want = api_search(server, {"query": "cells and protein", "k": 5}).json()["results"][0]["hits"]
    got = shown_hits(browser)
    assert [h["id"] for h in got] == [h["id"] for h in want] and len(got) == 5
    assert [h["rank"] for h in got] == [1, 2, 3, 4, 5]
    assert [h["score"] for h in got] == [round(h["score"], 4) for h in want]
    assert [h["text"] for h in got] == [h["text"] for h in want]
    assert [h["meta"] for h in got] == [h["meta"] for h in want]
    assert all(not h["marks"] for h in got)  # dense: no word is what matched
    assert "5 hits · dense" in by_id(browser, "summary").text
    assert requests_outside(browser, server) == []


def test_modes_are_the_stores_and_bm25_marks_the_query_words(browser, server):
    from selenium.webdriver.support.ui import Select

    open_page(browser, server)
    options = [o.get_attribute("value") for o in Select(by_id(browser, "mode")).options]
    assert options == httpx.get(f"{server}/health").json()["modes"]
    run_search(browser, "cells brain", mode="dense")
    Select(by_id(browser, "mode")).select_by_value("bm25")  # searches again, by the new mode
    wait(browser, lambda: "· bm25 ·" in by_id(browser, "summary").text)
    want = api_search(server, {"query": "cells brain", "k": 5, "mode": "bm25"}).json()
    assert [h["id"] for h in shown_hits(browser)] == [h["id"] for h in want["results"][0]["hits"]]
    for mode in ("bm25", "hybrid"):
        run_search(browser, "the Cells of brain", mode=mode, k=10)
        body = {"query": "the Cells of brain", "k": 10, "mode": mode}
        want = api_search(server, body).json()["results"][0]["hits"]
        got = shown_hits(browser)
        assert [h["id"] for h in got] == [h["id"] for h in want] and got
        marks = {m.lower() for h in got for m in h["marks"]}
        assert marks == {"cells", "brain"}, marks  # stop words ("the", "of") not marked
        assert f"· {mode} ·" in by_id(browser, "summary").text
    assert requests_outside(browser, server) == []


def test_a_filter_and_a_bad_filters_error(browser, server):
    open_page(browser, server)
    flt = {"field": "meta.year", "operator": ">=", "value": 2020}
    run_search(browser, "virus vaccine", filters=json.dumps(flt), k=10)
    got = shown_hits(browser)
    want = api_search(server, {"query": "virus vaccine", "k": 10, "filters": flt}).json()
    assert [h["id"] for h in got] == [h["id"] for h in want["results"][0]["hits"]]
    assert got and all(h["meta"]["year"] >= 2020 for h in got)
    assert not by_id(browser, "error").is_displayed()

    bad = {"field": "meta.year", "operator": "~", "value": 1}
    run_search(browser, "virus vaccine", filters=json.dumps(bad))
    answer = api_search(server, {"query": "virus vaccine", "k": 5, "filters": bad})
    assert answer.status_code == 400
    assert by_id(browser, "error").text == answer.json()["error"]
    assert "operator" in by_id(browser, "error").text

    run_search(browser, "virus vaccine", filters="{not json")
    assert by_id(browser, "error").text.startswith("filter: not valid JSON")


def test_an_api_key_entered_in_the_page_goes_in_a_header(browser, keyed_server):
    open_page(browser, keyed_server)
    error = by_id(browser, "error")
    assert by_id(browser, "key-box").is_displayed() and "API key" in error.text
    assert by_id(browser, "store").text == "this server needs an API key"
    assert api_search(keyed_server, {"query": "cells"}).status_code == 401

    by_id(browser, "api-key").send_keys("wrong")
    run_search(browser, "cells")
    assert error.is_displayed() and "missing or wrong API key" in error.text
    assert not shown_hits(browser)

    key = by_id(browser, "api-key")
    key.clear()
    key.send_keys(KEY)
    run_search(browser, "cells", k=3)
    want = api_search(keyed_server, {"query": "cells", "k": 3}, KEY).json()["results"][0]["hits"]
    assert [h["id"] for h in shown_hits(browser)] == [h["id"] for h in want]
    assert not error.is_displayed() and KEY not in browser.current_url
    assert "30 documents" in by_id(browser, "store").text  # connected with the key

    # the key went out as a header of the API calls, never in a URL
    sent = [json.loads(e["message"])["message"] for e in browser.get_log("performance")]
    requests = [m["params"]["request"] for m in sent if m["method"] == "Network.requestWillBeSent"]
    assert not [r["url"] for r in requests if KEY in r["url"]]
    searches = [r for r in requests if r["url"].endswith("/search")]
    assert searches and searches[-1]["headers"].get("X-API-Key") == KEY


@pytest.mark.parametrize("engine", STORE_ENGINES)
def test_the_page_searches_every_engine(browser, new_target, model, engine):
    from selenium.webdriver.support.ui import Select

    store = open_store(new_target(engine), model)
    index_documents(store, model, corpus(12))
    with serve_in_thread(create_app(store, model)) as url:
        open_page(browser, url)
        modes = [o.get_attribute("value") for o in Select(by_id(browser, "mode")).options]
        assert modes == search_modes(store.capabilities)
        for mode in modes:
            run_search(browser, "blood virus", mode=mode, k=4)
            want = api_search(url, {"query": "blood virus", "k": 4, "mode": mode}).json()
            got = [h["id"] for h in shown_hits(browser)]
            assert got == [h["id"] for h in want["results"][0]["hits"]] and got, mode
        assert requests_outside(browser, url) == []


def test_a_server_without_a_store_says_it_only_embeds(browser):
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok", "modes": []})
    add_ui_routes(app)
    with serve_in_thread(app) as url:
        open_page(browser, url)
        assert "only embeds" in by_id(browser, "store").text
        assert not by_id(browser, "query").is_enabled()
