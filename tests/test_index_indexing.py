"""index_documents (resume, updates, duplicates, report) and Retriever's index/retrieve."""

from __future__ import annotations

import numpy as np
import pytest

from densefit.api import Retriever, as_document
from densefit.data.types import Document
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.index import ModelMismatchError, StoreError, open_store
from densefit.retrieval.index.indexing import index_documents, prune_documents
from densefit.retrieval.index.searching import search, search_batch
from densefit.testing.conformance import make_corpus


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from densefit.testing import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def store(model, tmp_path):
    with open_store(tmp_path / "store", model) as store:
        yield store


def test_report_accounts_for_every_document(store, model):
    docs = make_corpus(50)
    report = index_documents(store, model, docs, batch_size=8, commit_every=16)
    assert (report.seen, report.added, report.encoded, report.commits) == (50, 50, 50, 4)
    assert report.docs_per_second > 0 and "50 added" in report.summary()

    changed = list(docs)
    changed[3] = Document(docs[3].id, "banana apple new text")  # re-embedded
    changed[4] = Document(docs[4].id, docs[4].text, title="new title")  # metadata only
    changed.append(Document(docs[0].id, "a repeated id replaces the first"))  # duplicate
    changed.append(Document("new-doc", "python search index"))
    report = index_documents(store, model, changed, batch_size=8, commit_every=16)
    assert report.seen == 52
    assert (report.added, report.updated, report.metadata_updated) == (1, 1, 1)
    assert (report.unchanged, report.duplicates, report.duplicate_ids) == (48, 1, [docs[0].id])
    assert report.seen == (
        report.added
        + report.updated
        + report.metadata_updated
        + report.unchanged
        + report.duplicates
    )
    assert store.count() == 51
    assert store.get([docs[0].id])[0].text == "a repeated id replaces the first"
    assert store.get([docs[4].id])[0].title == "new title"
    assert "repeated ids" in report.summary()


def test_duplicate_within_one_chunk_keeps_the_last(store, model):
    docs = [Document("x", "first"), Document("y", "other"), Document("x", "second")]
    report = index_documents(store, model, docs)
    assert (report.added, report.duplicates, store.count()) == (2, 1, 2)
    assert store.get(["x"])[0].text == "second"


def test_stored_vectors_are_the_texts_embeddings(store, model):
    docs = make_corpus(30)
    index_documents(store, model, docs, batch_size=4, commit_every=7)
    ids = [d.id for d in docs]
    np.testing.assert_allclose(
        store.vectors(ids), encode_texts(model, [d.text for d in docs], normalize=True), atol=1e-5
    )


def test_identical_texts_share_one_vector_across_commits(store, model):
    docs = make_corpus(20)
    copies = [Document(f"copy-{i}", docs[i].text) for i in (2, 15)]
    report = index_documents(store, model, docs[:10] + copies + docs[10:], commit_every=8)
    # copy-2 finds docs[2] stored; docs[15] comes after copy-15 was stored.
    assert report.encoded == 20 and report.reused == 2
    assert "vectors copied" in report.summary()
    vectors = store.vectors([docs[2].id, "copy-2", docs[15].id, "copy-15"])
    assert (vectors[0] == vectors[1]).all() and (vectors[2] == vectors[3]).all()  # bit for bit
    hits = store.search(vectors[:1], top_k=2)[0]
    assert {h.id for h in hits} == {docs[2].id, "copy-2"} and hits[0].score == hits[1].score


def test_generator_input_and_progress_bar(store, model, capsys):
    report = index_documents(store, model, (d for d in make_corpus(20)), show_progress=True)
    assert report.added == 20
    assert "doc" in capsys.readouterr().err  # tqdm writes docs/s to stderr


def test_prune_and_compaction(store, model):
    docs = make_corpus(40)
    index_documents(store, model, docs)
    assert prune_documents(store, [d.id for d in docs[:10]]) == 30
    assert store.count() == 10
    for round_ in range(3):  # rewrites pile up dead rows until compaction kicks in
        rewritten = [Document(d.id, f"{d.text} v{round_}") for d in docs[:10]]
        index_documents(store, model, rewritten, compact=False)
    assert store.dead_rows() == 60
    store.compact()
    assert store.dead_rows() == 0 and store.count() == 10


def test_rejects_non_documents(store, model):
    with pytest.raises(TypeError, match="document 0 is a str"):
        index_documents(store, model, ["plain text"])


def test_search_helpers(store, model):
    docs = make_corpus(20)
    index_documents(store, model, docs)
    assert search(store, model, docs[7].text, top_k=3)[0].id == docs[7].id
    batch = search_batch(store, model, [docs[1].text, docs[2].text], top_k=2)
    assert [hits[0].id for hits in batch] == [docs[1].id, docs[2].id]
    with pytest.raises(TypeError, match="search_batch"):
        search(store, model, ["a list"])


# -- Retriever: index, retrieve, evaluate ----------------------------------------------------


def test_retriever_index_retrieve_evaluate(model, tmp_path):
    retriever = Retriever(model, batch_size=16)
    with pytest.raises(StoreError, match="retriever.index"):
        retriever.retrieve("cells")
    docs = [
        {"id": "1", "content": "cells divide in mitosis", "title": "Biology", "meta": {"n": 1}},
        {"id": "2", "content": "python functions return values"},
        Document("3", "vaccine dose trial"),
        "banana apple",
    ]
    report = retriever.index(docs, store=tmp_path / "s")
    assert report.added == 4 and retriever.store.count() == 4
    hits = retriever.retrieve("python functions return values", top_k=2)
    assert hits[0].id == "2" and hits[0].rank == 1 and len(hits) == 2
    assert retriever.store.get(["1"])[0].meta == {"n": 1}
    batch = retriever.retrieve_batch(["cells divide in mitosis", "banana apple"], top_k=1)
    assert batch[0][0].title == "Biology" and batch[1][0].id == as_document("banana apple").id
    result = retriever.evaluate({"q": "vaccine dose trial"}, {"q": {"3": 1}}, metrics=["mrr@10"])
    assert result.metrics == {"mrr@10": 1.0}
    # Indexing again with the same documents is free: everything is unchanged.
    assert retriever.index(docs).unchanged == 4


def test_retriever_refuses_after_training_in_place(tmp_path):
    import torch

    from densefit.testing import tiny_model

    retriever = Retriever(tiny_model(tmp_path / "m"))
    retriever.index(make_corpus(10))
    with torch.no_grad():
        for parameter in retriever.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    with pytest.raises(ModelMismatchError, match="weights changed"):
        retriever.retrieve("cells")
    retriever.store = None  # a fresh (temporary) index for the new weights
    retriever.index(make_corpus(10))
    assert len(retriever.retrieve("cells", top_k=3)) == 3


def test_as_document_errors():
    with pytest.raises(TypeError, match="'content'"):
        as_document({"id": "1", "body": "x"})
    with pytest.raises(TypeError, match="documents\\[4\\] is a int"):
        as_document(5, 4)


def test_retriever_refuses_other_settings_unless_reembed(tmp_path):
    from densefit.retrieval.index.types import SettingsMismatchError
    from densefit.testing import tiny_model

    retriever = Retriever(tiny_model(tmp_path / "m"))
    docs = make_corpus(8)
    retriever.index(docs, store=tmp_path / "s")
    retriever.model.max_seq_length = 8
    with pytest.raises(SettingsMismatchError, match="reembed=True"):
        retriever.index(docs)
    report = retriever.index(docs, reembed=True)
    assert report.reembedded == 8 and retriever.store.settings.max_seq_length == 8
