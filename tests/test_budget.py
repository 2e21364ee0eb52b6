"""A memory budget is a promise about the whole process: its measured peak stays under it.

The planner's predicted peak must bound what the kernel sees: the resident set of the whole
training process (interpreter, libraries, model, data, gradients, AdamW and activations),
not only what a training step adds (bench/results/budget.md has the real model's runs).
"""

import json
import os
import subprocess
import sys

import pytest

from densefit.memory import allocator

CHILD = r"""
import json, sys
from densefit import TrainConfig, TrainingExample, train
from densefit.memory.process import peak_rss_bytes, resident_bytes
from densefit.testing import tiny_model

model = tiny_model(sys.argv[1])  # loaded back from safetensors: weights mapped, as a user's
batch, longest = int(sys.argv[3]), int(sys.argv[4])
rows = [TrainingExample(f"query {i} " * (i % 5 + 1), f"the cell protein {i} " * (i % longest + 1))
        for i in range(2 * batch)]
budget = resident_bytes() + int(sys.argv[2]) * 2**20  # what the process holds + a margin
config = TrainConfig(batch_size=batch, max_steps=2, memory="auto", memory_budget=budget,
                     show_progress=False)
result = train(model, rows, config)
print("RESULT", json.dumps({
    "budget": budget, "plan": result.plan,
    "peak": peak_rss_bytes(),  # VmHWM: ru_maxrss would carry the vfork parent's peak
}))
"""


def run_child(tmp_path, margin_mib: int, env: dict, batch: int = 128, longest: int = 17) -> dict:
    """Train 2 steps under a budget of what the child holds + ``margin_mib``; ``longest``:
    the positives' length in repeats of 4 words."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(tmp_path / "tiny"),
            str(margin_mib),
            str(batch),
            str(longest),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


ALLOCATORS = ["system"]
if sys.platform.startswith("linux") and allocator.mimalloc_library() is not None:
    ALLOCATORS.append("mimalloc")


def child_env(malloc: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DENSEFIT_ALLOCATOR")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DENSEFIT_ALLOCATOR=malloc)
    if malloc == "mimalloc":  # as the CLI re-runs itself
        env = allocator.preload_env(env)
    return env


@pytest.mark.parametrize("malloc", ALLOCATORS)
def test_whole_process_peak_stays_under_the_predicted_peak_and_the_budget(tmp_path, malloc):
    # 64 MiB over what the child holds: too little for the plain strategy (it needs ~100),
    # enough for a cached one, since the probe and the step setup
    # (densefit.memory.process.STEP_SETUP_BYTES) take ~55 of it.
    out = run_child(tmp_path, 64, child_env(malloc))
    plan, mib = out["plan"], 2**20
    assert plan["cpu_allocator"] == malloc
    assert plan["strategy"] != "plain", plan["strategy"]  # the budget binds
    predicted, base = plan["predicted_peak_bytes"], plan["process"]["total_bytes"]
    # the measured peak of the whole process <= the prediction <= the budget
    assert out["peak"] <= predicted <= out["budget"], (out["peak"] / mib, predicted / mib)
    # and not far above it (measured on this tiny model: 1.04-1.05x the peak)
    assert predicted <= 1.15 * out["peak"], (out["peak"] / mib, predicted / mib)
    # the prediction starts from what the process really holds (hundreds of MiB: torch,
    # transformers, the model), not from the parameters and optimizer alone
    assert plan["process"]["held_bytes"] > 0.5 * out["peak"]
    assert base < predicted


def test_the_predicted_step_is_not_far_above_the_measured_one(tmp_path):
    """With room for the plain strategy, activations are most of what a step adds to the
    process: the predicted increment over what the process held when it planned is at most
    1.6x the measured one (measured on this tiny model: 1.02x under glibc, 1.21x under
    mimalloc). A prediction that doubles the activations (1.8-2.2x) fails here."""
    malloc = ALLOCATORS[-1]  # the CLI's: mimalloc where it is installed
    out = run_child(tmp_path, 3000, child_env(malloc), batch=256, longest=30)
    plan, mib = out["plan"], 2**20
    assert plan["strategy"] == "plain", plan["strategy"]
    held, predicted = plan["process"]["held_bytes"], plan["predicted_peak_bytes"]
    measured = out["peak"] - held
    assert measured < predicted - held <= 1.6 * measured, (measured / mib, (predicted - held) / mib)
