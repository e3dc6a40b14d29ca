"""The second stage as search sees it: something that scores a shortlist against a rubric.

Search owns this seam so recall never depends on the reranker's package; ``rerank.rubric.RubricReranker``
implements it over any :class:`~rerank.protocol.Reranker` (local or vLLM).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rubricsearch.retrieval.packages import ModelPackages, Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search.instructions import Rubric


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


QueryKind = Literal["criteria", "negative", "candidate", "candidate+criteria"]
QUERY_KINDS: tuple[QueryKind, ...] = ("criteria", "negative", "candidate", "candidate+criteria")


@dataclass(frozen=True)
class KindPolicy:
    """Whether the scorer reranks searches of one kind, and the measurement that decided it.

    A scorer whose model was not measured reranks every kind (``measured`` is None). Where reranking lost to the
    recall order on the model's held-out measurement, search keeps the recall order, and ``calibration``
    (slope, intercept; measured with it) maps the vector score to the probability of a match,
    ``sigmoid(slope · s + intercept)``, so ``score`` and the match threshold keep their meaning. Where it reranks,
    ``judgement_calibration`` (measured likewise) maps each judgement's P(yes) to the probability that the judged
    statement holds (:meth:`judgement`)."""

    kind: QueryKind
    rerank: bool = True
    measured: dict[str, float] | None = None  # nDCG@10 of the recall and the reranked order
    calibration: tuple[float, float] | None = None
    source: str | None = None
    judgement_calibration: tuple[float, float] | None = None

    def recall_score(self, vector_score: float) -> float:
        """The score of a hit ordered by recall: its calibrated match probability (monotone in the vector score)."""
        if self.calibration is None:
            return vector_score
        slope, intercept = self.calibration
        return _sigmoid(slope * vector_score + intercept)

    def judgement(self, p_yes: float) -> float:
        """The probability that a judged statement holds: the reranker's P(yes) through the Platt calibration
        measured with the checkpoint, ``sigmoid(slope · logit(P) + intercept)``; P(yes) itself without one."""
        if self.judgement_calibration is None:
            return p_yes
        slope, intercept = self.judgement_calibration
        return _sigmoid(slope * logit(p_yes) + intercept)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "rerank": self.rerank, "measured_ndcg10": self.measured,
                "calibration": _pair(self.calibration), "judgement_calibration": _pair(self.judgement_calibration),
                "source": self.source}


def logit(p: float) -> float:
    """``log(p / (1 − p))`` of a probability clipped to [1e-7, 1 − 1e-7]: a judgement's P(yes) of exactly 0 or 1
    (float rounding of a confident model) stays finite, so the calibration fitted on it and applied to it agree."""
    q = min(max(p, 1e-7), 1 - 1e-7)
    return math.log(q / (1 - q))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _pair(calibration: tuple[float, float] | None) -> dict[str, float] | None:
    return None if calibration is None else {"slope": calibration[0], "intercept": calibration[1]}


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

    def policy(self, rubric: Rubric, has_candidate: bool) -> KindPolicy:
        """Whether this query's kind is reranked (the model's measured policy; unmeasured: always)."""
        ...

    def score(self, query: Content, rubric: Rubric, documents: Sequence[Content], *,
              usage: Usage | None = None) -> ShortlistScores:
        """All judgements batched; raises BackendUnavailable when the scoring model cannot be reached."""
        ...
