"""`densefit index | search | eval` round trips through typer's CliRunner, offline, tiny model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from densefit.testing.conformance import make_corpus

runner = CliRunner()


@pytest.fixture(scope="module")
def app():
    from densefit.cli.app import app

    return app


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    docs = make_corpus(30)
    with open(folder / "corpus.jsonl", "w") as fh:
        for d in docs:
            fh.write(
                json.dumps({"_id": d.id, "title": d.title, "text": d.text[len(d.title) + 1 :]})
                + "\n"
            )
    queries = {f"q{i}": docs[i].text for i in range(0, 30, 3)}
    with open(folder / "queries.jsonl", "w") as fh:
        for q, text in queries.items():
            fh.write(json.dumps({"_id": q, "text": text}) + "\n")
    (folder / "qrels").mkdir()
    rows = ["query-id\tcorpus-id\tscore"] + [f"q{i}\t{docs[i].id}\t1" for i in range(0, 30, 3)]
    (folder / "qrels" / "test.tsv").write_text("\n".join(rows) + "\n")
    return folder


def invoke(app, args):
    result = runner.invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_round_trip_index_search_eval(app, tiny_models, data, tmp_path):
    store = tmp_path / "store"
    model = tiny_models / "tiny"
    result = invoke(
        app,
        [
            "index",
            data / "corpus.jsonl",
            "--model",
            model,
            "--store",
            store,
            "--encode-batch-size",
            8,
            "--commit-every",
            10,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "30 added" in result.stderr and "30 documents" in result.stderr

    again = invoke(
        app, ["index", data, "--model", model, "--store", store, "--json", "--no-progress"]
    )
    report = json.loads(again.stdout)["report"]
    assert (report["unchanged"], report["added"]) == (30, 0)  # the BEIR folder, same corpus

    docs = make_corpus(30)
    hits = json.loads(
        invoke(
            app, ["search", "--store", store, docs[4].text, docs[9].text, "-k", 3, "--json"]
        ).stdout
    )
    assert [h["hits"][0]["id"] for h in hits] == [docs[4].id, docs[9].id]
    assert len(hits[0]["hits"]) == 3 and hits[0]["hits"][0]["rank"] == 1

    table = invoke(app, ["search", "--store", store, docs[4].text, "-k", 2])
    assert table.exit_code == 0 and docs[4].id in table.stdout and "score" in table.stdout

    evaluated = invoke(
        app,
        [
            "eval",
            "--store",
            store,
            "--queries",
            data / "queries.jsonl",
            "--qrels",
            data / "qrels" / "test.tsv",
            "--json",
            "--no-progress",
            "--output",
            tmp_path / "eval.json",
        ],
    )
    assert evaluated.exit_code == 0, evaluated.output
    payload = json.loads(evaluated.stdout)
    assert payload["results"][0]["metrics"]["ndcg@10"] == pytest.approx(1.0)
    assert json.loads((tmp_path / "eval.json").read_text()) == payload


def test_eval_dataset_compare(app, tiny_models, data):
    result = invoke(
        app,
        [
            "eval",
            "--dataset",
            data,
            "--model",
            tiny_models / "tiny",
            "--compare",
            tiny_models / "tiny-other",
            "--metrics",
            "ndcg@10,mrr@10",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "delta" in result.stdout and "wins/losses" in result.stdout
    as_json = invoke(
        app,
        [
            "eval",
            "--dataset",
            data,
            "--model",
            tiny_models / "tiny",
            "--compare",
            tiny_models / "tiny-other",
            "--json",
            "--no-progress",
        ],
    )
    payload = json.loads(as_json.stdout)
    assert len(payload["results"]) == 2 and "ndcg@10" in payload["comparison"]


def test_eval_says_which_mode_and_runtime_it_searched_with(app, tiny_models, data, tmp_path):
    """`--runtime auto` takes an export where there is one: the table's caption says so, for
    each model, and which mode searched."""
    pytest.importorskip("onnxruntime")
    import shutil

    model = tmp_path / "exported"
    shutil.copytree(tiny_models / "tiny", model)
    assert invoke(app, ["export", model, "--to", "onnx", "--no-progress"]).exit_code == 0
    args = ["eval", "--dataset", data, "--model", model, "--compare", tiny_models / "tiny"]
    result = invoke(app, [*args, "--no-progress"])
    assert result.exit_code == 0, result.output
    caption = " ".join(result.stdout.split())  # the caption as one line, however it wrapped
    assert "dense search; embedded by torch (tiny), onnx (onnx/model.onnx) (exported)" in caption
    bm25 = invoke(app, [*args, "--mode", "bm25", "--no-progress"])
    assert "bm25 search" in " ".join(bm25.stdout.split()) and "embedded" not in bm25.stdout


def test_other_formats_prune_and_bad_rows(app, tiny_models, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_corpus(12)
    pq.write_table(
        pa.table({"id": [d.id for d in docs], "text": [d.text for d in docs]}),
        tmp_path / "c.parquet",
    )
    store = tmp_path / "store"
    model = tiny_models / "tiny"
    assert (
        invoke(app, ["index", tmp_path / "c.parquet", "--model", model, "--store", store]).exit_code
        == 0
    )
    csv = tmp_path / "c.csv"
    csv.write_text("id,text\n" + "".join(f"{d.id},{d.text}\n" for d in docs[:5]) + "bad-row,\n")
    failed = invoke(app, ["index", csv, "--model", model, "--store", store])
    assert (
        failed.exit_code == 2
        and "c.csv:7" in failed.stderr
        and "--on-bad-row skip" in failed.stderr
    )
    pruned = invoke(
        app,
        [
            "index",
            csv,
            "--model",
            model,
            "--store",
            store,
            "--on-bad-row",
            "skip",
            "--prune",
            "--json",
        ],
    )
    assert pruned.exit_code == 0, pruned.output
    out = json.loads(pruned.stdout)
    assert out["report"]["pruned"] == 7 and out["store"]["documents"] == 5
    assert len(out["read"]["skipped"]) == 1


def test_errors_are_one_clear_line(app, tiny_models, data, tmp_path):
    missing = invoke(app, ["search", "--store", tmp_path / "nope", "cells"])
    assert missing.exit_code == 2 and "densefit index CORPUS" in missing.stderr

    store = tmp_path / "store"
    invoke(app, ["index", data, "--model", tiny_models / "tiny", "--store", store, "--no-progress"])
    mismatch = invoke(
        app, ["search", "--store", store, "cells", "--model", tiny_models / "tiny-other"]
    )
    assert mismatch.exit_code == 2 and "does not reproduce" in mismatch.stderr
    reindex = invoke(app, ["index", data, "--model", tiny_models / "tiny-other", "--store", store])
    assert reindex.exit_code == 2 and "NEW_DIR" in reindex.stderr

    usage = invoke(app, ["eval", "--store", store])
    assert usage.exit_code == 2 and "--dataset BEIR_DIR" in usage.stderr
    compare = invoke(
        app,
        [
            "eval",
            "--store",
            store,
            "--queries",
            data / "queries.jsonl",
            "--qrels",
            data / "qrels" / "test.tsv",
            "--compare",
            "x",
        ],
    )
    assert compare.exit_code == 2 and "--compare needs --dataset" in compare.stderr
    bad_metric = invoke(
        app, ["eval", "--dataset", data, "--model", tiny_models / "tiny", "--metrics", "f1"]
    )
    assert bad_metric.exit_code == 2 and "ndcg@K" in bad_metric.stderr
    no_corpus = invoke(
        app,
        [
            "index",
            tmp_path / "none.jsonl",
            "--model",
            tiny_models / "tiny",
            "--store",
            tmp_path / "s2",
        ],
    )
    assert no_corpus.exit_code == 2 and "none.jsonl" in no_corpus.stderr


def test_search_uses_the_recorded_model_or_explains(app, tmp_path, data):
    from densefit.retrieval.index import open_store
    from densefit.testing import tiny_model

    open_store(tmp_path / "s", tiny_model(tmp_path / "m")).close()  # name "tiny-bert-32x2"
    result = invoke(app, ["search", "--store", tmp_path / "s", "cells"])
    assert result.exit_code == 2 and "pass --model" in result.stderr
    # eval --store takes the store's model the same way (model_for_store)
    qrels = data / "qrels" / "test.tsv"
    result = invoke(
        app,
        ["eval", "--store", tmp_path / "s", "--queries", data / "queries.jsonl", "--qrels", qrels],
    )
    assert result.exit_code == 2 and "pass --model" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_interrupted_index_says_how_to_resume(app, tiny_models, data, tmp_path, monkeypatch):
    import densefit.jobs

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(densefit.jobs, "index_documents", interrupted)
    result = invoke(
        app, ["index", data, "--model", tiny_models / "tiny", "--store", tmp_path / "s"]
    )
    assert result.exit_code == 130 and "run the same command again to resume" in result.stderr


def test_index_with_other_settings_is_refused_or_reembedded(app, tiny_models, data, tmp_path):
    store = tmp_path / "store"
    model = tiny_models / "tiny"
    first = invoke(app, ["index", data, "--model", model, "--store", store, "--no-progress"])
    assert first.exit_code == 0, first.output
    refused = invoke(
        app,
        ["index", data, "--model", model, "--store", store, "--max-seq-length", 8],
    )
    assert refused.exit_code == 2
    lines = [x for x in refused.stderr.splitlines() if x.strip() and "Loading weights" not in x]
    assert len(lines) == 1 and lines[0].startswith("error:")  # one line, no traceback
    message = lines[0]
    assert "max_seq_length=64" in message and "--reembed" in message
    reembedded = invoke(
        app,
        ["index", data, "--model", model, "--store", store, "--max-seq-length", 8]
        + ["--reembed", "--json", "--no-progress"],
    )
    assert reembedded.exit_code == 0, reembedded.output
    out = json.loads(reembedded.stdout)
    assert out["report"]["reembedded"] == 30 and out["report"]["encoded"] == 30
    assert out["store"]["max_seq_length"] == 8 and out["store"]["prompts"] == {}
    again = invoke(
        app,
        ["index", data, "--model", model, "--store", store, "--max-seq-length", 8, "--json"],
    )
    assert json.loads(again.stdout)["report"]["unchanged"] == 30


def _beir_with_bad_rows(data, folder):
    """A copy of ``data`` with a judgment of an unknown document (qrels line 3) and a
    query without text (queries.jsonl line 2)."""
    import shutil

    shutil.copytree(data, folder)
    qrels = folder / "qrels" / "test.tsv"
    lines = qrels.read_text().splitlines()
    lines.insert(2, "q3\tno-such-doc\t1")
    qrels.write_text("\n".join(lines) + "\n")
    queries = (folder / "queries.jsonl").read_text().splitlines()
    queries.insert(1, json.dumps({"_id": "q-empty", "text": ""}))
    (folder / "queries.jsonl").write_text("\n".join(queries) + "\n")
    return folder, qrels


def test_eval_reports_every_skipped_row(app, tiny_models, data, tmp_path):
    folder, qrels = _beir_with_bad_rows(data, tmp_path / "beir")
    queries = folder / "queries.jsonl"
    strict = invoke(app, ["eval", "--dataset", folder, "--model", tiny_models / "tiny"])
    assert strict.exit_code == 2 and f"{queries}:2" in strict.stderr
    args = ["eval", "--dataset", folder, "--model", tiny_models / "tiny", "--on-bad-row", "skip"]
    as_json = invoke(app, args + ["--json", "--no-progress"])
    assert as_json.exit_code == 0, as_json.output
    skipped = json.loads(as_json.stdout)["results"][0]["skipped_rows"]
    assert [origin for origin, _ in skipped] == [f"{queries}:2", f"{qrels}:3"]
    assert "no-such-doc" in skipped[1][1]
    table = invoke(app, args + ["--no-progress"])
    assert table.exit_code == 0, table.output
    flat = " ".join(table.stdout.split())  # the caption may wrap
    assert "2 bad rows skipped" in flat and f"{qrels}:3".replace(" ", "") in flat.replace(" ", "")
    assert f"{qrels}:3" in table.stderr.replace("\n", "")


def test_eval_of_a_store_reports_skipped_rows_too(app, tiny_models, data, tmp_path):
    folder, qrels = _beir_with_bad_rows(data, tmp_path / "beir")
    store = tmp_path / "store"
    invoke(app, ["index", data, "--model", tiny_models / "tiny", "--store", store, "--no-progress"])
    args = ["eval", "--store", store, "--queries", folder / "queries.jsonl", "--qrels", qrels]
    strict = invoke(app, args)
    assert strict.exit_code == 2 and "queries.jsonl:2" in strict.stderr
    skipped_run = invoke(app, args + ["--on-bad-row", "skip", "--json", "--no-progress"])
    assert skipped_run.exit_code == 0, skipped_run.output
    result = json.loads(skipped_run.stdout)["results"][0]
    assert [origin for origin, _ in result["skipped_rows"]] == [f"{folder}/queries.jsonl:2"]
    # q3's judgment of an unknown document is no bad row here: the store is not the corpus
    assert result["n_queries"] == 10 and "q-empty" not in result["missing_queries"]


def test_int8_store_searched_by_every_mode(app, tiny_models, data, tmp_path):
    """`index --vectors int8`, then `search --mode dense|bm25|hybrid` (and `eval --mode`)."""
    store = tmp_path / "int8"
    model = tiny_models / "tiny"
    indexed = invoke(
        app,
        ["index", data, "--model", model, "--store", store, "--vectors", "int8", "--json",
         "--no-progress"],
    )  # fmt: skip
    assert indexed.exit_code == 0, indexed.output
    assert json.loads(indexed.stdout)["store"]["vectors"] == "int8"
    docs = make_corpus(30)
    query = docs[7].text
    found = {}
    for mode in ("dense", "bm25", "hybrid"):
        result = invoke(app, ["search", "--store", store, query, "--mode", mode, "-k", 5, "--json"])
        assert result.exit_code == 0, result.output
        (answer,) = json.loads(result.stdout)
        found[mode] = [hit["id"] for hit in answer["hits"]]
        assert len(found[mode]) == 5, (mode, answer)
    assert found["bm25"][0] == docs[7].id  # its own words find it first
    assert docs[7].id in found["hybrid"]
    weighted = invoke(
        app,
        ["search", "--store", store, query, "--mode", "hybrid", "--fusion", "weighted",
         "--dense-weight", "0", "--rescore", 2, "-k", 5, "--json"],
    )  # fmt: skip
    assert weighted.exit_code == 0, weighted.output
    # all weight on BM25: the BM25 ranking (ties aside), first of all its best document
    assert json.loads(weighted.stdout)[0]["hits"][0]["id"] == found["bm25"][0]
    table = invoke(app, ["search", "--store", store, query, "--mode", "hybrid", "-k", 3])
    assert table.exit_code == 0 and docs[7].id in table.stdout, table.output

    scored = {}
    for mode in ("dense", "bm25", "hybrid"):
        result = invoke(
            app,
            ["eval", "--store", store, "--queries", data / "queries.jsonl", "--qrels",
             data / "qrels" / "test.tsv", "--mode", mode, "--metrics", "recall@10", "--json",
             "--no-progress"],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        (scored[mode],) = json.loads(result.stdout)["results"]
        assert scored[mode]["info"]["mode"] == mode and scored[mode]["info"]["vectors"] == "int8"
    assert scored["bm25"]["metrics"]["recall@10"] == 1.0  # each query is its document's text


def test_bad_mode_is_one_line_exit_2(app, tiny_models, data, tmp_path):
    store = tmp_path / "store"
    result = runner.invoke(app, ["search", "--store", str(store), "x", "--mode", "lexical"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines == ["error: --mode must be one of dense, bm25, hybrid, got 'lexical'"], lines


def _corpus_file(path, rows):
    """A JSONL corpus of ``rows`` ``(id, text, meta)``; ``json.dumps`` writes a float NaN as
    ``NaN``, which the corpus reader refuses."""
    path.write_text(
        "".join(json.dumps({"_id": i, "text": t, "metadata": m}) + "\n" for i, t, m in rows)
    )
    return path


ENGINES = ("embedded", "postgresql", "qdrant", "milvus")


@pytest.fixture
def engine_target(new_target, tmp_path):
    """``engine_target(engine)``: a new store's target on ``engine``, Milvus Lite's too."""

    def make(engine: str) -> str:
        if engine != "milvus":
            return new_target(engine)
        pytest.importorskip("pymilvus", reason="pymilvus is not installed (densefit[milvus])")
        pytest.importorskip("milvus_lite", reason="milvus-lite is not installed")
        return f"milvus:{tmp_path}/m.db"

    return make


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("refused_at", [1, 3])
def test_a_refused_index_leaves_no_store(
    app, tiny_models, tmp_path, engine_target, engine, refused_at
):
    """A corpus refused before anything was committed (its only row, or a later row of the
    first commit) leaves no store behind on any engine, so the corrected corpus indexes with
    another model."""
    from densefit.retrieval.index.engines import open_store
    from densefit.retrieval.index.types import NoStoreError

    target = engine_target(engine)
    rows = [(f"d{i}", f"text number {i}", {"v": i}) for i in range(1, refused_at)]
    bad = _corpus_file(tmp_path / "bad.jsonl", [*rows, ("nan", "a text", {"v": float("nan")})])
    refused = invoke(app, ["index", bad, "--model", tiny_models / "tiny", "--store", target])
    assert refused.exit_code == 2 and f"bad.jsonl:{refused_at}" in refused.stderr, refused.output
    with pytest.raises(NoStoreError):
        open_store(target, create=False)
    good = _corpus_file(tmp_path / "good.jsonl", [*rows, ("ok", "a text", {"v": 0.5})])
    other = tiny_models / "tiny-other"
    indexed = invoke(app, ["index", good, "--model", other, "--store", target])
    assert indexed.exit_code == 0, indexed.output
    with open_store(target, create=False) as store:
        assert store.count() == refused_at and store.model_name == str(other)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_refused_index_keeps_a_store_that_held_data(
    app, tiny_models, tmp_path, engine_target, engine
):
    from densefit.retrieval.index.engines import open_store

    target, model = engine_target(engine), tiny_models / "tiny"
    good = _corpus_file(tmp_path / "good.jsonl", [("a", "cells divide", {}), ("b", "genes", {})])
    assert invoke(app, ["index", good, "--model", model, "--store", target]).exit_code == 0
    bad = _corpus_file(tmp_path / "bad.jsonl", [("c", "more", {"v": float("nan")})])
    refused = invoke(app, ["index", bad, "--model", model, "--store", target])
    assert refused.exit_code == 2, refused.output
    with open_store(target, create=False) as store:
        assert store.count() == 2 and store.get(["a"])[0].text == "cells divide"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failed_copy_into_a_new_store_leaves_none(
    app, tiny_models, tmp_path, engine_target, engine, monkeypatch
):
    """``index --from-store`` into a new target that fails before a document is copied
    leaves no store there."""
    import densefit.jobs
    from densefit.retrieval.index.engines import open_store
    from densefit.retrieval.index.types import NoStoreError

    source, target = tmp_path / "source", engine_target(engine)
    good = _corpus_file(tmp_path / "good.jsonl", [("a", "cells divide", {})])
    model = tiny_models / "tiny"
    assert invoke(app, ["index", good, "--model", model, "--store", source]).exit_code == 0

    def refused(*args, **kwargs):
        raise ValueError("refused by the test")

    monkeypatch.setattr(densefit.jobs, "copy_documents", refused)
    failed = invoke(app, ["index", "--from-store", source, "--store", target])
    assert failed.exit_code == 2 and "refused by the test" in failed.stderr, failed.output
    with pytest.raises(NoStoreError):
        open_store(target, create=False)


@pytest.mark.parametrize("engine", ENGINES)
def test_serve_create_that_cannot_start_leaves_no_store(
    app, tiny_models, engine_target, engine, monkeypatch
):
    """``serve --create`` whose port is taken stops before a store is made; one whose app
    fails to start drops the store it made."""
    import socket

    import densefit.serve.server
    from densefit.retrieval.index.engines import open_store
    from densefit.retrieval.index.types import NoStoreError

    target, model = engine_target(engine), tiny_models / "tiny"
    args = ["serve", "--store", target, "--create", "--model", model, "--no-ui"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        taken = invoke(app, [*args, "--port", port])
    assert taken.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    with pytest.raises(NoStoreError):
        open_store(target, create=False)

    def fail(*_, **__):
        raise ValueError("the app cannot start")

    monkeypatch.setattr(densefit.serve.server, "create_app", fail)
    failed = invoke(app, [*args, "--port", "0"])
    assert failed.exit_code == 2 and "the app cannot start" in failed.stderr, failed.output
    with pytest.raises(NoStoreError):
        open_store(target, create=False)
