"""Read corpora, queries and qrels (BEIR layout) for indexing, evaluation and mining.

A BEIR folder holds ``corpus.jsonl`` (or ``corpus.jsonl.gz``) with ``_id``, ``title``,
``text``; ``queries.jsonl`` (or ``queries.jsonl.gz``) with ``_id``, ``text``; and
``qrels/<split>.tsv`` with the header ``query-id corpus-id score``. Errors follow :mod:`densefit.data.readers`: ``path:line``, the
field, and what to do.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from densefit.data.rows import (
    SKIP_HINT,
    BadRows,
    OnBadRow,
    Record,
    check_columns,
    check_text,
    first_present,
    iter_rows,
    require_text,
    why_empty,
)
from densefit.data.types import BadRowError, Document, ReadReport, TrainingExample

ID_KEYS = ("_id", "id")
QRELS_COLUMNS = ("query-id", "corpus-id", "score")
T = TypeVar("T")


class Judgment(NamedTuple):
    """One qrels row: ``origin`` is ``qrels/<split>.tsv:line``."""

    origin: str
    query_id: str
    doc_id: str
    score: int


@dataclass
class BeirDataset:
    """A BEIR split: the corpus, the queries judged in the split, and their judgments.

    ``judgments`` are the qrels rows in file order with their origins; ``qrels`` is the same
    as ``{query_id: {doc_id: score}}``. ``report`` lists rows skipped with
    ``on_bad_row="skip"``.
    """

    corpus: dict[str, Document]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    judgments: list[Judgment]
    report: ReadReport

    def training_pairs(self) -> list[TrainingExample]:
        """One (query, document text) example per judgment with score > 0.

        Each example's ``positive_ids`` holds every positive document of its query, so the
        trainer can keep them out of the negatives.
        """
        positives = {
            q: tuple(d for d, s in docs.items() if s > 0) for q, docs in self.qrels.items()
        }
        return [
            TrainingExample(
                query=self.queries[j.query_id],
                positive=self.corpus[j.doc_id].text,
                origin=j.origin,
                positive_ids=positives[j.query_id],
                positive_id=j.doc_id,
            )
            for j in self.judgments
            if j.score > 0
        ]


# ----------------------------------------------------------------------------- corpus


def read_corpus(
    path: str | os.PathLike, *, on_bad_row: OnBadRow = "error"
) -> tuple[list[Document], ReadReport]:
    """Read every document of a corpus file (or of a BEIR folder's ``corpus.jsonl[.gz]``).

    JSON Lines rows need ``_id`` (or ``id``) and ``text``, optionally ``title``; CSV, TSV and
    Parquet files need the columns ``id`` (or ``_id``), ``text`` and optionally ``title``.
    ``Document.text`` is ``title + " " + text`` when there is a title. A repeated id is a bad
    row naming both lines (``on_bad_row="skip"`` keeps the first).

    Example:
        >>> docs, report = read_corpus("scifact/")  # doctest: +SKIP
        >>> len(docs), docs[0].id  # doctest: +SKIP
        (5183, '4983')
    """
    report = ReadReport(str(path))
    documents = list(iter_corpus(path, on_bad_row=on_bad_row, report=report))
    return documents, report


def iter_corpus(
    path: str | os.PathLike,
    *,
    on_bad_row: OnBadRow = "error",
    report: ReadReport | None = None,
) -> Iterator[Document]:
    """Stream the documents of a corpus file or BEIR folder (see :func:`read_corpus`).

    With ``on_bad_row="skip"``, pass a ``report`` to learn which rows were skipped.

    Example:
        >>> for doc in iter_corpus("corpus.jsonl.gz"):  # doctest: +SKIP
        ...     index.add(doc)
    """
    path = find_corpus_file(Path(path))
    report = report if report is not None else ReadReport(str(path))
    ignored: set[str] = set()

    def document(record: Record, origin: str) -> tuple[str, Document]:
        unknown = [k for k in record if k not in DOCUMENT_FIELDS and k not in ignored]
        if unknown:
            ignored.update(unknown)
            warnings.warn(
                f"{origin}: {', '.join(repr(k) for k in unknown)} not read (a document takes "
                f"{', '.join(DOCUMENT_FIELDS)}): put it under 'meta' to filter on it",
                UserWarning,
                stacklevel=2,
            )
        return _document(record, origin)

    documents = _unique_rows(path, BadRows(on_bad_row, report), document, "document")

    def counted() -> Iterator[Document]:
        for _, document in documents:
            report.rows += 1
            yield document

    return counted()


# The fields a corpus row gives a document; others are warned about once per file.
DOCUMENT_FIELDS = (*ID_KEYS, "text", "title", "meta", "metadata")


def _document(record: Record, origin: str) -> tuple[str, Document]:
    doc_id = _check_id(record, origin)
    text, title = (_optional_text(record, key, origin) for key in ("text", "title"))
    if not (text.strip() or title.strip()):
        raise BadRowError(origin, "text", "empty document (no text and no title)", SKIP_HINT)
    return doc_id, Document(
        id=doc_id,
        text=f"{title} {text}".strip() if title else text,
        title=title,
        meta=_metadata(record, origin),
    )


def _metadata(record: Record, origin: str) -> dict:
    """The row's metadata, kept for filters: ``meta`` (Haystack's and densefit's HTTP API's
    name) or ``metadata`` (BEIR's), an object of finite values."""
    given = [key for key in ("meta", "metadata") if record.get(key) is not None]
    if len(given) == 2 and record["meta"] != record["metadata"]:
        raise BadRowError(origin, "meta", "the row gives both 'meta' and 'metadata'", SKIP_HINT)
    if not given:
        return {}
    meta = record[given[0]]
    if not isinstance(meta, dict):
        raise BadRowError(
            origin, given[0], f"expected an object of metadata, got {type(meta).__name__}"
        )
    bad = non_finite_path(meta)
    if bad is not None:
        raise BadRowError(
            origin, f"{given[0]}.{bad}", "NaN or Infinity: filters compare finite numbers only"
        )
    return meta


def non_finite_path(value, path: str = "") -> str | None:
    """The path (``a.b`` or ``a.2``) of the first NaN or infinite number in a metadata value
    (nested lists and objects), None when every number is finite.

    >>> non_finite_path({"a": {"b": [1, float("nan")]}})
    'a.b.1'
    """
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        found = non_finite_path(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def find_corpus_file(path: str | os.PathLike) -> Path:
    """The corpus file of a BEIR folder (``corpus.jsonl`` or ``.jsonl.gz``), or ``path`` itself
    when it is a file; FileNotFoundError when a folder holds neither.

    >>> find_corpus_file("corpus.parquet")
    PosixPath('corpus.parquet')
    """
    path = Path(path)
    return find_beir_file(path, "corpus") if path.is_dir() else path


def find_beir_file(folder: str | os.PathLike, stem: str) -> Path:
    """``<stem>.jsonl`` of a BEIR folder, or ``<stem>.jsonl.gz`` when only that is there;
    FileNotFoundError when the folder holds neither."""
    folder = Path(folder)
    for name in (f"{stem}.jsonl", f"{stem}.jsonl.gz"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{folder}: no {stem}.jsonl or {stem}.jsonl.gz in this BEIR folder")


# ----------------------------------------------------------------------------- queries, qrels


def read_queries(
    path: str | os.PathLike,
    *,
    on_bad_row: OnBadRow = "error",
    report: ReadReport | None = None,
) -> dict[str, str]:
    """Read a BEIR ``queries.jsonl`` (``_id``, ``text``) into ``{query_id: text}``.

    With ``on_bad_row="skip"``, pass a ``report`` to learn which rows were skipped.

    Example:
        >>> read_queries("scifact/queries.jsonl")["1"]  # doctest: +SKIP
        '0-dimensional biomaterials show inductive properties.'
    """
    report = report if report is not None else ReadReport(str(path))
    queries = _read_queries(Path(path), BadRows(on_bad_row, report))
    report.rows += len(queries)
    return queries


def read_qrels(
    path: str | os.PathLike,
    *,
    on_bad_row: OnBadRow = "error",
    report: ReadReport | None = None,
) -> dict[str, dict[str, int]]:
    """Read a BEIR qrels TSV (header ``query-id corpus-id score``) into ``{query: {doc: score}}``.

    With ``on_bad_row="skip"``, pass a ``report`` to learn which rows were skipped.

    Example:
        >>> read_qrels("scifact/qrels/test.tsv")["1"]  # doctest: +SKIP
        {'31715818': 1}
    """
    path = Path(path)
    report = report if report is not None else ReadReport(str(path))
    qrels: dict[str, dict[str, int]] = {}
    for judgment in _judgments(path, BadRows(on_bad_row, report)):
        qrels.setdefault(judgment.query_id, {})[judgment.doc_id] = judgment.score
        report.rows += 1
    if not qrels:
        raise ValueError(f"{path}: no judgments{why_empty(report)}")
    return qrels


def load_beir(
    folder: str | os.PathLike,
    split: str = "test",
    *,
    on_bad_row: OnBadRow = "error",
    corpus: Mapping[str, Document] | None = None,
) -> BeirDataset:
    """Load one split of a BEIR folder; every judgment must name a known query and document.

    ``queries`` keeps only the queries judged in ``split``. A judgment of a missing query or
    document is a bad row at its qrels line (``on_bad_row="skip"`` drops it and reports it).
    ``corpus`` reuses documents read earlier instead of reading the folder's corpus again.

    Example:
        >>> beir = load_beir("scifact", "test")  # doctest: +SKIP
        >>> len(beir.corpus), len(beir.queries), len(beir.judgments)  # doctest: +SKIP
        (5183, 300, 339)
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder}: no such folder (a BEIR folder holds corpus.jsonl[.gz], "
            "queries.jsonl[.gz] and qrels/<split>.tsv)"
        )
    qrels_path = folder / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        splits = sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
        there = f"the splits here are {', '.join(splits)}" if splits else "it has no qrels/*.tsv"
        raise FileNotFoundError(f"{qrels_path}: no such file; {there}")
    report = ReadReport(str(folder))
    bad = BadRows(on_bad_row, report)
    corpus_name = "the corpus passed in"
    if corpus is None:
        corpus_file = find_corpus_file(folder)
        corpus_name = corpus_file.name
        corpus = dict(_unique_rows(corpus_file, bad, _document, "document"))
    queries_file = find_beir_file(folder, "queries")
    all_queries = _read_queries(queries_file, bad)

    qrels: dict[str, dict[str, int]] = {}
    judgments = []
    for j in _judgments(qrels_path, bad):
        if j.query_id not in all_queries:
            bad(_unknown(j, "query-id", "query", queries_file.name))
        elif j.doc_id not in corpus:
            bad(_unknown(j, "corpus-id", "document", corpus_name))
        else:
            qrels.setdefault(j.query_id, {})[j.doc_id] = j.score
            judgments.append(j)
    if not judgments:
        raise ValueError(f"{qrels_path}: no usable judgments{why_empty(report)}")
    report.rows = len(judgments)
    queries = {q: all_queries[q] for q in qrels}
    return BeirDataset(dict(corpus), queries, qrels, judgments, report)


def _unknown(judgment: Judgment, field: str, what: str, where: str) -> BadRowError:
    missing_id = judgment.query_id if field == "query-id" else judgment.doc_id
    hint = f"add the {what} to {where}, or pass --on-bad-row skip to drop this judgment"
    return BadRowError(judgment.origin, field, f"{what} {missing_id!r} is not in {where}", hint)


def _read_queries(path: Path, bad: BadRows) -> dict[str, str]:
    def query(record: Record, origin: str) -> tuple[str, str]:
        return _check_id(record, origin), require_text(record, ("text",), origin)

    return dict(_unique_rows(path, bad, query, "query"))


def _judgments(path: Path, bad: BadRows) -> Iterator[Judgment]:
    judged: set[tuple[str, str]] = set()
    checked = False
    for origin, record in iter_rows(path):
        if isinstance(record, BadRowError):
            bad(record)
            continue
        if not checked and not all(column in record for column in QRELS_COLUMNS):
            raise ValueError(
                f"{path}: found the columns {list(record)!r}; a qrels file starts with the"
                " header line 'query-id<TAB>corpus-id<TAB>score'"
            )
        checked = True
        try:
            query_id = require_text(record, ("query-id",), origin)
            doc_id = require_text(record, ("corpus-id",), origin)
            score = _relevance(record["score"], origin)
            if (query_id, doc_id) in judged:
                problem = f"query {query_id!r} and document {doc_id!r} are already judged above"
                raise BadRowError(origin, None, f"duplicate judgment: {problem}", SKIP_HINT)
        except BadRowError as error:
            bad(error)
            continue
        judged.add((query_id, doc_id))
        yield Judgment(origin, query_id, doc_id, score)


# ----------------------------------------------------------------------------- helpers


def _unique_rows(
    path: Path, bad: BadRows, parse: Callable[[Record, str], tuple[str, T]], what: str
) -> Iterator[tuple[str, T]]:
    """``parse`` each row into ``(id, item)``; a repeated id is a bad row naming both lines."""
    first_at: dict[str, str] = {}
    checked = False
    for origin, record in iter_rows(path):
        if isinstance(record, BadRowError):
            bad(record)
            continue
        if not checked:
            check_columns(record, str(path), {"id": ID_KEYS, "text": ("text",)})
            checked = True
        try:
            item_id, item = parse(record, origin)
            if item_id in first_at:
                problem = f"duplicate {what} id {item_id!r} (first at {first_at[item_id]})"
                hint = f"give every {what} a unique id, or pass --on-bad-row skip to keep the first"
                raise BadRowError(origin, None, problem, hint)
        except BadRowError as error:
            bad(error)
            continue
        first_at[item_id] = origin
        yield item_id, item
    if not first_at:
        raise ValueError(f"{path}: no {what} rows{why_empty(bad.report)}")


def _check_id(record: Record, origin: str) -> str:
    key, value = first_present(record, ID_KEYS)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if value is None:
        raise BadRowError(origin, None, "missing '_id' or 'id'", SKIP_HINT)
    return check_text(value, origin, key, also="or an integer")


def _optional_text(record: Record, key: str, origin: str) -> str:
    value = record.get(key)
    return "" if value is None else check_text(value, origin, key, empty_ok=True)


def _relevance(value: Any, origin: str) -> int:
    try:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError
        return int(value)
    except (TypeError, ValueError):
        problem = "missing" if value is None else f"expected an integer relevance, got {value!r}"
        raise BadRowError(origin, "score", problem, SKIP_HINT) from None
