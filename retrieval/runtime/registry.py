"""Runtimes and vision encoders by name: the factories load them from here with importlib, so no core module
imports a plug-in.

``local`` is the plain torch runtime (the reference; it runs everywhere), ``accelerated`` layers the GPU paths on
it (fused kernels, compiled blocks, packed passes, CUDA graphs: ``retrieval/plugins/accelerated/``), ``vllm`` sends
the work to a vLLM server. A new runtime (another model family, another server) is one more entry here and one
adapter module. Vision encoders outside a runtime (a vision-only worker next to vLLM, the CLI's reranker tower)
come from :data:`VISION_ENCODERS` the same way.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rubricsearch.retrieval.packages import VisualPackages
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
    from rubricsearch.retrieval.runtime.config import ModelConfig, VisionConfig

RuntimeName = Literal["local", "accelerated", "vllm"]
LocalEngine = Literal["local", "accelerated"]

# task -> runtime name -> "module:class"
RUNTIMES: dict[str, dict[str, str]] = {
    "embedding": {
        "local": "rubricsearch.retrieval.runtime.local:LocalRuntime",
        "accelerated": "rubricsearch.retrieval.plugins.accelerated.runtime:AcceleratedRuntime",
        "vllm": "rubricsearch.retrieval.remote.runtime:VLLMRuntime",
    },
    "reranker": {
        "local": "rubricsearch.rerank.local:LocalScoringRuntime",
        "accelerated": "rubricsearch.rerank.plugins.accelerated.runtime:AcceleratedScoringRuntime",
        "vllm": "rubricsearch.rerank.remote:VLLMScoringRuntime",
    },
}

# local engine -> "module:class" of its vision encoder
VISION_ENCODERS: dict[str, str] = {
    "local": "rubricsearch.retrieval.qwen.engine.vision:VisionEncoder",
    "accelerated": "rubricsearch.retrieval.plugins.accelerated.vision:AcceleratedVisionEncoder",
}


def runtime_class(task: str, name: RuntimeName) -> Any:
    """The runtime class registered as ``name`` for ``task`` ("embedding" or "reranker")."""
    module, _, attr = RUNTIMES[task][name].partition(":")
    return getattr(importlib.import_module(module), attr)


def build_runtime(task: str, model: str | Path | LoadedQwen, config: ModelConfig, *,
                  packages: VisualPackages | None, vision: VisionEncoder | None, **load_options: Any) -> Any:
    """The runtime ``config`` names for ``task``: the vLLM one where it gives a server, else the local engine it
    asks for over ``model`` (loaded here with ``load_options`` unless it is already a :class:`LoadedQwen`)."""
    from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
    from rubricsearch.retrieval.runtime.local import load_local, local_engine

    if config.vllm is not None:
        return runtime_class(task, "vllm")(str(model), config.vllm, config.vision, role=task, packages=packages,
                                           vision=vision)
    loaded = model if isinstance(model, LoadedQwen) else load_local(model, config.local, **load_options)
    engine = local_engine(config.local, loaded, config.vision.preprocess)
    return runtime_class(task, engine)(loaded, config.local, config.vision, role=task, packages=packages,
                                       vision=vision)


def vision_encoder(loaded: LoadedQwen, vision: VisionConfig, *, engine: Literal["auto"] | LocalEngine = "auto",
                   **options: Any) -> VisionEncoder:
    """The vision encoder ``engine`` names over ``loaded`` (``options``: the encoder's own keywords). ``auto`` is
    the accelerated one on a GPU or for preprocessing only it does (``gpu-nvjpeg``), the plain one elsewhere."""
    if engine == "auto":
        engine = "accelerated" if loaded.device.type == "cuda" or vision.preprocess != "official" else "local"
    module, _, attr = VISION_ENCODERS[engine].partition(":")
    encoder: VisionEncoder = getattr(importlib.import_module(module), attr)(
        loaded, min_pixels=vision.min_pixels, max_pixels=vision.max_pixels, preprocess=vision.preprocess, **options)
    return encoder
