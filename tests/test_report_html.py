"""report.html in headless Chromium (the `browser` fixture): opened from disk it requests
nothing, its query table sorts and filters, and a query's detail shows what
eval/per_query.jsonl holds. The page is written from synthetic results: seconds, no model."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from densefit.comparison import compare_queries
from densefit.evaluate import evaluate_run
from densefit.pipeline.report import _md_per_query
from densefit.pipeline.report_html import TEXT_WIDTH, write_html

# A 1x1 PNG: the inlined plot
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
WORDS = ["alpha", "beta", "gamma", "delta", "omega"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """report.html of 24 queries (random runs of two models over 40 documents) and the
    comparison it shows."""
    rng = np.random.default_rng(7)
    docs = [f"d{i}" for i in range(40)]
    qrels, runs = {}, ({}, {})
    for q in range(24):
        judged = rng.choice(docs, size=3, replace=False)
        qrels[f"q{q}"] = {str(d): int(rng.integers(0, 3)) for d in judged} | {str(judged[0]): 2}
        for run in runs:
            retrieved = rng.choice(docs, size=15, replace=False)
            run[f"q{q}"] = {str(d): float(np.round(rng.random(), 3)) for d in retrieved}
    base = evaluate_run(runs[0], qrels, ["ndcg@10", "mrr@10"], name="base")
    new = evaluate_run(runs[1], qrels, ["ndcg@10", "mrr@10"], name="trained")
    queries = {f"q{q}": f"query {q} about {WORDS[q % 5]}" for q in range(24)}
    texts = {d: f"document {d} <b>text</b> " + "long " * (i * 10) for i, d in enumerate(docs)}
    comparison = compare_queries(base, new, queries=queries, documents=texts, close=0.3)
    folder = tmp_path_factory.mktemp("report")
    (folder / "plots").mkdir()
    (folder / "plots" / "metrics.png").write_bytes(PNG)
    summary = {**comparison.summary, "file": "eval/per_query.jsonl"}
    markdown = "\n\n".join(
        [
            "# densefit run: synthetic",
            "## Results\n\n| metric | base | trained |\n|---|---|---|\n| ndcg@10 | 0.1 | 0.2 |",
            "![base vs trained](plots/metrics.png)",
            "\n".join(_md_per_query(summary, comparison.texts)),
            "## Training\n\nSteps.",
        ]
    )
    path = write_html(folder / "report.html", markdown, comparison, folder=folder)
    return path, comparison


def in_page(text: str) -> str:
    """A document's text as the page shows it: cut at TEXT_WIDTH, white space collapsed."""
    cut = text if len(text) <= TEXT_WIDTH else text[: TEXT_WIDTH - 1] + "…"
    return " ".join(cut.split())


def shown(browser) -> list[str]:
    return [
        tr.get_attribute("data-query")
        for tr in browser.find_elements("css selector", "#queries-table tbody tr")
    ]


def click(browser, selector: str) -> None:
    browser.find_element("css selector", selector).click()


@pytest.fixture
def page(browser, report):
    """The report opened from disk (file://), in a browser left on a blank page with its
    network and console logs emptied (the browser is shared: an earlier test's page, still
    polling its server, may have logged its own 4xx)."""
    from densefit.testing.browser import requests_outside

    browser.get("about:blank")
    requests_outside(browser)
    browser.get_log("browser")
    browser.get(report[0].as_uri())
    return browser


def test_opened_from_disk_no_request_leaves_the_page(page, report):
    from densefit.testing.browser import requests_outside

    assert len(shown(page)) == 24
    assert requests_outside(page) == []
    urls = page.execute_script(
        "return Array.from(document.querySelectorAll('[src],[href]'))"
        ".map(e => e.getAttribute('src') || e.getAttribute('href'))"
    )
    assert urls and all(u.startswith("data:") for u in urls), urls
    assert page.execute_script("return document.querySelector('figure img').naturalWidth") == 1
    assert page.get_log("browser") == []  # no script error
    bars = page.find_elements("css selector", "#rank-changes rect title")
    counts = dict(b.get_attribute("textContent").rsplit(": ", 1) for b in bars)
    assert {k: int(v) for k, v in counts.items()} == report[1].summary["rank_changes"]


def test_the_table_sorts_by_a_clicked_header(page, report):
    rows = report[1].rows
    by_delta = sorted(rows, key=lambda r: (-r["delta"], int(r["query_id"][1:])))
    assert shown(page) == [r["query_id"] for r in by_delta]  # the default: delta, largest first
    click(page, 'th[data-key="delta"]')
    assert shown(page)[0] == min(rows, key=lambda r: r["delta"])["query_id"]
    assert (
        page.find_element("css selector", 'th[data-key="delta"]').get_attribute("aria-sort")
        == "ascending"
    )
    click(page, 'th[data-key="query_id"]')
    assert shown(page) == [f"q{i}" for i in range(24)]  # numeric-aware: q2 before q10
    click(page, 'th[data-key="query_id"]')
    assert shown(page) == [f"q{i}" for i in reversed(range(24))]
    click(page, 'th[data-key="new_best_rank"]')
    ranks = [next(r for r in rows if r["query_id"] == q)["new_best_rank"] for q in shown(page)]
    found = [r for r in ranks if r is not None]
    assert found == sorted(found, reverse=True) and ranks[: len(found)] == found  # nulls last


