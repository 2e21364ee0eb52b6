"""The vocabularies every option draws its choices from: declared once, at the bottom layer.

The modules that implement a choice (the losses, the memory strategies, the gather modes of
several processes, the mining methods...) import their names from here, and the options that
offer them (:mod:`densefit.config` and the other option declarations) list them from here,
so a name is spelt one way everywhere: in flags, YAML keys, saved models, stores and docs.
Nothing here imports anything but the standard library.
"""

from __future__ import annotations

import re

__all__ = [
    "AMP",
    "AUTO_PRECISION",
    "DEFAULT_INT8_RECIPES",
    "DEFAULT_METRICS",
    "EMBED_PROMPTS",
    "EXPORT_TARGETS",
    "FUSIONS",
    "GATHER_MODES",
    "INT8_RECIPES",
    "LOSSES",
    "MEMORY_STRATEGIES",
    "METRIC_KINDS",
    "MINE_METHODS",
    "MINE_SAMPLING",
    "ON_BAD_ROW",
    "ON_CHECK_FAILURE",
    "PRECISIONS",
    "PRECISION_CHOICES",
    "RUNTIMES",
    "RUNTIME_CHOICES",
    "SEARCH_BACKENDS",
    "SEARCH_MODES",
    "SIMILARITIES",
    "TRAINING_EVAL_RUNTIMES",
    "VECTOR_KINDS",
    "SOURCE_BATCHES",
    "SOURCE_SAMPLING",
    "TRACKERS",
    "embeds",
    "parse_metric",
    "reads_texts",
    "search_mode",
]

# How two embeddings are scored: sentence-transformers' `similarity_fn_name` values that
# densefit trains with and searches by. A trained model saves its similarity under that name
# and a store reads it back from there.
SIMILARITIES = ("cosine", "dot")
LOSSES = ("mnrl", "margin_mse")
# Memory strategies of one optimizer step (densefit.memory); the options add "auto" (planned).
MEMORY_STRATEGIES = ("plain", "checkpoint", "cache", "cache+checkpoint")
# Several processes: which embeddings every rank gathers (densefit.training.distributed).
GATHER_MODES = ("none", "candidates", "both")
AMP = (None, "bf16", "fp16")
MINE_METHODS = ("bm25", "dense", "hybrid")
MINE_SAMPLING = ("top", "random")
ON_BAD_ROW = ("error", "skip")
# How a store keeps its vectors (densefit.retrieval.index.vectors): float32 and float16 are
# searched as they are; int8 (4x smaller than float32) and binary (sign bits, 32x smaller)
# are searched in memory for candidates that are then rescored against float32 vectors kept
# on disk (densefit.retrieval.index.quantized).
VECTOR_KINDS = ("float32", "float16", "int8", "binary")
# What a search ranks by: the embeddings, BM25 over the texts, or both fused
# (densefit.retrieval.fusion), by reciprocal rank ("rrf") or by normalised scores ("weighted").
SEARCH_MODES = ("dense", "bm25", "hybrid")
# What each mode ranks by (mining's methods share the names): (query embeddings, query texts).
# The one place that decides whether a mode runs the model on the queries.
_MODE_INPUTS = {"dense": (True, False), "bm25": (False, True), "hybrid": (True, True)}
# How the vectors are searched (each engine offers some: densefit.retrieval.index.engines):
# every vector compared ("exact"), FAISS (the embedded store: "faiss" or "faiss:FACTORY"), or
# the engine's HNSW graph (PostgreSQL's pgvector, Qdrant).
SEARCH_BACKENDS = ("exact", "faiss", "hnsw")
FUSIONS = ("rrf", "weighted")
# Several training sources (densefit.data.batching): whether each step's rows come from one
# source, and how the sources' steps are interleaved.
SOURCE_BATCHES = ("same", "mixed")
SOURCE_SAMPLING = ("proportional", "round_robin", "temperature")
# Experiment trackers a training run reports to (densefit.training.tracking).
TRACKERS = ("tensorboard", "mlflow", "wandb")
# Which of a store's prompts a text embedded by `densefit serve`'s embeddings endpoints gets
# (densefit.prompts: the model's query and document prompts).
EMBED_PROMPTS = ("query", "document")
# What runs the model's transformer when texts are embedded for inference
# (densefit.retrieval.runtimes); each but torch is a file `densefit export --to` writes.
RUNTIMES = ("torch", "onnx", "onnx-int8", "openvino", "openvino-int8")
# The options that pick one add "auto": the fastest exported runtime whose check passed.
RUNTIME_CHOICES = ("auto", *RUNTIMES)
# The number format the torch runtime runs the model's transformer in when embedding
# (densefit.retrieval.runtimes); the options add "auto" (the device's default, or a store's).
PRECISIONS = ("fp32", "fp16", "bf16")
PRECISION_CHOICES = ("auto", *PRECISIONS)
# What "auto" runs by device type (a device not named: fp32). fp32 on CUDA too until a GPU run
# shows fp16 at least 1.5x fp32 at a cosine >= 0.999 to it (bench/gpu_inference.py writes
# bench/results/inference_gpu.json).
AUTO_PRECISION = {"cpu": "fp32", "cuda": "fp32"}
EXPORT_TARGETS = RUNTIMES[1:]  # what `densefit export --to` writes (densefit.retrieval.export)
# ONNX Runtime int8 recipes (densefit.retrieval.export): the export tries the first two in
# order; the per-tensor ones are the baselines bench/inference.py compares them with.
INT8_RECIPES = (
    "matmul-per-channel",
    "matmul-per-channel-ffn-out-fp32",
    "matmul-per-tensor",
    "dynamic-default",
)
DEFAULT_INT8_RECIPES = INT8_RECIPES[:2]  # what an export tries when none is named
# Evaluation during training: weights change every step, so only runtimes that export the
# current weights in memory (fp32) can run it; "auto" finds no export of them: torch.
TRAINING_EVAL_RUNTIMES = ("auto", "torch", "onnx", "openvino")
ON_CHECK_FAILURE = ("error", "warn")  # a file whose check fails: deleted and refused, or kept

