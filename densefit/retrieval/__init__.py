"""Retrieval: embedding texts (:mod:`~densefit.retrieval.encode`) and the document store with
its vector search (:mod:`~densefit.retrieval.index`). The :class:`~densefit.api.Retriever`
facade sits above this layer: ``from densefit import Retriever``.
"""
