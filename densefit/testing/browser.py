"""Headless Chromium for the browser tests and the documentation screenshots (selenium and
Debian's ``chromium`` + ``chromium-driver``: nothing is downloaded at run time). For example::

    driver = start_chromium()
    driver.get("http://127.0.0.1:8000/")
    assert not requests_outside(driver, "http://127.0.0.1:8000")
    driver.quit()
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

__all__ = [
    "MISSING",
    "WINDOW",
    "chromium_paths",
    "requests_outside",
    "screenshot",
    "serve_in_thread",
    "start_chromium",
]

MISSING = "chromium/chromedriver not found: apt-get install chromium chromium-driver"
WINDOW = (1280, 900)  # a laptop screen: what the screenshots and layout assertions see


def chromium_paths() -> tuple[str, str] | None:
    """The Chromium binary and its chromedriver (``$DENSEFIT_CHROMIUM`` and
    ``$DENSEFIT_CHROMEDRIVER`` first, then the PATH), or None when either is missing."""
    browser = os.environ.get("DENSEFIT_CHROMIUM") or next(
        filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
    )
    driver = os.environ.get("DENSEFIT_CHROMEDRIVER") or shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def start_chromium(window: tuple[int, int] = WINDOW):
    """A headless Chromium driven by selenium, logging the network (for
    :func:`requests_outside`). Raises RuntimeError(:data:`MISSING`) without the browser."""
    from selenium import webdriver  # the optional extra `test`
    from selenium.webdriver.chrome.service import Service  # the optional extra `test`

    paths = chromium_paths()
    if paths is None:
        raise RuntimeError(MISSING)
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in a container has no user namespace for the sandbox
        "--disable-dev-shm-usage",  # a small /dev/shm in containers crashes tabs
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",  # no update or safe-browsing requests in the log
        "--disable-component-update",
        f"--window-size={window[0]},{window[1]}",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # An explicit driver path: selenium's manager then downloads nothing.
    return webdriver.Chrome(options=options, service=Service(executable_path=paths[1]))


def requests_outside(driver, *origins: str) -> list[str]:
    """The URLs the page requested since the last call (the performance log is read and
    emptied) that are not ``file:``, ``data:``, ``blob:``, ``about:`` or under one of
    ``origins`` (``http://127.0.0.1:8000``)."""
    allowed = {_origin(o) for o in origins}
    outside = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") != "Network.requestWillBeSent":
            continue
        url = message["params"]["request"]["url"]
        scheme = urlsplit(url).scheme
        if scheme in ("file", "data", "blob", "about", "chrome", "devtools"):
            continue
        if _origin(url) not in allowed:
            outside.append(url)
    return outside


def screenshot(driver, path, *, max_height: int = 2400) -> None:
    """A PNG of the whole page (up to ``max_height`` pixels tall, below the window's bottom
    too) at the window's width, written to ``path``."""
    width, height = driver.execute_script(
        "const e = document.documentElement; return [e.clientWidth, e.scrollHeight]"
    )
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": min(height, max_height), "scale": 1},
        },
    )
    Path(path).write_bytes(base64.b64decode(shot["data"]))


@contextmanager
def serve_in_thread(app, host: str = "127.0.0.1") -> Iterator[str]:
    """``app`` (ASGI) under uvicorn on a free port of ``host``, in a thread of this process,
    its lifespan run; yields its URL and stops it after."""
    import uvicorn  # the optional extra `serve`

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start (its log says why)")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def _origin(url: str) -> str:
    """>>> _origin("http://127.0.0.1:8000/search?q=1")
    'http://127.0.0.1:8000'
    """
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"
