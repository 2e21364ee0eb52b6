"""What each job takes besides its settings: its inputs, its outputs and how it reports.

One :class:`~densefit.config.options.Options` class per job; the command of the same name
offers every field as a flag (an argument where declared ``positional``) and its section's
fields too (:class:`TrainJob` holds a :class:`~densefit.config.train.TrainConfig`), the jobs
layer (:mod:`densefit.jobs`) runs it, and ``densefit run``'s stages and the
:class:`~densefit.api.Retriever` build the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from densefit.choices import (
    DEFAULT_INT8_RECIPES,
    EXPORT_TARGETS,
    INT8_RECIPES,
    ON_CHECK_FAILURE,
    embeds,
)
from densefit.config.evaluation import EvalConfig
from densefit.config.mine import MineConfig
from densefit.config.options import Options, option, section
from densefit.config.shared import (
    BACKEND,
    COMMIT_EVERY,
    DENSE_WEIGHT,
    DEVICE,
    DIM,
    DOCUMENT_PROMPT,
    ENCODE_BATCH_SIZE,
    FUSION,
    FUSION_DEPTH,
    JSON,
    LOCK_TIMEOUT,
    MAX_SEQ_LENGTH,
    MODEL,
    NPROC,
    ON_BAD_ROW_OPTION,
    OUTPUT,
    PRECISION,
    PROGRESS,
    QUERY_PROMPT,
    RESCORE,
    RRF_K,
    RUNTIME,
    SEARCH_MODE,
    SPLIT,
    STORE,
    TOP_K,
    VECTORS,
)
from densefit.config.train import TrainConfig, check_dims

__all__ = [
    "DocumentEmbedding",
    "EvalJob",
    "ExportJob",
    "IndexJob",
    "MineJob",
    "PlanJob",
    "ReembedJob",
    "SearchJob",
    "TrainJob",
]

_DATA_HELP = (
    "Training data: JSONL, CSV/TSV, Parquet, a BEIR folder, a Dataset.save_to_disk folder or "
    "a folder of Parquet shards. Several are several sources (NAME=PATH names one): each "
    "step's rows come from one source (--source-batches)."
)


@dataclass(kw_only=True)
class TrainJob(Options):
    """``densefit train``: data in, a fine-tuned model folder out."""

    # a list of paths on the command line; the Python API and densefit run's stages may also
    # give one path, a mapping {name: path}, a datasets.Dataset or rows
    data: list[str] = option(help=_DATA_HELP, positional=True)
    model: str | None = MODEL()
    output: Path = OUTPUT(required=True)
    overwrite: bool = option(
        False, "Train into an --output folder that holds something else.", flag="--overwrite"
    )
    resume: bool = option(
        False,
        "Continue an interrupted run from the newest good checkpoint in OUTPUT/checkpoints.",
        flag="--resume",
    )
    resume_from: Path | None = option(
        None, "Continue from this checkpoint folder (OUTPUT/checkpoints/step-...)."
    )
    split: str | None = SPLIT()
    eval_data: Path | None = option(
        None,
        "BEIR folder to evaluate on during training (split --eval-split); default: DATA when "
        "it is a BEIR folder and --eval-every, --keep-best or --early-stopping-patience is "
        "given.",
        group="Evaluation during training",
    )
    on_bad_row: str = ON_BAD_ROW_OPTION()
    nproc: int | None = NPROC()
    train: TrainConfig = section(TrainConfig, "The training options.")


@dataclass(kw_only=True)
class PlanJob(Options):
    """``densefit plan``: the memory plan of a batch size within a budget, and its peak."""

    data: list[str] = option(
        help="Training data, as densefit train reads it (the planner reads its real lengths).",
        positional=True,
    )
    model: str | None = MODEL()
    split: str | None = SPLIT()
    on_bad_row: str = ON_BAD_ROW_OPTION()
    json: bool = JSON()
    train: TrainConfig = section(
        TrainConfig, "The training options that shape the plan.", flags="plan"
    )


@dataclass(kw_only=True)
class MineJob(Options):
    """``densefit mine``: hard negatives for (query, positive) pairs, written as JSON Lines."""

    pairs: Path = option(
        help="(query, positive) pairs: a BEIR folder (its --split) or a training file.",
        positional=True,
    )
    corpus: Path | None = option(
        None, "Documents to mine from: a corpus file or a BEIR folder.", flag="--corpus", short="-c"
    )
    store: str | None = STORE()  # instead of --corpus: the store's documents and vectors
    output: Path = OUTPUT(required=True)
    model: str | None = MODEL()
    split: str | None = SPLIT()
    on_bad_row: str = ON_BAD_ROW_OPTION()
    device: str | None = DEVICE()
    query_prompt: str | None = QUERY_PROMPT()
    document_prompt: str | None = DOCUMENT_PROMPT()
    show_progress: bool = PROGRESS()
    mine: MineConfig = section(MineConfig, "How negatives are mined.")

    def check(self) -> None:
        """--corpus or --store: one of them."""
        if (self.corpus is None) == (self.store is None):
            raise self.error(
                "corpus", "names the documents to mine from: give --corpus or --store (one)"
            )


@dataclass(kw_only=True)
class DocumentEmbedding(Options):
    """How a job embeds documents into a store (``densefit index``, ``densefit reembed``):
    the model and the settings its vectors are made with (:func:`densefit.jobs.
    embedding_model`)."""

    model: str | None = MODEL()  # reembed: required unless --cancel (reembed_job says so)
    device: str | None = DEVICE()
    max_seq_length: int | None = MAX_SEQ_LENGTH()
    query_prompt: str | None = QUERY_PROMPT()
    document_prompt: str | None = DOCUMENT_PROMPT()
    dim: int | None = DIM()
    encode_batch_size: int = ENCODE_BATCH_SIZE()
    runtime: str = RUNTIME()
    precision: str = PRECISION()
    commit_every: int = COMMIT_EVERY()
    lock_timeout: float = LOCK_TIMEOUT()


@dataclass(kw_only=True)
class IndexJob(DocumentEmbedding):
    """``densefit index``: embed a corpus into a store (created if new, resumed if not)."""

    corpus: Path | None = option(
        None, "JSONL(.gz), CSV, TSV, Parquet, or a BEIR folder.", positional=True
    )
    store: str = STORE(required=True)
    from_store: str | None = option(
        None,
        "Copy every document, its metadata and its vector from this store (a folder or "
        "another engine's target) into --store instead of embedding a CORPUS: how a store "
        "moves to PostgreSQL or Qdrant without re-embedding; resumable.",
        flag="--from-store",
        metavar="STORE",
    )
    backend: str | None = BACKEND()
    vectors: str = VECTORS()
    reembed: bool = option(
        False,
        "Re-embed every stored document with this run's settings (e.g. a new "
        "--max-seq-length) instead of refusing to mix vectors made two ways.",
    )
    prune: bool = option(False, "Delete stored documents that are not in CORPUS.")
    index_fields: list[str] = option(
        help="Add an SQLite index on a metadata field (meta.NAME) that search --filter "
        "compares often; repeatable.",
        flag="--index-field",
        factory=list,
    )
    on_bad_row: str = ON_BAD_ROW_OPTION()
    nproc: int | None = NPROC()
    show_progress: bool = PROGRESS()
    json: bool = JSON()

    def check(self) -> None:
        """CORPUS to embed, or --from-store to copy: one of them; a copy embeds nothing."""
        if (self.corpus is None) == (self.from_store is None):
            raise self.error(
                "corpus",
                "names what to index: give CORPUS to embed, or --from-store STORE to copy "
                "a store's documents and vectors (one of them)",
            )
        if self.from_store is not None:
            for name, given in (("reembed", self.reembed), ("prune", self.prune)):
                if given:
                    raise self.error(name, "embeds or deletes; --from-store copies: drop one")
            if self.nproc not in (None, 1):
                raise self.error("nproc", "shares embedding; --from-store embeds nothing")


@dataclass(kw_only=True)
class ReembedJob(DocumentEmbedding):
    """``densefit reembed``: swap a store to another model while it keeps serving."""

    store: str = STORE(required=True)
    cancel: bool = option(
        False, "Drop the model swap under way (the store keeps serving its current model)."
    )
    show_progress: bool = PROGRESS()
    json: bool = JSON()


@dataclass(kw_only=True)
class SearchJob(Options):
    """``densefit search``: the best documents of a store for each query."""

    queries: list[str] = option(help="One or more queries.", positional=True)
    store: str = STORE(required=True)
    top_k: int | None = TOP_K()
    model: str | None = MODEL()
    device: str | None = DEVICE()
    query_prompt: str | None = QUERY_PROMPT()
    document_prompt: str | None = DOCUMENT_PROMPT()
    dim: int | None = DIM()
    encode_batch_size: int = ENCODE_BATCH_SIZE()
    runtime: str = RUNTIME()
    precision: str = PRECISION()
    backend: str | None = BACKEND()
    filter: str | None = option(
        None,
        "Metadata filter, Haystack syntax as JSON (or @FILE.json), e.g. "
        '\'{"field": "meta.lang", "operator": "==", "value": "en"}\': the best k that match.',
    )
    mode: str = SEARCH_MODE()
    fusion: str = FUSION()
    rrf_k: int = RRF_K()
    dense_weight: float = DENSE_WEIGHT()
    fusion_depth: int = FUSION_DEPTH()
    rescore: int | None = RESCORE()
    scale_score: bool = option(
        False,
        "Scores in [0, 1]: cosine (s+1)/2, dot expit(s/100); bm25 expit(s/8); hybrid: the "
        "fused score over its largest possible value.",
        flag="--scale-score",
    )
    width: int = option(160, "Snippet length in characters.", ge=1)
    json: bool = JSON()


@dataclass(kw_only=True)
class EvalJob(Options):
    """``densefit eval``: metrics of a model (or two) on a BEIR split, or of a store.

    ``--store`` with ``--queries``/``--qrels`` is the store to search; with ``--dataset``, the
    folder where the corpus's index is kept (and reused by the next evaluation)."""

    dataset: Path | None = option(
        None, "BEIR folder to index and evaluate.", flag="--dataset", short="-d"
    )
    model: str | None = MODEL()
    compare: str | None = option(
        None,
        "A second model (e.g. the base model) evaluated on the same queries, after --model; "
        "delta = --model minus --compare (positive: --model is better).",
    )
    store: str | None = STORE()
    queries: Path | None = option(None, "queries.jsonl (_id, text).")
    qrels: Path | None = option(None, "qrels TSV (query-id, corpus-id, score).")
    dims: list[int] | str | None = option(
        None,
        "Matryoshka: report the metrics at each of these sizes (every vector cut to its "
        "first D coordinates, re-normalised), e.g. 384,256,128,64; the corpus is embedded once.",
        check=check_dims,
        metavar="D1,D2,...",
        group="Embedding",
    )
    device: str | None = DEVICE()
    query_prompt: str | None = QUERY_PROMPT()
    document_prompt: str | None = DOCUMENT_PROMPT()
    backend: str | None = BACKEND()
    vectors: str = VECTORS()
    rescore: int | None = RESCORE()
    on_bad_row: str = ON_BAD_ROW_OPTION()
    output: Path | None = OUTPUT()
    per_query: bool = option(False, "Include per-query scores in the JSON.")
    show_progress: bool = PROGRESS()
    json: bool = JSON()
    eval: EvalConfig = section(EvalConfig, "How queries are searched and scored.")

    def check(self) -> None:
        """--dataset, or --store with --queries and --qrels; --compare needs --dataset;
        --dims needs embeddings to cut (not --mode bm25)."""
        if self.dims is not None and not embeds(self.eval.mode):
            raise self.error(
                "dims", "cuts the embeddings, which --mode bm25 does not use: drop one of them"
            )
        if self.dataset is not None:
            if self.queries is not None or self.qrels is not None:
                raise self.error(
                    "dataset", "brings its own queries and qrels: drop --queries/--qrels"
                )
            if self.compare is not None and self.compare == self.model:
                raise self.error("compare", "names the same model as --model; give the other model")
            if self.compare is not None and self.store is not None:
                raise self.error(
                    "store", "keeps the index of one model; drop it when using --compare"
                )
            return
        if self.store is None or self.queries is None or self.qrels is None:
            raise self.error(
                "dataset",
                "is not given: give either --dataset BEIR_DIR [--model M], or --store DIR "
                "--queries FILE --qrels FILE",
            )
        if self.compare is not None:
            raise self.error(
                "compare",
                "needs --dataset (each model needs its own index); or run eval once per store",
            )
        if self.eval.max_seq_length is not None:
            raise self.eval.error(
                "max_seq_length",
                "applies to a --dataset's index; a store's documents were embedded at its own "
                "length (re-index with densefit index --max-seq-length --reembed)",
            )
        if self.eval.distractors is not None:
            raise self.eval.error(
                "distractors", "subsamples a --dataset corpus; a store is searched whole"
            )


