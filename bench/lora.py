"""LoRA vs full fine-tuning at equal batch: memory, step time, and SciFact nDCG@10 after
equal steps (all-MiniLM-L6-v2, offline).

    OMP_NUM_THREADS=1 python bench/lora.py [--steps 30] [--pairs 2]

Each training point runs in a fresh process (peak RSS is the process's own): full, LoRA,
LoRA, full, ... (ABBA order: on a shared machine a drift in load hits both alike). Per
point: the planner's static bytes (weights, gradients, AdamW state; frozen weights once),
the peak RSS of training above the loaded model, and the median step time. Then each
configuration's first model, and the base model, are scored on SciFact's test split
(nDCG@10 over every judged document + 1,000 seeded random others: see :func:`eval_point`).
Results: bench/results/lora.{json,csv,png}, with the command and the environment it ran in
(``command``, ``environment``: written by this script) and the load average around every
point; the ratios (LoRA / full within a pair) are the numbers to read, the
absolute times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

import _runner
from _common import judged_plus_others
from _runner import DATASETS, RESULTS

MODEL = "all-MiniLM-L6-v2"
BATCH, SEQ = 32, 128
DISTRACTORS = 1000
SETTINGS = {
    "full": {"learning_rate": 2e-5},
    "lora": {"learning_rate": 2e-4, "lora_r": 16, "lora_alpha": 32},
}


def environment() -> dict:
    """Where the run ran: interpreter, torch, densefit (and its git commit), machine, load."""
    import densefit

    env = _runner.environment()
    return {
        "python": env["python"],
        "torch": env["torch"],
        "densefit": densefit.__version__,
        "git_commit": _runner.git_commit(short=False) or None,
        "platform": env["platform"],
        "cpus": env["cpu_count"],
        "child_threads": 1,  # every point runs with OMP_NUM_THREADS=MKL_NUM_THREADS=1
        "loadavg": _runner.loadavg(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def train_point(mode: str, steps: int, output: str | None) -> dict:
    """One training run in this process: its memory and step times."""
    from densefit import TrainConfig, train
    from densefit.data.sources import load_training_examples
    from densefit.memory.planner import plan_memory
    from densefit.models import apply_lora, load_model, lora_parameter_count

    examples = load_training_examples(DATASETS / "scifact", split="train")
    config = TrainConfig(
        batch_size=BATCH, max_seq_length=SEQ, max_steps=steps, epochs=10, device="cpu",
        show_progress=False, keep_checkpoints=0, seed=7, **SETTINGS[mode],
    )  # fmt: skip
    model = load_model(MODEL, device="cpu", max_seq_length=SEQ)
    apply_lora(model, config)
    planned = dict(config.to_dict(), memory="auto", memory_budget="64GiB")
    static = plan_memory(model, examples, TrainConfig(**planned)).static_bytes
    trainable, total = lora_parameter_count(model)
    Path("/proc/self/clear_refs").write_text("5")  # forget the load's and the probe's peak
    base_rss = _rss_mb()
    stamps: list[float] = []
    started = time.perf_counter()
    train(model, examples, config, output_dir=output, on_step=lambda r: stamps.append(
        time.perf_counter()))  # fmt: skip
    times = [b - a for a, b in zip([started, *stamps], stamps)]
    return {
        "mode": mode,
        "steps": len(stamps),
        "trainable_params": trainable,
        "total_params": total,
        "planner_static_mb": round(static / 2**20, 2),
        "rss_before_training_mb": round(base_rss, 1),
        "training_peak_rss_mb": round(_peak_rss_mb() - base_rss, 1),
        "median_step_s": round(statistics.median(times[2:] or times), 3),
        **{k: v for k, v in SETTINGS[mode].items()},
    }


def eval_point(model_ref: str) -> dict:
    """SciFact test nDCG@10 of a model (max_seq_length 128) on every judged document plus
    DISTRACTORS seeded random others, as ``densefit run``'s ``eval.distractors`` does (the
    full corpus takes most of an hour per model on this shared machine)."""
    from densefit.data.corpus import load_beir
    from densefit.evaluate import evaluate
    from densefit.models import load_model

    model = load_model(model_ref, device="cpu", max_seq_length=SEQ)
    beir = judged_plus_others(load_beir(DATASETS / "scifact", "test"), DISTRACTORS, 0)
    result = evaluate(model, beir, split="test", metrics=["ndcg@10"], batch_size=64)
    return {"ndcg@10": round(float(result.metrics["ndcg@10"]), 4), "documents": len(beir.corpus)}


class _Child:
    """One point in a fresh process (started now; :meth:`result` waits for it)."""

    def __init__(self, kind: str, spec: dict) -> None:
        self.kind, self.spec = kind, spec
        self.running = _runner.start_child(__file__, f"--{kind}", json.dumps(spec), threads=1)

    def result(self) -> dict:
        child = self.running.wait()
        if child.returncode != 0:
            raise RuntimeError(f"{self.kind} {self.spec} failed:\n{child.stderr[-3000:]}")
        out = child.result
        out.update(load_before=child.loadavg_before[0], load_after=child.loadavg_after[0],
                   wall_s=child.wall_s)  # fmt: skip
        print(json.dumps({self.kind: self.spec, **out}), flush=True)
        return out


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["planner static bytes", "training peak RSS", "median step time"]
    keys = ["planner_static_ratio", "training_peak_rss_ratio", "step_time_ratio"]
    values = [summary[k] for k in keys]
    left.bar(names, values, color="#4c72b0")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set_title("LoRA r=16 / full fine-tuning (paired runs)")
    for i, v in enumerate(values):
        left.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    left.tick_params(axis="x", labelsize=8)
    scores = summary["ndcg@10"]
    right.bar(list(scores), list(scores.values()), color=["grey", "#4c72b0", "#dd8452"])
    right.set_title(f"SciFact test nDCG@10 after {summary['steps']} steps")
    for i, v in enumerate(scores.values()):
        right.text(i, v, f"{v:.4f}", ha="center", va="bottom")
    right.set_ylim(0, max(scores.values()) * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    """Run the paired points, then the evaluations; write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--work", default="/tmp/densefit-bench-lora")
    parser.add_argument(
        "--no-eval",
        action="store_true",
        help="Time the training points only (no evaluation, no results written: print the "
        "lines for --from-log).",
    )
    parser.add_argument("--train", help=argparse.SUPPRESS)
    parser.add_argument("--eval", help=argparse.SUPPRESS)
    parser.add_argument(
        "--from-log",
        help="Write the results from the JSON lines a run printed (LOG): the complete pairs "
        "and the evaluations, e.g. of a run stopped early.",
    )
    args = parser.parse_args()
    if args.train:
        spec = json.loads(args.train)
        print("RESULT " + json.dumps(train_point(spec["mode"], spec["steps"], spec.get("output"))))
        return
    if args.eval:
        print("RESULT " + json.dumps(eval_point(json.loads(args.eval)["model"])))
        return

    command = _runner.command_line("lora.py", sys.argv[1:])
    if args.from_log:
        points, scores, run = _read_log(Path(args.from_log))
        pairs = len({p["pair"] for p in points})
        run = run or {"command": None, "environment": None}  # a log without its header line
        write_results(
            points,
            scores,
            args.steps,
            f"{run['command']} (the run; {pairs} complete pair(s)), then "
            f"{command} (this file, from its printed lines)",
            run["environment"],
        )
        return
    # The header line of the printed log: --from-log reads the run's command and environment.
    run = {"command": command, "environment": environment()}
    print(json.dumps({"run": run}), flush=True)
    work = Path(args.work)
    points, evals = [], {} if args.no_eval else {"base": _Child("eval", {"model": MODEL})}
    for pair in range(args.pairs):
        order = ("full", "lora") if pair % 2 == 0 else ("lora", "full")
        for mode in order:
            output = None
            if not (args.no_eval or mode in evals):
                output = str(work / f"{mode}-{int(time.time())}")
            spec = {"mode": mode, "steps": args.steps, "output": output}
            points.append({**_Child("train", spec).result(), "pair": pair})
            if output is not None:  # scored while the next points train
                evals[mode] = _Child("eval", {"model": output})
    if args.no_eval:
        return
    scores = {mode: evals[mode].result()["ndcg@10"] for mode in ("base", "full", "lora")}
    write_results(points, scores, args.steps, run["command"], run["environment"])


