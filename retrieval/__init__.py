"""rubricsearch retrieval: visual packages, Qwen3-VL embeddings, vector indexes and rubric search."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rubricsearch.retrieval.embedding.protocol import Embedder


def load_embedder(path_or_id: str, **options: Any) -> Embedder:
    """Load Qwen3-VL-Embedding (hub id or local path); see :func:`retrieval.embedding.load_embedder`."""
    from rubricsearch.retrieval.embedding.factory import load_embedder as _load

    return _load(path_or_id, **options)


__all__ = ["load_embedder"]
