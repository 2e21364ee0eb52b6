"""IR evaluation: nDCG, MRR, Recall, MAP through pytrec_eval, on BEIR folders or stores.

Every metric is computed by ``pytrec_eval`` (trec_eval's C code); nothing is re-implemented.
MRR@k is trec_eval's ``recip_rank`` on the run cut to its top k, cut with trec_eval's own
ordering (score descending, then document id descending), so it agrees with trec_eval on ties.

Conventions match BEIR / MTEB, so the numbers compare with published tables: linear-gain
nDCG (``ndcg_cut``), documents whose id equals the query id are dropped from the run
(``ignore_identical_ids``), and the mean is over every judged query -- a judged query with no
results (or no text) scores 0 and is listed in ``missing_queries`` rather than silently left
out of the average, as pytrec_eval alone would do.

>>> qrels = {"q1": {"d1": 1}, "q2": {"d3": 2}}
>>> run = {"q1": {"d1": 0.9, "d2": 0.5}, "q2": {"d2": 0.8, "d3": 0.4}}
>>> evaluate_run(run, qrels, ["mrr@10", "recall@1"]).metrics
{'mrr@10': 0.75, 'recall@1': 0.5}
"""

from __future__ import annotations

import dataclasses
import os
import random
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from densefit.choices import DEFAULT_METRICS, embeds, parse_metric
from densefit.data.corpus import BeirDataset, load_beir, read_qrels, read_queries
from densefit.data.types import ReadReport
from densefit.errors import OptionError
from densefit.losses.matryoshka import truncate
from densefit.models import load_model, model_name_of
from densefit.retrieval.index.documents import DB_NAME
from densefit.retrieval.index.engines import open_store
from densefit.retrieval.index.indexing import index_documents
from densefit.retrieval.index.registry import engine_of, redacted
from densefit.retrieval.index.searching import search_batch

__all__ = [
    "DEFAULT_METRICS",
    "parse_metric",
    "EvalResult",
    "checked_top_k",
    "compare_results",
    "evaluate",
    "evaluate_run",
    "format_p_value",
    "format_table",
    "search_caption",
    "is_store",
    "paired_randomization_test",
    "load_queries_and_qrels",
    "retrieve_run",
    "skipped_caption",
    "store_target",
    "subsample_corpus",
]

# Our metric name -> (pytrec_eval measure family, the key pytrec_eval reports for cutoff k).
_PYTREC = {
    "ndcg": ("ndcg_cut", "ndcg_cut_{k}"),
    "recall": ("recall", "recall_{k}"),
    "map": ("map_cut", "map_cut_{k}"),
    "precision": ("P", "P_{k}"),
}


@dataclass
class EvalResult:
    """Mean metrics over the judged queries, per-query scores, and how they were produced.

    ``rankings`` holds each judged query's retrieved documents in rank order (trec_eval's:
    score descending, then id descending; ``(doc_id, score)``) and ``qrels`` the judgments they
    were scored against: what :func:`densefit.comparison.compare_queries` lines up.
    """

    name: str
    metrics: dict[str, float]
    per_query: dict[str, dict[str, float]] = field(repr=False)
    n_queries: int = 0
    missing_queries: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    skipped_rows: list[tuple[str, str]] = field(default_factory=list)  # (file:line, reason)
    rankings: dict[str, list[tuple[str, float]]] = field(default_factory=dict, repr=False)
    qrels: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)

    def to_dict(self, *, per_query: bool = False, rankings: bool = False) -> dict:
        """A JSON-ready dict; ``per_query`` adds every query's scores, ``rankings`` every
        query's ranked documents and judgments (what :meth:`from_dict` needs to compare)."""
        out = {
            "name": self.name,
            "metrics": {k: round(v, 6) for k, v in self.metrics.items()},
            "n_queries": self.n_queries,
            "missing_queries": self.missing_queries,
            "skipped_rows": [list(row) for row in self.skipped_rows],
            "info": self.info,
        }
        if per_query:
            out["per_query"] = self.per_query
        if rankings:
            out["rankings"] = {q: [[d, s] for d, s in hits] for q, hits in self.rankings.items()}
            out["qrels"] = self.qrels
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> EvalResult:
        """The result :meth:`to_dict` wrote (``metrics`` means exactly as saved).

        >>> r = EvalResult("m", {"mrr@10": 0.5}, {"q": {"mrr@10": 0.5}}, 1, rankings={"q": [("a", 1.0)]})
        >>> EvalResult.from_dict(r.to_dict(per_query=True, rankings=True)).rankings
        {'q': [('a', 1.0)]}
        """  # noqa: E501
        return cls(
            d["name"],
            dict(d["metrics"]),
            dict(d.get("per_query", {})),
            d.get("n_queries", 0),
            list(d.get("missing_queries", [])),
            dict(d.get("info", {})),
            [tuple(row) for row in d.get("skipped_rows", [])],
            {
                q: [(str(doc), float(s)) for doc, s in hits]
                for q, hits in d.get("rankings", {}).items()
            },
            {q: dict(docs) for q, docs in d.get("qrels", {}).items()},
        )


