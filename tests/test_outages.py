"""Outages of a store's engine, on real servers on 127.0.0.1: an unreachable engine is the
machine's fault (HTTP 503 with ``Retry-After``, exit 3, one line), never the client's, and
everything heals when the engine is back, with nothing acknowledged lost.

- a PostgreSQL server of the test's own (``densefit.testing.postgres.stoppable_postgres``)
  stopped and started again on the same port: under a running ``densefit serve`` process,
  in the middle of a bulk ``densefit index`` and of a model swap (``densefit reembed``);
- a Milvus server (Milvus Lite's gRPC server as a process of its own,
  ``densefit.testing.servers.MilvusServer``) stopped and started again under ``densefit
  serve``;
- a loopback server that accepts connections and never answers, and a port where nothing
  listens (``densefit.testing.servers``), as PostgreSQL, Qdrant and Milvus server targets:
  ``densefit search`` and ``index`` end within the target's timeout with one line, exit 3.

Qdrant's local mode and Milvus Lite's file are in the process itself: no outage to have.
No Qdrant server runs here (it is not a Python package): its server targets are covered by
the loopback servers only.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from densefit.testing import WORDS
from densefit.testing.postgres import postgres_target, stoppable_postgres
from densefit.testing.servers import (
    closed_port,
    densefit_serve,
    silent_server,
)

httpx = pytest.importorskip("httpx")
psycopg = pytest.importorskip("psycopg")

# seconds: the first 503 after the engine stops, the first 200 after it is back (the server
# connects again at its next call), a command's wait on a target that never answers beyond
# the target's own timeout (what the command does around it: loading a model, reading a
# file; under the engines' default timeouts of 10 s)
OUTAGE_SEEN, BACK_SEEN, TIMEOUT_SLACK = 10.0, 30.0, 4.0
HANG_GUARD = 240  # a command that hangs fails the test after this many seconds


@pytest.fixture(scope="module")
def pg_server():
    """One stoppable PostgreSQL for the module (its folder not under pytest's: run as root,
    the wheel's server runs as another user)."""
    import shutil

    folder = tempfile.mkdtemp(prefix="densefit-outages-")
    try:
        with stoppable_postgres(folder) as server:
            yield server
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def pg(pg_server):
    """The module's PostgreSQL, running again after each test whatever the test did."""
    yield pg_server
    if not pg_server.running:
        pg_server.start()


def corpus(n: int, tag: str = "") -> list[dict]:
    """``n`` small documents of the tiny model's words, each text different."""
    rows = []
    for i in range(n):
        words = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(24))
        rows.append({"_id": f"{tag}d{i:05d}", "title": "", "text": f"{words} {i}"})
    return rows


