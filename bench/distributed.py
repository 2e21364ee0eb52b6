"""1 vs 2 processes on the same global batch: step time and collectives per step.

    python bench/distributed.py                    # CPU: gloo, 1 thread per process (~5 min)
    python bench/distributed.py --device cuda --nproc 2 4 8 --batch-size 1024 --chunk-size 64

Packaged all-MiniLM-L6-v2 on SciFact training pairs at 128 tokens, the gradient cache in
both implementations (densefit ``--memory cache``; sentence-transformers
CachedMultipleNegativesRankingLoss with ``gather_across_devices=True`` under DDP, the DDP
model swapped into the loss as SentenceTransformerTrainer does). Every process of a point is
fresh (bench/_dist_worker.py); a step's time is the slowest rank's. Counted per step: the
gradient all-reduces (densefit: its one flat buffer; DDP: bucket all-reduces through a comm
hook, and synchronisations = backwards that reduced), and the embedding collectives.

Writes bench/results/distributed{SUFFIX}.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import socket
import time
from pathlib import Path

from _runner import HERE, RESULTS, loadavg, machine_note, start_child


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_point(spec: dict, world: int, timeout: float) -> dict:
    """One point: ``world`` ranks of _dist_worker.py (one process each, 1 thread each)."""
    port = free_port()
    load_before = loadavg()
    started = time.perf_counter()
    children = []
    for r in range(world):
        ranks_env: dict = {"WORLD_SIZE": None}
        if world > 1:
            ranks_env = dict(RANK=r, LOCAL_RANK=r, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1")
            ranks_env["MASTER_PORT"] = port
        children.append(
            start_child(HERE / "_dist_worker.py", json.dumps(spec), threads=1, env=ranks_env)
        )
    ranks, status = [], "ok"
    for running in children:
        child = running.wait(timeout)
        if child.timed_out:
            for other in children:
                other.proc.kill()
            status = "timeout"
            break
        if child.result is None:
            status = "crashed: " + " | ".join(child.stderr.strip().splitlines()[-3:])[:400]
            continue
        ranks.append(child.result)
    result = {
        **spec,
        "world_size": world,
        "status": status,
        "wall_s": round(time.perf_counter() - started, 1),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
    }
    if status == "ok" and ranks:
        steps = len(ranks[0]["step_times_s"])
        per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(steps)]
        counts = ranks[0]["per_step"]
        result.update(
            step_times_s=per_step,
            step_time_s=round(sorted(per_step)[len(per_step) // 2], 3),
            per_rank_step_times_s=[r["step_times_s"] for r in ranks],
            per_step_counts=counts,
            losses=[c["loss"] for c in counts],
            n_params=ranks[0]["n_params"],
        )
        last = counts[-1]
        if spec["impl"] == "densefit":
            result.update(
                grad_allreduce_calls=last.get("grad_allreduces", 0),
                grad_syncs=last.get("grad_allreduces", 0),
                embedding_collectives=last.get("embedding_allgathers", 0)
                + last.get("embedding_grad_allreduces", 0),
                chunks_per_rank=last.get("chunks"),
            )
        else:
            result.update(
                grad_allreduce_calls=last.get("ddp_bucket_allreduce", 0),
                grad_syncs=last.get("ddp_sync", 0),
                # forward all-gathers; backward: reduce-scatter on NCCL, world scatters on gloo
                embedding_collectives=sum(
                    last.get(k, 0)
                    for k in (
                        "all_gather",
                        "all_to_all",
                        "all_to_all_single",
                        "scatter",
                        "reduce_scatter",
                    )
                ),
            )
    return result


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    ok = [r for r in results if r.get("step_time_s")]
    labels = [f"{r['impl']}\n{r['world_size']} proc" for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(labels, [r["step_time_s"] for r in ok], color="tab:blue")
    axes[0].set_ylabel("step time (s), slowest rank")
    axes[0].set_title(
        f"global batch {ok[0]['batch_size']}, chunks of {ok[0]['chunk_size']}" if ok else ""
    )
    x = list(range(len(ok)))
    axes[1].bar(
        [i - 0.2 for i in x],
        [r.get("grad_allreduce_calls", 0) for r in ok],
        0.4,
        color="tab:orange",
        label="gradient all-reduce calls",
    )
    axes[1].bar(
        [i + 0.2 for i in x],
        [r.get("embedding_collectives", 0) for r in ok],
        0.4,
        color="tab:green",
        label="embedding collectives",
    )
    axes[1].set_xticks(x, labels)
    axes[1].set_ylabel("per step")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


FIELDS = [
    "impl",
    "world_size",
    "batch_size",
    "chunk_size",
    "max_seq_length",
    "device",
    "status",
    "step_time_s",
    "grad_allreduce_calls",
    "grad_syncs",
    "embedding_collectives",
    "loadavg_before",
    "loadavg_after",
]


def save(results: list[dict], note: dict, name: str) -> None:
    """Write json and csv (after every point: a timeout keeps what finished)."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"machine": note, "points": results}, indent=2)
    )
    with (RESULTS / f"{name}.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow(
                {
                    **r,
                    "loadavg_before": r["loadavg_before"][0],
                    "loadavg_after": r["loadavg_after"][0],
                }
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--impl", nargs="+", default=["densefit", "st"])
    parser.add_argument(
        "--device", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU per rank)"
    )
    parser.add_argument("--name", default="distributed")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--report-only", action="store_true", help="re-plot the saved json")
    args = parser.parse_args()
    if args.report_only:
        saved = json.loads((RESULTS / f"{args.name}.json").read_text())
        plot(saved["points"], RESULTS / f"{args.name}.png")
        return

    note = {
        **machine_note(1),
        "loadavg_start": loadavg(),
        "threads_per_process": 1,
    }
    results = []
    for world in args.nproc:
        for impl in args.impl:
            spec = {
                "impl": impl,
                "batch_size": args.batch_size,
                "chunk_size": args.chunk_size,
                "steps": args.steps,
                "max_seq_length": args.max_seq_length,
                "device": args.device,
            }
            r = run_point(spec, world, args.timeout)
            results.append(r)
            print(
                f"{impl:<9} {world} proc  {r['status']:<8} step {r.get('step_time_s')}s "
                f"grad all-reduce calls {r.get('grad_allreduce_calls')} "
                f"syncs {r.get('grad_syncs')} embedding collectives "
                f"{r.get('embedding_collectives')} load {r['loadavg_before'][0]}",
                flush=True,
            )
            save(results, note, args.name)
    note["loadavg_end"] = loadavg()
    save(results, note, args.name)
    plot(results, RESULTS / f"{args.name}.png")
    print()
    print(
        "| impl | processes | step time (s) | grad all-reduce calls / step | grad syncs / step "
        "| embedding collectives / step | load before |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['impl']} | {r['world_size']} | {r.get('step_time_s')} | "
            f"{r.get('grad_allreduce_calls')} | {r.get('grad_syncs')} | "
            f"{r.get('embedding_collectives')} | {r['loadavg_before'][0]} |"
        )


if __name__ == "__main__":
    main()
