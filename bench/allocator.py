"""glibc heap fragmentation under the gradient cache: densefit's allocator setting on and off.

    OMP_NUM_THREADS=1 python bench/allocator.py

Same points twice (densefit cache, chunks of 32, all-MiniLM-L6-v2): with glibc's default
dynamic mmap threshold, and with the fixed threshold densefit sets on CPU
(densefit/memory/allocator.py). Fresh process per point. Writes
bench/results/allocator.{jsonl,md,json}.
"""

from __future__ import annotations

import json

from _runner import RESULTS, machine_note, run_all


def main() -> None:
    specs = []
    for dataset, seq in (("scifact", 128), ("pydoc", 256)):
        for release in (False, "trim", True):
            name = {False: "default", "trim": "default+trim", True: "fixed+trim"}[release]
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
    print("\n".join(lines))


if __name__ == "__main__":
    main()