def evaluate_run(
    run: Mapping[str, Mapping[str, float]],
    qrels: Mapping[str, Mapping[str, int]],
    metrics: Sequence[str] = DEFAULT_METRICS,
    *,
    ignore_identical_ids: bool = True,
    name: str = "run",
) -> EvalResult:
    """Score a run ``{query_id: {doc_id: score}}`` against ``{query_id: {doc_id: relevance}}``.

    The mean is over every query in ``qrels``; queries of ``run`` without judgments are
    ignored (as trec_eval does). See the module docstring for the conventions.

    >>> result = evaluate_run({"q": {"a": 2.0, "b": 1.0}}, {"q": {"b": 1}}, ["ndcg@10"])
    >>> round(result.metrics["ndcg@10"], 4)  # 1 / log2(3): the relevant document is second
    0.6309
    """
    import pytrec_eval  # the optional extra `eval`

    parsed = [(m, *parse_metric(m)) for m in metrics]
    qrels = {str(q): {str(d): int(r) for d, r in docs.items()} for q, docs in qrels.items()}
    if not qrels:
        raise ValueError("qrels are empty: there is nothing to evaluate against")
    clean_run: dict[str, dict[str, float]] = {}
    for query_id, docs in run.items():
        scored = {str(d): float(s) for d, s in docs.items()}
        if ignore_identical_ids:
            scored.pop(str(query_id), None)
        if scored:
            clean_run[str(query_id)] = scored

    families: dict[str, set[int]] = {}
    for _, kind, k in parsed:
        if kind != "mrr":
            families.setdefault(_PYTREC[kind][0], set()).add(k)
    per_query_raw: dict[str, dict[str, float]] = {}
    if families:
        measures = {f"{fam}.{','.join(map(str, sorted(ks)))}" for fam, ks in families.items()}
        per_query_raw = pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(clean_run)
    reciprocal: dict[int, dict[str, dict[str, float]]] = {}
    for k in sorted({k for _, kind, k in parsed if kind == "mrr"}):
        cut = {q: dict(_trec_order(docs)[:k]) for q, docs in clean_run.items()}
        reciprocal[k] = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(cut)

    per_query: dict[str, dict[str, float]] = {}
    missing = sorted(q for q in qrels if q not in clean_run)
    for query_id in qrels:
        scores = {}
        for metric, kind, k in parsed:
            if kind == "mrr":
                value = reciprocal[k].get(query_id, {}).get("recip_rank", 0.0)
            else:
                value = per_query_raw.get(query_id, {}).get(_PYTREC[kind][1].format(k=k), 0.0)
            scores[metric] = float(value)
        per_query[query_id] = scores
    means = {m: float(np.mean([per_query[q][m] for q in qrels])) for m, _, _ in parsed}
    rankings = {q: _trec_order(clean_run.get(q, {})) for q in qrels}
    return EvalResult(
        name, means, per_query, n_queries=len(qrels), missing_queries=missing,
        rankings=rankings, qrels=qrels,
    )  # fmt: skip


def _trec_order(docs: Mapping[str, float]) -> list[tuple[str, float]]:
    """trec_eval's ranking: score descending, ties broken by document id descending."""
    return sorted(docs.items(), key=lambda item: (item[1], item[0]), reverse=True)


