"""The embedder: Qwen3-VL-Embedding's task logic once, over any runtime.

A drop-in for the official ``Qwen3VLEmbedder``: the same item dicts, the finished instruction (the official
default when none), the same truncation and Matryoshka rules. Where the model runs is the runtime's
business (:mod:`retrieval.runtime.seam`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rubricsearch.retrieval.embedding.protocol import matryoshka
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.inputs import parse_embed_items
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.prompts import EMBED_DEFAULT_INSTRUCTION, Content, finish_instruction
from rubricsearch.retrieval.runtime.config import ModelConfig
from rubricsearch.retrieval.runtime.core import TaskModel, Truncation
from rubricsearch.retrieval.runtime.seam import Runtime

EMBED_MAX_LENGTH = 8192  # the official Qwen3VLEmbedder's default max_length


class TaskEmbedder(TaskModel):
    """``embed(items, dimensions)``: instruction-aware multimodal embeddings, float32 ``[N, D]``, L2-normalised."""

    def __init__(self, runtime: Runtime, config: ModelConfig) -> None:
        super().__init__(runtime, config.inputs, config.max_length or EMBED_MAX_LENGTH, ("embedded_items",))
        self.dimension = runtime.dimension
        self.default_instruction = (EMBED_DEFAULT_INSTRUCTION if config.default_instruction is None
                                    else config.default_instruction)

    def embed(self, items: Sequence[Any], dimensions: int | None = None, *, truncate: bool = True,
              usage: Usage | None = None) -> np.ndarray:
        """Official item dicts -> float32 ``[N, D]``, L2-normalised; ``dimensions`` truncates (Matryoshka)
        and renormalises."""
        contents, instructions = parse_embed_items(items, max_bytes=self.image_max_bytes,
                                                   max_pixels=self.image_max_pixels)
        return self.embed_contents(contents, instructions, dimensions, truncate=truncate, usage=usage)

    def embed_contents(
        self,
        contents: Sequence[Content],
        instructions: Sequence[str | None],
        dimensions: int | None = None,
        *,
        usage: Usage | None = None,
        truncate: bool = True,
    ) -> np.ndarray:
        """Already-parsed content (search, ingestion, the API); ``usage`` collects the vision encodes.
        Text over the model's token limit is cut as the official classes cut it, or, with
        ``truncate=False``, refused (:class:`~retrieval.errors.InputTooLong`)."""
        if len(contents) != len(instructions):
            raise InvalidInput("one instruction (or None) per item is required")
        matryoshka(np.zeros((0, self.dimension), dtype=np.float32), dimensions, self.dimension)  # refuse before work
        if not contents:
            return np.zeros((0, dimensions or self.dimension), dtype=np.float32)
        finished = [finish_instruction(i, self.default_instruction) for i in instructions]
        vectors = self.runtime.embed(contents, finished, usage=usage,
                                     truncation=Truncation(self.max_length, truncate))
        self.count("embedded_items", len(contents))
        return matryoshka(vectors, dimensions, self.dimension)

