"""Property tests: whatever the bytes, a reader returns valid records or names the file and line.

For every reader the outcome is either a list of valid records, or a BadRowError / ValueError
whose message starts with the file path; never another exception type. In skip mode every
non-blank row is either kept or listed as skipped: nothing is dropped silently.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from densefit.data import BadRowError, Document, TrainingExample
from densefit.data.corpus import load_beir, read_corpus, read_qrels, read_queries
from densefit.data.readers import examples_from_records, read_training_data

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------- strategies

text = st.text(max_size=12)
good_text = st.text(min_size=1, max_size=12).filter(str.strip)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6,
)
training_keys = st.sampled_from(
    ["anchor", "query", "question", "positive", "pos_doc", "neg_doc", "negative",
     "negative_1", "negative_2", "score", "label", "other"]
)  # fmt: skip
training_rows = st.dictionaries(
    training_keys, good_text | json_values | st.lists(good_text, max_size=3), max_size=6
)
good_row = st.fixed_dictionaries({"anchor": good_text, "positive": good_text})
odd_lines = st.sampled_from(
    [
        b"",
        b"  \t\r",
        b"[" * 50_000,  # deeply nested
        b'{"anchor": "\\ud800", "positive": "p"}',  # a lone surrogate escape
        b'{"anchor": "q\xff\xfe", "positive": "p"}',  # invalid UTF-8
        b'{"anchor": "q", "positive": "p", "score": ' + b"9" * 5000 + b"}",  # huge int
        b'{"anchor": "q", "positive": "p", "score": 1e999}',
        json.dumps({"anchor": "q" * 200_000, "positive": "p"}).encode(),  # a very long line
        b"\xef\xbb\xbf",
    ]
)


def json_line(value: object) -> bytes:
    return json.dumps(value).encode()


jsonl_lines = st.lists(
    st.one_of(
        good_row.map(json_line),
        training_rows.map(json_line),
        json_values.map(json_line),
        st.binary(max_size=30),
        odd_lines,
    ),
    max_size=8,
)


# ----------------------------------------------------------------------------- checks


def outcome(call: Callable, path: Path | str):
    """The result of ``call()``, or None after checking that its error names ``path``."""
    try:
        result = call()
        event("outcome: records")
        return result
    except BadRowError as error:
        event("outcome: BadRowError")
        assert error.origin.startswith(str(path)), error
        assert re.search(r":(row )?\d+$", error.origin), error  # and a line
        assert str(error).startswith(f"{error.origin}: "), error
    except ValueError as error:
        event("outcome: ValueError")
        assert type(error) is ValueError, f"{type(error).__name__} leaked: {error}"
        assert str(error).startswith(str(path)), error
    return None


def line_of(origin: str) -> int:
    return int(origin.rsplit(":", 1)[1].removeprefix("row "))


def non_blank_lines(data: bytes) -> set[int]:
    return {n for n, line in enumerate(data.split(b"\n"), start=1) if line.strip()}


def assert_valid_example(example: TrainingExample) -> None:
    for value in (example.query, example.positive, *example.negatives):
        assert isinstance(value, str) and value.strip()
        value.encode("utf-8")  # valid Unicode: no lone surrogates
    assert example.score is None or (
        isinstance(example.score, float) and math.isfinite(example.score)
    )


def first_text(record: dict, keys: tuple[str, ...]) -> str:
    return next(record[k] for k in keys if record.get(k) is not None)


def assert_equals_its_record(example: TrainingExample, record: dict) -> None:
    """The example holds its record's texts unchanged (case, accents, spaces: as written)."""
    assert example.query == first_text(record, ("anchor", "query", "question"))
    assert example.positive == first_text(record, ("positive", "pos_doc"))


def assert_valid_document(doc: Document) -> None:
    assert isinstance(doc.id, str) and doc.id.strip()
    assert isinstance(doc.text, str) and doc.text.strip()
    doc.text.encode("utf-8")


# ----------------------------------------------------------------------------- training data


@FAST
@given(lines=jsonl_lines, final_newline=st.booleans(), gz=st.booleans())
def test_jsonl_rows_are_kept_or_reported(lines, final_newline, gz):
    data = b"\n".join(lines) + b"\n" * final_newline
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / ("t.jsonl.gz" if gz else "t.jsonl")
        path.write_bytes(gzip.compress(data) if gz else data)
        strict = outcome(lambda: read_training_data(path), path)
        skipped = outcome(lambda: read_training_data(path, on_bad_row="skip"), path)

    rows = non_blank_lines(data)
    if strict is not None:
        examples, report = strict
        assert {line_of(e.origin) for e in examples} == rows and not report.skipped
        assert skipped == strict
    if skipped is not None:
        examples, report = skipped
        kept = [line_of(e.origin) for e in examples]
        dropped = [line_of(origin) for origin, _ in report.skipped]
        assert sorted(kept + dropped) == sorted(rows)  # each row exactly once
        assert report.rows == len(examples)
        physical = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
        for example in examples:
            assert_valid_example(example)
            assert_equals_its_record(example, json.loads(physical[line_of(example.origin) - 1]))


