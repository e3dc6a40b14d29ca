"""Runtimes by name: the factories load them from here with importlib, so no core module imports a plug-in.

``local`` is the plain torch runtime (the reference; it runs everywhere), ``accelerated`` layers CUDA graphs and
the packed shortlist passes on it, ``vllm`` sends the work to a vLLM server. A new runtime (another model family,
another server) is one more entry here and one adapter module.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rubricsearch.retrieval.packages import VisualPackages
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
    from rubricsearch.retrieval.runtime.config import ModelConfig

RuntimeName = Literal["local", "accelerated", "vllm"]

# task -> runtime name -> "module:class"
RUNTIMES: dict[str, dict[str, str]] = {
    "embedding": {
        "local": "rubricsearch.retrieval.runtime.local:LocalRuntime",
        "accelerated": "rubricsearch.retrieval.plugins.accelerated:AcceleratedRuntime",
        "vllm": "rubricsearch.retrieval.remote.runtime:VLLMRuntime",
    },
    "reranker": {
        "local": "rubricsearch.rerank.local:LocalScoringRuntime",
        "accelerated": "rubricsearch.rerank.plugins.accelerated:AcceleratedScoringRuntime",
        "vllm": "rubricsearch.rerank.remote:VLLMScoringRuntime",
    },
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
    return runtime_class(task, local_engine(config.local, loaded))(loaded, config.local, config.vision, role=task,
                                                                   packages=packages, vision=vision)
