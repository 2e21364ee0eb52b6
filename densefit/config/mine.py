"""Hard-negative mining options (:class:`MineConfig`): ``densefit mine``'s flags and the
``mine:`` section of ``densefit run`` (:mod:`densefit.mine` does the mining)."""

from __future__ import annotations

from dataclasses import dataclass

from densefit.choices import MINE_METHODS, MINE_SAMPLING
from densefit.config.options import Options, option
from densefit.config.shared import ENCODE_BATCH_SIZE, MAX_SEQ_LENGTH, PRECISION, RUNTIME, SEED

__all__ = ["MineConfig", "parse_range"]


def parse_range(text: str) -> tuple[int, int]:
    """``"10:100"`` -> ``(10, 100)``: skip the 10 best candidates, look no deeper than 100.

    >>> parse_range("10:100")
    (10, 100)
    """
    try:
        low, high = (int(part) for part in str(text).split(":"))
    except ValueError:
        raise ValueError(f"must be MIN:MAX, e.g. 10:100; got {text!r}") from None
    if not 0 <= low < high:
        raise ValueError(
            f"{text!r}: need 0 <= MIN < MAX (candidates ranked MIN+1 .. MAX), e.g. 10:100"
        )
    return low, high


def _check_range(text: str) -> None:
    parse_range(text)


@dataclass(kw_only=True)
class MineConfig(Options):
    """How hard negatives are mined for (query, positive) pairs.

    >>> MineConfig(range="10:100").bounds
    (10, 100)
    """

    method: str = option(
        "bm25",
        "bm25 (bm25s), dense (the model's embeddings) or hybrid (both, rank-fused).",
        choices=MINE_METHODS,
        run_flag=True,
    )
    num_negatives: int = option(
        1,
        "Negatives per row (1: question/pos_doc/neg_doc; more: anchor/positive/negative_1..k).",
        ge=1,
    )
    range: str = option(
        "10:100",
        "MIN:MAX: skip the MIN best non-positive candidates, look no deeper than MAX.",
        check=_check_range,
        metavar="MIN:MAX",
    )
    relative_margin: float | None = option(
        None,
        "Skip candidates scoring above (1 - margin) x the positive's score, e.g. 0.05; "
        "default: keep every candidate in range.",
        ge=0,
        le=1,
    )
    sampling: str = option(
        "top", "top: the hardest in range; random: a seeded sample of them.", choices=MINE_SAMPLING
    )
    seed: int = SEED()
    query_block: int = option(256, "Queries searched at once (bounds the score memory).", ge=1)
    encode_batch_size: int = ENCODE_BATCH_SIZE()
    runtime: str = RUNTIME()
    precision: str = PRECISION()
    max_seq_length: int | None = MAX_SEQ_LENGTH()

    @property
    def bounds(self) -> tuple[int, int]:
        """``range`` as (MIN, MAX)."""
        return parse_range(self.range)
