"""Options several commands take, each declared once (:func:`~densefit.config.options.shared`).

``model: str | None = MODEL()`` in a class gives it the one ``--model`` declaration: the same
flag, help and default in ``train``, ``index``, ``search``, ``eval``, ``serve``... The checks
these options run live here too (:func:`check_device`).
"""

from __future__ import annotations

import re

from densefit.choices import (
    AUTO_PRECISION,
    FUSIONS,
    ON_BAD_ROW,
    PRECISION_CHOICES,
    RUNTIME_CHOICES,
    SEARCH_BACKENDS,
    SEARCH_MODES,
    VECTOR_KINDS,
)
from densefit.config.options import shared

__all__ = [
    "BACKEND",
    "DEFAULT_MODEL",
    "DEFAULT_RESCORE",
    "DENSE_WEIGHT",
    "DEVICE",
    "DEVICES",
    "DIM",
    "DOCUMENT_PROMPT",
    "ENCODE_BATCH_SIZE",
    "FUSION",
    "FUSION_DEPTH",
    "JSON",
    "MAX_SEQ_LENGTH",
    "MODEL",
    "NPROC",
    "ON_BAD_ROW_OPTION",
    "OUTPUT",
    "PRECISION",
    "PROGRESS",
    "QUERY_PROMPT",
    "RESCORE",
    "RRF_K",
    "SEARCH_MODE",
    "RUNTIME",
    "SPLIT",
    "SEARCH_TOP_K",
    "SEED",
    "STORE",
    "TOP_K",
    "VECTORS",
    "check_device",
    "model_or_default",
]

# The model a command uses when none is given and no store names one: packaged, no download.
DEFAULT_MODEL = "all-MiniLM-L6-v2"


def model_or_default(model: str | None, store_model: str | None = None) -> str:
    """The model a command runs: the one given, else the store's, else :data:`DEFAULT_MODEL`.

    >>> model_or_default(None), model_or_default(None, "runs/m"), model_or_default("x", "y")
    ('all-MiniLM-L6-v2', 'runs/m', 'x')
    """
    return model or store_model or DEFAULT_MODEL


_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")


def check_device(device: str | None) -> str | None:
    """``device`` as a device name (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``),
    lower-cased; ``ValueError`` naming the choices. Whether the device is present is asked
    when a model is loaded (:func:`densefit.models.resolve_device`), not here: building an
    option object never imports torch.

    >>> check_device("CPU"), check_device(None), check_device("cuda:1")
    ('cpu', None, 'cuda:1')
    """
    if device is None:
        return None
    text = str(device).strip().lower()
    if not _DEVICE.fullmatch(text):
        raise ValueError(f"must be one of {', '.join(DEVICES)}, got {device!r}")
    return text


