"""One rank of a bench/distributed.py point: timed training steps on a shard of each global batch.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python bench/_dist_worker.py SPEC_JSON

Every collective is counted: ``torch.distributed`` calls by wrapping the module's functions,
DistributedDataParallel's gradient all-reduces through a comm hook (its reducer does not go
through the Python functions). Prints ``RESULT {...}`` with per-step times and counts.

impl ``densefit``: the training loop's own step (``densefit.training.step.train_step``) on the
global batch; densefit shards it and gathers candidates (``gather=candidates``).
impl ``st``: sentence-transformers' CachedMultipleNegativesRankingLoss with
``gather_across_devices=True`` driven as SentenceTransformerTrainer drives it under DDP
(the DDP-wrapped model swapped into the loss, ``find_unused_parameters=True`` as the HF
Trainer defaults to), on this rank's shard of the same global batch.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from _step_worker import load_rows, materialize_optimizer

CALLS: Counter = Counter()
BYTES: Counter = Counter()


def count(name, original):
    def wrapped(*args, **kwargs):
        CALLS[name] += 1
        return original(*args, **kwargs)

    return wrapped


for _name in (
    "all_reduce",
    "all_gather",
    "all_to_all",
    "all_to_all_single",
    "scatter",
    "reduce_scatter",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
):
    setattr(dist, _name, count(_name, getattr(dist, _name)))


def main(spec: dict) -> dict:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = spec.get("device", "cpu")
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    cuda = device.startswith("cuda")

    from densefit.config.train import TrainConfig
    from densefit.data.batching import columns_of
    from densefit.models import load_model
    from densefit.training.distributed import shard_bounds
    from densefit.training.setup import make_optimizer, setup_run
    from densefit.training.step import train_step

    B, steps, chunk = spec["batch_size"], spec["steps"], spec["chunk_size"]
    warm = 2 * world
    rows = load_rows("scifact", B * steps + warm, seed=0)
    model = load_model("all-MiniLM-L6-v2", max_seq_length=spec["max_seq_length"], device=device)
    model.train()
    torch.manual_seed(rank)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = TrainConfig(
        batch_size=B,
        memory=spec.get("method", "cache"),
        chunk_size=chunk,
        show_progress=False,
        learning_rate=1e-5,
        max_seq_length=spec["max_seq_length"],
        device=device,
    )
    if spec["impl"] == "densefit":
        if not cuda:
            from densefit.memory.allocator import release_freed_memory_promptly

            release_freed_memory_promptly()  # as train() does on CPU
        run = setup_run(model, rows, config)  # rank 0's plan, broadcast weights
        materialize_optimizer(model, run.optimizer)
        torch.manual_seed(rank)

        def step(indices):
            record = train_step(run, [list(indices)])
            keys = (
                "grad_allreduces",
                "embedding_allgathers",
                "embedding_grad_allreduces",
                "comm_mb",
                "chunks",
            )
            return record["loss"], {k: record[k] for k in keys if k in record}
    else:
        from sentence_transformers.sentence_transformer import losses

        optimizer = make_optimizer(model, config)
        materialize_optimizer(model, optimizer)
        loss_model = losses.CachedMultipleNegativesRankingLoss(
            model, mini_batch_size=chunk, gather_across_devices=world > 1
        )
        if world > 1:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(
                model,
                find_unused_parameters=True,
                device_ids=[torch.cuda.current_device()] if cuda else None,
            )

            def counting_hook(state, bucket):
                CALLS["ddp_bucket_allreduce"] += 1
                BYTES["ddp_bucket_allreduce"] += bucket.buffer().numel() * 4
                if bucket.is_last():
                    CALLS["ddp_sync"] += 1  # one synchronisation = all buckets of one backward
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, counting_hook)
            loss_model.model = ddp  # what SentenceTransformerTrainer does under DDP

        def step(indices):
            batch = [rows[i] for i in indices]
            a, b = shard_bounds(len(batch), world, rank)
            local = batch[a:b]
            optimizer.zero_grad(set_to_none=True)
            features = [
                {
                    k: v.to(device) if hasattr(v, "to") else v
                    for k, v in model.preprocess(col).items()
                }
                for col in columns_of(local)
                if col
            ]
            loss = loss_model(features, None)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            return float(loss.detach()), {}

    step(range(B * steps, len(rows)))  # warm-up on a few rows
    if world > 1:
        dist.barrier()
    times, per_step = [], []
    for i in range(steps):
        CALLS.clear()
        BYTES.clear()
        t0 = time.perf_counter()
        loss, own = step(range(i * B, (i + 1) * B))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        counts = {**dict(CALLS), **own, "loss": round(loss, 5)}
        if BYTES:
            counts["ddp_allreduce_mb"] = round(BYTES["ddp_bucket_allreduce"] / 2**20, 2)
            # DDP's default hook goes through dist.all_reduce: those calls are the buckets
            counts["all_reduce"] = counts.get("all_reduce", 0) - CALLS["ddp_bucket_allreduce"]
        per_step.append(counts)
        if world > 1:
            dist.barrier()
    if world > 1:
        dist.destroy_process_group()
    return {
        **spec,
        "rank": rank,
        "world_size": world,
        "n_params": n_params,
        "step_times_s": [round(t, 3) for t in times],
        "step_time_s": round(statistics.median(times), 3),
        "per_step": per_step,
    }


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
