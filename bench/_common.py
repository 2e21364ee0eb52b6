"""What the quality grids (bench/quality.py, bench/batch_size.py) and bench/matryoshka.py
and bench/lora.py share: the finished points of a JSONL, one fine-tune-and-evaluate point
(in its child process), the judged-plus-others test corpus, the record a point leaves and
the report's files and plotting setup. Running a child is bench/_runner.py's."""

from __future__ import annotations

import csv
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from _runner import Child, run_child


def finished(path: Path) -> dict[str, dict]:
    """Points already in the JSONL (status ok), by key; the last line of a key wins."""
    done: dict[str, dict] = {}
    if path.exists():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                print(f"{path}:{n}: not JSON (an interrupted write?): ignored", flush=True)
                continue
            if record.get("status") == "ok":
                done[record["key"]] = record
    return done


# ----------------------------------------------------------------------------- one point


def training_rows(beir, n: int | None, seed: int):
    """The (query, positive) pairs of a BEIR train split; a seeded subsample of ``n``."""
    rows = beir.training_pairs()
    if n and n < len(rows):
        rows = random.Random(seed).sample(rows, n)
    return rows


def load_point(spec: dict):
    """The point's model at its sequence length, and the first fields of its result."""
    import torch

    from densefit.models import load_model

    model = load_model(spec["model"], max_seq_length=spec["max_seq_length"])
    return model, {"torch_threads": torch.get_num_threads(), "train": None}


def fine_tune(model, rows, spec: dict, **config):
    """Train ``model`` on ``rows`` with the spec's batch, epochs, learning rate, seed and
    length (``config``: more TrainConfig settings); the train result and its per-step log."""
    from densefit.config.train import TrainConfig
    from densefit.training.loop import train

    config = TrainConfig(
        batch_size=spec["batch_size"],
        epochs=spec["epochs"],
        learning_rate=spec["learning_rate"],
        seed=spec["seed"],
        max_seq_length=spec["max_seq_length"],
        show_progress=False,
        **config,
    )
    log: list[dict] = []
    result = train(model, rows, config, on_step=log.append)
    return result, log


def grid_point(
    spec: dict,
    rows_of: Callable[[object, dict], list],
    more_train: Callable[[object, list[dict]], dict] | None = None,
) -> dict:
    """Fine-tune (unless the base: batch size 0) with the spec's memory strategy and
    evaluate on the test split; runs in the point's child process.

    ``rows_of(train_split, out)``: the training rows (it may record more in ``out``);
    ``more_train(result, log)``: fields of ``out["train"]`` beside the ones every grid has.
    """
    from densefit.data.corpus import load_beir

    model, out = load_point(spec)
    corpus = None
    if spec["batch_size"]:
        beir = load_beir(spec["data"], "train")
        corpus = beir.corpus  # the test split reuses it
        rows = rows_of(beir, out)
        result, log = fine_tune(model, rows, spec, memory=spec["memory"])
        out["train"] = {
            "rows": len(rows),
            "steps": result.steps,
            "rows_per_step_max": max(r["examples"] for r in log),
            "seconds": round(result.seconds, 1),
            "first_loss": round(log[0]["loss"], 4),
            "final_loss": round(result.final_loss, 4),
            **(more_train(result, log) if more_train else {}),
            "plan": result.plan,
        }
    return evaluate_test(model, spec, corpus, out)


def evaluate_test(model, spec: dict, corpus, out: dict) -> dict:
    """Evaluate on the test split over the full corpus (``corpus``: the train split's, when
    loaded); adds timing, sizes, metrics and peak RSS to ``out`` and returns it."""
    from densefit.data.corpus import load_beir
    from densefit.evaluate import evaluate
    from densefit.training.loop import peak_rss_bytes

    started = time.perf_counter()
    test = load_beir(spec["data"], "test", corpus=corpus)
    result = evaluate(model, test, split="test", batch_size=64)
    out["eval_s"] = round(time.perf_counter() - started, 1)
    out["eval_docs"] = len(test.corpus)
    out["eval_queries"] = result.n_queries
    out["metrics"] = {k: round(v, 5) for k, v in result.metrics.items()}
    out["peak_rss_mb"] = round(peak_rss_bytes() / 2**20, 1)
    return out


