"""``densefit serve`` against two peers on the same documents and model, plus fault scripts.

    OMP_NUM_THREADS=1 python bench/serve.py              # everything (~35 min on a shared CPU)
    python bench/serve.py --prepare                       # only embed and cache the corpus
    python bench/serve.py --skip-load --skip-scale --skip-embeddings   # only the fault scripts
    python bench/serve.py --skip-load --skip-faults --skip-scale       # only /v1/embeddings
    python bench/serve.py --swap-only                     # only search during a model swap
    python bench/serve.py --systems densefit,handwritten --writer off --seconds 10 \
        --skip-faults --skip-scale                        # a short load run (~5 min)

Before starting, the script waits until the 1-minute load average is below ``--quiet-load``
(1.5; polls every 30 s, at most 20 min, then runs anyway and says so).

Documents: every document of ../shared/datasets (SciFact, NFCorpus, manpages, pydoc; ids
``dataset/id``, metadata ``{"dataset": name}``), embedded once with all-MiniLM-L6-v2 and
cached under bench/.cache/serve/ (gitignored). Queries: their query sets, shuffled.

Systems, each a uvicorn server on 127.0.0.1 in its own process with the same thread count,
serving the same documents and vectors with the same model:

- ``densefit``: :func:`densefit.serve.app.create_app` over a store built from the cached
  vectors (micro-batched query encoding, one writer acknowledged after commit), its queries
  embedded with torch;
- ``densefit:R`` (``densefit:openvino``, ``densefit:openvino-int8``...): the same server with
  ``runtime=R``, the model exported for R once into bench/.cache/serve/model-exports (checked
  on SciFact's train split); the documents keep the torch vectors, so an int8 runtime's
  queries meet fp32 documents, as serve allows where the export's check found the mix keeps
  the top 10 (its agreement with ``densefit`` is recorded); ``densefit:auto`` with every
  export made, serve picking the fastest at one query at start (its choice and timings are
  recorded under ``load_settings.query_runtime``);
- ``handwritten``: FastAPI calling ``SentenceTransformer.encode`` per request and
  ``faiss.IndexFlatIP`` (writes: encode + ``index.add``; nothing persisted);
- ``haystack``: a Haystack pipeline (``SentenceTransformersTextEmbedder`` ->
  ``InMemoryEmbeddingRetriever``) behind the same FastAPI wrapper (writes:
  ``SentenceTransformersDocumentEmbedder`` + ``write_documents(OVERWRITE)``).

Load: 1, 4 and 16 concurrent clients (asyncio + httpx, one process), each sending one query
(k=10) at a time for ``--seconds``; with and without a concurrent writer that upserts
``--write-batch`` new documents every ``--write-interval`` seconds (the same write work for
every system, as far as it keeps up), waiting for each acknowledgement. Recorded:
queries/s, p50/p99 latency, writes acknowledged. Search results of the densefit server
(under 16 concurrent clients, so micro-batched) are compared with the exact in-process search.

Embeddings (``/v1/embeddings``, OpenAI's shape): densefit's endpoint (inputs micro-batched
with each other, as with search queries) against the hand-written server's, which calls
``SentenceTransformer.encode`` on each request's inputs (and counts no tokens); 1, 4 and 16
clients each send one request at a time of ``--embed-inputs`` texts (1: queries; 32:
documents, Haystack's document-embedder batch), base64 as OpenAI's client asks, for
``--seconds``. Recorded: texts/s, requests/s, p50/p99 latency, errors, server CPU, and the
largest difference of each server's vectors from in-process ``encode_texts`` on 64 documents.

Faults (on the densefit server): SIGKILL while clients stream acknowledged writes, then
restart: every acknowledged document must be found (GET, and search for a sample); 1,000
malformed or hostile requests: none may get a 5xx, and /health must still answer. All are
refused with a 4xx except the well-formed filters among the injections (a value carrying
SQL text such as ``"x' OR '1'='1"``, or ``{"$gt": ""}``): values are bound parameters, so
those are valid filters that match nothing, and must get 200 with no hits (hits would mean
an injection); the results count them apart (``expected_200_no_hits``).

Model swap (``--swap-only``, or with the other parts unless ``--skip-swap``): a densefit
server (API key set) over ``--swap-docs`` of the documents, searched by ``--swap-clients``
clients one query at a time while a writer upserts ``--write-batch`` documents every
``--write-interval`` seconds, first for ``--seconds`` (before), then through ``POST
/admin/reembed`` to the same model at its own 256 tokens (the server's vectors are made at 128,
so every vector changes) until ``GET /admin/reembed`` says done, then for ``--seconds``
(after). Recorded: searches and their errors (any non-200) in each phase, p50/p99, writes
acknowledged, the swap's duration, and the top-10 of 50 queries from the server after the
swap against a fresh in-process index of the final documents by the new model.

Scale: a store of the real vectors plus random unit vectors up to ``--scale-rows``
(1,000,000), searched in-process one query at a time, unfiltered and with metadata filters.

The machine is shared: threads, versions, the command line and the load averages (before
and after each point) are recorded with the results, and only ratios between systems
measured in the same run are meaningful. Every part of serve.json names the run (``runs``:
command, environment, machine, versions, load) that measured it; a part skipped this time
keeps its last measurement and run record. Writes bench/results/serve.csv, serve.json and
serve.png.
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
from _runner import cpu_model
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / "bench" / ".cache" / "serve"
DATASETS = ROOT.parent / "shared" / "datasets"
MODEL = "all-MiniLM-L6-v2"
SYSTEMS = ("densefit", "handwritten", "haystack")  # densefit also as densefit:RUNTIME
# Documents are cut at 128 tokens (the model's default is 256): embedding 15k documents on
# the shared 2-core CPU at 256 tokens would take about an hour; every system in the benchmark
# uses the same model with the same setting.
MAX_SEQ_LENGTH = 128
# Cheapest first, so that partial caches help; BENCH_SERVE_DATASETS=pydoc makes a smoke run.
ORDER = tuple(os.environ.get("BENCH_SERVE_DATASETS", "pydoc,manpages,nfcorpus,scifact").split(","))


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
    from densefit.data.corpus import find_beir_file, iter_corpus, read_queries
    from densefit.data.types import Document

    docs: dict[str, list] = {}
    queries: dict[str, list[str]] = {}
    for name in [n for n in ("scifact", "nfcorpus", "manpages") if n in ORDER]:
        folder = datasets / name
        docs[name] = [
            Document(f"{name}/{d.id}", d.text, d.title, {"dataset": name})
            for d in iter_corpus(folder)
        ]
        queries[name] = list(read_queries(find_beir_file(folder, "queries")).values())
    if "pydoc" not in ORDER:
        return docs, queries
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


def model_path() -> str:
    from densefit.models import resolve_model_path

    return resolve_model_path(MODEL)


def all_documents(docs: dict, embeddings: dict) -> tuple[list, np.ndarray]:
    """Every document (in ORDER) and its unit-length vector."""
    flat = [d for name in ORDER for d in docs[name]]
    vectors = np.concatenate([embeddings[name] for name in ORDER]).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return flat, vectors


def build_store(path: Path, model, documents: list, vectors: np.ndarray) -> None:
    """A fresh densefit store at ``path`` holding ``documents`` with the cached vectors."""
    import shutil

    from densefit.retrieval.index import open_store

    shutil.rmtree(path, ignore_errors=True)
    with open_store(path, model) as store:
        for start in range(0, len(documents), 5000):
            store.write(documents[start : start + 5000], vectors[start : start + 5000])


def query_list(queries: dict, n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    pool = [q for name in ORDER for q in queries[name] if q.strip()]
    return [pool[i] for i in rng.permutation(len(pool))[:n]]


# -- the servers (each run in its own process: ``--server NAME``) --------------------------


def serve_densefit(store_path: Path, port: int, runtime: str | None = None) -> None:
    """The densefit server; ``runtime``: its query workers run that runtime of the model's
    exports (:func:`runtime_model`), else the packaged model with torch."""
    from densefit.models import load_model
    from densefit.retrieval.index import LocalDocumentStore
    from densefit.serve.app import create_app
    from densefit.serve.config import ServeConfig
    from densefit.serve.server import run_server

    model = load_model(runtime_model() if runtime else MODEL, max_seq_length=MAX_SEQ_LENGTH)
    config = ServeConfig(
        api_key=os.environ.get("BENCH_SERVE_API_KEY") or None, runtime=runtime or "torch"
    )
    app = create_app(LocalDocumentStore(store_path), model, config)
    run_server(app, port=port, graceful_seconds=10)


class PeerSearchIn(BaseModel):
    """The peers' search body (module level: FastAPI resolves the annotations here)."""

    query: str
    k: int = 10


