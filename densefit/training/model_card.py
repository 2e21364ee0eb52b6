"""The ``README.md`` of every saved model folder, written from the run's own records.

Every number on the card comes from the :class:`~densefit.training.loop.TrainResult` (steps,
time, data, memory plan, evaluations during training) and the
:class:`~densefit.config.TrainConfig`; none is typed by hand. The "Training options" table
lists every TrainConfig field that differs from its default, with the help text it was
declared with, so an option added to TrainConfig shows up here without editing this module.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from densefit._version import __version__
from densefit.config.options import declared_options
from densefit.config.train import TrainConfig
from densefit.models import resolve_device

__all__ = ["CARD_NAME", "model_card", "write_model_card"]

CARD_NAME = "README.md"
# The fields that configure the loss, shown beside its name.


def write_model_card(
    folder: str | os.PathLike, model: Any, config: TrainConfig, result: Any = None
) -> Path:
    """Write ``folder/README.md`` (see :func:`model_card`); returns its path."""
    path = Path(folder) / CARD_NAME
    path.write_text(model_card(model, config, result, location=str(folder)), encoding="utf-8")
    return path


def model_card(model: Any, config: TrainConfig, result: Any = None, *, location: str = ".") -> str:
    """The model card as Markdown: front matter, data, training, options, evaluation, usage.

    ``result`` is the run's :class:`~densefit.training.loop.TrainResult` (None: a model saved
    without a run, e.g. ``Retriever.save``); ``location`` is where the model is loaded from in
    the usage examples.

    >>> from densefit.testing import tiny_model
    >>> card = model_card(tiny_model(), TrainConfig(batch_size=8))
    >>> "| `batch_size` | 8 |" in card
    True
    """
    base = getattr(result, "base_model", None)
    lines = [
        "---",
        "library_name: sentence-transformers",
        "pipeline_tag: sentence-similarity",
        "tags: [sentence-transformers, sentence-similarity, densefit]",
        *([f"base_model: {json.dumps(base)}"] if base else []),
        "---",
        "",
        f"# {Path(location).resolve().name}",
        "",
        "A sentence-transformers bi-encoder"
        + (f" fine-tuned from `{base}`" if base else "")
        + f" with densefit {__version__}.",
    ]
    sections = [lines]
    if result is not None:
        sections += [_data(result), _training(config, result)]
        if getattr(result, "sources", None):
            sections.append(_sources(config, result))
    sections.append(_options(config, result))
    evaluation = getattr(result, "evaluation", None)
    if evaluation:
        sections.append(_evaluation(evaluation))
    sections.append(_usage(model, location))
    return "\n\n".join("\n".join(s) for s in sections) + "\n"


def _data(result: Any) -> list[str]:
    data = result.data or {}
    skipped = data.get("skipped_rows")
    files = ", ".join(f"`{f}`" for f in data.get("files", [])) or "(in memory)"
    return [
        "## Training data",
        "",
        "| files | rows | skipped rows |",
        "|---|---|---|",
        f"| {files} | {data.get('rows', result.examples)} | "
        f"{'not recorded' if skipped is None else skipped} |",
    ]


def _sources(config: TrainConfig, result: Any) -> list[str]:
    """Several sources: each one's files, rows, steps, trained rows and loss."""
    files = {s["name"]: s.get("files", []) for s in (result.data or {}).get("sources", [])}
    mixed = config.source_batches == "mixed"
    how = (
        "the rows of all sources shuffled together (`source_batches: mixed`)"
        if mixed
        else f"each step's rows from one source, interleaved `{config.source_sampling}`"
        + (f" (temperature {config.source_temperature:g})" if
           config.source_sampling == "temperature" else "")
    )  # fmt: skip
    lines = [
        "## Training sources",
        "",
        f"{len(result.sources)} sources, {how}.",
        "",
        "| source | files | rows | steps | rows trained | mean loss | last loss |",
        "|---|---|---|---|---|---|---|",
    ]
    shown = lambda v, fmt="{}": "n/a" if v is None else fmt.format(v)  # noqa: E731
    for name, s in result.sources.items():
        where = ", ".join(f"`{f}`" for f in files.get(name, [])) or "(in memory)"
        lines.append(
            f"| {name} | {where} | {s['rows']} | {shown(s['steps'])} | {s['trained_rows']} | "
            f"{shown(s['mean_loss'], '{:.4f}')} | {shown(s['last_loss'], '{:.4f}')} |"
        )
    return lines


def _training(config: TrainConfig, result: Any) -> list[str]:
    options = ", ".join(  # the options declared in the loss's group, beside the loss
        f"{f.name}={getattr(config, f.name)}"
        for f, opt in declared_options(TrainConfig)
        if opt.group == "Loss" and f.name != "loss"
    )
    plan = result.plan or {}
    shown = ("strategy", "chunk_size", "token_budget", "keep_graphs", "loss_block_size")
    memory = ", ".join(f"{k} {plan[k]}" for k in shown if plan.get(k) is not None)
    return [
        "## Training",
        "",
        "| loss | batch size | learning rate | memory plan | steps | examples | time | final loss |",
        "|---|---|---|---|---|---|---|---|",
        f"| {config.loss} ({options}) | {config.batch_size} | {_learning_rate(config, plan)} | "
        f"{memory or 'n/a'} | "
        f"{result.steps} | {result.examples} | {result.seconds:.1f} s | "
        f"{result.final_loss:.4f} |",
        *(
            ["", f"{result.skipped_nonfinite} step(s) skipped for a non-finite loss or gradient."]
            if result.skipped_nonfinite
            else []
        ),
    ]


