"""What the accelerated runtime does to a loaded checkpoint before its first pass: Liger's fused kernels
(``LocalConfig.fused_kernels``, :mod:`.kernels.fused_kernels`) and ``torch.compile`` of each block
(``LocalConfig.compile``). The plain runtime loads the checkpoint as transformers builds it."""

from __future__ import annotations

import logging

from rubricsearch.retrieval.plugins.accelerated.kernels.fused_kernels import (
    fused_kernels_problem,
    fused_kernels_wanted,
    use_fused_kernels,
)
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
from rubricsearch.retrieval.runtime.config import LocalConfig

log = logging.getLogger(__name__)


def accelerate(loaded: LoadedQwen, config: LocalConfig, *, language: bool = True) -> None:
    """Switch ``loaded`` to the fused kernels and compile its blocks as ``config`` asks (``language``: the LM's
    layers too, see :func:`compile_blocks`). A model switched before keeps its kernels: a second runtime over the
    same checkpoint changes nothing."""
    if not loaded.fused_kernels:
        fused = fused_kernels_wanted(config.fused_kernels, loaded.device)
        if fused:
            use_fused_kernels(loaded.model)
            loaded.fused_kernels = True
        if config.fused_kernels == "auto":
            log.info("%s: Liger's fused kernels %s", loaded.model_id,
                     "on" if fused else f"off ({fused_kernels_problem(loaded.device)})")
    if config.compile:
        compile_blocks(loaded, language=language)


def compile_blocks(loaded: LoadedQwen, *, dynamic: bool = True, language: bool = True) -> int:
    """``torch.compile`` each transformer block of the tower and the language model, which fuses their
    element-wise work (norms, activations, rotary embeddings) around the matrix products; ``dynamic=False``
    specialises on each new shape (one compile per shape: for workloads of few shapes). ``language=False``
    leaves the LM's layers eager: passes through a KV cache (the reranker's shared prefix) index the cache by
    layer number, which torch.compile specialises on, so each layer would compile on its own and the 9th hits
    dynamo's recompile limit. Blocks keep their signatures; returns how many blocks were compiled."""
    blocks = []
    visual = getattr(loaded.model, "visual", None)
    if visual is not None:
        blocks += list(visual.blocks)
    text = getattr(loaded.model, "language_model", None)
    if language and text is not None:
        blocks += list(text.layers)
    for block in blocks:
        block.compile(dynamic=dynamic)
    return len(blocks)
