"""Hard-negative mining: never a positive, range and margin rules, blocks, files and CLI."""

import json
import random

import numpy as np
import pytest
from typer.testing import CliRunner

from densefit.data.readers import read_training_data
from densefit.data.types import Document, TrainingExample
from densefit.mine import mine_files, mine_hard_negatives, parse_range, write_mined
from densefit.retrieval.encode import encode_texts

pytest.importorskip("bm25s")

TOPICS = ["cell", "gene", "virus", "heart", "brain", "drug", "blood", "protein"]
WORDS = "cancer risk disease patients study effect increase decrease dose trial mice human".split()


def make_corpus(n=120, seed=0):
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        words = [topic] * rng.randint(1, 3) + rng.sample(WORDS, 4)
        docs.append(Document(f"d{i}", " ".join(words) + f" n{i}"))
    # d_copy repeats the text of d0 under another id: text-identical to a positive
    docs.append(Document("d_copy", docs[0].text))
    return docs


def make_pairs(corpus):
    pairs = []
    for q in range(16):
        topic = TOPICS[q % len(TOPICS)]
        positive = corpus[q]  # same topic as the query
        others = tuple(d.id for d in corpus[q + 8 : q + 9])  # a second known positive
        pairs.append(
            TrainingExample(
                f"{topic} {WORDS[q % len(WORDS)]} study",
                positive.text,
                positive_id=positive.id,
                positive_ids=(positive.id, *others),
            )
        )
    # a pair whose positive is not in the corpus, and one sharing a query with the first
    pairs.append(TrainingExample("cell cancer study", "a text that is nowhere in the corpus"))
    pairs.append(TrainingExample(pairs[0].query, corpus[40].text, positive_id="d40"))
    return pairs


CORPUS = make_corpus()
PAIRS = make_pairs(CORPUS)
TEXT = {d.id: d.text for d in CORPUS}


def positives_of(query, pairs=PAIRS):
    """Every id that is a positive of ``query`` in ``pairs``, and every text of those."""
    ids, texts = set(), set()
    for p in pairs:
        if p.query == query:
            ids |= {*p.positive_ids, p.positive_id} - {""}
            texts.add(p.positive)
    texts |= {TEXT[i] for i in ids if i in TEXT}
    ids |= {d.id for d in CORPUS if d.text in texts}
    return ids, texts


def check_no_positive(rows):
    for row in rows:
        ids, texts = positives_of(row.query)
        assert not set(row.negative_ids) & ids, row
        assert not set(row.negatives) & texts, row
        assert len(set(row.negatives)) == len(row.negatives)
        assert [TEXT[i] for i in row.negative_ids] == list(row.negatives)


@pytest.mark.parametrize("method", ["bm25", "dense", "hybrid"])
def test_mining_never_returns_a_positive(method, tiny):
    rows, report = mine_hard_negatives(
        PAIRS,
        CORPUS,
        method=method,
        model=tiny,
        num_negatives=5,
        range_min=0,
        range_max=60,
        show_progress=False,
    )
    assert len(rows) == len(PAIRS) and report.rows == len(PAIRS)
    check_no_positive(rows)
    assert report.skipped_positives > 0 and report.positives_outside_corpus == 1
    assert all(len(r.negatives) == 5 for r in rows)
    # ids travel with the rows: the query's known positives, this row's positive id
    assert rows[0].positive_ids == tuple(sorted({"d0", "d8", "d_copy", "d40"}))
    assert rows[0].positive_id == "d0" and rows[-2].positive_id == ""


def dense_ranking(model, docs, query, exclude):
    """Reference: the full cosine ranking of the corpus, positives removed."""
    q = encode_texts(model, [query], normalize=True)[0]
    scores = docs @ q
    order = [i for i in np.argsort(-scores, kind="stable") if CORPUS[i].id not in exclude]
    return [CORPUS[i].id for i in order], {d.id: float(s) for d, s in zip(CORPUS, scores)}


