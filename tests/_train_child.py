"""A training run in its own process, for the kill-and-resume tests in tests/test_resume.py.

    python tests/_train_child.py SPEC.json

SPEC: ``base`` (a saved sentence-transformers folder), ``data`` (JSONL, or several sources:
a mapping of names to JSONL files), ``output``,
``config`` (TrainConfig fields), ``threads`` (torch threads, as in the parent, so the
arithmetic is the same), ``step_sleep`` (seconds to sleep after each step, so the parent
can kill at a step of its choosing) and ``kill_in_checkpoint`` (SIGKILL this process
half-way through writing that checkpoint: after its model.pt, before the rest).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from sentence_transformers import SentenceTransformer

import densefit.training.checkpoint
from densefit import TrainConfig, train
from densefit.data.readers import read_training_data


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path, encoding="utf-8").read())
    torch.set_num_threads(spec["threads"])
    kill_at = spec.get("kill_in_checkpoint")
    if kill_at is not None:
        original = densefit.training.checkpoint.write_part

        def write_part(path, write):
            original(path, write)
            if path.parent.name.startswith(f".tmp-step-{kill_at:06d}") and path.name == "model.pt":
                os.kill(os.getpid(), signal.SIGKILL)

        densefit.training.checkpoint.write_part = write_part

    def on_step(record: dict) -> None:
        time.sleep(spec.get("step_sleep", 0))

    data = spec["data"]
    examples = read_training_data(data)[0] if isinstance(data, str) else data
    model = SentenceTransformer(spec["base"], device="cpu")
    train(
        model, examples, TrainConfig(**spec["config"]), output_dir=spec["output"], on_step=on_step
    )


if __name__ == "__main__":
    main(sys.argv[1])
