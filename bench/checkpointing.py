"""Gradient checkpointing: activation memory and step time, with and without, batch 16..256.

    OMP_NUM_THREADS=1 python bench/checkpointing.py [--batches 16 32 64 128 256] [--threads 1]

Packaged all-MiniLM-L6-v2, SciFact training pairs at sequence length 128, densefit's
training step (plain vs checkpoint), each point in a fresh process (bench/_step_worker.py):
peak RSS, activation memory (peak RSS minus RSS once the model, its gradients and AdamW's
state exist), step time. Writes bench/results/checkpointing.{jsonl,csv,md,json,png}.

Expected on this CPU (issue 2): activation memory at batch 128 at least 2x lower with
checkpointing, step time at most 35% higher.
"""

from __future__ import annotations

import argparse
import json

from _runner import RESULTS, machine_note, run_all


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="*", default=[16, 32, 64, 128, 256])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "checkpointing.jsonl"
    if args.fresh and out.exists():
        out.unlink()
    specs = [
        {
            "key": f"ckpt/{B}/{method}",
            "section": "checkpointing",
            "impl": "densefit",
            "method": method,
            "dataset": "scifact",
            "max_seq_length": 128,
            "batch_size": B,
            "steps": 2 if B <= 32 else 1,
            "threads": args.threads,
            "rlimit_gib": 16,
        }
        for B in args.batches
        for method in ("plain", "checkpoint")
    ]
    run_all(specs, out)
    results = [json.loads(x) for x in out.read_text().splitlines()]
    by = {(r["batch_size"], r["method"]): r for r in results if r.get("status") == "ok"}
    rows = []
    for B in sorted({b for b, _ in by}):
        plain, ckpt = by.get((B, "plain")), by.get((B, "checkpoint"))
        if not (plain and ckpt):
            continue
        rows.append(
            {
                "batch_size": B,
                "plain_activation_mb": plain["activation_mb"],
                "ckpt_activation_mb": ckpt["activation_mb"],
                "memory_saving_x": round(
                    plain["activation_mb"] / max(1.0, ckpt["activation_mb"]), 2
                ),
                "plain_peak_mb": plain["peak_rss_mb"],
                "ckpt_peak_mb": ckpt["peak_rss_mb"],
                "plain_step_s": plain["step_time_s"],
                "ckpt_step_s": ckpt["step_time_s"],
                "time_overhead": round(ckpt["step_time_s"] / plain["step_time_s"] - 1, 3),
                "loadavg": max(plain["loadavg_before"], ckpt["loadavg_before"]),
            }
        )
    note = machine_note(args.threads)
    (RESULTS / "checkpointing.json").write_text(
        json.dumps({"machine": note, "rows": rows, "points": results}, indent=1)
    )
    header = list(rows[0]) if rows else []
    with (RESULTS / "checkpointing.csv").open("w") as f:
        f.write(",".join(header) + "\n")
        for r in rows:
            f.write(",".join(str(r[h]) for h in header) + "\n")
    lines = [
        "# Gradient checkpointing (all-MiniLM-L6-v2, SciFact, seq 128)",
        "",
        f"Machine: {json.dumps(note)}",
        "",
        "| batch | act MiB plain | act MiB ckpt | saving | peak MiB plain | peak MiB ckpt | step s plain | step s ckpt | time overhead | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | {r['plain_activation_mb']} | {r['ckpt_activation_mb']} | "
            f"{r['memory_saving_x']}x | {r['plain_peak_mb']} | {r['ckpt_peak_mb']} | "
            f"{r['plain_step_s']} | {r['ckpt_step_s']} | {r['time_overhead']:+.0%} | {r['loadavg']} |"
        )
    (RESULTS / "checkpointing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["batch_size"] for r in rows]
    a1.plot(xs, [r["plain_activation_mb"] for r in rows], "-o", label="plain")
    a1.plot(xs, [r["ckpt_activation_mb"] for r in rows], "-o", label="checkpointing")
    a1.set(xscale="log", xlabel="batch size", ylabel="activation memory (MiB)", title="memory")
    a2.plot(xs, [r["plain_step_s"] for r in rows], "-o", label="plain")
    a2.plot(xs, [r["ckpt_step_s"] for r in rows], "-o", label="checkpointing")
    a2.set(xscale="log", xlabel="batch size", ylabel="step time (s)", title="time")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"all-MiniLM-L6-v2, SciFact, seq 128, {args.threads} thread(s)")
    fig.tight_layout()
    fig.savefig(RESULTS / "checkpointing.png", dpi=110)


if __name__ == "__main__":
    main()
