"""The reranker: Qwen3-VL-Reranker's task logic once, over any scoring runtime.

A drop-in for the official ``Qwen3VLReranker``: the same ``process``-shaped inputs (the query may be the
official ``(instruction, text)`` tuple), the same prompt and truncation rule, one score in [0, 1] per
document. Where the model runs is the runtime's business (:class:`~rerank.protocol.ScoringRuntime`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rubricsearch.rerank.protocol import Pair, ScoringRuntime, official_pairs
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.runtime.config import ModelConfig
from rubricsearch.retrieval.runtime.core import TaskModel, Truncation

RERANK_MAX_LENGTH = 10240  # the official Qwen3VLReranker's default max_length


class TaskReranker(TaskModel):
    """``score(query, documents, instruction)``: sigmoid(logit_yes - logit_no) of the official prompt."""

    runtime: ScoringRuntime

    def __init__(self, runtime: ScoringRuntime, config: ModelConfig) -> None:
        super().__init__(runtime, config.inputs, config.max_length or RERANK_MAX_LENGTH, ("scored_pairs",))

    def score(self, query: Any, documents: Sequence[Any], instruction: str | None = None, *,
              truncate: bool = True, usage: Usage | None = None) -> list[float]:
        """Official-shaped inputs (``{"text"?, "image"?}`` dicts or strings); one score per document."""
        return self.score_pairs(official_pairs(query, documents, instruction, max_bytes=self.image_max_bytes,
                                               max_pixels=self.image_max_pixels), truncate=truncate, usage=usage)

    def score_pairs(self, pairs: Sequence[Pair], *, usage: Usage | None = None,
                    truncate: bool = True) -> list[float]:
        """Parsed pairs, scored in batches (criteria breakdowns use this with many instructions);
        ``usage`` collects the vision encodes. Over the token limit a pair is cut as the official class
        cuts it, or, with ``truncate=False``, refused (:class:`~retrieval.errors.InputTooLong`)."""
        if not pairs:
            return []
        scores = self.runtime.score(pairs, usage=usage, truncation=Truncation(self.max_length, truncate))
        self.count("scored_pairs", len(pairs))
        return scores