csv_cells = st.one_of(text, good_text, st.just(""), st.just(" "), st.just("x" * 200_000))


csv_rows = st.one_of(
    st.lists(csv_cells, min_size=1, max_size=4),
    st.tuples(good_text, good_text, st.sampled_from(["", "0.5", "-1", "x", "nan"])).map(list),
)


@FAST
@given(rows=st.lists(csv_rows, max_size=6))
def test_csv_rows_are_kept_or_reported(rows):
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows([["anchor", "positive", "score"], *rows])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.csv"
        path.write_text(buffer.getvalue(), encoding="utf-8")
        result = outcome(lambda: read_training_data(path, on_bad_row="skip"), path)
    if result is not None:
        examples, report = result
        blank = [all(not c.strip(" \t\n\r\x0b\x0c") for c in row) for row in rows]
        assert len(examples) + report.n_skipped == blank.count(False)
        for example in examples:
            assert_valid_example(example)


tsv_cells = st.text(
    st.characters(exclude_characters="\t\n\r", exclude_categories=["Cs"]), max_size=8
)


@FAST
@given(
    rows=st.lists(st.lists(tsv_cells, min_size=1, max_size=4), max_size=6),
    junk=st.binary(max_size=20),
)
def test_tsv_rows_are_kept_or_reported(rows, junk):
    data = (
        b"question\tpos_doc\tneg_doc\n"
        + b"".join("\t".join(r).encode() + b"\n" for r in rows)
        + junk
    )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.tsv"
        path.write_bytes(data)
        result = outcome(lambda: read_training_data(path, on_bad_row="skip"), path)
    if result is not None:
        examples, report = result
        blank = {
            n for n, line in enumerate(data.split(b"\n"), 1) if not line.strip(b" \t\r\x0b\x0c")
        }
        lines = [line_of(e.origin) for e in examples] + [line_of(o) for o, _ in report.skipped]
        assert sorted(lines) == sorted(non_blank_lines(data) - blank - {1})


mostly_string = st.sampled_from(["string", "string", "string", "int", "list"])
any_kind = st.sampled_from(["string", "int", "float", "list"])
parquet_columns = st.fixed_dictionaries(
    {"anchor": mostly_string, "positive": mostly_string},
    optional={
        "negative": st.sampled_from(["list", "list", "string", "int"]),
        "negative_1": mostly_string,
        "score": st.sampled_from(["float", "float", "int", "string"]),
        "x": any_kind,
    },
)


@FAST
@given(columns=parquet_columns, n_rows=st.integers(1, 5), data=st.data())
def test_parquet_rows_are_kept_or_reported(columns, n_rows, data):
    kinds = {
        "string": (pa.string(), good_text | good_text | good_text | text | st.none()),
        "int": (pa.int64(), st.none() | st.integers(-(2**63), 2**63 - 1)),
        "float": (pa.float64(), st.none() | st.floats()),
        "list": (pa.list_(pa.string()), st.none() | st.lists(good_text | text, max_size=3)),
    }
    table = pa.table(
        {
            name: pa.array(
                data.draw(st.lists(kinds[k][1], min_size=n_rows, max_size=n_rows)), kinds[k][0]
            )
            for name, k in columns.items()
        }
        or {"empty": pa.array([None] * n_rows, pa.string())}
    )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.parquet"
        pq.write_table(table, path)
        result = outcome(lambda: read_training_data(path, on_bad_row="skip"), path)
    if result is not None:
        examples, report = result
        assert len(examples) + report.n_skipped == n_rows
        for example in examples:
            assert_valid_example(example)


@FAST
@given(records=st.lists(st.one_of(good_row, training_rows, json_values), max_size=6))
def test_python_records_are_kept_or_reported(records):
    result = outcome(lambda: examples_from_records(records, on_bad_row="skip"), "<list>")
    if result is not None:
        examples, report = result
        assert len(examples) + report.n_skipped == len(records)
        for example in examples:
            assert_valid_example(example)
            assert_equals_its_record(example, records[line_of(example.origin)])


