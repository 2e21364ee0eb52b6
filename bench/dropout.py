"""Chunking-invariant dropout: what it costs per training step, with and without, paired.

    OMP_NUM_THREADS=1 python bench/dropout.py [--batch 32] [--steps 8] [--threads 1]

Packaged all-MiniLM-L6-v2, SciFact training pairs (query, positive) at sequence length 128,
densefit's forward-backward for plain (chunks of 16), cache (chunks of 8) and
checkpoint. One process, one model: each timed step runs once with ordinary dropout and once
with invariant dropout (densefit.memory.dropout), alternating from pair to pair which goes
first, so both see the same load; the result is the per-pair ratio (invariant / ordinary) of the step's CPU
time (process time: one thread, so it is the work done, and it moves less than the wall
clock when other jobs share the machine) and of its wall time, not absolute times. Also records the bytes one forward saves for backward with and without
(densefit.memory.planner.saved_bytes), and checks that with it on, the three strategies
give the same loss. Writes bench/results/dropout.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from pathlib import Path

import torch
from _runner import DATASETS, RESULTS

from densefit.config.train import TrainConfig
from densefit.data.batching import columns_of
from densefit.data.readers import read_training_data
from densefit.memory import fixed_plan, make_strategy, tokenize
from densefit.memory.dropout import (
    disable_invariant_dropout,
    dropout_rows,
    enable_invariant_dropout,
)
from densefit.memory.planner import saved_bytes
from densefit.models import load_model
from densefit.training.objective import make_loss_fn

METHODS = {"plain": ("plain", None), "cache": ("cache", 8), "checkpoint": ("checkpoint", None)}


def _step(model, strategy, rows, config) -> tuple[float, float, float]:
    """One forward-backward of ``rows``: (CPU seconds, wall seconds, loss); grads zeroed after."""
    loss_fn = make_loss_fn(config, rows)
    torch.manual_seed(0)  # the same step key / dropout stream in every run
    cpu, wall = time.process_time(), time.perf_counter()
    stats = strategy.forward_backward(model, columns_of(rows), loss_fn)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    model.zero_grad(set_to_none=False)
    return cpu, wall, stats.loss


def _saved_mb(model, texts: list[str], invariant: bool) -> float:
    """MiB one forward of ``texts`` saves for backward (parameters excluded)."""
    features = tokenize(model, texts)
    rows = torch.arange(len(texts))

    def forward():
        with dropout_rows(model, 1 if invariant else None, 0, rows, features["attention_mask"]):
            return model(dict(features))["sentence_embedding"]

    return saved_bytes(forward, exclude=list(model.parameters())) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the files go")
    args = parser.parse_args()
    results = args.results
    torch.set_num_threads(args.threads)

    examples, _ = read_training_data(DATASETS / "scifact", split="train")
    batches = [examples[i * args.batch : (i + 1) * args.batch] for i in range(args.steps + 1)]
    config = TrainConfig(
        similarity="cosine", batch_size=args.batch, max_seq_length=args.seq, show_progress=False
    )
    model = load_model("all-MiniLM-L6-v2", max_seq_length=args.seq)
    model.train()

    pairs, losses = [], {}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    for step, rows in enumerate(batches):  # batch 0 warms both variants up, untimed
        for index, (method, (name, chunk)) in enumerate(METHODS.items()):
            strategy = make_strategy(fixed_plan(name, chunk))
            strategy.prepare(model)
            cpu, wall = {}, {}
            # Which variant goes first alternates from one step's pair to the next (and
            # between the strategies of a step).
            order = (False, True) if (step + index) % 2 == 0 else (True, False)
            load = os.getloadavg()[0]
            for invariant in order:
                (enable_invariant_dropout if invariant else disable_invariant_dropout)(model)
                cpu[invariant], wall[invariant], loss = _step(model, strategy, rows, config)
                if invariant:
                    losses.setdefault(step, {})[method] = loss
            disable_invariant_dropout(model)
            if step == 0:
                continue
            pairs.append(
                {
                    "step": step,
                    "method": method,
                    "invariant_first": order[0],
                    "ordinary_cpu_s": round(cpu[False], 3),
                    "invariant_cpu_s": round(cpu[True], 3),
                    "cpu_ratio": round(cpu[True] / cpu[False], 4),
                    "ordinary_wall_s": round(wall[False], 3),
                    "invariant_wall_s": round(wall[True], 3),
                    "wall_ratio": round(wall[True] / wall[False], 4),
                    "loadavg_before": round(load, 2),
                    "loadavg_after": round(os.getloadavg()[0], 2),
                }
            )
            print(json.dumps(pairs[-1]), flush=True)

    texts = [r.positive for r in batches[0][:16]]
    memory = {"ordinary_saved_mb": round(_saved_mb(model, texts, False), 1)}
    enable_invariant_dropout(model)
    memory["invariant_saved_mb"] = round(_saved_mb(model, texts, True), 1)
    disable_invariant_dropout(model)
    spread = max(max(v.values()) - min(v.values()) for v in losses.values())

    rows_out = []
    for method in METHODS:
        mine = [p for p in pairs if p["method"] == method]
        cpu_ratios = [p["cpu_ratio"] for p in mine]
        wall_ratios = [p["wall_ratio"] for p in mine]
        rows_out.append(
            {
                "method": method,
                "pairs": len(mine),
                "median_cpu_ratio": round(statistics.median(cpu_ratios), 4),
                "min_cpu_ratio": min(cpu_ratios),
                "max_cpu_ratio": max(cpu_ratios),
                "median_wall_ratio": round(statistics.median(wall_ratios), 4),
                "min_wall_ratio": min(wall_ratios),
                "max_wall_ratio": max(wall_ratios),
                "median_ordinary_cpu_s": statistics.median(p["ordinary_cpu_s"] for p in mine),
                "median_invariant_cpu_s": statistics.median(p["invariant_cpu_s"] for p in mine),
            }
        )
    loads = [p["loadavg_before"] for p in pairs] + [p["loadavg_after"] for p in pairs]
    machine = {
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_min": min(loads),
        "loadavg_max": max(loads),
        "note": (
            "other jobs shared the machine (1-min load above 1.5): " if max(loads) > 1.5 else ""
        )
        + "compare the paired ratios, CPU time first, not the absolute times",
    }
    setup = {
        "model": "all-MiniLM-L6-v2",
        "dataset": "scifact (query, positive)",
        "batch": args.batch,
        "max_seq_length": args.seq,
        "timed_steps": args.steps,
        "methods": {m: {"strategy": n, "chunk_size": c} for m, (n, c) in METHODS.items()},
    }
    results.mkdir(parents=True, exist_ok=True)
    (results / "dropout.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "setup": setup,
                "rows": rows_out,
                "pairs": pairs,
                "saved_for_backward_16_positives": memory,
                "invariant_loss_spread_across_methods": spread,
            },
            indent=1,
        )
    )
    with (results / "dropout.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        writer.writeheader()
        writer.writerows(rows_out)
    _plot(pairs, machine, setup, results)
    print(json.dumps({"rows": rows_out, "memory": memory, "loss_spread": spread}, indent=1))


def _plot(pairs: list[dict], machine: dict, setup: dict, results: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, method in enumerate(METHODS):
        for shift, kind, marker in ((-0.12, "cpu", "o"), (0.12, "wall", "x")):
            ratios = [p[f"{kind}_ratio"] for p in pairs if p["method"] == method]
            ax.scatter(
                [i + shift] * len(ratios),
                ratios,
                marker=marker,
                color=f"C{i}",
                label=f"{kind} time" if i == 0 else None,
            )
            ax.hlines(statistics.median(ratios), i + shift - 0.1, i + shift + 0.1, color="black")
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.axhline(1.05, color="red", linestyle=":", linewidth=0.8)  # the default-on threshold
    ax.set_xticks(range(len(METHODS)), list(METHODS))
    ax.legend(fontsize=8)
    ax.set_ylabel("step time: invariant / ordinary")
    ax.set_title(
        f"MiniLM, SciFact batch {setup['batch']}, seq {setup['max_seq_length']}, "
        f"{machine['threads']} thread(s), shared machine (paired ratios)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(results / "dropout.png", dpi=120)


if __name__ == "__main__":
    main()
