"""One place that picks and builds the embedder backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from rubricsearch.retrieval.embedding.protocol import Embedder
from rubricsearch.retrieval.errors import InvalidInput

Backend = Literal["local", "vllm"]


def load_embedder(path_or_id: str | Path, *, backend: Backend = "local", **options: Any) -> Embedder:
    """Load Qwen3-VL-Embedding (a hub id in the local cache, or a path) behind the :class:`Embedder` seam.

    Local options: ``device``, ``dtype``, ``attn_implementation``, ``compile`` (torch.compile the blocks),
    ``fused_kernels`` (Liger's RMSNorm, rotary and SiLU-multiply kernels on a GPU; ``"auto"``: where they run),
    ``packages`` (a VisualPackages service,
    shared with the reranker: identical vision towers then share packages, and ingestion builds packages for
    every distinct tower), or just ``store`` (a PackageStore), ``min_pixels``, ``max_pixels``,
    ``default_instruction``, ``max_length``, ``batch_size``, ``lm_workers`` (threads running LM passes; default:
    one on a GPU, one per core on a CPU). vLLM options: see ``retrieval.remote``.
    """
    match backend:
        case "local":
            from rubricsearch.retrieval.embedding.local import LocalEmbedder
            from rubricsearch.retrieval.qwen.model.loading import load_qwen

            load_keys = ("device", "dtype", "attn_implementation", "revision", "compile", "fused_kernels")
            loaded = load_qwen(path_or_id, **{k: options.pop(k) for k in load_keys if k in options})
            return LocalEmbedder(loaded, **options)
        case "vllm":
            from rubricsearch.retrieval.remote.embedder import VLLMEmbedder

            embedder: Embedder = VLLMEmbedder(str(path_or_id), **options)
            return embedder
        case _:
            raise InvalidInput(f"unknown embedder backend {backend!r}; choose 'local' or 'vllm'")