def _check_recipes(recipes: list[str]) -> None:
    if not recipes:
        raise ValueError(f"needs at least one of {', '.join(INT8_RECIPES)}")
    unknown = [r for r in recipes if r not in INT8_RECIPES]
    if unknown:
        raise ValueError(f"must be one of {', '.join(INT8_RECIPES)}, got {unknown[0]!r}")


@dataclass(kw_only=True)
class ExportJob(Options):
    """``densefit export``: a model's runtime files in sentence-transformers' layout
    (``onnx/model.onnx``, ``onnx/model_qint8_<isa>.onnx``, ``openvino/...``), each checked
    against the model before it is kept (:mod:`densefit.retrieval.export`)."""

    model: str = option(
        help="The model: a sentence-transformers folder (exported into, unless --output) or "
        "name (then --output is needed).",
        positional=True,
    )
    to: str = option(
        "onnx",
        "What to export (onnx/model.onnx is written with any of them: the others are made "
        "from it): onnx (fp32), onnx-int8, openvino, openvino-int8.",
        flag="--to",
        choices=EXPORT_TARGETS,
    )
    calibration: Path | None = option(
        None,
        "Texts the check embeds (and OpenVINO int8 calibrates on): training pairs, a corpus "
        "or a BEIR folder; at most 200 queries and 800 documents are drawn. Default: for the "
        "int8 targets the training data the model folder records (densefit train records "
        "it), for fp32 ones probe texts.",
        metavar="DATA",
    )
    output: Path | None = OUTPUT()
    on_check_failure: str = option(
        "error",
        "A file whose check fails (cosine to the model below 0.99 or top-10 overlap below "
        "0.85; fp32: below 1 - 1e-5): error deletes it and exits 2 with the numbers; warn "
        "keeps it, recorded as failed (auto never picks it).",
        choices=ON_CHECK_FAILURE,
    )
    int8_recipes: list[str] = option(
        help="onnx-int8: the ONNX Runtime quantization recipe to try, in order, keeping the "
        f"first that passes its check; repeatable. One of {', '.join(INT8_RECIPES)}. "
        f"Default: {', '.join(DEFAULT_INT8_RECIPES)}.",
        flag="--int8-recipe",
        factory=lambda: list(DEFAULT_INT8_RECIPES),
        check=_check_recipes,
    )
    show_progress: bool = PROGRESS()
    json: bool = JSON()
