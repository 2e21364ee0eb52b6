"""Every command on every engine: ``densefit index``, ``search``, ``eval``, ``mine`` and
``serve`` on the embedded store, PostgreSQL + pgvector (a real server, started by the
``postgres_uri`` fixture) and Qdrant (its local mode), each checked against the embedded
store's answers; the move of an embedded store into an engine (``densefit index
--from-store``); the one-line refusals of what an engine cannot do."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import STORE_ENGINES
from typer.testing import CliRunner

from densefit.retrieval.index import open_store
from densefit.retrieval.index.registry import ENGINES
from densefit.testing.conformance import make_corpus, with_meta

runner = CliRunner()


@pytest.fixture(params=STORE_ENGINES)
def engine(request) -> str:
    return request.param


@pytest.fixture
def target(new_target, engine) -> str:
    """A new store on each engine (tests/conftest.py's new_target)."""
    return new_target(engine)


@pytest.fixture(scope="module")
def app():
    from densefit.cli.app import app

    return app


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A corpus with metadata, queries and qrels, and training pairs, as files."""
    folder = tmp_path_factory.mktemp("data")
    docs = with_meta(make_corpus(40))
    with open(folder / "corpus.jsonl", "w") as fh:
        for d in docs:
            fh.write(json.dumps({"_id": d.id, "title": d.title, "text": d.text, "meta": d.meta}))
            fh.write("\n")
    with open(folder / "queries.jsonl", "w") as fh:
        for i in range(0, 40, 4):
            fh.write(json.dumps({"_id": f"q{i}", "text": docs[i].text}) + "\n")
    rows = ["query-id\tcorpus-id\tscore"] + [f"q{i}\t{docs[i].id}\t1" for i in range(0, 40, 4)]
    (folder / "qrels.tsv").write_text("\n".join(rows) + "\n")
    with open(folder / "pairs.jsonl", "w") as fh:
        for i in range(0, 40, 5):
            fh.write(json.dumps({"query": docs[i].text[:40], "positive": docs[i].text}) + "\n")
    return folder


def invoke(app, args, code: int = 0):
    result = runner.invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == code, result.output
    return result


def index(app, data, model, store, *extra):
    return invoke(app, ["index", data / "corpus.jsonl", "--model", model, "--store", store, *extra])


def search(app, store, *args) -> list:
    result = invoke(app, ["search", "--store", store, "--json", "-k", "5", *args])
    return [[(h["id"], round(h["score"], 4)) for h in q["hits"]] for q in json.loads(result.stdout)]


def test_index_search_eval_on_every_engine(app, tiny_models, data, target, tmp_path):
    model = tiny_models / "tiny"
    reference = tmp_path / "reference"
    index(app, data, model, reference)
    index(app, data, model, target, "--backend", "exact")
    again = index(app, data, model, target, "--json")  # resumes: nothing to embed
    assert json.loads(again.stdout)["report"]["unchanged"] == 40
    queries = ["cells genes", "python function", "vaccine memory"]
    for args in ([], ["--filter", '{"field": "meta.lang", "operator": "!=", "value": "de"}']):
        expected = search(app, reference, *queries, *args)
        assert search(app, target, *queries, "--backend", "exact", *args) == expected
    with open_store(target, create=False) as store:
        lexical, hybrid = store.capabilities.lexical, store.capabilities.hybrid
        assert store.get(["doc-0007"])[0].meta == with_meta(make_corpus(40))[7].meta
    if lexical:
        found = search(app, target, "banana cells", "--mode", "bm25")
        assert found[0] and all(h[0] for h in found[0])
    if hybrid:
        assert search(app, target, "banana cells", "--mode", "hybrid")[0]
    scores = []
    for store in (reference, target):
        result = invoke(
            app,
            ["eval", "--store", store, "--queries", data / "queries.jsonl"]
            + ["--qrels", data / "qrels.tsv", "--json", "--backend", "exact"],
        )
        scores.append(json.loads(result.stdout)["results"][0]["metrics"]["ndcg@10"])
    assert scores[0] == pytest.approx(scores[1], abs=1e-6) and scores[0] > 0.5


def test_mine_from_every_engine(app, tiny_models, data, target, tmp_path):
    model = tiny_models / "tiny"
    index(app, data, model, target)
    common = ["--method", "dense", "--num-negatives", "2", "--range", "0:6"]
    invoke(
        app, ["mine", data / "pairs.jsonl", "--store", target, "-o", tmp_path / "a.jsonl"] + common
    )
    invoke(
        app,
        ["mine", data / "pairs.jsonl", "--corpus", data / "corpus.jsonl", "--model", model]
        + ["-o", tmp_path / "b.jsonl"]
        + common,
    )
    mined = [
        [json.loads(line)["negative_ids"] for line in open(tmp_path / name)]
        for name in ("a.jsonl", "b.jsonl")
    ]
    assert mined[0] == mined[1] and all(len(n) == 2 for n in mined[0])


def test_move_an_embedded_store_into_every_engine(app, tiny_models, data, target, tmp_path):
    model = tiny_models / "tiny"
    folder = tmp_path / "embedded"
    index(app, data, model, folder)
    moved = invoke(app, ["index", "--from-store", folder, "--store", target, "--json"])
    report = json.loads(moved.stdout)["report"]
    assert (report["added"], report["encoded"]) == (40, 0)
    with open_store(folder, create=False) as source, open_store(target, create=False) as copy:
        ids = sorted(source.ids())
        assert sorted(copy.ids()) == ids
        assert copy.get(ids) == source.get(ids)  # text, title and metadata
        assert copy.record.same_vectors(source.record)
    queries = ["cells genes", "banana", "python search"]
    assert search(app, target, *queries, "--backend", "exact") == search(app, folder, *queries)
    again = invoke(app, ["index", "--from-store", folder, "--store", target, "--json"])
    assert json.loads(again.stdout)["report"]["unchanged"] == 40  # a second run resumes


def test_serve_on_every_engine(tiny_models, target):
    """The HTTP API over each engine; where the engine is shared, a second server on the same
    store sees the first one's writes (replicas behind a load balancer)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from densefit.models import load_model
    from densefit.serve.app import create_app

    model = load_model(str(tiny_models / "tiny"))
    docs = [{"id": d.id, "text": d.text, "meta": d.meta} for d in with_meta(make_corpus(12))]
    first = open_store(target, model)
    with TestClient(create_app(first, model)) as client:
        assert client.post("/documents", json={"documents": docs}).status_code == 200
        hits = client.post("/search", json={"query": docs[3]["text"], "k": 2}).json()
        assert hits["results"][0]["hits"][0]["id"] == docs[3]["id"]
        assert client.get(f"/documents/{docs[5]['id']}").json()["meta"] == docs[5]["meta"]
        if not first.capabilities.shared:
            return
        second = open_store(target, model)
        with TestClient(create_app(second, model)) as replica:
            assert replica.get("/health").json()["documents"] == 12
            client.request("DELETE", "/documents", json={"ids": [docs[0]["id"]]})
            extra = {"id": "late", "text": "banana vaccine memory", "meta": {}}
            client.post("/documents", json={"documents": [extra]})
            found = replica.post("/search", json={"query": extra["text"], "k": 1}).json()
            assert found["results"][0]["hits"][0]["id"] == "late"
            assert replica.get(f"/documents/{docs[0]['id']}").status_code == 404


def test_what_an_engine_cannot_do_is_one_line(app, tiny_models, data, target, new_target, engine):
    model = tiny_models / "tiny"
    index(app, data, model, target)
    with open_store(target, create=False) as store:
        capabilities = store.capabilities
    if not capabilities.model_swap:
        result = invoke(
            app, ["reembed", "--store", target, "--model", tiny_models / "tiny-other"], code=2
        )
        assert "cannot swap models" in result.output and "the embedded store" in result.output
    missing = [k for k in ("int8", "binary", "float16") if k not in capabilities.vector_kinds]
    if missing:
        result = invoke(
            app,
            ["index", data / "corpus.jsonl", "--model", model, "--store", new_target(engine)]
            + ["--vectors", missing[0]],
            code=2,
        )
        assert f"cannot store {missing[0]} vectors" in result.output


def test_docs_list_every_engines_capabilities():
    """docs/search.md's table is what the engines declare (regenerate it from
    densefit.retrieval.index.registry.capabilities_table when an engine changes)."""
    from densefit.retrieval.index.registry import capabilities_table

    docs = (Path(__file__).resolve().parents[1] / "docs" / "search.md").read_text()
    assert capabilities_table() in docs


# -- the contract: its size, its roles, its coverage by the conformance suite, its imports ------


def test_the_core_contract_fits_on_one_screen():
    from densefit.retrieval.index.base import ROLES, DocumentStore, members
    from densefit.retrieval.index.types import Capabilities

    assert len(members(DocumentStore)) <= 26  # 24 members and __enter__ / __exit__
    roles = [set(members(role)) for role in ROLES.values()]
    assert all(not (r & set(members(DocumentStore))) for r in roles)  # no member in two places
    assert set(ROLES) <= {f.name for f in dataclasses.fields(Capabilities)}


@pytest.mark.parametrize("name", list(ENGINES))
def test_each_engine_implements_the_core_and_the_roles_it_declares(name):
    """Read from the engine's store class, without a server: every member of the core and of
    each declared role is there, and a role not declared is refused (not half-implemented)."""
    from densefit.retrieval.index.base import ROLES, DocumentStore, members
    from densefit.retrieval.index.common import StoreCommon
    from densefit.retrieval.index.engines import engine_module
    from densefit.retrieval.index.registry import capabilities_of

    module = engine_module(name)
    (store_class,) = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, StoreCommon) and c.__module__ == module.__name__
    ]
    capabilities = capabilities_of(name)
    assert module.CAPABILITIES == capabilities and store_class.capabilities == capabilities
    wanted = members(DocumentStore) + [
        member
        for role, protocol in ROLES.items()
        if getattr(capabilities, role)
        for member in members(protocol)
    ]
    missing = [m for m in wanted if not hasattr(store_class, m) and m not in _INSTANCE_ATTRIBUTES]
    assert not missing, f"{store_class.__name__} lacks {missing}"


