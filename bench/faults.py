"""What the embedded store's fault checks cost, and the filter limits SQLite really has.

- **Opening a store**: ``PRAGMA quick_check`` (every page and record of ``store.sqlite``
  readable) and the check that the committed vectors are finite, both run when a store
  opens; timed on a store of the SciFact corpus's first 5,000 documents (their texts, titles
  and metadata) with random 384-d float32 vectors (all-MiniLM-L6-v2's size), median of 7
  runs with the files in the page cache, beside the whole open.
- **Filters**: the deepest and the widest filters SQLite compiles, per shape of the filter
  (``densefit/retrieval/index/sqlite_filters.py`` compiles it; the statements are the store's own,
  the metadata statistics' subquery included), against the validator's ``MAX_DEPTH`` and
  ``MAX_CONDITIONS``: every shape must reach at least the validator's limit.

    nice -n 10 .venv/bin/python bench/faults.py
    .venv/bin/python bench/faults.py --plot-only     # redraw from the JSON

Writes bench/results/faults.json, faults.md and faults.png.
"""

from __future__ import annotations

import gzip
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runner import RESULTS, command_line, environment  # noqa: E402

from densefit.data.types import Document  # noqa: E402
from densefit.retrieval.index import filters, sqlite_filters  # noqa: E402
from densefit.retrieval.index.documents import DB_NAME, DocumentTable  # noqa: E402
from densefit.retrieval.index.engines import open_store  # noqa: E402
from densefit.retrieval.index.store import LocalDocumentStore  # noqa: E402
from densefit.retrieval.index.types import StoreRecord  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCIFACT = REPO.parent / "shared" / "datasets" / "scifact" / "corpus.jsonl.gz"
DOCUMENTS, DIM, RUNS = 5000, 384, 7


def _documents() -> list[Document]:
    """SciFact's first 5,000 documents (synthetic texts when the dataset is absent)."""
    docs = []
    if SCIFACT.is_file():
        with gzip.open(SCIFACT, "rt", encoding="utf-8") as fh:
            for line in fh:
                row = json.loads(line)
                docs.append(Document(row["_id"], row["text"], row.get("title", "")))
                if len(docs) == DOCUMENTS:
                    break
    words = "cells protein vitamin gene risk cancer trial dose".split()
    while len(docs) < DOCUMENTS:
        i = len(docs)
        docs.append(Document(f"s{i}", " ".join(words[(i + j) % 8] for j in range(200))))
    return [
        Document(
            d.id, d.text, d.title, {"n": i, "lang": ("en", "de")[i % 2], "year": 2000 + i % 20}
        )
        for i, d in enumerate(docs)
    ]


def _median_ms(work) -> float:
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 2)


def open_costs(folder: Path) -> dict:
    docs = _documents()
    record = StoreRecord("random", DIM, "cosine", "float32", np.zeros((3, DIM), np.float32), None)
    vectors = np.random.default_rng(0).standard_normal((len(docs), DIM)).astype(np.float32)
    with open_store(folder / "store", record=record) as store:
        for start in range(0, len(docs), 1024):
            store.write(docs[start : start + 1024], vectors[start : start + 1024])
    path = folder / "store"
    table = DocumentTable(path / DB_NAME)
    quick_check = _median_ms(table.check)
    table.close()
    opened = LocalDocumentStore(path)
    committed = opened._vectors

    def finite():
        committed.finite_rows = 0
        committed._check_finite()

    finite_ms = _median_ms(finite)
    opened.close()
    whole = _median_ms(lambda: LocalDocumentStore(path).close())
    return {
        "documents": len(docs),
        "source": "SciFact corpus" if SCIFACT.is_file() else "synthetic texts",
        "store_sqlite_bytes": (path / DB_NAME).stat().st_size,
        "vector_bytes": (path / "vectors-0.f32").stat().st_size,
        "quick_check_ms": quick_check,
        "finite_vectors_ms": finite_ms,
        "open_ms": whole,
    }


# -- filters ---------------------------------------------------------------------------------------

LEAVES = {
    "== number": {"field": "meta.k", "operator": "==", "value": 1},
    "!= list": {"field": "meta.k", "operator": "!=", "value": [1]},
    "> date": {"field": "meta.d", "operator": ">", "value": "2020-01-01"},
    "not in, five kinds": {"field": "meta.k", "operator": "not in", "value": [1, "a", None, [1], {"x": 1}]},
}  # fmt: skip


def _runs(table: DocumentTable, tree: dict) -> bool:
    sql, params = sqlite_filters.compile_filters(tree)  # a dict: parsed for no engine's limits
    field_sql, type_sql = sqlite_filters.meta_field_sql("meta.k")
    try:
        table.rows_matching(sql, params)
        table.count_matching(sql, params)
        table.meta_values(field_sql, type_sql, sql, params)
        table.meta_range(field_sql, type_sql, ("integer", "real"), sql, params)
    except sqlite3.OperationalError:
        return False
    return True


def _largest(table: DocumentTable, make, high: int) -> int:
    """The largest n in [1, high) for which ``make(n)`` runs (SQLite's limit is monotone)."""
    low = 1
    if _runs(table, make(high)):
        return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if _runs(table, make(middle)) else (low, middle)
    return low


def _nested(levels: int, leaf: dict, operators, *, last: bool) -> dict:
    node = leaf
    for i in range(levels):
        pair = [leaf, node] if last else [node, leaf]
        node = {"operator": operators[i % len(operators)], "conditions": pair}
    return node


def _one_level(n: int, operator: str, leaf: dict) -> dict:
    return {"operator": operator, "conditions": [leaf] * n}


