"""Regenerate the screenshots in docs/ with headless Chromium (densefit.testing.browser).

    .venv/bin/python scripts/screenshots.py            # every screenshot
    .venv/bin/python scripts/screenshots.py search     # docs/search-page.png only
    .venv/bin/python scripts/screenshots.py report --run runs/mine   # docs/report-page.png

The report shot opens a run's report.html (``--run``, default ``runs/scifact``: what
``bash scripts/demo.sh`` writes).

Needs the `test` and `serve` extras, the packaged all-MiniLM-L6-v2 (`models`) and Debian's
chromium + chromium-driver (scripts/test.sh installs them where it can). Each shot is a
function ``(driver, folder) -> path`` in :data:`SHOTS`; all share one browser.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from densefit.testing.browser import screenshot, serve_in_thread, start_chromium  # noqa: E402

DOCUMENTS = 300  # the first SciFact documents of examples/scifact: indexed in seconds
RUN = REPO / "runs" / "scifact"  # the demo's run folder: its report.html
HEIGHT = 1500  # pixels of the report shot, from the rank-change histogram down


def search_page(driver, folder: Path) -> Path:
    """``densefit serve``'s search page over SciFact documents: a hybrid query with a
    filter, its words marked in the hits."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from densefit.data.corpus import iter_corpus
    from densefit.data.types import Document
    from densefit.models import load_model
    from densefit.retrieval.index import index_documents, open_store
    from densefit.serve.app import create_app

    docs = []
    for doc in iter_corpus(REPO / "examples" / "scifact"):
        meta = {"source": "scifact", "words": len(doc.text.split())}
        docs.append(Document(doc.id, doc.text, meta=meta))  # the text starts with the title
        if len(docs) == DOCUMENTS:
            break
    model = load_model("all-MiniLM-L6-v2")
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(Path(tmp) / "scifact", model)
        index_documents(store, model, docs)
        with serve_in_thread(create_app(store, model)) as url:
            driver.get(url + "/")
            wait = WebDriverWait(driver, 60)
            wait.until(lambda d: "documents" in d.find_element("id", "store").text)
            Select(driver.find_element("id", "mode")).select_by_value("hybrid")
            k = driver.find_element("id", "k")
            k.clear()
            k.send_keys("4")
            flt = {"field": "meta.words", "operator": "<", "value": 300}
            driver.find_element("id", "filters").send_keys(json.dumps(flt))
            query = driver.find_element("id", "query")
            query.send_keys("HIV prevention with antiretroviral prophylaxis", Keys.ENTER)
            wait.until(lambda d: len(d.find_elements("css selector", "#hits > li")) == 4)
            path = folder / "search-page.png"
            screenshot(driver, path)
    return path


def report_page(driver, folder: Path, run: Path = RUN) -> Path:
    """``run``/report.html from disk: sorted by delta ascending, the largest loss opened;
    the shot starts at the rank-change histogram. Returns ``folder``/report-page.png."""
    page = Path(run) / "report.html"
    if not page.is_file():
        raise SystemExit(f"{page}: no such file: run `bash scripts/demo.sh` (or pass --run)")
    driver.get(page.resolve().as_uri())
    driver.find_element("css selector", 'th[data-key="delta"]').click()  # largest loss first
    driver.find_element("css selector", "#queries-table tbody tr").click()
    top, width, bottom = driver.execute_script(
        "const r = document.getElementById('rank-change-histogram').getBoundingClientRect();"
        "const d = document.getElementById('detail').getBoundingClientRect();"
        "return [r.top + scrollY - 8, document.documentElement.clientWidth, d.bottom + scrollY + 8]"
    )
    clip = {"x": 0, "y": top, "width": width, "height": min(bottom - top, HEIGHT), "scale": 1}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    path = Path(folder) / "report-page.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


SHOTS = {"search": search_page, "report": report_page}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shots", nargs="*", help=f"of {', '.join(SHOTS)} (default: all)")
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="default: docs/")
    parser.add_argument("--run", type=Path, default=RUN, help="report's run; default runs/scifact")
    args = parser.parse_args(argv)
    unknown = [name for name in args.shots if name not in SHOTS]
    if unknown:
        parser.error(f"no screenshot named {unknown[0]!r}: choose from {', '.join(SHOTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    driver = start_chromium()
    try:
        for name in args.shots or SHOTS:
            extra = {"run": args.run} if name == "report" else {}
            print(SHOTS[name](driver, args.out, **extra))
    finally:
        driver.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
