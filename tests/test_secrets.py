"""Secrets in a store target never leave the process: every command and the server, run with a
password in a PostgreSQL target (a real server that needs it), print and write the target
redacted (:func:`densefit.retrieval.index.registry.redacted`); Qdrant's and Milvus's keys
written in a target are masked in their errors. Everything printed (stdout, stderr, log
records, warnings) and every file written is searched for the secret."""

from __future__ import annotations

import json
import logging
import uuid
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from densefit.retrieval.index.registry import redacted
from densefit.testing.conformance import make_corpus

runner = CliRunner()
PASSWORD = "Pw7xSecretQz"  # letters and digits: the same text percent-encoded or not
SSL_PASSWORD = "Ssl9xSecretQk"
API_KEY = "Key4xSecretQv"
ROLE = "densefit_secret"


@pytest.fixture(scope="module")
def app():
    from densefit.cli.app import app

    return app


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A BEIR folder (corpus, queries, qrels) of a few documents."""
    folder = tmp_path_factory.mktemp("beir")
    docs = make_corpus(8)
    with open(folder / "corpus.jsonl", "w") as fh:
        for d in docs:
            fh.write(json.dumps({"_id": d.id, "title": "", "text": d.text}) + "\n")
    with open(folder / "queries.jsonl", "w") as fh:
        for i in range(0, 8, 2):
            fh.write(json.dumps({"_id": f"q{i}", "text": docs[i].text}) + "\n")
    (folder / "qrels").mkdir()
    rows = ["query-id\tcorpus-id\tscore"] + [f"q{i}\t{docs[i].id}\t1" for i in range(0, 8, 2)]
    (folder / "qrels" / "test.tsv").write_text("\n".join(rows) + "\n")
    return folder


@pytest.fixture(scope="module")
def secret_server(postgres_uri):
    """The test server's socket URI with a role that logs in with PASSWORD only (scram-sha-256
    for that role, put first in pg_hba.conf), so a target without the password fails."""
    import psycopg

    with psycopg.connect(postgres_uri, autocommit=True) as conn:
        conn.execute(f"DROP ROLE IF EXISTS {ROLE}")
        conn.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}'")
        database = conn.execute("SELECT current_database()").fetchone()[0]
        conn.execute(f"GRANT ALL ON DATABASE {database} TO {ROLE}")
        conn.execute(f"GRANT ALL ON SCHEMA public TO {ROLE}")
        hba = Path(conn.execute("SHOW hba_file").fetchone()[0])
        try:
            rules = hba.read_text()
            first = f"local all {ROLE} scram-sha-256\nhost all {ROLE} 127.0.0.1/32 scram-sha-256\n"
            hba.write_text(first + rules)
            conn.execute("SELECT pg_reload_conf()")
            needed = True
        except OSError:  # a server of DENSEFIT_TEST_POSTGRES: the password is given, not needed
            needed = False
    return postgres_uri, database, needed


def _target(server, form: str) -> str:
    """A new table's target for ROLE, its password as ``user:PASSWORD@`` or ``?password=``
    (and a secret ``sslpassword`` beside it either way)."""
    from urllib.parse import urlsplit

    uri, database, _ = server
    table = f"s_{uuid.uuid4().hex[:10]}"
    query = urlsplit(uri).query + f"&sslpassword={SSL_PASSWORD}"
    if form == "userinfo":
        return f"postgresql://{ROLE}:{PASSWORD}@/{database}/{table}?{query}"
    return f"postgresql://{ROLE}@/{database}/{table}?{query}&password={PASSWORD}"


class Shown:
    """Everything the commands of one test printed, logged or warned."""

    def __init__(self, app, caplog):
        self.app, self.caplog, self.texts = app, caplog, []

    def run(self, *args, code: int | tuple = 0):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = runner.invoke(self.app, [str(a) for a in args])
        self.texts += [result.stdout, result.stderr, *(str(w.message) for w in caught)]
        if result.exception and not isinstance(result.exception, SystemExit):
            raise result.exception
        codes = code if isinstance(code, tuple) else (code,)
        assert result.exit_code in codes, f"{args[0]}: {result.output}"
        return result

    def add(self, *texts) -> None:
        self.texts += [str(t) for t in texts]

    def assert_no_secret(self, *folders: Path, secrets=(PASSWORD, SSL_PASSWORD)) -> None:
        self.texts.append(self.caplog.text)
        for secret in secrets:
            for text in self.texts:
                assert secret not in text, text
            for folder in folders:
                for path in Path(folder).rglob("*"):
                    if path.is_file():
                        assert secret.encode() not in path.read_bytes(), path


def test_redacted_masks_every_secret_form():
    assert redacted("postgresql://me:pw@h/d/t?password=x&connect_timeout=3") == (
        "postgresql://me:***@h/d/t?password=***&connect_timeout=3"
    )
    for name in ("sslpassword", "api_key", "api-key", "apikey", "token", "access_token", "key"):
        assert redacted(f"qdrant://h:1/c?https=true&{name}=S") == (
            f"qdrant://h:1/c?https=true&{name}=***"
        )
    assert redacted("qdrant://S@h/c") == "qdrant://***@h/c"
    assert redacted("milvus://u:S@h/c") == "milvus://***@h/c"
    assert redacted("postgresql://me:a/b@h/d/t") == "postgresql://me:***@h/d/t"
    assert redacted("qdrant:///srv/a@b/q?collection=c") == "qdrant:///srv/a@b/q?collection=c"
    assert redacted("runs/store") == "runs/store"


@pytest.mark.parametrize("form", ["query", "userinfo"])
def test_no_command_prints_or_writes_a_postgresql_password(
    app, tiny_models, data, secret_server, tmp_path, caplog, form
):
    caplog.set_level(logging.DEBUG)
    shown = Shown(app, caplog)
    target, model, out = _target(secret_server, form), tiny_models / "tiny", tmp_path / "out"
    without = target.replace(f":{PASSWORD}@", "@").replace(f"&password={PASSWORD}", "")
    if secret_server[2]:  # the server needs the password (pg_hba.conf could be changed)
        refused = shown.run("search", "--store", without, "cells", code=(2, 3))
        assert "cannot connect" in refused.stderr and "password" in refused.stderr
    shown.run("index", data / "corpus.jsonl", "--model", model, "--store", target)
    assert redacted(target) in shown.texts[-1]  # the summary line names the store, redacted
    shown.run("index", data / "corpus.jsonl", "--store", target, "--json")
    shown.run("search", "--store", target, "cells divide", "-k", "3")
    shown.run("search", "--store", target, "cells divide", "--json")
    shown.run("search", "--store", target, "cells", "--filter", "meta.x ~ 1", code=2)
    queries, qrels = data / "queries.jsonl", data / "qrels" / "test.tsv"
    ran = shown.run(
        "eval", "--store", target, "--queries", queries, "--qrels", qrels,
        "--output", out / "eval.json", "--per-query",
    )  # fmt: skip
    assert redacted(target) in ran.stdout + ran.stderr  # the table header
    assert redacted(target) in (out / "eval.json").read_text()  # store_target: redacted
    shown.run("eval", "--store", target, "--queries", queries, "--qrels", qrels, "--json")
    shown.run("mine", data, "--split", "test", "--store", target, "--output", out / "mined.jsonl")
    copy = out / "copy"
    shown.run("index", "--from-store", target, "--store", copy)
    shown.run("index", "--from-store", copy, "--store", _target(secret_server, form), "--json")
    shown.run("reembed", "--store", target, "--model", tiny_models / "tiny-other")
    refused = shown.run("index", data / "corpus.jsonl", "--model", model, "--store", target, code=2)
    assert redacted(target) in refused.stderr  # another model: refused, naming the store
    _serve(shown, target, tiny_models / "tiny-other")
    shown.assert_no_secret(out, tmp_path)


def _serve(shown: Shown, target: str, model_path: Path) -> None:
    """Every route of ``densefit serve`` on the store, errors included."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from densefit.models import load_model
    from densefit.retrieval.index.engines import open_store
    from densefit.serve.app import create_app

    model = load_model(str(model_path))
    store = open_store(target, model)
    shown.add(store.info(), repr(store), store.location)
    with TestClient(create_app(store, model), raise_server_exceptions=False) as client:
        answers = [
            client.get("/health"),
            client.get("/metrics"),
            client.get("/openapi.json"),
            client.post("/search", json={"query": "cells", "k": 3}),
            client.post("/search", json={"query": "cells", "filters": {"bad": 1}}),
            client.post("/documents", json={"documents": [{"id": "new", "text": "genes"}]}),
            client.get("/documents/new"),
            client.get("/documents/missing"),
            client.delete("/documents", params={"ids": ["new"]}),
            client.get("/admin/reembed"),
            client.post("/embed", json={"texts": ["cells"]}),
        ]
    shown.add(*(f"{a.status_code} {dict(a.headers)} {a.text}" for a in answers))
    assert [a.status_code for a in answers[:4]] == [200, 200, 200, 200]
    assert answers[4].status_code == 400 and answers[6].status_code == 200


