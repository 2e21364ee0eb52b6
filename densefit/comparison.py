"""Per-query comparison of two evaluations on the same queries: which queries got better,
which got worse, and the ranks, scores and hits behind each.

:func:`compare_queries` lines up two :class:`~densefit.evaluate.EvalResult` (a base model and
a new one: the base and trained models of ``densefit run``, ``--compare`` and ``--model`` of
``densefit eval``) query by query. Each row of :attr:`QueryComparison.rows` (one line of
``per_query.jsonl``, :meth:`QueryComparison.write_jsonl`) holds:

``query_id``, ``query``
    the query and its text (null when unknown);
``metric``, ``base``, ``new``, ``delta``, ``change``
    the chosen metric's value under each model, ``new - base``, and ``"better"``,
    ``"worse"`` or ``"same"`` (a difference within 1e-12 is the same);
``base_metrics``, ``new_metrics``
    every metric of each model for this query (``{metric: value}``);
``base_best_rank``, ``new_best_rank``, ``rank_change``
    the rank (1 = first) of the best-ranked relevant document under each model (null when
    none is in the retrieved top k), and ``base_best_rank - new_best_rank`` (positive: the new
    model ranks it higher), counting a document outside the top k as rank k + 1; null when
    neither model retrieved one;
``relevant``
    each relevant document (relevance > 0): ``id``, ``relevance``, and ``base_rank``,
    ``base_score``, ``new_rank``, ``new_score`` (null when outside that model's top k);
``base_hits``, ``new_hits``
    each model's top hits (``hits`` of them): ``id``, ``score``, ``relevance`` (the
    judgment, 0 for a judged non-relevant document; null when unjudged);
``possible_missing_label``
    the new model's top hit is unjudged for this query and *close* to the best judged
    relevant document: that document is retrieved and its score is within ``close`` (default
    5%) of the top hit's, ``top - judged <= close * |top|``. Such a hit is often a relevant
    document nobody labelled: worth a look before trusting the metric.

Document texts are not in the rows (the ids resolve in the corpus); :attr:`QueryComparison.texts`
holds those the rows name, when ``documents`` are given. The rows read with pandas:
``pandas.read_json("per_query.jsonl", lines=True)``.

>>> from densefit.evaluate import evaluate_run
>>> qrels = {"q1": {"d1": 1}, "q2": {"d2": 1}}
>>> base = evaluate_run({"q1": {"d1": 0.2, "x": 0.9}, "q2": {"d2": 0.8}}, qrels, ["mrr@10"])
>>> new = evaluate_run({"q1": {"d1": 0.9, "x": 0.2}, "q2": {"d2": 0.8}}, qrels, ["mrr@10"])
>>> comparison = compare_queries(base, new)
>>> [(r["query_id"], r["change"], r["rank_change"]) for r in comparison.rows]
[('q1', 'better', 1), ('q2', 'same', 0)]
>>> comparison.summary["better"], comparison.summary["same"], comparison.summary["worse"]
(1, 1, 0)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from densefit.evaluate import EvalResult

__all__ = [
    "CLOSE",
    "RANK_BUCKETS",
    "QueryComparison",
    "compare_queries",
    "per_query_path",
    "rank_bucket",
    "read_per_query",
]

CLOSE = 0.05  # "close to the judged document": within 5% of the top hit's score
_TIE = 1e-12  # as compare_results: a smaller difference is no change

# The rank-change distribution's buckets, in the order plots and tables show them.
RANK_BUCKETS = (
    "left the top k",
    "down 10+",
    "down 3-9",
    "down 1-2",
    "same rank",
    "up 1-2",
    "up 3-9",
    "up 10+",
    "entered the top k",
    "in neither top k",
)


@dataclass
class QueryComparison:
    """Two evaluations lined up per query: the rows (see the module docstring), a summary
    and the texts of the documents the rows name."""

    metric: str
    names: tuple[str, str]
    rows: list[dict]
    summary: dict
    texts: dict[str, str] = field(default_factory=dict, repr=False)

    def document_ids(self) -> set[str]:
        """Every document a row names: relevant ones and both models' hits."""
        keys = ("relevant", "base_hits", "new_hits")
        return {d["id"] for row in self.rows for key in keys for d in row[key]}

    def add_texts(self, documents: Mapping[str, str]) -> None:
        """Keep the texts (of ``documents``: id -> text) of the documents the rows name, and
        add each to the hits the summary lists (wins, losses, possible missing labels)."""
        self.texts = {d: documents[d] for d in sorted(self.document_ids()) if d in documents}
        s = self.summary
        for entry in (*s["wins"], *s["losses"], *s["possible_missing_labels"]):
            for key in ("base_top", "new_top", "hit"):
                hit = entry.get(key)
                if hit is not None and hit["id"] in self.texts:
                    hit["text"] = self.texts[hit["id"]]

    def write_jsonl(self, path: str | os.PathLike) -> Path:
        """Write the rows as JSON Lines (one query a line); return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for row in self.rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        return path


def per_query_path(output: str | os.PathLike) -> Path:
    """Where the per-query rows of the metrics file ``output`` go: beside it.

    >>> per_query_path("results/eval.json").as_posix()
    'results/eval.per_query.jsonl'
    """
    output = Path(output)
    return output.with_name(f"{output.stem}.per_query.jsonl")


def read_per_query(path: str | os.PathLike) -> list[dict]:
    """The rows :meth:`QueryComparison.write_jsonl` wrote."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def compare_queries(
    base: EvalResult,
    new: EvalResult,
    *,
    metric: str | None = None,
    queries: Mapping[str, str] | None = None,
    documents: Mapping[str, str] | None = None,
    hits: int = 10,
    close: float = CLOSE,
    top: int = 10,
) -> QueryComparison:
    """``base`` and ``new`` lined up per query on ``metric`` (default: ``base``'s first).

    ``queries`` and ``documents`` (id -> text) add the texts; ``hits`` top hits are kept per
    model; ``close`` defines a possible missing label (module docstring); ``top`` wins and
    losses go in the summary. Both results need their ``rankings`` and ``qrels``
    (:func:`~densefit.evaluate.evaluate_run` keeps them; a saved result keeps them with
    ``to_dict(rankings=True)``).
    """
    if set(base.per_query) != set(new.per_query):
        raise ValueError(
            "the two results were computed on different queries; compare like with like"
        )
    metric = metric or next(iter(base.metrics))
    for result in (base, new):
        if metric not in result.metrics:
            raise ValueError(f"{result.name} has no {metric}: it has {', '.join(result.metrics)}")
        if result.per_query and not result.rankings:
            raise ValueError(
                f"{result.name} kept no rankings: evaluate again (saved results keep them with "
                "to_dict(rankings=True))"
            )
    depth = max(_depth(base), _depth(new))
    queries = queries or {}
    rows = [
        _row(q, base, new, metric, queries.get(q), hits=hits, close=close, depth=depth)
        for q in sorted(base.per_query)
    ]
    summary = _summary(rows, metric, (base.name, new.name), queries=queries, top=top)
    summary.update(close=close, depth=depth, hits=hits)
    comparison = QueryComparison(metric, (base.name, new.name), rows, summary)
    if documents is not None:
        comparison.add_texts(documents)
    return comparison


