"""Embedding backends behind the :class:`Embedder` seam."""

from rubricsearch.retrieval.embedding.factory import load_embedder
from rubricsearch.retrieval.embedding.protocol import Embedder

__all__ = ["Embedder", "load_embedder"]
