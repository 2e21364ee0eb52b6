"""A store whose engine cannot be reached is the engine's fault, not the client's: ``densefit
serve`` answers 503 with ``Retry-After`` on the routes that use the store, ``/health`` included
(and 200 again once the engine answers, no restart), ``/embed`` keeps answering, a client error
stays 4xx; the command line exits 3 with one line, soon, on every engine.

The engines' real outages (PostgreSQL stopped under a running server) are tests/test_faults.py's;
here the store's calls fail as an unreachable engine's do, and the targets name a loopback
port nobody listens on, or one that accepts and never answers.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from densefit.cli import app as cli_app  # noqa: E402
from densefit.data.types import Document  # noqa: E402
from densefit.retrieval.index import LocalDocumentStore, index_documents, open_store  # noqa: E402
from densefit.retrieval.index.types import StoreError, StoreUnavailableError  # noqa: E402
from densefit.serve.app import create_app  # noqa: E402
from densefit.serve.config import ServeConfig  # noqa: E402

DOWN = "postgresql://app:***@127.0.0.1:5999/db/docs: PostgreSQL is unreachable (connection refused)"


class FlakyStore(LocalDocumentStore):
    """An embedded store whose reads and writes fail as an unreachable engine's do while
    ``fault`` is set (an exception to raise), and hang while ``hang`` is cleared."""

    fault: Exception | None = None
    hang: threading.Event | None = None
    resume_after = 0.0  # seconds a hung call still takes once the hang ends

    def _call(self, name, *args, **kwargs):
        if self.hang is not None:
            self.hang.wait()
            time.sleep(self.resume_after)
        if self.fault is not None:
            raise self.fault
        return getattr(super(), name)(*args, **kwargs)

    def count(self):
        return self._call("count")

    def search(self, *args, **kwargs):
        return self._call("search", *args, **kwargs)

    def get(self, *args, **kwargs):
        return self._call("get", *args, **kwargs)

    def write(self, *args, **kwargs):
        return self._call("write", *args, **kwargs)

    def delete(self, *args, **kwargs):
        return self._call("delete", *args, **kwargs)


@pytest.fixture
def flaky(tmp_path, model):
    path = tmp_path / "store"
    with open_store(path, model) as store:
        docs = [Document(f"d{i}", f"cells and genes {i}", meta={"n": i}) for i in range(12)]
        index_documents(store, model, docs)
    return FlakyStore(path)


def test_unreachable_store_is_503_with_retry_after_and_health_heals(flaky, model):
    with TestClient(create_app(flaky, model, ServeConfig())) as client:
        assert client.get("/health").status_code == 200
        flaky.fault = StoreUnavailableError(DOWN)
        answers = {
            "/search": client.post("/search", json={"query": "cells", "k": 3}),
            "/health": client.get("/health"),
            "/documents/d1": client.get("/documents/d1"),
            "/documents": client.post("/documents", json={"documents": [{"id": "n", "text": "x"}]}),
        }
        for route, answer in answers.items():
            assert answer.status_code == 503, (route, answer.text)
            assert answer.headers["Retry-After"] == "5", route  # ServeConfig's default
            body = answer.json()
            assert body["detail"] == DOWN and "\n" not in body["detail"], (route, body)
        embedded = client.post("/embed", json={"inputs": "cells"})
        assert embedded.status_code == 200 and len(embedded.json()[0]) == 32
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        assert "densefit_store_up 0" in metrics.text
        assert 'densefit_errors_total{kind="store_unavailable"} 4' in metrics.text
        assert 'densefit_requests_total{route="/health",method="GET",status="503"} 1' in (
            metrics.text
        )

        flaky.fault = None  # the engine is back: no restart
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["documents"] == 12
        assert client.post("/search", json={"query": "cells", "k": 3}).status_code == 200
        assert "densefit_store_up 1" in client.get("/metrics").text


def test_retry_after_is_the_configured_one(flaky, model):
    flaky.fault = StoreUnavailableError(DOWN)
    with TestClient(create_app(flaky, model, ServeConfig(retry_after=17))) as client:
        assert client.get("/health").headers["Retry-After"] == "17"


def test_client_errors_stay_4xx(flaky, model):
    with TestClient(create_app(flaky, model, ServeConfig())) as client:
        bad = {"field": "meta.n", "operator": "~~", "value": 1}
        answer = client.post("/search", json={"query": "cells", "filters": bad})
        assert answer.status_code == 400 and "Retry-After" not in answer.headers
        flaky.fault = StoreError("docs: collection 'docs' is gone")  # the store's, not the engine's
        answer = client.post("/search", json={"query": "cells", "k": 3})
        assert answer.status_code == 400 and "Retry-After" not in answer.headers


def test_a_hung_store_cannot_hang_the_health_check(flaky, model):
    config = ServeConfig(health_timeout=0.5)
    with TestClient(create_app(flaky, model, config)) as client:
        flaky.hang = threading.Event()  # the engine accepts and never answers
        flaky.resume_after = 0.2  # once it answers again, the hung question takes a while
        try:
            for _ in range(2):  # the second check shares the question still waiting
                start = time.monotonic()
                answer = client.get("/health")
                assert answer.status_code == 503 and answer.headers["Retry-After"] == "5"
                assert "has not answered" in answer.json()["detail"]
                assert time.monotonic() - start < 3
            assert client.get("/metrics").status_code == 200
        finally:
            flaky.hang.set()
        flaky.hang = None
        # a check that comes while the hung question is still finishing waits for its answer
        assert client.get("/health").status_code == 200


# -- the command line -----------------------------------------------------------------------


def _closed_port() -> int:
    """A loopback port nobody listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_server():
    """A loopback server that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield server.getsockname()[1]
    server.close()


def _targets(port: int, timeout: str) -> dict[str, str]:
    return {
        "postgresql": f"postgresql://app:s3cret@127.0.0.1:{port}/db/docs?connect_timeout={timeout}",
        "qdrant": f"qdrant://127.0.0.1:{port}/docs?timeout={timeout}",
        "milvus": f"milvus://127.0.0.1:{port}/docs?timeout={timeout}",
    }


def _search(target: str) -> tuple[int, str, float]:
    start = time.monotonic()
    result = CliRunner().invoke(cli_app, ["search", "--store", target, "cells"])
    return result.exit_code, result.output, time.monotonic() - start


@pytest.mark.parametrize("engine", ["postgresql", "qdrant", "milvus"])
def test_cli_exits_3_with_one_line_when_the_server_is_down(engine):
    pytest.importorskip(
        {"postgresql": "psycopg", "qdrant": "qdrant_client"}.get(engine, "pymilvus")
    )
    port = _closed_port()
    code, output, seconds = _search(_targets(port, "10")[engine])
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 3, output
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    assert "s3cret" not in output and f"127.0.0.1:{port}" in output, output
    assert seconds < 8, f"{engine}: {seconds:.1f} s to say the server is down"  # refused at once


@pytest.mark.parametrize("engine", ["postgresql", "qdrant", "milvus"])
def test_cli_gives_up_on_a_server_that_never_answers_within_its_timeout(engine, silent_server):
    pytest.importorskip(
        {"postgresql": "psycopg", "qdrant": "qdrant_client"}.get(engine, "pymilvus")
    )
    code, output, seconds = _search(_targets(silent_server, "1")[engine])
    assert code == 3, output
    assert len([line for line in output.splitlines() if line.strip()]) == 1, output
    assert seconds < 8, f"{engine}: {seconds:.1f} s with a 1 s timeout"


def test_wrong_database_or_password_stays_a_client_error():
    """A refused login or an unknown database is the target's fault: exit 2, not 3."""
    psycopg = pytest.importorskip("psycopg")
    from densefit.retrieval.index import pgvector

    refused = psycopg.OperationalError('FATAL:  database "nope" does not exist')
    error = pgvector._cannot_connect("postgresql://u:***@h/nope/docs", refused)
    assert type(error) is StoreError and "createdb nope" in str(error)
    lost = psycopg.OperationalError("connection to server failed: Connection refused")
    assert isinstance(
        pgvector._cannot_connect("postgresql://h/db/docs", lost), StoreUnavailableError
    )


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("qdrant://127.0.0.1/docs?timeout=0", "timeout must be a number of seconds above 0"),
        ("qdrant://127.0.0.1/docs?timeout=soon", "timeout must be a number of seconds above 0"),
        ("milvus://127.0.0.1/docs?timeout=-1", "timeout must be a number of seconds above 0"),
    ],
)
def test_a_bad_timeout_in_the_target_is_refused(target, message):
    result = CliRunner().invoke(cli_app, ["search", "--store", target, "cells"])
    assert result.exit_code == 2 and message in result.output, result.output