class PeerDocIn(BaseModel):
    id: str
    text: str
    meta: dict = {}


class PeerUpsertIn(BaseModel):
    documents: list[PeerDocIn]


class PeerEmbeddingsIn(BaseModel):
    input: str | list[str]
    model: str | None = None
    encoding_format: str = "float"


def peer_embedding(vector: np.ndarray, encoding_format: str):
    import base64

    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()


def serve_handwritten(port: int, docs: list, vectors: np.ndarray) -> None:
    """What a user writes by hand: encode per request, faiss.IndexFlatIP, a lock for writes."""
    import threading

    import faiss
    import uvicorn
    from fastapi import FastAPI
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_path(), device="cpu")
    model.max_seq_length = MAX_SEQ_LENGTH
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    ids, texts, metas = [d.id for d in docs], [d.text for d in docs], [d.meta for d in docs]
    lock = threading.Lock()
    app = FastAPI()

    @app.post("/search")
    def search(req: PeerSearchIn):
        emb = model.encode([req.query], normalize_embeddings=True)
        with lock:
            scores, rows = index.search(emb, req.k)
        hits = [
            {"id": ids[r], "score": float(s), "text": texts[r], "meta": metas[r]}
            for s, r in zip(scores[0], rows[0])
            if r >= 0
        ]
        return {"results": [{"query": req.query, "hits": hits}]}

    @app.post("/documents")
    def upsert(req: PeerUpsertIn):
        emb = model.encode([d.text for d in req.documents], normalize_embeddings=True)
        with lock:
            index.add(emb)
            for d in req.documents:
                ids.append(d.id)
                texts.append(d.text)
                metas.append(d.meta)
        return {"added": len(req.documents)}

    @app.post("/v1/embeddings")
    def embeddings(req: PeerEmbeddingsIn):
        from fastapi.responses import JSONResponse

        texts = [req.input] if isinstance(req.input, str) else req.input
        emb = model.encode(texts, normalize_embeddings=True, batch_size=32)
        data = [
            {"object": "embedding", "index": i, "embedding": peer_embedding(v, req.encoding_format)}
            for i, v in enumerate(emb)
        ]
        usage = {"prompt_tokens": 0, "total_tokens": 0}
        return JSONResponse({"object": "list", "data": data, "model": MODEL, "usage": usage})

    @app.get("/health")
    def health():
        return {"status": "ok", "documents": index.ntotal}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_haystack(port: int, docs: list, vectors: np.ndarray) -> None:
    """A Haystack pipeline (text embedder -> in-memory embedding retriever) behind FastAPI."""
    import uvicorn
    from fastapi import FastAPI
    from haystack import Document as HDocument
    from haystack import Pipeline
    from haystack.components.retrievers.in_memory import InMemoryEmbeddingRetriever
    from haystack.document_stores.in_memory import InMemoryDocumentStore
    from haystack.document_stores.types import DuplicatePolicy
    from haystack_integrations.components.embedders.sentence_transformers import (
        SentenceTransformersDocumentEmbedder,
        SentenceTransformersTextEmbedder,
    )

    kwargs = dict(
        model=model_path(),
        normalize_embeddings=True,
        progress_bar=False,
        local_files_only=True,
        tokenizer_kwargs={"model_max_length": MAX_SEQ_LENGTH},
    )
    store = InMemoryDocumentStore(embedding_similarity_function="dot_product")
    store.write_documents(
        [
            HDocument(id=d.id, content=d.text, meta=d.meta, embedding=v.tolist())
            for d, v in zip(docs, vectors)
        ]
    )
    pipe = Pipeline()
    pipe.add_component("embedder", SentenceTransformersTextEmbedder(**kwargs))
    pipe.add_component("retriever", InMemoryEmbeddingRetriever(store))
    pipe.connect("embedder.embedding", "retriever.query_embedding")
    pipe.warm_up()
    doc_embedder = SentenceTransformersDocumentEmbedder(**kwargs)
    doc_embedder.warm_up()
    app = FastAPI()

    @app.post("/search")
    def search(req: PeerSearchIn):
        out = pipe.run({"embedder": {"text": req.query}, "retriever": {"top_k": req.k}})
        hits = [
            {"id": d.id, "score": float(d.score), "text": d.content, "meta": d.meta}
            for d in out["retriever"]["documents"]
        ]
        return {"results": [{"query": req.query, "hits": hits}]}

    @app.post("/documents")
    def upsert(req: PeerUpsertIn):
        batch = [HDocument(id=d.id, content=d.text, meta=d.meta) for d in req.documents]
        batch = doc_embedder.run(batch)["documents"]
        store.write_documents(batch, policy=DuplicatePolicy.OVERWRITE)
        return {"added": len(batch)}

    @app.get("/health")
    def health():
        return {"status": "ok", "documents": store.count_documents()}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def system_runtime(system: str) -> str | None:
    """``densefit:R`` -> ``R`` (the densefit server running runtime R); None for the others.

    >>> system_runtime("densefit:openvino-int8"), system_runtime("densefit")
    ('openvino-int8', None)
    """
    base, _, runtime = system.partition(":")
    return runtime if base == "densefit" and runtime else None


def is_densefit(system: str) -> bool:
    return system.partition(":")[0] == "densefit"


def system_error(system: str) -> str | None:
    """What is wrong with the ``--systems`` entry ``system``, or None.

    >>> system_error("densefit:openvino-int8") is None, system_error("densefit:tflite")
    (True, "unknown system 'densefit:tflite' (densefit[:RUNTIME], handwritten, haystack)")
    """
    from densefit.choices import RUNTIME_CHOICES  # stdlib only: what serve's --runtime takes

    base, colon, runtime = system.partition(":")
    if base in SYSTEMS and (not colon or (base == "densefit" and runtime in RUNTIME_CHOICES)):
        return None
    return f"unknown system {system!r} (densefit[:RUNTIME], handwritten, haystack)"


def runtime_model() -> Path:
    """The model folder whose exports the ``densefit:R`` servers run: the packaged model
    saved under the cache and exported there (:func:`prepare_runtimes`)."""
    return CACHE / "model-exports"


def prepare_runtimes(runtimes: list[str]) -> dict:
    """Export the model for ``runtimes`` into :func:`runtime_model` (once: kept in the cache),
    checked on SciFact's train split as ``densefit export --calibration`` checks; their
    manifest records (check numbers included) for the results."""
    from densefit.models import load_model
    from densefit.retrieval.export import export_model
    from densefit.retrieval.runtimes import exports_of

    folder = runtime_model()
    missing = [r for r in runtimes if r not in exports_of(folder if folder.is_dir() else None)]
    if missing:
        print(f"exporting {MODEL} to {folder} ({', '.join(missing)})", flush=True)
        export_model(
            load_model(folder if folder.is_dir() else MODEL, device="cpu"),
            missing,
            folder=folder,
            calibration=DATASETS / "scifact",
            on_check_failure="warn",
        )
    records = exports_of(folder)
    return {r: {k: v for k, v in records[r][0].items() if k != "recipes_tried"} for r in runtimes}