def retrieve_run(
    store,
    model,
    queries: Mapping[str, str],
    *,
    top_k: int = 100,
    batch_size: int = 64,
    show_progress: bool = False,
    mode: str = "dense",
    fusion=None,
    runtime="auto",
) -> dict[str, dict[str, float]]:
    """Search ``store`` for every query: ``{query_id: {doc_id: score}}`` with ``top_k`` each,
    by ``mode`` (``dense``, ``bm25`` or ``hybrid``, fused by ``fusion``:
    :meth:`DocumentStore.search <densefit.retrieval.index.base.DocumentStore.search>`).

    ``runtime`` embeds the queries (:func:`~densefit.retrieval.index.searching.query_runtime`:
    ``auto`` picks one whose vectors may meet the store's).

    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.index import open_store
    >>> retrieve_run(open_store(None, tiny_model()), tiny_model(), {"q1": "cells"})
    {'q1': {}}
    """
    ids = list(queries)
    run: dict[str, dict[str, float]] = {}
    block = 256  # queries searched together: one matrix product per store chunk
    with tqdm(total=len(ids), desc="Searching", unit="query", disable=not show_progress) as bar:
        for start in range(0, len(ids), block):
            part = ids[start : start + block]
            found = search_batch(
                store,
                model,
                [queries[q] for q in part],
                top_k=top_k,
                batch_size=batch_size,
                mode=mode,
                fusion=fusion,
                runtime=runtime,
            )
            for query_id, hits in zip(part, found, strict=True):
                run[query_id] = {hit.id: hit.score for hit in hits}
            bar.update(len(part))
    return run


def checked_top_k(top_k: int | None, metrics: Sequence[str]) -> int:
    """The documents to retrieve per query: ``top_k``, or (None) the largest metric cutoff;
    :class:`~densefit.errors.OptionError` for a ``top_k`` below 1.

    >>> checked_top_k(None, ["ndcg@10", "recall@100"]), checked_top_k(5, ["ndcg@10"])
    (100, 5)
    """
    if top_k is None:
        return max(parse_metric(m)[1] for m in metrics)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise OptionError(
            "top_k",
            f"{{option}} must be an integer >= 1 (or unset: the largest metric cutoff), "
            f"got {top_k!r}",
            flag="--top-k",
        )
    return top_k


def evaluate(
    model,
    source,
    *,
    split: str = "test",
    queries: str | os.PathLike | Mapping[str, str] | None = None,
    qrels: str | os.PathLike | Mapping[str, Mapping[str, int]] | None = None,
    dims: Sequence[int] | None = None,
    metrics: Sequence[str] = DEFAULT_METRICS,
    top_k: int | None = None,
    batch_size: int = 64,
    distractors: int | None = None,
    sample_seed: int = 0,
    store_dir: str | os.PathLike | None = None,
    backend: str | None = None,
    on_bad_row: str = "error",
    show_progress: bool = False,
    name: str | None = None,
    mode: str = "dense",
    fusion=None,
    vectors: str = "float32",
    rescore: int | None = None,
    runtime="auto",
) -> EvalResult | list[EvalResult]:
    """nDCG, MRR, Recall, MAP of ``model`` on ``source``: the one evaluation entry.

    ``source`` is either

    - a BEIR folder (or a loaded :class:`~densefit.data.corpus.BeirDataset`): its corpus is
      indexed with ``model`` (into ``store_dir`` when given, kept and reused; else a temporary
      store) and its ``split`` queries are scored; ``distractors=N`` searches every judged
      document plus N seeded random others (``sample_seed``) instead of the whole corpus;
    - a document store (a store object or a store folder) with ``queries`` and ``qrels``
      (files or mappings), searched as it is.

    ``dims`` (Matryoshka sizes) gives one result per size, the corpus embedded once at the
    full size and every vector cut to each size and re-normalised, exactly as ``densefit
    index --dim`` and a search of that store would do; without ``dims`` one result. Judged
    queries without text or results score 0 and are listed in ``missing_queries``; rows
    skipped with ``on_bad_row="skip"`` are listed in ``skipped_rows``.

    ``mode`` ranks by the embeddings (``dense``), by BM25 over the texts (``bm25``: the model
    is not run, and may be None for a store) or by both fused (``hybrid``, by ``fusion``, a
    :class:`~densefit.retrieval.fusion.Fusion`; default reciprocal rank). ``vectors`` and
    ``rescore``: the vector kind of the store a BEIR folder is indexed into (a kept
    ``store_dir`` keeps its own) and the candidates an int8 or binary store rescores per
    result (:func:`~densefit.retrieval.index.store.open_store`).

    ``runtime`` embeds documents and queries (:data:`densefit.choices.RUNTIME_CHOICES`;
    ``auto``: the fastest runtime exported for the model's weights whose check passed and
    whose vectors may meet the store's, else torch; :mod:`densefit.retrieval.runtimes`).

    >>> result = evaluate("all-MiniLM-L6-v2", "datasets/scifact")  # doctest: +SKIP
    >>> round(result.metrics["ndcg@10"], 3)  # doctest: +SKIP
    0.645
    """
    checked_top_k(top_k, metrics)  # before the corpus is embedded
    if dims and not embeds(mode):
        raise ValueError("dims cut the embeddings, which mode='bm25' does not use: drop one")
    bm25_store = not embeds(mode) and model is None and is_store(source)
    model = None if bm25_store else load_model(model)
    name = name or (model_name_of(model) if model is not None else None)
    options = dict(
        metrics=metrics, top_k=top_k, batch_size=batch_size, show_progress=show_progress,
        mode=mode, fusion=fusion, runtime=runtime,
    )  # fmt: skip
    if is_store(source):
        if queries is None or qrels is None:
            raise ValueError("evaluating a store needs queries and qrels (files or mappings)")
        results = _evaluate_store(
            model, source, queries, qrels, dims=dims, backend=backend, rescore=rescore,
            on_bad_row=on_bad_row, name=name, options=options,
        )  # fmt: skip
    else:
        if queries is not None or qrels is not None:
            raise ValueError("a BEIR folder brings its own queries and qrels: drop queries/qrels")
        results = _evaluate_beir(
            model, source, split=split, dims=dims, distractors=distractors,
            sample_seed=sample_seed, store_dir=store_dir, backend=backend, vectors=vectors,
            rescore=rescore, on_bad_row=on_bad_row, name=name, options=options,
        )  # fmt: skip
    return results if dims else results[0]


