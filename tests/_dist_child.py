"""One rank of a multi-process test, for tests/test_distributed.py (gloo on 127.0.0.1).

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/_dist_child.py SPEC.json

Every collective is counted by wrapping ``torch.distributed.all_reduce`` / ``all_gather`` /
``broadcast`` (the test's own count, independent of densefit's). SPEC:

- ``cases``: one optimizer step each (:func:`densefit.training.step.train_step`, the training
  loop's own code, after :func:`densefit.training.setup.setup_run`, with no clipping so the
  gradients are left as summed) on ``rows`` with the ``config`` of the case; rank 0 writes
  ``OUT/case-i.pt`` with the loss, every parameter gradient and the collectives of the step;
- ``train``: a whole :func:`densefit.train` run (evaluating during training on the BEIR
  folder ``eval_data`` when given) on ``rows``, or on several ``sources`` (name -> rows;
  each row's origin ``name:i``); ``resume`` continues from the output folder's newest
  checkpoint; ``crash_after`` N ends every rank right after step N (and its checkpoint, if
  one is due), as a kill would. Every rank writes ``OUT/train-RANK.json`` with the
  losses, the collectives, the run's memory plan, what each cached forward-backward really
  ran with (kept graphs, token budget, chunk), the origins of the rows it embedded in each
  micro-batch and the result's evaluation summary.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from sentence_transformers import SentenceTransformer

import densefit.training.loop
from densefit import TrainConfig, TrainingExample
from densefit.memory.strategies import CachedStrategy
from densefit.training.distributed import DistributedRun, init_distributed, teardown_distributed
from densefit.training.loop import train
from densefit.training.setup import setup_run
from densefit.training.step import train_step

CALLS: list[tuple[str, int]] = []


def count(name, original):
    def wrapped(*args, **kwargs):
        first = args[0]
        numel = sum(t.numel() for t in first) if isinstance(first, list) else first.numel()
        CALLS.append((name, int(numel)))
        return original(*args, **kwargs)

    return wrapped


for _name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_gather_into_tensor"):
    setattr(dist, _name, count(_name, getattr(dist, _name)))


def rows_of(spec_rows: list[dict], name: str = "") -> list[TrainingExample]:
    return [
        TrainingExample(
            r["query"],
            r["positive"],
            tuple(r.get("negatives", ())),
            score=r.get("score"),
            positive_id=r.get("positive_id", ""),
            positive_ids=tuple(r.get("positive_ids", ())),
            origin=f"{name}:{i}" if name else "",
        )
        for i, r in enumerate(spec_rows)
    ]


LOCAL: list[list[str]] = []  # the origins of this rank's rows, per micro-batch
_local_loss_fn = DistributedRun.local_loss_fn


def recording_local(self, config, rows, health):
    local, loss_fn = _local_loss_fn(self, config, rows, health)
    LOCAL.append([r.origin for r in local])
    return local, loss_fn


DistributedRun.local_loss_fn = recording_local


USED: list[dict] = []  # what each cached forward-backward really ran with
_cached = CachedStrategy.forward_backward


def recording(self, *args, **kwargs):
    USED.append(
        {
            "keep_graphs": self.keep_graphs,
            "token_budget": self.token_budget,
            "chunk_size": self.chunk_size,
        }
    )
    return _cached(self, *args, **kwargs)


CachedStrategy.forward_backward = recording


def one_step(base: str, rows, case: dict, out: Path, index: int) -> None:
    config = TrainConfig(
        **{
            "max_grad_norm": None,
            "show_progress": False,
            **case["config"],
            "memory": case["strategy"],
            "chunk_size": case.get("chunk"),
        }
    )
    model = SentenceTransformer(base, device="cpu")
    model.train()
    run = setup_run(model, rows, config)
    torch.manual_seed(case.get("seed", 0) + dist.get_rank())
    CALLS.clear()
    record = train_step(run, [list(range(len(rows)))])
    if dist.get_rank() == 0:
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        torch.save(
            {
                "loss": record["loss"],
                "grads": grads,
                "calls": list(CALLS),
                "record": {k: v for k, v in record.items() if k != "outcome"},
            },
            out / f"case-{index}.pt",
        )


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    init_distributed("cpu")
    out = Path(spec["out"])
    for i, case in enumerate(spec.get("cases", [])):
        one_step(case.get("base", spec["base"]), rows_of(case["rows"]), case, out, i)
    if "train" in spec:
        job = spec["train"]
        model = SentenceTransformer(spec["base"], device="cpu")
        CALLS.clear()
        USED.clear()
        if "crash_after" in job:  # every rank ends after that step, as if killed
            checkpoint = densefit.training.loop._checkpoint

            def checkpoint_then_crash(run, **kwargs):
                checkpoint(run, **kwargs)
                if run.position.step == job["crash_after"]:
                    os._exit(0)

            densefit.training.loop._checkpoint = checkpoint_then_crash
        if "sources" in job:
            data = {name: rows_of(rows, name) for name, rows in job["sources"].items()}
        else:
            data = rows_of(job["rows"])
        result = train(
            model,
            data,
            TrainConfig(**job["config"]),
            output_dir=job["output"],
            eval_data=job.get("eval_data"),
            resume=job.get("resume", False),
        )
        rank = dist.get_rank()
        (out / f"train-{rank}.json").write_text(
            json.dumps(
                {
                    "losses": result.losses,
                    "steps": result.steps,
                    "calls": CALLS,
                    "plan": result.memory_plan.to_dict(),
                    "used": USED,
                    "local_origins": LOCAL,
                    "evaluation": result.evaluation,
                }
            )
        )
    teardown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
