"""Inference runtimes: the model's transformer run by PyTorch, ONNX Runtime or OpenVINO.

A runtime computes one thing, the transformer's token embeddings; everything else a model
does stays in its sentence-transformers modules (pooling, Dense, Normalize), run after it as
``SentenceTransformer.forward`` runs them, so tokenization, prompts, pooling, Matryoshka
truncation and dedup are the same whatever runs the transformer
(:mod:`densefit.retrieval.encode`).

The runtimes (:data:`densefit.choices.RUNTIMES`):

- ``torch``: the model itself, PyTorch eager.
- ``onnx``: the transformer exported with ``torch.onnx.export``, run by ONNX Runtime, fp32.
  It reproduces torch to ~1e-7 cosine; without an exported file for the model's current
  weights it is exported in memory on first use (seconds; checked against torch on probe
  texts).
- ``onnx-int8``: an int8 export (dynamic quantization of the weight matrices, per output
  channel), written and checked by :func:`densefit.retrieval.export.export_model`. Lossy: it is used only
  from a file whose recorded check passed and whose weights are the model's.
- ``openvino`` / ``openvino-int8``: the same with OpenVINO (int8: NNCF post-training
  quantization calibrated on real texts), when the ``openvino`` package is installed.

Exported files live in the model folder in sentence-transformers' layout (``onnx/model.onnx``,
``onnx/model_qint8_avx512_vnni.onnx``, ``openvino/openvino_model.xml``...), each folder with a
``densefit_export.json`` recording, per file, the weights it was made from, its quantization
and its self-check (:func:`exports_of`). ``auto`` picks the first of :data:`AUTO_ORDER` that is
exported for the current weights and passed its check, else torch.

Which runtimes may be mixed (:func:`disagreement`): vectors belong to a *family*: ``fp32``
(torch and every fp32 export, equal to 1e-5 cosine), one quantized file (its sha256), or torch
at a half precision (``fp16``, ``bf16``). A store's documents are written by one family only;
queries may come from another family only when one side is fp32 and the other side's check
found that fp32 queries against its documents (and the reverse) rank the same
(``agrees_with_fp32``).

Precision (:data:`densefit.choices.PRECISIONS`, ``--precision``): the torch runtime runs the
transformer in fp32, or in fp16 / bf16 from a cast copy of its weights (:func:`set_precision`
on the model; the store records it in :class:`VectorSource`). ``auto`` is the device's
default (:data:`densefit.choices.AUTO_PRECISION`), or the store's precision when adding
documents to it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import io
import json
import os
import tempfile
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from densefit.choices import AUTO_PRECISION, PRECISIONS, RUNTIME_CHOICES
from densefit.models import eval_mode, resolve_model_path, transformer_of
from densefit.retrieval.vector_source import FP32, VectorSource, disagreement

__all__ = [
    "AUTO_ORDER",
    "HALF_COSINE",
    "MANIFEST",
    "Runtime",
    "RuntimeUnavailableError",
    "TORCH",
    "auto_candidates",
    "export_onnx",
    "exports_of",
    "model_folder",
    "model_precision",
    "no_openvino_telemetry",
    "openvino_properties",
    "read_manifest",
    "release_runtimes",
    "resolve_precision",
    "resolve_runtime",
    "runtime_inputs",
    "set_precision",
    "sha256_of_file",
    "weights_digest",
    "write_manifest_entry",
]

MANIFEST = "densefit_export.json"
MANIFEST_FORMAT = "densefit-export/1"
# The folder and the file of each runtime, as sentence-transformers names them (its
# export_dynamic_quantized_onnx_model writes onnx/model_qint8_<isa>.onnx,
# export_static_quantized_openvino_model openvino/openvino_model_qint8_quantized.xml).
FOLDERS = {"onnx": "onnx", "onnx-int8": "onnx", "openvino": "openvino", "openvino-int8": "openvino"}
# ``auto`` tries these in order, fastest first as measured on this project's CPU
# (bench/results/inference_throughput.csv: int8 before fp32, OpenVINO before ONNX Runtime at
# equal precision); each only where it is exported and its check passed; torch last, always
# available.
AUTO_ORDER = ("openvino-int8", "onnx-int8", "openvino", "onnx", "torch")
# An fp32 runtime must reproduce torch's sentence embeddings to this cosine on every probe
# (the store's SAME_WEIGHTS_COSINE: the same weights reproduce them to ~1e-7).
FP32_COSINE = 1 - 1e-5
_PROBES = (
    "densefit runtime probe: the quick brown fox jumps over the lazy dog.",
    "What is the effect of vitamin D on bone density in older adults?",
    "short",
)
_FEATURE_ORDER = ("input_ids", "attention_mask", "token_type_ids")
# A half-precision runtime must reproduce fp32's sentence embeddings to this cosine on every
# probe text, with finite values, or it is refused (a model whose activations overflow fp16).
HALF_COSINE = 0.999
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# Per model: its resolved runtimes (sessions) and its weights' digest. Kept outside the model
# (weakly), so copying, pickling or saving a model never meets an inference session.
_RUNTIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class RuntimeUnavailableError(ValueError):
    """The runtime asked for cannot run this model here; the message says how to fix it."""


# ----------------------------------------------------------------------------- runtimes


@dataclass
class Runtime:
    """A runtime ready to run: ``embed(model, features)`` gives the sentence embeddings.

    ``session`` is None for torch in fp32, else a callable from the features to the token
    embeddings ``(batch, tokens, hidden)``: a NumPy array (ONNX Runtime, OpenVINO) or a
    float32 tensor on the model's device (torch at a half precision).
    """

    name: str
    source: VectorSource
    session: object = None
    record: dict = field(default_factory=dict)  # the manifest entry of its file

    @classmethod
    def from_file(cls, name: str, path: str | os.PathLike) -> Runtime:
        """Runtime ``name`` on an exported file as it is, its check and weights not looked at
        (benchmarks comparing files; everything else goes through :func:`resolve_runtime`)."""
        source = VectorSource(name, FP32 if name in ("onnx", "openvino") else "unchecked")
        return cls(name, source, _open_session(name, Path(path)), {"file": str(path)})

    def embed(self, model, features: dict):
        """``model``'s ``sentence_embedding`` for one batch of ``features`` (torch tensors),
        the transformer run by this runtime and the model's other modules after it."""
        if self.session is None:
            return model(features)["sentence_embedding"]

        features = dict(features)
        device = features["attention_mask"].device  # the model's: its other modules run there
        tokens = self.session(features)  # (b, length, hidden)
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.from_numpy(tokens).to(device)
        features[model[0].module_output_name] = tokens
        for module in list(model)[1:]:
            features = module(features)
        return features["sentence_embedding"]