def run_server_process(name: str, port: int, store_path: Path) -> None:
    if is_densefit(name):
        serve_densefit(store_path, port, system_runtime(name))
        return
    from densefit.models import load_model

    docs, _ = load_corpus(DATASETS)
    embeddings = {n: np.load(next(CACHE.glob(f"{n}-*-{MAX_SEQ_LENGTH}.npy"))) for n in ORDER}
    flat, vectors = all_documents(docs, embeddings)
    del load_model
    (serve_handwritten if name == "handwritten" else serve_haystack)(port, flat, vectors)


class Server:
    """A benchmark server in a subprocess on a free loopback port; killed on exit."""

    def __init__(self, name: str, store_path: Path, threads: int, api_key: str | None = None):
        import socket
        import subprocess

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "BENCH_SERVE_API_KEY": api_key or "",
        }
        self.name = name
        self.headers = {"X-API-Key": api_key} if api_key else {}
        self.log = open(CACHE / f"server-{name}.log", "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--server",
                name,
                "--port",
                str(self.port),
                "--store",
                str(store_path),
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited: see {self.log.name}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2, headers=self.headers)
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} server did not start in {timeout}s")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


# -- load ---------------------------------------------------------------------------------------


async def _load_cell(
    url: str,
    queries: list[str],
    clients: int,
    seconds: float,
    writer: bool,
    write_docs: list,
    write_batch: int,
    write_interval: float = 2.0,
) -> dict:
    import asyncio

    import httpx

    latencies: list[float] = []
    errors = 0
    acked = 0
    write_lat: list[float] = []
    stop_at = time.perf_counter() + seconds
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def reader():
            nonlocal errors
            while time.perf_counter() < stop_at:
                q = queries[next(counter) % len(queries)]
                t0 = time.perf_counter()
                r = await client.post("/search", json={"query": q, "k": 10})
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

        async def write_loop():
            nonlocal acked, errors
            for start in range(0, len(write_docs), write_batch):  # bounded by the documents
                if time.perf_counter() >= stop_at:
                    return
                batch = write_docs[start : start + write_batch]
                t0 = time.perf_counter()
                next_at = t0 + write_interval  # a fixed pace: the same write work for all
                r = await client.post("/documents", json={"documents": batch})
                if r.status_code == 200:
                    acked += len(batch)
                    write_lat.append(time.perf_counter() - t0)
                else:
                    errors += 1
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

        t0 = time.perf_counter()
        tasks = [reader() for _ in range(clients)] + ([write_loop()] if writer else [])
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    lat = np.array(latencies) * 1000
    return {
        "queries": len(latencies),
        "qps": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "errors": errors,
        "writes_acked": acked,
        "write_p50_ms": float(np.median(write_lat) * 1000) if write_lat else None,
        "seconds": elapsed,
    }


def load_cell(
    url, queries, clients, seconds, writer, write_docs, write_batch, write_interval=2.0
) -> dict:
    import asyncio

    return asyncio.run(
        _load_cell(url, queries, clients, seconds, writer, write_docs, write_batch, write_interval)
    )


async def _embed_cell(
    url: str, texts: list[str], clients: int, seconds: float, inputs: int
) -> dict:
    import httpx

    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def embedder():
            nonlocal errors
            while time.perf_counter() < stop_at:
                batch = [texts[next(counter) % len(texts)] for _ in range(inputs)]
                body = {"input": batch, "model": MODEL, "encoding_format": "base64"}
                t0 = time.perf_counter()
                r = await client.post("/v1/embeddings", json=body)
                if r.status_code == 200 and len(r.json()["data"]) == inputs:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

        import asyncio

        t0 = time.perf_counter()
        await asyncio.gather(*(embedder() for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    lat = np.array(latencies) * 1000
    return {
        "requests": len(latencies),
        "texts": len(latencies) * inputs,
        "requests_per_s": len(latencies) / elapsed,
        "texts_per_s": len(latencies) * inputs / elapsed,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "errors": errors,
        "seconds": elapsed,
    }


def embed_cell(url: str, texts: list[str], clients: int, seconds: float, inputs: int) -> dict:
    import asyncio

    return asyncio.run(_embed_cell(url, texts, clients, seconds, inputs))


def embedding_check(url: str, model, texts: list[str]) -> dict:
    """The server's /v1/embeddings vectors against in-process ``encode_texts`` (normalised)."""
    import base64

    import httpx

    from densefit.retrieval.encode import encode_texts

    body = {"input": texts, "model": MODEL, "encoding_format": "base64"}
    data = httpx.post(f"{url}/v1/embeddings", json=body, timeout=300).json()["data"]
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])
    want = encode_texts(model, texts, normalize=True)
    return {"texts": len(texts), "max_abs_diff": float(np.abs(got - want).max())}


def embedding_ratios(rows: list[dict]) -> list[dict]:
    """densefit / handwritten texts per second and p99 at each (inputs, clients) point."""
    out = []
    for d in (r for r in rows if r["system"] == "densefit"):
        h = next(
            (
                r
                for r in rows
                if r["system"] == "handwritten"
                and r["clients"] == d["clients"]
                and r["inputs_per_request"] == d["inputs_per_request"]
            ),
            None,
        )
        if h is None or not h["texts_per_s"]:
            continue
        out.append(
            {
                "clients": d["clients"],
                "inputs_per_request": d["inputs_per_request"],
                "texts_per_s_ratio": d["texts_per_s"] / h["texts_per_s"],
                "p99_ratio": (d["p99_ms"] / h["p99_ms"]) if d["p99_ms"] and h["p99_ms"] else None,
            }
        )
    return out


def server_cpu(server: Server) -> float:
    """CPU seconds (user + system) the server process used so far: on a shared machine
    queries per CPU second is the steadier measure of efficiency."""
    import psutil

    times = psutil.Process(server.proc.pid).cpu_times()
    return times.user + times.system


def writer_documents(docs: dict, system: str, n: int, seed: int) -> list[dict]:
    """``n`` new documents (real texts, new ids) for the concurrent writer."""
    rng = np.random.default_rng(seed)
    pool = [d for name in ORDER for d in docs[name]]
    picks = rng.choice(len(pool), size=min(n, len(pool)), replace=False)
    return [
        {
            "id": f"w/{system}/{seed}/{i}",
            "text": pool[p].text[:1000],
            "meta": {"dataset": "written"},
        }
        for i, p in enumerate(picks)
    ]


async def _fetch_results(url: str, queries: list[str], clients: int, k: int) -> list[list]:
    import asyncio

    import httpx

    sem = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(q):
            async with sem:
                r = await client.post("/search", json={"query": q, "k": k})
                return r.json()["results"][0]["hits"]

        return await asyncio.gather(*(one(q) for q in queries))


def equality_check(url: str, store_path: Path, model, queries: list[str]) -> dict:
    """The server's hits (16 concurrent clients: micro-batched) vs the exact in-process
    search, one query at a time."""
    import asyncio

    from densefit.retrieval.encode import encode_texts
    from densefit.retrieval.index import LocalDocumentStore

    got = asyncio.run(_fetch_results(url, queries, 16, 10))
    same_ids = same_up_to_ties = 0
    max_diff = 0.0
    with LocalDocumentStore(store_path) as store:
        for q, hits in zip(queries, got):
            want = store.search(encode_texts(model, [q]), top_k=10)[0]
            scores = np.array([h["score"] for h in hits])
            exact_scores = np.array([w.score for w in want])
            max_diff = max(max_diff, float(np.abs(scores - exact_scores).max()))
            if [h["id"] for h in hits] == [h.id for h in want]:
                same_ids += 1
            else:  # differing ids must be float-level ties (batched vs single encoding)
                query = encode_texts(model, [q], normalize=True)[0]
                exact_of = store.vectors([h["id"] for h in hits]) @ query  # a rank-11 doc too
                tied = all(abs(e - w.score) < 1e-5 for e, w in zip(exact_of, want))
                same_up_to_ties += tied
    return {
        "queries": len(queries),
        "identical_ids": same_ids,
        "differ_only_by_ties_within_1e-5": same_up_to_ties,
        "different": len(queries) - same_ids - same_up_to_ties,
        "max_score_diff": max_diff,
    }


