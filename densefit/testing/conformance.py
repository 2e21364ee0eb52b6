"""The conformance suite every store engine must pass (Haystack-style: subclass and run).

:class:`StoreConformance` states what every engine does; it opens stores with
:func:`~densefit.retrieval.index.engines.open_store` from the ``target`` fixture, so one
subclass per engine (and per vector kind or backend) runs it::

    class TestMyEngine(StoreConformance):
        @pytest.fixture
        def target(self, tmp_path):
            return f"qdrant:{tmp_path}/q"      # what open_store opens; a fresh store per test

        @pytest.fixture
        def backend(self):
            return "exact"                     # None: the engine's default

The suite covers add / update / delete by id, reopening, writes made through a second store
object (as another process or server replica makes them), model mismatch errors, filters
(top k of the matches, against a plain-Python reference), BM25 and hybrid search (BM25 equal
to an index built from scratch over the current documents after writes, updates and deletes;
hybrid equal to the fusion of the two rankings) and, where the engine promises it
(:class:`~densefit.retrieval.index.types.Capabilities`), compaction and crashes: a child
process (forked) indexing a corpus is SIGKILLed between batches, and the store must reopen
with its last committed state, documents and vectors aligned, and a rerun must resume. A
test of something the engine does not declare is skipped, saying so.

:class:`EmbeddedConformance` adds the embedded store's own files: compaction's generations,
the BM25 file kept beside the documents, a writer killed in the middle of a write or
between a commit and its BM25 update.

Needs pytest; uses :func:`densefit.testing.tiny_model` (no downloads).
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient  # the `test` extra has the `serve` extra's FastAPI

from densefit.data.types import Document
from densefit.models import load_model, model_name_of
from densefit.retrieval.bm25 import Bm25Index, Tokens
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.fusion import Fusion
from densefit.retrieval.index import vectors
from densefit.retrieval.index.engines import open_store
from densefit.retrieval.index.indexing import index_documents
from densefit.retrieval.index.reembed import reembed_store
from densefit.retrieval.index.registry import redacted
from densefit.retrieval.index.searching import search
from densefit.retrieval.index.settings import record_for
from densefit.retrieval.index.types import (
    ModelMismatchError,
    ModelSwappedError,
    NoStoreError,
    StoreError,
)
from densefit.serve.app import create_app
from densefit.serve.config import ServeConfig
from densefit.testing import SWAP_QUERIES, WORDS, save_swap_models, swap_corpus, tiny_model

__all__ = [
    "EmbeddedConformance",
    "StoreConformance",
    "SwapConformance",
    "make_corpus",
    "reference_match",
    "with_meta",
]

_TOPICS = ["cells", "genes", "python", "search", "cancer", "memory", "vaccine", "banana"]


def make_corpus(n: int, *, seed: int = 0, prefix: str = "doc") -> list[Document]:
    """``n`` small distinct documents built from the tiny model's vocabulary."""
    rng = np.random.default_rng(seed)

    docs = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(4, 24)))
        topic = _TOPICS[i % len(_TOPICS)]
        docs.append(Document(f"{prefix}-{i:04d}", f"{topic} {i} " + " ".join(words), title=topic))
    return docs


def with_meta(docs: list[Document]) -> list[Document]:
    """``docs`` with metadata to filter on: ``lang`` (en/de/fr in turn), ``year``
    (2000-2009), ``rare`` (True for the 8th document only) and ``tags``."""
    return [
        Document(
            d.id,
            d.text,
            d.title,
            {
                "lang": ("en", "de", "fr")[i % 3],
                "year": 2000 + i % 10,
                "rare": i == 7,
                "tags": {"topic": d.title},
            },
        )
        for i, d in enumerate(docs)
    ]


def reference_match(filters: dict, doc: Document) -> bool:
    """A plain-Python evaluation of the filters :func:`with_meta` documents are tested with
    (numbers, strings, bools, None; no dates), the reference for the SQL."""
    if "field" not in filters:
        results = [reference_match(c, doc) for c in filters["conditions"]]
        return {"AND": all, "OR": any}.get(filters["operator"], lambda r: not all(r))(results)
    field, op, value = filters["field"], filters["operator"], filters["value"]
    if field.startswith("meta."):
        got = doc.meta
        for name in field[5:].split("."):
            got = got.get(name) if isinstance(got, dict) else None
    else:
        got = {"id": doc.id, "content": doc.text, "title": doc.title}[field]
    if op in ("==", "!="):
        return (got == value) == (op == "==")
    if op in ("in", "not in"):
        return (got in value) == (op == "in")
    if got is None or value is None or isinstance(got, (str, bool)):
        return False
    return {">": got > value, ">=": got >= value, "<": got < value, "<=": got <= value}[op]


def _embed(model, docs) -> np.ndarray:
    return encode_texts(model, [d.text for d in docs])