TORCH = Runtime("torch", VectorSource())


def resolve_runtime(
    model,
    runtime: str | Runtime = "auto",
    *,
    stored: VectorSource | None = None,
    mixing: bool = False,
) -> Runtime:
    """The runtime that embeds with ``model``: ``runtime`` by name (:data:`densefit.choices.
    RUNTIME_CHOICES`) or already resolved.

    ``auto``: the first of :data:`AUTO_ORDER` exported for the model's current weights whose
    check passed and that may meet the vectors of ``stored`` (:func:`disagreement`, with
    ``mixing``), else torch. A runtime named explicitly that is not available raises
    :class:`RuntimeUnavailableError` saying how to get it; whether it may meet ``stored`` is
    the store's check (:func:`densefit.retrieval.index.settings.check_runtime`). Resolved
    runtimes are remembered on the model until its weights, its folder's exports or the
    thread count change.

    The model's precision (:func:`set_precision`; :func:`resolve_precision`) other than fp32
    makes ``torch`` and ``auto`` the torch runtime at that precision; another runtime named
    with it is refused (exports run fp32 or int8).

    >>> from densefit.testing import tiny_model
    >>> resolve_runtime(tiny_model(), "auto").name
    'torch'
    """
    if isinstance(runtime, Runtime):
        return runtime
    if runtime not in RUNTIME_CHOICES:
        raise RuntimeUnavailableError(
            f"unknown runtime {runtime!r}: use one of {', '.join(RUNTIME_CHOICES)}"
        )
    precision = resolve_precision(model, runtime, stored=stored, mixing=mixing)
    if mixing and stored is not None and precision != stored.precision:
        raise RuntimeUnavailableError(
            f"the store's documents were embedded in {stored.precision}, this run embeds in "
            f"{precision}: one store holds vectors of one precision; pass --precision "
            f"{stored.precision} (or auto: the store's), or --reembed to re-embed every "
            "document in this one"
        )
    if precision != FP32:
        if runtime not in ("auto", "torch"):
            raise RuntimeUnavailableError(
                f"--precision {precision} runs the model in torch; --runtime {runtime} runs "
                "an export (fp32 or int8): use --runtime torch or auto, or --precision fp32"
            )
        found = _half_runtime(model, precision, explicit=model_precision(model) != "auto")
        if found is not None:
            return found
    if runtime == "torch":
        return TORCH
    if runtime != "auto":
        return _runtime(model, runtime, explicit=True)
    return next(_auto_runtimes(model, stored, mixing), TORCH)