def _read_log(path: Path) -> tuple[list[dict], dict, dict | None]:
    """The training points of the complete pairs, the scores, and the run's command and
    environment (its first line; None in a log without it), from a run's printed lines."""
    points, scores, run = [], {}, None
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "run" in row:
            run = row["run"]
        elif "train" in row:
            points.append({k: v for k, v in row.items() if k != "train"})
        elif "eval" in row:
            model = row["eval"]["model"]
            mode = "base" if model == MODEL else Path(model).name.split("-")[0]
            scores[mode] = row["ndcg@10"]
    for i, point in enumerate(points):
        point["pair"] = i // 2
    return [p for p in points if p["pair"] < len(points) // 2], scores, run


def write_results(
    points: list[dict], scores: dict, steps: int, command: str, env: dict | None
) -> None:
    """bench/results/lora.{json,csv,png}: the paired ratios, the scores and every point."""
    pairs = sorted({p["pair"] for p in points})

    def per_pair(key: str) -> list[float]:
        rows = [{p["mode"]: p[key] for p in points if p["pair"] == pair} for pair in pairs]
        return [round(row["lora"] / row["full"], 3) for row in rows]

    def ratio(key: str) -> float:
        return round(statistics.median(per_pair(key)), 3)

    import torch

    summary = {
        "command": command,
        "environment": env,
        "model": MODEL,
        "batch_size": BATCH,
        "max_seq_length": SEQ,
        "steps": steps,
        "pairs": len(pairs),
        "threads": 1,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "device": "cpu",
        "memory": "plain",
        "note": "shared machine (2 cores, other jobs running: see load_before/load_after per "
        "point); one training point at a time, paired in ABBA order, the evaluations run "
        "beside the training points; ratios are LoRA / full within each pair (median over "
        "pairs); absolute times are load-dependent. nDCG@10: the first model of each "
        "configuration, SciFact test, judged documents + 1,000 seeded random distractors (higher "
        "than on the full corpus; compare within this file only). GPU: not measured here "
        "(bench/gpu.sh).",
        "planner_static_ratio": ratio("planner_static_mb"),
        "training_peak_rss_ratio": ratio("training_peak_rss_mb"),
        "step_time_ratio": ratio("median_step_s"),
        "step_time_ratio_per_pair": per_pair("median_step_s"),
        "training_peak_rss_ratio_per_pair": per_pair("training_peak_rss_mb"),
        "ndcg@10": scores,
        "settings": SETTINGS,
        "points": points,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(summary, indent=2))
    with (RESULTS / "lora.csv").open("w", newline="") as f:
        fields = list(dict.fromkeys(k for p in points for k in p))
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(points)
    _plot(summary, RESULTS / "lora.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "points"}, indent=2))


if __name__ == "__main__":
    main()
