"""One place that builds the reranker: the task class over the scoring runtime its configuration names."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Unpack

if TYPE_CHECKING:
    from rubricsearch.rerank.protocol import ScoringRuntime
    from rubricsearch.rerank.task import TaskReranker
    from rubricsearch.retrieval.packages import PackageStore, VisualPackages
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
    from rubricsearch.retrieval.runtime.config import ModelConfig, ModelOptions


def load_reranker(
    model: str | Path | LoadedQwen,
    config: ModelConfig | None = None,
    *,
    packages: VisualPackages | None = None,
    store: PackageStore | None = None,
    vision: VisionEncoder | None = None,
    **options: Unpack[ModelOptions],
) -> TaskReranker:
    """Qwen3-VL-Reranker (a hub id in the local cache, a path, or a checkpoint loaded here with its ``yes`` and
    ``no`` LM rows); the arguments are :func:`~retrieval.embedding.factory.load_embedder`'s."""
    from rubricsearch.rerank.task import TaskReranker
    from rubricsearch.retrieval.packages import VisualPackages
    from rubricsearch.retrieval.runtime.config import configure
    from rubricsearch.retrieval.runtime.registry import build_runtime

    config = configure(config, options)
    if packages is None and store is not None:
        packages = VisualPackages(store)
    runtime: ScoringRuntime = build_runtime("reranker", model, config, packages=packages, vision=vision,
                                            lm_rows=("yes", "no"))
    return TaskReranker(runtime, config)