def judged_plus_others(split, others: int, seed: int):
    """``split`` with its corpus cut to the documents its qrels judge plus ``others`` more
    drawn at random (seeded), as ``densefit run``'s evaluation subsample does; ``others``
    0: the whole corpus."""
    import dataclasses

    if not others:
        return split
    judged = {d for docs in split.qrels.values() for d in docs}
    rest = sorted(set(split.corpus) - judged)
    picked = set(random.Random(seed).sample(rest, min(others, len(rest))))
    corpus = {k: v for k, v in split.corpus.items() if k in judged or k in picked}
    return dataclasses.replace(split, corpus=corpus)


def run_grid_point(
    script: str, spec: dict, threads: int, jsonl: Path, *, env: dict | None = None, **more
) -> dict:
    """Run ``script --point SPEC`` in a fresh interpreter and append its record to
    ``jsonl``: the spec with its results (status ok) or the end of its output (status
    failed, ``error``), timing, load and ``more``; prints how it went."""
    child: Child = run_child(script, "--point", json.dumps(spec), threads=threads, env=env)
    record = {**spec, "status": "ok" if child.ok else "failed"}
    if child.ok:
        record.update(child.result)
    else:
        record["error"] = (child.stderr or child.stdout)[-2000:]
    record.update(
        wall_s=child.wall_s,
        threads=threads,
        loadavg_before=child.loadavg_before,
        loadavg_after=child.loadavg_after,
        finished=child.finished,
        **more,
    )
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    with jsonl.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print_point(record)
    return record


def print_point(record: dict) -> None:
    """The progress line of a point just run: its failure, or its metrics and times."""
    if record["status"] != "ok":
        print(f"     FAILED after {record['wall_s']}s:\n{record['error']}", flush=True)
        return
    train = record["train"] or {}
    print(
        f"     nDCG@10 {record['metrics']['ndcg@10']:.4f} R@100 "
        f"{record['metrics']['recall@100']:.4f} steps {train.get('steps', 0)} "
        f"train {train.get('seconds', 0)}s eval {record['eval_s']}s wall {record['wall_s']}s",
        flush=True,
    )


# ----------------------------------------------------------------------------- report


def point_row(record: dict) -> dict:
    """A finished point's CSV columns (a grid's CSV writes the ones its fields name)."""
    train = record.get("train") or {}
    keys = ("dataset", "batch_size", "rule", "learning_rate", "epochs", "negatives", "seed")
    keys += ("memory", "peak_rss_mb", "threads", "commit", "key")
    return (
        {k: record.get(k) for k in keys}
        | {m: record["metrics"][m] for m in ("ndcg@10", "recall@100")}
        | {
            "steps": train.get("steps", 0),
            "rows_per_step": train.get("rows_per_step_max", ""),
            "train_s": train.get("seconds", 0),
            "eval_s": record["eval_s"],
            "wall_s": record["wall_s"],
            "load_1min_before": (record.get("loadavg_before") or [None])[0],
        }
    )


def write_report(
    folder: Path, name: str, payload: dict, text: str, fields: list[str], records, more=None
) -> None:
    """A grid's files: NAME.json (``payload``), NAME.md (``text``) and NAME.csv, one row a
    point of ``records`` (its :func:`point_row` columns, then ``more(record)``'s) with the
    columns ``fields`` names."""
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (folder / f"{name}.md").write_text(text)
    with open(folder / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in records:
            writer.writerow(point_row(r) | (more(r) if more else {}))


def pyplot(missing: str = "matplotlib not installed: no PNG"):
    """matplotlib.pyplot on the Agg backend; None (saying ``missing``) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(missing)
        return None
    return plt
