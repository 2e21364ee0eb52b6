"""The jobs, each assembled once: train, plan, mine, index, search, evaluate.

The command line (:mod:`densefit.cli`), ``densefit run``'s stages (:mod:`densefit.pipeline`)
and the :class:`~densefit.api.Retriever` all run a job through these functions, so reading
the data, warning about skipped rows, loading the model, checking the options and saying
what happens is written once. Each takes the job's options object
(:mod:`densefit.config.commands`), whose fields may also hold objects already in memory: a
loaded ``SentenceTransformer`` as ``model``, a list of rows (or ``TrainingExample``) as
training ``data``.

Status lines go to ``say`` (the command line prints them on stderr, the pipeline on its
console, the Python API drops them); results are returned, never printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from densefit.choices import embeds
from densefit.comparison import QueryComparison, compare_queries
from densefit.config.commands import (
    DocumentEmbedding,
    EvalJob,
    ExportJob,
    IndexJob,
    MineJob,
    PlanJob,
    ReembedJob,
    SearchJob,
    TrainJob,
)
from densefit.config.evaluation import EvalConfig
from densefit.config.shared import SEARCH_TOP_K, VECTORS, model_or_default
from densefit.config.train import TrainConfig, auto_learning_rate, record_training_data
from densefit.data.batching import effective_batch_size, planned_batches
from densefit.data.corpus import find_corpus_file, iter_corpus, load_beir
from densefit.data.sources import TrainingData, load_training_data, source_names
from densefit.data.types import ReadReport
from densefit.evaluate import EvalResult, evaluate, load_queries_and_qrels
from densefit.memory.planner import for_the_data, plan_memory
from densefit.mine import MiningReport, mine_files
from densefit.models import apply_lora, load_model, resolve_device
from densefit.prompts import set_prompts
from densefit.retrieval.encode import configure_model, encode_with_callback
from densefit.retrieval.export import (
    CheckTexts,
    ExportCheckError,
    ExportReport,
    check_texts,
    export_model,
)
from densefit.retrieval.fusion import Fusion
from densefit.retrieval.index.engines import open_store
from densefit.retrieval.index.filters import meta_path, parse_filter_text
from densefit.retrieval.index.indexing import (
    IndexReport,
    copy_documents,
    index_documents,
    prune_documents,
)
from densefit.retrieval.index.reembed import SwapReport, reembed_store
from densefit.retrieval.index.registry import redacted, require
from densefit.retrieval.index.searching import model_for_store, query_runtime, search_batch
from densefit.retrieval.index.types import NoStoreError, SearchHit
from densefit.retrieval.runtimes import (
    check_supported,
    model_precision,
    resolve_runtime,
    set_precision,
)
from densefit.training import distributed
from densefit.training.checkpoint import CHECKPOINTS, list_checkpoints
from densefit.training.evaluation import eval_data_for
from densefit.training.loop import TrainResult, train
from densefit.training.setup import check_output_dir, warn_batch_larger_than_data

__all__ = [
    "EvalOutcome",
    "IndexOutcome",
    "TrainOutcome",
    "check_index_job",
    "eval_job",
    "fusion_of",
    "export_job",
    "index_job",
    "mine_job",
    "plan_job",
    "read_training",
    "sources_words",
    "training_sources",
    "search_job",
    "train_job",
]

Say = Callable[[str], Any] | None


def _say(say: Say, message: str) -> None:
    if say is not None:
        say(message)


def training_sources(data: Any) -> Any:
    """The training data as :func:`~densefit.data.sources.load_training_data` reads it, from
    what a command or a YAML key gives: one path, a list of them (``NAME=PATH`` names a
    source; other paths are named after their file), a mapping ``{name: path}``, or objects
    already in memory (a ``datasets.Dataset``, rows), passed on as they are.

    >>> training_sources(["faq=data/faq.jsonl", "manual.jsonl"])
    {'faq': 'data/faq.jsonl', 'manual.jsonl': 'manual.jsonl'}
    >>> training_sources(["pairs.jsonl"])
    'pairs.jsonl'
    """
    if isinstance(data, (list, tuple)) and data and all(_is_path(d) for d in data):
        named = [_named_path(d) for d in data]
        if len(named) == 1 and named[0][0] is None:
            return data[0]
        if all(name is None for name, _ in named):
            return list(data)
        names = source_names([path for _, path in named])
        sources: dict[str, Any] = {}
        for (name, path), default in zip(named, names):
            name = name if name is not None else default
            if name in sources:
                raise ValueError(
                    f"DATA: two training sources are named {name!r}: name each once (NAME=PATH)"
                )
            sources[name] = path
        return sources
    return data


def _named_path(item: str | os.PathLike) -> tuple[str | None, str | os.PathLike]:
    """(name, path) of a ``NAME=PATH`` item; (None, item) for a plain path (one that
    exists is a path even with an ``=`` in it)."""
    text = str(item)
    if isinstance(item, os.PathLike) or "=" not in text or Path(text).exists():
        return None, item
    name, _, path = text.partition("=")
    if not name.strip() or not path.strip():
        raise ValueError(f"DATA: {text!r}: write NAME=PATH to name a source, or a path")
    return name.strip(), path


def read_training(data: Any, *, on_bad_row: str, split: str) -> TrainingData:
    """Training rows of one source or several (:func:`training_sources`: paths, ``NAME=PATH``,
    a mapping, a ``datasets.Dataset``, rows in memory); skipped rows are warned about, per
    source (:func:`~densefit.data.sources.load_training_data`)."""
    return load_training_data(training_sources(data), on_bad_row=on_bad_row, split=split)


def _single_path(data: Any) -> str | os.PathLike | None:
    """The one path the training data is, when it is one (``[path]`` included)."""
    data = training_sources(data)
    return data if _is_path(data) else None


def sources_words(examples: TrainingData, config: TrainConfig) -> str:
    """``2 sources (faq 12 rows, manual 30 rows), same-source batches (proportional)``;
    the source's path or name with one source."""
    if len(examples.sources) < 2:
        source = examples.sources[0]
        report = source.report
        return report.path if report is not None and report.path else source.name
    each = ", ".join(f"{s.name} {plural_rows(s.rows)}" for s in examples.sources)
    if config.source_batches == "mixed":
        how = "mixed batches"
    else:
        how = f"same-source batches ({config.source_sampling}"
        if config.source_sampling == "temperature":
            how += f", temperature {config.source_temperature:g}"
        how += ")"
    return f"{len(examples.sources)} sources ({each}), {how}"