def test_a_refused_connection_names_the_target_redacted(app, tiny_models, tmp_path, caplog):
    """Errors that show a target (a wrong password, no server, a bad option) mask it; serve
    and index refuse with one line."""
    caplog.set_level(logging.DEBUG)
    shown = Shown(app, caplog)
    dead = f"postgresql://me:{PASSWORD}@127.0.0.1:9/db/docs?sslpassword={SSL_PASSWORD}"
    for command in (["search", "--store", dead, "cells"], ["serve", "--store", dead]):
        failed = shown.run(*command, code=(2, 3))
        assert redacted(dead) in failed.stderr and len(failed.stderr.strip().splitlines()) == 1
    for unread in (  # libpq quotes the token it cannot read
        f"postgresql://me:a%zz{PASSWORD}@127.0.0.1:9/db/docs",
        f"postgresql://me@127.0.0.1:9/db/docs?passwrd={PASSWORD}",
    ):
        failed = shown.run("search", "--store", unread, "cells", code=2)
        assert "not a PostgreSQL URL" in failed.stderr
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"_id": "a", "text": "cells"}) + "\n")
    shown.run("index", data, "--model", tiny_models / "tiny", "--store", dead, code=(2, 3))
    shown.assert_no_secret(tmp_path)


@pytest.mark.parametrize(
    "target",
    [
        f"qdrant://{API_KEY}@127.0.0.1:9/docs",
        f"qdrant://me:{API_KEY}@127.0.0.1:9/docs",
        f"qdrant://127.0.0.1:9/docs?api_key={API_KEY}",
        f"qdrant://127.0.0.1:9/docs?https=true&api-key={API_KEY}",
        f"milvus://{API_KEY}@127.0.0.1:9/docs",
        f"milvus://root:{API_KEY}@127.0.0.1:9/docs",
        f"milvus://127.0.0.1:9/docs?token={API_KEY}",
    ],
)
def test_a_key_written_in_a_qdrant_or_milvus_target_is_masked(app, target, caplog):
    """Qdrant and Milvus take their key from the environment, never from the target: a key
    written there is refused with one line that does not show it."""
    engine = target.split(":", 1)[0]
    pytest.importorskip("qdrant_client" if engine == "qdrant" else "pymilvus")
    shown = Shown(app, caplog)
    failed = shown.run("search", "--store", target, "cells", code=2)
    assert "***" in failed.stderr and len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    shown.assert_no_secret(secrets=(API_KEY,))