class StoreConformance:
    """Behaviour every engine, backend and vector kind must show.

    Subclasses override the ``target`` fixture (default: a new embedded store folder) and
    ``backend`` (default None: the engine's own), and set ``vectors`` (the vector kind,
    :data:`densefit.choices.VECTOR_KINDS`) and, for int8 and binary, ``rescore``: the suite
    compares results with exact search, which a quantized store gives when it rescores every
    document (``rescore x k >= n_docs``). ``bm25_exact = False`` for an engine whose BM25
    approximates bm25s's scores (the suite then checks what it finds, not its scores).
    """

    n_docs = 40
    vectors = "float32"
    rescore: int | None = None
    vector_atol = 1e-5  # how far a stored vector may be from its float32 embedding
    bm25_exact = True

    @property
    def options(self) -> dict:
        """What :func:`open_store` takes besides the backend: the vector kind and rescoring."""
        return {"vectors": self.vectors, "rescore": self.rescore}

    @pytest.fixture
    def backend(self):
        return None

    @pytest.fixture
    def target(self, tmp_path):
        """What :func:`open_store` opens: a fresh store for each test."""
        return tmp_path / "store"

    def open(self, target, model=None, backend=None, **options):
        """The store at ``target`` (created for ``model`` when given and new; else it must
        exist), opened with this class's vector kind and rescoring."""
        options = {**self.options, **options}
        return open_store(target, model, backend=backend, create=model is not None, **options)

    @staticmethod
    def needs(store, ability: str) -> None:
        """Skip the test unless the store's engine declares ``ability``."""
        if not getattr(store.capabilities, ability):
            pytest.skip(f"the {store.capabilities.engine} engine does not declare {ability}")

    @pytest.fixture(scope="class")
    def model_dir(self, tmp_path_factory) -> Path:

        folder = tmp_path_factory.mktemp("tiny-model")
        tiny_model(folder / "build").save(str(folder / "model"))
        return folder / "model"

    @pytest.fixture(scope="class")
    def model(self, model_dir):

        return load_model(model_dir)

    @pytest.fixture
    def docs(self) -> list[Document]:
        return make_corpus(self.n_docs)

    @pytest.fixture
    def store(self, target, model, backend, docs):
        store = self.open(target, model, backend)
        store.write(docs, _embed(model, docs))
        yield store
        store.close()

    # -- add, get, search ------------------------------------------------------------------

    def test_add_count_get(self, store, docs):
        assert store.count() == len(docs)
        assert sorted(store.ids()) == sorted(d.id for d in docs)
        got = store.get([docs[3].id, "no-such-id"])
        assert got[0] == docs[3] and got[0].title == docs[3].title and got[1] is None

    def test_each_document_finds_itself_first(self, store, model, docs):
        hits = store.search(_embed(model, docs), top_k=3)
        assert [h[0].id for h in hits] == [d.id for d in docs]
        # cosine store: unit vectors
        assert all(abs(h[0].score - 1.0) < max(1e-4, self.vector_atol) for h in hits)
        assert all(h[0].rank == 1 and h[1].rank == 2 for h in hits)
        assert all(h[0].score >= h[1].score >= h[2].score for h in hits)

    def test_results_match_brute_force(self, store, model, docs):
        queries = encode_texts(model, ["cells and genes", "python function", "banana"])
        vectors = store.vectors([d.id for d in docs])
        expected = _normalise(queries) @ vectors.T  # (q, n)
        for q, hits in enumerate(store.search(queries, top_k=5)):
            best = np.argsort(-expected[q])[:5]
            assert [h.id for h in hits] == [docs[i].id for i in best]
            np.testing.assert_allclose([h.score for h in hits], expected[q][best], atol=1e-5)

    def test_top_k_larger_than_store(self, store, model, docs):
        hits = store.search(_embed(model, docs[:1]), top_k=len(docs) + 10)[0]
        assert len(hits) == len(docs) and len({h.id for h in hits}) == len(docs)

    def test_empty_store_finds_nothing(self, target, model, backend):
        with self.open(target, model, backend) as store:
            assert store.search(encode_texts(model, ["cells"]), top_k=5) == [[]]
            assert store.count() == 0

    # -- update and delete -----------------------------------------------------------------

    def test_update_replaces_text_and_vector(self, store, model, docs):
        changed = Document(docs[5].id, "banana banana apple fruit salad", title="fruit")
        result = store.write([changed], _embed(model, [changed]))
        assert (result.added, result.updated) == (0, 1)
        assert store.count() == len(docs)
        assert store.dead_rows() == (1 if store.capabilities.compaction else 0)
        assert store.get([changed.id])[0].text == changed.text
        hit = store.search(_embed(model, [changed]), top_k=1)[0][0]
        assert hit.id == changed.id and abs(hit.score - 1) < max(1e-4, self.vector_atol)
        old_hits = store.search(_embed(model, [docs[5]]), top_k=len(docs))[0]
        old_score = next(h.score for h in old_hits if h.id == changed.id)
        assert old_score < 0.9999  # the old vector is gone

    def test_delete(self, store, model, docs):
        assert store.delete([docs[0].id, docs[1].id, "never-there"]) == 2
        assert store.count() == len(docs) - 2
        assert store.get([docs[0].id]) == [None]
        hits = store.search(_embed(model, docs[:2]), top_k=len(docs))
        found = {h.id for query_hits in hits for h in query_hits}
        assert docs[0].id not in found and docs[1].id not in found
        assert len(hits[0]) == len(docs) - 2

    def test_write_metadata_keeps_vector(self, store, model, docs):
        renamed = Document(docs[2].id, docs[2].text, title="renamed", meta={"lang": "en"})
        assert store.write_metadata([renamed]) == 1
        got = store.get([renamed.id])[0]
        assert got.title == "renamed" and got.meta == {"lang": "en"}
        assert store.dead_rows() == 0

    def test_compact_keeps_results(self, store, model, docs):
        self.needs(store, "compaction")
        store.write(docs[:10], _embed(model, docs[:10]))  # 10 dead rows
        store.delete([docs[20].id])
        queries = encode_texts(model, ["cells", "python search", "vaccine dose"])
        before = _as_pairs(store.search(queries, top_k=8))
        assert store.compact() == 11
        assert store.dead_rows() == 0
        assert _close(_as_pairs(store.search(queries, top_k=8)), before)

    # -- filters and score scaling ---------------------------------------------------------

    def _filtered_brute_force(self, store, queries, matching_ids, k):
        """Expected ``[(id, score)]`` per query: the best ``k`` of ``matching_ids``."""
        ids = sorted(matching_ids)
        if not ids:
            return [[] for _ in queries]
        expected = _normalise(queries) @ store.vectors(ids).T  # (q, m)
        return [
            [(ids[i], float(row[i])) for i in np.argsort(-row, kind="stable")[:k]]
            for row in expected
        ]

    @pytest.mark.parametrize(
        "filters",
        [
            {"field": "meta.lang", "operator": "==", "value": "de"},  # a third
            {"field": "meta.year", "operator": ">=", "value": 2007},  # 30%, masked scan
            {"field": "meta.rare", "operator": "==", "value": True},  # one document
            {
                "operator": "OR",
                "conditions": [
                    {"field": "id", "operator": "in", "value": ["doc-0003", "doc-0011"]},
                    {"field": "meta.lang", "operator": "!=", "value": "en"},
                ],
            },
        ],
    )
    def test_filtered_search_is_top_k_of_the_matches(self, store, model, docs, filters):
        store.write_metadata(with_meta(docs))
        queries = encode_texts(model, ["cells and genes", "python function", "banana"])
        matching = {d.id for d in store.filter_documents(filters)}
        assert matching == {d.id for d in with_meta(docs) if reference_match(filters, d)}
        k = 5
        got = _as_pairs(store.search(queries, top_k=k, filters=filters))
        expected = self._filtered_brute_force(store, queries, matching, k)
        assert all(len(hits) == min(k, len(matching)) for hits in got)
        assert _close_scores(got, expected)

    def test_filter_matching_nothing_finds_nothing(self, store, model, docs):
        filters = {"field": "meta.lang", "operator": "==", "value": "xx"}
        assert store.search(_embed(model, docs[:2]), top_k=3, filters=filters) == [[], []]

    def test_filters_see_updates_and_deletes(self, store, model, docs):
        store.write_metadata(with_meta(docs))
        filters = {"field": "meta.lang", "operator": "==", "value": "de"}
        de = [d.id for d in with_meta(docs) if d.meta["lang"] == "de"]
        store.delete(de[:2])
        moved = Document(docs[0].id, docs[0].text, meta={"lang": "de"})  # en -> de
        store.write([moved], _embed(model, [moved]))
        hits = store.search(_embed(model, docs[:1]), top_k=len(docs), filters=filters)[0]
        assert {h.id for h in hits} == set(de[2:]) | {moved.id}
        assert hits[0].id == moved.id and store.count_matching(filters) == len(hits)

    def test_no_filter_and_empty_filter_are_the_same_search(self, store, model, docs):
        queries = encode_texts(model, ["cells", "vaccine"])
        plain = _as_pairs(store.search(queries, top_k=7))
        assert _as_pairs(store.search(queries, top_k=7, filters={})) == plain
        assert _as_pairs(store.search(queries, top_k=7, filters=None)) == plain

    def test_malformed_filter_is_a_value_error(self, store, model, docs):
        with pytest.raises(ValueError, match="needs a list"):
            store.search(
                _embed(model, docs[:1]), filters={"field": "id", "operator": "in", "value": "x"}
            )

    def test_scale_score_maps_cosine_to_unit_interval(self, store, model, docs):
        queries = encode_texts(model, ["cells genes", "python"])
        plain = store.search(queries, top_k=6)
        scaled = store.search(queries, top_k=6, scale_score=True)
        for p, s in zip(plain, scaled, strict=True):
            assert [h.id for h in p] == [h.id for h in s]
            np.testing.assert_allclose([h.score for h in s], [(h.score + 1) / 2 for h in p])
            assert all(0 <= h.score <= 1 for h in s)

    # -- BM25 and hybrid search -------------------------------------------------------------

    bm25_queries = ("cells genes", "python function return", "banana apple memory", "the of")

    def _fresh_bm25(self, store, queries, k, filters=None):
        """Expected BM25 ``[(id, score)]`` per query: an index built now, from scratch, over
        the stored documents (those matching ``filters``), in write order as the store's."""
        docs = store.filter_documents()
        index = Bm25Index(Tokens.of([d.text for d in docs]))
        mask = None if filters is None else np.array([reference_match(filters, d) for d in docs])
        return [
            [(docs[p].id, float(score)) for p, score in zip(*found, strict=True)]
            for found in index.search(list(queries), k, mask)
        ]

    def _bm25(self, store, queries=None, k=10, **options):
        self.needs(store, "lexical")
        queries = list(queries or self.bm25_queries)
        return _as_pairs(store.search(None, k, mode="bm25", query_texts=queries, **options))

    def _assert_bm25(self, store, got, queries, k, filters=None) -> None:
        """BM25 results equal to an index built from scratch (scores and order, ties aside),
        or, for an engine whose BM25 approximates its scores, the same documents found
        when every match fits in ``k``, and only documents sharing a token with the query."""
        expected = self._fresh_bm25(store, queries, k, filters)
        if self.bm25_exact:
            assert _close_scores(got, expected), (got, expected)
            return
        matches = self._fresh_bm25(store, queries, store.count(), filters)
        for found, every in zip(got, matches, strict=True):
            ids = {d for d, _ in every}
            assert {d for d, _ in found} <= ids and len(found) == min(k, len(ids))

    def test_bm25_equals_a_fresh_index_of_the_documents(self, store):
        got = self._bm25(store, k=12)
        self._assert_bm25(store, got, self.bm25_queries, 12)
        assert got[0] and got[-1] == []  # stop words only: nothing shares a token

    def test_bm25_follows_writes_updates_and_deletes(self, store, model, docs):
        self._bm25(store)  # the index exists before the changes
        changed = Document(docs[4].id, "vaccine dose trial mice", title="trial")
        extra = make_corpus(5, seed=3, prefix="extra")
        store.write([changed, *extra], _embed(model, [changed, *extra]))
        store.delete([docs[0].id, docs[9].id])
        queries = [*self.bm25_queries, docs[4].text, "vaccine dose trial mice", extra[2].text]
        got = self._bm25(store, queries, k=len(docs) + 10)
        self._assert_bm25(store, got, queries, len(docs) + 10)
        found = {doc_id for hits in got for doc_id, _ in hits}
        assert docs[0].id not in found and docs[9].id not in found
        assert changed.id in {d for d, _ in got[-2][:3]} and extra[2].id in {d for d, _ in got[-1]}

    @pytest.mark.parametrize(
        "filters",
        [
            {"field": "meta.lang", "operator": "==", "value": "de"},
            {"field": "meta.rare", "operator": "==", "value": True},
            {"field": "meta.year", "operator": ">=", "value": 2003},
        ],
    )
    def test_bm25_and_hybrid_filter_before_ranking(self, store, model, docs, filters):
        store.write_metadata(with_meta(docs))
        got = self._bm25(store, k=7, filters=filters)
        self._assert_bm25(store, got, self.bm25_queries, 7, filters)
        self.needs(store, "hybrid")
        matching = {d.id for d in store.filter_documents(filters)}
        texts = list(self.bm25_queries[:3])
        hybrid = store.search(
            encode_texts(model, texts), 7, mode="hybrid", query_texts=texts, filters=filters
        )
        assert all(h.id in matching for hits in hybrid for h in hits)
        assert all(len(hits) == min(7, len(matching)) for hits in hybrid)

    @pytest.mark.parametrize("method", ["rrf", "weighted"])
    def test_hybrid_is_the_fusion_of_the_dense_and_bm25_rankings(self, store, model, method):
        self.needs(store, "hybrid")
        fusion = Fusion(method=method, depth=15, alpha=0.3)
        texts = list(self.bm25_queries)
        embeddings = encode_texts(model, texts)
        position = {d.id: i for i, d in enumerate(store.filter_documents())}  # row order
        dense = _as_pairs(store.search(embeddings, 15))
        lexical = self._bm25(store, texts, k=15)
        got = _as_pairs(
            store.search(embeddings, 6, mode="hybrid", query_texts=texts, fusion=fusion)
        )
        ids = {i: doc_id for doc_id, i in position.items()}
        for q in range(len(texts)):
            keys = [np.array([position[d] for d, _ in side]) for side in (dense[q], lexical[q])]
            scores = [np.array([x for _, x in side]) for side in (dense[q], lexical[q])]
            rows, fused = fusion.fuse(keys, 6, scores)
            assert [d for d, _ in got[q]] == [ids[int(r)] for r in rows]
            np.testing.assert_allclose([x for _, x in got[q]], fused, rtol=1e-6)

    def test_search_modes_are_checked(self, store, model):
        with pytest.raises(ValueError, match="mode must be one of dense, bm25, hybrid"):
            store.search(encode_texts(model, ["x"]), mode="sparse")
        with pytest.raises(ValueError, match="needs the query texts"):
            store.search(encode_texts(model, ["x"]), mode="hybrid")
        with pytest.raises(ValueError, match="needs the query embeddings"):
            store.search(None, mode="hybrid", query_texts=["x"])
        with pytest.raises(ValueError, match="2 query texts for 1 query embeddings"):
            store.search(encode_texts(model, ["x"]), mode="hybrid", query_texts=["x", "y"])

    # -- persistence and other processes ---------------------------------------------------

    def test_reopen_gives_same_results(self, store, target, model, backend, docs):
        queries = encode_texts(model, ["cells genes", "memory batch"])
        before = _as_pairs(store.search(queries, top_k=5))
        store.delete([docs[7].id])
        before_delete = _as_pairs(store.search(queries, top_k=5))
        store.close()
        with self.open(target, backend=backend) as again:
            assert again.count() == len(docs) - 1
            assert _close(_as_pairs(again.search(queries, top_k=5)), before_delete)
        assert before  # searched before closing too

    def test_second_handle_sees_commits(self, store, target, model, backend, docs):
        with self.open(target, backend=backend) as other:
            assert other.count() == len(docs)
            extra = make_corpus(3, seed=9, prefix="extra")
            store.write(extra, _embed(model, extra))
            store.delete([docs[0].id])
            assert other.count() == len(docs) + 2
            hit = other.search(_embed(model, extra[:1]), top_k=1)[0][0]
            assert hit.id == extra[0].id
            other.compact()
            assert store.search(_embed(model, extra[1:2]), top_k=1)[0][0].id == extra[1].id

    # -- the model -------------------------------------------------------------------------

    def test_records_model(self, store, model):

        assert store.dim == 32 and store.similarity == "cosine"
        assert store.model_name == str(Path(model_name_of(model)).resolve())
        store.check_model(model)  # no error

    def test_other_dimension_is_an_error(self, store, tmp_path):

        wider = tiny_model(tmp_path / "wide", hidden_size=48, num_heads=2)
        with pytest.raises(ModelMismatchError, match="32-d.*48-d"):
            store.check_model(wider)
        with pytest.raises(ModelMismatchError):
            search(store, wider, "cells")

    def test_other_weights_same_dimension_is_an_error(self, store, target, backend, tmp_path):

        other = tiny_model(tmp_path / "other", seed=123)
        with pytest.raises(ModelMismatchError, match="does not reproduce"):
            store.check_model(other)
        with pytest.raises(ModelMismatchError):
            self.open(target, other, backend)

    def test_weights_changed_in_place_is_an_error(self, store, model_dir, docs):

        model = load_model(model_dir)
        assert search(store, model, docs[0].text, top_k=1)[0].id == docs[0].id
        torch.manual_seed(0)
        with torch.no_grad():  # what an optimizer step does
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
        with pytest.raises(ModelMismatchError, match="weights changed"):
            search(store, model, docs[0].text)

    def test_same_weights_under_another_name_is_accepted(self, store, model_dir):

        model = load_model(model_dir)
        model._densefit_name = "my-copy-of-the-model"
        assert model_name_of(model) != store.model_name  # the name really differs
        store.check_model(model)

    # -- roles: metadata statistics, re-embedding, upkeep, drop ------------------------------
    # (the contract helper's section: each role's test skips where the engine does not declare
    # it; tests/test_engines.py checks that the suite exercises every member of the contract)

    def test_the_store_says_what_it_is(self, store, target, model):
        assert store.location == redacted(target)
        assert store.record.model_name == store.model_name == model_name_of(model)
        assert (store.record.dim, store.record.vector_kind) == (store.dim, self.vectors)
        assert store.model_generation == 0
        info = store.info()
        assert info["engine"] == store.capabilities.engine and info["documents"] == store.count()

    def test_metadata_statistics_are_those_of_the_matching_documents(self, target, model, backend):
        docs = _statistics_corpus()
        with self.open(target, model, backend) as store:
            self.needs(store, "metadata_stats")
            store.write(docs, _embed(model, docs))
            filters = {"field": "meta.lang", "operator": "!=", "value": "de"}
            matching = [d for d in docs if reference_match(filters, d)]
            assert store.meta_fields() == _reference_fields(docs)
            for field in ("meta.lang", "meta.year", "meta.score", "meta.rare", "meta.tags.topic"):
                for flt, among in ((None, docs), (filters, matching)):
                    got = sorted(map(repr, store.meta_values(field, flt)))
                    assert got == sorted(map(repr, _reference_values(among, field))), field
                    assert store.meta_range(field, flt) == _reference_range(among, field)
            assert store.meta_values("meta.none") == [] and store.meta_range("meta.none") == (
                None,
                None,
            )

    def test_reembedding_marks_every_vector_stale_until_written_again(self, store, model, docs):
        self.needs(store, "reembedding")
        store.start_reembedding(model)
        assert store.all_stale_ids() == [d.id for d in docs]
        assert store.stale_ids([docs[1].id, "no-such-id"]) == {docs[1].id}
        text_hash = store.hashes([docs[1].id])[docs[1].id][0]
        assert store.vectors_for_texts([text_hash]) == {}  # a stale vector is not copied
        with pytest.raises(StoreError, match="still hold vectors made before --reembed"):
            store.finish_reembedding()
        store.write(docs[:5], _embed(model, docs[:5]))
        assert store.all_stale_ids() == [d.id for d in docs[5:]]
        assert store.stale_ids([docs[1].id]) == set()
        assert list(store.vectors_for_texts([text_hash])) == [text_hash]
        store.write(docs[5:], _embed(model, docs[5:]))
        assert store.all_stale_ids() == []
        store.finish_reembedding()
        store.finish_reembedding()  # nothing under way: nothing to do

    def test_reembed_with_new_settings_remakes_every_vector(self, store, model, docs):
        self.needs(store, "reembedding")
        shorter = copy.deepcopy(model)
        shorter.max_seq_length = 8  # the corpus texts are longer: truncation changes vectors
        report = index_documents(store, shorter, docs[:10], reembed=True)
        assert (report.reembedded, report.reembedded_stored) == (10, len(docs) - 10)
        assert store.settings.max_seq_length == 8 and store.all_stale_ids() == []
        np.testing.assert_allclose(
            store.vectors([d.id for d in docs]),
            _normalise(_embed(shorter, docs)),
            atol=self.vector_atol,
        )
        again = index_documents(store, shorter, docs)  # the new settings are the store's now
        assert (again.unchanged, again.encoded) == (len(docs), 0)

    def test_upkeep_keeps_bm25_and_metadata_indexes_current(self, target, model, backend):
        docs = with_meta(make_corpus(self.n_docs))
        with self.open(target, model, backend) as store:
            self.needs(store, "upkeep")
            store.write(docs, _embed(model, docs))
            filters = {"field": "meta.lang", "operator": "==", "value": "de"}
            before = store.count_matching(filters)
            store.index_meta_field("meta.lang")
            store.index_meta_field("meta.lang")  # idempotent
            assert store.count_matching(filters) == before > 0
            with pytest.raises(ValueError):
                store.index_meta_field("lang")  # not a metadata field
            assert store.dead_rows() >= 0
            if store.capabilities.lexical:
                self._bm25(store, [docs[0].text], 1)
            new = Document("upkeep-new", "zebra quartz upkeep " + docs[0].text, title="new")
            store.write([new], _embed(model, [new]))
            if store.bm25_loaded:  # this process holds an index: one update brings it current
                assert store.update_bm25() is True and store.update_bm25() is False
            else:  # the engine keeps BM25 current itself
                assert store.update_bm25() is False
            if store.capabilities.lexical:
                assert self._bm25(store, ["zebra quartz upkeep"], 1)[0][0][0] == new.id

    def test_drop_deletes_the_store(self, target, model, backend, docs):
        store = self.open(target, model, backend)
        store.write(docs, _embed(model, docs))
        store.drop()
        with pytest.raises(NoStoreError):
            self.open(target, backend=backend)
        with self.open(target, model, backend) as again:  # a new, empty store
            assert again.count() == 0 and again.count_matching(None) == 0

    # -- crashes ---------------------------------------------------------------------------

    def _fork_indexer(self, model, target, backend, mode: str, n: int) -> tuple[int, int]:
        """Index ``make_corpus(n)`` in a forked child; returns (pid, read end of its pipe).

        A fork rather than a fresh interpreter: the child starts in milliseconds with the
        model already loaded, and dies by SIGKILL all the same. ``mode="between"`` writes a
        byte to the pipe after each commit and pauses; ``mode="mid-write"`` kills itself
        after the third batch's vectors reached the file, before SQLite commits them.
        """
        if not hasattr(os, "fork"):
            pytest.skip("the crash tests need os.fork")
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid != 0:
            os.close(write_end)
            return pid, read_end
        try:  # the child: never returns into pytest
            os.close(read_end)

            torch.set_num_threads(1)

            store = self.open(target, model, backend)
            if mode == "mid-write":
                original, calls = vectors.VectorFile.write, [0]

                def write_then_die(self, start, array):
                    original(self, start, array)
                    calls[0] += 1
                    if calls[0] == 3:
                        os.kill(os.getpid(), signal.SIGKILL)

                vectors.VectorFile.write = write_then_die
            else:
                original_write = store.write

                def write_slowly(docs, embeddings):
                    result = original_write(docs, embeddings)
                    os.write(write_end, b"c")
                    time.sleep(0.3)
                    return result

                store.write = write_slowly
            index_documents(store, model, make_corpus(n), batch_size=8, commit_every=16)
            os.write(write_end, b"f")
            os._exit(0)
        except BaseException:  # noqa: BLE001 - report and leave without running pytest code
            traceback.print_exc()
            os._exit(1)

    @staticmethod
    def _wait_killed(pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"the indexing child ended with status {status}, not by SIGKILL"
        )

    def _check_consistent(self, target, model, backend, n_expected=None):
        with self.open(target, backend=backend) as store:
            ids = sorted(store.ids())
            if n_expected is not None:
                assert len(ids) == n_expected
            docs = store.get(ids)
            # Every stored document's vector is its own text's embedding: nothing misaligned.
            np.testing.assert_allclose(
                store.vectors(ids),
                encode_texts(model, [d.text for d in docs], normalize=True),
                atol=self.vector_atol,
            )
            hits = store.search(encode_texts(model, [docs[-1].text]), top_k=1)[0]
            assert hits[0].id == ids[-1]
            return len(ids)

    def _assert_resumes(self, target, model, backend, committed, n):
        with self.open(target, model, backend) as store:
            report = index_documents(store, model, make_corpus(n), batch_size=8, commit_every=16)
        assert report.unchanged == committed and report.added == n - committed
        self._check_consistent(target, model, backend, n_expected=n)

    def test_killed_between_batches_reopens_and_resumes(self, model, backend, target):
        n = 160
        with self.open(target, model, backend) as store:  # a flushed first part
            self.needs(store, "crash_safe")
            index_documents(store, model, make_corpus(16), batch_size=8, commit_every=16)
        pid, pipe = self._fork_indexer(model, target, backend, "between", n)
        try:
            seen = b""
            deadline = time.monotonic() + 60
            while seen.count(b"c") < 3 and time.monotonic() < deadline:
                chunk = os.read(pipe, 16)
                if not chunk:
                    break
                seen += chunk
            assert seen.count(b"c") >= 3, "the indexing child did not commit three batches"
        finally:
            os.kill(pid, signal.SIGKILL)
            os.close(pipe)
            self._wait_killed(pid)
        committed = self._check_consistent(target, model, backend)
        assert committed % 16 == 0 and 16 + 3 * 16 <= committed < n
        self._assert_resumes(target, model, backend, committed, n)


