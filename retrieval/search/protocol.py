"""The second stage as search sees it: something that scores a shortlist against a rubric.

Search owns this seam so recall never depends on the reranker's package; ``rerank.rubric.RubricReranker``
implements it over any :class:`~rerank.protocol.Reranker` (local or vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from retrieval.packages import ModelPackages, Usage
from retrieval.qwen.model.prompts import Content
from retrieval.search.instructions import Rubric


@dataclass(frozen=True)
class Judged:
    """A criterion as typed, the positive statement the scorer judges, and whether its score is 1 − P(it)."""

    criterion: str
    statement: str
    negated: bool


@dataclass(frozen=True)
class ScoringInstructions:
    """The instructions a scorer judges with: one per criterion (in the rubric's order), or, for a query
    without criteria, one ``overall`` judgement of the whole query; ``formed`` says how the score is made."""

    overall: str | None
    per_criterion: tuple[str, ...]
    judged: tuple[Judged, ...]
    formed: str


@dataclass
class ShortlistScores:
    overall: list[float]
    per_criterion: list[list[float]]  # [document][criterion]


class ShortlistScorer(Protocol):
    """Scores a shortlist of references against a query and its rubric, from cached packages."""

    model_id: str
    revision: str

    @property
    def packages(self) -> ModelPackages:
        """The scoring model's view of the package stage (its vision tower)."""
        ...

    def instructions(self, rubric: Rubric, has_candidate: bool) -> ScoringInstructions: ...

    def score(self, query: Content, rubric: Rubric, documents: Sequence[Content], *,
              usage: Usage | None = None) -> ShortlistScores:
        """All judgements batched; raises BackendUnavailable when the scoring model cannot be reached."""
        ...