# Metrics: KIND@K, computed by pytrec_eval (densefit.evaluate).
METRIC_KINDS = ("ndcg", "mrr", "recall", "map", "precision")
DEFAULT_METRICS = ("ndcg@10", "mrr@10", "recall@10", "recall@100", "map@100")
_METRIC = re.compile(rf"^({'|'.join(METRIC_KINDS)})@(\d+)$")


def search_mode(mode: str) -> str:
    """``mode`` when it is one of :data:`SEARCH_MODES` (or a mining method: the same names),
    else ValueError (one line).

    >>> search_mode("lexical")
    Traceback (most recent call last):
    ...
    ValueError: mode must be one of dense, bm25, hybrid, not 'lexical'
    """
    if mode not in _MODE_INPUTS:
        raise ValueError(f"mode must be one of {', '.join(SEARCH_MODES)}, not {mode!r}")
    return mode


def embeds(mode: str) -> bool:
    """Whether a search (or mining) by ``mode`` ranks by embeddings, so the model embeds
    the queries.

    >>> [mode for mode in SEARCH_MODES if embeds(mode)]
    ['dense', 'hybrid']
    """
    return _MODE_INPUTS[search_mode(mode)][0]


def reads_texts(mode: str) -> bool:
    """Whether a search (or mining) by ``mode`` ranks by BM25 over the query texts.

    >>> [mode for mode in SEARCH_MODES if reads_texts(mode)]
    ['bm25', 'hybrid']
    """
    return _MODE_INPUTS[search_mode(mode)][1]


def parse_metric(name: str) -> tuple[str, int]:
    """``"ndcg@10"`` -> ``("ndcg", 10)``; ``ValueError`` listing what is supported.

    >>> parse_metric("nDCG@10")
    ('ndcg', 10)
    """
    match = _METRIC.match(str(name).strip().lower())
    if not match or int(match.group(2)) < 1:
        kinds = ", ".join(f"{kind}@K" for kind in METRIC_KINDS)
        raise ValueError(f"unknown metric {name!r}: use {kinds} (K a positive integer)")
    return match.group(1), int(match.group(2))
