"""Query/document prompts (issue 15.3): the right texts in training, mining, indexing, search
and evaluation; saved in the model where sentence-transformers reads them; recorded by stores."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import typer
from sentence_transformers import SentenceTransformer
from typer.testing import CliRunner

from densefit.config.train import TrainConfig
from densefit.data.types import Document, TrainingExample
from densefit.prompts import model_prompts, set_prompts
from densefit.retrieval.encode import configure_model, encode_texts
from densefit.retrieval.index.engines import open_store
from densefit.retrieval.index.indexing import index_documents
from densefit.retrieval.index.searching import search_batch
from densefit.retrieval.index.types import SettingsMismatchError
from densefit.training.loop import train
from densefit.training.setup import setup_run
from densefit.training.step import train_step

PROMPTS = {"query_prompt": "query: ", "document_prompt": "passage: "}
ROWS = [
    TrainingExample(f"what is cell {i}", f"cell {i} is a unit", (f"python {i}", f"java {i}"))
    for i in range(4)
]
DOCS = [Document(f"d{i}", f"document {i} about " + "cells " * i) for i in range(6)]
QUERIES = ["cells cells", "document 3"]


def columns_seen(model, config) -> list[list[str]]:
    """The texts one training step hands to the encoder, column by column."""
    run = setup_run(model, ROWS, config)
    seen = []
    inner = run.strategy.forward_backward

    def spy(model, columns, loss_fn, **kwargs):
        seen.extend(columns)
        return inner(model, columns, loss_fn, **kwargs)

    run.strategy.forward_backward = spy
    train_step(run, [list(range(len(ROWS)))])
    return seen


def test_training_puts_each_prompt_before_its_columns(tiny):
    config = TrainConfig(batch_size=4, show_progress=False, **PROMPTS)
    anchors, positives, negatives = columns_seen(tiny, config)
    assert anchors == [f"query: {r.query}" for r in ROWS]
    assert positives == [f"passage: {r.positive}" for r in ROWS]
    assert negatives == [f"passage: {n}" for r in ROWS for n in r.negatives]


def test_a_models_own_prompts_are_the_default_and_empty_turns_them_off(tiny):
    tiny.prompts = {"query": "q: ", "passage": "p: "}  # an E5-style saved config
    anchors, positives, _ = columns_seen(tiny, TrainConfig(batch_size=4, show_progress=False))
    assert anchors[0] == f"q: {ROWS[0].query}" and positives[0] == f"p: {ROWS[0].positive}"
    off = TrainConfig(batch_size=4, show_progress=False, query_prompt="", document_prompt="")
    anchors, positives, _ = columns_seen(tiny, off)
    assert anchors[0] == ROWS[0].query and positives[0] == ROWS[0].positive


def test_a_trained_model_saves_its_prompts_for_sentence_transformers(tiny, tmp_path):
    config = TrainConfig(batch_size=4, show_progress=False, keep_checkpoints=0, **PROMPTS)
    train(tiny, ROWS, config, output_dir=tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config_sentence_transformers.json").read_text())
    assert saved["prompts"]["query"] == "query: " and saved["prompts"]["document"] == "passage: "
    loaded = SentenceTransformer(str(tmp_path / "out"), device="cpu")
    ours = encode_texts(loaded, QUERIES, prompt_name="query")
    theirs = loaded.encode(QUERIES, prompt_name="query")
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    unprompted = loaded.encode(QUERIES)
    assert not np.allclose(theirs, unprompted, atol=1e-3)  # the prompt changes the vector


def test_search_scores_equal_sentence_transformers_with_the_prompts(tiny):
    model = configure_model(copy.deepcopy(tiny), **PROMPTS)
    store = open_store(None, model)
    index_documents(store, model, DOCS)
    hits = search_batch(store, model, QUERIES, top_k=len(DOCS))
    q = model.encode(QUERIES, prompt_name="query", normalize_embeddings=True)
    d = model.encode_document([doc.text for doc in DOCS], normalize_embeddings=True)
    expected = q @ d.T  # (queries, docs): sentence-transformers' cosine with the prompts
    for i, per_query in enumerate(hits):
        got = {h.id: h.score for h in per_query}
        want = {doc.id: float(expected[i, j]) for j, doc in enumerate(DOCS)}
        assert got == pytest.approx(want, abs=1e-5)
    plain = model.encode(QUERIES, normalize_embeddings=True)
    assert not np.allclose(plain, q, atol=1e-3)


def test_the_store_records_the_prompts_and_refuses_others(tiny, tmp_path):
    model = configure_model(copy.deepcopy(tiny), **PROMPTS)
    with open_store(tmp_path / "store", model) as store:
        index_documents(store, model, DOCS)
    with open_store(tmp_path / "store", tiny) as store:
        assert store.settings.prompts == {"query": "query: ", "document": "passage: "}
        assert store.info()["prompts"] == store.settings.prompts
        with pytest.raises(SettingsMismatchError, match="prompts"):
            search_batch(store, tiny, QUERIES)  # no prompts: refused
        with pytest.raises(SettingsMismatchError, match="prompts"):
            index_documents(store, tiny, DOCS[:1])


def test_set_prompts_keeps_none_and_clears_with_empty(tiny):
    assert model_prompts(tiny) == {}
    assert set_prompts(tiny, query="q: ") == {"query": "q: "}
    assert set_prompts(tiny, document="d: ") == {"query": "q: ", "document": "d: "}
    assert set_prompts(tiny, query="") == {"document": "d: "}


def test_mining_embeds_queries_and_documents_with_their_prompts(tiny, monkeypatch):
    import densefit.mine as mine
    from densefit.mine import mine_hard_negatives

    calls = []
    real = mine.encode_texts

    def spy(model, texts, **kwargs):
        calls.append(kwargs.get("prompt_name"))
        return real(model, texts, **kwargs)

    monkeypatch.setattr(mine, "encode_texts", spy)
    model = configure_model(copy.deepcopy(tiny), **PROMPTS)
    pairs = [TrainingExample(f"cells {i}", DOCS[i].text) for i in range(3)]
    mine_hard_negatives(
        pairs, DOCS, method="dense", model=model, num_negatives=1, range_min=0, range_max=3,
        show_progress=False,
    )  # fmt: skip
    assert calls[0] == "document" and set(calls[1:]) == {"query"}


def test_planner_counts_the_prompt_tokens(tiny):
    from densefit.memory.planner import probe_run

    def longest(**prompts):
        config = TrainConfig(batch_size=4, **prompts)  # as `densefit plan` gets them
        return probe_run(copy.deepcopy(tiny), ROWS, config, None, 100, None).longest

    plain, prompted = longest(), longest(query_prompt="a long query prompt: ", document_prompt="")
    assert prompted["anchors"] > plain["anchors"]
    assert prompted["positives"] == plain["positives"]


@pytest.fixture
def cli(tmp_path):
    from densefit.cli import eval as eval_command
    from densefit.cli import index as index_command
    from densefit.testing import tiny_model

    app = typer.Typer()
    index_command.register(app)
    eval_command.register(app)
    tiny_model(tmp_path / "build").save(str(tmp_path / "tiny"))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": d.id, "text": d.text}) + "\n" for d in DOCS))
    return app, tmp_path


def test_cli_index_records_the_prompts_and_search_reuses_them(cli):
    app, tmp = cli
    runner = CliRunner()
    args = ["index", tmp / "corpus.jsonl", "--model", tmp / "tiny", "--store", tmp / "store"]
    args += ["--query-prompt", "query: ", "--document-prompt", "passage: ", "--no-progress"]
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["search", "--store", str(tmp / "store"), "cells", "--json"])
    assert result.exit_code == 0, result.output
    model = configure_model(SentenceTransformer(str(tmp / "tiny"), device="cpu"), **PROMPTS)
    store = open_store(tmp / "store", model)
    expected = search_batch(store, model, ["cells"])[0]
    got = json.loads(result.stdout)[0]["hits"]
    assert [h["id"] for h in got] == [h.id for h in expected]
    store.close()
    other = ["search", "--store", str(tmp / "store"), "cells", "--query-prompt", "q: "]
    result = runner.invoke(app, other)
    assert result.exit_code != 0 and isinstance(result.exception, SettingsMismatchError)


def test_cli_index_at_a_dim_and_eval_at_each_dim(cli):
    app, tmp = cli
    runner = CliRunner()
    args = ["index", tmp / "corpus.jsonl", "--model", tmp / "tiny", "--store", tmp / "s8"]
    result = runner.invoke(app, [str(a) for a in args] + ["--dim", "8", "--no-progress", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["store"]["dim"] == 8
    result = runner.invoke(app, ["search", "--store", str(tmp / "s8"), "cells", "--json"])
    assert result.exit_code == 0, result.output  # the store's size is the default
    (tmp / "q.jsonl").write_text(json.dumps({"_id": "q1", "text": "cells cells"}) + "\n")
    (tmp / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td5\t1\n")
    full = ["index", tmp / "corpus.jsonl", "--model", tmp / "tiny", "--store", tmp / "full"]
    assert runner.invoke(app, [str(a) for a in full] + ["--no-progress"]).exit_code == 0
    evaluated = runner.invoke(
        app,
        ["eval", "--store", str(tmp / "full"), "--queries", str(tmp / "q.jsonl"),
         "--qrels", str(tmp / "qrels.tsv"), "--dims", "32,8", "--json", "--no-progress"],
    )  # fmt: skip
    assert evaluated.exit_code == 0, evaluated.output
    results = json.loads(evaluated.stdout)["results"]
    assert [r["info"]["dim"] for r in results] == [32, 8]
