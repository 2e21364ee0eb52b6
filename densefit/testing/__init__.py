"""Test helpers other projects can reuse: a tiny random BERT wrapped as a SentenceTransformer.

Nothing here touches the network: the tokenizer is built from a vocab file written to a
temporary folder and the weights are random from a config.
"""

from __future__ import annotations

import atexit
import inspect
import random
import shutil
import string
import tempfile
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
from transformers import BertConfig, BertModel, BertTokenizerFast

from densefit.data.types import Document

__all__ = [
    "tiny_model",
    "write_tiny_vocab",
    "WORDS",
    "SWAP_QUERIES",
    "swap_corpus",
    "save_swap_models",
    "random_vectors",
    "hit_pairs",
    "assert_same_hits",
]

# A small closed vocabulary: special tokens, common words, letters and digits, so that any
# ASCII text tokenizes into something (WordPiece falls back to single characters).
WORDS = (
    "the a an of to in and is for on with what how why who which does do can are was "
    "cell cells protein gene genes cancer risk disease patients study effect increase "
    "decrease blood brain heart virus vaccine drug treatment dose trial mice human "
    "python function class module return value list string file error data model train "
    "query document search index vector embedding retrieval batch memory loss negative "
    "positive hard chunk cache gradient sort length token text title body apple banana"
).split()


def write_tiny_vocab(folder: str | Path) -> Path:
    """Write a BERT ``vocab.txt`` to ``folder`` and return its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    pieces = ["##" + c for c in string.ascii_lowercase + string.digits]
    # Token ids are line numbers: a repeated entry would create ids past the vocab size.
    vocab = list(dict.fromkeys(specials + sorted(set(WORDS)) + chars + pieces))
    path = folder / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return path


def tiny_model(
    folder: str | Path | None = None,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    max_seq_length: int = 64,
    dropout: float = 0.1,
    normalize: bool = False,
    seed: int = 0,
) -> SentenceTransformer:
    """A random BERT (mean pooling) small enough for unit tests: builds in well under a second.
    Its files go to ``folder``, or without one to a temporary folder removed at exit.

    >>> model = tiny_model()
    >>> model.encode(["hello world"]).shape
    (1, 32)
    """

    if folder is None:  # a folder of its own, removed when the process exits
        folder = Path(tempfile.mkdtemp(prefix="densefit-tiny-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    folder = Path(folder)
    vocab = write_tiny_vocab(folder)

    # transformers 5 takes the vocabulary as `vocab`, 4.x as `vocab_file`.
    key = (
        "vocab_file" if "vocab_file" in inspect.signature(BertTokenizerFast).parameters else "vocab"
    )
    tokenizer = BertTokenizerFast(**{key: str(vocab)}, do_lower_case=True)
    if len(tokenizer) < 50:
        raise RuntimeError(f"tiny tokenizer did not read {vocab} ({len(tokenizer)} tokens)")
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=hidden_size * 2,
        max_position_embeddings=max(128, max_seq_length),
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    transformer = Transformer(str(folder), max_seq_length=max_seq_length)
    modules = [transformer, Pooling(hidden_size, pooling_mode="mean")]
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, device="cpu")
    model._densefit_name = f"tiny-bert-{hidden_size}x{num_layers}"  # type: ignore[attr-defined]
    return model


# -- model swaps: the corpus, queries and models every engine's swap tests share --------------

SWAP_WORDS = "cell protein python kernel socket river bread music zebra vitamin bone signal".split()
SWAP_QUERIES = ["cell protein", "python socket", "zebra river music", "vitamin bone"]


def swap_corpus(n: int = 40, seed: int = 0, prefix: str = "d") -> list[Document]:
    """``n`` seeded documents of six :data:`SWAP_WORDS` each, ``meta={"n": i}``."""
    rng = random.Random(seed)
    return [
        Document(f"{prefix}{i}", " ".join(rng.choices(SWAP_WORDS, k=6)), meta={"n": i})
        for i in range(n)
    ]


def save_swap_models(folder: str | Path) -> dict[str, Path]:
    """Saved tiny models under ``folder``: ``old``, ``new`` (another seed, the same size) and
    ``wide`` (48-d, so that a swap changes the dimension)."""
    folder = Path(folder)
    made = {"old": {}, "new": {"seed": 7}, "wide": {"seed": 3, "hidden_size": 48}}
    for name, kwargs in made.items():
        tiny_model(folder / f"build-{name}", **kwargs).save(str(folder / name))
    return {name: folder / name for name in made}


# -- comparing two engines' searches --------------------------------------------------------


def random_vectors(n: int, dim: int = 8, seed: int = 0) -> np.ndarray:
    """``(n, dim)`` seeded standard-normal float32 vectors: embeddings without a model."""
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def hit_pairs(results) -> list[list[tuple[str, float]]]:
    """``[(id, score), ...]`` per query of a store's search results."""
    return [[(h.id, h.score) for h in hits] for hits in results]


def assert_same_hits(got, expected, atol: float = 1e-5) -> None:
    """The same ids in the same order per query (:func:`hit_pairs`), scores within ``atol``."""
    assert [[i for i, _ in q] for q in got] == [[i for i, _ in q] for q in expected]
    for q_got, q_expected in zip(got, expected, strict=True):
        np.testing.assert_allclose([s for _, s in q_got], [s for _, s in q_expected], atol=atol)
