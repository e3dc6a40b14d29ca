"""The reranker seam: local transformers and remote vLLM both implement :class:`Reranker`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from retrieval.qwen.prompts import Content


@dataclass
class Pair:
    """One judgement: does ``document`` meet ``query`` under ``instruction``?"""

    query: Content
    document: Content
    instruction: str | None = None


@runtime_checkable
class Reranker(Protocol):
    """Qwen3-VL-Reranker relevance: sigmoid(logit_yes - logit_no) of the official prompt, in [0, 1]."""

    model_id: str
    revision: str

    def score(self, query: Any, documents: Sequence[Any], instruction: str | None = None) -> list[float]:
        """Official-shaped inputs (``{"text"?, "image"?}`` dicts or strings); one score per document."""
        ...

    def score_pairs(self, pairs: Sequence[Pair]) -> list[float]:
        """Parsed pairs, scored in batches (criteria breakdowns use this with many instructions)."""
        ...

    @property
    def stats(self) -> dict[str, int]: ...

    def health(self) -> bool: ...
