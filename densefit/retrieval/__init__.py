"""Retrieval: encoding, the document store and vector search, and the Retriever class."""

from densefit.retrieval.retriever import Retriever

__all__ = ["Retriever"]