def set_precision(model, precision: str | None):
    """Embed with ``model`` at ``precision`` (:data:`densefit.choices.PRECISION_CHOICES`:
    ``auto``, ``fp32``, ``fp16``, ``bf16``; None leaves it as it is): what
    :func:`resolve_runtime` runs its transformer in. Returns ``model``.

    >>> from densefit.testing import tiny_model
    >>> model_precision(set_precision(tiny_model(), "bf16"))
    'bf16'
    """
    if precision is None:
        return model
    if precision != "auto" and precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of auto, {', '.join(PRECISIONS)}, got {precision!r}"
        )
    model._densefit_precision = precision  # a string: copying or saving the model keeps it
    return model


def model_precision(model) -> str:
    """The precision set on ``model`` (:func:`set_precision`); fp32 when none was set.

    >>> from densefit.testing import tiny_model
    >>> model_precision(tiny_model())
    'fp32'
    """
    return getattr(model, "_densefit_precision", FP32)


def resolve_precision(
    model, runtime: str = "auto", *, stored: VectorSource | None = None, mixing: bool = False
) -> str:
    """The precision ``model`` embeds at with ``runtime``: the one set on it, or for
    ``auto`` the precision of ``stored``'s documents when adding to them (``mixing``), else
    the device's default (:data:`densefit.choices.AUTO_PRECISION`); fp32 for a named export.

    >>> from densefit.testing import tiny_model
    >>> resolve_precision(set_precision(tiny_model(), "auto"))  # on the CPU
    'fp32'
    >>> stored = VectorSource(family="bf16", precision="bf16")
    >>> resolve_precision(set_precision(tiny_model(), "auto"), stored=stored, mixing=True)
    'bf16'
    """
    precision = model_precision(model)
    if precision != "auto":
        return precision
    if runtime not in ("auto", "torch"):
        return FP32
    if mixing and stored is not None:
        return stored.precision
    return AUTO_PRECISION.get(_device_of(model).type, FP32)


def _device_of(model) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def auto_candidates(
    model, *, stored: VectorSource | None = None, mixing: bool = False
) -> list[Runtime]:
    """Every runtime ``auto`` may pick for ``model`` (and the vectors of ``stored``), in
    :data:`AUTO_ORDER`: :func:`resolve_runtime` takes the first, ``densefit serve`` times
    them on queries (:func:`densefit.retrieval.encode.fastest_runtime`). Torch comes last;
    where nothing may meet ``stored``, torch alone (the store's check then says why).

    >>> from densefit.testing import tiny_model
    >>> [r.name for r in auto_candidates(tiny_model())]
    ['torch']
    """
    return list(_auto_runtimes(model, stored, mixing)) or [TORCH]


def release_runtimes(model, keep: Runtime) -> None:
    """Let go of the sessions ``auto`` opened for ``model`` other than ``keep``'s (after
    :func:`auto_candidates` opened them all to time them); a later ``auto`` reopens one."""
    cache = _RUNTIMES.get(model, {})
    for key in [k for k in cache if not k[1] and k[0] not in (keep.name, "torch")]:
        del cache[key]


