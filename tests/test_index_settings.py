"""Stores record what made their vectors (issue 18.5): settings, refusal, --reembed, the lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from densefit.retrieval.encode import encode_texts
from densefit.retrieval.index import open_store
from densefit.retrieval.index.indexing import index_documents
from densefit.retrieval.index.locking import StoreLockedError, writer_lock
from densefit.retrieval.index.types import SettingsMismatchError, VectorSettings
from densefit.testing.conformance import make_corpus


@pytest.fixture
def model(tmp_path):
    from densefit.testing import tiny_model

    return tiny_model(tmp_path / "tiny")


def _unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_store_records_the_settings(tmp_path):
    from densefit.testing import tiny_model

    model = tiny_model(tmp_path / "m", max_seq_length=48, normalize=True)
    with open_store(tmp_path / "s", model) as store:
        info = store.info()
    assert (info["max_seq_length"], info["normalize"], info["prompts"]) == (48, True, {})
    with open_store(tmp_path / "s", model) as reopened:  # read back from store.sqlite
        assert reopened.settings == VectorSettings(max_seq_length=48, normalize=True, prompts={})


def test_other_truncation_is_refused_and_nothing_changes(model, tmp_path):
    docs = make_corpus(12)
    with open_store(tmp_path / "s", model) as store:
        index_documents(store, model, docs)
        before = store.vectors([d.id for d in docs])
        model.max_seq_length = 8
        with pytest.raises(SettingsMismatchError) as caught:
            index_documents(store, model, docs)
        message = str(caught.value)
        assert "max_seq_length=64" in message and "max_seq_length=8" in message
        assert "--max-seq-length 64" in message and "--reembed" in message
        assert "\n" not in message
        np.testing.assert_array_equal(store.vectors([d.id for d in docs]), before)
        assert store.dead_rows() == 0


def test_interrupted_reembed_resumes_without_the_flag(model, tmp_path):
    docs = make_corpus(16)
    with open_store(tmp_path / "s", model) as store:
        index_documents(store, model, docs)
        model.max_seq_length = 8
        store.start_reembedding(model)  # ... and the process died here
    with open_store(tmp_path / "s", model) as store:
        report = index_documents(store, model, docs[:4])  # no reembed=True: resumes anyway
        assert (report.reembedded, report.reembedded_stored) == (4, 12)
        expected = _unit(encode_texts(model, [d.text for d in docs]))
        np.testing.assert_allclose(store.vectors([d.id for d in docs]), expected, atol=1e-6)
        assert store.all_stale_ids() == []


def test_duplicate_texts_do_not_copy_stale_vectors(model, tmp_path):
    docs = make_corpus(6)
    with open_store(tmp_path / "s", model) as store:
        index_documents(store, model, docs)
        model.max_seq_length = 8
        twin = type(docs[0])("twin", docs[0].text)  # same text as a stored, stale document
        index_documents(store, model, [twin], reembed=True)
        expected = _unit(encode_texts(model, [docs[0].text]))
        np.testing.assert_allclose(store.vectors(["twin"]), expected, atol=1e-6)


def test_lock_waits_then_gives_up_with_a_clear_message(tmp_path):
    said = []
    with writer_lock(tmp_path):
        with pytest.raises(StoreLockedError, match="--lock-timeout"):
            with writer_lock(tmp_path, timeout=0.3, on_wait=said.append):
                pass
    assert len(said) == 1 and "waiting" in said[0] and f"pid {os.getpid()}" in said[0]
    with writer_lock(tmp_path, timeout=0):  # released: taken at once
        pass


def test_the_lock_file_is_removed_and_still_lets_one_holder_in_at_a_time(tmp_path):
    """Each holder removes the file as it lets go; holders that waited on a removed file
    lock the one at the path instead, so no two are ever inside together."""
    import threading

    inside, most, entries = [0], [0], [0]
    guard = threading.Lock()

    def hold(times: int) -> None:
        for _ in range(times):
            with writer_lock(tmp_path, on_wait=None, poll=0.001):
                with guard:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                    entries[0] += 1
                time.sleep(0.001)
                with guard:
                    inside[0] -= 1

    threads = [threading.Thread(target=hold, args=(40,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert entries[0] == 240 and most[0] == 1
    assert not (tmp_path / "densefit.lock").exists()


def _write_corpus(path: Path, n: int) -> None:
    with open(path, "w") as fh:
        for doc in make_corpus(n):
            fh.write(json.dumps({"_id": doc.id, "text": doc.text}) + "\n")


def test_two_index_processes_create_and_embed_once(tmp_path):
    """Both wait on the lock the test holds, then race: one store, each document once."""
    from densefit.testing import tiny_model

    tiny_model(tmp_path / "build").save(str(tmp_path / "model"))
    _write_corpus(tmp_path / "corpus.jsonl", 200)
    store = tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    command = [sys.executable, "-m", "densefit", "index", str(tmp_path / "corpus.jsonl")]
    command += ["--model", str(tmp_path / "model"), "--store", str(store)]
    command += ["--commit-every", "20", "--no-progress", "--json"]
    logs = [tmp_path / f"err{i}.txt" for i in range(2)]
    with writer_lock(store):
        runs = [
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), env=env)
            for log in logs
        ]
        deadline = time.monotonic() + 300
        while not all("waiting" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            assert all(run.poll() is None for run in runs), [log.read_text() for log in logs]
            time.sleep(0.2)
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [log.read_text() for log in logs]
    reports = [json.loads(out)["report"] for out in outputs]
    assert sum(r["added"] for r in reports) == 200
    assert sum(r["encoded"] for r in reports) == 200  # never embedded twice
    assert sorted(r["unchanged"] for r in reports) == [0, 200]
    with open_store(store) as opened:
        assert opened.count() == 200 and opened.dead_rows() == 0