@pytest.mark.parametrize("margin", [None, 0.05])
def test_dense_range_and_margin_rules(tiny, margin):
    rows, report = mine_hard_negatives(
        PAIRS,
        CORPUS,
        method="dense",
        model=tiny,
        num_negatives=4,
        range_min=5,
        range_max=30,
        relative_margin=margin,
        show_progress=False,
        query_block=3,
    )
    positive_emb = dict(
        zip(
            [p.positive for p in PAIRS],
            encode_texts(tiny, [p.positive for p in PAIRS], normalize=True),
        )
    )
    docs = encode_texts(tiny, [d.text for d in CORPUS], normalize=True)
    for row in rows:
        ids, _ = positives_of(row.query)
        ranking, scores = dense_ranking(tiny, docs, row.query, ids)
        ranks = [ranking.index(i) + 1 for i in row.negative_ids]
        assert all(5 < r <= 30 for r in ranks), ranks
        assert ranks == sorted(ranks)  # hardest first
        if margin is None:
            # exactly the next distinct texts after the first 5 (copies of a text tie)
            distinct = list(dict.fromkeys(TEXT[i] for i in ranking[5:]))
            assert list(row.negatives) == distinct[:4]
        else:
            q = encode_texts(tiny, [row.query], normalize=True)[0]
            pos = float(positive_emb[row.positive] @ q)
            assert all(scores[i] <= pos - margin * abs(pos) + 1e-5 for i in row.negative_ids)
    if margin is not None:
        assert report.skipped_margin > 0


def test_bm25_ranks_in_range():
    import bm25s

    rows, _ = mine_hard_negatives(
        PAIRS[:16], CORPUS, num_negatives=3, range_min=4, range_max=40, show_progress=False
    )
    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize([d.text for d in CORPUS], stopwords="en", show_progress=False),
        show_progress=False,
    )
    for row in rows:
        ids, _ = positives_of(row.query, PAIRS[:16])
        tokens = bm25s.tokenize([row.query], stopwords="en", return_ids=False, show_progress=False)[
            0
        ]
        scores = retriever.get_scores_from_ids(retriever.get_tokens_ids(tokens))
        order = np.lexsort((np.arange(len(CORPUS)), -scores))
        ranking = [CORPUS[i].id for i in order if CORPUS[i].id not in ids and scores[i] > 0]
        assert [ranking.index(i) + 1 for i in row.negative_ids] == [5, 6, 7]


def test_query_blocks_do_not_change_the_result(tiny):
    kwargs = dict(
        method="dense", model=tiny, num_negatives=3, range_min=2, range_max=20, show_progress=False
    )
    small, _ = mine_hard_negatives(PAIRS, CORPUS, query_block=2, **kwargs)
    large, _ = mine_hard_negatives(PAIRS, CORPUS, query_block=1000, **kwargs)
    assert [r.negative_ids for r in small] == [r.negative_ids for r in large]


def test_dense_search_is_blocked_over_queries(tiny, monkeypatch):
    import densefit.mine

    seen = []
    original = densefit.mine.exact_search

    def spy(vectors, queries, k, **kw):
        seen.append(len(queries))
        return original(vectors, queries, k, **kw)

    monkeypatch.setattr(densefit.mine, "exact_search", spy)
    mine_hard_negatives(
        PAIRS,
        CORPUS,
        method="dense",
        model=tiny,
        num_negatives=2,
        range_min=0,
        range_max=10,
        query_block=4,
        show_progress=False,
    )
    assert max(seen) <= 4 and sum(seen) == len({p.query for p in PAIRS})


