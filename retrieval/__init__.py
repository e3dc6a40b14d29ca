"""rubricsearch retrieval: visual packages, Qwen3-VL embeddings, vector indexes and rubric search."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Unpack

if TYPE_CHECKING:
    from rubricsearch.retrieval.embedding.task import TaskEmbedder
    from rubricsearch.retrieval.packages import PackageStore, VisualPackages
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
    from rubricsearch.retrieval.runtime.config import ModelConfig, ModelOptions


def load_embedder(model: str | Path | LoadedQwen, config: ModelConfig | None = None, *,
                  packages: VisualPackages | None = None, store: PackageStore | None = None,
                  vision: VisionEncoder | None = None, **options: Unpack[ModelOptions]) -> TaskEmbedder:
    """Load Qwen3-VL-Embedding (hub id or local path); see :func:`retrieval.embedding.factory.load_embedder`."""
    from rubricsearch.retrieval.embedding.factory import load_embedder as _load

    return _load(model, config, packages=packages, store=store, vision=vision, **options)


__all__ = ["load_embedder"]