def test_the_table_filters_wins_losses_review_and_text(page, report):
    rows = report[1].rows
    for button, keep in (
        ("better", lambda r: r["change"] == "better"),
        ("worse", lambda r: r["change"] == "worse"),
        ("same", lambda r: r["change"] == "same"),
        ("review", lambda r: r["possible_missing_label"]),
    ):
        click(page, f'button[data-filter="{button}"]')
        assert sorted(shown(page)) == sorted(r["query_id"] for r in rows if keep(r)), button
    assert any(r["possible_missing_label"] for r in rows)
    click(page, 'button[data-filter="all"]')
    page.find_element("id", "search").send_keys("GAMMA")
    expected = {r["query_id"] for r in rows if "gamma" in r["query"]}
    assert set(shown(page)) == expected and len(expected) == 5
    assert page.find_element("id", "shown").text == "5 of 24 queries"


def test_a_query_detail_shows_what_the_per_query_file_holds(page, report):
    comparison = report[1]
    row = next(r for r in comparison.rows if r["change"] == "worse")
    assert page.find_element("id", "detail").get_attribute("hidden") is not None
    click(page, f'#queries-table tr[data-query="{row["query_id"]}"]')
    detail = page.find_element("id", "detail")
    assert detail.is_displayed() and row["query"] in detail.find_element("tag name", "h3").text
    relevant = detail.find_elements("css selector", "table.relevant tbody tr")
    assert [tr.get_attribute("data-doc") for tr in relevant] == [d["id"] for d in row["relevant"]]
    for tr, doc in zip(relevant, row["relevant"]):
        cells = [td.text for td in tr.find_elements("tag name", "td")]
        fmt = [lambda v: "-" if v is None else str(v), lambda v: "-" if v is None else f"{v:.4f}"]
        assert cells[2:6] == [
            fmt[0](doc["base_rank"]), fmt[1](doc["base_score"]),
            fmt[0](doc["new_rank"]), fmt[1](doc["new_score"]),
        ]  # fmt: skip
        assert cells[6] == in_page(comparison.texts[doc["id"]])
    for name, key in (("base", "base_hits"), ("trained", "new_hits")):
        items = detail.find_elements("css selector", f'.hits[data-model="{name}"] li')
        assert [li.get_attribute("data-doc") for li in items] == [h["id"] for h in row[key]]
        for li, hit in zip(items, row[key]):
            assert f"score {hit['score']:.4f}" in li.text
            label = {None: "unjudged", 0: "judged 0"}.get(hit["relevance"])
            assert (label or f"relevant {hit['relevance']}") in li.text
            assert in_page(comparison.texts[hit["id"]]) in li.text  # as text, not markup
    assert page.execute_script("return location.hash") == f"#q={row['query_id']}"


def test_printing_drops_the_controls_and_prints_the_whole_table(page):
    page.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": "print"})
    try:
        style = "return getComputedStyle(document.querySelector(arguments[0]))[arguments[1]]"
        assert page.execute_script(style, ".controls", "display") == "none"
        assert page.execute_script(style, ".table-scroll", "max-height") == "none"
    finally:
        page.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": ""})


def test_the_screenshot_script_shoots_the_per_query_view(browser, report, tmp_path):
    """scripts/screenshots.py report (docs/report-page.png) on this report: a PNG, the table
    sorted by delta ascending and the largest loss opened."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "screenshots.py"
    spec = importlib.util.spec_from_file_location("screenshots", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = module.report_page(browser, tmp_path, run=report[0].parent)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    worst = min(report[1].rows, key=lambda r: (r["delta"], int(r["query_id"][1:])))
    assert shown(browser)[0] == worst["query_id"]
    assert worst["query"] in browser.find_element("css selector", "#detail h3").text


def test_a_report_of_evaluations_without_rankings_has_no_per_query_view(tmp_path):
    """Evaluations saved before rankings were kept: report.html is report.md alone."""
    markdown = (
        "# densefit run: old\n\n## Results\n\n| metric | base |\n|---|---|\n| ndcg@10 | 0.5 |"
    )
    page = write_html(tmp_path / "report.html", markdown, None, folder=tmp_path).read_text()
    assert "<td>ndcg@10</td><td>0.5</td>" in page and "<title>densefit run: old</title>" in page
    assert 'id="per-query-data"' not in page and 'id="per-query-view"' not in page