def _depth(result: EvalResult) -> int:
    """The k of the top k searched: the result's ``top_k``, else its longest ranking."""
    return int(
        result.info.get("top_k") or max((len(r) for r in result.rankings.values()), default=0)
    )


def _row(
    query_id: str,
    base: EvalResult,
    new: EvalResult,
    metric: str,
    text: str | None,
    *,
    hits: int,
    close: float,
    depth: int,
) -> dict:
    judged = base.qrels.get(query_id) or new.qrels.get(query_id) or {}
    relevant = sorted((d for d, r in judged.items() if r > 0), key=lambda d: (-judged[d], d))
    ranked = {}
    for role, result in (("base", base), ("new", new)):
        ranking = result.rankings.get(query_id, [])
        ranked[role] = {doc: (i + 1, score) for i, (doc, score) in enumerate(ranking)}
    rows_relevant = []
    for doc in relevant:
        entry = {"id": doc, "relevance": judged[doc]}
        for role in ("base", "new"):
            rank, score = ranked[role].get(doc, (None, None))
            entry[f"{role}_rank"], entry[f"{role}_score"] = rank, score
        rows_relevant.append(entry)
    best = {
        role: min((ranked[role][d][0] for d in relevant if d in ranked[role]), default=None)
        for role in ("base", "new")
    }
    if best["base"] is None and best["new"] is None:
        rank_change = None
    else:
        rank_change = (best["base"] or depth + 1) - (best["new"] or depth + 1)
    a, b = base.per_query[query_id][metric], new.per_query[query_id][metric]
    delta = b - a
    change = "better" if delta > _TIE else "worse" if delta < -_TIE else "same"
    new_ranking = new.rankings.get(query_id, [])
    return {
        "query_id": query_id,
        "query": text,
        "metric": metric,
        "base": a,
        "new": b,
        "delta": delta,
        "change": change,
        "base_metrics": dict(base.per_query[query_id]),
        "new_metrics": dict(new.per_query[query_id]),
        "base_best_rank": best["base"],
        "new_best_rank": best["new"],
        "rank_change": rank_change,
        "relevant": rows_relevant,
        "base_hits": _hits(base.rankings.get(query_id, []), judged, hits),
        "new_hits": _hits(new_ranking, judged, hits),
        "possible_missing_label": _possible_missing_label(
            new_ranking, judged, relevant, ranked["new"], close
        ),
    }


