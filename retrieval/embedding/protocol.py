"""What the product needs of an embedder (:class:`~retrieval.embedding.task.TaskEmbedder` over either runtime)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rubricsearch.retrieval.packages import ModelPackages, Usage
from rubricsearch.retrieval.qwen.model.prompts import Content


@runtime_checkable
class Embedder(Protocol):
    """Instruction-aware multimodal embeddings in the official Qwen3-VL-Embedding layout."""

    model_id: str
    revision: str
    dimension: int

    @property
    def packages(self) -> ModelPackages:
        """This model's view of the package stage: its tower's fingerprint, and whether it runs here."""
        ...

    def embed(self, items: Sequence[Any], dimensions: int | None = None, *, truncate: bool = True,
              usage: Usage | None = None) -> np.ndarray:
        """Official item dicts -> float32 ``[N, D]``, L2-normalised; ``dimensions`` truncates (Matryoshka)
        and renormalises."""
        ...

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
        ...

    @property
    def stats(self) -> dict[str, int]:
        """At least ``vision_encodes``, ``package_hits``, ``package_misses`` and ``lm_tokens``."""
        ...

    def health(self) -> bool: ...

    def pending(self) -> int:
        """Inputs queued for the model's device (admission control refuses new work above a limit)."""
        ...

    def close(self) -> None: ...


def matryoshka(vectors: np.ndarray, dimensions: int | None, full: int) -> np.ndarray:
    """Truncate to the first ``dimensions`` values and renormalise (the model was trained for this)."""
    from rubricsearch.retrieval.errors import InvalidInput

    if dimensions is None or dimensions == full:
        return vectors
    low = min(64, full)
    if not isinstance(dimensions, int) or not low <= dimensions <= full:
        raise InvalidInput(f"dimensions must be an integer from {low} to {full}, got {dimensions!r}")
    cut = vectors[:, :dimensions]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return (cut / np.maximum(norms, 1e-12)).astype(np.float32)