# -- a model swap -------------------------------------------------------------------------------


async def _swap_phase(url, headers, queries, clients, write_docs, write_batch, write_interval,
                      until) -> dict:  # fmt: skip
    """Search (and write) until ``until()`` is true; statuses and latencies."""
    import asyncio

    import httpx

    latencies: list[float] = []
    statuses: dict[int, int] = {}
    acked = 0
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, headers=headers) as c:

        async def reader():
            while not await until(c):
                q = queries[next(counter) % len(queries)]
                t0 = time.perf_counter()
                r = await c.post("/search", json={"query": q, "k": 10})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)

        async def writer():
            nonlocal acked
            for start in range(0, len(write_docs), write_batch):
                if await until(c):
                    return
                batch = write_docs[start : start + write_batch]
                next_at = time.perf_counter() + write_interval
                r = await c.post("/documents", json={"documents": batch})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    acked += len(batch)
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

        t0 = time.perf_counter()
        await asyncio.gather(*[reader() for _ in range(clients)], writer())
        elapsed = time.perf_counter() - t0
    lat = np.array(latencies) * 1000
    return {
        "searches": int(sum(v for k, v in statuses.items())),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "errors": int(sum(v for k, v in statuses.items() if k != 200)),
        "qps": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "documents_written": acked,
        "seconds": elapsed,
    }


def swap_point(store_path: Path, model, documents, vectors, docs, queries, args, threads):
    """Search during ``POST /admin/reembed``: errors, latency, and the results after it."""
    import asyncio

    from densefit.data.types import Document
    from densefit.models import load_model
    from densefit.retrieval.encode import encode_texts
    from densefit.retrieval.index import index_documents, open_store

    n = min(args.swap_docs, len(documents))
    build_store(store_path, model, documents[:n], vectors[:n])
    key = "bench-swap-key"
    server = Server("densefit", store_path, threads, api_key=key)
    headers = {"X-API-Key": key}
    written: list[dict] = []
    try:
        load_cell_warm = asyncio.run(
            _swap_phase(server.url, headers, queries[:20], 2, [], 1, 1.0, _after(2.0))
        )
        del load_cell_warm
        row: dict = {"documents": n, "datasets": list(ORDER), "clients": args.swap_clients,
                     "new_model": MODEL, "old_max_seq_length": MAX_SEQ_LENGTH,
                     "new_max_seq_length": 256}  # fmt: skip
        wdocs = writer_documents(docs, "swap", 4000, seed=11)
        phases = (("before", wdocs[:1000]), ("during", wdocs[1000:3000]), ("after", wdocs[3000:]))
        for phase, phase_docs in phases:
            before = loadavg()
            if phase == "during":
                import httpx

                started = time.perf_counter()
                r = httpx.post(f"{server.url}/admin/reembed", json={"model": MODEL},
                               headers=headers, timeout=120)  # fmt: skip
                if r.status_code != 202:
                    raise RuntimeError(f"/admin/reembed: {r.status_code} {r.text}")
                until = _swap_done
            else:
                until = _after(args.seconds)
            cell = asyncio.run(
                _swap_phase(server.url, headers, queries, args.swap_clients, phase_docs,
                            args.write_batch, args.write_interval, until)
            )  # fmt: skip
            if phase == "during":
                cell["swap_seconds"] = time.perf_counter() - started
                status = httpx.get(f"{server.url}/admin/reembed", headers=headers).json()
                cell["swap_state"] = status["state"]
                cell["swap_report"] = status.get("report")
            written += phase_docs[: cell["documents_written"]]
            row[phase] = {**cell, "loadavg_before": before, "loadavg_after": loadavg()}
            print(phase, json.dumps(cell), flush=True)
        sample = queries[-50:]
        got = asyncio.run(_fetch_results_with(server.url, sample, 4, 10, headers))
    finally:
        server.stop()
    new = load_model(MODEL)
    fresh = open_store(None, new)
    final = documents[:n] + [Document(d["id"], d["text"], meta=d["meta"]) for d in written]
    index_documents(fresh, new, final)
    # The same ranking up to float-level ties: each hit's score is the fresh index's score of
    # that document, and the k scores are the fresh top-k's (the corpus holds copies and
    # near-copies: the writer's documents are real texts under new ids, cut at 1,000 chars).
    same_ids = same_ranking = 0
    max_diff = 0.0
    for q, hits in zip(sample, got):
        query = encode_texts(new, [q], prompt_name="query")
        want = fresh.search(query, top_k=10)[0]
        unit = query[0] / np.linalg.norm(query[0])
        fresh_of = fresh.vectors([h["id"] for h in hits]) @ unit
        got_scores = np.array([h["score"] for h in hits])
        diff = max(
            float(np.abs(got_scores - fresh_of).max()),
            float(np.abs(np.sort(got_scores) - np.sort([w.score for w in want])).max()),
        )
        max_diff = max(max_diff, diff)
        same_ids += [h["id"] for h in hits] == [w.id for w in want]
        same_ranking += diff <= 1e-4
    row["after_swap"] = {
        "queries": len(sample),
        "identical_top10_ids": same_ids,
        "same_top10_up_to_ties_1e-4": same_ranking,
        "max_score_diff": max_diff,
    }
    return row


def _after(seconds: float):
    deadline = time.perf_counter() + seconds

    async def until(client) -> bool:
        return time.perf_counter() >= deadline

    return until


_SWAP_POLL = {"at": 0.0, "done": False}


async def _swap_done(client) -> bool:
    """Whether the server's model swap has ended (polled at most every half second)."""
    if _SWAP_POLL["done"]:
        return True
    now = time.perf_counter()
    if now - _SWAP_POLL["at"] >= 0.5:
        _SWAP_POLL["at"] = now
        state = (await client.get("/admin/reembed")).json()["state"]
        _SWAP_POLL["done"] = state not in ("running", "loading")
    return _SWAP_POLL["done"]


async def _fetch_results_with(url, queries, clients, k, headers) -> list[list]:
    import asyncio

    import httpx

    sem = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as client:

        async def one(q):
            async with sem:
                r = await client.post("/search", json={"query": q, "k": k})
                return r.json()["results"][0]["hits"]

        return await asyncio.gather(*(one(q) for q in queries))


# -- faults -------------------------------------------------------------------------------------


