"""Training on one CUDA GPU, densefit against sentence-transformers in the same process.

    python bench/gpu_train.py --part steps      # step time and peak memory (bench/gpu.sh)
    python bench/gpu_train.py --part converge   # bf16 and fp16 runs against fp32
    python bench/gpu_train.py --part steps --device cpu --batches 8 --steps 2 --name smoke

Parts:

- ``steps``: all-MiniLM-L6-v2 on SciFact training pairs (repeated to fill the batch) at
  sequence length 128, batches ``--batches`` (512 and 4,096): densefit plain / checkpoint /
  cache (chunks of 256 rows) and auto (the planner, default budget: 0.8 of the free GPU
  memory) against sentence-transformers MultipleNegativesRankingLoss and
  CachedMultipleNegativesRankingLoss (mini-batch 256), each driven as
  SentenceTransformerTrainer drives it (the collator pads each column, loss, backward,
  clip, AdamW). A warm-up step on 4 rows, then ``--steps`` timed steps (CUDA synchronised);
  the step time is the median of all but the first; the peak is the allocator's whole
  process peak over the timed steps (weights, gradients, AdamW, activations). Tokenizing is
  part of every step, as in a training loop. The targets of issue 37 are checked on the rows
  (``targets``): cache at batch 4,096 at most 0.8x CachedMNRL's step time at no more memory;
  auto at least as fast as the fastest densefit plan that fitted; plain at least as fast as
  MNRL.
- ``converge``: ``--converge-steps`` (50) steps at batch 128 in fp32, ``--amp bf16`` and
  ``--amp fp16`` (loss scaling), the same seed and data: each step's loss, and the last ten
  steps' mean loss of each against fp32's.

Each point runs in this one process, one after the other (the GPU's memory freed between
them); a point that fails (out of memory included) is recorded with its error and the next
one runs. Rows are written as they finish. Writes bench/results/gpu_train_steps.{jsonl,json,md}
or bench/results/gpu_train_converge.json (``--name`` replaces ``gpu_train``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from _runner import RESULTS, ROOT, command_line, environment

sys.path.insert(0, str(ROOT))

MODEL = "all-MiniLM-L6-v2"
CHUNK = 256  # densefit's chunks and CachedMNRL's mini-batch
DENSEFIT = ["plain", "checkpoint", "cache", "auto"]
PEERS = ["st-mnrl", "st-cmnrl"]


def free_memory(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def densefit_step(model, rows, spec: dict, device: str):
    """A ``step(indices)`` of densefit's :func:`~densefit.training.step.train_step`, and what
    the run's plan says."""
    from _step_worker import materialize_optimizer

    from densefit.config.train import TrainConfig
    from densefit.training.setup import setup_run
    from densefit.training.step import train_step

    B, steps = spec["batch_size"], spec["steps"]
    method = spec["method"]
    config = TrainConfig(
        batch_size=B,
        memory=method,
        chunk_size=None if method == "auto" else CHUNK,
        max_seq_length=spec["max_seq_length"],
        learning_rate=1e-5,
        show_progress=False,
        device=device,
    )
    batches = [list(range(i * B, (i + 1) * B)) for i in range(steps)]
    started = time.perf_counter()
    run = setup_run(model, rows, config, batches=batches)
    plan = run.report()
    facts = {
        "plan_seconds": round(time.perf_counter() - started, 2),
        "plan": {
            k: plan.get(k)
            for k in ("strategy", "chunk_size", "token_budget", "keep_graphs", "loss_block_size")
        },
        "predicted_peak_mib": round(plan["predicted_peak_bytes"] / 2**20, 1)
        if plan.get("predicted_peak_bytes")
        else None,
        "budget_mib": round(plan["budget_bytes"] / 2**20, 1) if plan.get("budget_bytes") else None,
    }
    materialize_optimizer(model, run.optimizer)
    return (lambda indices: train_step(run, [list(indices)])), facts, run


