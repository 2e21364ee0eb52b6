"""Readers of training data, corpora, queries and qrels: every format, every bad row."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from densefit.data import BadRowError, Document
from densefit.data.corpus import (
    iter_corpus,
    load_beir,
    read_corpus,
    read_qrels,
    read_queries,
)
from densefit.data.readers import examples_from_records, read_training_data
from densefit.data.types import ReadReport


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    if path.name.endswith(".gz"):
        content = gzip.compress(content)
    path.write_bytes(content)
    return path


def jsonl(*rows: dict) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


# ----------------------------------------------------------------------------- formats


def test_jsonl_sentence_transformers_columns(tmp_path):
    path = write(
        tmp_path / "train.jsonl",
        jsonl(
            {
                "anchor": "q1",
                "positive": "p1",
                "negative_2": "n2",
                "negative_10": "n10",
                "negative_1": "n1",
                "score": 0.5,
                "source": "ignored",
            },
            {"query": "q2", "positive": "p2", "negative": ["a", "b"], "label": 1},
        ),
    )
    (first, second), report = read_training_data(path)
    assert (first.query, first.positive, first.negatives, first.score) == (
        "q1",
        "p1",
        ("n1", "n2", "n10"),
        0.5,
    )
    assert (second.query, second.negatives, second.score) == ("q2", ("a", "b"), 1.0)
    assert (first.origin, second.origin) == (f"{path}:1", f"{path}:2")
    assert (report.rows, report.skipped) == (2, [])


@pytest.mark.parametrize("neg_doc, expected", [("n", ("n",)), (["n", "m"], ("n", "m")), (None, ())])
def test_jsonl_haystack_columns(tmp_path, neg_doc, expected):
    row = {"question": "q", "pos_doc": "p", "neg_doc": neg_doc, "score": 3}
    [example], _ = read_training_data(write(tmp_path / "h.jsonl", jsonl(row)))
    assert (example.query, example.positive, example.negatives, example.score) == (
        "q",
        "p",
        expected,
        3.0,
    )


@pytest.mark.parametrize("name", ["train.json", "train.jsonl.gz", "TRAIN.JSONL"])
def test_json_lines_suffixes(tmp_path, name):
    path = write(tmp_path / name, jsonl({"anchor": "q", "positive": "p"}) + "\n  \n")
    examples, report = read_training_data(path)
    assert [e.query for e in examples] == ["q"] and report.rows == 1


def test_blank_lines_are_ignored_and_lines_are_physical(tmp_path):
    path = write(
        tmp_path / "t.jsonl", '\n{"anchor": "q", "positive": "p"}\r\n\n\t\n{"anchor": 1}\n'
    )
    with pytest.raises(BadRowError, match=rf"^{path}:5: field 'anchor'"):
        read_training_data(path)


def test_utf8_bom_is_ignored(tmp_path):
    path = write(
        tmp_path / "t.jsonl", b"\xef\xbb\xbf" + jsonl({"anchor": "q", "positive": "p"}).encode()
    )
    assert read_training_data(path)[0][0].query == "q"


def test_csv_with_negatives_and_quoted_multiline_rows(tmp_path):
    path = write(
        tmp_path / "t.csv",
        "anchor,positive,negative_1,negative_2,score\n"
        'q1,"p1, with comma",n1,,0.25\n'
        'q2,"two\nlines",,,\n'
        "q3,p3,n1,n2,x\n",
    )
    with pytest.raises(BadRowError, match=rf"^{path}:5: field 'score': expected a number"):
        read_training_data(path)  # the quoted row spans lines 3-4, so q3 is on line 5
    (one, two), report = read_training_data(path, on_bad_row="skip")
    assert (one.positive, one.negatives, one.score) == ("p1, with comma", ("n1",), 0.25)
    assert (two.positive, two.negatives, two.score, two.origin) == (
        "two\nlines",
        (),
        None,
        f"{path}:3",
    )
    assert report.skipped == [(f"{path}:5", "field 'score': expected a number, got 'x'")]


def test_tsv_has_no_quoting(tmp_path):
    path = write(tmp_path / "t.tsv", 'question\tpos_doc\tneg_doc\n"quoted" q\tp "x\tn\n')
    [example], _ = read_training_data(path)
    assert (example.query, example.positive, example.negatives) == ('"quoted" q', 'p "x', ("n",))


def test_parquet(tmp_path):
    table = pa.table(
        {
            "anchor": ["q1", "q2", None],
            "positive": ["p1", "p2", "p3"],
            "negative": [["n1", "n2"], None, ["n3"]],
            "score": [1.0, None, 2.0],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    path = tmp_path / "t.parquet"
    with pytest.raises(BadRowError, match=rf"^{path}:row 3: missing 'anchor' or 'query'"):
        read_training_data(path)
    (one, two), report = read_training_data(path, on_bad_row="skip")
    assert (one.negatives, one.score, one.origin) == (("n1", "n2"), 1.0, f"{path}:row 1")
    assert (two.negatives, two.score) == ((), None)
    assert [origin for origin, _ in report.skipped] == [f"{path}:row 3"]


def test_unreadable_parquet_names_the_file(tmp_path):
    path = write(tmp_path / "t.parquet", b"not parquet at all")
    with pytest.raises(ValueError, match=rf"^{path}: cannot read this Parquet file"):
        read_training_data(path)


def test_unknown_suffix_lists_the_formats(tmp_path):
    path = write(tmp_path / "t.xlsx", b"x")
    with pytest.raises(ValueError, match=r"\.jsonl, \.json, \.jsonl\.gz, \.csv, \.tsv, \.parquet"):
        read_training_data(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl: no such file"):
        read_training_data(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    "name, content",
    [("c.jsonl", jsonl({"_id": "1", "text": "t"})), ("c.csv", "id,text\n1,t\n")],
)
def test_a_file_without_query_and_positive_columns(tmp_path, name, content):
    path = write(tmp_path / name, content)
    with pytest.raises(ValueError, match=rf"^{path}: found the columns \[.*'text'\].*'anchor'"):
        read_training_data(path, on_bad_row="skip")


@pytest.mark.parametrize("content", ["", "\n\n", "anchor,positive\n"])
def test_empty_files(tmp_path, content):
    path = write(tmp_path / ("t.csv" if "," in content else "t.jsonl"), content)
    with pytest.raises(ValueError, match=rf"^{path}: no training rows"):
        read_training_data(path)


def test_only_bad_rows_is_an_error_in_skip_mode(tmp_path):
    path = write(tmp_path / "t.jsonl", '{"anchor": "q"}\n')
    with pytest.raises(
        ValueError, match=rf"no training rows \(1 bad rows skipped; the first: {path}:1"
    ):
        read_training_data(path, on_bad_row="skip")


def test_corpus_argument_is_for_beir_folders_only(tmp_path):
    path = write(tmp_path / "t.jsonl", jsonl({"anchor": "q", "positive": "p"}))
    with pytest.raises(ValueError, match="only used with BEIR folders"):
        read_training_data(path, corpus={})


def test_on_bad_row_must_be_error_or_skip(tmp_path):
    path = write(tmp_path / "t.jsonl", jsonl({"anchor": "q", "positive": "p"}))
    with pytest.raises(ValueError, match="on_bad_row must be 'error' or 'skip'"):
        read_training_data(path, on_bad_row="ignore")


# ----------------------------------------------------------------------------- bad rows

GOOD = '{"anchor": "q", "positive": "p"}\n'
BAD_ROWS = [
    # (second line as bytes, field, message fragment)
    (b'{"anchor": "q", "positive": \n', None, "invalid JSON at column"),
    (b'["q", "p"]\n', None, "expected a JSON object, got a list"),
    (b'"q"\n', None, "expected a JSON object, got str"),
    (b'{"positive": "p"}\n', None, "missing 'anchor' or 'query' or 'question'"),
    (b'{"anchor": "q"}\n', None, "missing 'positive' or 'pos_doc'"),
    (b'{"anchor": "  \\t", "positive": "p"}\n', "anchor", "is empty"),
    (b'{"anchor": 7, "positive": "p"}\n', "anchor", "expected text, got int"),
    (b'{"question": "q", "pos_doc": ["p"]}\n', "pos_doc", "expected text, got a list"),
    (b'{"anchor": "q", "positive": "p", "neg_doc": [1]}\n', "neg_doc", "expected text, got int"),
    (b'{"anchor": "q", "positive": "p", "negative": {}}\n', "negative", "text or a list of texts"),
    (b'{"anchor": "q", "positive": "p", "negative_1": ""}\n', "negative_1", "is empty"),
    (b'{"anchor": "q", "positive": "p", "score": "high"}\n', "score", "expected a number"),
    (b'{"anchor": "q", "positive": "p", "score": NaN}\n', "score", "finite number"),
    (b'{"anchor": "q", "positive": "p", "label": Infinity}\n', "label", "finite number"),
    (b'{"anchor": "q", "positive": "p", "score": true}\n', "score", "expected a number"),
    (b'{"anchor": "q\xff", "positive": "p"}\n', None, "invalid UTF-8 at byte 14"),
    (b'{"anchor": "q\\ud800", "positive": "p"}\n', "anchor", "broken \\u escape"),
    (b'{"anchor": "q\\u0000", "positive": "p"}\n', "anchor", "NUL character"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", None, "nested too deeply"),
    (b'{"anchor": "q", "positive": "p', None, "truncated last line"),
]


@pytest.mark.parametrize("line, field, fragment", BAD_ROWS)
def test_bad_rows_name_file_line_and_field(tmp_path, line, field, fragment):
    last = line.endswith(b"\n")  # else the bad row is a truncated last line
    path = write(tmp_path / "t.jsonl", GOOD.encode() + line + (GOOD.encode() if last else b""))
    with pytest.raises(BadRowError) as caught:
        read_training_data(path)
    error = caught.value
    assert (error.origin, error.field) == (f"{path}:2", field)
    assert str(error).startswith(f"{path}:2: ")
    assert fragment in error.problem
    assert "--on-bad-row skip" in str(error)
    examples, report = read_training_data(path, on_bad_row="skip")
    assert report.rows == len(examples) == 1 + last
    assert [origin for origin, _ in report.skipped] == [f"{path}:2"]


def test_a_valid_last_line_without_newline_is_fine(tmp_path):
    path = write(tmp_path / "t.jsonl", GOOD + GOOD.strip())
    assert len(read_training_data(path)[0]) == 2


def test_a_json_array_file_gets_a_conversion_hint(tmp_path):
    path = write(tmp_path / "t.json", '[\n  {"anchor": "q", "positive": "p"}\n]\n')
    with pytest.raises(BadRowError, match=r"t.json:1: a JSON array.*jq -c"):
        read_training_data(path)


@pytest.mark.parametrize(
    "content, line, field, fragment",
    [
        ("anchor,positive\nq,p\nq,p,extra\n", 3, None, "3 fields, but the header has 2"),
        (b"anchor,positive\nq,p\nq\xff,p\n", 3, "anchor", "invalid UTF-8"),
        ("anchor,positive\nq,p\n,p\n", 3, None, "missing 'anchor'"),
        ("anchor,positive\nq,p\n\n  ,p\n", 4, "anchor", "is empty"),
    ],
)
def test_csv_bad_rows(tmp_path, content, line, field, fragment):
    path = write(tmp_path / "t.csv", content)
    with pytest.raises(BadRowError) as caught:
        read_training_data(path)
    assert (caught.value.origin, caught.value.field) == (f"{path}:{line}", field)
    assert fragment in caught.value.problem
    examples, report = read_training_data(path, on_bad_row="skip")
    assert (len(examples), report.skipped[0][0]) == (1, f"{path}:{line}")


def test_an_empty_negative_cell_is_no_negative_and_an_empty_positive_a_bad_row(tmp_path):
    """As the README says: a CSV row cannot leave a column out, so an empty neg_doc cell
    means that row has no negative; an empty positive cell is a bad row."""
    path = write(tmp_path / "n.csv", "question,pos_doc,neg_doc\nq1,p1,\nq2,p2,n2\n")
    examples, _ = read_training_data(path)
    assert [e.negatives for e in examples] == [(), ("n2",)]
    bad = write(tmp_path / "p.csv", "question,pos_doc,neg_doc\nq1,,n1\nq2,p2,n2\n")
    with pytest.raises(BadRowError, match="missing"):
        read_training_data(bad)


def test_csv_header_problems_are_errors_even_when_skipping(tmp_path):
    duplicate = write(tmp_path / "d.csv", "anchor,positive,anchor\nq,p,q\n")
    with pytest.raises(ValueError, match=rf"^{duplicate}:1: duplicate column names \['anchor'\]"):
        read_training_data(duplicate, on_bad_row="skip")
    undecodable = write(tmp_path / "u.csv", b"anch\xffor,positive\nq,p\n")
    with pytest.raises(ValueError, match=rf"^{undecodable}:1: the header row is not valid UTF-8"):
        read_training_data(undecodable, on_bad_row="skip")


def test_skip_mode_counts_and_origins(tmp_path):
    lines = [GOOD, "{bad\n", GOOD, "\n", '{"anchor": ""}\n', "[1]\n", GOOD]
    path = write(tmp_path / "t.jsonl", "".join(lines))
    examples, report = read_training_data(path, on_bad_row="skip")
    assert [e.origin for e in examples] == [f"{path}:{n}" for n in (1, 3, 7)]
    assert [origin for origin, _ in report.skipped] == [f"{path}:{n}" for n in (2, 5, 6)]
    assert report.skipped[1] == (f"{path}:5", "field 'anchor': is empty")
    assert "3 rows read, 3 bad rows skipped" in report.summary()


def test_corrupt_gzip_names_the_file(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(GOOD.encode() * 50)[:-12])
    with pytest.raises(ValueError, match=rf"^{path}: cannot read this gzip file"):
        read_training_data(path)


# ----------------------------------------------------------------------------- Python records


def test_examples_from_haystack_records():
    records = [
        {"question": "q1", "pos_doc": "p1", "neg_doc": ["n1", "n2"], "score": 0.1},
        {"question": "q2", "pos_doc": "p2", "neg_doc": "n3"},
    ]
    examples, report = examples_from_records(records)
    assert [e.negatives for e in examples] == [("n1", "n2"), ("n3",)]
    assert [e.origin for e in examples] == ["<list>:0", "<list>:1"]
    assert report.rows == 2


def test_examples_from_records_reports_bad_records():
    records = [{"anchor": "q", "positive": "p"}, "not a dict", {"anchor": "q", "positive": 5}]
    with pytest.raises(BadRowError, match=r"^mine:1: expected a dict, got str"):
        examples_from_records(records, origin="mine")
    examples, report = examples_from_records(records, origin="mine", on_bad_row="skip")
    assert len(examples) == 1
    assert report.skipped == [
        ("mine:1", "expected a dict, got str"),
        ("mine:2", "field 'positive': expected text, got int"),
    ]
    with pytest.raises(ValueError, match="^<list>: no training rows"):
        examples_from_records([])


# ----------------------------------------------------------------------------- BEIR


def make_beir(
    root: Path, corpus_name: str = "corpus.jsonl", queries_name: str = "queries.jsonl"
) -> Path:
    write(
        root / corpus_name,
        jsonl(
            {"_id": "d1", "title": "Title one", "text": "body one"},
            {"_id": "d2", "title": "", "text": "body two"},
            {"_id": "d3", "text": "body three"},
            {"_id": "d4", "title": "Only title", "text": ""},
        ),
    )
    write(root / queries_name, jsonl(*({"_id": f"q{i}", "text": f"query {i}"} for i in (1, 2, 3))))
    write(
        root / "qrels" / "train.tsv",
        "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t2\nq2\td3\t0\nq2\td4\t1\n",
    )
    write(root / "qrels" / "test.tsv", "query-id\tcorpus-id\tscore\nq3\td1\t1\n")
    return root


@pytest.mark.parametrize(
    ("corpus_name", "queries_name"),
    [("corpus.jsonl", "queries.jsonl"), ("corpus.jsonl.gz", "queries.jsonl.gz")],
)
def test_beir_folder_as_training_pairs(tmp_path, corpus_name, queries_name):
    folder = make_beir(tmp_path / "beir", corpus_name, queries_name)
    examples, report = read_training_data(folder)
    assert [(e.query, e.positive) for e in examples] == [
        ("query 1", "Title one body one"),
        ("query 1", "body two"),
        ("query 2", "Only title"),
    ]
    assert [e.positive_ids for e in examples] == [("d1", "d2"), ("d1", "d2"), ("d4",)]
    assert examples[2].origin == f"{folder}/qrels/train.tsv:5"
    assert report.rows == 3
    [test_pair], _ = read_training_data(folder, split="test")
    assert test_pair.query == "query 3"


def test_beir_training_pairs_can_reuse_a_corpus(tmp_path):
    folder = make_beir(tmp_path / "beir")
    corpus = {d.id: d for d in read_corpus(folder)[0]}
    (folder / "corpus.jsonl").unlink()
    assert len(read_training_data(folder, corpus=corpus)[0]) == 3


def test_beir_folder_missing_parts(tmp_path):
    folder = make_beir(tmp_path / "beir")
    with pytest.raises(
        FileNotFoundError, match=r"dev.tsv: no such file; the splits here are test, train"
    ):
        read_training_data(folder, split="dev")
    (folder / "corpus.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="no corpus.jsonl or corpus.jsonl.gz"):
        load_beir(folder)
    make_beir(folder)
    (folder / "queries.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="no queries.jsonl or queries.jsonl.gz"):
        load_beir(folder)


def test_load_beir(tmp_path):
    folder = make_beir(tmp_path / "beir")
    beir = load_beir(folder, "train")
    assert set(beir.corpus) == {"d1", "d2", "d3", "d4"}
    assert beir.queries == {"q1": "query 1", "q2": "query 2"}  # q3 is judged only in test
    assert beir.qrels == {"q1": {"d1": 1, "d2": 2}, "q2": {"d3": 0, "d4": 1}}
    assert beir.corpus["d1"] == Document("d1", "Title one body one", "Title one")


@pytest.mark.parametrize(
    "row, field, fragment",
    [
        ("q1\tmissing\t1", "corpus-id", "document 'missing' is not in corpus.jsonl"),
        ("q9\td1\t1", "query-id", "query 'q9' is not in queries.jsonl"),
        ("q1\td1\t1", None, "duplicate judgment"),
        ("q1\td3\thigh", "score", "expected an integer relevance"),
        ("q1\td3", None, "2 fields, but the header has 3"),
    ],
)
def test_load_beir_bad_judgments(tmp_path, row, field, fragment):
    folder = make_beir(tmp_path / "beir")
    qrels = write(folder / "qrels" / "test.tsv", f"query-id\tcorpus-id\tscore\nq1\td1\t1\n{row}\n")
    with pytest.raises(BadRowError) as caught:
        load_beir(folder)
    assert (caught.value.origin, caught.value.field) == (f"{qrels}:3", field)
    assert fragment in str(caught.value)
    beir = load_beir(folder, on_bad_row="skip")
    assert beir.qrels == {"q1": {"d1": 1}}
    assert [origin for origin, _ in beir.report.skipped] == [f"{qrels}:3"]


# ----------------------------------------------------------------------------- corpus, queries, qrels


def test_read_corpus_jsonl_ids_titles_and_report(tmp_path):
    path = write(
        tmp_path / "c.jsonl",
        jsonl(
            {"_id": "a", "text": "x"},
            {"id": 7, "title": "T", "text": "y"},
            {"_id": "b", "title": "T"},
        ),
    )
    docs, report = read_corpus(path)
    assert docs == [Document("a", "x"), Document("7", "T y", "T"), Document("b", "T", "T")]
    assert report.rows == 3


@pytest.mark.parametrize("name", ["c.csv", "c.tsv", "c.parquet"])
def test_read_corpus_tabular(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"id": [1, 2], "title": ["T", None], "text": ["x", "y"]}), path)
    else:
        sep = "," if name.endswith(".csv") else "\t"
        write(path, f"id{sep}title{sep}text\n1{sep}T{sep}x\n2{sep}{sep}y\n")
    assert read_corpus(path)[0] == [Document("1", "T x", "T"), Document("2", "y")]


def test_duplicate_document_ids_name_both_lines(tmp_path):
    path = write(
        tmp_path / "c.jsonl",
        jsonl({"_id": "a", "text": "x"}, {"_id": "b", "text": "y"}, {"_id": "a", "text": "z"}),
    )
    with pytest.raises(
        BadRowError, match=rf"^{path}:3: duplicate document id 'a' \(first at {path}:1\)"
    ):
        read_corpus(path)
    docs, report = read_corpus(path, on_bad_row="skip")
    assert [d.text for d in docs] == ["x", "y"]
    assert [origin for origin, _ in report.skipped] == [f"{path}:3"]


@pytest.mark.parametrize(
    "row, field, fragment",
    [
        ({"_id": "b"}, "text", "empty document"),
        ({"_id": "b", "text": " ", "title": ""}, "text", "empty document"),
        ({"text": "x"}, None, "missing '_id' or 'id'"),
        ({"_id": 1.5, "text": "x"}, "_id", "expected text or an integer, got float"),
        ({"_id": "b", "text": ["x"]}, "text", "expected text, got a list"),
        ({"_id": "b", "text": "x", "title": 3}, "title", "expected text, got int"),
    ],
)
def test_corpus_bad_rows(tmp_path, row, field, fragment):
    path = write(tmp_path / "c.jsonl", jsonl({"_id": "a", "text": "x"}, row))
    with pytest.raises(BadRowError) as caught:
        read_corpus(path)
    assert (caught.value.origin, caught.value.field) == (f"{path}:2", field)
    assert fragment in caught.value.problem


def test_iter_corpus_streams_and_reports(tmp_path):
    path = write(
        tmp_path / "c.jsonl.gz",
        jsonl({"_id": "a", "text": "x"}) + "oops\n" + jsonl({"_id": "b", "text": "y"}),
    )
    report = ReadReport(str(path))
    stream = iter_corpus(path, on_bad_row="skip", report=report)
    assert next(stream).id == "a" and report.rows == 1
    assert [d.id for d in stream] == ["b"]
    assert (report.rows, [o for o, _ in report.skipped]) == (2, [f"{path}:2"])


def test_read_corpus_errors_on_a_wrong_file_or_no_documents(tmp_path):
    queries_like = write(tmp_path / "t.jsonl", jsonl({"anchor": "q", "positive": "p"}))
    with pytest.raises(
        ValueError, match=rf"^{queries_like}: found the columns \['anchor', 'positive'\]"
    ):
        read_corpus(queries_like)
    with pytest.raises(ValueError, match="no document rows"):
        read_corpus(write(tmp_path / "e.jsonl", ""))


def test_read_queries_and_qrels(tmp_path):
    queries = write(
        tmp_path / "queries.jsonl",
        jsonl({"_id": "1", "text": "a?", "metadata": {}}, {"_id": 2, "text": "b?"}),
    )
    assert read_queries(queries) == {"1": "a?", "2": "b?"}
    qrels = write(tmp_path / "q.tsv", "query-id\tcorpus-id\tscore\n1\td1\t1\n1\td2\t0\n2\td1\t2\n")
    assert read_qrels(qrels) == {"1": {"d1": 1, "d2": 0}, "2": {"d1": 2}}


def test_query_and_qrels_errors(tmp_path):
    queries = write(
        tmp_path / "queries.jsonl", jsonl({"_id": "1", "text": "a"}, {"_id": "1", "text": "b"})
    )
    with pytest.raises(
        BadRowError, match=rf"^{queries}:2: duplicate query id '1' \(first at {queries}:1\)"
    ):
        read_queries(queries)
    empty_text = write(tmp_path / "q2.jsonl", jsonl({"_id": "1", "text": ""}))
    with pytest.raises(BadRowError, match=rf"^{empty_text}:1: field 'text': is empty"):
        read_queries(empty_text)
    headerless = write(tmp_path / "h.tsv", "1\td1\t2\n2\td2\t1\n")
    with pytest.raises(ValueError, match=r"h.tsv: found the columns .* header line 'query-id<TAB>"):
        read_qrels(headerless)
    headerless_ones = write(tmp_path / "h1.tsv", "1\td1\t1\n")
    with pytest.raises(
        ValueError, match=r"h1.tsv:1: duplicate column .*first line must be the header"
    ):
        read_qrels(headerless_ones)
    with pytest.raises(ValueError, match="no judgments"):
        read_qrels(write(tmp_path / "e.tsv", "query-id\tcorpus-id\tscore\n"))


# ----------------------------------------------------------------------------- real data


def test_scifact(shared_datasets):
    scifact = shared_datasets / "scifact"
    if not scifact.is_dir():
        pytest.skip("no SciFact in the shared datasets")
    examples, report = read_training_data(scifact, split="train")
    assert len(examples) == 919 and report.n_skipped == 0
    assert all(e.positive and e.positive_ids for e in examples)
    beir = load_beir(scifact, "test")
    assert (len(beir.corpus), len(beir.queries), len(beir.judgments)) == (5183, 300, 339)


def test_load_training_examples_takes_paths_dicts_and_examples(tmp_path):
    from densefit.data import TrainingExample, load_training_examples

    path = tmp_path / "train.jsonl"
    path.write_text('{"anchor": "q1", "positive": "p1"}\n{"anchor": 3, "positive": "p2"}\n')
    with pytest.warns(UserWarning, match=f"{path}:2"):  # the skipped row, by file:line
        rows = load_training_examples(path, on_bad_row="skip")
    assert [(r.query, r.origin) for r in rows] == [("q1", f"{path}:1")]
    with pytest.raises(BadRowError, match=f"{path}:2"):
        load_training_examples(path)
    from_dicts = load_training_examples([{"question": "q", "pos_doc": "d", "neg_doc": ["n"]}])
    assert (from_dicts[0].positive, from_dicts[0].negatives) == ("d", ("n",))
    examples = [TrainingExample("q", "p")]
    assert list(load_training_examples(examples)) == examples


def test_find_corpus_file(tmp_path):
    from densefit.data import find_corpus_file

    (tmp_path / "corpus.jsonl.gz").write_bytes(b"")
    assert find_corpus_file(tmp_path) == tmp_path / "corpus.jsonl.gz"
    assert find_corpus_file(tmp_path / "docs.csv") == tmp_path / "docs.csv"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no corpus.jsonl"):
        find_corpus_file(tmp_path / "empty")


# ----------------------------------------------------------------------------- kept rows == input

# Mixed case, accents, other scripts, emoji, combining marks, quotes, commas and spaces at the
# ends: a reader that lower-cases, strips, normalises or re-encodes any of them is wrong.
TEXTS = [
    "Straße in MÜNCHEN",
    "  Naïve Café, “quoted” and 'single'  ",
    "ΣΊΣΥΦΟΣ and σίσυφος",
    "日本語のテキスト, 한국어",
    "Emoji 🙂 and İstanbul",
    "e\u0301 (combining) vs \u00e9, Ǆ ǅ ǆ",
    'He said "Hi", then LEFT',
    "NaN",
]


def rows_of(texts: list[str]) -> list[dict]:
    """Training rows whose every field is one of ``texts``; negatives, ids and scores too."""
    n = len(texts)
    return [
        {
            "anchor": texts[i],
            "positive": texts[(i + 1) % n],
            "negative": [texts[(i + 2) % n], texts[(i + 3) % n].upper()],
            "score": i / 4 - 1,
            "positive_id": f"Doc-{texts[(i + 1) % n][:4].strip()}-{i}",
        }
        for i in range(n)
    ]


def write_delimited(path: Path, rows: list[dict]) -> None:
    """A CSV file (quoted where needed), or a TSV file (no quoting: no tab or newline here)."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        if path.suffix == ".csv":
            writer = csv.DictWriter(f, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        else:
            for cells in [list(rows[0]), *(list(r.values()) for r in rows)]:
                assert not any("\t" in c or "\n" in c for c in cells)
                f.write("\t".join(cells) + "\n")


def assert_kept_as_written(examples, rows) -> None:
    assert len(examples) == len(rows)
    for example, row in zip(examples, rows, strict=True):
        assert example.query == row["anchor"]
        assert example.positive == row["positive"]
        assert example.negatives == tuple(row["negative"])
        assert example.score == row["score"]
        if "positive_id" in row:
            assert example.positive_id == row["positive_id"]


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "t.csv", "t.tsv", "t.parquet"])
def test_every_format_keeps_texts_exactly_as_written(tmp_path, name):
    rows = rows_of(TEXTS)
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif name.endswith((".csv", ".tsv")):
        flat = [
            {"anchor": r["anchor"], "positive": r["positive"], "negative_1": r["negative"][0],
             "negative_2": r["negative"][1], "score": repr(r["score"]),
             "positive_id": r["positive_id"]}
            for r in rows
        ]  # fmt: skip
        write_delimited(path, flat)
    else:
        write(
            path, "".join(json.dumps(r, ensure_ascii=i % 2 == 0) + "\n" for i, r in enumerate(rows))
        )
    examples, _ = read_training_data(path)
    assert_kept_as_written(examples, rows)
    # in skip mode, with a bad row among them, the others are still kept as written
    if name.endswith((".jsonl", ".gz")):
        lines = [json.dumps(r, ensure_ascii=False) for r in rows]
        lines.insert(3, '{"anchor": "Bad ROW", "positive": 7}')
        write(path, "\n".join(lines) + "\n")
        kept, report = read_training_data(path, on_bad_row="skip")
        assert_kept_as_written(kept, rows)
        assert report.n_skipped == 1


