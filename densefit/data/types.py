"""Plain records shared by the readers, the trainer, the miner and the document store."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TrainingExample:
    """One training row: a query, its positive, optional hard negatives and a score.

    ``origin`` is ``"path:line"`` (or ``"<list>:index"``) so that every later message can
    point back at the row. ``score`` is the teacher margin used by ``margin_mse``.
    ``positive_ids`` holds known positive document ids of the query (used to mask false
    negatives), when the source knows them. ``positive_id`` is the id of this row's own
    positive and ``negative_ids`` the ids of ``negatives`` (same order), where known: the
    trainer masks a candidate whose id is a known positive of the anchor.
    """

    query: str
    positive: str
    negatives: tuple[str, ...] = ()
    score: float | None = None
    origin: str = ""
    positive_ids: tuple[str, ...] = ()
    positive_id: str = ""
    negative_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Document:
    """A corpus document. ``text`` is what gets embedded: title and body joined by a space."""

    id: str
    text: str
    title: str = ""
    meta: dict = field(default_factory=dict, hash=False, compare=False)


class BadRowError(ValueError):
    """A row of an input file cannot be used. The message starts with ``path:line:``."""

    def __init__(self, origin: str, field_name: str | None, problem: str, hint: str = ""):
        self.origin = origin
        self.field = field_name
        self.problem = problem
        where = f"{origin}: " if origin else ""
        what = f"field {field_name!r}: " if field_name else ""
        tail = f" ({hint})" if hint else ""
        super().__init__(f"{where}{what}{problem}{tail}")


@dataclass
class ReadReport:
    """What a reader did: rows read, rows skipped and where (nothing is dropped silently)."""

    path: str
    rows: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (origin, reason)

    @property
    def n_skipped(self) -> int:
        """How many rows were skipped."""
        return len(self.skipped)

    def to_dict(self) -> dict:
        """``{"path", "rows", "skipped": [[origin, reason], ...]}`` for ``--json`` output."""
        return {"path": self.path, "rows": self.rows, "skipped": [list(s) for s in self.skipped]}

    def summary(self, limit: int = 5) -> str:
        """One line: rows read, and the first ``limit`` skipped rows with their reasons."""
        if not self.skipped:
            return f"{self.path}: {self.rows} rows read, none skipped"
        shown = "; ".join(f"{o}: {r}" for o, r in self.skipped[:limit])
        more = f"; ... and {self.n_skipped - limit} more" if self.n_skipped > limit else ""
        return (
            f"{self.path}: {self.rows} rows read, {self.n_skipped} bad rows skipped ({shown}{more})"
        )