class EmbeddedConformance(StoreConformance):
    """:class:`StoreConformance` and the embedded store's own files (see the module docstring)."""

    @pytest.fixture
    def store_dir(self, target) -> Path:
        return Path(target)

    def test_bm25_survives_reopen_compaction_and_other_handles(
        self, store, store_dir, model, backend, docs
    ):
        store.write(docs[:6], _embed(model, docs[:6]))  # 6 dead rows
        store.flush()  # saved: bm25-<generation>.npz
        assert list(store_dir.glob("bm25-0.npz"))
        with self.open(store_dir, backend=backend) as other:
            assert self._bm25(other) == self._fresh_bm25(other, self.bm25_queries, 10)
            assert other._bm25.tokenised == 0  # read from the file, nothing tokenised again
            extra = make_corpus(2, seed=5, prefix="extra")
            store.write(extra, _embed(model, extra))  # another handle commits
            assert self._bm25(other, [extra[1].text], 1)[0][0][0] == extra[1].id
            assert other._bm25.tokenised == 2
        self._bm25(store)  # this handle's index is current before compacting
        tokenised = store._bm25.tokenised
        assert store.compact() == 6
        assert self._bm25(store) == self._fresh_bm25(store, self.bm25_queries, 10)
        assert store._bm25.tokenised == tokenised  # renumbered, not rebuilt
        store.flush()
        assert [p.name for p in store_dir.glob("bm25-*")] == ["bm25-1.npz"]

    def test_unreadable_bm25_file_is_rebuilt(self, store, store_dir, backend):
        store.flush()
        store.close()
        (store_dir / "bm25-0.npz").write_bytes(b"PK\x03\x04 not a zip file at all")
        with self.open(store_dir, backend=backend) as again:
            assert self._bm25(again) == self._fresh_bm25(again, self.bm25_queries, 10)
            assert again._bm25.tokenised == self.n_docs

    def test_files_of_a_running_compaction_survive_another_open(self, store, store_dir, backend):
        # Another process compacting holds the write lock while it writes the next
        # generation's file; opening the store meanwhile must not delete that file.
        next_file = store_dir / "vectors-1.f32"
        with store.transaction():
            next_file.write_bytes(b"being written")
            self.open(store_dir, backend=backend).close()
            assert next_file.exists()
        # Once nobody holds the lock, a leftover of an interrupted compaction is removed.
        self.open(store_dir, backend=backend).close()
        assert not next_file.exists()

    def test_killed_mid_write_keeps_last_commit(self, model, backend, store_dir):
        n = 96
        with self.open(store_dir, model, backend) as store:
            index_documents(store, model, make_corpus(16), batch_size=8, commit_every=16)
        pid, pipe = self._fork_indexer(model, store_dir, backend, "mid-write", n)
        os.close(pipe)
        self._wait_killed(pid)
        # The run skipped the 16 unchanged documents, committed two batches of 16, and died
        # after writing the third batch's vectors but before its transaction committed.
        vector_file = next(store_dir.glob("vectors-*"))
        row_bytes = 32 * (2 if self.vectors == "float16" else 4)
        assert vector_file.stat().st_size > 48 * row_bytes
        committed = self._check_consistent(store_dir, model, backend, n_expected=48)
        self._assert_resumes(store_dir, model, backend, committed, n)

    def test_killed_between_a_commit_and_the_bm25_update_never_answers_stale(
        self, model, backend, store_dir
    ):
        if not hasattr(os, "fork"):
            pytest.skip("the crash tests need os.fork")
        with self.open(store_dir, model, backend) as store:
            index_documents(store, model, make_corpus(30), batch_size=8)  # flushes: BM25 saved
        saved = (store_dir / "bm25-0.npz").read_bytes()
        extra = make_corpus(6, seed=11, prefix="late")
        pid = os.fork()
        if pid == 0:  # the child: commit a write and a delete, then die before any flush
            try:
                torch.set_num_threads(1)
                store = self.open(store_dir, model, backend)
                store.write(extra, _embed(model, extra))
                store.delete(["doc-0003", "doc-0004"])
                os.kill(os.getpid(), signal.SIGKILL)
            except BaseException:  # noqa: BLE001 - report and leave without running pytest code
                traceback.print_exc()
            os._exit(1)
        self._wait_killed(pid)
        assert (store_dir / "bm25-0.npz").read_bytes() == saved  # the file is behind
        with self.open(store_dir, backend=backend) as store:
            assert store.info()["bm25"] != "current"
            queries = [*self.bm25_queries, extra[0].text, make_corpus(30)[3].text]
            got = self._bm25(store, queries, k=40)
            assert got == self._fresh_bm25(store, queries, 40)
            assert extra[0].id in {d for d, _ in got[-2][:3]}
            assert "doc-0003" not in {d for hits in got for d, _ in hits}
            assert store._bm25.tokenised == len(extra)  # the saved part was reused
            assert store.info()["bm25"] == "current"


