"""Embedding backends behind the :class:`Embedder` seam."""

from retrieval.embedding.factory import load_embedder
from retrieval.embedding.protocol import Embedder

__all__ = ["Embedder", "load_embedder"]