def test_a_qdrant_key_from_the_environment_is_never_shown(app, monkeypatch, caplog):
    """A Qdrant server that cannot be reached: the error names the target and the variable,
    never the key it holds."""
    pytest.importorskip("qdrant_client")
    monkeypatch.setenv("QDRANT_API_KEY", API_KEY)
    shown = Shown(app, caplog)
    failed = shown.run("search", "--store", "qdrant://127.0.0.1:9/docs", "cells", code=(2, 3))
    assert "QDRANT_API_KEY" in failed.stderr
    shown.assert_no_secret(secrets=(API_KEY,))


def test_a_haystack_store_serialises_a_secret_target_by_its_variable(secret_server, monkeypatch):
    """``to_dict`` (what a Haystack pipeline file holds) never writes the password: a plain
    target with one is refused in one line, a ``Secret.from_env_var`` target is written as
    the variable's name and reopens the same table."""
    from haystack import Document
    from haystack.utils import Secret

    from densefit.integrations.haystack import DensefitDocumentStore

    target = _target(secret_server, "userinfo")
    plain = DensefitDocumentStore(target, embedding_dim=3)
    with pytest.raises(ValueError, match=r"Secret\.from_env_var") as refused:
        plain.to_dict()
    assert PASSWORD not in str(refused.value) and redacted(target) in str(refused.value)

    monkeypatch.setenv("DENSEFIT_TEST_TARGET", target)
    store = DensefitDocumentStore(Secret.from_env_var("DENSEFIT_TEST_TARGET"), embedding_dim=3)
    store.write_documents([Document(content="a", embedding=[1.0, 0.0, 0.0])])
    data = store.to_dict()
    assert PASSWORD not in json.dumps(data) and SSL_PASSWORD not in json.dumps(data)
    assert data["init_parameters"]["path"]["env_vars"] == ["DENSEFIT_TEST_TARGET"]
    again = DensefitDocumentStore.from_dict(data)
    assert again.count_documents() == 1
    again.store.drop()