def _evaluate_store(
    model, source, queries, qrels, *, dims, backend, rescore, on_bad_row, name, options: dict
) -> list[EvalResult]:
    """:func:`evaluate` of a store (an object, left open, or a target, opened here): one
    result per size of ``dims`` (one without)."""
    report = ReadReport(f"{queries}, {qrels}")
    texts, judgments = load_queries_and_qrels(queries, qrels, on_bad_row=on_bad_row, report=report)
    given = not isinstance(source, (str, os.PathLike))  # the caller's: left open
    opening = (
        nullcontext(source)
        if given
        else open_store(source, backend=backend, rescore=rescore, create=False)
    )
    with opening as opened:
        results = [
            _score_store(
                opened, model, texts, judgments, dim=dim, name=name or opened.model_name, **options
            )
            for dim in (dims or [None])
        ]
    for result in results:
        result.skipped_rows = list(report.skipped)
    return results


def _evaluate_beir(
    model, source, *, split, dims, distractors, sample_seed, store_dir, backend, vectors,
    rescore, on_bad_row, name, options: dict,
) -> list[EvalResult]:  # fmt: skip
    """:func:`evaluate` of a BEIR folder or dataset: index its corpus (or a subsample of it)
    into ``store_dir`` or a temporary store, then score its ``split``."""
    beir = (
        source
        if isinstance(source, BeirDataset)
        else load_beir(source, split, on_bad_row=on_bad_row)
    )
    beir, corpus = subsample_corpus(beir, distractors, sample_seed)
    with tempfile.TemporaryDirectory(prefix="densefit-eval-") as temporary:
        folder = temporary if store_dir is None else store_dir
        opening = open_store(folder, model, backend=backend, vectors=vectors, rescore=rescore)
        with opening as store:
            started = time.perf_counter()
            indexed = index_documents(
                store, model, beir.corpus.values(), batch_size=options["batch_size"],
                show_progress=options["show_progress"], total=len(beir.corpus),
                runtime=options["runtime"],
            )  # fmt: skip
            index_seconds = time.perf_counter() - started
            results = [
                _score_store(store, model, beir.queries, beir.qrels, dim=dim, name=name, **options)
                for dim in (dims or [None])
            ]
            kept = None if store_dir is None else store_target(store)
    for result in results:
        result.info.update(
            dataset=str(source) if not isinstance(source, BeirDataset) else "<BeirDataset>",
            split=split,
            backend=backend,
            corpus=corpus,
            index=indexed.to_dict(),
            index_seconds=round(index_seconds, 3),
            max_seq_length=model.max_seq_length,
            store=kept,
        )
        result.skipped_rows = list(beir.report.skipped)
    return results


