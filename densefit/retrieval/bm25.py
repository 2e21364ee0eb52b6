"""BM25 over texts, the one implementation densefit has: mining (:mod:`densefit.mine`) and the
store's side index (:mod:`densefit.retrieval.index.lexical`) both use it.

- **Tokens** are bm25s's: lower case, the regex ``(?u)\\b\\w\\w+\\b``, English stop words, no
  stemming (``bm25s.tokenize(texts, stopwords="en")``).
- **Scores** are bm25s's default BM25 ("lucene"): ``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``
  times ``tf / (tf + k1 (1 - b + b dl / avgdl))``, ``k1 = 1.5``, ``b = 0.75``, computed once
  per (document, token) into a sparse matrix; a query's scores are the sum of its tokens'
  columns (bm25s's ``get_scores_from_ids``).
- **The matrix is built with numpy** (one sort of the (document, token) pairs) instead of
  bm25s's Python loop over documents: the same matrix (``tests/test_bm25.py`` compares it
  with ``bm25s.BM25.index``) in a fraction of the time, which is what lets a store rebuild
  it from cached token ids after every change instead of keeping an approximate one.

>>> index = Bm25Index(Tokens.of(["cells divide", "python functions", "cells and genes in mice"]))
>>> [(int(p), round(float(s), 3)) for p, s in zip(*index.search(["cells"], 5)[0])]
[(0, 0.201), (2, 0.167)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["K1", "B", "Bm25Index", "Tokens", "best_positions", "import_bm25s", "tokenize"]

K1, B = 1.5, 0.75  # bm25s's defaults
STOPWORDS = "en"


def import_bm25s():
    """``import bm25s``, or an ImportError that says what to install."""
    try:
        import bm25s  # tokenising only: the matrix is built with numpy
    except ImportError:
        raise ImportError("BM25 needs bm25s: pip install bm25s (a densefit dependency)") from None
    return bm25s


def tokenize(texts: Sequence[str], *, show_progress: bool = False) -> list[list[str]]:
    """Each text's BM25 tokens (bm25s's tokenizer, English stop words).

    >>> tokenize(["The cells divide, and divide again."])
    [['cells', 'divide', 'divide', 'again']]
    """
    bm25s = import_bm25s()
    return bm25s.tokenize(
        list(texts), stopwords=STOPWORDS, return_ids=False, show_progress=show_progress
    )


@dataclass
class Tokens:
    """Texts as token ids: text ``i`` is ``ids[indptr[i]:indptr[i + 1]]``, ``vocab[j]`` the
    token of id ``j``. Vocabularies only grow, so ids stay valid when texts are added.

    >>> tokens = Tokens.of(["cells divide", "divide again"])
    >>> tokens.vocab, tokens.ids.tolist(), len(tokens)
    (['cells', 'divide', 'again'], [0, 1, 1, 2], 2)
    """

    indptr: np.ndarray  # (n + 1,) int64
    ids: np.ndarray  # (tokens,) int32
    vocab: list[str]
    _lookup: dict[str, int] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.indptr) - 1

    @property
    def lookup(self) -> dict[str, int]:
        """``{token: id}``."""
        if self._lookup is None or len(self._lookup) != len(self.vocab):
            self._lookup = {token: i for i, token in enumerate(self.vocab)}
        return self._lookup

    @classmethod
    def empty(cls) -> Tokens:
        return cls(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int32), [])

    @classmethod
    def of(cls, texts: Sequence[str], *, show_progress: bool = False) -> Tokens:
        """Tokenise ``texts`` into a new vocabulary."""
        return cls.empty().extended(texts, show_progress=show_progress)

    def extended(self, texts: Sequence[str], *, show_progress: bool = False) -> Tokens:
        """These tokens followed by those of ``texts``; new tokens get new ids."""
        bm25s = import_bm25s()
        if not len(texts):
            return self
        found = bm25s.tokenize(
            list(texts), stopwords=STOPWORDS, return_ids=True, show_progress=show_progress
        )
        vocab = list(self.vocab)
        lookup = dict(self.lookup)
        remap = np.empty(len(found.vocab), dtype=np.int32)  # their id -> ours
        for token, theirs in found.vocab.items():
            ours = lookup.get(token)
            if ours is None:
                ours = lookup[token] = len(vocab)
                vocab.append(token)
            remap[theirs] = ours
        lengths = np.fromiter((len(d) for d in found.ids), dtype=np.int64, count=len(found.ids))
        theirs = np.fromiter(
            (t for d in found.ids for t in d), dtype=np.int32, count=int(lengths.sum())
        )
        indptr = np.concatenate([self.indptr, self.indptr[-1] + np.cumsum(lengths)])
        return Tokens(indptr, np.concatenate([self.ids, remap[theirs]]), vocab, lookup)

    def select(self, positions: np.ndarray) -> Tokens:
        """The texts at ``positions``, in that order (same vocabulary)."""
        positions = np.asarray(positions, dtype=np.int64)
        lengths = np.diff(self.indptr)[positions]
        indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        # For each kept token: its text's start in the old ids plus its offset in the text.
        gather = np.repeat(self.indptr[positions] - indptr[:-1], lengths) + np.arange(indptr[-1])
        return Tokens(indptr, self.ids[gather], self.vocab, self._lookup)

    def pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(texts, token ids, counts)``: each distinct token of each text once, by text
        then token id, with the number of times the text holds it (its term frequency).

        >>> [a.tolist() for a in Tokens.of(["cells divide divide", "divide"]).pairs()]
        [[0, 0, 1], [0, 1, 1], [1, 2, 1]]
        """
        n_vocab = len(self.vocab)
        texts = np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.indptr))
        pairs, counts = np.unique(texts * n_vocab + self.ids, return_counts=True)
        return pairs // n_vocab, pairs % n_vocab, counts

    def query_ids(self, queries: Sequence[str]) -> list[np.ndarray]:
        """Each query's token ids in this vocabulary (unknown tokens dropped, repeats kept:
        as bm25s's ``get_tokens_ids``)."""
        lookup = self.lookup
        return [
            np.array([lookup[t] for t in tokens if t in lookup], dtype=np.int32)
            for tokens in tokenize(queries)
        ]