def hostile_requests(n: int, seed: int = 0) -> list[tuple[str, str, str, bytes, dict]]:
    """``n`` malformed or hostile requests: (expected, method, path, body, headers), of these
    kinds: bad JSON, huge bodies, wrong types, unknown fields, filter injection, deep nesting,
    bad ids and paths, random bytes, lying Content-Length.

    ``expected`` is ``"4xx"`` for every request but the well-formed filters among the
    injections (a value carrying SQL text, ``"x' OR '1'='1"``, or a Mongo-style object,
    ``{"$gt": ""}``): those are valid equality filters whose value is bound as a parameter,
    so they get ``"200-no-hits"`` (no stored document has that value; an injection would
    return hits)."""
    from densefit.retrieval.index.filters import validate_filters

    rng = np.random.default_rng(seed)
    js = {"content-type": "application/json"}
    injections = [
        {"field": "meta.dataset') OR 1=1 --", "operator": "==", "value": "x"},
        {"field": "meta.dataset", "operator": "== 1 OR 1", "value": "x"},
        {"field": "meta.dataset", "operator": "==", "value": "x' OR '1'='1"},
        {"field": 'meta.a"); DROP TABLE documents; --', "operator": "==", "value": 1},
        {"field": "content", "operator": "in", "value": "not a list"},
        {"field": "meta.year", "operator": ">", "value": "next tuesday"},
        {"operator": "AND", "conditions": [{"operator": "NOT", "conditions": "x"}]},
        {"operator": "XOR", "conditions": []},
        {"field": ["meta", "x"], "operator": "==", "value": 1},
        {"field": "meta.x", "operator": "==", "value": {"$gt": ""}},
    ]

    def expected_for(filters: dict) -> str:
        try:
            validate_filters(filters)
        except ValueError:
            return "4xx"
        return "200-no-hits"

    def injection():
        filters = injections[int(rng.integers(len(injections)))]
        body = json.dumps({"query": "x", "filters": filters}).encode()
        return expected_for(filters), "POST", "/search", body, js

    nested = {"field": "meta.x", "operator": "==", "value": 1}
    for _ in range(200):
        nested = {"operator": "AND", "conditions": [nested]}
    kinds = [
        lambda: (
            "POST",
            "/search",
            b'{"query": "x", "k": 10' + b"}" * int(rng.integers(0, 2)) + b"{",
            js,
        ),
        lambda: ("POST", "/search", b"\xff\xfe\x00" + rng.bytes(int(rng.integers(1, 300))), js),
        lambda: ("POST", "/search", b'{"query": "' + b"a" * (5 * 1024 * 1024) + b'"}', js),
        lambda: (
            "POST",
            "/documents",
            json.dumps({"documents": [{"id": "x", "text": "y" * 120_000}]}).encode(),
            js,
        ),
        lambda: ("POST", "/search", json.dumps({"query": 42, "k": "ten"}).encode(), js),
        lambda: ("POST", "/search", json.dumps({"query": ["x"] * 1000}).encode(), js),
        lambda: (
            "POST",
            "/search",
            json.dumps({"query": "x", "k": int(rng.choice([0, -5, 10**9]))}).encode(),
            js,
        ),
        lambda: (
            "POST",
            "/search",
            json.dumps({"query": "x", "k": 1e309 if rng.random() < 0.5 else None})
            .encode()
            .replace(b"Infinity", b"1e999"),
            js,
        ),
        lambda: ("POST", "/search", json.dumps({"query": "x", "unknown": True}).encode(), js),
        injection,
        lambda: ("POST", "/search", json.dumps({"query": "x", "filters": nested}).encode(), js),
        lambda: ("POST", "/search", b"[" * 100_000 + b"]" * 100_000, js),
        lambda: (
            "POST",
            "/documents",
            json.dumps({"documents": [{"id": "", "text": "x"}]}).encode(),
            js,
        ),
        lambda: (
            "POST",
            "/documents",
            json.dumps({"documents": [{"id": "a", "text": "x", "meta": "no"}]}).encode(),
            js,
        ),
        lambda: ("POST", "/documents", json.dumps({"documents": "all of them"}).encode(), js),
        lambda: ("DELETE", "/documents", json.dumps({"ids": "../../store.sqlite"}).encode(), js),
        lambda: ("DELETE", "/documents", b"not json", js),
        lambda: ("GET", "/documents/..%2F..%2Fetc%2Fpasswd", b"", {}),
        lambda: ("GET", "/documents/" + "x" * 5000, b"", {}),
        lambda: ("PUT", "/search", b"{}", js),
        lambda: ("POST", "/search", (b"a" * 65536 for _ in range(100)), js),  # 6.5 MB, chunked
        lambda: ("POST", "/search", b'{"query": "x"}', {"content-type": "text/plain"}),
        lambda: ("POST", "/search", b'{"query": ["x", "bad \\udcff"]}', js),  # not text
        lambda: ("POST", "/documents", b'{"documents": [{"id": "n", "text": "a\\u0000b"}]}', js),
        lambda: ("POST", "/v1/embeddings", b'{"input": [[101, 2023, 102]]}', js),  # token ids
        lambda: ("POST", "/v1/embeddings", b'{"input": "x", "dimensions": 4096}', js),
        lambda: ("POST", "/embed", b'{"inputs": ["\\ud800", "x"]}', js),
        lambda: ("POST", "/embed", json.dumps({"inputs": "y" * 120_000}).encode(), js),
    ]
    out = []
    for _ in range(n):
        made = kinds[int(rng.integers(len(kinds)))]()
        out.append(made if len(made) == 5 else ("4xx", *made))
    return out


def hostile_fault(url: str, n: int) -> dict:
    """Send ``n`` hostile requests; count statuses per expected outcome. What must hold: no
    5xx, every ``4xx`` request refused with a 4xx, every ``200-no-hits`` request (a valid
    filter whose value carries SQL text) answered with no hits (no injection), and /health
    answering afterwards."""
    import httpx

    statuses: dict[str, int] = {}
    by_expected: dict[str, dict[str, int]] = {}
    transport_errors = hits_from_valid = 0
    unexpected: list[dict] = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for expected, method, path, body, headers in hostile_requests(n):
            try:
                r = client.request(method, path, content=body, headers=headers)
                key = str(r.status_code)
                hits = len(r.json()["results"][0]["hits"]) if r.status_code == 200 else 0
                hits_from_valid += hits
                ok = (
                    400 <= r.status_code < 500
                    if expected == "4xx"
                    else r.status_code == 200 and hits == 0
                )
            except httpx.HTTPError as exc:  # e.g. the server closing a connection early
                transport_errors += 1
                key, ok = type(exc).__name__, expected == "4xx"
            statuses[key] = statuses.get(key, 0) + 1
            counts = by_expected.setdefault(expected, {})
            counts[key] = counts.get(key, 0) + 1
            if not ok and len(unexpected) < 20:
                unexpected.append({"expected": expected, "got": key, "path": path})
        health = client.get("/health").status_code
    fivexx = sum(v for k, v in statuses.items() if k.startswith("5"))
    return {
        "requests_sent": n,
        "statuses": statuses,
        "statuses_by_expected": by_expected,
        "expected_4xx": sum(by_expected.get("4xx", {}).values()),
        "expected_200_no_hits": sum(by_expected.get("200-no-hits", {}).values()),
        "5xx": fivexx,
        "transport_errors": transport_errors,
        "hits_returned_by_2xx": hits_from_valid,
        "unexpected": unexpected,
        "health_after": health,
    }


