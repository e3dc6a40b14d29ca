"""The runtime seam: what a model family's execution backend gives the task classes, and nothing more.

A runtime turns prepared content into vectors (or, for a reranker, pairs into scores) on some device or
server; the task classes (:class:`~retrieval.embedding.task.TaskEmbedder`,
:class:`~rerank.task.TaskReranker`) do everything else once: the official item shapes, instructions,
truncation rules, Matryoshka, the task counters. Two runtimes implement it: local torch
(:class:`~retrieval.runtime.local.LocalRuntime`) and vLLM over HTTP (:class:`~retrieval.remote.runtime.VLLMRuntime`);
the reranker's variants add ``score`` (:class:`~rerank.protocol.ScoringRuntime`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from rubricsearch.retrieval.packages import ModelPackages, Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.runtime.core import Truncation


@runtime_checkable
class Runtime(Protocol):
    """One loaded model behind a device or a server. ``model_id``, ``revision`` and ``dimension`` name it."""

    model_id: str
    revision: str
    dimension: int

    @property
    def packages(self) -> ModelPackages:
        """Images -> visual packages: this model's view of the package stage (its tower, whether it runs here)."""
        ...

    def embed(self, contents: Sequence[Content], instructions: Sequence[str], *, usage: Usage | None,
              truncation: Truncation) -> np.ndarray:
        """A prepared batch (finished instructions, decoded images) -> float32 ``[N, dimension]``, L2-normalised."""
        ...

    def health(self) -> bool: ...

    def load(self) -> tuple[int, dict[str, int]]:
        """Admission and accounting: inputs queued for the device (0 where a server schedules its own), and
        the runtime's counters (package stage, tokens, requests)."""
        ...

    def close(self) -> None: ...
