"""rubricsearch reranking: Qwen3-VL-Reranker backends scoring from cached visual packages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rubricsearch.rerank.protocol import Reranker


def load_reranker(path_or_id: str, **options: Any) -> Reranker:
    """Load Qwen3-VL-Reranker (hub id or local path); see :func:`rerank.factory.load_reranker`."""
    from rubricsearch.rerank.factory import load_reranker as _load

    return _load(path_or_id, **options)


__all__ = ["load_reranker"]