def test_records_and_haystack_keys_keep_texts_exactly_as_given():
    rows = rows_of(TEXTS)
    examples, _ = examples_from_records(rows)
    assert_kept_as_written(examples, rows)
    haystack = [{"question": r["anchor"], "pos_doc": r["positive"], "neg_doc": r["negative"],
                 "label": r["score"]} for r in rows]  # fmt: skip
    examples, _ = examples_from_records(haystack)
    assert_kept_as_written(examples, [{k: r[k] for k in r if k != "positive_id"} for r in rows])


@pytest.mark.parametrize("name", ["c.jsonl", "c.csv", "c.tsv", "c.parquet"])
def test_corpus_queries_and_beir_pairs_keep_texts_exactly_as_written(tmp_path, name):
    docs = [{"_id": f"Doc-{i}-{t[:3].strip()}", "title": TEXTS[-1 - i] if i % 2 else "",
             "text": t} for i, t in enumerate(TEXTS)]  # fmt: skip
    path = tmp_path / name
    if name.endswith(".jsonl"):
        write(path, jsonl(*docs))
    elif name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(docs), path)
    else:
        write_delimited(path, docs)
    read, _ = read_corpus(path)
    want = [
        Document(d["_id"], f"{d['title']} {d['text']}".strip() if d["title"] else d["text"],
                 d["title"])
        for d in docs
    ]  # fmt: skip
    assert read == want
    # a BEIR folder: queries and the pairs built from them
    beir = tmp_path / "beir"
    write(beir / "corpus.jsonl", jsonl(*docs))
    write(
        beir / "queries.jsonl", jsonl(*({"_id": f"Q-{i}", "text": t} for i, t in enumerate(TEXTS)))
    )
    qrels = "".join(f"Q-{i}\t{d['_id']}\t1\n" for i, d in enumerate(docs[::-1]))
    write(beir / "qrels" / "train.tsv", "query-id\tcorpus-id\tscore\n" + qrels)
    assert read_queries(beir / "queries.jsonl") == {f"Q-{i}": t for i, t in enumerate(TEXTS)}
    pairs, _ = read_training_data(beir)
    assert [(p.query, p.positive, p.positive_id) for p in pairs] == [
        (TEXTS[i], want[-1 - i].text, docs[-1 - i]["_id"]) for i in range(len(TEXTS))
    ]
