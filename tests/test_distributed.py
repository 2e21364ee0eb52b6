"""Two gloo processes on 127.0.0.1 against one process on the union batch.

Each multi-process run is a set of child processes (tests/_dist_child.py, or torchrun for
the CLI) with a timeout: a hang fails the test instead of freezing it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sentence_transformers import SentenceTransformer

from densefit import TrainConfig, TrainingExample
from densefit.losses import mnrl
from densefit.memory.strategies import make_strategy
from densefit.testing import tiny_model
from densefit.training.distributed import shard_bounds
from densefit.training.loop import train
from densefit.training.objective import make_loss_fn
from densefit.training.setup import setup_run
from densefit.training.step import train_step

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # seconds for a whole multi-process run (imports take ~8 s per process here)

# 7 rows: rank 0 takes 4, rank 1 takes 3; 0-2 hard negatives per row (so the ranks hold
# different numbers of negatives); row 5's negative is row 1's positive (a false negative
# across devices) and rows 2 and 6 share a known positive id.
ROWS = [
    {"query": "what is the cell", "positive": "the cell is a unit", "negatives": ["python list"]},
    {"query": "gene risk", "positive": "genes increase cancer risk", "negatives": []},
    {
        "query": "blood heart",
        "positive": "the heart pumps blood",
        "positive_id": "d2",
        "negatives": ["brain virus", "vaccine dose"],
    },
    {"query": "python function", "positive": "a function returns a value", "negatives": []},
    {"query": "mice trial", "positive": "a trial in mice", "negatives": ["human study"]},
    {
        "query": "cancer genes",
        "positive": "gene protein cancer",
        "negatives": ["genes increase cancer risk"],
    },
    {
        "query": "heart blood pump",
        "positive": "blood and the heart",
        "positive_ids": ["d2"],
        "negatives": [],
    },
]
MARGIN_ROWS = [
    {
        "query": f"query {w}",
        "positive": f"the {w} document",
        "negatives": [f"a {w} cancer"],
        "score": float(i % 3),
    }
    for i, w in enumerate(["cell", "gene", "heart", "python", "mice"])
]
CASES = [  # (strategy, chunk, config); dropout off: the base model
    ("plain", 2, {"gather": "candidates"}),
    ("cache", 2, {"gather": "candidates", "symmetric": True}),
    ("cache", 1, {"gather": "both"}),
    ("plain", 3, {"gather": "both", "symmetric": True}),
    ("cache", 2, {"gather": "none"}),
    ("cache", 2, {"gather": "candidates", "loss_block_size": 2, "similarity": "dot", "scale": 1.0}),
    (
        "cache",
        2,
        {
            "gather": "candidates",
            "matryoshka_dims": [32, 16, 8],  # issue 15
            "matryoshka_weights": [1, 0.5, 0.25],
            "loss_block_size": 2,
            "query_prompt": "query: ",
            "document_prompt": "passage: ",
        },
    ),
]
MARGIN_CASE = ("cache", 2, {"loss": "margin_mse"})
DROPOUT_CASES = [("plain", 2, {"gather": "candidates"}), ("cache", 2, {"gather": "candidates"})]


def examples(rows: list[dict]) -> list[TrainingExample]:
    return [
        TrainingExample(
            r["query"],
            r["positive"],
            tuple(r.get("negatives", ())),
            score=r.get("score"),
            positive_id=r.get("positive_id", ""),
            positive_ids=tuple(r.get("positive_ids", ())),
        )
        for r in rows
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: dict, tmp: Path, world: int = 2, *, check: bool = True) -> list[str]:
    """Run tests/_dist_child.py as ``world`` gloo ranks; fail (and kill them) on a hang.

    Each rank's output, in rank order; with ``check`` every rank must exit 0."""
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs = []
    for r in range(world):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "_dist_child.py"), str(spec_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the {world} processes did not finish in {TIMEOUT}s (a hang)")
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 or not check, f"rank {r} failed:\n{out[-4000:]}"
    return outputs


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    """The tiny model saved once (dropout off and on): every process loads the same weights."""
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for name, dropout in (("still", 0.0), ("dropout", 0.1)):
        model = tiny_model(root / f"build-{name}", dropout=dropout)
        model.save(str(root / name))
        out[name] = str(root / name)
    return out


def reference_step(
    base: str, rows: list[dict], strategy: str, chunk: int, config: dict, seed: int = 0
):
    """One process on the union batch: the same training-loop step."""
    cfg = TrainConfig(
        **{
            "max_grad_norm": None,
            "show_progress": False,
            **config,
            "memory": strategy,
            "chunk_size": chunk,
        }
    )
    model = SentenceTransformer(base, device="cpu")
    model.train()
    run = setup_run(model, examples(rows), cfg)
    torch.manual_seed(seed)
    record = train_step(run, [list(range(len(rows)))])
    return record["loss"], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def per_rank_reference(base: str, rows: list[dict], chunk: int, config: dict):
    """gather=none: each rank's rows are their own batch; losses weighted by rows."""
    cfg = TrainConfig(
        **{"max_grad_norm": None, "show_progress": False, "similarity": "cosine", **config}
    )
    model = SentenceTransformer(base, device="cpu")
    model.train()
    s = make_strategy("cache", chunk)
    total = 0.0
    for r in range(2):
        a, b = shard_bounds(len(rows), 2, r)
        part = examples(rows)[a:b]
        loss_fn = make_loss_fn(cfg, part)
        stats = s.forward_backward(
            model,
            [
                [x.query for x in part],
                [x.positive for x in part],
                [n for x in part for n in x.negatives],
            ],
            lambda emb, f=loss_fn, w=(b - a) / len(rows): f(emb) * w,
        )
        total += stats.loss
    return total, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def two_ranks(bases, tmp_path_factory) -> Path:
    """One 2-process launch: every case of the module, then a short training run."""
    tmp = tmp_path_factory.mktemp("dist")
    cases = [{"strategy": s, "chunk": c, "config": cfg, "rows": ROWS} for s, c, cfg in CASES]
    s, c, cfg = MARGIN_CASE
    cases.append({"strategy": s, "chunk": c, "config": cfg, "rows": MARGIN_ROWS})
    for s, c, cfg in DROPOUT_CASES:
        cases.append(
            {
                "strategy": s,
                "chunk": c,
                "config": cfg,
                "rows": ROWS,
                "seed": 7,
                "base": bases["dropout"],
            }
        )
    spec = {
        "base": bases["still"],
        "out": str(tmp),
        "cases": cases,
        "train": {"rows": ROWS * 2, "output": str(tmp / "run"), "config": TRAIN_CONFIG},
    }
    launch(spec, tmp)
    return tmp


TRAIN_CONFIG = {
    "batch_size": 6,
    "memory": "cache",
    "chunk_size": 2,
    "token_budget": 24,
    "keep_graphs": 2,
    "learning_rate": 1e-3,
    "show_progress": False,
    "keep_checkpoints": 0,
    "seed": 3,
}


def n_params(base: str) -> int:
    return sum(p.numel() for p in SentenceTransformer(base, device="cpu").parameters())


@pytest.mark.parametrize("index", range(len(CASES)))
def test_two_processes_equal_one_process_on_the_union_batch(two_ranks, bases, index):
    strategy, chunk, config = CASES[index]
    got = torch.load(two_ranks / f"case-{index}.pt", weights_only=False)
    if config["gather"] == "none":
        loss, grads = per_rank_reference(bases["still"], ROWS, chunk, config)
    else:
        loss, grads = reference_step(bases["still"], ROWS, strategy, chunk, config)
    assert abs(got["loss"] - loss) < 1e-5, (got["loss"], loss)
    assert got["grads"].keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(got["grads"][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_gathered_negatives_change_the_loss(two_ranks, bases):
    """Sanity: with gathering the loss is the union batch's, not the mean of two halves."""
    gathered = torch.load(two_ranks / "case-0.pt", weights_only=False)["loss"]
    halves, _ = per_rank_reference(bases["still"], ROWS, 2, {"gather": "none"})
    assert abs(gathered - halves) > 1e-3


def test_margin_mse_across_processes(two_ranks, bases):
    strategy, chunk, config = MARGIN_CASE
    got = torch.load(two_ranks / f"case-{len(CASES)}.pt", weights_only=False)
    loss, grads = reference_step(bases["still"], MARGIN_ROWS, strategy, chunk, config)
    assert abs(got["loss"] - loss) < 1e-5
    for name, g in grads.items():
        torch.testing.assert_close(got["grads"][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_cache_equals_plain_across_processes_with_dropout_on(two_ranks):
    """Each rank replays its own chunks' dropout: the cache stays exact when distributed."""
    first = len(CASES) + 1
    plain = torch.load(two_ranks / f"case-{first}.pt", weights_only=False)
    cache = torch.load(two_ranks / f"case-{first + 1}.pt", weights_only=False)
    assert abs(plain["loss"] - cache["loss"]) < 1e-5
    for name, g in plain["grads"].items():
        torch.testing.assert_close(cache["grads"][name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_one_gradient_all_reduce_per_step(two_ranks, bases, index):
    """Counted by wrapping torch.distributed in the child, whatever the chunk count."""
    strategy, chunk, config = CASES[index]
    got = torch.load(two_ranks / f"case-{index}.pt", weights_only=False)
    params = n_params(bases["still"])
    reduces = [numel for name, numel in got["calls"] if name == "all_reduce"]
    gathers = [numel for name, numel in got["calls"] if name == "all_gather"]
    assert len([n for n in reduces if n >= params]) == 1  # the gradients, one buffer
    assert got["record"]["chunks"] > 3  # several encoder chunks (backwards, with the cache)
    if config["gather"] == "none":
        assert reduces and len(reduces) == 1 and not gathers
    else:  # embeddings: one all-gather forward, one all-reduce of their gradients backward
        assert len(reduces) == 2 and len(gathers) == 1
        assert max(n for n in reduces if n < params) < params / 10
    assert got["record"]["grad_allreduces"] == 1  # densefit's own count, logged per step


def test_training_run_matches_one_process_and_syncs_once_per_step(two_ranks, bases, tmp_path):
    ranks = [json.loads((two_ranks / f"train-{r}.json").read_text()) for r in range(2)]
    model = SentenceTransformer(bases["still"], device="cpu")
    one = train(model, examples(ROWS * 2), TrainConfig(**TRAIN_CONFIG))
    assert ranks[0]["steps"] == ranks[1]["steps"] == one.steps == 3  # 14 rows: 6, 6, 2
    for r in ranks:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(one.losses), atol=1e-4, rtol=1e-4
        )
    params = n_params(bases["still"])
    for r in ranks:
        grad_reduces = [n for name, n in r["calls"] if name == "all_reduce" and n >= params]
        assert len(grad_reduces) == one.steps
    run = two_ranks / "run"
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3]  # written by rank 0 only
    assert all(x["world_size"] == 2 and x["grad_allreduces"] == 1 for x in log)
    assert [x["examples"] for x in log] == [6, 6, 2]
    assert [x["per_device_examples"] for x in log] == [3, 3, 1]
    assert all(x["chunks"] >= 4 for x in log[:2])  # 3 rows per rank in chunks of 2
    assert (run / "model.safetensors").exists() or any(run.rglob("model.safetensors"))


def test_every_rank_runs_the_users_kept_graphs_and_token_budget(two_ranks):
    """The plan rank 0 broadcasts is the plan every rank's strategy runs (kept graphs too)."""
    ranks = [json.loads((two_ranks / f"train-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    for r in ranks:
        assert (r["plan"]["keep_graphs"], r["plan"]["token_budget"]) == (2, 24)
        assert r["used"] and all(
            u == {"keep_graphs": 2, "token_budget": 24, "chunk_size": 2} for u in r["used"]
        )


def test_mnrl_rows_partition_adds_up_to_the_batch_loss():
    torch.manual_seed(0)
    a, p, n = torch.randn(7, 5), torch.randn(7, 5), torch.randn(4, 5)
    mask = torch.rand(7, 11) > 0.8
    for symmetric in (False, True):
        full = mnrl(a, p, n, mask=mask, symmetric=symmetric)
        parts = sum(
            (b - s)
            / 7
            * mnrl(
                a if symmetric else a[s:b],
                p,
                n,
                mask=mask,
                symmetric=symmetric,
                rows=slice(s, b),
                chunk_size=2,
            )
            for s, b in (shard_bounds(7, 3, r) for r in range(3))
        )
        torch.testing.assert_close(parts, full)


def test_cli_nproc_two_with_uneven_data_finishes(bases, tmp_path):
    """densefit train --nproc 2 launches torchrun; 5 rows in batches of 4: the last batch
    has one row, so rank 1 has none in that step, and both ranks still finish."""
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": r["query"], "pos_doc": r["positive"]}) + "\n" for r in ROWS[:5]
        )
    )
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "densefit",
        "train",
        str(data),
        "--model",
        bases["still"],
        "--output",
        str(out),
        "--batch-size",
        "4",
        "--epochs",
        "2",
        "--memory",
        "cache",
        "--chunk-size",
        "1",
        "--no-progress",
        "--nproc",
        "2",
        "--keep-checkpoints",
        "1",
    ]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"densefit train --nproc 2 did not finish in {TIMEOUT}s (a hang)")
    assert done.returncode == 0, done.stderr[-4000:]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3, 4]
    assert [x["examples"] for x in log] == [4, 1, 4, 1]
    assert [x["per_device_examples"] for x in log] == [2, 1, 2, 1]
    assert SentenceTransformer(str(out), device="cpu").encode(["a cell"]).shape == (1, 32)
    assert done.stderr.count("done:") == 1  # rank 0 reports, once
    assert "2 processes" in done.stderr


SOURCES = {  # two sources: every step's rows, on both ranks, from one of them
    "faq": [{"query": f"what is the cell {i}", "positive": f"the cell protein {i}"} for i in range(6)],
    "code": [{"query": f"python function {i}", "positive": f"a function returns {i}",
              "negatives": [f"a list value {i}"]} for i in range(9)],
}  # fmt: skip


def saved_weights(folder: Path) -> dict:
    return SentenceTransformer(str(folder), device="cpu").state_dict()


def test_a_multi_process_run_resumes_on_as_many_processes_with_identical_weights(bases, tmp_path):
    """2 gloo processes, dropout on, two sources: a run ended on both ranks after step 5
    (its newest checkpoint at step 4) and resumed on 2 processes ends with the weights and
    losses of the run that was never interrupted; every rank restored its own RNG state.
    Each step's rows come from one source on both ranks."""
    config = {"batch_size": 4, "epochs": 2, "learning_rate": 1e-3, "memory": "cache",
              "chunk_size": 1, "checkpoint_every": 2, "keep_checkpoints": 3,
              "show_progress": False, "seed": 5}  # fmt: skip
    job = {"sources": SOURCES, "config": config}
    runs = {}
    for name, extra in (("ref", {}), ("out", {"crash_after": 5}), ("again", {"resume": True})):
        out = tmp_path / ("ref" if name == "ref" else "out")
        folder = tmp_path / f"json-{name}"  # spec and results, beside the output folders
        folder.mkdir()
        launch({"base": bases["dropout"], "out": str(folder),
                "train": {**job, **extra, "output": str(out)}}, folder)  # fmt: skip
        if name != "out":
            runs[name] = [json.loads((folder / f"train-{r}.json").read_text()) for r in range(2)]
    assert not (tmp_path / "json-out" / "train-0.json").exists()  # it ended after step 5
    ref, again = runs["ref"], runs["again"]
    assert ref[0]["steps"] == again[0]["steps"] == 2 * (2 + 3)
    assert again[0]["losses"] == ref[0]["losses"]  # the checkpoint's losses, then the same steps
    a, b = saved_weights(tmp_path / "ref"), saved_weights(tmp_path / "out")
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    log = [
        json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in log] == list(range(1, 11))  # steps 5's record redone once
    # every micro-batch: both ranks' rows from the step's one source (cross-device negatives)
    for rank_runs in (ref, again):
        for step, (mine, theirs) in enumerate(zip(*(r["local_origins"] for r in rank_runs))):
            names = {o.split(":")[0] for o in mine + theirs}
            assert len(names) == 1, (step, mine, theirs)
    sources = [r["source"] for r in log]
    assert set(sources) == {"faq", "code"} and sources.count("faq") == 2 * 2


def test_a_checkpoint_resumes_only_on_the_number_of_processes_that_wrote_it(bases, tmp_path):
    """The batches and the data order do not depend on the number of processes, but each
    rank's dropout stream does: another number is refused with a line saying what to do."""
    from densefit.training.checkpoint import CheckpointError

    config = {"batch_size": 4, "epochs": 1, "learning_rate": 1e-3, "memory": "plain",
              "show_progress": False, "keep_checkpoints": 1}  # fmt: skip
    two, work = tmp_path / "two", tmp_path / "work"
    work.mkdir()
    launch({"base": bases["dropout"], "out": str(work),
            "train": {"rows": ROWS, "config": config, "output": str(two)}}, work)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"written by a run of 2 processes, resumed on 1 "
                       r"process: resume it on 2 processes \(--nproc 2\)"):  # fmt: skip
        train(SentenceTransformer(bases["dropout"], device="cpu"), examples(ROWS),
              TrainConfig(**config), output_dir=two, resume=True)  # fmt: skip
    one = tmp_path / "one"
    train(SentenceTransformer(bases["dropout"], device="cpu"), examples(ROWS),
          TrainConfig(**config), output_dir=one)  # fmt: skip
    outputs = launch({"base": bases["dropout"], "out": str(work),
                      "train": {"rows": ROWS, "config": config, "output": str(one),
                                "resume": True}}, work, check=False)  # fmt: skip
    for out in outputs:  # every rank refuses, with the same line (nothing hangs)
        assert (
            "written by a run of 1 process, resumed on 2 processes: resume it on 1 process" in out
        )


def test_evaluation_during_training_with_early_stopping_and_keep_best(bases, tmp_path):
    """Rank 0 evaluates after every step; a learning rate too high for the tiny model makes
    step 2 worse than step 1, so patience 1 stops the run there: both ranks stop after the
    same step (no hang), rank 0 logs the evaluations and saves the best step's model."""
    from test_eval_during_training import make_beir

    from densefit.data.readers import read_training_data
    from densefit.evaluate import evaluate

    beir = make_beir(tmp_path / "beir")
    rows, _ = read_training_data(beir, split="train")  # 16 rows: 4 steps an epoch
    config = {"batch_size": 4, "epochs": 2, "learning_rate": 2e-2, "memory": "plain",
              "show_progress": False, "keep_checkpoints": 0, "seed": 3, "eval_every": 1,
              "keep_best": True, "early_stopping_patience": 1}  # fmt: skip
    out = tmp_path / "run"
    job = {
        "rows": [{"query": r.query, "positive": r.positive} for r in rows],
        "output": str(out),
        "config": config,
        "eval_data": str(beir),
    }
    launch({"base": bases["still"], "out": str(tmp_path), "train": job}, tmp_path)
    ranks = [json.loads((tmp_path / f"train-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"] < 8  # stopped early, together
    ev = ranks[0]["evaluation"]
    assert ranks[1]["evaluation"] is None  # rank 0 evaluates
    history = [h["step"] for h in ev["history"]]
    assert ev["stopped_early"] and history == list(range(ranks[0]["steps"] + 1))
    assert ev["final_step"] == ev["best_step"] + 1 and ev["best_step"] > 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "eval" in r] == history
    saved = SentenceTransformer(str(out), device="cpu")
    again = evaluate(saved, beir, split="dev", metrics=["ndcg@10"]).metrics["ndcg@10"]
    assert round(again, 6) == ev["best"] != ev["history"][-1]["eval"]["ndcg@10"]
    assert not (out / "best").exists()