def st_step(model, rows, spec: dict, device: str):
    """A ``step(indices)`` of sentence-transformers' MNRL or CachedMNRL."""
    import torch
    from _step_worker import materialize_optimizer
    from sentence_transformers.sentence_transformer import losses
    from sentence_transformers.util import batch_to_device

    from densefit.config.train import TrainConfig
    from densefit.data.batching import columns_of
    from densefit.training.setup import make_optimizer

    optimizer = make_optimizer(model, TrainConfig(learning_rate=1e-5))
    materialize_optimizer(model, optimizer)
    if spec["method"] == "st-cmnrl":
        loss_model = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=CHUNK)
    else:
        loss_model = losses.MultipleNegativesRankingLoss(model)

    def step(indices):
        optimizer.zero_grad(set_to_none=True)
        batch = [rows[i] for i in indices]
        features = [
            batch_to_device(model.preprocess(col), model.device) for col in columns_of(batch) if col
        ]
        loss = loss_model(features, None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step, {}, (optimizer, loss_model)


def measure(spec: dict, device: str) -> dict:
    """One point: its model, warm-up, timed steps and peak memory."""
    import torch
    from _step_worker import load_rows

    from densefit.models import load_model

    B, steps = spec["batch_size"], spec["steps"]
    rows = load_rows("scifact", B * steps + 4)
    model = load_model(MODEL, max_seq_length=spec["max_seq_length"], device=device)
    model.train()
    torch.manual_seed(0)
    maker = densefit_step if spec["impl"] == "densefit" else st_step
    step, facts, keep = maker(model, rows, spec, device)
    out = {**spec, **facts}
    cuda = device.startswith("cuda")
    step(range(B * steps, len(rows)))  # warm-up: lazy initialisation, first allocations
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps):
        started = time.perf_counter()
        step(range(i * B, (i + 1) * B))
        sync(device)
        times.append(time.perf_counter() - started)
    timed = times[1:] or times
    out.update(
        status="ok",
        step_times_s=[round(t, 4) for t in times],
        step_time_s=round(statistics.median(timed), 4),
        examples_per_s=round(B / statistics.median(timed), 1),
    )
    if cuda:
        out["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        out["peak_reserved_mib"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
        if out.get("predicted_peak_mib"):  # the planner's prediction against the measurement
            out["peak_vs_predicted"] = round(out["peak_mib"] / out["predicted_peak_mib"], 3)
    del model, step, keep
    return out


def steps_specs(batches: list[int], steps: int) -> list[dict]:
    return [
        {
            "impl": impl,
            "method": method,
            "batch_size": B,
            "steps": steps,
            "max_seq_length": 128,
            "key": f"{B}/{method}",
        }
        for B in batches
        for impl, methods in (("densefit", DENSEFIT), ("st", PEERS))
        for method in methods
    ]


def targets(rows: list[dict]) -> dict:
    """Issue 37's training targets, on the rows that ran: True / False, or None when a row
    they need is missing."""
    ok = {(r["batch_size"], r["method"]): r for r in rows if r.get("status") == "ok"}
    found: dict = {}
    for B in sorted({r["batch_size"] for r in rows}):
        cache, cmnrl = ok.get((B, "cache")), ok.get((B, "st-cmnrl"))
        plain, mnrl, auto = ok.get((B, "plain")), ok.get((B, "st-mnrl")), ok.get((B, "auto"))
        if cache and cmnrl:
            found[f"cache_vs_cmnrl_time_{B}"] = round(
                cache["step_time_s"] / cmnrl["step_time_s"], 3
            )
            if "peak_mib" in cache:
                found[f"cache_vs_cmnrl_memory_{B}"] = round(
                    cache["peak_mib"] / cmnrl["peak_mib"], 3
                )
        if plain and mnrl:
            found[f"plain_vs_mnrl_time_{B}"] = round(plain["step_time_s"] / mnrl["step_time_s"], 3)
        fitted = [ok[B, m] for m in ("plain", "checkpoint", "cache") if (B, m) in ok]
        if auto and fitted:
            fastest = min(r["step_time_s"] for r in fitted)
            found[f"auto_vs_fastest_fitting_{B}"] = round(auto["step_time_s"] / fastest, 3)
    checks = {
        "cache_4096_at_most_0.8x_cmnrl_time": found.get("cache_vs_cmnrl_time_4096"),
        "cache_4096_no_more_memory_than_cmnrl": found.get("cache_vs_cmnrl_memory_4096"),
    }
    return {
        "ratios": found,
        "met": {
            "cache_4096_at_most_0.8x_cmnrl_time": None
            if checks["cache_4096_at_most_0.8x_cmnrl_time"] is None
            else checks["cache_4096_at_most_0.8x_cmnrl_time"] <= 0.8,
            "cache_4096_no_more_memory_than_cmnrl": None
            if checks["cache_4096_no_more_memory_than_cmnrl"] is None
            else checks["cache_4096_no_more_memory_than_cmnrl"] <= 1.0,
            "auto_as_fast_as_the_fastest_fitting_plan": _all_at_most(found, "auto_vs_fastest", 1.0),
            "plain_as_fast_as_mnrl": _all_at_most(found, "plain_vs_mnrl_time", 1.0),
        },
    }


def _all_at_most(found: dict, prefix: str, limit: float) -> bool | None:
    values = [v for k, v in found.items() if k.startswith(prefix)]
    return None if not values else all(v <= limit for v in values)


def write_steps(rows: list[dict], name: str, argv: list[str]) -> None:
    payload = {
        "command": command_line("gpu_train.py", argv),
        "model": MODEL,
        "environment": environment(),
        "rows": rows,
        "targets": targets(rows),
    }
    (RESULTS / f"{name}_steps.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        f"# Training steps on {payload['environment'].get('gpu', 'the CPU')}",
        "",
        f"`{payload['command']}`; torch {payload['environment']['torch']}, "
        f"sentence-transformers {payload['environment']['sentence_transformers']}, CUDA "
        f"{payload['environment'].get('cuda')}. Median step (s) of the timed steps but the "
        "first; peak: the allocator's process peak (MiB).",
        "",
        "| batch | method | step s | examples/s | peak MiB | plan |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        plan = r.get("plan") or {}
        shown = f"{plan.get('strategy')} chunk {plan.get('chunk_size')}" if plan else ""
        if r.get("status") != "ok":
            shown = f"{r.get('status')}: {r.get('error', '')[:80]}"
        lines.append(
            f"| {r['batch_size']:,} | {r['method']} | {r.get('step_time_s')} | "
            f"{r.get('examples_per_s')} | {r.get('peak_mib')} | {shown} |"
        )
    lines += ["", "Targets: `" + json.dumps(payload["targets"]["met"]) + "`", ""]
    (RESULTS / f"{name}_steps.md").write_text("\n".join(lines))


def run_steps(args, argv: list[str]) -> None:
    jsonl = RESULTS / f"{args.name}_steps.jsonl"
    jsonl.write_text("")
    rows = []
    for spec in steps_specs(args.batches, args.steps):
        free_memory(args.device)
        started = time.perf_counter()
        try:
            row = measure(spec, args.device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            row = {**spec, "status": "failed", "error": str(exc).splitlines()[0][:300]}
        row["wall_s"] = round(time.perf_counter() - started, 1)
        free_memory(args.device)
        rows.append(row)
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        write_steps(rows, args.name, argv)
        print(
            f"{spec['key']:<18} {row['status']:<7} step {row.get('step_time_s')} s "
            f"peak {row.get('peak_mib')} MiB plan {row.get('plan', {}).get('strategy')}",
            flush=True,
        )
    print("targets:", json.dumps(targets(rows)), flush=True)


def run_converge(args, argv: list[str]) -> None:
    """fp32, bf16 and fp16 runs of ``--converge-steps`` steps: their losses, side by side."""
    from _step_worker import load_rows

    from densefit import TrainConfig, train
    from densefit.models import load_model

    B = args.converge_batch
    rows = load_rows("scifact", B * args.converge_steps)
    curves: dict = {}
    out = {
        "command": command_line("gpu_train.py", argv),
        "model": MODEL,
        "batch_size": B,
        "steps": args.converge_steps,
        "environment": environment(),
        "runs": {},
    }
    for amp in (None, "bf16", "fp16"):
        free_memory(args.device)
        model = load_model(MODEL, max_seq_length=128, device=args.device)
        config = TrainConfig(
            batch_size=B,
            max_steps=args.converge_steps,
            epochs=100,
            amp=amp,
            device=args.device,
            show_progress=False,
            seed=0,
        )
        started = time.perf_counter()
        try:
            result = train(model, rows, config)
        except (RuntimeError, ValueError) as exc:
            out["runs"][amp or "fp32"] = {"status": "failed", "error": str(exc)[:300]}
            continue
        curves[amp or "fp32"] = result.losses
        out["runs"][amp or "fp32"] = {
            "status": "ok",
            "seconds": round(time.perf_counter() - started, 1),
            "plan": result.plan.get("strategy"),
            "skipped_nonfinite": result.skipped_nonfinite,
            "losses": [round(x, 5) for x in result.losses],
            "last10_mean_loss": round(statistics.mean(result.losses[-10:]), 5),
        }
        del model
    base = out["runs"].get("fp32", {}).get("last10_mean_loss")
    for name in ("bf16", "fp16"):
        run = out["runs"].get(name, {})
        if base and run.get("status") == "ok":
            run["last10_vs_fp32"] = round(run["last10_mean_loss"] / base, 4)
            # converges like fp32: its last ten steps' mean loss within 5% of fp32's
            run["converges_like_fp32"] = abs(run["last10_vs_fp32"] - 1) <= 0.05
    (RESULTS / f"{args.name}_converge.json").write_text(json.dumps(out, indent=2) + "\n")
    for name, run in out["runs"].items():
        shown = {k: v for k, v in run.items() if k != "losses"}
        print(f"{name}: {json.dumps(shown)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["steps", "converge"], required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--converge-steps", type=int, default=50)
    parser.add_argument("--converge-batch", type=int, default=128)
    parser.add_argument("--name", default="gpu_train")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    if args.part == "steps":
        run_steps(args, argv)
    else:
        run_converge(args, argv)


if __name__ == "__main__":
    main()