def plural_rows(n: int) -> str:
    """``1 row``, ``2,048 rows``."""
    return f"{n:,} row" + ("" if n == 1 else "s")


# ----------------------------------------------------------------------------- train


@dataclass
class TrainOutcome:
    """What :func:`train_job` did: the run's result and where things are."""

    result: TrainResult
    config: TrainConfig  # as run: the device resolved
    rows: int
    source: str
    output: Path | None
    world: int = 1  # processes
    main: bool = True  # this process logs and saves
    checkpoints: dict = field(default_factory=dict)  # what is left on disk: count, bytes
    export: ExportReport | None = None  # config.export: the files written beside the model
    sources: list | None = None  # several sources: each one's name, files and rows


def _start_processes(device: str) -> tuple[str, int, bool]:
    """Join torchrun's process group when launched by it: (this process's device, world
    size, main). ``cuda`` becomes ``cuda:LOCAL_RANK``; alone: (``device``, 1, True)."""
    if distributed.launched_by_torchrun() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = str(distributed.init_distributed(device))
        return device, distributed.world_size(), distributed.is_main_process()
    return device, 1, True


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def train_job(
    job: TrainJob,
    *,
    on_step: Callable[[dict], None] | None = None,
    say: Say = None,
) -> TrainOutcome:
    """Read the data, load the model, train, save into ``job.output`` (when given), and
    delete the checkpoints once done unless ``delete_checkpoints`` is off.

    Everything that can be refused is checked before anything slow: the options (when
    ``job`` was built), the output folder, the evaluation data, LoRA on the model.
    """
    config = job.train.replace(device=resolve_device(job.train.device))
    resume = job.resume_from or job.resume
    if job.output is not None:
        check_output_dir(job.output, config, resume=bool(resume), overwrite=job.overwrite)
    evaluate_on = eval_data_for(config, job.eval_data, _single_path(job.data))
    device, world, main = _start_processes(config.device)
    config = config.replace(device=device)
    examples = read_training(job.data, on_bad_row=job.on_bad_row, split=job.split or "train")
    model = load_model(
        model_or_default(job.model), max_seq_length=config.max_seq_length, device=config.device
    )
    apply_lora(model, config)  # its errors before any line of output
    export_texts = None
    if config.export is not None:
        check_supported(model, config.export)  # the runtime's package and the model's kind
        export_texts = _export_texts(config.export, examples)
    if main:
        _say(say, _start_line(job, config, examples, world))
    result = train(
        model,
        examples,
        config,
        output_dir=job.output,
        resume=resume,
        overwrite=job.overwrite,
        eval_data=evaluate_on,
        on_step=on_step,
    )
    if world > 1:
        distributed.teardown_distributed()
    outcome = TrainOutcome(
        result,
        config,
        len(examples),
        sources_words(examples, config),
        job.output,
        world,
        main,
        sources=examples.describe().get("sources"),
    )
    if job.output is not None and main:
        outcome.checkpoints = _finish_checkpoints(Path(job.output), config)
        if paths := _data_paths(job.data):  # densefit export checks int8 files on them
            record_training_data(job.output, paths, job.split or "train")
        if config.export is not None:
            outcome.export = _export_trained(Path(job.output), config.export, export_texts, say)
    return outcome