def store_target(store) -> str:
    """Where ``store`` lives as results record it: its folder, URL or collection, with a
    URL's password masked (``***``).

    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.index import open_store
    >>> with open_store(None, tiny_model()) as store:
    ...     store_target(store) == store.location
    True
    """
    return redacted(getattr(store, "location", None) or getattr(store, "path", ""))


def is_store(source) -> bool:
    """Whether ``source`` is a document store (an object, or a folder holding one) rather
    than a BEIR folder or dataset."""
    if isinstance(source, (str, os.PathLike)):
        return engine_of(source) != "embedded" or (Path(source) / DB_NAME).is_file()
    return hasattr(source, "search") and hasattr(source, "check_model")


def _score_store(
    store,
    model,
    queries: Mapping[str, str],
    qrels: Mapping[str, Mapping[str, int]],
    *,
    dim: int | None = None,
    metrics: Sequence[str] = DEFAULT_METRICS,
    top_k: int | None = None,
    batch_size: int = 64,
    show_progress: bool = False,
    name: str,
    mode: str = "dense",
    fusion=None,
    runtime="auto",
) -> EvalResult:
    """Search ``store`` with the judged queries and score the run; at ``dim`` (a Matryoshka
    size below the store's) the store's vectors are cut, re-normalised, into a temporary
    store and the queries embedded with ``model.truncate_dim = dim``. ``mode`` (``dense``,
    ``bm25``, ``hybrid``) and ``fusion`` choose how the store ranks
    (:meth:`DocumentStore.search <densefit.retrieval.index.base.DocumentStore.search>`); ``mode="bm25"`` does not run ``model``; ``runtime`` embeds the queries (:func:`retrieve_run`)."""
    if dim is not None and dim < store.dim:
        before = getattr(model, "truncate_dim", None)
        model.truncate_dim = dim
        try:
            kind = getattr(store, "vector_kind", "float32")
            with open_store(None, model, vectors=kind) as cut:
                settings = getattr(store, "settings", None)
                if settings is not None:  # the copies were made by the store's runtime
                    cut.adopt_runtime(settings.source)
                ids = list(store.ids())
                for start in range(0, len(ids), 4096):
                    part = ids[start : start + 4096]
                    cut.write(store.get(part), truncate(store.vectors(part), dim))
                result = _score_store(
                    cut, model, queries, qrels, metrics=metrics, top_k=top_k,
                    batch_size=batch_size, show_progress=show_progress, name=name, mode=mode,
                    fusion=fusion, runtime=runtime,
                )  # fmt: skip
        finally:
            model.truncate_dim = before
        result.name = f"{name} @{dim}"
        result.info.update(dim=dim, store=store_target(store))
        return result
    top_k = checked_top_k(top_k, metrics)
    judged = {q: queries[q] for q in qrels if q in queries}
    started = time.perf_counter()
    run = retrieve_run(
        store,
        model,
        judged,
        top_k=top_k,
        batch_size=batch_size,
        show_progress=show_progress,
        mode=mode,
        fusion=fusion,
        runtime=runtime,
    )
    search_seconds = time.perf_counter() - started
    label = name if dim is None else f"{name} @{store.dim}"
    result = evaluate_run(run, qrels, metrics, name=label)
    model_name = model_name_of(model) if model is not None else store.model_name
    result.info.update(
        {
            "model": model_name,
            "mode": mode,
            "fusion": dataclasses.asdict(fusion)
            if fusion is not None and mode == "hybrid"
            else None,
            "vectors": getattr(store, "vector_kind", None),
            "store": store_target(store),
            "documents": store.count(),
            "dim": store.dim,
            "top_k": top_k,
            "queries_without_text": sorted(q for q in qrels if q not in queries),
            "search_seconds": round(search_seconds, 3),
            "torch_threads": _threads(),
            "runtime": _documents_runtime(store),
        }
    )
    return result