def _auto_runtimes(model, stored: VectorSource | None, mixing: bool):
    precision = resolve_precision(model, "auto", stored=stored, mixing=mixing)
    if precision != FP32:  # the torch runtime at that precision, when it passed its check
        found = _half_runtime(model, precision, explicit=model_precision(model) != "auto")
        if found is not None:
            if stored is None or disagreement(stored, found.source, mixing=mixing) is None:
                yield found
            return
    for name in AUTO_ORDER:
        found = TORCH if name == "torch" else _runtime(model, name, explicit=False)
        if found is None:
            continue
        if stored is None or disagreement(stored, found.source, mixing=mixing) is None:
            yield found


def _runtime(model, name: str, *, explicit: bool) -> Runtime | None:
    """``name`` for ``model``'s current weights (remembered per model), or None (``auto``:
    not exported, stale or failed) / :class:`RuntimeUnavailableError` (named explicitly)."""

    folder = model_folder(model)
    stamp = _manifest_stamp(folder, name)
    if stamp is None and not explicit:
        return None  # nothing exported: no need to hash the weights
    key = (_parameter_version(model), torch.get_num_threads(), stamp)
    cache = _RUNTIMES.setdefault(model, {})  # (name, explicit) -> (key, runtime or error)
    cached = cache.get((name, explicit))
    if cached is None or cached[0] != key:  # one per name: a stale session is let go
        try:
            found = _load_runtime(model, name, folder, in_memory=explicit)
        except RuntimeUnavailableError as exc:
            found = exc
        cache[(name, explicit)] = (key, found)
    found = cache[(name, explicit)][1]
    if isinstance(found, RuntimeUnavailableError):
        if explicit:
            raise found
        return None
    return found


def _load_runtime(model, name: str, folder: Path | None, *, in_memory: bool) -> Runtime:
    """Open ``name``'s exported file for the model's weights, else (``in_memory``, fp32
    runtimes only) export the current weights in memory."""
    check_supported(model, name)
    digest = weights_digest(model)
    record = None
    for entry in exports_of(folder).get(name, []):
        if entry.get("weights_sha256") == digest:
            record = entry
            break
    if record is not None:
        path = folder / FOLDERS[name] / record["file"]
        if not path.is_file() or sha256_of_file(path) != record.get("sha256"):
            raise RuntimeUnavailableError(
                f"{path}: missing or changed since it was exported and checked: run "
                f"`densefit export {folder} --to {name}` again"
            )
        if not record.get("passed", False):
            raise RuntimeUnavailableError(
                f"{path}: its check failed ({_check_summary(record)}): it ranks differently "
                "from fp32; export with other settings or use --runtime torch"
            )
        source = VectorSource(
            name,
            record.get("family", FP32),
            f"{FOLDERS[name]}/{record['file']}",
            bool(record.get("agrees_with_fp32", record.get("family", FP32) == FP32)),
        )
        return Runtime(name, source, _open_session(name, path), record)
    if in_memory and name in ("onnx", "openvino"):
        return _in_memory_fp32(model, name)
    where = f"in {folder / FOLDERS[name]}" if folder is not None else "(the model has no folder)"
    stale = " for the model's current weights" if exports_of(folder).get(name) else ""
    raise RuntimeUnavailableError(
        f"no checked {name} export {where}{stale}: run `densefit export MODEL_FOLDER --to "
        f"{name} --calibration DATA` (Python: densefit.retrieval.export.export_model), or use --runtime "
        "torch or onnx"
    )


def check_supported(model, name: str) -> None:
    """Raise :class:`RuntimeUnavailableError` unless runtime ``name`` can run ``model``: its
    first module a sentence-transformers Transformer giving token embeddings, and the
    runtime's package installed."""
    _check_transformer(model, f"--runtime {name}", "use --runtime torch")
    module = "openvino" if name.startswith("openvino") else "onnxruntime"
    try:
        __import__(module)
    except ImportError:
        raise RuntimeUnavailableError(
            f"--runtime {name} needs the {module} package: pip install 'densefit[onnx]'"
            + (" openvino" if module == "openvino" else "")
        ) from None