def _data_paths(data: Any) -> list:
    """The files or folders the training data was read from; ``[]`` for rows in memory."""
    sources = training_sources(data)
    if _is_path(sources):
        return [sources]
    items = list(sources.values()) if isinstance(sources, dict) else sources
    if isinstance(items, list) and items and all(_is_path(p) for p in items):
        return items
    return []


def _export_texts(kind: str, examples: list) -> CheckTexts | None:
    """The held-out texts ``--export KIND`` is checked on: the training data's (drawn before
    training, so too few of them for a quantized export is refused before any step). Too
    few for an fp32 export: None, the probe texts."""
    try:
        return check_texts(examples)
    except ValueError as exc:
        if kind.endswith("int8"):
            raise ValueError(f"--export {kind}: {exc}") from None
        return None


def _export_trained(
    output: Path, kind: str, texts: CheckTexts | None, say: Say
) -> ExportReport | None:
    """``densefit train --export KIND``: export the saved model into its folder, checked on
    the training data's texts. A file that fails its check is not kept: a warning with the
    numbers, the trained model stands (None)."""
    try:
        report = export_model(str(output), kind, calibration=texts)
    except ExportCheckError as exc:
        warnings.warn(f"the model is saved, its export is not: {exc}", UserWarning, stacklevel=3)
        return None
    _say(say, f"exported {report.summary()}")
    return report


def _is_path(data: Any) -> bool:
    return isinstance(data, (str, os.PathLike))


