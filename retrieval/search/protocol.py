"""The second stage as search sees it: something that scores a shortlist against a rubric.

Search owns this seam so recall never depends on the reranker's package; ``rerank.rubric.RubricReranker``
implements it over any :class:`~rerank.protocol.Reranker` (local or vLLM). Whether a query is reranked at all is
the scorer's own decision (a measured policy, in ``rerank.rubric``): search only reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rubricsearch.retrieval.packages import ModelPackages, Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search.instructions import Rubric
from rubricsearch.retrieval.search.provenance import PolicyReport


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
    """The scorer's scores of a shortlist, in the order it was given.

    ``kept_recall_order`` is None when the scores are judgements that rerank the shortlist; otherwise it is why
    the scorer kept the recall order (for ``rerank_status``), ``overall`` then scores the hits in that order
    (``per_criterion`` is empty) and ``formed`` says how."""

    overall: list[float]
    per_criterion: list[list[float]]  # [document][criterion]
    kept_recall_order: str | None = None
    formed: str | None = None


class ShortlistScorer(Protocol):
    """Scores a shortlist of references against a query and its rubric, from cached packages."""

    model_id: str
    revision: str
    version: str  # "base", or the id of a version trained for a set (provenance names it)

    @property
    def packages(self) -> ModelPackages:
        """The scoring model's view of the package stage (its vision tower)."""
        ...

    def instructions(self, rubric: Rubric, has_candidate: bool) -> ScoringInstructions: ...

    def policy_report(self, rubric: Rubric, has_candidate: bool) -> PolicyReport:
        """What decides whether this scorer reranks a query like this one, as provenance reports it."""
        ...

    def score(self, query: Content, rubric: Rubric, documents: Sequence[Content], recall_scores: Sequence[float],
              *, usage: Usage | None = None) -> ShortlistScores:
        """All judgements batched, or, where the scorer keeps the recall order, its scores of ``recall_scores``
        (the documents' vector scores); raises BackendUnavailable when the scoring model cannot be reached."""
        ...
