"""A model swap killed (SIGKILL) at a point of the test's choosing.

    python tests/_swap_child.py STORE MODEL POINT N

POINT: ``vectors`` (the N-th new vector chunk written and fsync'd, not committed),
``committed`` (the N-th chunk committed), ``switch`` (the switch's rows and record changed,
not committed) or ``cleanup`` (switched, the old generation's files being removed).
"""

from __future__ import annotations

import os
import signal
import sys

import densefit.retrieval.index.documents as documents
import densefit.retrieval.index.store as store_module
import densefit.retrieval.index.vectors as vectors
from densefit.models import load_model
from densefit.retrieval.index import LocalDocumentStore
from densefit.retrieval.index.swap import reembed_store


def kill_after(function, n: int):
    calls = [0]

    def wrapped(*args, **kwargs):
        result = function(*args, **kwargs)
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return wrapped


def main() -> None:
    store_dir, model_dir, point, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if point == "vectors":
        vectors.VectorFile.write = kill_after(vectors.VectorFile.write, n)
    elif point == "committed":
        store_module.LocalDocumentStore.write_swap = kill_after(
            store_module.LocalDocumentStore.write_swap, n
        )
    elif point == "switch":
        documents.DocumentTable.promote_next_rows = kill_after(
            documents.DocumentTable.promote_next_rows, n
        )
    elif point == "cleanup":
        vectors.CommittedVectors.remove_other_generations = kill_after(
            vectors.CommittedVectors.remove_other_generations, n
        )
    else:
        raise SystemExit(f"unknown point {point!r}")
    with LocalDocumentStore(store_dir) as store:
        reembed_store(store, load_model(model_dir), commit_every=5, runtime="torch")
    raise SystemExit(3)  # not killed: the test asked for a point the swap never reached


if __name__ == "__main__":
    main()