def _start_line(job: TrainJob, config: TrainConfig, examples: TrainingData, world: int) -> str:
    scale_out = ""
    if world > 1:
        share = -(-config.batch_size // world)
        scale_out = (
            f"; global batch {config.batch_size} = {world} processes x {share} rows at most, "
            f"gather {config.gather}"
        )
    to = f" -> {job.output}" if job.output is not None else ""
    return (
        f"training on {plural_rows(len(examples))} from {sources_words(examples, config)}{to} "
        f"on {config.device}"
        f"{lora_words(config)}{scale_out}; "
        f"{learning_rate_words(config, batch=effective_batch_size(examples, config))}"
    )


def learning_rate_words(
    config: TrainConfig, plan: dict | None = None, *, batch: int | None = None
) -> str:
    """``lr 8e-05 (auto, from the batch size)``: the peak learning rate and its origin; the
    one the run used when ``plan`` (its report) says, else the auto rule's for ``batch``
    (the rows a step really has: :func:`~densefit.data.batching.effective_batch_size`)."""
    plan = plan or {}
    auto = config.learning_rate == "auto" or plan.get("learning_rate_from") == "auto"
    if plan.get("learning_rate") is not None:
        rate = float(plan["learning_rate"])
    elif config.learning_rate == "auto" and batch is not None:
        rate = auto_learning_rate(min(config.batch_size, batch))
    else:
        rate = config.peak_learning_rate
    return f"lr {rate:.3g}" + (" (auto, from the batch size)" if auto else "")


def lora_words(config: TrainConfig) -> str:
    """``, LoRA r=16 alpha=32 (saved merged)``; empty without LoRA."""
    if config.lora_r is None:
        return ""
    saved = "adapter" if config.save_adapter else "merged"
    return f", LoRA r={config.lora_r} alpha={config.effective_lora_alpha:g} (saved {saved})"


def _finish_checkpoints(output: Path, config: TrainConfig) -> dict:
    """Delete the finished run's checkpoints (``delete_checkpoints``), or say what they hold."""
    folder = output / CHECKPOINTS
    if not folder.is_dir():
        return {"kept": 0, "bytes": 0, "folder": None}
    size, count = _folder_bytes(folder), len(list_checkpoints(folder))
    if config.delete_checkpoints:
        shutil.rmtree(folder)
        return {"kept": 0, "bytes": 0, "deleted": count, "freed_bytes": size, "folder": None}
    return {"kept": count, "bytes": size, "folder": str(folder)}


# ----------------------------------------------------------------------------- plan


def plan_job(job: PlanJob):
    """The memory plan ``job.train`` gets on ``job.data``: (plan, the device planned for)."""
    config = job.train.replace(memory="auto", device=resolve_device(job.train.device))
    examples = read_training(job.data, on_bad_row=job.on_bad_row, split=job.split or "train")
    model = load_model(
        model_or_default(job.model), max_seq_length=config.max_seq_length, device=config.device
    )
    apply_lora(model, config)  # the planner counts the frozen weights once
    batch = effective_batch_size(examples, config)  # the rows a step really has
    warn_batch_larger_than_data(examples, config, batch)  # the plan is for that batch
    planned = for_the_data(examples, config)
    plan = plan_memory(model, examples, planned, batches=planned_batches(examples, planned))
    return plan, config


# ----------------------------------------------------------------------------- mine


def mine_job(job: MineJob, *, say: Say = None) -> MiningReport:
    """Mine hard negatives for ``job.pairs`` from ``job.corpus`` (or the documents of
    ``job.store``) into ``job.output``."""
    device = resolve_device(job.device)  # a device that is not here: refused, even for bm25
    settings = job.mine
    if job.store is not None:
        return _mine_store(job, device, say)
    model = None
    if embeds(settings.method):  # dense and hybrid embed the corpus
        model = load_model(
            model_or_default(job.model), max_seq_length=settings.max_seq_length, device=device
        )
        set_prompts(model, query=job.query_prompt, document=job.document_prompt)
        set_precision(model, settings.precision)
    return _mine(job, job.corpus, model, settings.runtime, say)


def _mine_store(job: MineJob, device: str, say: Say) -> MiningReport:
    """``densefit mine --store``: the store's documents are the corpus; dense and hybrid
    mining take its vectors as the corpus embeddings and embed the queries with its model
    (or ``--model``), as a search of the store would (its prompts, size and runtime rule)."""
    settings = job.mine
    with open_store(job.store, create=False) as store:
        documents = store.filter_documents(None)
        if not embeds(settings.method):
            return _mine(job, documents, None, settings.runtime, say)
        prompts = {"query_prompt": job.query_prompt, "document_prompt": job.document_prompt}
        model = model_for_store(store, job.model, device=device, **prompts)
        set_precision(model, settings.precision)
        store.check_model(model)
        runner = query_runtime(store, model, settings.runtime)
        vectors = store.vectors([d.id for d in documents])
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return _mine(job, documents, model, runner, say, corpus_embeddings=vectors)


def _mine(job: MineJob, corpus, model, runtime, say: Say, **extra) -> MiningReport:
    settings = job.mine
    low, high = settings.bounds
    report = mine_files(
        job.pairs,
        corpus,
        job.output,
        split=job.split or "train",
        on_bad_row=job.on_bad_row,
        method=settings.method,
        model=model,
        num_negatives=settings.num_negatives,
        range_min=low,
        range_max=high,
        relative_margin=settings.relative_margin,
        sampling=settings.sampling,
        seed=settings.seed,
        query_block=settings.query_block,
        batch_size=settings.encode_batch_size,
        show_progress=job.show_progress,
        runtime=runtime,
        **extra,
    )
    _say(say, f"wrote {job.output}: {report.summary()}")
    return report


# ----------------------------------------------------------------------------- index


@dataclass
class IndexOutcome:
    """What :func:`index_job` did: the indexing report, what the reader skipped, the store.

    With several processes only rank 0 (``main``) writes and reports; the others' outcome
    holds an empty report."""

    report: IndexReport
    read: ReadReport
    store: dict  # the store's info()
    main: bool = True


def recorded_model(store: str | os.PathLike | None) -> str | None:
    """The model a store at ``store`` was indexed with, or None when there is no store."""
    if store is None:
        return None
    try:
        with open_store(store, create=False) as existing:
            return existing.model_name
    except NoStoreError:
        return None


def count_rows(path: Path) -> int | None:
    """Rows in a corpus file, cheaply, for the progress bar's total (None when unknown)."""

    try:
        path = find_corpus_file(path)
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # only to read the row count

            return pq.ParquetFile(path).metadata.num_rows
        opener = gzip.open if path.name.endswith(".jsonl.gz") else open
        if path.name.endswith((".jsonl", ".jsonl.gz")):
            with opener(path, "rb") as fh:
                return sum(1 for line in fh if line.strip())
    except OSError:
        return None
    return None


def check_index_job(job: IndexJob) -> None:
    """What :func:`index_job` refuses before loading anything (``densefit index --nproc``
    asks before it starts the processes): a corpus that is not there, a bad
    ``--index-field``."""
    if job.corpus is not None and not Path(job.corpus).exists():
        raise FileNotFoundError(f"{job.corpus}: no such file or folder")
    for name in job.index_fields:
        meta_path(name)  # a bad field name fails before any work


def embedding_model(name: str, job: DocumentEmbedding, device: str):
    """``name`` loaded on ``device`` to embed documents as ``job`` says: its
    ``--max-seq-length``, prompts and ``--dim`` (those not given: the model's own)."""
    model = load_model(name, max_seq_length=job.max_seq_length, device=device)
    return configure_model(
        model,
        query_prompt=job.query_prompt,
        document_prompt=job.document_prompt,
        dim=job.dim,
        precision=job.precision,
    )


def index_job(job: IndexJob) -> IndexOutcome:
    """Embed ``job.corpus`` into ``job.store`` (created for the model when new; resumed, and
    unchanged documents skipped, when not). ``prune`` deletes stored documents that are not
    in the corpus. The model defaults to the store's own.

    Started by torchrun (``densefit index --nproc N``), every process loads the model and
    embeds a share of each commit's texts (:func:`_encode_on_every_process`); rank 0 alone reads the
    corpus, decides what to embed, opens the store and writes it, as one process would: the
    same documents and vectors, resumed and pruned the same way."""
    if job.from_store is not None:
        return _copy_into_store(job)
    device, world, main = _start_processes(resolve_device(job.device))
    if main:  # the one process that reads the corpus
        check_index_job(job)
    recorded = recorded_model(job.store) if main else None
    name = model_or_default(job.model, recorded)
    if world > 1:
        name = distributed.broadcast_object(name)  # the store's model, as rank 0 read it
    model = embedding_model(name, job, device)
    if world == 1:
        return _index_into_store(job, model, encode_with_callback, new=recorded is None)
    if not main:
        _embed_shares(model)
        distributed.teardown_distributed()
        return IndexOutcome(
            IndexReport(redacted(job.store), name), ReadReport(str(job.corpus)), {}, False
        )
    try:
        outcome = _index_into_store(job, model, _encode_on_every_process, new=recorded is None)
    except KeyboardInterrupt:
        raise  # torchrun interrupts every process
    except BaseException:
        _stop_sharing()  # the other ranks stop waiting for texts and leave
        raise
    _stop_sharing()
    outcome.report.processes = world
    return outcome


def _index_into_store(job: IndexJob, model, encoder, *, new: bool) -> IndexOutcome:  # noqa: ANN001
    """Open (or create, ``new``: there was none) the store for ``model`` and index the corpus
    into it with ``encoder`` (:func:`~densefit.retrieval.index.indexing.index_documents`):
    the one writer."""
    store = open_store(
        job.store, model, backend=job.backend, vectors=job.vectors, lock_timeout=job.lock_timeout
    )
    read = ReadReport(str(job.corpus))
    documents = iter_corpus(job.corpus, on_bad_row=job.on_bad_row, report=read)
    seen: set[str] = set()

    def remembered(docs: Iterator) -> Iterator:
        for doc in docs:
            seen.add(doc.id)
            yield doc

    with _dropped_on_failure(store, new=new):
        if store.vector_kind != job.vectors and job.vectors != VECTORS.default:
            warnings.warn(
                f"{store.location} stores {store.vector_kind} vectors; --vectors {job.vectors} "
                "applies to new stores only (index into a new --store to change the kind)",
                UserWarning,
                stacklevel=3,
            )
        _require_index_fields(store, job.index_fields)
        report = index_documents(
            store,
            model,
            remembered(documents) if job.prune else documents,
            batch_size=job.encode_batch_size,
            commit_every=job.commit_every,
            show_progress=job.show_progress,
            total=count_rows(Path(job.corpus)),
            reembed=job.reembed,
            lock_timeout=job.lock_timeout,
            runtime=job.runtime,
            encoder=encoder,
        )
        if job.prune:
            report.pruned = prune_documents(store, seen)
        for name in job.index_fields:
            store.index_meta_field(name)
        info = store.info()
    return IndexOutcome(report, read, info)


@contextlib.contextmanager
def _dropped_on_failure(store, *, new: bool) -> Iterator:
    """``store`` for the block, closed after it. When the block fails and the store is
    ``new`` (this command created it) and holds no document, the store is dropped: a refused
    command leaves nothing behind. A store that held data before, or that this command
    committed documents into (the same command resumes it), is kept."""
    with store:
        try:
            yield store
        except BaseException:
            if new:
                discard_if_empty(store)
            raise


def discard_if_empty(store) -> None:
    """Drop ``store`` (one a command created and then failed with) if it holds no document;
    any error doing so is swallowed: the command's own error is the one to report."""
    with contextlib.suppress(Exception):
        if store.count() == 0:
            store.drop()


def _require_index_fields(store, fields: list[str]) -> None:
    """Refuse ``--index-field`` before indexing starts where the engine has no metadata
    indexes (the upkeep role)."""
    if fields:
        doing = "index metadata fields (--index-field)"
        require(store.capabilities, "upkeep", doing, location=store.location)


def _copy_into_store(job: IndexJob) -> IndexOutcome:
    """``densefit index --from-store SOURCE --store TARGET``: every document of SOURCE with
    its vector copied into TARGET (created recording SOURCE's model and settings, with
    ``--vectors`` when given, else SOURCE's vector kind), nothing embedded
    (:func:`~densefit.retrieval.index.indexing.copy_documents`)."""
    with open_store(job.from_store, create=False) as source:
        kind = job.vectors if job.vectors != VECTORS.default else source.vector_kind
        record = dataclasses.replace(source.record, vector_kind=kind)
        opening = {"backend": job.backend, "lock_timeout": job.lock_timeout}
        new = recorded_model(job.store) is None
        created = open_store(job.store, record=record, **opening)
        with _dropped_on_failure(created, new=new) as target:
            _require_index_fields(target, job.index_fields)
            report = copy_documents(
                source,
                target,
                commit_every=job.commit_every,
                show_progress=job.show_progress,
                lock_timeout=job.lock_timeout,
            )
            for name in job.index_fields:
                target.index_meta_field(name)
            info = target.info()
    return IndexOutcome(report, ReadReport(source.location), info)


def reembed_job(job: ReembedJob) -> SwapReport | None:
    """Swap ``job.store`` to ``job.model`` (:func:`~densefit.retrieval.index.swap.
    reembed_store`): every document embedded again, then one switch; resumes a swap to the
    same model. With ``job.cancel``, drop the swap under way instead (None)."""
    with open_store(job.store, create=False) as store:  # StoreError (one line) when none
        if job.cancel:
            if job.model is not None:
                raise ValueError("--cancel drops the swap under way; it takes no --model")
            store.cancel_swap()
            return None
        if job.model is None:
            raise ValueError(
                "--model: name the model to swap the store to (or --cancel the swap under way)"
            )
        model = embedding_model(job.model, job, resolve_device(job.device))
        return reembed_store(
            store,
            model,
            runtime=job.runtime,
            batch_size=job.encode_batch_size,
            commit_every=job.commit_every,
            show_progress=job.show_progress,
            lock_timeout=job.lock_timeout,
        )


def _encode_on_every_process(  # noqa: ANN001
    model, texts: list[str], *, batch_size: int, on_batch, prompt_name: str | None, runtime
) -> np.ndarray:
    """Rank 0's encoder when indexing on several processes: the texts go to every rank with
    the batch size, prompt and runtime; each embeds its share of the batches
    (:func:`~densefit.retrieval.encode.encode_with_callback`'s ``share``) and rank 0 adds
    the shares up: every vector made in the batch one process would make it in."""
    runner = resolve_runtime(model, runtime)
    distributed.broadcast_object((texts, batch_size, prompt_name, runner.name, runner.source))
    done = [0]  # texts this rank embedded

    def own_batch(n: int) -> None:
        done[0] += n
        if on_batch is not None:
            on_batch(n)

    vectors = _encode_share(model, texts, batch_size, prompt_name, runner, own_batch)
    if on_batch is not None:
        on_batch(len(texts) - done[0])  # the other ranks' batches, now that they are in
    return vectors


def _encode_share(model, texts, batch_size, prompt_name, runner, on_batch):  # noqa: ANN001
    """This rank's share of ``texts`` embedded, gathered on rank 0: the whole array there
    (each row is one rank's vector plus the others' zeros: exact), None elsewhere."""
    share = (distributed.rank(), distributed.world_size())
    vectors = encode_with_callback(
        model,
        texts,
        batch_size=batch_size,
        on_batch=on_batch,
        prompt_name=prompt_name,
        runtime=runner,
        share=share,
    )
    parts = distributed.gather_object(vectors)
    return None if parts is None else np.sum(parts, axis=0, dtype=np.float32)


def _embed_shares(model) -> None:  # noqa: ANN001
    """A rank other than 0: embed its share of each call of rank 0's
    :func:`_encode_on_every_process` until rank 0 says it is done (:func:`_stop_sharing`)."""
    while (call := distributed.broadcast_object(None)) is not None:
        texts, batch_size, prompt_name, runtime, source = call
        if model_precision(model) == "auto":  # auto follows rank 0's: the store's precision
            set_precision(model, source.precision)
        runner = resolve_runtime(model, runtime)
        if runner.source != source:
            raise RuntimeError(
                f"rank {distributed.rank()} would embed with {runner.source.describe()} but "
                f"rank 0 embeds with {source.describe()}: give every process the same model "
                "folder and its exports"
            )
        _encode_share(model, texts, batch_size, prompt_name, runner, None)


def _stop_sharing() -> None:
    """Rank 0 is done: the other ranks leave :func:`_embed_shares`; every rank leaves the
    process group."""
    distributed.broadcast_object(None)
    distributed.teardown_distributed()


# ----------------------------------------------------------------------------- search


def fusion_of(settings: SearchJob | EvalConfig) -> Fusion:
    """The fusion of a hybrid search, from the options that declare it (``--fusion``,
    ``--rrf-k``, ``--dense-weight``, ``--fusion-depth``)."""
    return Fusion(
        method=settings.fusion,
        rrf_k=settings.rrf_k,
        alpha=settings.dense_weight,
        depth=settings.fusion_depth,
    )


def search_job(job: SearchJob) -> list[list[SearchHit]]:
    """The best ``job.top_k`` documents of ``job.store`` for each query (``job.filter``:
    Haystack's filter syntax as JSON text or ``@FILE``), ranked by ``job.mode``; a BM25
    search loads no model."""
    device = resolve_device(job.device)
    filters = parse_filter_text(job.filter)
    with open_store(job.store, backend=job.backend, rescore=job.rescore, create=False) as store:
        model = None
        if embeds(job.mode):
            model = model_for_store(
                store,
                job.model,
                device=device,
                query_prompt=job.query_prompt,
                document_prompt=job.document_prompt,
                dim=job.dim,
            )
            set_precision(model, job.precision)
        return search_batch(
            store,
            model,
            list(job.queries),
            top_k=job.top_k or SEARCH_TOP_K,
            filters=filters,
            scale_score=job.scale_score,
            batch_size=job.encode_batch_size,
            mode=job.mode,
            fusion=fusion_of(job),
            runtime=job.runtime,
        )


# ----------------------------------------------------------------------------- export


def export_job(job: ExportJob) -> ExportReport:
    """Write ``job.model``'s runtime files (``job.to``) into its folder or ``job.output``, each
    checked against the model on ``job.calibration`` (by default, for int8, the training data
    the model folder records: :func:`~densefit.retrieval.export.export_model`); a file that fails its check raises ``ExportCheckError`` (a ValueError)
    unless ``on_check_failure`` is warn."""
    if job.calibration is not None and not Path(job.calibration).exists():
        raise FileNotFoundError(f"--calibration {job.calibration}: no such file or folder")
    model = load_model(job.model, device="cpu")  # exports are made and checked on the CPU
    return export_model(
        model,
        job.to,
        folder=job.output,
        calibration=job.calibration,
        on_check_failure=job.on_check_failure,
        show_progress=job.show_progress,
        int8_recipes=job.int8_recipes,
    )


# ----------------------------------------------------------------------------- eval


@dataclass
class EvalOutcome:
    """What :func:`eval_job` measured: the results (with ``--compare``: the compared model
    first, then ``--model``, so a delta is ``--model`` minus ``--compare``), a title, notes."""

    results: list[EvalResult]
    title: str
    notes: list[str] = field(default_factory=list)
    comparison: QueryComparison | None = None  # with --compare: the two models per query


def eval_job(job: EvalJob, *, say: Say = None) -> EvalOutcome:
    """Evaluate ``job.model`` (and ``job.compare``) on a BEIR split or a store."""
    job = job.replace(device=resolve_device(job.device))
    settings = job.eval
    options = dict(
        metrics=settings.metric_list,
        top_k=settings.top_k,
        batch_size=settings.encode_batch_size,
        dims=job.dims,
        show_progress=job.show_progress,
        mode=settings.mode,
        fusion=fusion_of(settings),
        runtime=settings.runtime,
    )
    prompts = {"query_prompt": job.query_prompt, "document_prompt": job.document_prompt}
    if job.dataset is None:
        return _eval_store(job, options, prompts)
    split = settings.split_name
    beir = load_beir(job.dataset, split, on_bad_row=job.on_bad_row)
    names = [model_or_default(job.model)] + ([job.compare] if job.compare else [])
    labels = _labels(names)
    results: list[EvalResult] = []
    lengths = {}
    for name in names[::-1]:  # --compare first: the delta is --model minus --compare
        _say(say, f"evaluating {name} on {job.dataset} ({split})")
        model = configure_model(
            load_model(name, device=job.device, max_seq_length=settings.max_seq_length),
            precision=settings.precision,
            **prompts,
        )
        lengths[labels[name]] = model.max_seq_length
        found = evaluate(
            model,
            beir,
            split=split,
            distractors=settings.distractors,
            sample_seed=settings.sample_seed,
            store_dir=job.store,
            backend=job.backend,
            vectors=job.vectors,
            rescore=job.rescore,
            name=labels[name],
            **options,
        )
        for result in found if isinstance(found, list) else [found]:
            result.info["dataset"] = str(job.dataset)
            results.append(result)
    notes = []
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{label} {n}" for label, n in lengths.items())
        notes.append(
            f"the models truncate at their own lengths ({shown} tokens): pass "
            "--max-seq-length N to compare them at one length"
        )
    corpus = results[0].info.get("corpus", {})
    if corpus.get("kind") == "subsample":
        notes.append(
            f"searched {corpus['documents']} of {corpus['corpus_documents']} documents "
            f"(judged + {corpus['distractors']} random, seed {corpus['sample_seed']}): higher "
            "than full-corpus scores"
        )
    comparison = None
    if len(results) == 2:  # --compare without --dims: line the two models up per query
        texts = {doc_id: doc.text for doc_id, doc in beir.corpus.items()}
        comparison = compare_queries(*results, queries=beir.queries, documents=texts)
    return EvalOutcome(results, f"{job.dataset} ({split})", notes, comparison)


def _eval_store(job: EvalJob, options: dict, prompts: dict) -> EvalOutcome:
    report = ReadReport(f"{job.queries}, {job.qrels}")
    queries, qrels = load_queries_and_qrels(
        job.queries, job.qrels, on_bad_row=job.on_bad_row, report=report
    )
    with open_store(job.store, backend=job.backend, rescore=job.rescore, create=False) as store:
        model = None  # BM25 ranks by the texts alone: no model to load
        if embeds(job.eval.mode):
            model = model_for_store(store, job.model, device=job.device, **prompts)
            set_precision(model, job.eval.precision)
        found = evaluate(
            model,
            store,
            queries=queries,
            qrels=qrels,
            name=job.model or store.model_name,
            **options,
        )
    results = found if isinstance(found, list) else [found]
    for result in results:
        result.skipped_rows = list(report.skipped)
    return EvalOutcome(results, f"{redacted(job.store)} ({Path(job.qrels).name})")


def _labels(names: Sequence[str]) -> dict[str, str]:
    """Short column labels: a model folder's name, unless two models would share it."""
    short = {name: Path(name).name or name for name in names}
    if len(set(short.values())) < len(names):
        return {name: name for name in names}
    return short
