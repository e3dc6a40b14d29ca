"""One place that builds the embedder: the task class over the runtime its configuration names."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Unpack

if TYPE_CHECKING:
    from rubricsearch.retrieval.embedding.task import TaskEmbedder
    from rubricsearch.retrieval.packages import PackageStore, VisualPackages
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
    from rubricsearch.retrieval.runtime.config import ModelConfig, ModelOptions
    from rubricsearch.retrieval.runtime.seam import Runtime


def load_embedder(
    model: str | Path | LoadedQwen,
    config: ModelConfig | None = None,
    *,
    packages: VisualPackages | None = None,
    store: PackageStore | None = None,
    vision: VisionEncoder | None = None,
    **options: Unpack[ModelOptions],
) -> TaskEmbedder:
    """Qwen3-VL-Embedding (a hub id in the local cache, a path, or a checkpoint already loaded here).

    ``config`` groups every knob (:class:`~retrieval.runtime.config.ModelConfig`); keyword ``options`` set
    single fields of it (``device="cpu"``, ``max_pixels=…``; ``base_url`` selects the vLLM runtime).
    ``packages`` is the package stage shared with the reranker (identical vision towers then share
    packages, and ingestion builds packages for every distinct tower), or just ``store`` (a PackageStore);
    ``vision`` passes in a tower already built for this checkpoint.
    """
    from rubricsearch.retrieval.embedding.task import TaskEmbedder
    from rubricsearch.retrieval.packages import VisualPackages
    from rubricsearch.retrieval.runtime.config import configure
    from rubricsearch.retrieval.runtime.registry import build_runtime

    config = configure(config, options)
    if packages is None and store is not None:
        packages = VisualPackages(store)
    runtime: Runtime = build_runtime("embedding", model, config, packages=packages, vision=vision)
    return TaskEmbedder(runtime, config)
