"""glibc heap fragmentation under the gradient cache: densefit's allocator setting on and off.

    OMP_NUM_THREADS=1 python bench/allocator.py

Same points four times (densefit cache, chunks of 32, all-MiniLM-L6-v2): glibc's default
dynamic mmap threshold, the default plus a heap trim after each chunk, a fixed threshold,
and fixed + trims (what ``release_cpu_memory=True`` does; densefit/memory/allocator.py).
Fresh process per point. Writes bench/results/allocator.{jsonl,md,json,csv,png}.
"""

from __future__ import annotations

import csv
import json

from _runner import RESULTS, machine_note, run_all


def main() -> None:
    specs = []
    for dataset, seq in (("scifact", 128), ("pydoc", 256)):
        for release in (False, "trim", "fixed-notrim", True):
            name = {False: "default", "trim": "default+trim", "fixed-notrim": "fixed",
                    True: "fixed+trim"}[release]
            specs.append({
                "key": f"alloc/{dataset}/128/{name}",
                "section": "allocator", "impl": "densefit", "method": "cache", "chunk_size": 32,
                "dataset": dataset, "max_seq_length": seq, "batch_size": 128, "steps": 1,
                "threads": 1, "rlimit_gib": 16, "release_cpu_memory": release,
            })
    out = RESULTS / "allocator.jsonl"
    results = run_all(specs, out)
    note = machine_note(1)
    lines = ["# glibc mmap threshold: default vs fixed (densefit cache, batch 128, chunk 32)", "",
             f"Machine: {json.dumps(note)}", "",
             "| data | allocator | step s | activation MiB | peak RSS MiB | load |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['dataset']} | {r['key'].rsplit('/', 1)[1]} | {r.get('step_time_s')} | "
                     f"{r.get('activation_mb')} | {r.get('peak_rss_mb')} | {r.get('loadavg_before')} |")
    (RESULTS / "allocator.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "allocator.json").write_text(json.dumps({"machine": note, "results": results}, indent=1))
    with open(RESULTS / "allocator.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["data", "allocator", "step_s", "activation_mib", "peak_rss_mib", "load"])
        for r in results:
            writer.writerow([r["dataset"], r["key"].rsplit("/", 1)[1], r.get("step_time_s"),
                             r.get("activation_mb"), r.get("peak_rss_mb"), r.get("loadavg_before")])
    plot(results)
    print("\n".join(lines))


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    names = list(dict.fromkeys(r["key"].rsplit("/", 1)[1] for r in results))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        for ax, field in zip(axes, ("step_time_s", "activation_mb")):
            values = [next((r.get(field) or 0 for r in results if r["dataset"] == d
                            and r["key"].endswith("/" + name)), 0) for d in datasets]
            ax.bar([x + i * width for x in range(len(datasets))], values, width, label=name)
    for ax, title in zip(axes, ("step time (s)", "activation memory (MiB)")):
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(datasets))], datasets)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("densefit cache, batch 128, chunks of 32: glibc allocator settings")
    fig.tight_layout()
    fig.savefig(RESULTS / "allocator.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
