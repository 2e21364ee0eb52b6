"""``densefit serve`` against two peers, plus its fault scripts.

    OMP_NUM_THREADS=1 python bench/serve.py            # everything (~20-30 min on a shared CPU)
    python bench/serve.py --prepare                     # only embed and cache the corpus
    python bench/serve.py --faults-only                 # only the fault scripts

PLACEHOLDER: the full description is written below when the bench is complete.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / "bench" / ".cache" / "serve"
DATASETS = ROOT.parent / "shared" / "datasets"
MODEL = "all-MiniLM-L6-v2"
# Documents are cut at 128 tokens (the model's default is 256): embedding 15k documents on
# the shared 2-core CPU at 256 tokens would take about an hour; every system in the benchmark
# uses the same model with the same setting.
MAX_SEQ_LENGTH = 128
ORDER = ("pydoc", "manpages", "nfcorpus", "scifact")  # cheapest first: partial caches help


# -- the corpus and its embeddings (cached) --------------------------------------------------


def read_jsonl(path: Path):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def load_corpus(datasets: Path) -> tuple[dict[str, list], dict[str, list[str]]]:
    """``{dataset: [Document]}`` (ids prefixed ``dataset/``, meta ``{"dataset": name}``) and
    ``{dataset: [query text]}`` for SciFact, NFCorpus, manpages (BEIR) and pydoc (pairs)."""
    from densefit.data.corpus import iter_corpus
    from densefit.data.types import Document

    docs: dict[str, list] = {}
    queries: dict[str, list[str]] = {}
    for name in ("scifact", "nfcorpus", "manpages"):
        folder = datasets / name
        docs[name] = [
            Document(f"{name}/{d.id}", d.text, d.title, {"dataset": name})
            for d in iter_corpus(folder)
        ]
        qfile = next(
            p for p in (folder / "queries.jsonl", folder / "queries.jsonl.gz") if p.exists()
        )
        queries[name] = [row["text"] for row in read_jsonl(qfile)]
    rows = list(read_jsonl(datasets / "pydoc" / "train.jsonl"))
    docs["pydoc"] = [
        Document(
            f"pydoc/{i}", row["positive"], "", {"dataset": "pydoc", "source": row.get("source", "")}
        )
        for i, row in enumerate(rows)
    ]
    queries["pydoc"] = [row["anchor"] for row in rows]
    return docs, queries


def cached_embeddings(model, name: str, docs: list, cache: Path) -> np.ndarray:
    """The embeddings of ``docs`` (one dataset), encoded once and kept under ``cache``."""
    from densefit.retrieval.encode import encode_texts

    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{name}-{len(docs)}-{MAX_SEQ_LENGTH}.npy"
    if path.exists():
        return np.load(path)
    start = time.perf_counter()
    emb = encode_texts(model, [d.text for d in docs], batch_size=32, show_progress=True)
    np.save(path.with_suffix(".tmp.npy"), emb)
    os.replace(path.with_suffix(".tmp.npy"), path)
    print(
        f"{name}: {len(docs)} documents embedded in {time.perf_counter() - start:.0f}s", flush=True
    )
    return emb


def prepare(datasets: Path, cache: Path):
    from densefit.models import load_model

    model = load_model(MODEL, max_seq_length=MAX_SEQ_LENGTH)
    docs, queries = load_corpus(datasets)
    embeddings = {name: cached_embeddings(model, name, docs[name], cache) for name in ORDER}
    return model, docs, queries, embeddings


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--prepare", action="store_true")
    args = parser.parse_args()
    if args.prepare:
        prepare(DATASETS, CACHE)