def _check_transformer(model, what: str, fix: str) -> None:
    """Raise :class:`RuntimeUnavailableError` (``what`` runs ..., ``fix``) unless ``model``'s
    first module is a sentence-transformers Transformer giving token embeddings."""
    first = model[0] if len(model) else None
    config = getattr(first, "modality_config", {}) or {}
    text = config.get("text", {}) if isinstance(config, dict) else {}
    if (
        type(first).__name__ != "Transformer"
        or text.get("method") != "forward"
        or text.get("method_output_name") != "last_hidden_state"
        or getattr(first, "module_output_name", None) != "token_embeddings"
        or set(config) - {"text"}
    ):
        raise RuntimeUnavailableError(
            f"{what} runs text models whose first module is a sentence-transformers "
            f"Transformer giving token embeddings; this model's is {type(first).__name__}: "
            f"{fix}"
        )


def _in_memory_fp32(model, name: str) -> Runtime:
    """Export the transformer's current weights in memory and check it against torch."""
    data = export_onnx(model)
    if name == "onnx":
        session = _onnx_session(data)
    else:
        session = _openvino_session(data)
    found = Runtime(name, VectorSource(name), session, {"file": None})
    worst = fp32_agreement(model, found)
    if worst < FP32_COSINE:
        raise RuntimeUnavailableError(
            f"--runtime {name}: the exported transformer does not reproduce torch (probe "
            f"cosine {worst:.6f} < {FP32_COSINE}): use --runtime torch"
        )
    return found


def fp32_agreement(model, runtime: Runtime) -> float:
    """The lowest cosine between ``runtime``'s and torch's embeddings of the probe texts
    (NaN when ``runtime``'s are not finite)."""

    device = _device_of(model)
    features = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v
        for k, v in model.preprocess(list(_PROBES)).items()
    }
    with eval_mode(model), torch.inference_mode():
        reference = model(dict(features))["sentence_embedding"].float()
        ours = runtime.embed(model, dict(features)).float()
    if not bool(torch.isfinite(ours).all()):
        return float("nan")
    cosine = torch.nn.functional.cosine_similarity(reference, ours, dim=1)
    return float(cosine.min())


# ----------------------------------------------------------------------------- precision


def _half_runtime(model, precision: str, *, explicit: bool) -> Runtime | None:
    """The torch runtime at ``precision`` for ``model``'s current weights and device
    (remembered per model), or None (``auto`` precision: its check failed) /
    :class:`RuntimeUnavailableError` (named explicitly)."""
    key = (_parameter_version(model), str(_device_of(model)))
    cache = _RUNTIMES.setdefault(model, {})
    cached = cache.get((f"torch:{precision}", "precision"))
    if cached is None or cached[0] != key:  # one per precision: a stale copy is let go
        cache.pop((f"torch:{precision}", "precision"), None)
        try:
            found = _load_half(model, precision)
        except RuntimeUnavailableError as exc:
            found = exc
        cache[(f"torch:{precision}", "precision")] = (key, found)
    found = cache[(f"torch:{precision}", "precision")][1]
    if isinstance(found, RuntimeUnavailableError):
        if explicit:
            raise found
        return None
    return found


def _load_half(model, precision: str) -> Runtime:
    """A copy of the transformer cast to ``precision`` (PyTorch's scaled-dot-product
    attention; on CUDA flash attention where transformers offers it, which drops the
    padding tokens inside attention), checked against fp32 on the probe texts."""
    _check_transformer(model, f"--precision {precision}", "use --precision fp32")
    names = runtime_inputs(model)
    half = _cast_copy(transformer_of(model), _DTYPES[precision])
    attention = _fastest_attention(half, _device_of(model))

    def run(features: dict) -> torch.Tensor:
        inputs = {k: features[k] for k in names if k in features}
        return half(**inputs, return_dict=True).last_hidden_state.float()

    source = VectorSource("torch", precision, None, True, precision)
    found = Runtime("torch", source, run, {"precision": precision, "attention": attention})
    worst = fp32_agreement(model, found)
    if not worst >= HALF_COSINE:  # NaN (non-finite vectors) fails too
        raise RuntimeUnavailableError(
            f"--precision {precision}: the model's {precision} embeddings do not reproduce "
            f"fp32 (probe cosine {worst:.6f} < {HALF_COSINE}): use --precision fp32"
            + (" or bf16" if precision == "fp16" else "")
        )
    found.record["probe_cosine"] = worst
    return found


