"""Runtimes by name: the factories load them from here with importlib, so no core module imports a plug-in.

``local`` is the plain torch runtime (the reference; it runs everywhere), ``accelerated`` layers CUDA graphs and
the packed shortlist passes on it, ``vllm`` sends the work to a vLLM server. A new runtime (another model family,
another server) is one more entry here and one adapter module.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

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
