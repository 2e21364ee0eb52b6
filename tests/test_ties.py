"""Equal scores rank the same on every engine: score descending, then document id ascending
(:func:`~densefit.retrieval.index.request.ranked_order`), for dense, BM25 and hybrid search,
filtered or not, ties inside the top k and ties straddling its last place alike.

The corpus holds groups of documents with identical vectors and identical texts, written in
an order unrelated to their ids (so that neither write order nor a store row can pass for
the id), and each search is compared as a whole ranking (ids in order) with the rule applied
to the engine's own scores and with the embedded store's ranking."""

from __future__ import annotations

import random
import uuid

import numpy as np
import pytest
from conftest import STORE_ENGINES

from densefit.data.types import Document
from densefit.retrieval.fusion import Fusion
from densefit.retrieval.index.engines import open_store
from densefit.retrieval.index.request import (
    TIE,
    Ranked,
    in_rank_order,
    past_ties,
    ranked_order,
    tie_groups,
)
from densefit.retrieval.index.types import StoreRecord

DIM = 16
ENGINES = (*STORE_ENGINES, "milvus")
# groups of identical documents (vector and text): their sizes, the largest straddling
# every k up to 8 from the group before it
SIZES = (3, 5, 2, 9, 4, 1, 6, 3, 2, 4)
WORDS = ("cell", "gene", "mouse", "virus", "dose", "trial", "python", "return", "value")
LANG = {"field": "meta.lang", "operator": "==", "value": "en"}
QUERY_TEXTS = ["cell gene virus", "dose trial mouse", "python value cell"]
# RRF ties documents found on one side only at the same rank: sides 12 deep leave some out;
# weighted fusion ties identical documents (equal scores on both sides)
FUSIONS = {"rrf": Fusion(depth=12), "weighted": Fusion(method="weighted", alpha=0.6)}


def _record() -> StoreRecord:
    return StoreRecord("random", DIM, "cosine", "float32", np.zeros((3, DIM), np.float32), None)


def _corpus() -> tuple[list[Document], np.ndarray]:
    """The documents, in the order they are written, and their vectors: ids like ``d-17``
    and ``d-5`` (``"d-17" < "d-5"``) drawn at random, so that id order is neither numeric
    order nor write order."""
    rng = np.random.default_rng(3)
    bases = rng.standard_normal((len(SIZES), DIM)).astype(np.float32)
    numbers = random.Random(5).sample(range(1, 500), sum(SIZES))
    docs, vectors = [], []
    for group, size in enumerate(SIZES):
        words = rng.choice(WORDS, size=3 + group % 4)
        text = f"group{group} " + " ".join(words)
        for _ in range(size):
            n = numbers[len(docs)]
            docs.append(Document(f"d-{n}", text, meta={"lang": ("en", "de")[n % 2]}))
            vectors.append(bases[group])
    order = random.Random(7).sample(range(len(docs)), len(docs))  # scrambled write order
    return [docs[i] for i in order], np.stack([vectors[i] for i in order])


def _target(engine: str, folder, request) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    if engine == "embedded":
        return str(folder / name)
    if engine == "qdrant":
        pytest.importorskip("qdrant_client", reason="qdrant-client is not installed")
        return f"qdrant:{folder}/{name}"
    if engine == "milvus":
        pytest.importorskip("pymilvus", reason="pymilvus is not installed (densefit[milvus])")
        pytest.importorskip("milvus_lite", reason="milvus-lite is not installed")
        return f"milvus:{folder}/{name}.db"
    from densefit.testing.postgres import postgres_target

    return postgres_target(request.getfixturevalue("postgres_uri"), name)


def _open(engine: str, folder, request):
    docs, vectors = _corpus()
    store = open_store(_target(engine, folder, request), record=_record(), backend="exact")
    store.write(docs, vectors)  # one write: one Milvus Lite segment, one BM25 statistic
    return store


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, request):
    store = _open("embedded", tmp_path_factory.mktemp("embedded"), request)
    yield store
    store.close()


@pytest.fixture(scope="module", params=ENGINES)
def store(tmp_path_factory, request):
    store = _open(request.param, tmp_path_factory.mktemp(request.param), request)
    yield store
    store.close()


def _queries() -> np.ndarray:
    return np.random.default_rng(11).standard_normal((len(QUERY_TEXTS), DIM)).astype(np.float32)


