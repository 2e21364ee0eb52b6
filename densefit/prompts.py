"""Query and document prompts: one resolution, applied to the right texts everywhere.

A prompt is text put before every query (``"query: "``) or every document
(``"passage: "``), as E5 and BGE models expect. densefit keeps them where
sentence-transformers does, in the model's ``prompts`` dict under the keys ``"query"`` and
``"document"``: training, mining, indexing, search and evaluation read them from there, and
saving the model writes them to its ``config_sentence_transformers.json``, so
``SentenceTransformer(path).encode(q, prompt_name="query")`` and Haystack's embedders apply
the same prompts.

Queries are the anchors of a training row; documents its positives and hard negatives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "DOCUMENT",
    "QUERY",
    "apply_prompt",
    "model_prompts",
    "prompt_columns",
    "resolve_prompts",
    "set_prompts",
]

QUERY, DOCUMENT = "query", "document"
# sentence-transformers' encode_document looks for these keys, in this order.
_DOCUMENT_KEYS = (DOCUMENT, "passage", "corpus")


def model_prompts(model) -> dict[str, str]:
    """The model's query and document prompts, ``{"query": ..., "document": ...}``, empty
    ones left out (``{}``: no prompts). A document prompt saved as ``"passage"`` or
    ``"corpus"`` counts, as in sentence-transformers' ``encode_document``.

    >>> from densefit.testing import tiny_model
    >>> model = tiny_model()
    >>> model_prompts(model)
    {}
    >>> set_prompts(model, query="query: ")
    {'query': 'query: '}
    """
    prompts = getattr(model, "prompts", None) or {}
    found = {QUERY: prompts.get(QUERY) or ""}
    found[DOCUMENT] = next((prompts[k] for k in _DOCUMENT_KEYS if prompts.get(k)), "")
    return {k: v for k, v in found.items() if v}


def set_prompts(model, *, query: str | None = None, document: str | None = None) -> dict:
    """Set the model's query and/or document prompt (``None``: keep the model's own, ``""``:
    none) and return :func:`model_prompts`. Saving the model then saves them.
    """
    prompts = getattr(model, "prompts", None)
    if prompts is None:
        prompts = model.prompts = {}
    for key, value in ((QUERY, query), (DOCUMENT, document)):
        if value is None:
            continue
        if not isinstance(value, str):
            raise TypeError(f"the {key} prompt must be text, got {type(value).__name__}")
        prompts[key] = value
        if key == DOCUMENT:  # an older "passage"/"corpus" prompt must not shadow it
            for other in _DOCUMENT_KEYS[1:]:
                if other in prompts:
                    prompts[other] = value
    return model_prompts(model)


def resolve_prompts(model, *, query: str | None = None, document: str | None = None) -> dict:
    """The prompts :func:`set_prompts` would give ``model``, without changing it.

    >>> from densefit.testing import tiny_model
    >>> resolve_prompts(tiny_model(), query="query: ")
    {'query': 'query: '}
    """
    found = model_prompts(model)
    for key, value in ((QUERY, query), (DOCUMENT, document)):
        if value is not None:
            found[key] = value
    return {k: v for k, v in found.items() if v}


def apply_prompt(texts: Sequence[str], prompt: str | None) -> list[str]:
    """``texts`` with ``prompt`` put before each (a copy; no prompt: unchanged).

    >>> apply_prompt(["cells"], "query: ")
    ['query: cells']
    """
    return [prompt + t for t in texts] if prompt else list(texts)


def prompt_columns(columns: Sequence[Sequence[str]], prompts: Mapping[str, str]) -> list[list[str]]:
    """A training batch's columns [anchors, positives, negatives] with their prompts: the
    query prompt before the anchors, the document prompt before positives and negatives.

    >>> prompt_columns([["q"], ["p"], ["n"]], {"query": "query: ", "document": "passage: "})
    [['query: q'], ['passage: p'], ['passage: n']]
    """
    query, document = prompts.get(QUERY), prompts.get(DOCUMENT)
    return [apply_prompt(column, query if i == 0 else document) for i, column in enumerate(columns)]
