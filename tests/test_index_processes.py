"""`densefit index` on two gloo processes on 127.0.0.1 against one process.

Each multi-process run is `densefit index --nproc 2` (torchrun) or two ranks of
tests/_index_child.py, with a timeout: a hang fails the test instead of freezing it. The
stores are compared whole: the same ids, texts and titles, and bit-equal vectors (every
vector is made in the batch one process makes it in).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from densefit.config.commands import IndexJob
from densefit.jobs import index_job
from densefit.retrieval.index.store import LocalDocumentStore
from densefit.testing.conformance import make_corpus

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # seconds for a whole multi-process run (imports take ~8 s per process here)
ENV = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
SETTINGS = {"commit_every": 7, "encode_batch_size": 3, "show_progress": False}


def rows() -> list[dict]:
    """41 documents: 40 distinct ones, then doc-0040 holding doc-0000's text (a text already
    stored: its vector is copied, not embedded)."""
    docs = [{"_id": d.id, "title": d.title, "text": d.text} for d in make_corpus(40)]
    docs.append({**docs[0], "_id": "doc-0040"})
    return docs


def write_corpus(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def contents(store: Path) -> tuple[list, np.ndarray]:
    """Every stored document (id, text, title, metadata) in id order, and their vectors."""
    with LocalDocumentStore(store) as s:
        ids = sorted(s.ids())
        docs = [(d.id, d.text, d.title, d.meta) for d in s.get(ids)]
        return docs, s.vectors(ids)


def assert_same_store(ours: Path, reference: Path) -> None:
    docs, vectors = contents(ours)
    ref_docs, ref_vectors = contents(reference)
    assert docs == ref_docs
    np.testing.assert_array_equal(vectors, ref_vectors)


def one_process(corpus: Path, store: Path, model: Path, **options) -> dict:
    """`densefit index` in this process, on one thread as the ranks run."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job = IndexJob(corpus=corpus, store=store, model=str(model), **SETTINGS, **options)
        return index_job(job).report.to_dict()
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(tmp: Path, spec: dict, *, check: bool = True) -> list[dict | None]:
    """Run tests/_index_child.py as 2 gloo ranks; each rank's record (None if it wrote
    none). With ``check`` both must exit 0."""
    out = tmp / f"ranks-{free_port()}"
    out.mkdir()
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}, default=str))
    group = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "_index_child.py"), str(spec_path)],
            env={**os.environ, **ENV, **group, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the 2 index processes did not finish in {TIMEOUT}s (a hang)")
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0 or not check, f"rank {r} failed:\n{log[-4000:]}"
    records = [out / f"rank-{r}.json" for r in range(2)]
    return [json.loads(f.read_text()) if f.is_file() else None for f in records]


@pytest.fixture(scope="module")
def model(tiny_models) -> Path:
    return tiny_models / "tiny"


def test_index_nproc_two_equals_one_process(model, tmp_path):
    """`densefit index --nproc 2` launches torchrun; the store equals one process's, bit for
    bit, and rank 0 alone prints the summary."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", rows())
    reference = one_process(corpus, tmp_path / "one", model)
    cmd = [sys.executable, "-m", "densefit", "index", str(corpus), "--model", str(model),
           "--store", str(tmp_path / "two"), "--commit-every", "7", "--encode-batch-size", "3",
           "--no-progress", "--nproc", "2"]  # fmt: skip
    try:
        done = subprocess.run(
            cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"densefit index --nproc 2 did not finish in {TIMEOUT}s (a hang)")
    assert done.returncode == 0, done.stderr[-4000:]
    assert_same_store(tmp_path / "two", tmp_path / "one")
    assert done.stderr.count("documents read") == 1, done.stderr  # rank 0 reports, once
    assert "(torch, 2 processes)" in done.stderr
    assert f"{reference['seen']} documents read: {reference['added']} added" in done.stderr
    assert reference["reused"] == 1


def test_a_killed_two_process_index_resumes_to_the_one_process_store(model, tmp_path):
    """Rank 0 killed after its second commit: the store keeps 14 documents; the same run
    again on 2 processes skips them and ends with one uninterrupted process's store, each
    rank having embedded a share of the rest and only rank 0 having opened the store."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", rows())
    reference = one_process(corpus, tmp_path / "one", model)
    job = {"corpus": corpus, "store": tmp_path / "two", "model": str(model), **SETTINGS}
    crashed = two_ranks(tmp_path, {"job": job, "crash_after": 2}, check=False)
    assert crashed == [None, None]  # neither rank finished
    with LocalDocumentStore(tmp_path / "two") as store:
        assert store.count() == 14
    first, second = two_ranks(tmp_path, {"job": job})
    assert_same_store(tmp_path / "two", tmp_path / "one")
    report = first["report"]
    assert (report["unchanged"], report["added"]) == (14, 41 - 14)
    assert report["reused"] == reference["reused"] == 1  # doc-0040: doc-0000's vector
    assert [first["opened_store"], second["opened_store"]] == [True, False]
    assert second["report"] is None
    # Every text embedded once, by one rank; batches of 3 dealt in turn: balanced shares.
    assert first["embedded"] + second["embedded"] == report["encoded"] == 41 - 14 - 1
    assert first["embedded"] > 0 and second["embedded"] > 0
    assert abs(first["embedded"] - second["embedded"]) <= 3 * report["commits"]


