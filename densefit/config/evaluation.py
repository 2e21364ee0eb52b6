"""Evaluation options (:class:`EvalConfig`): ``densefit eval``'s flags and the ``eval:``
section of ``densefit run`` (:mod:`densefit.evaluate` scores the runs)."""

from __future__ import annotations

from dataclasses import dataclass

from densefit.choices import DEFAULT_METRICS, parse_metric
from densefit.config.options import Options, option
from densefit.config.shared import (
    DENSE_WEIGHT,
    ENCODE_BATCH_SIZE,
    FUSION,
    FUSION_DEPTH,
    MAX_SEQ_LENGTH,
    PRECISION,
    RRF_K,
    RUNTIME,
    SEARCH_MODE,
    SPLIT,
    TOP_K,
)

__all__ = ["EvalConfig", "check_metrics"]


def check_metrics(value: str | list[str]) -> list[str]:
    """``"ndcg@10,recall@100"`` or a list: each a metric (``ValueError`` naming the supported
    ones), lower-cased, at least one.

    >>> check_metrics("nDCG@10, recall@100")
    ['ndcg@10', 'recall@100']
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    metrics = [str(m).strip() for m in items if str(m).strip()]
    if not metrics:
        raise ValueError("is empty: list at least one metric, e.g. ndcg@10")
    return ["{}@{}".format(*parse_metric(m)) for m in metrics]


@dataclass(kw_only=True)
class EvalConfig(Options):
    """How queries are searched and scored (both models of a comparison alike).

    >>> EvalConfig(metrics="ndcg@10").metrics
    ['ndcg@10']
    """

    split: str | None = SPLIT()
    metrics: list[str] | str = option(
        help="Metrics: ndcg@K, mrr@K, recall@K, map@K, precision@K (comma-separated on the "
        "command line).",
        check=check_metrics,
        metavar="M1,M2,...",
        factory=lambda: list(DEFAULT_METRICS),
    )
    top_k: int | None = TOP_K()
    mode: str = SEARCH_MODE()
    fusion: str = FUSION()
    rrf_k: int = RRF_K()
    dense_weight: float = DENSE_WEIGHT()
    fusion_depth: int = FUSION_DEPTH()
    max_seq_length: int | None = MAX_SEQ_LENGTH()
    encode_batch_size: int = ENCODE_BATCH_SIZE()
    runtime: str = RUNTIME()
    precision: str = PRECISION()
    distractors: int | None = option(
        None,
        "Search a seeded subsample of the corpus: every document judged for the split's "
        "queries plus N random others (faster; metrics are then higher than on the full "
        "corpus and not comparable with published numbers); null, the default: the full "
        "corpus.",
        ge=0,
        run_flag=True,
    )
    sample_seed: int = option(0, "Seed of the --distractors sample.")
    cache_dir: str | None = option(
        None,
        "Folder where base-model evaluations are kept by fingerprint (model, data, settings) "
        "and reused by later runs, in any output folder; default: no cache.",
        cli=False,
    )

    @property
    def split_name(self) -> str:
        """The split evaluated: ``split``, by default ``test``."""
        return self.split or "test"

    @property
    def metric_list(self) -> list[str]:
        """``metrics`` as a list (a string given to the constructor is split)."""
        return list(self.metrics)
