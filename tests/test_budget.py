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
rows = [TrainingExample(f"query {i} " * (i % 5 + 1), f"the cell protein {i} " * (i % 17 + 1))
        for i in range(256)]
budget = resident_bytes() + int(sys.argv[2]) * 2**20  # what the process holds + a little
config = TrainConfig(batch_size=128, max_steps=2, memory="auto", memory_budget=budget,
                     show_progress=False)
result = train(model, rows, config)
print("RESULT", json.dumps({
    "budget": budget, "plan": result.plan,
    "peak": peak_rss_bytes(),  # VmHWM: ru_maxrss would carry the vfork parent's peak
}))
"""


def run_child(tmp_path, margin_mib: int, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "tiny"), str(margin_mib)],
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


@pytest.mark.parametrize("malloc", ALLOCATORS)
def test_whole_process_peak_stays_under_the_predicted_peak_and_the_budget(tmp_path, malloc):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DENSEFIT_ALLOCATOR")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DENSEFIT_ALLOCATOR=malloc)
    if malloc == "mimalloc":  # as the CLI re-runs itself
        env = allocator.preload_env(env)
    out = run_child(tmp_path, 48, env)
    plan, mib = out["plan"], 2**20
    assert plan["cpu_allocator"] == malloc
    predicted, base = plan["predicted_peak_bytes"], plan["process"]["total_bytes"]
    # the measured peak of the whole process <= the prediction <= the budget
    assert out["peak"] <= predicted <= out["budget"], (out["peak"] / mib, predicted / mib)
    # the prediction starts from what the process really holds (hundreds of MiB: torch,
    # transformers, the model), not from the parameters and optimizer alone
    assert plan["process"]["held_bytes"] > 0.5 * out["peak"]
    assert base < predicted