def _hits(ranking: Sequence[tuple[str, float]], judged: Mapping[str, int], n: int) -> list:
    return [{"id": d, "score": s, "relevance": judged.get(d)} for d, s in ranking[:n]]


def _possible_missing_label(ranking, judged, relevant, ranked: dict, close: float) -> bool:
    """The top hit is unjudged and the best retrieved relevant document scores within
    ``close * |top|`` of it."""
    if not ranking or ranking[0][0] in judged:
        return False
    scores = [ranked[d][1] for d in relevant if d in ranked]
    if not scores:
        return False
    top = ranking[0][1]
    return top - max(scores) <= close * abs(top)


def rank_bucket(row: Mapping) -> str:
    """The :data:`RANK_BUCKETS` entry of a row's best relevant rank change.

    >>> rank_bucket({"base_best_rank": 4, "new_best_rank": 1, "rank_change": 3})
    'up 3-9'
    """
    base, new, change = row["base_best_rank"], row["new_best_rank"], row["rank_change"]
    if base is None and new is None:
        return "in neither top k"
    if base is None:
        return "entered the top k"
    if new is None:
        return "left the top k"
    size = abs(change)
    if size == 0:
        return "same rank"
    word = "up" if change > 0 else "down"
    return f"{word} {'1-2' if size <= 2 else '3-9' if size <= 9 else '10+'}"


def _summary(
    rows: list[dict], metric: str, names: tuple[str, str], *, queries: Mapping, top: int
) -> dict:
    counts = {change: sum(r["change"] == change for r in rows) for change in ("better", "same")}
    counts["worse"] = len(rows) - counts["better"] - counts["same"]
    buckets = dict.fromkeys(RANK_BUCKETS, 0)
    for row in rows:
        buckets[rank_bucket(row)] += 1
    by_delta = sorted(rows, key=lambda r: (r["delta"], r["query_id"]))
    n = max(len(rows), 1)
    return {
        "metric": metric,
        "models": {"base": names[0], "new": names[1]},
        "queries": len(rows),
        "base_mean": sum(r["base"] for r in rows) / n,
        "new_mean": sum(r["new"] for r in rows) / n,
        **counts,
        "rank_changes": buckets,
        "wins": [_brief(r) for r in reversed(by_delta) if r["change"] == "better"][:top],
        "losses": [_brief(r) for r in by_delta if r["change"] == "worse"][:top],
        "possible_missing_labels": [
            {**_brief(r), "hit": dict(r["new_hits"][0]), "relevant": _best_relevant(r)}
            for r in rows
            if r["possible_missing_label"]
        ],
    }


def _brief(row: dict) -> dict:
    """A row as the summary lists it: the query, the metric, both best ranks, both top hits."""
    keys = ("query_id", "query", "base", "new", "delta", "base_best_rank", "new_best_rank")
    out = {k: row[k] for k in keys}
    out["base_top"] = dict(row["base_hits"][0]) if row["base_hits"] else None  # copies: texts
    out["new_top"] = dict(row["new_hits"][0]) if row["new_hits"] else None  # go on these
    return out


def _best_relevant(row: dict) -> dict | None:
    """The relevant document the new model ranks highest (id, rank, score)."""
    found = [r for r in row["relevant"] if r["new_rank"] is not None]
    best = min(found, key=lambda r: r["new_rank"], default=None)
    return None if best is None else {k: best[k] for k in ("id", "new_rank", "new_score")}
