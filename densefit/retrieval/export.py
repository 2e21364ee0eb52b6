"""Export a model's transformer for the inference runtimes, and check every file it writes.

:func:`export_model` writes into a sentence-transformers model folder, in sentence-transformers'
own layout, so ``SentenceTransformer(folder, backend="onnx", model_kwargs={"file_name":
"onnx/model_qint8_avx512_vnni.onnx"})`` loads the files where its ONNX backend is installed:

- ``onnx``: ``onnx/model.onnx``, fp32 (``torch.onnx.export``; inputs ``input_ids``,
  ``attention_mask`` [, ``token_type_ids``], output ``last_hidden_state``).
- ``onnx-int8``: ``onnx/model_qint8_<isa>.onnx``: ONNX Runtime's dynamic quantization of the
  weight matrices (MatMul with a constant weight) to int8 *per output channel*, activations
  quantized per batch; ``reduce_range`` where the CPU lacks VNNI (ONNX Runtime's advice:
  its AVX2/AVX-512 u8s8 kernels can saturate). Per-tensor weights (``quantize_dynamic``'s
  default) drift to a mean cosine of about 0.94 against fp32 on MiniLM; per channel keeps
  about 0.995 (the recipes and their measured cost: ``bench/results/inference_quality.*``).
  Recipes are tried in :data:`INT8_RECIPES` order and the first whose check passes is kept:
  the last one leaves the FFN down-projections (the widest-ranging activations) in fp32.
- ``openvino`` / ``openvino-int8``: ``openvino/openvino_model.xml`` (converted from the ONNX
  file) and ``openvino/openvino_model_qint8_quantized.xml`` (NNCF post-training quantization,
  ``ModelType.TRANSFORMER``, calibrated on real texts), with the ``openvino`` and ``nncf``
  packages.

**The check.** Every file is checked against the torch model on texts like the ones it will
embed: ``calibration`` (a training-data file, a corpus, a BEIR folder, or texts), by default
the model's training data (``densefit train --export``, or the data a densefit-trained model
folder records). The check measures how far the file's vectors are from torch's, not retrieval
quality, so the training texts serve; OpenVINO's int8 file calibrates on a third of the
documents and is checked on the others. It records, in ``densefit_export.json`` beside the
files, the cosine between each text's vector from the file and from torch (mean, min), and the
overlap of the top 10 documents per query against torch's, with queries and documents from the
file (``top10_overlap``) and mixed with torch's (``top10_overlap_mixed``: fp32 queries on the
file's documents and the reverse, the worse of the two). An fp32 file passes when every cosine
is at least ``1 - 1e-5``; a quantized one when the mean cosine and the top-10 overlap reach
:data:`MIN_COSINE` and :data:`MIN_TOP10_OVERLAP`; it *agrees with fp32* (a store may be queried
across the two, :func:`densefit.retrieval.vector_source.disagreement`) when the mixed overlap does
too. A file that fails is deleted and the export raises :class:`ExportCheckError` with the
numbers (``on_check_failure="warn"``: kept, recorded as failed, never picked by ``auto``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import platform
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from densefit.choices import DEFAULT_INT8_RECIPES, EXPORT_TARGETS, ON_CHECK_FAILURE
from densefit.choices import INT8_RECIPES as INT8_RECIPE_NAMES
from densefit.config.train import training_data_record
from densefit.data.corpus import read_corpus
from densefit.data.sources import load_training_examples
from densefit.models import load_model, model_similarity
from densefit.prompts import model_prompts
from densefit.retrieval.encode import encode_texts
from densefit.retrieval.runtimes import (
    FOLDERS,
    FP32,
    FP32_COSINE,
    MANIFEST,
    Runtime,
    check_supported,
    export_onnx,
    fp32_agreement,
    model_folder,
    no_openvino_telemetry,
    now,
    read_manifest,
    runtime_inputs,
    sha256_of_file,
    weights_digest,
    write_manifest_entry,
)

__all__ = [
    "DEFAULT_INT8_RECIPES",
    "EXPORT_TARGETS",
    "INT8_RECIPES",
    "MIN_COSINE",
    "MIN_TOP10_OVERLAP",
    "CheckTexts",
    "ExportCheckError",
    "ExportReport",
    "check_runtime",
    "check_texts",
    "export_model",
    "file_name",
]

# A quantized file passes its check when its vectors keep this mean cosine to torch's and
# its top 10 per query overlaps torch's by this much. Measured (bench/results/
# inference_quality.json, MiniLM on SciFact/NFCorpus/manpages): quantize_dynamic's default
# (per-tensor weights) reaches cosine ~0.94 and overlap ~0.8 and costs ~0.016 nDCG@10; the
# per-channel recipe ~0.995 and ~0.9, within the 0.005 nDCG@10 target.
MIN_COSINE = 0.99
MIN_TOP10_OVERLAP = 0.85
# The int8 recipes of ONNX Runtime's dynamic quantization: its options per name. The first two
# are the export's (tried in that order until one passes its check); both quantize MatMuls
# with a constant weight only (never the attention products, the embeddings' Gather or the
# output), weights per output channel. The last two are the per-tensor baselines the
# benchmark compares them with (``dynamic-default``: quantize_dynamic's defaults).
INT8_RECIPES = dict(
    zip(
        INT8_RECIPE_NAMES,
        (
            {"per_channel": True, "keep_ffn_out": False, "ops": ["MatMul"]},
            {"per_channel": True, "keep_ffn_out": True, "ops": ["MatMul"]},
            {"per_channel": False, "keep_ffn_out": False, "ops": ["MatMul"]},
            {"per_channel": False, "keep_ffn_out": False, "ops": None},
        ),
        strict=True,
    )
)
_CHECK_QUERIES = 200
_CHECK_DOCUMENTS = 800
_CALIBRATION_TEXTS = 300  # OpenVINO's static quantization: texts it measures ranges on


class ExportCheckError(ValueError):
    """An exported file ranks differently from the model beyond the threshold."""


@dataclass
class CheckTexts:
    """The texts the check embeds: queries and the documents they search; ``source`` says
    where they came from."""

    queries: list[str]
    documents: list[str]
    source: str = "texts"


@dataclass
class ExportReport:
    """What :func:`export_model` wrote: per runtime its file, recipe and check."""

    folder: str
    exports: dict = field(default_factory=dict)  # runtime -> manifest record
    seconds: float = 0.0

    def summary(self) -> str:
        """One line: the texts of the check, then each file with its check's numbers."""
        checks = [record.get("check", {}) for record in self.exports.values()]
        texts = next((c["texts"] for c in checks if "texts" in c), "probe texts")
        parts = []
        for name, record in self.exports.items():
            check = record.get("check", {})
            state = "passed" if record.get("passed") else "FAILED"
            numbers = ", ".join(
                f"{k} {check[k]}"
                for k in ("cosine_mean", "cosine_min", "top10_overlap", "top10_overlap_mixed")
                if k in check
            )
            parts.append(f"{name}: {FOLDERS[name]}/{record['file']} ({state}; {numbers})")
        files = "; ".join(parts)
        return f"{self.folder}: checked on {texts}; {files}; {self.seconds:.1f}s"