# -- each engine's table: unreachable or refused --------------------------------------------


@pytest.mark.parametrize(("status", "unavailable"), [(503, True), (502, True), (400, False)])
def test_a_qdrant_server_that_is_busy_is_unavailable_one_that_refuses_is_not(status, unavailable):
    pytest.importorskip("qdrant_client")
    import httpx
    from qdrant_client.http.exceptions import UnexpectedResponse

    from densefit.retrieval.index import qdrant

    target = qdrant.parse_target("qdrant://127.0.0.1:6333/docs")
    answer = UnexpectedResponse(status, "x", b"{}", httpx.Headers())
    error = qdrant._server_error(target, answer)
    assert isinstance(error, StoreUnavailableError) is unavailable
    assert (
        target.timeout == 10
        and qdrant.parse_target(f"{target.location}?timeout=2.5").timeout == 2.5
    )


def test_milvus_connection_failures_are_unavailable_refusals_are_not():
    pytest.importorskip("pymilvus")
    from pymilvus.exceptions import MilvusException, ParamError

    from densefit.retrieval.index import milvus

    assert milvus._is_unreachable(MilvusException(2, "Fail connecting to server on 127.0.0.1:1"))
    assert milvus._is_unreachable(MilvusException(1, "[search] Retry timeout: 10s, message=x"))
    assert not milvus._is_unreachable(ParamError(message="invalid collection name"))
    assert not milvus._is_unreachable(ValueError("not pymilvus's"))
    assert milvus.parse_target("milvus://127.0.0.1/docs?timeout=3").timeout == 3


def test_postgresql_outage_is_unavailable_and_the_first_call_after_it_succeeds(tmp_path, model):
    """Stopped: a call is a StoreUnavailableError. Stopped and started again while the store
    sat idle: its connection is dead though nothing has noticed yet, and the first call
    after the outage answers (the store replaces the dropped connection first)."""
    pytest.importorskip("psycopg")
    from densefit.testing.postgres import postgres_target, stoppable_postgres

    with stoppable_postgres(tmp_path) as server:
        store = open_store(postgres_target(server.uri, "docs"), model)
        try:
            index_documents(store, model, [Document("a", "cells"), Document("b", "genes")])
            server.stop()
            with pytest.raises(StoreUnavailableError, match="127.0.0.1"):
                store.count()
            server.start()
            assert store.count() == 2
            server.stop()  # an outage nobody called the store through
            server.start()
            assert store.count() == 2
            assert store.search(query_texts=["cells"], mode="bm25", top_k=1)[0][0].id == "a"
        finally:
            store.close()