def write_corpus(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def count_rows(uri: str, table: str) -> int:
    """Rows of ``table`` (0 while it does not exist)."""
    with psycopg.connect(uri, autocommit=True, connect_timeout=5) as conn:
        try:
            return conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
        except psycopg.errors.UndefinedTable:
            return 0


def stored_ids(uri: str, table: str) -> list[str]:
    with psycopg.connect(uri, autocommit=True, connect_timeout=5) as conn:
        return [r[0] for r in conn.execute(f'SELECT id FROM "{table}" ORDER BY id')]


def vector_tables(uri: str, table: str) -> dict[int, int]:
    """{generation: rows} of the store's vector tables (``TABLE_vN``)."""
    with psycopg.connect(uri, autocommit=True, connect_timeout=5) as conn:
        names = [
            r[0]
            for r in conn.execute(
                "SELECT relname FROM pg_class WHERE relkind = 'r' AND relname ~ %s",
                (f"^{re.escape(table)}_v[0-9]+$",),
            )
        ]
        return {
            int(n.rsplit("_v", 1)[1]): conn.execute(f'SELECT count(*) FROM "{n}"').fetchone()[0]
            for n in names
        }


def the_one_line(stderr: str) -> str:
    """The command's error line: exactly one ``error:`` line and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def stop_when(pg, proc: subprocess.Popen, ready: Callable[[], bool], what: str) -> None:
    """Stop ``pg`` as soon as ``ready()`` holds; fails when ``proc`` ended first."""
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline:
        if ready():
            pg.stop()
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the command ended (exit {proc.returncode}) before {what}:\n{err}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"no {what} within {HANG_GUARD} s")


def invoke(args: list[str]):
    """``densefit ARGS`` in this process (the CLI's own error handler; no interpreter to
    start) within a hang guard: (click's result, seconds)."""
    from typer.testing import CliRunner

    from densefit.cli.app import app

    result: dict = {}

    def run() -> None:
        started = time.monotonic()
        result["run"] = CliRunner().invoke(app, args)
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD)
    assert not thread.is_alive(), f"densefit {' '.join(args)} still runs after {HANG_GUARD} s"
    return result["run"], result["seconds"]


def densefit_process(args: list[str]) -> subprocess.Popen:
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "densefit", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# -- a running server --------------------------------------------------------------------------


def until(request: Callable[[], httpx.Response], status: int, seconds: float, passing=(200,)):
    """Send ``request`` every 50 ms until it answers ``status``: (the answer, seconds
    waited). Any status other than ``status`` and ``passing`` fails at once (a 400 for an
    outage is the client's fault, the bug this guards against)."""
    started = time.monotonic()
    while True:
        try:
            answer = request()
        except httpx.TimeoutException:
            pytest.fail(f"no answer within the client's timeout while waiting for {status}")
        waited = time.monotonic() - started
        if answer.status_code == status:
            return answer, waited
        assert answer.status_code in passing, (answer.status_code, answer.text)
        assert waited < seconds, f"still {answer.status_code} after {seconds} s: {answer.text}"
        time.sleep(0.05)


def assert_unavailable(answer: httpx.Response) -> None:
    """A 503 with a Retry-After of whole seconds and one line naming the target."""
    assert answer.status_code == 503, (answer.status_code, answer.text)
    assert re.fullmatch(r"[1-9][0-9]*", answer.headers.get("retry-after", "")), answer.headers
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and "127.0.0.1" in detail, detail


def test_serve_answers_503_while_postgresql_is_down_and_200_once_it_is_back(
    pg, tiny_models, model, tmp_path, record_property
):
    target = postgres_target(pg.uri, "served")
    seed(target, model, corpus(40))
    times = serve_through_an_outage(pg, target, tiny_models / "tiny", 40, tmp_path)
    for name, seconds in times.items():
        record_property(name, seconds)
    print(f"PostgreSQL: {times}")


def test_serve_answers_503_while_a_milvus_server_is_down_and_200_once_it_is_back(
    tiny_models, model, tmp_path, record_property
):
    """A Milvus server (Milvus Lite's, as a process of its own) stopped and started again on
    its port and data. The store is made through Milvus Lite's file: densefit asks a server
    for the "whitespace" analyzer, which Milvus Lite's server lacks."""
    pytest.importorskip("pymilvus")
    pytest.importorskip("milvus_lite")
    from densefit.testing.servers import MilvusServer

    data = tmp_path / "milvus" / "store.db"
    data.parent.mkdir()
    seed(f"milvus:{data}", model, corpus(40))
    server = MilvusServer(tmp_path / "milvus", data=data)
    server.start()
    try:
        target = server.target("densefit")
        times = serve_through_an_outage(server, target, tiny_models / "tiny", 40, tmp_path)
    finally:
        server.stop()
    for name, seconds in times.items():
        record_property(name, seconds)
    print(f"Milvus: {times}")


def seed(target: str, model, rows: list[dict]) -> None:
    from densefit.retrieval.index import open_store

    docs = _documents(rows)
    with open_store(target, model) as store:
        store.write(docs, model.encode([d.text for d in docs]))


def serve_through_an_outage(server, target: str, model_path, n: int, tmp_path) -> dict:
    """``densefit serve`` on ``target`` (``n`` documents) while ``server`` (``stop()``,
    ``start()``) is stopped and started again: 503 with Retry-After on the store's routes and
    /health, /embed 200; then 200 again, the same answers, writes taken, the same process.
    The seconds to the first 503 and back to the first 200."""
    query = {"query": corpus(n)[3]["text"], "k": 5}
    with densefit_serve(target, model_path, log=tmp_path / "serve.log") as served:
        client = httpx.Client(base_url=served.url, timeout=20)
        before = client.post("/search", json=query)
        assert before.status_code == 200, before.text
        assert client.get("/health").json()["documents"] == n

        server.stop()
        health, to_503 = until(lambda: client.get("/health"), 503, OUTAGE_SEEN)
        assert_unavailable(health)
        assert_unavailable(client.post("/search", json=query))
        added = {"documents": [{"id": "during", "text": "cells and genes"}]}
        assert_unavailable(client.post("/documents", json=added))
        embedded = client.post("/embed", json={"inputs": "cells"})
        assert embedded.status_code == 200, embedded.text  # the model needs no store

        server.start()
        health, to_200 = until(lambda: client.get("/health"), 200, BACK_SEEN, passing=(503,))
        assert health.json()["documents"] == n  # the refused write was not written
        after = client.post("/search", json=query)
        assert after.status_code == 200, f"a search once the engine is back: {after.text}"
        assert after.json() == before.json()
        assert client.post("/documents", json=added).status_code == 200
        assert client.get("/documents/during").status_code == 200
        assert served.proc.poll() is None  # the same process throughout
    return {"seconds_to_503": round(to_503, 2), "seconds_to_200": round(to_200, 2)}


def _documents(rows: list[dict]):
    from densefit.data.types import Document

    return [Document(r["_id"], r["text"], r["title"]) for r in rows]


# -- a bulk load and a model swap --------------------------------------------------------------


def test_a_bulk_index_stopped_by_an_outage_says_so_and_resumes_with_every_document_once(
    pg, tiny_models, tmp_path
):
    rows = corpus(2000)
    path = write_corpus(tmp_path / "corpus.jsonl", rows)
    target = postgres_target(pg.uri, "bulk")
    args = ["index", str(path), "--model", str(tiny_models / "tiny"), "--store", target,
            "--commit-every", "100", "--json"]  # fmt: skip
    proc = densefit_process(args)
    seen = 0

    def first_commits() -> bool:
        nonlocal seen
        seen = count_rows(pg.uri, "bulk")
        return seen > 0

    stop_when(pg, proc, first_commits, "a first commit")
    out, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 3, (proc.returncode, err)
    line = the_one_line(err)
    assert "127.0.0.1" in line and "PostgreSQL" in line, line
    # what was committed, and that the same command resumes from it
    assert "committed" in line and "resume" in line, f"says nothing of the commits: {line}"

    pg.start()
    committed = count_rows(pg.uri, "bulk")
    assert seen <= committed < len(rows)  # every acknowledged commit is there
    done, _ = invoke(args)  # the same command (in this process: no interpreter to start)
    assert done.exit_code == 0, (done.output, done.exception)
    report = json.loads(done.stdout)["report"]
    # it resumed: what was committed is skipped, the rest added
    assert (report["unchanged"], report["added"]) == (committed, len(rows) - committed)
    assert stored_ids(pg.uri, "bulk") == sorted(r["_id"] for r in rows)  # each exactly once


def test_a_model_swap_stopped_by_an_outage_says_so_and_resumes_to_the_new_model(
    pg, tiny_models, model, tmp_path
):
    from densefit.models import load_model
    from densefit.retrieval.index import open_store

    rows = corpus(2000, tag="s")
    target = postgres_target(pg.uri, "swapped")
    seed(target, model, rows)
    live = max(vector_tables(pg.uri, "swapped"))
    args = ["reembed", "--store", target, "--model", str(tiny_models / "tiny-other"),
            "--commit-every", "50", "--json"]  # fmt: skip
    proc = densefit_process(args)
    seen = 0

    def next_vectors() -> bool:
        nonlocal seen
        seen = vector_tables(pg.uri, "swapped").get(live + 1, 0)
        return seen > 0

    stop_when(pg, proc, next_vectors, "the new model's first vectors")
    out, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 3, (proc.returncode, err)
    line = the_one_line(err)
    assert "127.0.0.1" in line and "PostgreSQL" in line, line

    pg.start()
    made = vector_tables(pg.uri, "swapped")[live + 1]
    assert seen <= made < len(rows)
    with open_store(target) as store:  # still serving the old model
        assert store.model_name == str(tiny_models / "tiny")
    done, _ = invoke(args)  # the same command (in this process: no interpreter to start)
    assert done.exit_code == 0, (done.output, done.exception)
    report = json.loads(done.stdout)
    assert report["resumed"] and report["switched"], report
    assert report["embedded"] == len(rows) - made  # went on from the vectors written
    other = load_model(str(tiny_models / "tiny-other"))
    with open_store(target, other) as store:
        assert store.model_name == str(tiny_models / "tiny-other")
        assert store.count() == len(rows)
        query = other.encode([rows[5]["text"]])
        assert store.search(query, top_k=1)[0][0].id == rows[5]["_id"]
    assert vector_tables(pg.uri, "swapped") == {live + 1: len(rows)}


# -- a server that never answers, a port where nothing listens ---------------------------------

TARGETS = {
    "postgresql": "postgresql://me@127.0.0.1:{port}/search/docs?connect_timeout={timeout}",
    "qdrant": "qdrant://127.0.0.1:{port}/docs?timeout={timeout}",
    "milvus": "milvus://127.0.0.1:{port}/docs?timeout={timeout}",
}
TIMEOUT = 2


def _ends_in_one_line(args: list[str]) -> float:
    """``densefit ARGS`` (:func:`invoke`) ends with exit 3 and one line naming the target;
    the seconds it took."""
    run, seconds = invoke(args)
    assert run.exit_code == 3, (run.exit_code, run.output, run.exception)
    line = the_one_line(run.stderr)
    assert "127.0.0.1" in line, line
    return seconds


@pytest.mark.parametrize("engine", list(TARGETS))
def test_a_target_that_never_answers_or_refuses_ends_in_one_line_and_exit_3(
    engine, tiny_models, tmp_path
):
    pytest.importorskip({"postgresql": "psycopg", "qdrant": "qdrant_client",
                         "milvus": "pymilvus"}[engine])  # fmt: skip
    path = write_corpus(tmp_path / "corpus.jsonl", corpus(5))
    refused = TARGETS[engine].format(port=closed_port(), timeout=TIMEOUT)
    _ends_in_one_line(["search", "--store", refused, "cells"])  # (and the imports made)
    with silent_server() as port:
        target = TARGETS[engine].format(port=port, timeout=TIMEOUT)
        search = _ends_in_one_line(["search", "--store", target, "cells"])
        index = _ends_in_one_line(
            ["index", str(path), "--model", str(tiny_models / "tiny"), "--store", target]
        )
    print(f"{engine}: search {search:.1f} s, index {index:.1f} s on a server that never answers")
    assert search < TIMEOUT + TIMEOUT_SLACK and index < TIMEOUT + TIMEOUT_SLACK, (search, index)


def test_real_processes_on_a_target_that_never_answers_exit_within_its_timeout():
    """The processes themselves end (no thread of a client library keeps one alive); one
    per engine, at once."""
    with silent_server() as port:
        procs = {
            engine: densefit_process(
                ["search", "--store", form.format(port=port, timeout=TIMEOUT), "cells"]
            )
            for engine, form in TARGETS.items()
        }
        try:
            for engine, proc in procs.items():
                _, err = proc.communicate(timeout=HANG_GUARD)
                assert proc.returncode == 3, (engine, proc.returncode, err)
                assert "127.0.0.1" in the_one_line(err), err
        finally:
            for proc in procs.values():
                proc.kill()