def file_name(runtime: str) -> str:
    """The file a runtime's export is written to, in its folder, as sentence-transformers
    names it.

    >>> file_name("onnx")
    'model.onnx'
    >>> file_name("openvino-int8")
    'openvino_model_qint8_quantized.xml'
    """
    return {
        "onnx": "model.onnx",
        "onnx-int8": f"model_qint8_{cpu_isa()}.onnx",
        "openvino": "openvino_model.xml",
        "openvino-int8": "openvino_model_qint8_quantized.xml",
    }[runtime]


def cpu_isa() -> str:
    """The instruction set int8 files are made for: ``avx512_vnni``, ``avx512``, ``avx2`` or
    ``arm64`` (sentence-transformers' names)."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "arm64"
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="ignore")
    except OSError:
        return "avx2"
    if "avx512_vnni" in flags or "amx_int8" in flags:
        return "avx512_vnni"
    return "avx512" if "avx512f" in flags else "avx2"


# ----------------------------------------------------------------------------- texts


def check_texts(source, *, split: str = "train", seed: int = 0) -> CheckTexts:
    """The texts of a check from ``source``: training data (a file, a BEIR folder's
    ``split`` with corpus documents added as distractors, a list of rows), a corpus file, a
    list of texts (every fifth text's first 12 words become a query), or :class:`CheckTexts`.
    At most 200 queries and 800 documents, drawn with ``seed``.

    >>> texts = check_texts([f"text {i} about cells dividing fast" for i in range(12)])
    >>> len(texts.queries), len(texts.documents)
    (3, 12)
    """
    if isinstance(source, CheckTexts):
        return _capped(source, seed)
    if isinstance(source, (str, os.PathLike)):
        return _capped(_texts_from_path(Path(source), split), seed)
    rows = list(source)
    if rows and all(isinstance(r, str) for r in rows):
        queries = [" ".join(t.split()[:12]) for t in rows[::5]]
        return _capped(CheckTexts(queries, rows, "texts"), seed)

    examples = load_training_examples(rows)
    return _capped(_from_examples(examples, "training rows"), seed)


def _texts_from_path(path: Path, split: str) -> CheckTexts:

    if path.is_dir() and any(path.glob("corpus.jsonl*")):
        texts = _from_examples(load_training_examples(path, split=split), f"{path} ({split})")
        corpus, _ = read_corpus(path)
        texts.documents += [d.text for d in corpus]
        return texts
    try:
        return _from_examples(load_training_examples(path), str(path))
    except ValueError as training_error:
        try:
            corpus, _ = read_corpus(path)
        except ValueError:
            raise ValueError(
                f"--calibration {path}: neither training data nor a corpus ({training_error})"
            ) from None
        texts = [d.text for d in corpus]
        return CheckTexts([" ".join(t.split()[:12]) for t in texts[::5]], texts, str(path))


def _from_examples(examples, source: str) -> CheckTexts:
    queries = list(dict.fromkeys(e.query for e in examples))
    documents = list(dict.fromkeys(t for e in examples for t in (e.positive, *e.negatives)))
    return CheckTexts(queries, documents, source)


def _capped(texts: CheckTexts, seed: int) -> CheckTexts:
    queries = list(dict.fromkeys(t for t in texts.queries if t.strip()))
    documents = list(dict.fromkeys(t for t in texts.documents if t.strip()))
    rng = random.Random(seed)
    if len(queries) > _CHECK_QUERIES:
        queries = rng.sample(queries, _CHECK_QUERIES)
    if len(documents) > _CHECK_DOCUMENTS:
        # The documents of the drawn queries' pairs come first in the source order; keep the
        # first half of the cap in order (positives), draw the rest (distractors).
        head = documents[: _CHECK_DOCUMENTS // 2]
        documents = head + rng.sample(documents[len(head) :], _CHECK_DOCUMENTS - len(head))
    if not queries or len(documents) < 10:
        raise ValueError(
            f"--calibration {texts.source}: {len(queries)} queries and {len(documents)} "
            "documents; the check needs at least 1 query and 10 documents"
        )
    return CheckTexts(queries, documents, texts.source)


# ----------------------------------------------------------------------------- the check


def check_runtime(model, runtime: Runtime, texts: CheckTexts, *, reference=None) -> dict:
    """How ``runtime``'s vectors agree with torch's on ``texts``: cosine (mean, min, 1st
    percentile) and top-10 overlap, same-runtime and mixed; ``reference``: torch's
    ``(queries, documents)`` vectors when already made.

    >>> from densefit.testing import tiny_model
    >>> from densefit.retrieval.runtimes import TORCH
    >>> texts = check_texts([f"text number {i} about cells" for i in range(20)])
    >>> check_runtime(tiny_model(), TORCH, texts)["cosine_min"]
    1.0
    """

    def embed(r):
        q = encode_texts(model, texts.queries, prompt_name="query", runtime=r, batch_size=32)
        d = encode_texts(model, texts.documents, prompt_name="document", runtime=r, batch_size=32)
        return q, d

    started = time.perf_counter()
    ref_q, ref_d = reference if reference is not None else embed("torch")
    our_q, our_d = embed(runtime)
    ours, theirs = np.concatenate([our_q, our_d]), np.concatenate([ref_q, ref_d])
    cosine = np.sum(_unit(ours) * _unit(theirs), axis=1)
    if model_similarity(model) == "cosine":
        ref_q, ref_d, our_q, our_d = map(_unit, (ref_q, ref_d, our_q, our_d))
    k = min(10, len(texts.documents))
    truth = _top(ref_q, ref_d, k)
    mixed = min(_overlap(_top(ref_q, our_d, k), truth), _overlap(_top(our_q, ref_d, k), truth))
    return {
        "texts": f"{len(texts.queries)} queries, {len(texts.documents)} documents from "
        f"{texts.source}",
        "cosine_mean": round(float(cosine.mean()), 6),
        "cosine_min": round(float(cosine.min()), 6),
        "cosine_p01": round(float(np.percentile(cosine, 1)), 6),
        "top10_overlap": round(_overlap(_top(our_q, our_d, k), truth), 4),
        "top10_overlap_mixed": round(mixed, 4),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _top(queries: np.ndarray, documents: np.ndarray, k: int) -> np.ndarray:
    scores = queries @ documents.T  # (q, d)
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(set(x) & set(y)) / len(y) for x, y in zip(a, b, strict=True)]))


def _verdict(name: str, check: dict) -> tuple[bool, bool]:
    """(passed, agrees_with_fp32) of a check."""
    if name in ("onnx", "openvino"):
        exact = check["cosine_min"] >= FP32_COSINE
        return exact, exact
    passed = check["cosine_mean"] >= MIN_COSINE and check["top10_overlap"] >= MIN_TOP10_OVERLAP
    return passed, passed and check["top10_overlap_mixed"] >= MIN_TOP10_OVERLAP


# ----------------------------------------------------------------------------- export


def export_model(
    model,
    to: str | Sequence[str] = ("onnx", "onnx-int8"),
    *,
    folder: str | os.PathLike | None = None,
    calibration=None,
    on_check_failure: str = "error",
    show_progress: bool = False,
    int8_recipes: Sequence[str] = DEFAULT_INT8_RECIPES,
) -> ExportReport:
    """Write ``model``'s runtime files into ``folder`` (default: the folder it was loaded
    from) and check each against the model (see the module docstring).

    ``model``: a SentenceTransformer or a model name/folder. ``to``: runtimes of
    :data:`EXPORT_TARGETS` (``onnx/model.onnx`` is written with any of them: the others are
    made from it). ``calibration``: the texts of the check (:func:`check_texts`); without it a
    quantized target is checked on the training data the model's folder records (a folder
    densefit trained), an fp32 one on probe texts.
    ``folder`` other than the model's own gets the sentence-transformers model saved first.
    ``on_check_failure``: ``"error"`` (delete the file, raise :class:`ExportCheckError`) or
    ``"warn"`` (keep it, recorded as failed). ``int8_recipes``: the :data:`INT8_RECIPES`
    ``onnx-int8`` tries, in order, keeping the first that passes.

    >>> from densefit.testing import tiny_model
    >>> report = export_model(tiny_model(), "onnx", folder=tempfile.mkdtemp())  # doctest: +SKIP
    """
    started = time.perf_counter()
    targets = _targets(to)
    unknown = [r for r in int8_recipes if r not in INT8_RECIPES]
    if unknown or not int8_recipes:
        raise ValueError(
            f"int8 recipes {unknown or '(none)'}: use one or more of {', '.join(INT8_RECIPES)}"
        )
    if on_check_failure not in ON_CHECK_FAILURE:
        raise ValueError(
            f"--on-check-failure {on_check_failure!r}: use one of {', '.join(ON_CHECK_FAILURE)}"
        )
    if isinstance(model, (str, os.PathLike)):
        model = load_model(model, device="cpu")
    for name in targets:
        check_supported(model, name)
    out = _output_folder(model, folder)
    texts = _texts_for(targets, calibration, model_folder(model))
    digest = weights_digest(model)
    report = ExportReport(str(out))
    reference = None
    if texts is not None:
        reference = (
            encode_texts(model, texts.queries, prompt_name="query", batch_size=32),
            encode_texts(model, texts.documents, prompt_name="document", batch_size=32),
        )
    fp32_onnx = out / "onnx" / file_name("onnx")
    with _progress(len(targets), show_progress) as bar:
        for name in targets:
            bar.set_description(f"Exporting {name}")
            record = _export_one(
                model, name, out, fp32_onnx, texts, reference, digest, tuple(int8_recipes),
                show_progress,
            )  # fmt: skip
            report.exports[name] = record
            if not record["passed"]:
                _refuse(name, out, record, on_check_failure)
            bar.update(1)
    report.seconds = time.perf_counter() - started
    return report


def _targets(to) -> list[str]:
    names = [to] if isinstance(to, str) else list(to)
    names = [n.strip() for part in names for n in part.split(",") if n.strip()]
    bad = [n for n in names if n not in EXPORT_TARGETS]
    if bad or not names:
        raise ValueError(
            f"--to {','.join(bad) or '(none)'}: export to one or more of "
            f"{', '.join(EXPORT_TARGETS)}"
        )
    order = {n: i for i, n in enumerate(EXPORT_TARGETS)}
    # onnx/model.onnx first: every other file is made from it.
    return sorted(set(names) | {"onnx"}, key=order.__getitem__)


def _output_folder(model, folder) -> Path:
    own = model_folder(model)
    if folder is None:
        if own is None:
            raise ValueError(
                "the model was not loaded from a folder: pass the folder to export into "
                "(--output DIR; folder= in Python)"
            )
        return own
    out = Path(folder).expanduser()
    if own is not None and out.resolve() == own.resolve():
        return own
    if out.exists() and any(out.iterdir()):
        if not (out / "modules.json").is_file():
            raise ValueError(
                f"{out} exists, is not empty and holds no sentence-transformers model: pick a "
                "new or empty folder, or the model's own folder"
            )

        if weights_digest(load_model(out, device="cpu")) != weights_digest(model):
            raise ValueError(
                f"{out} holds another model (other weights): export into the model's own "
                "folder, or a new or empty one"
            )
        return out
    model.save(str(out), safe_serialization=True)
    return out


def _texts_for(targets: list[str], calibration, folder: Path | None) -> CheckTexts | None:
    """The check's texts: ``calibration``'s (named as the model's training data when they
    are), else for a quantized target the training data ``folder`` records, else None."""
    recorded = training_data_record(folder) if folder is not None else None
    if calibration is not None:
        texts = check_texts(calibration)
        if recorded and _is_recorded(calibration, recorded):
            texts.source += " (the model's training data)"
        return texts
    quantized = [t for t in targets if t.endswith("int8")]
    if not quantized:
        return None
    if recorded is None:
        raise ValueError(
            f"--to {','.join(quantized)}: a quantized export is checked on texts like the ones "
            f"it will embed, and {folder or 'the model'} records no training data (a model "
            "densefit trained on files does): pass --calibration DATA (training pairs, a "
            "corpus or a BEIR folder)"
        )
    missing = [p for p in recorded["paths"] if not Path(p).exists()]
    if missing:
        raise ValueError(
            f"--to {','.join(quantized)}: the check reads the model's training data, and "
            f"{missing[0]} is not there any more: pass --calibration DATA (training pairs, a "
            "corpus or a BEIR folder)"
        )
    split = recorded.get("split") or "train"
    parts = [_texts_from_path(Path(p), split) for p in recorded["paths"]]
    where = ", ".join(recorded["paths"])
    return _capped(
        CheckTexts(
            [q for t in parts for q in t.queries],
            [d for t in parts for d in t.documents],
            f"the model's training data ({where})",
        ),
        0,
    )


def _is_recorded(calibration, recorded: dict) -> bool:
    """``calibration`` is (one of) the files or folders the model was trained on."""
    if not isinstance(calibration, (str, os.PathLike)):
        return False
    return str(Path(calibration).resolve()) in recorded["paths"]


def _export_one(
    model, name, out: Path, fp32_onnx: Path, texts, reference, digest, recipes: tuple,
    show_progress: bool = False,
) -> dict:  # fmt: skip
    """Write ``name``'s file, check it, record it in the manifest; the record."""
    sub = out / FOLDERS[name]
    path = sub / file_name(name)
    started = time.perf_counter()
    tried: list[dict] = []
    if name == "onnx":
        export_onnx(model, path)
        recipe = {"method": "torch.onnx.export", "precision": "fp32"}
        check = _check_file(model, name, path, texts, reference)
    elif name == "onnx-int8":
        recipe, check = {}, {}
        for recipe_name in recipes:
            recipe = _quantize_onnx(fp32_onnx, path, **INT8_RECIPES[recipe_name])
            recipe["recipe"] = recipe_name
            check = _check_file(model, name, path, texts, reference)
            tried.append({"recipe": recipe_name, **check})
            if _verdict(name, check)[0]:
                break
    elif name == "openvino":
        recipe = _convert_openvino(fp32_onnx, path)
        check = _check_file(model, name, path, texts, reference)
    else:
        calibration, held_out = _split(texts)
        recipe = _quantize_openvino(model, fp32_onnx, path, calibration, show_progress)
        texts_, reference_ = held_out
        check = _check_file(model, name, path, texts_, reference_)
    passed, agrees = _verdict(name, check)
    sha = sha256_of_file(path)
    record = {
        "runtime": name,
        "file": path.name,
        "sha256": sha,
        "family": FP32 if name in ("onnx", "openvino") else f"int8:{sha[:16]}",
        "weights_sha256": digest,
        "quantization": recipe,
        "check": check,
        "thresholds": _thresholds(name),
        "passed": passed,
        "agrees_with_fp32": agrees,
        "created": now(),
        "seconds": round(time.perf_counter() - started, 1),
        "versions": _versions(name),
    }
    if tried:
        record["recipes_tried"] = tried
    write_manifest_entry(sub, record)
    return record


