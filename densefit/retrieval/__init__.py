"""Retrieval: embedding texts (:mod:`~densefit.retrieval.encode`, its transformer run by one of
the :mod:`~densefit.retrieval.runtimes`) and the document store with its vector search
(:mod:`~densefit.retrieval.index`). The :class:`~densefit.api.Retriever`
facade sits above this layer: ``from densefit import Retriever``.
"""