def _cast_copy(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """An eval-mode copy of ``module`` with its floating-point weights and buffers in
    ``dtype``; the copy is made from the cast tensors, never a second full-precision one."""
    cast = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in cast or not tensor.is_floating_point():
            continue
        value = tensor.detach().to(dtype)
        if isinstance(tensor, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=False)
        cast[id(tensor)] = value
    return copy.deepcopy(module, cast).eval()


def _fastest_attention(module: torch.nn.Module, device: torch.device) -> str:
    """Switch ``module`` to flash attention on CUDA when transformers offers it for the model
    (its unpadded path), else keep scaled-dot-product attention; the implementation used."""
    config = getattr(module, "config", None)
    current = getattr(config, "_attn_implementation", None) or "eager"
    setter = getattr(module, "set_attn_implementation", None)
    if device.type == "cuda" and setter is not None:
        try:
            # only on CUDA: the check imports flash-attn's probing, kept off CPU paths
            from transformers.utils import is_flash_attn_2_available

            if is_flash_attn_2_available():
                setter("flash_attention_2")
                return "flash_attention_2"
        except (ImportError, ValueError, RuntimeError):
            pass  # not offered for this model: scaled-dot-product attention as it is
    if current == "eager" and setter is not None:
        try:
            setter("sdpa")
            return "sdpa"
        except (ValueError, RuntimeError):
            pass
    return current


# ----------------------------------------------------------------------------- files


def model_folder(model) -> Path | None:
    """The folder ``model`` was loaded from (where its exports are), or None."""
    name = getattr(model, "_densefit_name", None)
    if not name:
        return None

    try:
        path = Path(resolve_model_path(name))
    except Exception:  # noqa: BLE001 - not a folder: no exports
        return None
    return path if path.is_dir() else None


def read_manifest(folder: Path) -> dict:
    """``folder/densefit_export.json`` (``{"format", "files": {name: record}}``); empty
    when there is none."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return {"format": MANIFEST_FORMAT, "files": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RuntimeUnavailableError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg}): delete it and export again"
        ) from None
    if data.get("format") != MANIFEST_FORMAT:
        raise RuntimeUnavailableError(
            f"{path}: unknown format {data.get('format')!r} (this densefit reads "
            f"{MANIFEST_FORMAT}): delete it and export again"
        )
    return data


def write_manifest_entry(folder: Path, record: dict) -> Path:
    """Add (or replace) ``record`` (its ``file`` the key) in ``folder``'s manifest, atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = read_manifest(folder)
    data["files"][record["file"]] = record
    path = folder / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def exports_of(folder: Path | None) -> dict[str, list[dict]]:
    """The manifest records of ``folder``'s exports by runtime, newest first.

    >>> exports_of(None)
    {}
    """
    if folder is None:
        return {}
    found: dict[str, list[dict]] = {}
    for sub in sorted(set(FOLDERS.values())):
        for record in read_manifest(Path(folder) / sub)["files"].values():
            found.setdefault(record["runtime"], []).append(record)
    for records in found.values():
        records.sort(key=lambda r: r.get("created", ""), reverse=True)
    return found


def _manifest_stamp(folder: Path | None, name: str) -> tuple | None:
    if name not in FOLDERS or folder is None:
        return None
    path = folder / FOLDERS[name] / MANIFEST
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size)