def sigkill_fault(
    server: Server, store_path: Path, docs: dict, threads: int, kill_after: float
) -> dict:
    """Stream acknowledged writes, SIGKILL the server mid-stream, restart it, find them all."""
    import asyncio
    import signal

    import httpx

    new_docs = writer_documents(docs, "kill", 4000, seed=99)
    for i, d in enumerate(new_docs):
        d["text"] = f"{d['text'][:500]} [acknowledged write {i}]"
    acked: list[dict] = []
    sent = 0

    async def stream():
        nonlocal sent
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:

            async def one_writer(offset):
                nonlocal sent
                for start in range(offset, len(new_docs), 4 * 4):
                    batch = new_docs[start : start + 4]
                    sent += 1
                    try:
                        r = await client.post("/documents", json={"documents": batch})
                    except httpx.HTTPError:
                        return
                    if r.status_code == 200:
                        acked.extend(batch)

            async def killer():
                await asyncio.sleep(kill_after)
                server.proc.send_signal(signal.SIGKILL)

            await asyncio.gather(*(one_writer(4 * i) for i in range(4)), killer())

    asyncio.run(stream())
    server.proc.wait(10)
    server.log.close()
    restarted = Server("densefit", store_path, threads)
    found_get = found_search = 0
    try:
        with httpx.Client(base_url=restarted.url, timeout=60) as client:
            for d in acked:
                if client.get(f"/documents/{d['id']}").status_code == 200:
                    found_get += 1
            sample = acked[:: max(1, len(acked) // 200)]
            for d in sample:
                hits = client.post("/search", json={"query": d["text"], "k": 10}).json()
                found_search += d["id"] in [h["id"] for h in hits["results"][0]["hits"]]
    finally:
        restarted.stop()
    return {
        "write_requests_sent": sent,
        "acknowledged_documents": len(acked),
        "found_after_restart": found_get,
        "searched_sample": len(sample) if acked else 0,
        "found_by_search": found_search,
    }


# -- scale: 1M vectors --------------------------------------------------------------------------


def scale_point(
    model, documents: list, vectors: np.ndarray, queries: list[str], rows: int, n_queries: int
) -> list[dict]:
    """In-process search latency at 15k and ``rows`` vectors, unfiltered and filtered."""
    from densefit.data.types import Document
    from densefit.retrieval.encode import encode_texts
    from densefit.retrieval.index import LocalDocumentStore

    path = CACHE / f"store-{rows}"
    real = len(documents)
    if not (path / "store.sqlite").exists() or LocalDocumentStore(path).count() != rows:
        build_store(path, model, documents, vectors)
        rng = np.random.default_rng(0)
        with LocalDocumentStore(path) as store:
            for start in range(real, rows, 50_000):
                n = min(50_000, rows - start)
                rand = rng.standard_normal((n, vectors.shape[1]), dtype=np.float32)
                rand /= np.linalg.norm(rand, axis=1, keepdims=True)
                batch = [
                    Document(
                        f"random/{start + i}",
                        f"random vector {start + i}",
                        "",
                        {"dataset": "random"},
                    )
                    for i in range(n)
                ]
                store.write(batch, rand)
                print(f"scale store: {start + n} rows", flush=True)
    q = encode_texts(model, queries[:n_queries])
    filters = {
        "none": None,
        "scifact (5k)": {"field": "meta.dataset", "operator": "==", "value": "scifact"},
        "not random": {"field": "meta.dataset", "operator": "!=", "value": "random"},
        "random (most)": {"field": "meta.dataset", "operator": "==", "value": "random"},
    }
    out = []
    small = CACHE / "store-real"
    build_store(small, model, documents, vectors)
    for label, store_path, indexed in (
        ("real", small, False),
        ("scale", path, False),
        ("scale", path, True),
    ):
        if not indexed:  # a rerun finds the index made last time: measure without it first
            import sqlite3

            from densefit.retrieval.index.sqlite_filters import meta_index_sql

            with sqlite3.connect(store_path / "store.sqlite") as conn:
                conn.execute(f'DROP INDEX IF EXISTS "{meta_index_sql("meta.dataset")[0]}"')
        with LocalDocumentStore(store_path) as store:
            count = store.count()
            if indexed:  # SQLite index on meta.dataset: == filters look rows up
                store.index_meta_field("meta.dataset")
            for name, flt in filters.items():
                if indexed and flt is None:
                    continue
                if flt is not None and flt["value"] == "random" and label == "real":
                    continue
                store.search(q[:1], top_k=10, filters=flt)  # warm
                lat = []
                for row in q:
                    t0 = time.perf_counter()
                    store.search(row[None], top_k=10, filters=flt)
                    lat.append((time.perf_counter() - t0) * 1000)
                matches = store.count_matching(flt)
                out.append(
                    {
                        "rows": count,
                        "filter": name + (" +index" if indexed else ""),
                        "matches": matches,
                        "p50_ms": float(np.median(lat)),
                        "p99_ms": float(np.percentile(lat, 99)),
                        "queries": len(lat),
                    }
                )
                print(
                    f"scale {count} rows, filter {name}: p50 {out[-1]['p50_ms']:.1f} ms", flush=True
                )
    return out


# -- results ------------------------------------------------------------------------------------


def versions() -> dict:
    """Versions of what the servers run, and the densefit commit."""
    import importlib.metadata as md
    import platform
    import subprocess

    out = {"python": platform.python_version()}
    for dist in (
        "torch",
        "transformers",
        "sentence-transformers",
        "tokenizers",
        "fastapi",
        "uvicorn",
        "pydantic",
        "httpx",
        "faiss-cpu",
        "haystack-ai",
        "numpy",
        "onnxruntime",  # the densefit:RUNTIME servers' runtimes
        "openvino",
    ):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        out["densefit_commit"] = commit + ("+uncommitted changes" if dirty else "")
    except OSError:
        out["densefit_commit"] = None
    return out


def machine(threads: int) -> dict:
    """The machine and the thread settings of this run."""
    import torch

    from densefit.serve.config import ServeConfig, worker_threads

    config = ServeConfig()
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "threads_per_server": threads,
        "server_env": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)},
        "densefit_query_workers": config.query_workers,
        "densefit_torch_threads_per_worker": worker_threads(config, threads),
        "densefit_max_wait_ms": config.max_wait_ms,
        "load_client": "one process, asyncio + httpx",
        "torch_threads_in_client": torch.get_num_threads(),
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def wait_until_quiet(threshold: float, poll_s: float, max_wait_s: float) -> dict:
    """Poll the 1-minute load average until it is below ``threshold`` (every ``poll_s``
    seconds, at most ``max_wait_s``); what was seen is recorded with the results."""
    start = time.monotonic()
    polls = []
    while True:
        polls.append(loadavg())
        if polls[-1][0] < threshold:
            quiet = True
            break
        if time.monotonic() - start + poll_s > max_wait_s:
            quiet = False
            break
        print(f"load {polls[-1]}: waiting for < {threshold}", flush=True)
        time.sleep(poll_s)
    return {
        "threshold_1m": threshold,
        "quiet": quiet,
        "waited_s": round(time.monotonic() - start, 1),
        "polls": polls,
    }


