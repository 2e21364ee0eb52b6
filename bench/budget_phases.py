"""Where a training process's memory goes, phase by phase (the numbers in budget.md).

    LD_PRELOAD=$(python -m densefit.memory.allocator) MIMALLOC_PURGE_DELAY=-1 \
    OMP_NUM_THREADS=1 python bench/budget_phases.py DATA BUDGET BATCH MAX_SEQ_LENGTH STEPS

Runs what ``densefit train --memory auto`` runs (same loading, planning and loop: the run's
setup ``densefit.training.setup.setup_run``, its plan ``plan_for_run``, each step
``densefit.training.step.train_step``) and, at each phase boundary, prints the process's peak resident set since the previous boundary
(VmHWM, reset through /proc/self/clear_refs) and its resident set after it, anonymous and
file-backed. Linux only. Without LD_PRELOAD it runs under glibc's malloc.
"""

from __future__ import annotations

import json
import sys


def status() -> dict:
    """VmHWM, VmRSS, RssAnon, RssFile of this process in MiB."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


ROWS: list[tuple] = []


def mark(name: str) -> None:
    """Record the phase that just ended and reset the peak for the next."""
    s = status()
    ROWS.append((name, s["VmHWM"], s["VmRSS"], s["RssAnon"], s["RssFile"]))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    mark("interpreter")
    data, budget, batch, seq, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    import densefit.memory.planner as planner
    import densefit.training.loop as loop
    import densefit.training.setup as setup
    import densefit.training.step as step_module
    from densefit.config.train import TrainConfig
    from densefit.data.sources import load_training_examples
    from densefit.memory.allocator import allocator_in_use
    from densefit.models import load_model

    mark("imports (torch, transformers, densefit)")
    model = load_model("all-MiniLM-L6-v2", max_seq_length=seq)
    mark("model loaded (weights mapped)")
    examples = load_training_examples(data)
    mark("data read")
    # The run's plan (setup_run calls plan_for_run), the planner's probe, and the part of
    # each step after the forward-backward (train_step calls guarded_step: clip + AdamW).
    plan_for_run, probe = setup.plan_for_run, planner.probe_activations
    step = step_module.guarded_step
    plan = {}

    def plan_and_mark(*args, **kwargs):
        mark("training set up")
        out = plan_for_run(*args, **kwargs)
        plan.update(out.to_dict())
        mark("plan: the rest (after the probe)")
        return out

    def probe_and_mark(*args, **kwargs):
        mark("plan: tokenise every text")
        out = probe(*args, **kwargs)
        mark("plan: probe (peak, then freed)")
        return out

    count = [0]

    def step_and_mark(*args, **kwargs):
        count[0] += 1
        mark(f"step {count[0]}: forward + backward")
        out = step(*args, **kwargs)
        mark(f"step {count[0]}: clip + AdamW")
        return out

    setup.plan_for_run, planner.probe_activations = plan_and_mark, probe_and_mark
    step_module.guarded_step = step_and_mark
    config = TrainConfig(
        batch_size=batch,
        max_steps=steps,
        max_seq_length=seq,
        memory="auto",
        memory_budget=budget,
        show_progress=False,
    )
    loop.train(model, examples, config)
    mark("end")
    process = plan["process"]
    print(
        f"allocator {allocator_in_use()}; plan {plan['strategy']} chunk {plan['chunk_size']}; "
        f"predicted {plan['predicted_peak_bytes'] / 2**20:,.0f} MiB; process "
        + json.dumps({k: round(v / 2**20, 1) for k, v in process.items() if k != "device"})
    )
    print(f"{'phase':<40}{'peak':>8}{'after':>8}{'anon':>8}{'file':>8}  (MiB)")
    for name, *values in ROWS:
        print(f"{name:<40}" + "".join(f"{v:>8.0f}" for v in values))
    print(f"peak of the process: {max(r[1] for r in ROWS):,.0f} MiB")


if __name__ == "__main__":
    main()