def subsample_corpus(beir, distractors: int | None, seed: int) -> tuple:
    """``beir`` with its corpus cut to every judged document + ``distractors`` random others.

    The sample is seeded (``random.Random(seed)`` over the sorted unjudged ids), so two
    evaluations search the same documents. ``distractors=None`` keeps the whole corpus.
    Returns ``(dataset, info)``; ``info`` says what was searched (for reports and cards).

    >>> from densefit.data.corpus import BeirDataset
    >>> from densefit.data.types import Document, ReadReport
    >>> docs = {i: Document(i, i) for i in ("a", "b", "c", "d")}
    >>> beir = BeirDataset(docs, {"q": "x"}, {"q": {"a": 1}}, [], ReadReport(""))
    >>> small, info = subsample_corpus(beir, 1, seed=0)
    >>> len(small.corpus), info["kind"], info["judged_documents"]
    (2, 'subsample', 1)
    """
    total = len(beir.corpus)
    if distractors is None:
        return beir, {"kind": "full", "documents": total, "corpus_documents": total}
    judged = {d for docs in beir.qrels.values() for d in docs}
    others = sorted(set(beir.corpus) - judged)
    picked = set(random.Random(seed).sample(others, min(distractors, len(others))))
    corpus = {k: v for k, v in beir.corpus.items() if k in judged or k in picked}
    dataset = BeirDataset(corpus, beir.queries, beir.qrels, beir.judgments, beir.report)
    return dataset, {
        "kind": "subsample",
        "documents": len(corpus),
        "corpus_documents": total,
        "judged_documents": len(judged),
        "distractors": len(picked),
        "sample_seed": seed,
    }


def paired_randomization_test(
    a: Sequence[float], b: Sequence[float], *, n_resamples: int = 10_000, seed: int = 0
) -> float:
    """Two-sided p-value that the mean of ``b - a`` is 0 (paired sign-flip permutation test).

    The usual significance test for IR metrics over the same queries (Smucker et al. 2007).

    >>> round(paired_randomization_test([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]), 2)
    1.0
    """
    diffs = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    if diffs.size == 0 or not np.any(diffs):
        return 1.0
    observed = abs(diffs.mean())
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, n_resamples, 1000):
        n = min(1000, n_resamples - start)
        signs = rng.choice(np.array([-1.0, 1.0]), size=(n, diffs.size))
        hits += int(np.sum(np.abs((signs * diffs).mean(axis=1)) >= observed - 1e-12))
    return (hits + 1) / (n_resamples + 1)


def compare_results(base: EvalResult, other: EvalResult) -> dict:
    """Per metric: both means, the difference, wins/losses/ties over queries and a p-value.

    >>> a = EvalResult("base", {"ndcg@10": 0.5}, {"q1": {"ndcg@10": 0.5}})
    >>> b = EvalResult("tuned", {"ndcg@10": 0.7}, {"q1": {"ndcg@10": 0.7}})
    >>> compare_results(a, b)["ndcg@10"]["wins"]
    1
    """
    if set(base.per_query) != set(other.per_query):
        raise ValueError(
            "the two results were computed on different queries; compare like with like"
        )
    queries = sorted(base.per_query)
    out = {}
    for metric in base.metrics:
        if metric not in other.metrics:
            continue
        x = [base.per_query[q][metric] for q in queries]
        y = [other.per_query[q][metric] for q in queries]
        diff = np.asarray(y) - np.asarray(x)
        out[metric] = {
            base.name: base.metrics[metric],
            other.name: other.metrics[metric],
            "delta": other.metrics[metric] - base.metrics[metric],
            "wins": int(np.sum(diff > 1e-12)),
            "losses": int(np.sum(diff < -1e-12)),
            "ties": int(np.sum(np.abs(diff) <= 1e-12)),
            "p_value": paired_randomization_test(x, y),
        }
    return out