def write_results(result: dict) -> None:
    import csv

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serve.json").write_text(json.dumps(result, indent=2))
    for name, rows in (("serve.csv", result.get("load", [])),
                       ("serve_embeddings.csv", result.get("embeddings", []))):  # fmt: skip
        if rows:
            with open(RESULTS / name, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
    plot(result)


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("load", [])
    scale = result.get("scale", [])
    fig, axes = plt.subplots(1, 6, figsize=(31, 4.5))
    systems = sorted(
        {r["system"] for r in rows}, key=lambda s: (SYSTEMS.index(s.partition(":")[0]), s)
    )
    for ax, metric, title in (
        (axes[0], "qps", "queries/s (higher is better)"),
        (axes[1], "p99_ms", "p99 latency ms (lower is better)"),
        (axes[3], "queries_per_server_cpu_s", "queries per server CPU second (shared machine)"),
    ):
        width = 0.8 / max(1, 2 * len(systems))
        clients = sorted({r["clients"] for r in rows})
        for i, system in enumerate(systems):
            for j, writer in enumerate((False, True)):
                vals = [
                    next(
                        (
                            r[metric]
                            for r in rows
                            if r["system"] == system and r["clients"] == c and r["writer"] == writer
                        ),
                        0,
                    )
                    or 0
                    for c in clients
                ]
                xs = np.arange(len(clients)) + (2 * i + j) * width
                ax.bar(
                    xs,
                    vals,
                    width,
                    label=None if writer else system,
                    hatch="//" if writer else None,
                    color=f"C{i}",
                    alpha=0.6 if writer else 1,
                )
        ax.set_xticks(np.arange(len(clients)) + 0.4 - width / 2, [f"{c} clients" for c in clients])
        ax.set_title(title)
        if metric == "p99_ms":
            ax.set_yscale("log")
    # One legend under the three load panels: a colour per system, hatched with a writer.
    from matplotlib.patches import Patch

    handles, _ = axes[0].get_legend_handles_labels()
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="+ writer"))
    fig.legend(handles=handles, loc="lower left", ncol=len(handles), fontsize=8, frameon=False)
    if scale:
        for f in sorted({s["filter"] for s in scale}):
            pts = sorted((s["rows"], s["p50_ms"]) for s in scale if s["filter"] == f)
            axes[2].plot(*zip(*pts), marker="o", label=f)
        axes[2].set_xscale("log")
        axes[2].set_yscale("log")
        axes[2].set_xlabel("vectors in the store")
        axes[2].set_title("in-process search p50 ms (1 query)")
        axes[2].legend(fontsize=7)
    embeds = result.get("embeddings", [])
    if embeds:
        points = sorted({(r["inputs_per_request"], r["clients"]) for r in embeds})
        names = sorted({r["system"] for r in embeds})
        width = 0.8 / len(names)
        for i, system in enumerate(names):
            vals = [
                next(
                    (
                        r["texts_per_s"]
                        for r in embeds
                        if r["system"] == system and (r["inputs_per_request"], r["clients"]) == p
                    ),
                    0,
                )
                for p in points
            ]
            axes[4].bar(
                np.arange(len(points)) + i * width, vals, width, label=system, color=f"C{i}"
            )
        axes[4].set_xticks(
            np.arange(len(points)) + 0.4 - width / 2,
            [f"{n} in/req\n{c} clients" for n, c in points],
            fontsize=7,
        )
        axes[4].set_title("/v1/embeddings texts/s (higher is better)")
        axes[4].legend(fontsize=7)
    swap = result.get("swap")
    if swap:
        phases = ("before", "during", "after")
        xs = np.arange(len(phases))
        for offset, metric, label in ((-0.2, "p50_ms", "p50"), (0.2, "p99_ms", "p99")):
            axes[5].bar(xs + offset, [swap[p][metric] or 0 for p in phases], 0.4, label=label)
        axes[5].set_xticks(
            xs,
            [f"{p}\n{swap[p]['searches']:,} searches\n{swap[p]['errors']} errors" for p in phases],
            fontsize=7,
        )
        axes[5].set_title(
            f"search latency ms through a model swap ({swap['documents']:,} docs, "
            f"{swap['clients']} clients + writer)",
            fontsize=9,
        )
        axes[5].legend(fontsize=7)
    load_run = (result.get("load_settings") or {}).get("run")
    run = next((r for r in result.get("runs", []) if r["id"] == load_run), {})
    m = run.get("machine", {})
    loads = [r["loadavg_before"][0] for r in rows if "loadavg_before" in r]
    load_text = f"1-min load {min(loads):.2f}-{max(loads):.2f}" if loads else "load ?"
    fig.suptitle(
        f"densefit serve vs peers, all-MiniLM-L6-v2, {result.get('documents', '?')} docs; "
        f"{m.get('threads_per_server')} thread(s)/server, {m.get('cpus')} shared CPUs, "
        f"{load_text}; {run.get('started', '')}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))  # room for the legend at the bottom
    fig.savefig(RESULTS / "serve.png", dpi=110)


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    import asyncio
    import shlex

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="only embed and cache")
    parser.add_argument("--server", help=argparse.SUPPRESS)  # a server process: its system
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--store", type=Path, default=CACHE / "store-bench")
    parser.add_argument(
        "--systems",
        default="densefit,densefit:auto,densefit:onnx,densefit:openvino,densefit:openvino-int8,"
        "handwritten,haystack",
        help="densefit:R: the densefit server with --runtime R (the model exported for it)",
    )
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument(
        "--writer", default="off,on", help="cells without and/or with the concurrent writer"
    )
    parser.add_argument("--write-batch", type=int, default=8)
    parser.add_argument(
        "--write-interval", type=float, default=2.0, help="seconds between write batches"
    )
    parser.add_argument("--hostile", type=int, default=1000)
    parser.add_argument("--kill-after", type=float, default=8.0)
    parser.add_argument("--equality-queries", type=int, default=200)
    parser.add_argument("--scale-rows", type=int, default=1_000_000)
    parser.add_argument("--scale-queries", type=int, default=50)
    parser.add_argument(
        "--quiet-load",
        type=float,
        default=1.5,
        help="wait until the 1-minute load average is below this before starting (0: no wait)",
    )
    parser.add_argument("--quiet-poll", type=float, default=30.0, help="seconds between polls")
    parser.add_argument("--quiet-max-wait", type=float, default=1200.0, help="then run anyway")
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--skip-faults", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--skip-embeddings", action="store_true")
    parser.add_argument("--skip-swap", action="store_true")
    parser.add_argument("--swap-only", action="store_true", help="only the model-swap point")
    parser.add_argument("--swap-docs", type=int, default=3000)
    parser.add_argument("--swap-clients", type=int, default=4)
    parser.add_argument(
        "--embed-inputs", default="1,32", help="texts per /v1/embeddings request, one cell each"
    )
    parser.add_argument("--embed-systems", default="densefit,handwritten")
    parser.add_argument("--equality-only", action="store_true", help="only the equality check")
    parser.add_argument("--plot-only", action="store_true", help="redraw serve.png from serve.json")
    args = parser.parse_args()
    for system in [*args.systems.split(","), *args.embed_systems.split(",")]:
        if error := system_error(system):
            parser.error(f"--systems / --embed-systems: {error}")
    if args.server:
        run_server_process(args.server, args.port, args.store)
        return
    if args.plot_only:
        plot(json.loads((RESULTS / "serve.json").read_text()))
        return
    model, docs, queries, embeddings = prepare(DATASETS, CACHE)
    if args.prepare:
        return
    documents, vectors = all_documents(docs, embeddings)
    qs = query_list(queries, 3000)
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    previous = (
        json.loads((RESULTS / "serve.json").read_text())
        if (RESULTS / "serve.json").exists()
        else {}
    )
    if "runs" not in previous:  # results from before run records: not carried over
        previous = {}
    run_id = max((r["id"] for r in previous.get("runs", [])), default=-1) + 1
    run = {
        "id": run_id,
        "command": shlex.join(["python", *sys.argv]),
        "env": {
            k: os.environ.get(k)
            for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "BENCH_SERVE_DATASETS")
        },
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": machine(threads),
        "versions": versions(),
        "quiet_wait": None,
        "parts": [],
    }
    if args.quiet_load > 0:
        run["quiet_wait"] = wait_until_quiet(args.quiet_load, args.quiet_poll, args.quiet_max_wait)
    run["loadavg_start"] = loadavg()
    result = {
        "note": "shared 2-core machine: the load client runs on the same cores as the server; "
        "compare systems within one run only (each row records the load average around it)",
        # the load part's; a run without it may read fewer datasets (BENCH_SERVE_DATASETS),
        # and its parts record their own
        "documents": previous.get("documents", len(documents))
        if args.swap_only or args.skip_load
        else len(documents),
        "model": MODEL,
        "max_seq_length": MAX_SEQ_LENGTH,
        "load_settings": previous.get("load_settings"),
        "load": previous.get("load", []),
        "ratios_densefit_over_handwritten": previous.get("ratios_densefit_over_handwritten"),
        "equality": previous.get("equality"),
        "agreement_with_densefit": previous.get("agreement_with_densefit"),
        "faults": previous.get("faults"),
        "scale": previous.get("scale", []),
        "embeddings_settings": previous.get("embeddings_settings"),
        "embeddings": previous.get("embeddings", []),
        "swap": previous.get("swap"),
        "embedding_vectors": previous.get("embedding_vectors"),
        "ratios_embeddings_densefit_over_handwritten": previous.get(
            "ratios_embeddings_densefit_over_handwritten"
        ),
        "runs": previous.get("runs", []) + [run],
    }

    def save() -> None:
        run["loadavg_end"] = loadavg()
        run["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        used = {r.get("run") for r in result["load"] + result["scale"] + result["embeddings"]}
        used |= {
            (result[k] or {}).get("run")
            for k in ("equality", "faults", "load_settings", "embeddings_settings", "swap")
        }
        result["runs"] = [r for r in result["runs"] if r["id"] in used or r is run]
        write_results(result)

    clients = [int(c) for c in args.clients.split(",")]
    if args.swap_only or not args.skip_swap:
        run["parts"].append("swap")
        swap_store = args.store.with_name(args.store.name + "-swap")
        result["swap"] = {
            "run": run_id,
            **swap_point(swap_store, model, documents, vectors, docs, qs, args, threads),
        }
        save()
        if args.swap_only:
            print(summary(result))
            return
    if args.equality_only:
        run["parts"].append("equality")
        build_store(args.store, model, documents, vectors)
        server = Server("densefit", args.store, threads)
        try:
            result["equality"] = equality_check(
                server.url, args.store, model, qs[-args.equality_queries :]
            )
            result["equality"]["run"] = run_id
        finally:
            server.stop()
        print("equality:", result["equality"], flush=True)
        save()
        return
    if not args.skip_load:
        run["parts"].append("load")
        writers = [{"off": False, "on": True}[w] for w in args.writer.split(",")]
        result["load_settings"] = {
            "run": run_id,
            "systems": args.systems.split(","),
            "clients": clients,
            "seconds_per_cell": args.seconds,
            "writer": args.writer.split(","),
            "write_batch": args.write_batch,
            "write_interval_s": args.write_interval,
            "queries_k": 10,
        }
        runtimes = [r for r in map(system_runtime, args.systems.split(",")) if r]
        if "auto" in runtimes:  # densefit:auto chooses among every export
            from densefit.choices import EXPORT_TARGETS

            runtimes = list(EXPORT_TARGETS)
        if runtimes:
            result["load_settings"]["exports"] = prepare_runtimes(runtimes)
        result["load"] = []
        top_ids: dict[str, list] = {}
        for system in args.systems.split(","):
            build_store(args.store, model, documents, vectors)
            server = Server(system, args.store, threads)
            try:
                load_cell(server.url, qs[:50], 4, 2.0, False, [], 1)  # warm up
                top_ids[system] = [
                    [h["id"] for h in hits]
                    for hits in asyncio.run(
                        _fetch_results(server.url, qs[-args.equality_queries :], 4, 10)
                    )
                ]
                if is_densefit(system):  # what embeds its queries (auto: each one's timing)
                    import httpx

                    health = httpx.get(f"{server.url}/health", timeout=10).json()
                    result["load_settings"].setdefault("query_runtime", {})[system] = {
                        "runtime": health["runtime"],
                        "runtime_ms": health["runtime_ms"],
                    }
                if system == "densefit":
                    result["equality"] = equality_check(
                        server.url, args.store, model, qs[-args.equality_queries :]
                    )
                    result["equality"]["run"] = run_id
                    print("equality:", result["equality"], flush=True)
                for writer in writers:
                    for c in clients:
                        wdocs = writer_documents(docs, system, 4000, seed=c) if writer else []
                        before = loadavg()
                        cpu_before = server_cpu(server)
                        client_before = os.times()
                        cell = load_cell(
                            server.url,
                            qs,
                            c,
                            args.seconds,
                            writer,
                            wdocs,
                            args.write_batch,
                            args.write_interval,
                        )
                        client_after = os.times()
                        cpu = server_cpu(server) - cpu_before
                        cell["server_cpu_s"] = cpu
                        cell["queries_per_server_cpu_s"] = cell["queries"] / cpu if cpu else None
                        cell["client_cpu_s"] = (client_after.user + client_after.system) - (
                            client_before.user + client_before.system
                        )
                        row = {
                            "run": run_id,
                            "system": system,
                            "clients": c,
                            "writer": writer,
                            **cell,
                            "loadavg_before": before,
                            "loadavg_after": loadavg(),
                        }
                        result["load"].append(row)
                        print(json.dumps(row), flush=True)
                        save()
            finally:
                server.stop()
        result["agreement_with_densefit"] = {
            "run": run_id,
            "queries": args.equality_queries,
            "mean_top10_overlap": {
                system: float(
                    np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, top_ids["densefit"])])
                )
                for system, ids in top_ids.items()
                if "densefit" in top_ids and system != "densefit"
            },
        }
        result["ratios_densefit_over_handwritten"] = ratios(result["load"])
    if not args.skip_faults:
        run["parts"].append("faults")
        build_store(args.store, model, documents, vectors)
        server = Server("densefit", args.store, threads)
        try:
            hostile = hostile_fault(server.url, args.hostile)
            print("hostile:", hostile, flush=True)
        except BaseException:
            server.stop()
            raise
        kill = sigkill_fault(server, args.store, docs, threads, args.kill_after)
        print("sigkill:", kill, flush=True)
        result["faults"] = {"run": run_id, "hostile": hostile, "sigkill": kill}
        save()
    if not args.skip_embeddings:
        run["parts"].append("embeddings")
        inputs = [int(n) for n in args.embed_inputs.split(",")]
        systems = args.embed_systems.split(",")
        result["embeddings_settings"] = {
            "run": run_id,
            "systems": systems,
            "clients": clients,
            "inputs_per_request": inputs,
            "seconds_per_cell": args.seconds,
            "datasets": list(ORDER),
            "documents": len(documents),
            "encoding_format": "base64",
        }
        doc_texts = [d.text for d in documents[:: max(1, len(documents) // 2000)]]
        result["embeddings"], result["embedding_vectors"] = [], {"run": run_id}
        for system in systems:
            if is_densefit(system):
                build_store(args.store, model, documents, vectors)
            server = Server(system, args.store, threads)
            try:
                embed_cell(server.url, doc_texts, 4, 2.0, 8)  # warm up
                result["embedding_vectors"][system] = embedding_check(
                    server.url, model, doc_texts[:64]
                )
                for n in inputs:
                    texts = qs if n == 1 else doc_texts
                    for c in clients:
                        before, cpu_before = loadavg(), server_cpu(server)
                        cell = embed_cell(server.url, texts, c, args.seconds, n)
                        cell["server_cpu_s"] = server_cpu(server) - cpu_before
                        row = {
                            "run": run_id,
                            "system": system,
                            "clients": c,
                            "inputs_per_request": n,
                            **cell,
                            "loadavg_before": before,
                            "loadavg_after": loadavg(),
                        }
                        result["embeddings"].append(row)
                        print(json.dumps(row), flush=True)
                        save()
            finally:
                server.stop()
        result["ratios_embeddings_densefit_over_handwritten"] = embedding_ratios(
            result["embeddings"]
        )
        save()
    if not args.skip_scale:
        run["parts"].append("scale")
        result["scale"] = [
            {"run": run_id, **row}
            for row in scale_point(
                model, documents, vectors, qs, args.scale_rows, args.scale_queries
            )
        ]
    save()
    print(summary(result))


def ratios(rows: list[dict]) -> list[dict]:
    """Each densefit system / handwritten: queries per second and p99 at each (clients,
    writer) point."""
    out = []
    for d in (r for r in rows if is_densefit(r["system"])):
        h = next(
            (
                r
                for r in rows
                if r["system"] == "handwritten"
                and r["clients"] == d["clients"]
                and r["writer"] == d["writer"]
            ),
            None,
        )
        if h is None or not h["qps"]:
            continue
        out.append(
            {
                "system": d["system"],
                "clients": d["clients"],
                "writer": d["writer"],
                "qps_ratio": d["qps"] / h["qps"],
                "densefit_p99_ms": d["p99_ms"],
                "handwritten_p99_ms": h["p99_ms"],
                "p99_ratio": (d["p99_ms"] / h["p99_ms"]) if d["p99_ms"] and h["p99_ms"] else None,
            }
        )
    return out


def summary(result: dict) -> str:
    lines = []
    for r in result.get("load", []):
        lines.append(
            f"{r['system']:12s} clients={r['clients']:2d} writer={r['writer']!s:5s} "
            f"qps={r['qps']:7.1f} p50={r['p50_ms'] or 0:8.1f} ms p99={r['p99_ms'] or 0:8.1f} ms "
            f"writes_acked={r['writes_acked']}"
        )
    for r in result.get("embeddings", []):
        lines.append(
            f"{r['system']:12s} clients={r['clients']:2d} /v1/embeddings x{r['inputs_per_request']:<3d}"
            f" texts/s={r['texts_per_s']:7.1f} p50={r['p50_ms'] or 0:8.1f} ms "
            f"p99={r['p99_ms'] or 0:8.1f} ms errors={r['errors']}"
        )
    swap = result.get("swap")
    if swap:
        for phase in ("before", "during", "after"):
            p = swap[phase]
            lines.append(
                f"swap {phase:6s} searches={p['searches']} errors={p['errors']} "
                f"qps={p['qps']:.1f} p99={p['p99_ms'] or 0:.1f} ms written={p['documents_written']}"
            )
        lines.append(f"swap: after it, vs a fresh index {json.dumps(swap['after_swap'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
