"""Hard-negative mining: BM25 (bm25s), dense (the model's own embeddings), or both fused.

For every (query, positive) pair, rank the corpus for the query and keep ``num_negatives``
documents ranked between ``range_min`` and ``range_max`` as hard negatives, skipping what
would be a false negative:

- known positives of the query: ``positive_ids`` / ``positive_id`` of its rows (from BEIR
  qrels or a mined file), every row sharing the query text, and any corpus document whose
  text is identical to one of the query's positives;
- with ``relative_margin=m``, any candidate scoring above ``pos - m * |pos|``, i.e.
  ``(1 - m) x`` the positive's score ("TopK-PercPos", Moreira et al. 2024, NV-Retriever).

Ranks count only the documents that are not known positives (rank 1 = the best-scoring
non-positive), so ``range_min=10`` always skips the ten nearest candidates. Methods:

- ``bm25``: BM25 over the corpus (:mod:`densefit.retrieval.bm25`: bm25s's tokens and
  scores). Positives that are not in the corpus are indexed beside it (never returned) so
  that their score is comparable; documents sharing no term with the query (score 0) are
  never negatives.
- ``dense``: cosine similarity of the model's embeddings; the corpus is embedded once and
  searched in blocks of queries with :func:`densefit.retrieval.index.exact.exact_search` (which also
  blocks over the corpus), so no queries x corpus matrix ever exists in one piece.
- ``hybrid``: both rankings fused by reciprocal rank fusion (Cormack et al. 2009,
  ``1 / (rrf_k + rank)``, :mod:`densefit.retrieval.fusion`); the margin rule uses the dense
  cosine scores.

Rows are written in the trainer's formats (:func:`write_mined`), with the document ids that
let the trainer mask false negatives in the loss (:mod:`densefit.losses.masking`).

>>> from densefit.data.types import Document
>>> corpus = [Document(f"d{i}", f"cells divide {'fast ' * i}") for i in range(6)]
>>> pairs = [TrainingExample("do cells divide", "cells divide", positive_id="d0")]
>>> rows, report = mine_hard_negatives(pairs, corpus, num_negatives=2, range_min=0,
...                                    range_max=3, show_progress=False)
>>> rows[0].negative_ids  # d0 is the positive: never a negative
('d1', 'd2')
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from densefit.choices import MINE_METHODS, embeds
from densefit.config.shared import RRF_K
from densefit.data.corpus import read_corpus
from densefit.data.readers import read_training_data
from densefit.data.types import Document, TrainingExample
from densefit.memory.process import peak_rss_bytes
from densefit.models import load_model
from densefit.retrieval.bm25 import Bm25Index, Tokens, best_positions
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.fusion import reciprocal_rank_fusion
from densefit.retrieval.index.exact import exact_search
from densefit.retrieval.runtimes import resolve_runtime
from densefit.wording import plural

__all__ = ["MiningReport", "mine_hard_negatives", "mine_files", "write_mined", "parse_range"]


@dataclass
class MiningReport:
    """What a mining run did, how long each phase took and its peak memory."""

    method: str
    queries: int = 0
    rows: int = 0
    negatives: int = 0
    rows_short: int = 0  # rows that got fewer than num_negatives negatives
    skipped_positives: int = 0  # candidates skipped as known or text-identical positives
    skipped_margin: int = 0  # candidates skipped by the relative margin
    positives_outside_corpus: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    runtime: str | None = None  # dense, hybrid: what ran the model

    def summary(self) -> str:
        return (
            f"{self.method}: {plural(self.rows, 'row')} ({plural(self.queries, 'query', 'queries')}"
            f"), {plural(self.negatives, 'negative')}; {plural(self.rows_short, 'row')} short of "
            f"negatives; skipped {plural(self.skipped_positives, 'known positive')} and "
            f"{self.skipped_margin:,} above the margin; {sum(self.seconds.values()):.1f}s, "
            f"peak RSS {self.peak_rss_mb:.0f} MiB"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_range(text: str) -> tuple[int, int]:
    """``"10:100"`` -> ``(10, 100)``: skip the 10 best candidates, look no deeper than 100.

    >>> parse_range("10:100")
    (10, 100)
    """
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--range {text!r}: write MIN:MAX, e.g. 10:100") from None
    _check_range(low, high)
    return low, high


def _check_range(low: int, high: int) -> None:
    if not 0 <= low < high:
        raise ValueError(
            f"range {low}:{high}: need 0 <= MIN < MAX (candidates ranked MIN+1 .. MAX), e.g. 10:100"
        )


# ----------------------------------------------------------------------------- mining


def mine_hard_negatives(
    pairs: Sequence[TrainingExample],
    corpus: Sequence[Document],
    *,
    method: str = "bm25",
    model=None,
    num_negatives: int = 4,
    range_min: int = 10,
    range_max: int = 100,
    relative_margin: float | None = None,
    sampling: str = "top",
    seed: int = 42,
    query_block: int = 256,
    corpus_embeddings: np.ndarray | None = None,
    batch_size: int = 64,
    rrf_k: int = RRF_K.default,
    show_progress: bool = True,
    runtime="auto",
) -> tuple[list[TrainingExample], MiningReport]:
    """Add mined hard negatives (and their ids) to every (query, positive) pair.

    Args:
        pairs: training rows; their own negatives are replaced.
        corpus: the documents to mine from.
        method: ``"bm25"``, ``"dense"`` or ``"hybrid"`` (see the module docstring).
        model: a SentenceTransformer (or a name for :func:`densefit.models.load_model`);
            needed by ``dense`` and ``hybrid``.
        num_negatives: negatives per row (fewer when not enough candidates qualify).
        range_min, range_max: candidates ranked ``range_min + 1`` .. ``range_max`` among
            the non-positive documents.
        relative_margin: skip candidates scoring above ``(1 - margin) x`` the positive's
            score (e.g. 0.05); None keeps every candidate in range.
        sampling: ``"top"`` (hardest first) or ``"random"`` (seeded, among those in range).
        query_block: queries searched together (bounds the score memory).
        batch_size: encoder batch size (dense).
        rrf_k: the reciprocal rank fusion constant (hybrid).
        runtime: what runs the model (dense, hybrid; :data:`densefit.choices.RUNTIME_CHOICES`,
            ``auto``: the fastest exported for its weights whose check passed, else torch).
        corpus_embeddings: dense and hybrid: the corpus already embedded by ``model``,
            ``(len(corpus), d)`` and L2-normalised (e.g. vectors kept from an index), so
            that it is not embedded again.

    Returns:
        The rows with ``negatives``, ``negative_ids``, ``positive_id`` (when the positive
        is in the corpus) and ``positive_ids`` (every known positive of the query), and a
        :class:`MiningReport`.
    """
    _check_arguments(method, model, num_negatives, range_min, range_max, relative_margin, sampling)
    if query_block < 1:
        raise ValueError(f"query_block must be >= 1, got {query_block}")
    if not pairs:
        raise ValueError("no pairs to mine negatives for")
    if not corpus:
        raise ValueError("the corpus is empty: there is nothing to mine from")

    report = MiningReport(method=method, rows=len(pairs))
    started = time.perf_counter()
    plan = _Plan(pairs, corpus)
    report.queries = len(plan.queries)
    report.positives_outside_corpus = len(plan.outside)
    report.seconds["prepare"] = round(time.perf_counter() - started, 3)
    searchers = _Searchers(
        method, plan, model, batch_size, show_progress, corpus_embeddings, rrf_k, report, runtime
    )
    choice = _Choice(num_negatives, range_min, range_max, relative_margin, sampling, seed)

    started = time.perf_counter()
    mined: list[TrainingExample | None] = [None] * len(pairs)
    with tqdm(
        total=len(plan.queries), desc=f"Mining ({method})", unit="query", disable=not show_progress
    ) as bar:
        for start in range(0, len(plan.queries), query_block):
            block = list(range(start, min(start + query_block, len(plan.queries))))
            for q, (docs, scores) in zip(block, searchers.rank(block, range_max), strict=True):
                for row in plan.rows_of[q]:
                    threshold = searchers.margin_threshold(q, row, relative_margin)
                    mined[row] = _select(plan, q, row, docs, scores, report, choice, threshold)
            bar.update(len(block))
    report.seconds["search"] = round(time.perf_counter() - started, 3)
    report.peak_rss_mb = round(peak_rss_bytes() / 2**20, 1)
    out = [m for m in mined if m is not None]
    report.negatives = sum(len(m.negatives) for m in out)
    report.rows_short = sum(len(m.negatives) < num_negatives for m in out)
    return out, report


@dataclass
class _Choice:
    """Which ranked candidates become negatives (see :func:`mine_hard_negatives`)."""

    num_negatives: int
    range_min: int
    range_max: int
    relative_margin: float | None
    sampling: str
    seed: int

    def __post_init__(self):
        self.rng = random.Random(self.seed)


class _Searchers:
    """The method's searchers (BM25, dense, or both fused) behind one ``rank`` call."""

    def __init__(
        self,
        method,
        plan,
        model,
        batch_size,
        show_progress,
        corpus_embeddings,
        rrf_k,
        report,
        runtime="auto",
    ):
        self.method, self.plan, self.rrf_k = method, plan, rrf_k
        self.searchers: list = []
        self.dense = None
        if method in ("bm25", "hybrid"):
            started = time.perf_counter()
            self.searchers.append(_Bm25(plan, show_progress))
            report.seconds["bm25_index"] = round(time.perf_counter() - started, 3)
        if method in ("dense", "hybrid"):
            started = time.perf_counter()
            self.dense = _Dense(
                plan, _model(model), batch_size, show_progress, corpus_embeddings, runtime
            )
            report.runtime = self.dense.runtime.source.describe()
            self.searchers.append(self.dense)
            report.seconds["dense_encode"] = round(time.perf_counter() - started, 3)
        # Hybrid scores (for the margin and the ranking's scores) are the dense model's.
        self.margin_source = self.dense if method == "hybrid" else self.searchers[0]

    def rank(self, block: list[int], range_max: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(documents, scores)`` best first for each query of ``block``."""
        plan = self.plan
        # Depth: enough to see range_max non-positives after skipping every positive.
        depth = min(plan.n_docs, range_max + max(len(plan.excluded[q]) for q in block))
        rankings = [s.search(block, depth) for s in self.searchers]
        if self.method != "hybrid":
            return rankings[0]
        fused = _fuse(rankings, self.rrf_k, depth)
        return [
            (docs, self.dense.doc_scores(q, docs))
            for q, (docs, _) in zip(block, fused, strict=True)
        ]

    def margin_threshold(self, q: int, row: int, relative_margin: float | None) -> float | None:
        """Candidates scoring above this are too close to the row's positive (None: no margin)."""
        if relative_margin is None:
            return None
        positive = self.margin_source.positive_score(q, row)
        return positive - relative_margin * abs(positive)


def _check_arguments(method, model, num_negatives, range_min, range_max, margin, sampling):
    if method not in MINE_METHODS:
        raise ValueError(f"method must be one of {', '.join(MINE_METHODS)}, not {method!r}")
    if embeds(method) and model is None:
        raise ValueError(
            f"--method {method} embeds the corpus: pass --model (e.g. all-MiniLM-L6-v2)"
        )
    if num_negatives < 1:
        raise ValueError(f"num_negatives must be >= 1, got {num_negatives}")
    _check_range(range_min, range_max)
    if num_negatives > range_max - range_min:
        raise ValueError(
            f"{num_negatives} negatives cannot fit in the range {range_min}:{range_max}; "
            "widen the range or ask for fewer negatives"
        )
    if margin is not None and not 0 <= margin < 1:
        raise ValueError(f"relative_margin must be in [0, 1), e.g. 0.05; got {margin}")
    if sampling not in ("top", "random"):
        raise ValueError(f"sampling must be 'top' or 'random', not {sampling!r}")


def _model(model):
    if isinstance(model, (str, os.PathLike)):
        return load_model(model)
    return model


class _Plan:
    """Unique queries, their rows, and the corpus documents each query must never get.

    ``outside`` lists positive texts that are not in the corpus; they get document numbers
    ``n_docs + j`` so that searchers can score them, and are never candidates.
    """

    def __init__(self, pairs: Sequence[TrainingExample], corpus: Sequence[Document]):
        self.pairs, self.corpus = pairs, corpus
        self.n_docs = len(corpus)
        self.doc_of_id = {d.id: i for i, d in enumerate(corpus)}
        docs_of_text: dict[str, list[int]] = {}
        for i, d in enumerate(corpus):
            docs_of_text.setdefault(d.text, []).append(i)
        query_of: dict[str, int] = {}
        self.queries: list[str] = []
        self.rows_of: list[list[int]] = []
        for r, pair in enumerate(pairs):
            q = query_of.setdefault(pair.query, len(query_of))
            if q == len(self.queries):
                self.queries.append(pair.query)
                self.rows_of.append([])
            self.rows_of[q].append(r)

        outside_of: dict[str, int] = {}
        self.outside: list[str] = []
        self.positive_doc = [0] * len(pairs)  # per row: its positive's document number
        self.positive_id = [""] * len(pairs)  # per row: its positive's id, "" when unknown
        self.excluded: list[set[int]] = []  # per query: corpus documents that are positives
        self.positive_ids: list[tuple[str, ...]] = []  # per query, sorted
        for rows in self.rows_of:
            excluded: set[int] = set()
            ids: set[str] = set()
            for r in rows:
                pair = pairs[r]
                ids.update(pair.positive_ids)
                same_text = docs_of_text.get(pair.positive, [])
                excluded.update(same_text)
                doc = self.doc_of_id.get(pair.positive_id) if pair.positive_id else None
                if doc is None and same_text:
                    doc = same_text[0]  # the positive found in the corpus by its text
                if doc is None:  # not in the corpus: scored beside it, never returned
                    j = outside_of.setdefault(pair.positive, len(outside_of))
                    if j == len(self.outside):
                        self.outside.append(pair.positive)
                    doc = self.n_docs + j
                else:
                    excluded.add(doc)
                    ids.add(corpus[doc].id)
                self.positive_doc[r] = doc
                self.positive_id[r] = pair.positive_id or (
                    corpus[doc].id if doc < self.n_docs else ""
                )
                if pair.positive_id:
                    ids.add(pair.positive_id)
            excluded.update(self.doc_of_id[i] for i in ids if i in self.doc_of_id)
            # every copy of a positive's text is a positive too, whatever its id
            excluded.update(c for d in list(excluded) for c in docs_of_text[corpus[d].text])
            ids.update(corpus[d].id for d in excluded)
            self.excluded.append(excluded)
            self.positive_ids.append(tuple(sorted(ids)))


class _Bm25:
    """BM25 (:mod:`densefit.retrieval.bm25`) over the corpus plus the positives that are not
    in it (never returned)."""

    def __init__(self, plan: _Plan, show_progress: bool):
        self.plan = plan
        texts = [d.text for d in plan.corpus] + plan.outside
        self.index = Bm25Index(Tokens.of(texts, show_progress=show_progress))
        self._positive_scores: dict[int, float] = {}  # row -> its positive's score

    def search(self, block: list[int], depth: int) -> list[tuple[np.ndarray, np.ndarray]]:
        # One query's full score vector at a time (O(corpus) memory); only the top `depth`
        # and the scores of the query's positives are kept.
        self._positive_scores = {}
        n = self.plan.n_docs
        out = []
        query_ids = self.index.tokens.query_ids([self.plan.queries[q] for q in block])
        for q, ids in zip(block, query_ids, strict=True):
            full = self.index.scores(ids)  # (n_docs + outside,)
            for row in self.plan.rows_of[q]:
                self._positive_scores[row] = float(full[self.plan.positive_doc[row]])
            # no shared term (score 0): not retrieved at all; best first, ties by document
            out.append(best_positions(full[:n], depth))
        return out

    def positive_score(self, q: int, row: int) -> float:
        return self._positive_scores[row]


class _Dense:
    """Cosine similarity of the model's embeddings, searched in blocks of queries."""

    def __init__(
        self, plan: _Plan, model, batch_size: int, show_progress: bool, given=None, runtime="auto"
    ):
        self.plan, self.model, self.batch_size = plan, model, batch_size
        self.runtime = resolve_runtime(model, runtime)
        self.encode = encode_texts
        texts = [d.text for d in plan.corpus] if given is None else []
        outside = encode_texts(
            model,
            texts + plan.outside,
            batch_size=batch_size,
            show_progress=show_progress,
            normalize=True,
            prompt_name="document",
            runtime=self.runtime,
        )
        if given is None:
            self.vectors = outside  # (n_docs + outside, d)
        else:
            if given.shape != (plan.n_docs, outside.shape[1]):
                raise ValueError(
                    f"corpus_embeddings has shape {given.shape}; expected ({plan.n_docs}, "
                    f"{outside.shape[1]}): one row per corpus document, made by the same model"
                )
            self.vectors = np.concatenate([np.asarray(given, dtype=np.float32), outside])
        self._queries: dict[int, np.ndarray] = {}

    def search(self, block: list[int], depth: int) -> list[tuple[np.ndarray, np.ndarray]]:

        embedded = self.encode(
            self.model,
            [self.plan.queries[q] for q in block],
            batch_size=self.batch_size,
            normalize=True,
            prompt_name="query",
            runtime=self.runtime,
        )  # (q, d)
        self._queries = dict(zip(block, embedded, strict=True))
        corpus = self.vectors[: self.plan.n_docs]
        scores, rows = exact_search(corpus, embedded, depth)  # (q, depth) each
        return [(r[r >= 0], s[r >= 0]) for s, r in zip(scores, rows, strict=True)]

    def doc_scores(self, q: int, docs: np.ndarray) -> np.ndarray:
        return self.vectors[docs] @ self._queries[q]

    def positive_score(self, q: int, row: int) -> float:
        return float(self.vectors[self.plan.positive_doc[row]] @ self._queries[q])


def _fuse(rankings, rrf_k: int, depth: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Reciprocal rank fusion of several rankings of each query of a block."""
    return [
        reciprocal_rank_fusion([docs for docs, _ in per_query], depth, rrf_k=rrf_k)
        for per_query in zip(*rankings, strict=True)
    ]


def _select(
    plan, q, row, docs, scores, report, choice: _Choice, threshold: float | None
) -> TrainingExample:
    """The negatives of one row from its query's ranking (best first)."""
    pair = plan.pairs[row]
    excluded = plan.excluded[q]
    chosen: list[int] = []
    texts: set[str] = {pair.positive}
    rank = 0
    for doc, score in zip(docs.tolist(), scores.tolist(), strict=True):
        if doc in excluded:
            report.skipped_positives += 1
            continue
        rank += 1
        if rank <= choice.range_min:
            continue
        if rank > choice.range_max:
            break
        if threshold is not None and score > threshold:
            report.skipped_margin += 1
            continue
        text = plan.corpus[doc].text
        if text in texts:  # a duplicate document: one copy is enough
            continue
        texts.add(text)
        chosen.append(doc)
        if choice.sampling == "top" and len(chosen) == choice.num_negatives:
            break
    if choice.sampling == "random" and len(chosen) > choice.num_negatives:
        chosen = sorted(choice.rng.sample(chosen, choice.num_negatives), key=chosen.index)
    return dataclasses.replace(
        pair,
        negatives=tuple(plan.corpus[d].text for d in chosen),
        negative_ids=tuple(plan.corpus[d].id for d in chosen),
        positive_id=plan.positive_id[row],
        positive_ids=plan.positive_ids[q],
        score=None,  # a teacher margin of the old negatives would be wrong for the new ones
    )


# ----------------------------------------------------------------------------- files


def write_mined(
    path: str | os.PathLike, rows: Sequence[TrainingExample], *, num_negatives: int
) -> Path:
    """Write rows as JSON Lines the trainer reads back, with the document ids.

    One negative: Haystack-style ``question`` / ``pos_doc`` / ``neg_doc``; several:
    ``anchor`` / ``positive`` / ``negative_1`` .. ``negative_k``. Both add ``positive_id``,
    ``positive_ids`` and ``negative_ids`` so that the trainer can still mask false
    negatives (:mod:`densefit.losses.masking`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            if num_negatives == 1:
                record: dict = {"question": r.query, "pos_doc": r.positive}
                if r.negatives:
                    record["neg_doc"] = r.negatives[0]
            else:
                record = {"anchor": r.query, "positive": r.positive}
                record.update({f"negative_{i}": n for i, n in enumerate(r.negatives, start=1)})
            if r.positive_id:
                record["positive_id"] = r.positive_id
            record["positive_ids"] = list(r.positive_ids)
            record["negative_ids"] = list(r.negative_ids)
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)  # never a half-written file under the final name
    return path


def mine_files(
    pairs: str | os.PathLike,
    corpus: str | os.PathLike | Sequence[Document],
    output: str | os.PathLike,
    *,
    split: str = "train",
    on_bad_row: str = "error",
    **options,
) -> MiningReport:
    """Read pairs (a BEIR folder's ``split`` or a training file) and a corpus, mine, write.

    ``corpus`` is a corpus file or a BEIR folder, or the documents already read (a store's);
    ``options`` go to :func:`mine_hard_negatives`.

    >>> mine_files("scifact", "scifact", "mined.jsonl", method="bm25")  # doctest: +SKIP
    """

    t0 = time.perf_counter()
    if isinstance(corpus, (str, os.PathLike)):
        documents, corpus_report = read_corpus(corpus, on_bad_row=on_bad_row)
        if corpus_report.n_skipped:
            warnings.warn(corpus_report.summary(), UserWarning, stacklevel=2)
    else:
        documents = list(corpus)
    by_id = {d.id: d for d in documents} if Path(pairs).is_dir() else None
    rows, pairs_report = read_training_data(pairs, on_bad_row=on_bad_row, split=split, corpus=by_id)
    if pairs_report.n_skipped:
        warnings.warn(pairs_report.summary(), UserWarning, stacklevel=2)
    read_seconds = time.perf_counter() - t0
    mined, report = mine_hard_negatives(rows, documents, **options)
    report.seconds = {"read": round(read_seconds, 3), **report.seconds}
    write_mined(output, mined, num_negatives=options.get("num_negatives", 4))
    return report
