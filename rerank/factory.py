"""One place that picks and builds the reranker backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from rubricsearch.rerank.protocol import Reranker
from rubricsearch.retrieval.errors import InvalidInput

Backend = Literal["local", "vllm"]


def load_reranker(path_or_id: str | Path, *, backend: Backend = "local", **options: Any) -> Reranker:
    """Load Qwen3-VL-Reranker (a hub id in the local cache, or a path) behind the :class:`Reranker` seam.

    Local options: ``device``, ``dtype``, ``attn_implementation``, ``compile`` (torch.compile the blocks),
    ``fused_kernels`` (Liger's RMSNorm, rotary and SiLU-multiply kernels on a GPU; ``"auto"``: where they run),
    ``packages`` (the VisualPackages service
    shared with the embedder) or just ``store`` (a PackageStore), ``min_pixels``, ``max_pixels``,
    ``max_length``, ``batch_size``, ``lm_workers`` (threads running LM passes; default: one on a GPU, one
    per core on a CPU).
    """
    match backend:
        case "local":
            from rubricsearch.rerank.local import LocalReranker
            from rubricsearch.retrieval.qwen.model.loading import load_qwen

            load_keys = ("device", "dtype", "attn_implementation", "revision", "compile", "fused_kernels")
            # The reranker's LM passes go through the shared-prefix KV cache: its tower alone is compiled.
            loaded = load_qwen(path_or_id, lm_rows=("yes", "no"), compile_language=False,
                               **{k: options.pop(k) for k in load_keys if k in options})
            return LocalReranker(loaded, **options)
        case "vllm":
            from rubricsearch.rerank.remote import VLLMReranker

            reranker: Reranker = VLLMReranker(str(path_or_id), **options)
            return reranker
        case _:
            raise InvalidInput(f"unknown reranker backend {backend!r}; choose 'local' or 'vllm'")
