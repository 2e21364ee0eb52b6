"""One benchmark point in a fresh process: a few training steps of one method, measured.

Usage (called by the bench scripts, one process per point):
    python bench/_step_worker.py '{"impl": "densefit", "method": "cache", "dataset": "pydoc", ...}'

Prints one JSON line with peak RSS, activation memory (peak RSS minus RSS once the model,
its gradients and AdamW's state exist), step times and padding efficiency.

Methods: densefit plain | checkpoint | cache | cache+checkpoint | auto | cache-nokeep (the
cache with keep_graphs=0: every chunk re-embedded, as in GradCache) | cache-glibc (the cache
under the system's malloc) | cache-release (that with release_cpu_memory=True), and the
sentence-transformers peers st-mnrl | st-mnrl-gc | st-cmnrl (st-cmnrl-mi: under mimalloc),
each driven the way
SentenceTransformerTrainer drives them (its collator pads each column to its longest text,
then loss(features, labels).backward(), clip, AdamW step).
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

from _runner import DATASETS


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    """VmHWM: the peak RSS since the last reset_peak_rss() (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> None:
    """Forget the peak of model loading: writing 5 to clear_refs resets VmHWM."""
    Path("/proc/self/clear_refs").write_text("5")


def load_rows(dataset: str, n: int, seed: int = 0):
    from densefit.data.readers import read_training_data

    path = DATASETS / dataset if dataset != "pydoc" else DATASETS / "pydoc" / "train.jsonl"
    rows, _ = read_training_data(path, split="train")
    rng = random.Random(seed)
    rng.shuffle(rows)
    if len(rows) < n:  # repeat the data for big batches; texts stay real
        rows = (rows * (n // len(rows) + 1))[:n]
    return rows[:n]


def materialize_optimizer(model, optimizer) -> None:
    """Allocate gradients and AdamW state before the baseline, without changing weights."""
    import torch

    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


def main(spec: dict) -> dict:
    threads = int(spec.get("threads", 1))
    import torch

    torch.set_num_threads(threads)
    if spec.get("rlimit_gib"):
        limit = int(spec["rlimit_gib"] * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    from densefit.config.train import TrainConfig
    from densefit.data.batching import columns_of
    from densefit.models import load_model
    from densefit.training.setup import make_optimizer, setup_run
    from densefit.training.step import train_step

    B, steps = spec["batch_size"], spec.get("steps", 1)
    warmup_rows = spec.get("warmup_rows", 4)
    rows = load_rows(spec["dataset"], B * steps + warmup_rows, seed=spec.get("seed", 0))
    device = spec.get("device", "cpu")
    model = load_model("all-MiniLM-L6-v2", max_seq_length=spec["max_seq_length"], device=device)
    model.train()
    torch.manual_seed(0)
    config = TrainConfig(
        batch_size=B,
        # cache-nokeep / -release / -trim: the cache with keep_graphs=0 / release_cpu_memory
        memory=spec["method"].split("-")[0] if spec["impl"] == "densefit" else "plain",
        chunk_size=spec.get("chunk_size"),
        memory_budget=spec.get("memory_budget"),
        max_seq_length=spec["max_seq_length"],
        show_progress=False,
        learning_rate=1e-5,
        token_budget=spec.get("token_budget"),
        keep_graphs=spec.get("keep_graphs"),
    )
    import densefit
    from densefit.memory.allocator import allocator_in_use

    out: dict = {
        **spec,
        "allocator": allocator_in_use(),  # the malloc that served this point
        "threads": threads,
        "torch": torch.__version__,
        "densefit_path": str(Path(densefit.__file__).parent),
    }

    if spec["impl"] == "densefit":
        release = spec.get("release_cpu_memory", TrainConfig().release_cpu_memory)  # as train()
        if device == "cpu" and release == "trim":  # glibc's default threshold, trims only
            from densefit.memory.allocator import enable_trim

            enable_trim()
        elif device == "cpu" and release == "fixed-notrim":  # threshold fixed, no per-chunk trim
            import densefit.memory.strategies as strategies_module
            from densefit.memory.allocator import release_freed_memory_promptly

            release_freed_memory_promptly()
            strategies_module.trim = lambda: False
        elif device == "cpu" and release:
            from densefit.memory.allocator import release_freed_memory_promptly

            release_freed_memory_promptly()  # as train() does on CPU
        t0 = time.perf_counter()
        # auto plans for exactly the batches this worker runs
        run_batches = [list(range(i * B, (i + 1) * B)) for i in range(steps)]
        run = setup_run(model, rows, config, batches=run_batches)
        out["plan_seconds"] = round(time.perf_counter() - t0, 2)
        materialize_optimizer(model, run.optimizer)
        plan = run.report()
        out["plan"] = {
            k: plan.get(k)
            for k in (
                "strategy",
                "chunk_size",
                "token_budget",
                "loss_block_size",
                "keep_graphs",
                "predicted_peak_bytes",
            )
        }
        if plan.get("candidates"):  # auto: every strategy the planner weighed
            out["plan"]["candidates"] = [
                {
                    k: c.get(k)
                    for k in ("strategy", "peak_bytes", "fits", "relative_time", "keep_graphs")
                }
                for c in plan["candidates"]
            ]

        def step(indices):
            record = train_step(run, [list(indices)])
            return record["padding_efficiency"]
    else:
        from sentence_transformers.sentence_transformer import losses

        optimizer = make_optimizer(model, config)
        materialize_optimizer(model, optimizer)

        peer = spec["method"].removesuffix("-mi")  # -mi: the same peer under mimalloc
        if peer == "st-cmnrl":
            loss_model = losses.CachedMultipleNegativesRankingLoss(
                model, mini_batch_size=spec.get("chunk_size") or 32
            )
        else:
            loss_model = losses.MultipleNegativesRankingLoss(model)
            if peer == "st-mnrl-gc":
                model[0].auto_model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )

        def step(indices):
            optimizer.zero_grad(set_to_none=True)
            batch = [rows[i] for i in indices]
            features = [model.preprocess(col) for col in columns_of(batch) if col]
            real = sum(int(f["attention_mask"].sum()) for f in features)
            total = sum(f["attention_mask"].numel() for f in features)
            loss = loss_model(features, None)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            return real / total

    import gc

    gc.collect()
    out["baseline_rss_mb"] = round(rss_mb(), 1)
    reset_peak_rss()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        out["baseline_cuda_mb"] = round(torch.cuda.memory_allocated() / 2**20, 1)
    # Warm-up on a few rows (lazy initialisation, first allocations), then timed full steps.
    step(range(B * steps, len(rows)))
    gc.collect()
    reset_peak_rss()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, pads = [], []
    status = "ok"
    try:
        for i in range(steps):
            t0 = time.perf_counter()
            pads.append(step(range(i * B, (i + 1) * B)))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if times[-1] > spec.get("max_step_seconds", 1e9):
                status = "too_slow"
                break
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if (
            "alloc" not in str(exc).lower()
            and "memory" not in str(exc).lower()
            and not isinstance(exc, MemoryError)
        ):
            raise
        status = "oom"
        out["error"] = str(exc).splitlines()[0][:200]
    out.update(
        status=status,
        step_times_s=[round(t, 3) for t in times],
        step_time_s=round(statistics.median(times), 3) if times else None,
        padding_efficiency=round(statistics.mean(pads), 4) if pads else None,
        peak_rss_mb=round(peak_rss_mb(), 1),
    )
    out["activation_mb"] = round(out["peak_rss_mb"] - out["baseline_rss_mb"], 1)
    if cuda:  # on CUDA, activation memory is what the allocator peaked at above the baseline
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        out["activation_mb"] = round(out["peak_cuda_mb"] - out["baseline_cuda_mb"], 1)
    return out


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