def _search(store, mode: str, q: int, top_k: int, filters=None, fusion=None):
    """(id, score) pairs of query ``q``'s ranking."""
    options = {"mode": mode, "filters": filters, "fusion": fusion}
    embeddings = _queries()[q : q + 1] if mode != "bm25" else None
    texts = QUERY_TEXTS[q : q + 1] if mode != "dense" else None
    hits = store.search(embeddings, top_k, query_texts=texts, **options)[0]
    return [(h.id, h.score) for h in hits]


def _by_rule(pairs):
    """The documented order computed here: score descending, then id ascending among equal
    scores (each within TIE of the best of them, times it above 1)."""
    keyed, anchor, group = [], None, -1
    for doc_id, score in sorted(pairs, key=lambda pair: -pair[1]):
        if anchor is None or anchor - score > TIE * max(1.0, abs(anchor)):
            anchor, group = score, group + 1
        keyed.append((group, doc_id))
    return [doc_id for _, doc_id in sorted(keyed)]


def _whole(fusion: str | None) -> int:
    """The k of a case's whole ranking: every match, or for hybrid the most that fuses the
    same two lists as a smaller k does (each side ``max(k, depth)`` deep)."""
    return 200 if fusion is None else min(200, FUSIONS[fusion].depth)


def _cases(embedded):
    """(mode, fusion, filters, query, k): k at a tie straddling the cut on the embedded
    store (its k-th document ties with the next), and at the whole ranking."""
    cases, straddled = [], set()
    for mode, fusion in (("dense", None), ("bm25", None), *(("hybrid", f) for f in FUSIONS)):
        for filters in (None, LANG):
            for q in range(len(QUERY_TEXTS)):
                full = _search(embedded, mode, q, _whole(fusion), filters, FUSIONS.get(fusion))
                scores = [s for _, s in full]
                ties = [k for k in range(1, len(full)) if scores[k - 1] == scores[k]]
                for k in sorted({*ties[:1], *ties[len(ties) // 2 :][:1], len(full)}):
                    cases.append((mode, fusion, filters, q, k))
                if ties:
                    straddled.add((mode, fusion, filters is None))
    assert len(straddled) == 8, f"a mode without a tie to test: {sorted(straddled)}"
    return cases


def test_whole_rankings_follow_the_rule_and_equal_the_embedded_store(store, embedded):
    cases = _cases(embedded)
    engine = store.capabilities.engine
    for mode, fusion, filters, q, k in cases:
        case = f"{engine} {mode} {fusion or ''} filters={filters is not None} query={q} k={k}"
        full = _search(store, mode, q, _whole(fusion), filters, FUSIONS.get(fusion))
        got = _search(store, mode, q, k, filters, FUSIONS.get(fusion))
        assert [i for i, _ in full] == _by_rule(full), case  # the whole list, ties by id
        assert [i for i, _ in got] == _by_rule(full)[:k], case  # the cut at k included
        if engine == "milvus" and filters is not None and mode != "dense":
            continue  # Milvus Lite's filtered BM25 takes its statistics from the matches
        reference = _search(embedded, mode, q, k, filters, FUSIONS.get(fusion))
        assert [i for i, _ in got] == [i for i, _ in reference], case


def test_dense_ties_are_exact_and_ranked_by_id(embedded):
    """The reference computed from the vectors alone: a tie is a group of identical
    vectors, ranked among themselves by id, and a cut inside a group keeps its first ids."""
    docs, vectors = _corpus()
    vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    query = _queries()[0]
    scores = vectors @ (query / np.linalg.norm(query))
    order = sorted(range(len(docs)), key=lambda i: (-round(float(scores[i]), 5), docs[i].id))
    expected = [docs[i].id for i in order]
    for k in (1, 4, 7, 12, len(docs)):
        assert [i for i, _ in _search(embedded, "dense", 0, k)] == expected[:k]


def test_a_search_without_a_tie_at_k_asks_once_for_one_more():
    asked = []

    def ask(positions, depth):
        asked.append((list(positions), depth))
        return [(np.arange(50)[:depth], np.linspace(1, 0, 50)[:depth]) for _ in positions]

    ranked = in_rank_order(past_ties(ask, 3, 10), 10, lambda keys: pytest.fail("read ids"))
    assert asked == [([0, 1, 2], 11)]
    assert [r.keys.tolist() for r in ranked] == [list(range(10))] * 3


def test_a_tie_at_k_is_fetched_deeper_until_complete_for_that_query_only():
    scores = np.array([9.0] + [5.0] * 30 + [1.0] * 9)  # 30 tied from place 2 to 31
    ids = {key: f"id-{(key * 7) % 40:02d}" for key in range(40)}
    asked = []

    def ask(positions, depth):
        asked.append((list(positions), depth))
        plain = (np.arange(40)[:depth], np.linspace(1, 0, 40)[:depth])
        tied = (np.arange(40)[:depth], scores[:depth])
        return [tied if p == 1 else plain for p in positions]

    ranked = past_ties(ask, 2, 5)
    assert asked == [([0, 1], 6), ([1], 12), ([1], 24), ([1], 48)]
    assert len(ranked[1].keys) == 40
    read = []

    def ids_at(keys):
        read.append(keys)
        return {key: ids[key] for key in keys}

    cut = in_rank_order(ranked, 5, ids_at)
    assert read == [list(range(1, 31))]  # the tied documents' ids, read once
    tied_by_id = sorted(range(1, 31), key=ids.get)
    assert cut[1].keys.tolist() == [0, *tied_by_id[:4]]
    assert cut[0].keys.tolist() == [0, 1, 2, 3, 4]


def test_ranked_order_is_score_then_id_by_code_point():
    ids = ["d-5", "d-17", "é", "z", "D-9"]
    order = ranked_order(ids, np.array([1.0, 1.0, 2.0, 2.0, 1.0]))
    assert [ids[i] for i in order] == ["z", "é", "D-9", "d-17", "d-5"]


def test_a_tied_document_deleted_meanwhile_is_left_out():
    ranked = [Ranked(np.array([3, 4, 5]), np.array([1.0, 1.0, 1.0]))]
    stored = {3: "b", 5: "a"}  # 4 is gone
    cut = in_rank_order(ranked, 2, lambda keys: {k: stored[k] for k in keys if k in stored})
    assert cut[0].keys.tolist() == [5, 3]


def test_ids_that_came_with_the_ranking_are_not_read_again():
    documents = {1: ("b", "", "", {}), 2: ("a", "", "", {})}
    ranked = [Ranked(np.array([1, 2]), np.array([0.5, 0.5]), documents)]
    cut = in_rank_order(ranked, 2, lambda keys: pytest.fail(f"read {keys}"))
    assert cut[0].keys.tolist() == [2, 1] and cut[0].documents == documents


@pytest.mark.parametrize("scale", [0.5, 7.0])  # TIE is relative above 1
def test_scores_near_the_tie_width_cut_as_the_rule_orders_them(scale):
    """Gaps around TIE (equal, inside, just outside, far) at every place of a ranking: each
    ranking cut to k is the rule's order of the whole ranking cut to k, and a ranking asks
    for more exactly when its last score ties with its k-th."""
    rng = random.Random(7)
    gaps = [0.0, 0.5, 0.99, 1.0, 1.005, 1.02, 1.5, 1.99, 2.0, 2.01, 3.0, 50.0]
    for trial in range(400):
        n, k = rng.randint(1, 14), rng.randint(1, 12)
        steps = [rng.choice(gaps) * TIE * max(1.0, scale) for _ in range(n - 1)]
        scores = scale - np.cumsum([0.0, *steps])
        ids = [f"d{rng.randrange(10**6):06d}" for _ in range(n)]
        ranking = Ranked(np.arange(n), scores)
        cut = in_rank_order([ranking], k, lambda keys, ids=ids: {i: ids[i] for i in keys})
        assert cut[0].keys.tolist() == ranked_order(ids, scores)[:k], (trial, scores.tolist(), k)
        asked = []
        past_ties(lambda at, depth, r=ranking, asked=asked: asked.append(depth) or [r], 1, k)
        full_tie = n >= k + 1 and _ties(scores, k - 1, n - 1)
        assert (len(asked) > 1) == full_tie, (trial, scores.tolist(), k)


def _ties(scores, i: int, j: int) -> bool:
    """Whether places ``i`` and ``j`` (best first) are in one group of the rule."""
    groups = tie_groups(scores)
    return groups[i] == groups[j]