def _normalise(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _as_pairs(results) -> list[list[tuple[str, float]]]:
    return [[(h.id, h.score) for h in hits] for hits in results]


def _close_scores(a, b, atol: float = 1e-5) -> bool:
    """Same scores in order, and the same ids wherever a score is not tied with another."""
    for qa, qb in zip(a, b, strict=True):
        if len(qa) != len(qb):
            return False
        scores = [y for _, y in qb]
        for (ida, x), (idb, y) in zip(qa, qb, strict=True):
            if abs(x - y) > atol:
                return False
            tied = sum(abs(y - other) <= atol for other in scores) > 1
            if ida != idb and not tied:
                return False
    return True


def _close(a, b, atol: float = 1e-5) -> bool:
    if [[i for i, _ in q] for q in a] != [[i for i, _ in q] for q in b]:
        return False
    return all(
        abs(x - y) <= atol
        for qa, qb in zip(a, b, strict=True)
        for (_, x), (_, y) in zip(qa, qb, strict=True)
    )


def _statistics_corpus() -> list[Document]:
    """Documents whose metadata mixes JSON types: strings, integers, reals, booleans, an
    object, null and missing values (the shapes metadata statistics must tell apart)."""
    docs = with_meta(make_corpus(24, prefix="stat"))
    out = []
    for i, d in enumerate(docs):
        meta = dict(d.meta)
        meta["score"] = (0.5 * i) if i % 4 else None  # reals, and null
        if i % 5 == 0:
            del meta["year"]  # missing
        if i == 3:
            meta["year"] = "unknown"  # a string among numbers: the range keeps to numbers
        out.append(Document(d.id, d.text, d.title, meta))
    return out


def _json_type(value) -> str | None:
    """SQLite's ``json_type`` name of a metadata value (None for null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "real"
    if isinstance(value, str):
        return "text"
    return "array" if isinstance(value, list) else "object"


def _meta_value(doc: Document, field: str):
    value = doc.meta
    for name in field[len("meta.") :].split("."):
        value = value.get(name) if isinstance(value, dict) else None
    return value


def _reference_values(docs: list[Document], field: str) -> list[tuple[object, int]]:
    """Each distinct value (by JSON type and value) with its count; nulls left out."""
    counts: dict[tuple, list] = {}
    for doc in docs:
        value = _meta_value(doc, field)
        kind = _json_type(value)
        if kind is not None:
            counts.setdefault((kind, repr(value)), [value, 0])[1] += 1
    return [(value, n) for value, n in counts.values()]


def _reference_range(docs: list[Document], field: str) -> tuple[object, object]:
    """``(min, max)`` of the numbers (not booleans), else of the strings, else ``(None, None)``."""
    values = [_meta_value(d, field) for d in docs]
    for kinds in (("integer", "real"), ("text",)):
        found = [v for v in values if _json_type(v) in kinds]
        if found:
            return min(found), max(found)
    return None, None


def _reference_fields(docs: list[Document]) -> dict[str, dict[str, int]]:
    fields: dict[str, dict[str, int]] = {}
    for doc in docs:
        for key, value in doc.meta.items():
            kind = _json_type(value)
            if kind is not None:
                kinds = fields.setdefault(key, {})
                kinds[kind] = kinds.get(kind, 0) + 1
    return fields


# == model swaps (densefit reembed): every engine that declares model_swap ===================
# Owned with densefit.retrieval.index.swap: the coordinator's state machine, run on an engine.


def _swap_embed(model, docs: list[Document]) -> np.ndarray:
    return encode_texts(model, [d.text for d in docs], prompt_name="document")


def _swap_ranking(store, model, **options) -> list[list[tuple[str, float]]]:
    queries = encode_texts(model, SWAP_QUERIES, prompt_name="query")
    return _as_pairs(store.search(queries, 5, **options))


def _swap_fresh(model, documents: list[Document]):
    """An embedded store indexed from scratch by ``model``: what a swap must equal."""
    store = open_store(None, model)
    index_documents(store, model, documents)
    return store


def _swap_killed(target, backend, step: str, n: int, new) -> None:
    """Swap the store at ``target`` to the model ``new``, this process SIGKILLed once the
    coordinator's ``step`` has returned ``n`` times (the child of the kill test)."""
    torch.set_num_threads(1)
    child = open_store(target, backend=backend, create=False)
    cls = type(child)
    setattr(cls, step, _kill_after(getattr(cls, step), n))
    reembed_store(child, new, commit_every=5, runtime="torch")


def _kill_after(function, n: int):
    """``function`` that SIGKILLs its process once its ``n``-th call has returned (inside the
    caller's transaction, when the call is in one)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        result = function(*args, **kwargs)
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return wrapped


class SwapConformance:
    """Model swaps (:mod:`densefit.retrieval.index.swap`) on an engine that declares
    ``model_swap``: subclass once per engine with the ``target`` fixture (a fresh store per
    test), ``backend`` (exact search: rankings are compared with an embedded store indexed
    from scratch) and :meth:`generations`. The store holds what a fresh index by the new
    model holds after a switch; the old model serves, unchanged, until the switch; writes,
    deletes and metadata updates during a swap reach both generations; another store object
    follows the switch; a stopped or killed swap resumes; cancelling drops the swap's storage.
    """

    backend: str | None = None
    fork_child = True  # False: the kill test's child is a new interpreter (gRPC clients)

    @pytest.fixture
    def target(self, tmp_path):
        return tmp_path / "store"

    def generations(self, target) -> list[str] | None:
        """The names of the store's vector storages (files, tables, collections); None:
        not checked."""
        return None

    def open(self, target, model=None):
        return open_store(target, model, backend=self.backend, create=model is not None)

    def assert_generations(self, target, n: int) -> None:
        found = self.generations(target)
        if found is not None:
            assert len(found) == n, found

    @pytest.fixture(scope="class")
    @classmethod
    def swap_models(cls, tmp_path_factory) -> dict:
        """Loaded tiny models ``old``, ``new`` (another seed, same size), ``wide`` (48-d),
        and their folders under ``"paths"``."""
        paths = save_swap_models(tmp_path_factory.mktemp("swap-models"))
        return {name: load_model(str(path)) for name, path in paths.items()} | {"paths": paths}

    @pytest.fixture
    def indexed(self, target, swap_models):
        """The target of a store of 40 documents indexed by the ``old`` model."""
        with self.open(target, swap_models["old"]) as store:
            if not store.capabilities.model_swap:
                pytest.skip(f"the {store.capabilities.engine} engine does not swap models")
            index_documents(store, swap_models["old"], swap_corpus(40))
        return target

    def assert_equals_fresh(self, store, model, documents: list[Document]) -> None:
        """The store holds what a fresh index of ``documents`` by ``model`` does: the same
        documents, vectors (up to the rounding of other batches: a swap embeds chunks in
        write order), and ranking; no swap is under way."""
        fresh = _swap_fresh(model, documents)
        ids = sorted(d.id for d in documents)
        assert sorted(store.ids()) == ids
        np.testing.assert_allclose(store.vectors(ids), fresh.vectors(ids), rtol=0, atol=1e-5)
        assert store.get(ids) == fresh.get(ids)
        assert _close_scores(_swap_ranking(store, model), _swap_ranking(fresh, model), 1e-4)
        store.check_model(model)
        assert store.swap_target() is None and store.info()["swap"] is None

    @pytest.mark.parametrize("new_name", ["new", "wide"])
    def test_a_swap_equals_a_fresh_index_with_the_new_model(self, indexed, swap_models, new_name):
        old, new = swap_models["old"], swap_models[new_name]
        before_storage = self.generations(indexed)
        with self.open(indexed) as store:
            before = _swap_ranking(store, old)
            store.check_model(old)  # checked, and cached until the model generation changes
            report = reembed_store(store, new, commit_every=7)
            assert report.switched and not report.resumed and report.embedded == 40
            assert (store.dim, store.model_generation) == (new.get_embedding_dimension(), 1)
            assert store.info()["model_swaps"] == 1
            self.assert_equals_fresh(store, new, swap_corpus(40))
            with pytest.raises(ModelMismatchError):  # the old model no longer made them
                store.check_model(old)
        with self.open(indexed) as store:  # another process: the new model, generation 1
            assert store.model_generation == 1 and _swap_ranking(store, new) != before
            self.assert_equals_fresh(store, new, swap_corpus(40))
        self.assert_generations(indexed, 1)
        if before_storage is not None:  # the old generation dropped
            assert self.generations(indexed) != before_storage

    def test_the_old_model_serves_until_the_switch_and_stale_queries_are_refused(
        self, indexed, swap_models
    ):
        old, new = swap_models["old"], swap_models["new"]
        with self.open(indexed) as store:
            before = _swap_ranking(store, old, model_generation=0)
            target, resumed = store.begin_swap(record_for(new, store.vector_kind))
            assert not resumed and store.swap_target().generation == target.generation
            again, resumed = store.begin_swap(record_for(new, store.vector_kind))
            assert resumed and again.generation == target.generation
            with pytest.raises(StoreError, match="swaps to float32 vectors"):
                store.begin_swap(record_for(new, "binary"))
            pending = store.swap_pending(-1, 25)
            assert [r for r, *_ in pending] == sorted(r for r, *_ in pending)
            vectors = encode_texts(new, [text for *_, text in pending], prompt_name="document")
            assert store.write_swap(target, [(r, i) for r, i, _ in pending], vectors) == 25
            assert store.info()["swap"] == {"model": target.record.model_name, "dim": 32,
                                            "remaining": 15}  # fmt: skip
            assert store.swap_pending(pending[-1][0], 100) == store.swap_pending(-1, 100)
            assert not store.finish_swap(target)  # documents left: nothing switches
            assert _swap_ranking(store, old, model_generation=0) == before  # the old serves
            store.check_model(old)
            report = reembed_store(store, new)
            assert report.resumed and report.embedded == 15
            with pytest.raises(ModelSwappedError):  # queries embedded for the old model
                _swap_ranking(store, old, model_generation=0)
            got = _swap_ranking(store, new, model_generation=1)
        assert _close_scores(got, _swap_ranking(_swap_fresh(new, swap_corpus(40)), new), 1e-4)

    def test_a_stopped_swap_resumes_after_reopening(self, indexed, swap_models):
        old, new = swap_models["old"], swap_models["wide"]
        asked = []

        def stop_after_two_chunks() -> bool:
            asked.append(1)
            return len(asked) > 2

        with self.open(indexed) as store:
            report = reembed_store(store, new, commit_every=7, should_stop=stop_after_two_chunks)
            assert not report.switched and report.embedded == 14
            store.check_model(old)  # still the old model's
            assert store.info()["swap"]["remaining"] == 26
        self.assert_generations(indexed, 2)
        with self.open(indexed) as store:  # another run, the store opened afresh
            assert store.swap_target().record.dim == 48
            report = reembed_store(store, new, commit_every=7)
            assert report.resumed and report.switched and report.embedded == 26
            self.assert_equals_fresh(store, new, swap_corpus(40))
        self.assert_generations(indexed, 1)

    def test_writes_and_deletes_during_a_swap_reach_both_generations(self, indexed, swap_models):
        """Writes before a chunk is written (the swap meets the moved rows again) and after
        it: a document rewritten after its chunk was written loses the next vector of its old
        text, and ends with the new model's vector of its new text."""
        old, new = swap_models["old"], swap_models["new"]
        docs = {d.id: d for d in swap_corpus(40)}
        with self.open(indexed) as store:
            target, _ = store.begin_swap(record_for(new, store.vector_kind))
            pending = store.swap_pending(-1, 30)
            vectors = encode_texts(new, [text for *_, text in pending], prompt_name="document")
            # Before the chunk is written: a document rewritten, one deleted, two written with
            # both models (a server's writer), one by the old model only, one retitled.
            changed = Document("d3", "zebra zebra music", meta={"n": 3})
            store.write([changed], _swap_embed(old, [changed]))
            store.delete(["d5"])
            both = [Document("s1", "bread kernel signal"), Document("d7", "python python")]
            store.write(
                both,
                _swap_embed(old, both),
                swap_embeddings=_swap_embed(new, both),
                swap_target=target,
            )
            only_old = Document("o1", "river bone cell")
            store.write([only_old], _swap_embed(old, [only_old]))
            store.write_metadata([Document("d9", docs["d9"].text, "a title", {"n": 99})])
            # The chunk embedded before those writes: d3, d5 and d7 moved or went, and are left.
            assert store.write_swap(target, [(r, i) for r, i, _ in pending], vectors) == 27
            # After the chunk: d10 rewritten by the old model only (the next vector of its old
            # text must go), d12 by both, d11 deleted.
            late = Document("d10", "kernel kernel bread", meta={"n": 10})
            store.write([late], _swap_embed(old, [late]))
            late_both = Document("d12", "signal bone vitamin", meta={"n": 12})
            store.write(
                [late_both],
                _swap_embed(old, [late_both]),
                swap_embeddings=_swap_embed(new, [late_both]),
                swap_target=target,
            )
            store.delete(["d11"])
            assert store.info()["swap"]["remaining"] == 40 - 30 + 3  # the rest, d3, o1, d10
            report = reembed_store(store, new, commit_every=4)
            assert report.resumed and report.switched
            assert report.embedded == 40 - 30 + 3  # s1, d7 and d12 came with both
            np.testing.assert_allclose(
                store.vectors(["d10"]), _normalise(_swap_embed(new, [late])), rtol=0, atol=1e-5
            )  # the new model's vector of the new text
            docs.update({d.id: d for d in [changed, *both, only_old, late, late_both]})
            docs["d9"] = Document("d9", docs["d9"].text, "a title", {"n": 99})
            del docs["d5"], docs["d11"]
            self.assert_equals_fresh(store, new, list(docs.values()))
            assert store.count() == len(docs)
            assert store.count_matching({"field": "meta.n", "operator": "==", "value": 99}) == 1

    def test_another_store_object_follows_the_switch(self, indexed, swap_models):
        """A replica (another process or server on the store): searches and writes prepared
        for the old model are refused with ModelSwappedError, then it serves the new model."""
        old, new = swap_models["old"], swap_models["wide"]
        writer = self.open(indexed)  # opened before the swap
        searcher = self.open(indexed)
        try:
            queries = encode_texts(old, SWAP_QUERIES, prompt_name="query")
            assert searcher.search(queries, 5, model_generation=0)
            searcher.check_model(old)  # cached until the model generation changes
            with self.open(indexed) as store:
                assert reembed_store(store, new).switched
            with pytest.raises(ModelSwappedError, match="switched to the model"):
                searcher.search(queries, 5, model_generation=0)
            assert searcher.model_generation == 1 and searcher.dim == 48
            with pytest.raises(ModelMismatchError):
                searcher.check_model(old)
            doc = Document("late", "python kernel")
            with pytest.raises(ModelSwappedError, match="switched to the model"):
                writer.write([doc], _swap_embed(old, [doc]))
            assert writer.dim == 48 and writer.get(["late"]) == [None]  # reloaded, not written
            writer.write([doc], _swap_embed(new, [doc]))
            writer.check_model(new)
            assert searcher.search(_swap_embed(new, [doc]), 1)[0][0].id == "late"
        finally:
            writer.close()
            searcher.close()

    def test_a_swap_to_another_model_starts_afresh_and_cancel_drops_it(self, indexed, swap_models):
        old, new, wide = swap_models["old"], swap_models["new"], swap_models["wide"]
        with self.open(indexed) as store:
            before = _swap_ranking(store, old)
            target, _ = store.begin_swap(record_for(new, store.vector_kind))
            pending = store.swap_pending(-1, 10)
            vectors = encode_texts(new, [t for *_, t in pending], prompt_name="document")
            assert store.write_swap(target, [(r, i) for r, i, _ in pending], vectors) == 10
            self.assert_generations(indexed, 2)
            if store.capabilities.compaction:
                assert store.compact() == 0  # no compaction while a swap is under way
            with pytest.raises(StoreError, match="model swap to .* is under way"):
                index_documents(store, old, swap_corpus(40), reembed=True)
            assert store.cancel_swap()
            assert store.info()["swap"] is None and not store.cancel_swap()
            self.assert_generations(indexed, 1)
            assert _swap_ranking(store, old) == before
            with pytest.raises(StoreError, match="cancelled or restarted"):
                store.write_swap(target, [(r, i) for r, i, _ in pending], vectors)
            store.begin_swap(record_for(new, store.vector_kind))
            report = reembed_store(store, wide)  # another model than the swap under way
            assert not report.resumed and report.embedded == 40
            self.assert_equals_fresh(store, wide, swap_corpus(40))
        self.assert_generations(indexed, 1)

    @pytest.mark.parametrize(
        ("step", "n"),
        [("_put_next", 1), ("write_swap", 3), ("_put_next", 5), ("_before_switch", 1),
         ("_switch", 1), ("_swap_changed", 2)],
        ids=["first-chunk-written", "third-chunk-done", "fifth-chunk-written", "before-switch",
             "switch-written", "switched"],
    )  # fmt: skip
    def test_a_kill_anywhere_leaves_one_model_serving_and_the_swap_resumable(
        self, indexed, swap_models, step, n
    ):
        """A forked child swapping the store is SIGKILLed after the ``n``-th call of one of
        the coordinator's steps returned: ``_put_next`` and ``_switch`` inside their
        transaction (not committed, where the engine has transactions), ``_swap_changed``'s
        second call after the switch."""
        if not hasattr(os, "fork"):
            pytest.skip("the crash test needs os.fork")
        old, new = swap_models["old"], swap_models["wide"]
        with self.open(indexed) as store:
            before = _swap_ranking(store, old)
            transactions = store.capabilities.transactions
        switched = step == "_swap_changed" or (step == "_switch" and not transactions)
        if self.fork_child:
            pid = os.fork()
            if pid == 0:  # the child: never returns into pytest
                try:
                    _swap_killed(indexed, self.backend, step, n, new)
                except BaseException:  # noqa: BLE001 - report and leave without pytest code
                    traceback.print_exc()
                os._exit(1)
            StoreConformance._wait_killed(pid)
        else:  # a new interpreter: the engine's client cannot live through a fork
            wide = str(swap_models["paths"]["wide"])
            code = (
                "from densefit.models import load_model\n"
                "from densefit.testing.conformance import _swap_killed\n"
                f"_swap_killed({str(indexed)!r}, {self.backend!r}, {step!r}, {n}, "
                f"load_model({wide!r}))\n"
            )
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=600)
            assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-3000:]
        with self.open(indexed) as store:
            if switched:
                store.check_model(new)
            else:  # nothing of the live generation changed
                store.check_model(old)
                assert _swap_ranking(store, old) == before
                assert store.info()["swap"]["dim"] == 48
            report = reembed_store(store, new, commit_every=5)
            assert report.switched and report.resumed is not switched
            self.assert_equals_fresh(store, new, swap_corpus(40))
        self.assert_generations(indexed, 1)

    def test_searches_during_an_admin_swap_all_succeed_and_end_on_the_new_model(
        self, indexed, swap_models
    ):
        old, new = swap_models["old"], swap_models["wide"]
        wide = str(swap_models["paths"]["wide"])
        key = {"X-API-Key": "secret"}
        app = create_app(self.open(indexed, old), old, ServeConfig(api_key="secret"))
        statuses: list[int] = []
        stop = threading.Event()
        with TestClient(app) as client:

            def search_until_stopped():
                while not stop.is_set():
                    r = client.post("/search", json={"query": SWAP_QUERIES, "k": 5}, headers=key)
                    statuses.append(r.status_code)

            searchers = [threading.Thread(target=search_until_stopped) for _ in range(2)]
            for thread in searchers:
                thread.start()
            started = client.post("/admin/reembed", json={"model": wide}, headers=key)
            assert started.status_code == 202, started.text
            again = client.post("/admin/reembed", json={"model": wide}, headers=key)
            assert again.status_code in (409, 202)  # 202 only if the first had finished
            new_doc = {"id": "w1", "text": "zebra kernel bread"}
            written = client.post("/documents", json={"documents": [new_doc]}, headers=key)
            assert written.status_code == 200, written.text
            app.state.admin._thread.join(timeout=300)
            stop.set()
            for thread in searchers:
                thread.join()
            status = client.get("/admin/reembed", headers=key).json()
            assert status["state"] == "done", status
            assert statuses and set(statuses) == {200}, statuses[:20]
            assert client.get("/health", headers=key).json()["dim"] == 48
            got = client.post("/search", json={"query": SWAP_QUERIES, "k": 5}, headers=key)
        docs = [*swap_corpus(40), Document("w1", new_doc["text"])]
        want = _swap_ranking(_swap_fresh(new, docs), new)
        found = [[(h["id"], h["score"]) for h in r["hits"]] for r in got.json()["results"]]
        assert _close_scores(found, want, 1e-4)
