"""rubricsearch reranking: Qwen3-VL-Reranker backends scoring from cached visual packages."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Unpack

if TYPE_CHECKING:
    from rubricsearch.rerank.task import TaskReranker
    from rubricsearch.retrieval.packages import PackageStore, VisualPackages
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
    from rubricsearch.retrieval.runtime.config import ModelConfig, ModelOptions


def load_reranker(model: str | Path | LoadedQwen, config: ModelConfig | None = None, *,
                  packages: VisualPackages | None = None, store: PackageStore | None = None,
                  vision: VisionEncoder | None = None, **options: Unpack[ModelOptions]) -> TaskReranker:
    """Load Qwen3-VL-Reranker (hub id or local path); see :func:`rerank.factory.load_reranker`."""
    from rubricsearch.rerank.factory import load_reranker as _load

    return _load(model, config, packages=packages, store=store, vision=vision, **options)


__all__ = ["load_reranker"]
