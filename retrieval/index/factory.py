"""One place that turns a backend name and its options into a :class:`VectorIndex`."""

from __future__ import annotations

from typing import Any, Literal

from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.index.protocol import VectorIndex

Backend = Literal["faiss", "qdrant"]


def make_index(backend: Backend | str, **options: Any) -> VectorIndex:
    """Build a backend; ``options`` go to its constructor.

    FaissIndex needs ``path``; QdrantIndex needs ``url`` (server) or ``path`` (local mode).

    Imports are deferred so a FAISS deployment never imports qdrant-client, and vice versa.
    """
    match backend:
        case "faiss":
            from rubricsearch.retrieval.index.faiss_index import FaissIndex

            return FaissIndex(**options)
        case "qdrant":
            from rubricsearch.retrieval.index.qdrant_index import QdrantIndex

            return QdrantIndex(**options)
        case _:
            raise InvalidInput(f"unknown vector index backend {backend!r}: expected 'faiss' or 'qdrant'")