readers = {
    "training": lambda p: read_training_data(p, on_bad_row="skip"),
    "corpus": lambda p: read_corpus(p, on_bad_row="skip"),
    "queries": read_queries,
    "qrels": read_qrels,
}
pieces = st.one_of(
    st.binary(max_size=30),
    st.sampled_from(
        [b'{"anchor": "q", "positive": "p"}\n', b'{"_id": "1", "text": "t"}\n', b"query-id\tcorpus-id\tscore\n",
         b"q\td\t1\n", b"anchor,positive\n", b"a,b\n", b"PAR1", b"\n", b'"']
    ),
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(pieces, max_size=8),
    name=st.sampled_from(["f.jsonl", "f.json", "f.jsonl.gz", "f.csv", "f.tsv", "f.parquet"]),
    reader=st.sampled_from(sorted(readers)),
    compress=st.booleans(),
)
def test_random_bytes_never_crash_a_reader(pieces, name, reader, compress):
    data = b"".join(pieces)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(gzip.compress(data) if compress and name.endswith(".gz") else data)
        outcome(lambda: readers[reader](path), path)


# ----------------------------------------------------------------------------- corpus and BEIR

ids = st.sampled_from(["a", "b", "c", 1, 2, "", None, 1.5, ["a"]])
doc_rows = st.fixed_dictionaries(
    {"_id": ids}, optional={"text": st.none() | text | st.integers(), "title": st.none() | text}
)


@FAST
@given(rows=st.lists(doc_rows, max_size=8))
def test_corpus_rows_are_kept_or_reported(rows):
    data = b"".join(json_line(row) + b"\n" for row in rows)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "corpus.jsonl"
        path.write_bytes(data)
        strict = outcome(lambda: read_corpus(path), path)
        skipped = outcome(lambda: read_corpus(path, on_bad_row="skip"), path)
    if strict is not None:
        assert skipped == strict and not strict[1].skipped
    if skipped is not None:
        docs, report = skipped
        assert len(docs) + report.n_skipped == len(rows)
        assert len({d.id for d in docs}) == len(docs)  # duplicates are never kept
        for doc in docs:
            assert_valid_document(doc)


@FAST
@given(
    doc_ids=st.lists(st.sampled_from("abcd"), min_size=1, max_size=5),
    query_ids=st.lists(st.sampled_from("xyz"), min_size=1, max_size=4),
    judgments=st.lists(
        st.tuples(
            st.sampled_from("xyzw"),
            st.sampled_from("abcde"),
            st.sampled_from(["0", "1", "1", "2", "x", ""]),
        ),
        max_size=6,
    ),
)
def test_beir_judgments_are_kept_or_reported(doc_ids, query_ids, judgments):
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "qrels").mkdir()
        (root / "corpus.jsonl").write_text(
            "".join(json.dumps({"_id": d, "text": d}) + "\n" for d in doc_ids)
        )
        (root / "queries.jsonl").write_text(
            "".join(json.dumps({"_id": q, "text": q}) + "\n" for q in query_ids)
        )
        qrels = root / "qrels" / "test.tsv"
        qrels.write_text(
            "query-id\tcorpus-id\tscore\n" + "".join("\t".join(j) + "\n" for j in judgments)
        )
        strict = outcome(lambda: load_beir(root), root)
        skipped = outcome(lambda: load_beir(root, on_bad_row="skip"), root)

    if strict is not None:
        assert not strict.report.skipped and len(strict.judgments) == len(judgments)
    if skipped is not None:
        from_qrels = [o for o, _ in skipped.report.skipped if o.startswith(f"{qrels}:")]
        assert len(skipped.judgments) + len(from_qrels) == len(judgments)
        for j in skipped.judgments:
            assert j.doc_id in skipped.corpus and j.query_id in skipped.queries
            assert skipped.qrels[j.query_id][j.doc_id] == j.score


# Deep JSON and very long lines are fuzzed above for training files only; documents and
# queries go through the same JSON path but keep their own id checks (duplicates).
hostile_id_lines = st.sampled_from(
    [
        b"[" * 20_000,  # deeply nested, cut off
        b'{"_id": "d", "text": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",  # valid, too deep
        json.dumps({"_id": "long", "text": "w " * 100_000}).encode(),  # a very long line
        json.dumps({"_id": "a", "text": "again"}).encode(),  # a duplicate id, often
    ]
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(st.one_of(doc_rows.map(json_line), hostile_id_lines), max_size=6))
def test_hostile_corpus_and_query_lines_are_kept_or_reported(lines):
    data = b"\n".join(lines) + b"\n"
    with tempfile.TemporaryDirectory() as folder:
        corpus, queries = Path(folder) / "corpus.jsonl", Path(folder) / "queries.jsonl"
        corpus.write_bytes(data)
        queries.write_bytes(data)
        skipped = outcome(lambda: read_corpus(corpus, on_bad_row="skip"), corpus)
        by_id = outcome(lambda: read_queries(queries), queries)
    if skipped is not None:
        docs, report = skipped
        assert len(docs) + report.n_skipped == len(non_blank_lines(data))
        assert len({d.id for d in docs}) == len(docs)
        for doc in docs:
            assert_valid_document(doc)
    if by_id is not None:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in by_id.items())