def _check_file(model, name, path: Path, texts, reference) -> dict:

    runtime = Runtime.from_file(name, path)
    if texts is None:  # fp32 without calibration: the probe texts
        return {"texts": "probe texts", "cosine_min": round(fp32_agreement(model, runtime), 6)}
    return check_runtime(model, runtime, texts, reference=reference)


def _thresholds(name: str) -> dict:
    if name in ("onnx", "openvino"):
        return {"cosine_min": FP32_COSINE}
    return {"cosine_mean": MIN_COSINE, "top10_overlap": MIN_TOP10_OVERLAP}


def _refuse(name: str, out: Path, record: dict, on_check_failure: str) -> None:
    check = record["check"]
    numbers = ", ".join(f"{k} {v}" for k, v in check.items() if isinstance(v, (int, float)))
    message = (
        f"{out / FOLDERS[name] / record['file']}: {name} ranks differently from the model "
        f"({numbers}; needs {record['thresholds']})"
    )
    if on_check_failure == "warn":
        warnings.warn(message + ": kept, recorded as failed (auto never picks it)", stacklevel=3)
        return
    sub = out / FOLDERS[name]
    for path in (sub / record["file"], (sub / record["file"]).with_suffix(".bin")):
        if path.exists() and path.suffix in (".onnx", ".xml", ".bin"):
            path.unlink()
    data = read_manifest(sub)
    data["files"].pop(record["file"], None)

    (sub / MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    raise ExportCheckError(
        message + ": not kept. Calibrate on texts like the ones you will embed "
        "(--calibration), export fp32 (--to onnx), or keep it anyway with "
        "--on-check-failure warn"
    )


def _versions(name: str) -> dict:
    import onnxruntime  # the optional extra onnx

    versions = {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__}
    if name.startswith("openvino"):
        import openvino  # the optional extra openvino

        versions["openvino"] = openvino.__version__
    return versions


def _progress(total: int, show: bool):

    return tqdm(total=total, desc="Exporting", unit="file", disable=not show)


# ----------------------------------------------------------------------------- recipes


def down_projections(onnx_model) -> list[str]:
    """The MatMul nodes whose constant weight narrows its input (``(K, N)``, ``K > N``): the
    FFN down-projections of a transformer layer, whose inputs (after the activation) range
    widest and lose most to int8."""
    weights = {init.name: tuple(init.dims) for init in onnx_model.graph.initializer}
    found = []
    for node in onnx_model.graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2:
            continue
        shape = weights.get(node.input[1])
        if shape is not None and len(shape) == 2 and shape[0] > shape[1]:
            found.append(node.name)
    return found


def _quantize_onnx(
    source: Path, path: Path, *, per_channel: bool, keep_ffn_out: bool, ops: list | None
) -> dict:
    """Dynamic int8 quantization of ``source`` (one of :data:`INT8_RECIPES`' options)."""
    import onnx  # the optional extra onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic  # the optional extra onnx

    excluded = down_projections(onnx.load(str(source))) if keep_ffn_out else []
    reduce_range = cpu_isa() not in ("avx512_vnni", "arm64")
    logging.disable(logging.WARNING)  # its advice to pre-process: the check measures the result
    try:
        quantize_dynamic(
            str(source),
            str(path),
            op_types_to_quantize=ops,
            per_channel=per_channel,
            reduce_range=reduce_range,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=excluded,
            extra_options={"MatMulConstBOnly": True},
        )
    finally:
        logging.disable(logging.NOTSET)
    return {
        "method": "onnxruntime.quantization.quantize_dynamic",
        "weights": f"int8, {'per output channel' if per_channel else 'per tensor'}",
        "activations": "uint8, per batch (dynamic)",
        "operators": ["MatMul with a constant weight"] if ops else "quantize_dynamic's default",
        "reduce_range": reduce_range,
        "fp32_nodes": excluded,
        "isa": cpu_isa(),
    }


def _convert_openvino(source: Path, path: Path) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    with no_openvino_telemetry():
        import openvino as ov  # the optional extra openvino

        ov.save_model(ov.convert_model(str(source)), str(path), compress_to_fp16=False)
    return {"method": "openvino.convert_model", "precision": "fp32"}


def _split(texts: CheckTexts) -> tuple[list[str], tuple]:
    """Calibration texts for static quantization, and the held-out rest for the check."""
    rng = random.Random(1)
    docs = list(texts.documents)
    rng.shuffle(docs)
    n = min(_CALIBRATION_TEXTS, len(docs) // 3)
    calibration = docs[:n] + texts.queries[: n // 4]
    held = CheckTexts(texts.queries, docs[n:], texts.source + " (calibration texts held out)")
    return calibration, (held, None)


def _quantize_openvino(
    model, source: Path, path: Path, calibration: list[str], show_progress: bool = False
) -> dict:
    """NNCF's post-training int8 quantization for transformers, calibrated on real texts.
    NNCF draws its bars on stdout, where results go (``--json``): on stderr with
    ``show_progress``, else nowhere."""
    names = runtime_inputs(model)
    prompt = model_prompts(model).get("document", "")
    items = [model.preprocess([prompt + t]) for t in calibration]  # one text each: no padding
    bars = sys.stderr if show_progress else io.StringIO()
    with no_openvino_telemetry():
        import nncf  # the optional extra openvino (nncf)
        import openvino as ov  # the optional extra openvino

        dataset = nncf.Dataset(items, lambda f: {k: f[k].numpy().astype(np.int64) for k in names})
        network = ov.convert_model(str(source))
        with tempfile.TemporaryDirectory(), contextlib.redirect_stdout(bars):
            quantized = nncf.quantize(
                network, dataset, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(items)
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        ov.save_model(quantized, str(path))
    return {
        "method": "nncf.quantize (ModelType.TRANSFORMER)",
        "calibration_texts": len(items),
        "precision": "int8 weights and activations, static",
    }