MODEL = shared(
    None,
    "Model: a sentence-transformers folder or name. Default: the store's model when the "
    f"command reads a store, else {DEFAULT_MODEL} (packaged: no download); reembed: the "
    "model to swap the store to.",
    flag="--model",
    short="-m",
    metavar="NAME|DIR",
)
DEVICE = shared(
    "auto",
    "auto: the GPU (cuda) when torch sees one, else the CPU; or cpu, cuda, cuda:N, mps.",
    check=check_device,
    metavar="|".join(DEVICES),
    group="Device",
    affects_weights=False,
    run_flag=True,
)
NPROC = shared(
    None,
    "Run N processes on this machine (launches torchrun; each on its own GPU, cuda:LOCAL_RANK, "
    "when the device is cuda, as auto picks on a GPU machine); or start the command with "
    "torchrun yourself.",
    ge=1,
    group="Several processes",
)
MAX_SEQ_LENGTH = shared(
    None,
    "Truncate texts to this many tokens; default: the model's own. Above the model's limit "
    "(its position embeddings) is an error.",
    ge=1,
    group="Embedding",
    run_flag=True,
)
QUERY_PROMPT = shared(
    None,
    'Text put before every query (in training: the anchors), e.g. "query: "; a trained model '
    'saves it as its "query" prompt, a store records it. Default: the model\'s own, else '
    'none; "" for none.',
    metavar="TEXT",
    group="Embedding",
)
DOCUMENT_PROMPT = shared(
    None,
    'Text put before every document (in training: positives, negatives), e.g. "passage: "; '
    'a trained model saves it as its "document" prompt, a store records it. Default: the '
    'model\'s own, else none; "" for none.',
    metavar="TEXT",
    group="Embedding",
)
DIM = shared(
    None,
    "Matryoshka: cut every vector to its first DIM coordinates, re-normalised (for a model "
    "trained with --matryoshka-dims); a store records it. Default: the full size (reading "
    "a store: the store's).",
    ge=1,
    group="Embedding",
)
ENCODE_BATCH_SIZE = shared(
    64,
    "Texts per forward pass when embedding (not training).",
    ge=1,
    group="Embedding",
)
RUNTIME = shared(
    "auto",
    "What runs the model when embedding: auto (the fastest runtime exported for the model's "
    "current weights whose check passed and whose vectors may meet the store's, else "
    "torch; serve times each at one query when it starts and takes the fastest), torch, "
    "onnx (fp32, exported in memory when no file is), or a file written by densefit export: "
    "onnx-int8, openvino, openvino-int8.",
    choices=RUNTIME_CHOICES,
    group="Embedding",
    affects_weights=False,
    plan=False,
)
PRECISION = shared(
    "auto",
    "Number format of the model when embedding with the torch runtime: fp32, fp16 or bf16 "
    "(half the memory; on a GPU faster; checked against fp32 on probe texts); auto: the "
    "store's when adding documents to one, else "
    + (
        ", ".join(f"{value} on {device}" for device, value in AUTO_PRECISION.items())
        if len(set(AUTO_PRECISION.values())) > 1
        else next(iter(AUTO_PRECISION.values()))
    )
    + ". A store records it; queries of any precision search it.",
    choices=PRECISION_CHOICES,
    group="Embedding",
    affects_weights=False,
    plan=False,
)
BACKEND = shared(
    None,
    "Vector search (default: the engine's own, exact for a folder, hnsw for PostgreSQL and "
    "Qdrant): exact; faiss (HNSW32) or faiss:FACTORY, e.g. faiss:IVF4096,Flat, for a folder; "
    "hnsw for PostgreSQL and Qdrant.",
    metavar="|".join(SEARCH_BACKENDS) + "|faiss:FACTORY",
)
PROGRESS = shared(
    True,
    "Show progress bars (on a terminal; --progress also when writing to a file).",
    flag="--progress/--no-progress",
    affects_weights=False,
    plan=False,
)
ON_BAD_ROW_OPTION = shared(
    "error",
    "error: stop at the first bad data row (file:line); skip: skip and report each.",
    choices=ON_BAD_ROW,
)
JSON = shared(False, "Print JSON instead of a table.", flag="--json")
STORE = shared(
    None,
    "The store: a folder (the embedded store; densefit index creates it), "
    "postgresql://USER@HOST/DATABASE/TABLE (PostgreSQL + pgvector), "
    "qdrant://HOST:PORT/COLLECTION or qdrant:FOLDER (Qdrant), "
    "milvus://HOST:PORT/COLLECTION or milvus:FILE.db (Milvus, Milvus Lite).",
    flag="--store",
    short="-s",
    metavar="STORE",
)
COMMIT_EVERY = shared(
    1024,
    "Documents per transaction (reembed: new vectors per commit): a crash loses at most this many.",
    ge=1,
)
LOCK_TIMEOUT = shared(
    3600.0,
    "Seconds to wait for another process writing to the same store (reembed: for another "
    "model swap of it).",
    ge=0,
)
OUTPUT = shared(
    None,
    "Where the command writes its result (train: the model folder; mine: a JSON Lines "
    "file; eval: a copy of the JSON; export: the model folder to write into, default the "
    "model's own; run: the run folder, default runs/<config name>).",
    flag="--output",
    short="-o",
)
SEARCH_TOP_K = 10  # results of a search that names no --top-k
TOP_K = shared(
    None,
    f"Documents retrieved per query; default: {SEARCH_TOP_K} for a search, the largest "
    "metric cutoff for an evaluation (100 for recall@100).",
    flag="--top-k",
    short="-k",
    ge=1,
)
SEED = shared(
    42,
    "Seed of the randomness (training: the data order and dropout; mining: --sampling random).",
)
SPLIT = shared(
    None,
    "qrels split of a BEIR folder; default: train when training or mining, test when evaluating.",
)


# -- how a store is searched: the mode, the fusion of a hybrid search, the vector kind ------

_RANKING = "Ranking"
SEARCH_MODE = shared(
    "dense",
    "How documents are ranked: dense (the model's embeddings), bm25 (BM25 over the "
    "documents' texts: exact words, codes, names; the model does not run) or hybrid (both, "
    "fused by --fusion; a filter applies to both sides before fusion).",
    flag="--mode",
    choices=SEARCH_MODES,
    group=_RANKING,
)
FUSION = shared(
    "rrf",
    "How --mode hybrid fuses the dense and BM25 rankings: rrf (reciprocal rank, "
    "1 / (--rrf-k + rank) summed over both) or weighted (each side's scores min-max "
    "normalised, then --dense-weight x dense + (1 - --dense-weight) x BM25).",
    choices=FUSIONS,
    group=_RANKING,
)
RRF_K = shared(60, "Reciprocal rank fusion's constant (--fusion rrf).", ge=0, group=_RANKING)
DENSE_WEIGHT = shared(
    0.5,
    "The dense side's weight in --fusion weighted (BM25 gets 1 minus it).",
    ge=0,
    le=1,
    group=_RANKING,
)
FUSION_DEPTH = shared(
    100,
    "Documents each side of a hybrid search ranks before fusion (at least --top-k).",
    ge=1,
    group=_RANKING,
)
DEFAULT_RESCORE = 4  # candidates per result an int8 or binary store rescores
RESCORE = shared(
    None,
    "int8 and binary stores: rescore RESCORE x top-k candidates, found by the codes in "
    f"memory, against the float32 vectors on disk; default {DEFAULT_RESCORE} (more: closer "
    "to an exact float32 search, slower).",
    ge=1,
    group=_RANKING,
)
VECTORS = shared(
    "float32",
    "Vector kind of a new store: float32, float16, int8 (4x smaller than float32) or binary "
    "(sign bits, 32x smaller); int8 and binary search codes in memory and rescore the best "
    "candidates against float32 vectors kept on disk (see --rescore). A store keeps its kind.",
    choices=VECTOR_KINDS,
)