def _conditions(tree: dict) -> int:
    """What the validator counts (MAX_CONDITIONS): every comparison and logical operator,
    and each None, list or object in an ``in`` list."""
    if "field" in tree:
        listed = tree["value"] if tree["operator"] in ("in", "not in") else []
        return 1 + sum(not isinstance(v, (str, bool, int, float)) for v in listed)
    return 1 + sum(_conditions(c) for c in tree["conditions"])


def filter_limits(folder: Path) -> dict:
    folder.mkdir()
    from densefit.retrieval.index.documents import write_new_database

    write_new_database(folder / DB_NAME, {"n_rows": "0"})
    table = DocumentTable(folder / DB_NAME)
    with table.transaction():
        table.upsert([Document("a", "x", meta={"k": 1, "d": "2020-06-01"})], start=0)
    depth_limit, width_limit = sqlite_filters.MAX_DEPTH, sqlite_filters.MAX_CONDITIONS
    nesting, filters.MAX_NESTING = filters.MAX_NESTING, 10**6  # measure past the language's
    shapes = {}
    try:
        for name, leaf in LEAVES.items():
            for operators in (("NOT",), ("AND", "OR"), ("NOT", "AND", "OR")):
                for last in (True, False):
                    label = f"depth: {'/'.join(operators)} chain, nested {'last' if last else 'first'}, {name}"
                    chain = partial(_nested, leaf=leaf, operators=operators, last=last)
                    deepest = _largest(table, chain, 400)
                    shapes[label] = {"limit": "depth", "largest": deepest}
            for operator in ("AND", "OR", "NOT"):
                label = f"conditions: one {operator} of comparisons, {name}"
                one = partial(_one_level, operator=operator, leaf=leaf)
                most = _largest(table, one, 4000)
                shapes[label] = {"limit": "conditions", "largest": _conditions(one(most))}
            for levels in (2, 5, 10, 20):

                def deep_and_wide(width, levels=levels, leaf=leaf):
                    node = leaf
                    for i in range(levels):
                        node = {
                            "operator": ("OR", "AND")[i % 2],
                            "conditions": [node] + [leaf] * width,
                        }
                    return node

                width = _largest(table, deep_and_wide, 2000)
                label = f"conditions: {levels} levels, nested first, {name}"
                shapes[label] = {
                    "limit": "conditions",
                    "largest": _conditions(deep_and_wide(width)),
                }
    finally:
        filters.MAX_NESTING = nesting
        table.close()
    worst = {
        kind: min(s["largest"] for s in shapes.values() if s["limit"] == kind)
        for kind in ("depth", "conditions")
    }
    return {
        "sqlite": sqlite3.sqlite_version,
        "validator": {"MAX_DEPTH": depth_limit, "MAX_CONDITIONS": width_limit},
        "sqlite_worst": worst,
        "shapes": shapes,
    }


def plot(result: dict) -> None:
    """faults.png: SQLite's largest filter per shape against the validator's limits."""
    from _common import pyplot

    plt = pyplot()
    if plt is None:
        return
    limits = result["filters"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 7))
    for ax, kind, limit in ((axes[0], "depth", "MAX_DEPTH"), (axes[1], "conditions", "MAX_CONDITIONS")):  # fmt: skip
        shapes = {n: s["largest"] for n, s in limits["shapes"].items() if s["limit"] == kind}
        ax.barh([n.split(": ", 1)[1] for n in shapes], list(shapes.values()))
        ax.axvline(limits["validator"][limit], color="red", label=f"the validator's {limit}")
        ax.set_title(f"{kind}: the largest filter SQLite {limits['sqlite']} compiles", fontsize=10)
        ax.tick_params(axis="y", labelsize=6)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / "faults.png", dpi=120)


def main() -> None:
    if sys.argv[1:] == ["--plot-only"]:
        plot(json.loads((RESULTS / "faults.json").read_text()))
        return
    with tempfile.TemporaryDirectory(prefix="densefit-faults-") as tmp:
        costs = open_costs(Path(tmp))
        limits = filter_limits(Path(tmp) / "filters")
    assert limits["sqlite_worst"]["depth"] >= limits["validator"]["MAX_DEPTH"], limits
    assert limits["sqlite_worst"]["conditions"] >= limits["validator"]["MAX_CONDITIONS"], limits
    result = {
        "command": "nice -n 10 " + command_line("faults.py", sys.argv[1:]),
        "environment": environment(),
        "open": costs,
        "filters": limits,
    }
    (RESULTS / "faults.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Fault checks: their cost, and SQLite's filter limits",
        "",
        f"`{result['command']}`",
        "",
        f"Opening a store of {costs['documents']:,} documents ({costs['source']}; store.sqlite "
        f"{costs['store_sqlite_bytes'] / 2**20:.1f} MiB, vectors {costs['vector_bytes'] / 2**20:.1f} MiB, "
        f"{DIM}-d), median of {RUNS}, files in the page cache:",
        "",
        "| step | ms |",
        "|---|---|",
        f"| `PRAGMA quick_check` | {costs['quick_check_ms']} |",
        f"| finite check of the committed vectors | {costs['finite_vectors_ms']} |",
        f"| the whole open (both included) | {costs['open_ms']} |",
        "",
        f"SQLite {limits['sqlite']}: the largest filter it compiles, per shape, against the "
        f"validator's limits ({limits['validator']['MAX_DEPTH']} levels, "
        f"{limits['validator']['MAX_CONDITIONS']} conditions):",
        "",
        "| shape | limit | SQLite's largest |",
        "|---|---|---|",
        *(f"| {name} | {s['limit']} | {s['largest']} |" for name, s in limits["shapes"].items()),
        "",
        f"Worst shape: {limits['sqlite_worst']['depth']} levels, "
        f"{limits['sqlite_worst']['conditions']} conditions.",
        "",
    ]
    (RESULTS / "faults.md").write_text("\n".join(lines))
    plot(result)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
