"""Memory and speed of densefit's strategies against sentence-transformers, in one run.

    OMP_NUM_THREADS=1 python bench/memory_speed.py            # everything (about an hour)
    python bench/memory_speed.py --section speed --batches 32  # a part
    python bench/memory_speed.py --section speed --methods cache st-cmnrl --redo  # rerun those
    python bench/memory_speed.py --section speed --datasets pydoc --batches 64 --redo

Every point is a fresh process (bench/_step_worker.py) on packaged all-MiniLM-L6-v2:
a warm-up step on 4 rows, then timed full steps (speed: 3, the median is reported; the
same configuration varies by about 10% between processes on this shared CPU). Peers: sentence-transformers
MultipleNegativesRankingLoss, the same with gradient checkpointing, and
CachedMultipleNegativesRankingLoss with mini_batch_size equal to densefit's cache chunk.

Sections:
- speed: SciFact training pairs at sequence length 128, pydoc pairs at 256; batches 32,
  64, 128; densefit plain / checkpoint / cache / cache-nokeep / auto vs the three peers.
- scaling: NFCorpus training pairs truncated to 32 tokens; batches 64 .. 8192 for the
  cached rows, plain rows until out of memory or a step over 300 s. cache-glibc is the cache
  under the system's malloc; cache-release and cache-trim add release_cpu_memory=True (fixed
  mmap threshold + a heap trim per chunk) and trims only (glibc's own threshold);
  st-cmnrl-mi is CachedMNRL under mimalloc.

Allocator: densefit's points run under mimalloc, as its CLI runs training on Linux
(densefit.memory.allocator); the peers under the system's malloc, as their users run them
(st-cmnrl-mi shows what mimalloc alone does for CachedMNRL). Each row records its allocator.

Writes bench/results/memory_speed.{jsonl,csv,md,json} and memory_speed_{memory,time}.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics

from _runner import RESULTS, machine_note, run_all

CHUNK = 32  # densefit cache chunk == CachedMNRL mini_batch_size
# Statuses of points whose timed step finished ("too_slow": it took over max_step_seconds).
DONE = ("ok", "too_slow")
SPEED_BUDGET = "4GiB"  # for densefit auto in the speed table
SCALING_BUDGET = "6GiB"
# cache-nokeep: the classic gradient cache (every chunk re-embedded, keep_graphs=0), to show
# what keeping the last chunk's graph (densefit's default, no extra memory) saves.
DENSEFIT = ["plain", "checkpoint", "cache", "cache-nokeep", "auto"]
PEERS = ["st-mnrl", "st-mnrl-gc", "st-cmnrl"]


def specs_for(
    section: str, batches: list[int] | None, threads: int, device: str = "cpu"
) -> list[dict]:
    specs = []
    gpu = device.startswith("cuda")
    if section in ("speed", "all"):
        for dataset, seq in (("scifact", 128), ("pydoc", 256)):
            for B in batches or [32, 64, 128]:
                for impl, methods in (("densefit", DENSEFIT), ("st", PEERS)):
                    for method in methods:
                        spec = {
                            "section": "speed",
                            "impl": impl,
                            "method": method,
                            "dataset": dataset,
                            "max_seq_length": seq,
                            "batch_size": B,
                            "steps": 3,
                            "threads": threads,
                            "rlimit_gib": 16,
                        }
                        if method in ("cache", "cache-nokeep", "st-cmnrl"):
                            spec["chunk_size"] = CHUNK
                        if method == "cache-nokeep":
                            spec["keep_graphs"] = 0
                        if method == "auto":
                            spec["memory_budget"] = SPEED_BUDGET
                        if gpu:
                            spec.update(device=device, steps=3, rlimit_gib=None)
                        spec["key"] = f"speed/{dataset}/{B}/{impl}/{method}"
                        specs.append(spec)
    if section in ("scaling", "all"):
        for B in batches or [64, 256, 1024, 2048, 4096, 8192]:
            for impl, method in (
                ("densefit", "cache"),  # under mimalloc, as densefit's CLI runs
                ("densefit", "cache-glibc"),  # under the system's malloc (glibc)
                ("densefit", "cache-release"),  # glibc + release_cpu_memory=True
                ("densefit", "cache-trim"),  # glibc's default threshold + a trim per chunk
                ("st", "st-cmnrl"),
                ("st", "st-cmnrl-mi"),  # CachedMNRL under mimalloc too: the allocator's share
                ("densefit", "auto"),
                ("densefit", "plain"),
                ("st", "st-mnrl"),
            ):
                spec = {
                    "section": "scaling",
                    "impl": impl,
                    "method": method,
                    "dataset": "nfcorpus",
                    "max_seq_length": 32,
                    "batch_size": B,
                    # 3 timed steps (median) where a step takes about a minute or less: the
                    # first step of a process pays for touching its memory the first time
                    "steps": 3 if B <= 1024 else 1,
                    "threads": threads,
                    "rlimit_gib": 16,
                }
                if method in ("plain", "st-mnrl"):  # plain rows stop past 300 s a step
                    spec["max_step_seconds"] = 300
                if method in (
                    "cache",
                    "cache-glibc",
                    "cache-release",
                    "cache-trim",
                    "st-cmnrl",
                    "st-cmnrl-mi",
                ):
                    spec["chunk_size"] = CHUNK
                if method in ("cache-glibc", "cache-release", "cache-trim"):
                    spec["allocator"] = "system"
                if method == "st-cmnrl-mi":
                    spec["allocator"] = "mimalloc"
                if method == "cache-release":
                    spec["release_cpu_memory"] = True
                if method == "cache-trim":
                    spec["release_cpu_memory"] = "trim"
                if method == "auto":
                    spec["memory_budget"] = SCALING_BUDGET
                if gpu:
                    spec.update(device=device, steps=2, rlimit_gib=None)
                spec["key"] = f"scaling/nfcorpus/{B}/{impl}/{method}"
                specs.append(spec)
    return specs


def skip_after_failure(specs: list[dict], results_so_far: dict) -> None:
    """Plain rows stop at the first batch size that ran out of memory or was too slow."""
    for spec in specs:
        if spec["section"] != "scaling" or spec["method"] not in ("plain", "st-mnrl"):
            continue
        for other in results_so_far.values():
            if (
                other.get("section") == "scaling"
                and other.get("method") == spec["method"]
                and other.get("status") in ("oom", "oom-killed", "too_slow", "timeout")
                and other["batch_size"] < spec["batch_size"]
            ):
                spec["skip_reason"] = f"skipped (after {other['status']} at {other['batch_size']})"


def mean_time(r: dict) -> float:
    times = r.get("step_times_s") or [r["step_time_s"]]
    return sum(times) / len(times)


def time_ratio(ours: dict, other: dict) -> float:
    """Median over the timed batches of ours / other on the same batch (paired).

    Every point runs the same batches in the same order, and batches differ in their token
    lengths (pydoc's are heavy-tailed): pairing compares equal work, and the median drops
    one-off hiccups of a shared machine. One timed step each: the plain ratio.
    """
    a, b = ours.get("step_times_s") or [], other.get("step_times_s") or []
    if len(a) == len(b) and len(a) > 1:
        return statistics.median(x / y for x, y in zip(a, b))
    return ours["step_time_s"] / other["step_time_s"]


def ratio_rows(results: list[dict]) -> list[dict]:
    """densefit / peer ratios at equal dataset, batch size (and chunk for the cache)."""
    by = {
        (r["section"], r["dataset"], r["batch_size"], r["method"]): r
        for r in results
        if r.get("status") in DONE
    }
    pairs = [
        ("plain", "st-mnrl"),
        ("checkpoint", "st-mnrl-gc"),
        ("cache", "st-cmnrl"),
        ("cache", "st-cmnrl-mi"),
        ("cache", "cache-glibc"),
        ("cache", "plain"),
        ("cache", "cache-nokeep"),
        ("auto", "fastest-fitting"),
    ]
    out = []
    for (section, dataset, B, method), r in sorted(by.items(), key=lambda kv: str(kv[0])):
        for ours, peer in pairs:
            if method != ours:
                continue
            if peer == "fastest-fitting":
                budget = SPEED_BUDGET if section == "speed" else SCALING_BUDGET
                from densefit.config.train import parse_bytes

                limit = parse_bytes(budget) / 2**20
                fitting = [
                    by[k]
                    for k in by
                    if k[:3] == (section, dataset, B)
                    and k[3] in ("plain", "checkpoint", "cache", "cache-nokeep")
                    and by[k]["peak_rss_mb"] - by[k]["baseline_rss_mb"] + 346 <= limit
                ]  # + params, grads, AdamW
                if not fitting:
                    continue
                other = min(fitting, key=mean_time)
                label = f"fastest that fits {budget}: {other['method']}"
            else:
                other = by.get((section, dataset, B, peer))
                if other is None:
                    continue
                label = peer
            out.append(
                {
                    "section": section,
                    "dataset": dataset,
                    "batch_size": B,
                    "densefit": ours,
                    "vs": label,
                    "time_ratio": round(time_ratio(r, other), 3),
                    "activation_ratio": round(
                        max(r["activation_mb"], 1) / max(other["activation_mb"], 1), 3
                    ),
                    "peak_ratio": round(r["peak_rss_mb"] / other["peak_rss_mb"], 3),
                }
            )
    return out


def scaling_table(results: list[dict]) -> list[str]:
    """Activation memory against batch size, relative to the smallest batch, per method."""
    rows = [r for r in results if r["section"] == "scaling"]
    if not rows:
        return []
    sizes = sorted({r["batch_size"] for r in rows})
    out = [
        "",
        "## Memory scaling (activation MiB; x = relative to the smallest batch)",
        "",
        "| method | " + " | ".join(str(b) for b in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for method in dict.fromkeys(r["method"] for r in rows):
        by = {r["batch_size"]: r for r in rows if r["method"] == method}
        base = by.get(sizes[0], {}).get("activation_mb")
        cells = []
        for b in sizes:
            r = by.get(b)
            if r is None:
                cells.append("not run")
            elif r.get("status") not in DONE:
                cells.append(str(r.get("status")))
            else:
                rel = f" ({r['activation_mb'] / base:.2f}x)" if base else ""
                cells.append(f"{r['activation_mb']:.0f}{rel}, {r['step_time_s']:.0f} s")
        out.append(f"| {method} | " + " | ".join(cells) + " |")
    return out


def write_outputs(results: list[dict], note: dict, name: str = "memory_speed") -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    cols = [
        "section",
        "dataset",
        "max_seq_length",
        "batch_size",
        "impl",
        "method",
        "chunk_size",
        "status",
        "step_time_s",
        "activation_mb",
        "peak_rss_mb",
        "baseline_rss_mb",
        "padding_efficiency",
        "threads",
        "loadavg_before",
        "loadavg_after",
    ]
    with (RESULTS / f"{name}.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols + ["plan"], extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow({**r, "plan": json.dumps(r.get("plan")) if r.get("plan") else ""})
    ratios = ratio_rows(results)
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"machine": note, "results": results, "ratios": ratios}, indent=1)
    )
    lines = [
        f"# {name}",
        "",
        f"Machine: {json.dumps(note)}",
        "",
        "| section | data | seq | batch | impl | method | status | step s | act MiB | peak MiB | pad eff | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        plan = r.get("plan") or {}
        plan_text = (
            f"{plan.get('strategy')} c={plan.get('chunk_size')} t={plan.get('token_budget')}"
            + (
                f" keep={plan.get('keep_graphs')}"
                if str(plan.get("strategy")).startswith("cache")
                else ""
            )
            if r.get("method") == "auto"
            else ""
        )
        lines.append(
            f"| {r['section']} | {r['dataset']} | {r['max_seq_length']} | {r['batch_size']} | "
            f"{r['impl']} | {r['method']} | {r.get('status')} | {r.get('step_time_s', '')} | "
            f"{r.get('activation_mb', '')} | {r.get('peak_rss_mb', '')} | "
            f"{r.get('padding_efficiency', '')} | {plan_text} |"
        )
    lines += [
        "",
        "## Ratios (densefit / other, same data and batch size)",
        "",
        "Time: the median over the timed batches of the paired ratio (same batch, both "
        "methods); step s above is each point's median step.",
        "",
        "| section | data | batch | densefit | vs | time | activation | peak RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for q in ratios:
        lines.append(
            f"| {q['section']} | {q['dataset']} | {q['batch_size']} | {q['densefit']} | "
            f"{q['vs']} | {q['time_ratio']} | {q['activation_ratio']} | {q['peak_ratio']} |"
        )
    lines += scaling_table(results)
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, name)


def plot(results: list[dict], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.get("status") in DONE]
    groups = sorted({(r["section"], r["dataset"]) for r in ok})
    if not groups:
        return
    for metric, label, suffix in (
        ("activation_mb", "activation memory (MiB)", "memory"),
        ("step_time_s", "step time (s)", "time"),
    ):
        fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
        for ax, (section, dataset) in zip(axes[0], groups):
            rows = [r for r in ok if (r["section"], r["dataset"]) == (section, dataset)]
            for method in sorted({r["method"] for r in rows}):
                pts = sorted((r["batch_size"], r[metric]) for r in rows if r["method"] == method)
                style = "-o" if not method.startswith("st-") else "--s"
                ax.plot([p[0] for p in pts], [max(p[1], 1e-3) for p in pts], style, label=method)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_ylabel(label)
            ax.set_title(f"{section}: {dataset} (seq {rows[0]['max_seq_length']})")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}_{suffix}.png", dpi=110)
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--section", choices=["speed", "scaling", "all"], default="all")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", nargs="*", help="only these methods (e.g. cache st-cmnrl)")
    parser.add_argument(
        "--datasets", nargs="*", help="only these datasets (scifact pydoc nfcorpus)"
    )
    parser.add_argument("--fresh", action="store_true", help="ignore results already in the jsonl")
    parser.add_argument(
        "--redo",
        action="store_true",
        help="rerun the selected points, replacing their rows in the jsonl (others are kept)",
    )
    parser.add_argument("--name", default="memory_speed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bench/gpu.sh)")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the tables and plots from the jsonl, run nothing",
    )
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.jsonl"
    if args.report_only:
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        note = (
            json.loads((RESULTS / f"{args.name}.json").read_text())["machine"]
            if (RESULTS / f"{args.name}.json").exists()
            else machine_note(args.threads)
        )
        write_outputs(rows, note, args.name)
        return
    if args.fresh and out.exists():
        out.unlink()
    note = machine_note(args.threads)
    specs = specs_for(args.section, args.batches, args.threads, args.device)
    if args.methods:
        specs = [s for s in specs if s["method"] in args.methods]
    if args.datasets:
        specs = [s for s in specs if s["dataset"] in args.datasets]
    if args.redo and out.exists():
        keys = {s["key"] for s in specs}
        kept = [x for x in out.read_text().splitlines() if json.loads(x)["key"] not in keys]
        out.write_text("".join(k + "\n" for k in kept))
    results: dict = {}
    for spec in specs:  # one at a time, so failures of plain rows can skip larger batches
        skip_after_failure([spec], results)
        (r,) = run_all([spec], out)
        results[spec["key"]] = r
    all_results = [json.loads(x) for x in out.read_text().splitlines()]
    write_outputs(all_results, note, args.name)


if __name__ == "__main__":
    main()
