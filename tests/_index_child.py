"""One rank of a multi-process `densefit index`, for tests/test_index_processes.py (gloo).

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/_index_child.py SPEC.json

Runs :func:`densefit.jobs.index_job` on the :class:`~densefit.config.commands.IndexJob` of
``SPEC["job"]``, as ``densefit index`` does under torchrun, and writes ``OUT/rank-R.json``:
whether this rank opened a store, how many texts it embedded itself (the batches its
``encode_with_callback`` calls ran), and rank 0's report. ``crash_after`` N ends rank 0
right after its N-th commit of vectors, as a kill would (the other rank then fails too).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import densefit.jobs
from densefit.config.commands import IndexJob
from densefit.retrieval.index.store import LocalDocumentStore

spec = json.loads(Path(sys.argv[1]).read_text())
rank = int(os.environ["RANK"])
seen = {"opened_store": False, "embedded": 0}

_open_store = densefit.jobs.open_store


def recording_open_store(*args, **kwargs):
    seen["opened_store"] = True
    return _open_store(*args, **kwargs)


densefit.jobs.open_store = recording_open_store
_encode = densefit.jobs.encode_with_callback


def counting_encode(*args, on_batch=None, **kwargs):
    def count(n: int) -> None:
        seen["embedded"] += n
        if on_batch is not None:
            on_batch(n)

    return _encode(*args, on_batch=count, **kwargs)


densefit.jobs.encode_with_callback = counting_encode

if "crash_after" in spec and rank == 0:
    _write = LocalDocumentStore.write
    writes = [0]

    def write_then_crash(self, documents, embeddings):
        result = _write(self, documents, embeddings)
        writes[0] += 1
        if writes[0] == spec["crash_after"]:
            os._exit(0)
        return result

    LocalDocumentStore.write = write_then_crash

outcome = densefit.jobs.index_job(IndexJob(**spec["job"]))
seen["report"] = outcome.report.to_dict() if outcome.main else None
(Path(spec["out"]) / f"rank-{rank}.json").write_text(json.dumps(seen))