class Bm25Index:
    """BM25 scores of every (text, token) pair of ``tokens``, searched by query texts.

    ``search`` returns, for each query, the positions (text numbers) of the best texts with a
    score above 0 (texts sharing no token with the query are not found), best first, ties by
    position; ``mask`` keeps only the texts where it is True.
    """

    def __init__(self, tokens: Tokens, *, k1: float = K1, b: float = B):
        self.tokens, self.k1, self.b = tokens, k1, b
        self.n_docs = len(tokens)
        self.data, self.indices, self.indptr = _score_matrix(tokens, k1, b)
        self._scorer = None

    def scores(self, query_ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """``(n_docs,)`` float32 BM25 scores of one query given as token ids (0 where masked)."""
        if self._scorer is None:
            self._scorer = _bm25s_scorer(self)
        if self.n_docs == 0 or len(query_ids) == 0:
            return np.zeros(self.n_docs, dtype=np.float32)
        weights = None if mask is None else np.asarray(mask, dtype=np.float32)
        return self._scorer.get_scores_from_ids(query_ids, weight_mask=weights)

    def search(
        self, queries: Sequence[str], k: int, mask: np.ndarray | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(positions, scores)`` of the best ``k`` texts for each query (see the class)."""
        return [best_positions(self.scores(ids, mask), k) for ids in self.tokens.query_ids(queries)]

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The index as arrays (for ``np.savez``); :meth:`from_arrays` reads them back."""
        return {
            "tokens_indptr": self.tokens.indptr,
            "tokens_ids": self.tokens.ids,
            "vocab": np.array(self.tokens.vocab, dtype=str),
            "data": self.data,
            "indices": self.indices,
            "indptr": self.indptr,
            "params": np.array([self.k1, self.b]),
        }

    @classmethod
    def from_arrays(cls, arrays) -> Bm25Index:
        """The index :meth:`to_arrays` wrote (the matrix is read, not rebuilt)."""
        index = cls.__new__(cls)
        vocab = [str(t) for t in arrays["vocab"].tolist()]
        index.tokens = Tokens(
            np.asarray(arrays["tokens_indptr"], dtype=np.int64),
            np.asarray(arrays["tokens_ids"], dtype=np.int32),
            vocab,
        )
        index.k1, index.b = (float(x) for x in arrays["params"])
        index.n_docs = len(index.tokens)
        index.data = np.asarray(arrays["data"], dtype=np.float32)
        index.indices = np.asarray(arrays["indices"], dtype=np.int32)
        index.indptr = np.asarray(arrays["indptr"], dtype=np.int64)
        if len(index.indptr) != len(vocab) + 1 or len(index.data) != len(index.indices):
            raise ValueError("the BM25 arrays do not fit together")
        index._scorer = None
        return index


def best_positions(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The positions of the ``k`` best scores above 0 and their scores, best first, ties by
    position.

    >>> best_positions(np.array([0.0, 2.0, 1.0, 2.0]), 2)[0].tolist()
    [1, 3]
    """
    n = len(scores)
    top = np.argpartition(-scores, k - 1)[:k] if k < n else np.arange(n)
    top = top[scores[top] > 0]
    top = top[np.lexsort((top, -scores[top]))]
    return top, scores[top]


def _score_matrix(tokens: Tokens, k1: float, b: float):
    """The CSC matrix (by token) of BM25 scores: ``data``, ``indices`` (texts), ``indptr``.

    Arithmetic as bm25s's: idf rounded to float32, the rest in float64, stored as float32.
    """
    n_docs, n_vocab = len(tokens), len(tokens.vocab)
    if n_docs == 0 or len(tokens.ids) == 0:
        return (
            np.zeros(0, dtype=np.float32),
            np.zeros(0, dtype=np.int32),
            np.zeros(n_vocab + 1, dtype=np.int64),
        )
    lengths = np.diff(tokens.indptr)
    pair_doc, pair_token, tf = tokens.pairs()  # by text, then token
    df = np.bincount(pair_token, minlength=n_vocab)
    idf = np.zeros(n_vocab, dtype=np.float32)
    seen = df > 0
    idf[seen] = np.log(1 + (n_docs - df[seen] + 0.5) / (df[seen] + 0.5))
    avgdl = lengths.mean()
    tf = tf.astype(np.float64)
    tfc = tf / (k1 * ((1 - b) + b * lengths[pair_doc] / avgdl) + tf)
    scores = (idf[pair_token].astype(np.float64) * tfc).astype(np.float32)
    order = np.argsort(pair_token, kind="stable")  # by token; texts ascending within one
    indptr = np.concatenate([[0], np.cumsum(df)]).astype(np.int64)
    return scores[order], pair_doc[order].astype(np.int32), indptr


def _bm25s_scorer(index: Bm25Index):
    """A ``bm25s.BM25`` holding ``index``'s matrix: its query scoring is bm25s's own."""
    bm25s = import_bm25s()
    scorer = bm25s.BM25(k1=index.k1, b=index.b)
    scorer.scores = {
        "data": index.data,
        "indices": index.indices,
        "indptr": index.indptr,
        "num_docs": index.n_docs,
    }
    scorer.vocab_dict = index.tokens.lookup
    scorer.nonoccurrence_array = None
    return scorer