def sha256_of_file(path: Path) -> str:
    """The file's sha256 (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_digest(model) -> str:
    """sha256 of the transformer's weights (names, dtypes, shapes, bytes), remembered until a
    parameter changes: which weights an export was made from.

    >>> from densefit.testing import tiny_model
    >>> len(weights_digest(tiny_model()))
    64
    """
    version = _parameter_version(model)
    cached = _DIGESTS.get(model)
    if cached is not None and cached[0] == version:
        return cached[1]

    digest = hashlib.sha256()
    for name, tensor in sorted(transformer_of(model).state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(dtype=_byte_dtype()).numpy().tobytes())
    value = digest.hexdigest()
    _DIGESTS[model] = (version, value)
    return value


def _byte_dtype():

    return torch.uint8


def _parameter_version(model) -> int:
    """Changes whenever a parameter is modified in place (optimizer steps, load_state_dict)."""
    try:
        return sum(p._version for p in model.parameters())
    except (AttributeError, TypeError):  # pragma: no cover - not a torch module
        return -1


def _check_summary(record: dict) -> str:
    check = record.get("check") or {}
    parts = [f"{k} {v}" for k, v in check.items() if isinstance(v, (int, float))]
    return ", ".join(parts[:4]) or "no numbers recorded"


# ----------------------------------------------------------------------------- export


def runtime_inputs(model) -> list[str]:
    """The features the transformer takes from the tokenizer, in a fixed order: the inputs
    of its exported graph.

    >>> from densefit.testing import tiny_model
    >>> runtime_inputs(tiny_model())
    ['input_ids', 'attention_mask', 'token_type_ids']
    """
    features = model.preprocess(["probe"])
    accepted = set(inspect.signature(transformer_of(model).forward).parameters)
    return [k for k in _FEATURE_ORDER if k in features and k in accepted]


def export_onnx(model, path: str | os.PathLike | None = None) -> bytes | Path:
    """Export ``model``'s transformer to ONNX (``torch.onnx.export``, batch and sequence
    length dynamic): its inputs :func:`runtime_inputs`, its output ``last_hidden_state``, as
    optimum names them (so sentence-transformers' ONNX backend loads the file).

    Writes one self-contained file at ``path`` and returns it; ``path=None``: the bytes.
    """
    check_supported(model, "onnx")
    names = runtime_inputs(model)
    inner = transformer_of(model)
    features = model.preprocess(["a first probe text", "a second, longer probe text here"])
    example = tuple(features[k].to(next(inner.parameters()).device) for k in names)

    class _Transformer(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *inputs):
            kwargs = dict(zip(names, inputs, strict=True))
            return self.inner(**kwargs, return_dict=True).last_hidden_state

    with eval_mode(inner):
        model_proto = _trace_to_onnx(_Transformer(inner), example, names)
    import onnx  # the optional extra onnx

    if path is None:
        return model_proto.SerializeToString()

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model_proto, str(path))
    return path


def _trace_to_onnx(module, example: tuple, names: list[str]):
    """The ONNX ModelProto of ``module`` on ``example``, batch and length dynamic.

    The TorchScript exporter first: it exports a small model in a fraction of a second where
    the torch.export-based one takes seconds (in-memory exports and tests pay it each time),
    and ONNX Runtime's transformer fusions know its graphs. It is deprecated; where it is
    gone, the torch.export-based exporter. Either result is checked against torch by the
    caller (:func:`fp32_agreement`, the export's check).
    """
    import onnx  # the optional extra onnx

    outputs = ["last_hidden_state"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and trace notes
        try:
            buffer = io.BytesIO()
            axes = {k: {0: "batch_size", 1: "sequence_length"} for k in [*names, *outputs]}
            torch.onnx.export(
                module,
                example,
                buffer,
                input_names=names,
                output_names=outputs,
                dynamic_axes=axes,
                opset_version=17,
                dynamo=False,
            )
            return onnx.load_model_from_string(buffer.getvalue())
        except (TypeError, RuntimeError, NotImplementedError, ValueError):
            batch, tokens = torch.export.Dim("batch_size"), torch.export.Dim("sequence_length")
            program = torch.onnx.export(
                module,
                example,
                input_names=names,
                output_names=outputs,
                dynamic_shapes=(tuple({0: batch, 1: tokens} for _ in names),),
                dynamo=True,
                verbose=False,
            )
            return program.model_proto


# ----------------------------------------------------------------------------- sessions


def _open_session(name: str, path: Path):
    if name.startswith("openvino"):
        return _openvino_session(path)
    return _onnx_session(str(path))


def _onnx_session(model: str | bytes):
    """A callable running the ONNX transformer in ONNX Runtime with torch's thread count."""
    import onnxruntime as ort  # the optional extra onnx

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]

    def run(features: dict) -> np.ndarray:
        feed = {k: _int64(features[k]) for k in inputs}
        return session.run(None, feed)[0]

    return run


@contextlib.contextmanager
def no_openvino_telemetry():
    """OpenVINO's converter and NNCF send nothing while the block runs.

    Both report usage to Google Analytics through openvino-telemetry unless the user opted
    out, and its sender forks a process per event from a thread pool: a fork while the main
    thread was importing deadlocked ``densefit export --to openvino-int8`` for good (found by
    a test run from a fresh clone). Every ``convert_model`` and NNCF call of densefit runs
    in it. Both skip telemetry in CI, which openvino-telemetry reads each time a tool
    (re)initialises it, and ``ovc`` does so in every ``convert_model``: the block runs with
    ``CI=true`` (the variable restored after), so that densefit sends nothing.
    """
    ci = os.environ.get("CI")
    os.environ["CI"] = "true"
    try:
        yield
    finally:
        if ci is None:
            os.environ.pop("CI", None)
        else:
            os.environ["CI"] = ci


def _openvino_session(model: str | bytes | Path):
    """A callable running the transformer in OpenVINO (CPU, fp32 arithmetic outside the
    quantized operations: OpenVINO would pick bf16 on CPUs that have it).

    Each call runs on torch's thread count (of the thread that opened the session); calls
    from several threads at once (a server's query workers) run side by side, as ONNX
    Runtime's do: one stream of that many threads per core group, one infer request per
    calling thread. Threads are not pinned to cores: OpenVINO pins a latency stream to the
    first cores, so two compiled models (a server's query and document runtimes) or two
    processes (``--nproc``) would share one core while the others idle
    (bench/results/openvino_streams.json).
    """
    import openvino as ov  # the optional extra openvino

    core = ov.Core()
    if isinstance(model, bytes):
        with tempfile.TemporaryDirectory(prefix="densefit-ov-") as tmp:
            onnx_path = Path(tmp) / "model.onnx"
            onnx_path.write_bytes(model)
            with no_openvino_telemetry():
                network = ov.convert_model(str(onnx_path))
    else:
        network = core.read_model(str(model))
    compiled = core.compile_model(network, "CPU", openvino_properties(torch.get_num_threads()))
    inputs = [port.get_any_name() for port in compiled.inputs]
    output = compiled.output(0)
    local = threading.local()  # an infer request serves one call at a time: one per thread

    def run(features: dict) -> np.ndarray:
        feed = {k: _int64(features[k]) for k in inputs}
        request = getattr(local, "request", None)
        if request is None:
            request = local.request = compiled.create_infer_request()
        result = request.infer(feed)
        return np.array(result[output], dtype=np.float32, copy=True)

    run.compiled = compiled  # its settings, for tests and reports
    return run


def openvino_properties(threads: int) -> dict:
    """The CPU plugin's settings for calls of ``threads`` threads each (see
    :func:`_openvino_session`): as many streams as such calls fit on the cores, unpinned.

    >>> openvino_properties(1)["ENABLE_CPU_PINNING"]
    False
    """
    streams = max(1, _cores() // max(1, threads))
    return {
        "NUM_STREAMS": streams,
        "INFERENCE_NUM_THREADS": streams * threads,
        "INFERENCE_PRECISION_HINT": "f32",
        "ENABLE_CPU_PINNING": False,
    }


def _cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _int64(value) -> np.ndarray:
    if hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(value, dtype=np.int64)


def now() -> str:
    """A manifest timestamp (sortable)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