def format_p_value(p: float) -> str:
    """A p-value as every table and report prints it: three decimals, ``< 0.001`` below.

    >>> format_p_value(35 / 10001), format_p_value(1 / 10001), format_p_value(1.0)
    ('0.003', '< 0.001', '1.000')
    """
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def search_caption(results: Sequence[EvalResult]) -> str:
    """How the results were searched: the mode and, unless BM25, the runtime that embedded
    each result's documents (one when all share it).

    >>> a = EvalResult("base", {}, {}, info={"mode": "dense", "runtime": "torch"})
    >>> b = EvalResult("m", {}, {}, info={"mode": "dense", "runtime": "onnx-int8 (onnx/q.onnx)"})
    >>> search_caption([a, b])
    'dense search; embedded by torch (base), onnx-int8 (onnx/q.onnx) (m)'
    >>> search_caption([a])
    'dense search; embedded by torch'
    """
    modes = list(dict.fromkeys(str(r.info.get("mode", "dense")) for r in results))
    caption = f"{' / '.join(modes)} search"
    if modes == ["bm25"]:
        return caption  # BM25 ranks the texts: nothing embedded
    runtimes = [str(r.info.get("runtime", "torch")) for r in results]
    if len(set(runtimes)) == 1:
        return f"{caption}; embedded by {runtimes[0]}"
    each = ", ".join(f"{rt} ({r.name})" for rt, r in zip(runtimes, results))
    return f"{caption}; embedded by {each}"


def format_table(results: Sequence[EvalResult], *, title: str | None = None):
    """A :class:`rich.table.Table`: one row per metric, one column per result (+ delta).

    With two results a delta column and the paired-test p-value are added; the caption says
    how many queries, and how they were searched (:func:`search_caption`).
    """
    from rich.table import Table  # for the CLI's tables only

    table = Table(title=title)
    table.add_column("metric")
    for result in results:
        table.add_column(result.name, justify="right")
    comparison = compare_results(results[0], results[1]) if len(results) == 2 else None
    if comparison:
        table.add_column("delta", justify="right")
        table.add_column("wins/losses", justify="right")
        table.add_column("p", justify="right")
    for metric in results[0].metrics:
        row = [metric] + [f"{r.metrics.get(metric, float('nan')):.4f}" for r in results]
        if comparison and metric in comparison:
            c = comparison[metric]
            row += [f"{c['delta']:+.4f}", f"{c['wins']}/{c['losses']}"]
            row.append(format_p_value(c["p_value"]))
        table.add_row(*row)
    caption = f"{results[0].n_queries} queries; {search_caption(results)}"
    table.caption = caption + skipped_caption(results[0].skipped_rows)
    return table


def skipped_caption(skipped: Sequence[tuple[str, str]]) -> str:
    """``"; 2 bad rows skipped: a.tsv:3, a.tsv:9"`` (every file:line), or ``""``.

    >>> skipped_caption([("qrels/test.tsv:3", "duplicate judgment")])
    '; 1 bad row skipped: qrels/test.tsv:3'
    """
    if not skipped:
        return ""
    noun = "row" if len(skipped) == 1 else "rows"
    return f"; {len(skipped)} bad {noun} skipped: " + ", ".join(origin for origin, _ in skipped)


def format_markdown(results: Sequence[EvalResult]) -> str:
    """The same table as :func:`format_table`, as GitHub markdown."""
    names = [r.name for r in results]
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for metric in results[0].metrics:
        values = " | ".join(f"{r.metrics.get(metric, float('nan')):.4f}" for r in results)
        lines.append(f"| {metric} | {values} |")
    return "\n".join(lines)


def _documents_runtime(store) -> str:
    """What embedded the store's documents (runtime and file)."""
    settings = getattr(store, "settings", None)
    return settings.source.describe() if settings is not None else "torch"


def _threads() -> int:
    return torch.get_num_threads()


def load_queries_and_qrels(
    queries: str | os.PathLike | Mapping[str, str],
    qrels: str | os.PathLike | Mapping,
    *,
    on_bad_row: str = "error",
    report: ReadReport | None = None,
) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    """Queries and qrels from files (BEIR ``queries.jsonl``, qrels TSV) or from mappings.

    With ``on_bad_row="skip"``, bad rows of the files are skipped and listed in ``report``.
    """
    if isinstance(queries, (str, os.PathLike)):
        queries = read_queries(Path(queries), on_bad_row=on_bad_row, report=report)
    if isinstance(qrels, (str, os.PathLike)):
        qrels = read_qrels(Path(qrels), on_bad_row=on_bad_row, report=report)
    return dict(queries), {q: dict(d) for q, d in qrels.items()}