def test_a_bad_input_on_two_processes_is_one_error_line_and_exit_2(model, tiny_models, tmp_path):
    """The store refuses another model on rank 0: one error line, exit 2, no traceback."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", rows()[:5])
    one_process(corpus, tmp_path / "store", model)
    cmd = [sys.executable, "-m", "densefit", "index", str(corpus), "--store",
           str(tmp_path / "store"), "--model", str(tiny_models / "tiny-other"), "--no-progress",
           "--nproc", "2"]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True,
                          timeout=TIMEOUT)  # fmt: skip
    assert done.returncode == 2, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "does not reproduce its embeddings" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    missing = subprocess.run([*cmd[:4], str(tmp_path / "missing.jsonl"), *cmd[5:]],
                             env={**os.environ, **ENV}, capture_output=True, text=True,
                             timeout=TIMEOUT)  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.count("no such file or folder") == 1, missing.stderr
    assert "launching" not in missing.stderr  # refused before any process started


def test_prune_on_two_processes_equals_one_process(model, tmp_path):
    """A second corpus drops 5 documents and changes one: --prune on 2 processes deletes,
    re-embeds and skips what one process does, into the same store."""
    docs = rows()
    corpus = write_corpus(tmp_path / "corpus.jsonl", docs)
    kept = [d for i, d in enumerate(docs) if i not in (2, 9, 17, 30, 38)]
    kept[0] = {**kept[0], "text": "genes and proteins of the cell"}
    smaller = write_corpus(tmp_path / "smaller.jsonl", kept)
    one_process(corpus, tmp_path / "one", model)
    reference = one_process(smaller, tmp_path / "one", model, prune=True)
    one_process(corpus, tmp_path / "two", model)
    job = {"corpus": smaller, "store": tmp_path / "two", "model": str(model), "prune": True}
    first, second = two_ranks(tmp_path, {"job": {**job, **SETTINGS}})
    report = first["report"]
    assert report["pruned"] == reference["pruned"] == 5
    assert report["updated"] == reference["updated"] == 1
    assert report["unchanged"] == reference["unchanged"]
    assert second["embedded"] + first["embedded"] == 1  # the changed text, once
    assert_same_store(tmp_path / "two", tmp_path / "one")


def test_cuda_gives_each_process_its_own_gpu(monkeypatch):
    """Started by torchrun with --device cuda, the process of LOCAL_RANK 1 joins over nccl on
    cuda:1 (no GPU needed: the process-group calls are recorded, not made)."""
    import torch
    import torch.distributed as dist

    from densefit.jobs import _start_processes

    calls, joined = [], []
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(str(device)))
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append(backend))
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    assert _start_processes("cuda") == ("cuda:1", 2, False)
    assert calls == ["cuda:1"] and joined == ["nccl"]