_INSTANCE_ATTRIBUTES = {"location"}  # set by each store's __init__


def test_a_command_needing_a_role_the_engine_lacks_is_refused_in_one_line(tmp_path):
    from densefit.retrieval.index.indexing import index_documents
    from densefit.retrieval.index.types import CapabilityError
    from densefit.testing import tiny_model

    model = tiny_model()
    with open_store(tmp_path / "s", model) as store:
        store.capabilities = dataclasses.replace(store.capabilities, reembedding=False)
        with pytest.raises(CapabilityError) as caught:
            index_documents(store, model, make_corpus(4), reembed=True)
        message = str(caught.value)
        assert "cannot re-embed its documents with new settings (--reembed)" in message
        able = [e for e, row in ENGINES.items() if row.capabilities.reembedding and e != "embedded"]
        assert all(f" {e}" in message for e in able) and message.endswith(" can")
        assert "\n" not in message
        assert store.count() == 0  # refused before anything was written
        report = index_documents(store, model, make_corpus(4))  # the core needs no role
        assert report.added == 4


def test_every_contract_member_is_exercised_by_the_conformance_suite(tmp_path):
    """The conformance suite runs on the embedded store (which declares every role) with a
    recorder on every member of the core and of the roles (tests/_contract_recorder.py):
    a member no conformance test uses from outside the store fails here."""
    from densefit.retrieval.index.base import ROLES, DocumentStore, members

    used = tmp_path / "used.json"
    tests = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]),
        "DENSEFIT_CONTRACT_CLASSES": ",".join(_RECORDED_CLASSES),
        "DENSEFIT_CONTRACT_USED": str(used),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "_contract_recorder"]
    command += ["-p", "no:cacheprovider", *(str(tests / f) for f in _RECORDED_FILES)]
    run = subprocess.run(command, env=env, cwd=tests.parent, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    wanted = set(members(DocumentStore))
    for protocol in ROLES.values():
        wanted.update(members(protocol))
    unused = sorted(wanted - set(json.loads(used.read_text())))
    assert not unused, (
        f"no conformance test uses {unused}: add one to densefit/testing/conformance.py"
    )


# The embedded store's conformance classes (StoreConformance, SwapConformance) the recorder runs.
_RECORDED_FILES = ("test_index_store.py", "test_swap.py")
_RECORDED_CLASSES = ("TestExactBackend", "TestEmbeddedSwap")


def test_importing_the_engine_registry_loads_no_model_framework():
    code = (
        "import sys, densefit.retrieval.index.engines, densefit.retrieval.index.registry\n"
        "heavy = sorted({'torch', 'sentence_transformers', 'transformers'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
        "from densefit.retrieval.index.registry import capabilities_table\n"
        "capabilities_table()\n"
        "assert 'torch' not in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_no_import_circle_in_retrieval():
    """No module of densefit/retrieval/ reaches itself again by imports: at module level, in
    functions (STYLE.md: a function-level import never dodges a circle), or by name through
    importlib (engines.py loads the engine modules, which must not import it back)."""
    root = Path(__file__).resolve().parents[1] / "densefit" / "retrieval"
    graph = import_graph(root, "densefit.retrieval")
    assert graph["densefit.retrieval.index.engines"] >= {"densefit.retrieval.index.qdrant"}
    assert find_circles(graph) == []


def test_the_circle_finder_sees_function_level_and_importlib_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import x\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('pkg.a')\n")
    (pkg / "d.py").write_text("from pkg import a\n")  # into the circle, not part of it
    graph = import_graph(pkg, "pkg")
    assert find_circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, read from every import statement
    (any level, TYPE_CHECKING blocks too) and every ``importlib.import_module("name")``; a
    call with a computed name counts as importing every engine module of the registry
    (engines.py's way of loading them)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = (
            ".".join((package, *parts[:-1]))
            if parts[-1] == "__init__"
            else ".".join((package, *parts))
        )
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
                found.add(node.module)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
            ):
                argument = node.args[0] if node.args else None
                if isinstance(argument, ast.Constant):
                    found.add(argument.value)
                else:
                    found.update(engine.module for engine in ENGINES.values())
        graph[name] = {
            m for m in found if m in modules and m != name and not name.startswith(m + ".")
        }
    return graph


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each strongly connected set of two or more modules,
    sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def _factory(dim):
    from densefit.retrieval.index.vectors import ExactBackend

    return ExactBackend()


@pytest.mark.parametrize(
    ("asked", "refusal"),
    [
        ({"similarity": "euclidean"}, "similarity 'euclidean' is not supported"),
        ({"backend": "annoy"}, "cannot search by 'annoy'"),
        ({"backend": _factory}, "searches with its own index: pass backend="),
    ],
    ids=["euclidean", "unknown-backend", "backend-factory"],
)
@pytest.mark.parametrize("engine", [*STORE_ENGINES, "milvus"])
def test_what_no_store_of_the_engine_can_do_is_refused_in_one_line_before_anything_is_made(
    engine, asked, refusal, new_target, tmp_path
):
    import numpy as np

    from densefit.retrieval.index.types import NoStoreError, StoreError, StoreRecord

    if engine == "embedded" and asked.get("backend") is _factory:
        pytest.skip("the embedded store's own vector search takes a backend factory")
    if engine == "milvus":
        pytest.importorskip("pymilvus", reason="pymilvus is not installed (densefit[milvus])")
        pytest.importorskip("milvus_lite", reason="milvus-lite is not installed")
        target = f"milvus:{tmp_path}/m.db"
    else:
        target = new_target(engine)
    similarity = asked.get("similarity", "cosine")
    record = StoreRecord("random", 8, similarity, "float32", np.zeros((3, 8), np.float32), None)
    with pytest.raises(StoreError) as caught:
        open_store(target, record=record, backend=asked.get("backend"))
    message = str(caught.value)
    assert "\n" not in message and refusal in message
    with pytest.raises(NoStoreError):
        open_store(target, create=False)  # nothing was made
