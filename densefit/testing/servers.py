"""Servers a test starts, stops and starts again, all on 127.0.0.1: ``densefit serve`` as a
real process, a Milvus Lite server as a process of its own, and the two ends of a network
outage (a port where nothing listens, a server that accepts connections and never answers).

- :func:`densefit_serve`: ``python -m densefit serve ...`` on a free port, yielding once
  ``GET /health`` answers 200, killed when the block ends (its output in a log file);
- :class:`MilvusServer` (:func:`milvus_server`): ``python -m milvus_lite server`` on a free
  port; ``stop()`` ends it (SIGINT: it closes its data), ``start()`` runs it again on the
  same port and data;
- :func:`silent_server`: a port that accepts connections and never sends a byte (a hung
  server, a firewall that drops replies);
- :func:`closed_port`: a port where nothing listens (connections refused).

PostgreSQL's stoppable server is :func:`densefit.testing.postgres.stoppable_postgres`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MilvusServer",
    "ServeProcess",
    "closed_port",
    "densefit_serve",
    "free_port",
    "milvus_server",
    "run_densefit",
    "silent_server",
]

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def closed_port() -> int:
    """A port of 127.0.0.1 where nothing listens: a connection to it is refused."""
    return free_port()


@contextmanager
def silent_server() -> Iterator[int]:
    """A server on 127.0.0.1 that accepts every connection and never answers (nor closes
    it); yields its port. Connections are closed when the block ends."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(64)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            held.append(conn)  # read nothing, send nothing

    thread = threading.Thread(target=accept, name="silent-server", daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join(5)
        listener.close()
        for conn in held:
            conn.close()


def _wait(what: str, ready, proc: subprocess.Popen, log: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{log.read_text()}")
        if ready():
            return
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise AssertionError(f"{what} did not start in {seconds:.0f} s:\n{log.read_text()}")


def _stopped(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


@dataclass
class ServeProcess:
    """A running ``densefit serve``: its process, base URL and log file."""

    proc: subprocess.Popen
    url: str
    log: Path


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


@contextmanager
def densefit_serve(
    store: str, model: str | os.PathLike, *extra: str, log: Path, start_seconds: float = 300
) -> Iterator[ServeProcess]:
    """``python -m densefit serve --store STORE --model MODEL EXTRA...`` on a free port of
    127.0.0.1 (one thread per library, no API key), its output in ``log``; yields once
    ``GET /health`` answers 200 and kills it when the block ends."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("DENSEFIT_API_KEY", None)
    command = [sys.executable, "-m", "densefit", "serve", "--store", store, "--model",
               str(model), "--host", HOST, "--port", str(port), *extra]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    try:
        _wait("densefit serve", lambda: _status(f"{url}/health") == 200, proc, log, start_seconds)
        yield ServeProcess(proc, url, log)
    finally:
        _stopped(proc)


class MilvusServer:
    """Milvus Lite's gRPC server as a process of its own (``python -m milvus_lite server``)
    on 127.0.0.1, its data in ``data`` (default ``folder/data``: a ``milvus:FILE.db``
    store's ``FILE.db`` serves too), its log in ``folder``; stopped and started again on the
    same port and data. Its target: ``milvus://127.0.0.1:PORT/COLLECTION``."""

    def __init__(
        self, folder: str | os.PathLike, port: int | None = None, data: str | os.PathLike = ""
    ):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.data = Path(data or self.folder / "data")
        self.port = port or free_port()
        self.log = self.folder / "server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def target(self, collection: str) -> str:
        return f"milvus://{HOST}:{self.port}/{collection}"

    def start(self, seconds: float = 120) -> None:
        """Start the server and wait until its port accepts connections."""
        command = [sys.executable, "-m", "milvus_lite", "server", "--data-dir",
                   str(self.data), "--host", HOST, "--port", str(self.port)]  # fmt: skip
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex((HOST, self.port)) == 0

        _wait("the Milvus Lite server", listening, self.proc, self.log, seconds)

    def stop(self) -> None:
        """End the server as Ctrl-C does (it closes its data) and wait; killed after 30 s."""
        if not self.running:
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            _stopped(self.proc)


@contextmanager
def milvus_server(folder: str | os.PathLike) -> Iterator[MilvusServer]:
    """A started :class:`MilvusServer`, stopped when the block ends; skips (inside pytest)
    without milvus-lite."""
    try:
        import milvus_lite  # noqa: F401 - only to know it is there
    except ImportError:
        import pytest  # a test's skip: only without the extra

        pytest.skip("milvus-lite is not installed: pip install 'densefit[milvus]'")
    server = MilvusServer(folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def run_densefit(args: Sequence[str], *, timeout: float, env: dict | None = None):
    """``python -m densefit ARGS`` (one thread per library) with a hang guard of ``timeout``
    seconds: a :class:`subprocess.CompletedProcess` with text output, and its
    ``seconds``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "densefit", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    done.seconds = time.monotonic() - started  # type: ignore[attr-defined]
    return done