def test_random_sampling_stays_in_range_and_is_seeded(tiny):
    """sampling="random" draws from ranks range_min+1 .. range_max of the full ranking (the
    positives removed), keeps them hardest first, repeats with the same seed and changes
    with another one; the draw reaches past the hardest candidates."""
    kwargs = dict(
        method="dense", model=tiny, num_negatives=3, range_min=5, range_max=30,
        sampling="random", show_progress=False,
    )  # fmt: skip
    a, _ = mine_hard_negatives(PAIRS, CORPUS, seed=1, **kwargs)
    again, _ = mine_hard_negatives(PAIRS, CORPUS, seed=1, **kwargs)
    other, _ = mine_hard_negatives(PAIRS, CORPUS, seed=2, **kwargs)
    assert [r.negative_ids for r in a] == [r.negative_ids for r in again]
    changed = sum(x.negative_ids != y.negative_ids for x, y in zip(a, other, strict=True))
    assert changed >= len(a) // 2, changed
    check_no_positive(a)
    check_no_positive(other)
    docs = encode_texts(tiny, [d.text for d in CORPUS], normalize=True)
    drawn = []
    for row in a + other:
        ids, _ = positives_of(row.query)
        ranking, _ = dense_ranking(tiny, docs, row.query, ids)
        ranks = [ranking.index(i) + 1 for i in row.negative_ids]
        assert len(ranks) == 3 and all(5 < r <= 30 for r in ranks), ranks
        assert ranks == sorted(ranks)  # hardest first
        drawn += ranks
    assert max(drawn) > 20 and sum(r > 8 for r in drawn) > len(drawn) // 2  # not the top 3


def test_clear_errors(tiny):
    with pytest.raises(ValueError, match="--model"):
        mine_hard_negatives(PAIRS, CORPUS, method="dense")
    with pytest.raises(ValueError, match="method"):
        mine_hard_negatives(PAIRS, CORPUS, method="splade")
    with pytest.raises(ValueError, match="cannot fit"):
        mine_hard_negatives(PAIRS, CORPUS, num_negatives=5, range_min=10, range_max=12)
    with pytest.raises(ValueError, match="margin"):
        mine_hard_negatives(PAIRS, CORPUS, relative_margin=1.5)
    with pytest.raises(ValueError, match="MIN:MAX"):
        parse_range("10-100")
    with pytest.raises(ValueError, match="0 <= MIN < MAX"):
        parse_range("50:10")


@pytest.mark.parametrize("k", [1, 3])
def test_written_rows_read_back_with_ids(tmp_path, k):
    rows, _ = mine_hard_negatives(
        PAIRS, CORPUS, num_negatives=k, range_min=0, range_max=20, show_progress=False
    )
    path = write_mined(tmp_path / "mined.jsonl", rows, num_negatives=k)
    first = json.loads(path.read_text().splitlines()[0])
    assert ("neg_doc" in first) if k == 1 else ("negative_1" in first and "anchor" in first)
    back, _ = read_training_data(path)
    for got, want in zip(back, rows, strict=True):
        assert (got.query, got.positive, got.negatives) == (
            want.query,
            want.positive,
            want.negatives,
        )
        assert (got.positive_id, got.positive_ids, got.negative_ids) == (
            want.positive_id,
            want.positive_ids,
            want.negative_ids,
        )