def _learning_rate(config: TrainConfig, plan: dict) -> str:
    """``8e-05 (auto)`` or ``3e-05``: the peak learning rate the run used."""
    auto = " (auto)" if plan.get("learning_rate_from") == "auto" else ""
    return f"{config.peak_learning_rate:.3g}{auto}"


def _options(config: TrainConfig, result: Any = None) -> list[str]:
    """Every field that differs from its default, with its declared help. A default that
    resolves on this machine (``device="auto"``) or from the run (``learning_rate="auto"``,
    which the run records) counts as the default."""
    defaults = TrainConfig(device=resolve_device("auto"))  # device "auto" as resolved here
    auto_lr = ((getattr(result, "plan", None) or {}).get("learning_rate_from")) == "auto"
    rows = []
    for f, opt in declared_options(TrainConfig):
        value = getattr(config, f.name)
        if not opt.cli or f.default is dataclasses.MISSING:
            continue
        if value in (f.default, getattr(defaults, f.name)) or (
            f.name == "learning_rate" and auto_lr
        ):
            continue
        shown = json.dumps(value, default=str) if not isinstance(value, str) else value
        rows.append(f"| `{f.name}` | {shown} | {opt.help} |")
    if not rows:
        return ["## Training options", "", "Every option at its default."]
    return [
        "## Training options",
        "",
        "Options that differ from densefit's defaults:",
        "",
        "| option | value | meaning |",
        "|---|---|---|",
        *rows,
    ]


def _evaluation(ev: dict) -> list[str]:
    """The during-training table: base (step 0), best and final evaluations."""
    history = ev["history"]
    by_step = {h["step"]: h for h in history}
    columns = [("base (step 0)", by_step.get(0))]
    if ev.get("best_step") is not None:
        columns.append((f"best (step {ev['best_step']})", by_step.get(ev["best_step"])))
    if history:
        columns.append((f"final (step {history[-1]['step']})", history[-1]))
    columns = [(name, h) for name, h in columns if h is not None]
    corpus = ev.get("corpus", {})
    searched = (
        f"{corpus.get('documents')} of {corpus.get('corpus_documents')} documents (every judged "
        f"document + {corpus.get('distractors')} random others, seed {corpus.get('sample_seed')})"
        if corpus.get("kind") == "subsample"
        else f"the whole corpus ({corpus.get('documents')} documents)"
    )
    lines = [
        "## Evaluation during training",
        "",
        f"`{ev['data']}`, split `{ev['split']}`: {ev.get('queries')} queries searched over "
        f"{searched}; {len(history)} evaluations.",
        "",
        "| metric | " + " | ".join(name for name, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for metric in history[0]["eval"] if history else []:
        values = " | ".join(f"{h['eval'][metric]:.4f}" for _, h in columns)
        lines.append(f"| {metric} | {values} |")
    notes = []
    if ev.get("kept_best"):
        notes.append(
            f"This model is the best step by {ev['metric']} (step {ev['best_step']}), kept "
            "with `keep_best`."
        )
    if ev.get("stopped_early"):
        notes.append(f"Training stopped early after step {ev['final_step']} (patience).")
    return lines + (["", " ".join(notes)] if notes else [])


def _usage(model: Any, location: str) -> list[str]:
    prompts = {k: v for k, v in (getattr(model, "prompts", None) or {}).items() if v}
    query = ', prompt_name="query"' if "query" in prompts else ""
    lines = [
        "## Usage",
        "",
        "sentence-transformers:",
        "",
        "```python",
        "from sentence_transformers import SentenceTransformer",
        "",
        f"model = SentenceTransformer({location!r})",
        f'embeddings = model.encode(["how do cells divide?"]{query})',
        "```",
        "",
        "Haystack 3 (`pip install sentence-transformers-haystack`):",
        "",
        "```python",
        "from haystack_integrations.components.embedders.sentence_transformers import (",
        "    SentenceTransformersDocumentEmbedder,",
        "    SentenceTransformersTextEmbedder,",
        ")",
        "",
        f"document_embedder = SentenceTransformersDocumentEmbedder(model={location!r}"
        + (f", prefix={prompts['document']!r}" if "document" in prompts else "")
        + ")",
        f"query_embedder = SentenceTransformersTextEmbedder(model={location!r}"
        + (f", prefix={prompts['query']!r}" if "query" in prompts else "")
        + ")",
        "```",
    ]
    if prompts:
        shown = ", ".join(f"{k}: {v!r}" for k, v in prompts.items())
        lines += ["", f"The model stores its prompts ({shown}); apply them as shown."]
    return lines
