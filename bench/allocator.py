"""The CPU allocator under the gradient cache: glibc's malloc against mimalloc.

    OMP_NUM_THREADS=1 python bench/allocator.py

The same points four times (densefit cache, chunks of 32, batch 64, all-MiniLM-L6-v2,
3 timed steps, the median reported): glibc's malloc as it comes; glibc with
``release_cpu_memory=True`` (a fixed mmap threshold and a heap trim after each chunk);
mimalloc with its default purging (freed pages go back to the OS after a delay); and
mimalloc with purging off, which is what densefit's CLI runs (densefit/memory/allocator.py).
Fresh process per point. Writes bench/results/allocator.{jsonl,md,json,csv,png}.
(The glibc-only version of this benchmark, batch 128 and one step: allocator.md at commit
b1cdc78.)
"""

from __future__ import annotations

import csv
import json
import statistics

from _runner import RESULTS, machine_note, run_all

VARIANTS = {  # name: spec fields
    "glibc": {"allocator": "system"},
    "glibc+release": {"allocator": "system", "release_cpu_memory": True},
    "mimalloc, purge on": {"allocator": "mimalloc", "env": {"MIMALLOC_PURGE_DELAY": None}},
    "mimalloc, purge off (densefit)": {"allocator": "mimalloc"},
}


def main() -> None:
    specs = []
    for dataset, seq in (("scifact", 128), ("pydoc", 256)):
        for name, fields in VARIANTS.items():
            specs.append(
                {
                    "key": f"alloc/{dataset}/64/{name}",
                    "section": "allocator",
                    "impl": "densefit",
                    "method": "cache",
                    "chunk_size": 32,
                    "dataset": dataset,
                    "max_seq_length": seq,
                    "batch_size": 64,
                    "steps": 3,
                    "threads": 1,
                    "rlimit_gib": 16,
                    **fields,
                }
            )
    out = RESULTS / "allocator.jsonl"
    results = run_all(specs, out)
    note = machine_note(1)
    lines = [
        "# CPU allocator: glibc vs mimalloc (densefit cache, batch 64, chunks of 32)",
        "",
        f"Machine: {json.dumps(note)}",
        "",
        "Step s: median of 3 timed steps (the per-step times are in allocator.json). "
        "Time vs glibc: the median of the paired per-step ratios.",
        "",
        "| data | allocator | served by | step s | steps s | time vs glibc | activation MiB "
        "| peak RSS MiB | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for r in results:
        name = r["key"].rsplit("/", 1)[1]
        glibc = next(
            (g for g in results if g["dataset"] == r["dataset"] and g["key"].endswith("/glibc")),
            None,
        )
        ratio = ""
        if glibc and r.get("step_times_s") and glibc.get("step_times_s"):
            ratio = round(
                statistics.median(a / b for a, b in zip(r["step_times_s"], glibc["step_times_s"])),
                3,
            )
        rows.append(
            [
                r["dataset"],
                name,
                r.get("allocator"),
                r.get("step_time_s"),
                r.get("step_times_s"),
                ratio,
                r.get("activation_mb"),
                r.get("peak_rss_mb"),
                r.get("loadavg_before"),
            ]
        )
        lines.append("| " + " | ".join(str(x) for x in rows[-1]) + " |")
    (RESULTS / "allocator.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "allocator.json").write_text(
        json.dumps({"machine": note, "results": results}, indent=1)
    )
    with open(RESULTS / "allocator.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "data",
                "allocator",
                "served_by",
                "step_s",
                "steps_s",
                "time_vs_glibc",
                "activation_mib",
                "peak_rss_mib",
                "load",
            ]
        )
        writer.writerows(rows)
    plot(results)
    print("\n".join(lines))


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    names = list(dict.fromkeys(r["key"].rsplit("/", 1)[1] for r in results))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        for ax, field in zip(axes, ("step_time_s", "activation_mb")):
            values = [
                next(
                    (
                        r.get(field) or 0
                        for r in results
                        if r["dataset"] == d and r["key"].endswith("/" + name)
                    ),
                    0,
                )
                for d in datasets
            ]
            ax.bar([x + i * width for x in range(len(datasets))], values, width, label=name)
    for ax, title in zip(axes, ("step time (s, median of 3)", "activation memory (MiB)")):
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(datasets))], datasets)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("densefit cache, batch 64, chunks of 32: glibc vs mimalloc")
    fig.tight_layout()
    fig.savefig(RESULTS / "allocator.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