def write_beir(folder):
    folder.mkdir()
    (folder / "qrels").mkdir()
    with open(folder / "corpus.jsonl", "w") as f:
        for d in CORPUS[:-1]:
            f.write(json.dumps({"_id": d.id, "title": "", "text": d.text}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        for q in range(16):
            f.write(json.dumps({"_id": f"q{q}", "text": PAIRS[q].query}) + "\n")
    lines = ["query-id\tcorpus-id\tscore"]
    lines += [f"q{q}\td{q}\t1" for q in range(16)] + [f"q{q}\td{q + 8}\t1" for q in range(4)]
    (folder / "qrels" / "train.tsv").write_text("\n".join(lines) + "\n")


def test_cli_mines_a_beir_folder(tmp_path):
    from densefit.cli import app

    folder = tmp_path / "beir"
    write_beir(folder)
    out = tmp_path / "mined.jsonl"
    result = CliRunner().invoke(
        app,
        [
            "mine",
            str(folder),
            "--corpus",
            str(folder),
            "--method",
            "bm25",
            "--num-negatives",
            "2",
            "--range",
            "0:40",
            "--relative-margin",
            "0.05",
            "--output",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    rows, _ = read_training_data(out)
    assert len(rows) == 20
    for row in rows:
        assert row.positive_id not in row.negative_ids
        assert not set(row.negative_ids) & set(row.positive_ids)
    assert rows[0].positive_ids == ("d0", "d8")  # q0 has two judged positives


def test_cli_errors_are_clear(tmp_path):
    from densefit.cli import app

    folder = tmp_path / "beir"
    write_beir(folder)
    runner = CliRunner()
    base = ["mine", str(folder), "--corpus", str(folder), "--output", str(tmp_path / "o.jsonl")]
    result = runner.invoke(app, [*base, "--num-negatives", "0"])
    assert result.exit_code == 2 and "--num-negatives must be >= 1" in result.output
    result = runner.invoke(app, [*base, "--range", "abc"])
    assert result.exit_code == 2 and "MIN:MAX" in result.output
    result = runner.invoke(
        app,
        [
            "mine",
            str(tmp_path / "missing.jsonl"),
            "--corpus",
            str(folder),
            "--output",
            str(tmp_path / "o.jsonl"),
            "--no-progress",
        ],
    )
    assert result.exit_code == 2


def test_mined_file_trains_with_masking(tmp_path, tiny):
    from densefit import TrainConfig, train

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"anchor": p.query, "positive": p.positive}) + "\n" for p in PAIRS)
    )
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": d.id, "text": d.text}) + "\n" for d in CORPUS))
    out = tmp_path / "mined.jsonl"
    report = mine_files(
        pairs, corpus, out, num_negatives=2, range_min=0, range_max=10, show_progress=False
    )
    assert report.rows == len(PAIRS) and "read" in report.seconds
    rows, _ = read_training_data(out)
    assert rows[0].positive_id == "d0"  # found in the corpus by its text
    records = []
    train(
        tiny,
        rows,
        TrainConfig(batch_size=len(rows), max_steps=1, show_progress=False),
        on_step=records.append,
    )
    # rows 0 and 17 share a query: each one's positive is a known positive of the other
    assert records[0]["masked_known_positives"] >= 2


def test_precomputed_corpus_embeddings_give_the_same_negatives(tiny):
    kwargs = dict(method="dense", model=tiny, num_negatives=3, range_min=2, range_max=20)
    vectors = encode_texts(tiny, [d.text for d in CORPUS], normalize=True)
    given, _ = mine_hard_negatives(
        PAIRS, CORPUS, corpus_embeddings=vectors, show_progress=False, **kwargs
    )
    fresh, _ = mine_hard_negatives(PAIRS, CORPUS, show_progress=False, **kwargs)
    assert [r.negative_ids for r in given] == [r.negative_ids for r in fresh]
    with pytest.raises(ValueError, match="one row per corpus document"):
        mine_hard_negatives(
            PAIRS, CORPUS, corpus_embeddings=vectors[:5], show_progress=False, **kwargs
        )


def test_bm25_margin_rule():
    import bm25s

    margin = 0.3
    rows, report = mine_hard_negatives(
        PAIRS[:16],
        CORPUS,
        num_negatives=3,
        range_min=0,
        range_max=60,
        relative_margin=margin,
        show_progress=False,
    )
    retriever = bm25s.BM25()
    tokens = bm25s.tokenize([d.text for d in CORPUS], stopwords="en", show_progress=False)
    retriever.index(tokens, show_progress=False)
    index_of = {d.id: i for i, d in enumerate(CORPUS)}
    for row in rows:
        query = bm25s.tokenize([row.query], stopwords="en", return_ids=False, show_progress=False)
        scores = retriever.get_scores_from_ids(retriever.get_tokens_ids(query[0]))
        pos = scores[index_of[row.positive_id]]
        assert all(scores[index_of[i]] <= (1 - margin) * pos + 1e-5 for i in row.negative_ids)
    assert report.skipped_margin > 0
