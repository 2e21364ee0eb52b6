"""The curl commands of docs/serving.md, run verbatim (but for the port) against a live
``densefit serve``: each gets a 2xx; the same body without its Content-Type gets a 415 that
says how to send JSON."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
if shutil.which("curl") is None:
    pytest.skip("curl is not installed", allow_module_level=True)

from test_serve import corpus, start_server  # noqa: E402

from densefit.retrieval.index import index_documents, open_store  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
# Each curl call prints its body, then its status on a line of its own.
_CURL = 'curl() { command curl "$@" -w "\\nSTATUS %{http_code}\\n"; }\n'


def curl_blocks() -> list[str]:
    """The fenced bash blocks of docs/serving.md that call curl."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.S)
    return [b for b in blocks if re.search(r"(^|[;\s])curl ", b)]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    from densefit.models import load_model

    path = tmp_path_factory.mktemp("curl") / "store"
    model = load_model(str(tiny_models / "tiny"))
    with open_store(path, model) as store:
        index_documents(store, model, corpus(20))
    proc, url = start_server(path, tiny_models / "tiny")
    yield url
    proc.kill()
    proc.wait(10)


def run_shell(script: str, url: str) -> str:
    port = url.rsplit(":", 1)[1]
    script = script.replace("localhost:8000", f"localhost:{port}")
    done = subprocess.run(
        ["bash", "-c", _CURL + script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_documented_curl_command_succeeds(server):
    blocks = curl_blocks()
    assert blocks, "docs/serving.md has no curl examples"
    for block in blocks:
        calls = len(re.findall(r"(^|[;\n]\s*)curl ", block))
        out = run_shell(block, server)
        statuses = re.findall(r"^STATUS (\d{3})$", out, flags=re.M)
        assert len(statuses) == calls, (block, out)
        assert all(s.startswith("2") for s in statuses), out
    assert "/v1/embeddings" in "".join(blocks) and "/embed" in "".join(blocks)


def test_a_body_not_declared_json_gets_415_saying_how_to_send_it(server):
    for command in (
        """curl -s localhost:8000/search -d '{"query": "vitamin D"}'""",  # form-encoded
        """curl -s -X DELETE localhost:8000/documents -d '{"ids": ["n1"]}'""",
        """curl -s localhost:8000/v1/embeddings -H 'Content-Type: text/plain' -d '{"input": "x"}'""",
    ):
        out = run_shell(command, server)
        assert out.rstrip().endswith("STATUS 415"), out
        assert "Content-Type: application/json" in out and "--json" in out, out
    # curl's own shorthand (7.82+) sets the header
    out = run_shell("""curl -s localhost:8000/search --json '{"query": "vitamin D"}'""", server)
    assert out.rstrip().endswith("STATUS 200"), out
