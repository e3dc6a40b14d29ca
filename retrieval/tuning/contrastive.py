"""A set's judgments as the embedder's contrastive data, and the held-out ranking it is measured by.

A query is a criterion as search embeds it (the criterion's text under the text-only recall instruction,
:func:`retrieval.search.instructions.build`); its positives are the references judged "yes" for it. Its hard
negatives are the references judged "no" for it, the hardest the set has since a person thought them worth
judging; a criterion judged only "yes" takes the references nearest to it that are not judged "yes" (mined with
the base model). Every other document of a batch is an in-batch negative, unless it is judged "yes" for the
query (those are masked, never pushed away).

Validation ranks the held-out references judged for a criterion by their similarity to it: recall@10 and
nDCG@10 (binary gains), averaged over the criteria judged both ways on the held-out side, and the held-out
InfoNCE loss over the same references (which moves where the ranks do not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.metrics import ndcg_at
from rubricsearch.retrieval.search.instructions import Rubric, build
from rubricsearch.retrieval.tuning.judgments import JudgedCell, held_out

AT = 10  # recall@10 and nDCG@10
MINED = 3  # nearest references taken as hard negatives of a criterion nobody judged "no"


def query_instruction(criterion: str) -> str:
    """The instruction search embeds this criterion with, asked alone and without a candidate."""
    return build(Rubric.parse(None, [criterion]), False).query


@dataclass(frozen=True)
class Criterion:
    """One criterion's judgments on one side of the split."""

    text: str
    yes: frozenset[str]
    no: frozenset[str]

    @property
    def judged(self) -> frozenset[str]:
        return self.yes | self.no


def criteria(cells: Sequence[JudgedCell], references: set[str]) -> list[Criterion]:
    """The criteria judged on ``references``, in first-judged order; a reference judged both ways for one
    criterion counts by its latest judgment."""
    latest: dict[tuple[str, str], bool] = {}
    for c in sorted(cells, key=lambda c: c.judgment_id):
        if c.sha256 in references:
            latest[(c.criterion, c.sha256)] = c.holds
    order = list(dict.fromkeys(text for text, _ in latest))
    return [Criterion(text, frozenset(s for (t, s), h in latest.items() if t == text and h),
                      frozenset(s for (t, s), h in latest.items() if t == text and not h)) for text in order]


@dataclass(frozen=True)
class Pair:
    """A training item: a criterion (its index) and one reference judged "yes" for it."""

    query: int
    positive: str


def training_pairs(train: Sequence[Criterion]) -> list[Pair]:
    pairs = [Pair(i, sha) for i, c in enumerate(train) for sha in sorted(c.yes)]
    if not pairs:
        raise InvalidInput("no training reference is judged \"yes\" for any criterion: the embedder learns from the "
                           "references that match a criterion (the split is by reference, seeded)")
    return pairs


def hard_negatives(train: Sequence[Criterion], scores: np.ndarray, references: Sequence[str]) -> list[list[str]]:
    """Per criterion, its judged "no" references; else the :data:`MINED` references of ``references`` nearest
    to it (``scores[i, j]``: criterion i against reference j) not judged "yes" for it."""
    out: list[list[str]] = []
    for i, c in enumerate(train):
        if c.no:
            out.append(sorted(c.no))
            continue
        order = np.argsort(-scores[i], kind="stable")
        out.append([references[j] for j in order if references[j] not in c.yes][:MINED])
    return out


@dataclass(frozen=True)
class Split:
    train_references: set[str]
    validation_references: set[str]
    train: list[Criterion]
    validation: list[Criterion]  # the criteria judged both ways on the held-out references
    pairs: list[Pair]


def split(cells: Sequence[JudgedCell], seed: int) -> Split:
    """The seeded split by reference (:func:`retrieval.tuning.judgments.held_out`) as contrastive data; raises
    :class:`InvalidInput` when training has no pair or validation no criterion judged both ways."""
    held = held_out((c.sha256 for c in cells), seed)
    train_refs = {c.sha256 for c in cells} - held
    train = criteria(cells, train_refs)
    validation = measured(criteria(cells, held))
    return Split(train_refs, held, train, validation, training_pairs(train))


@dataclass(frozen=True)
class Ranking:
    """Held-out quality of the embedder's ranking: means over ``queries`` criteria."""

    queries: int
    references: int
    recall: float
    ndcg: float
    loss: float  # InfoNCE of each "yes" against the criterion's "no" references
    drift: float = 0.0  # the trainer's: mean squared distance of the anchor queries from their base vectors

    def to_json(self) -> dict[str, Any]:
        return {"queries": self.queries, "references": self.references, f"recall@{AT}": round(self.recall, 4),
                f"ndcg@{AT}": round(self.ndcg, 4), "infonce": round(self.loss, 4),
                "anchor_drift": round(self.drift, 6)}


def measured(side: Sequence[Criterion]) -> list[Criterion]:
    """The criteria a ranking can be measured on: judged "yes" and "no" on this side."""
    kept = [c for c in side if c.yes and c.no]
    if not kept:
        raise InvalidInput("no criterion is judged both \"yes\" and \"no\" on the held-out references, so the "
                           "ranking cannot be measured: judge more references both ways (the split is by "
                           "reference, seeded)", criteria=len(side))
    return kept


def ranking(side: Sequence[Criterion], scores: np.ndarray, references: Sequence[str], temperature: float
            ) -> Ranking:
    """``scores[i, j]``: criterion i against reference j; each criterion ranks the references judged for it."""
    column = {sha: j for j, sha in enumerate(references)}
    recalls, ndcgs, losses = [], [], []
    for i, c in enumerate(side):
        negatives = np.array([scores[i, column[s]] for s in sorted(c.no)], dtype=np.float64) / temperature
        for sha in sorted(c.yes):
            logits = np.concatenate(([scores[i, column[sha]] / temperature], negatives))
            losses.append(float(np.logaddexp.reduce(logits) - logits[0]))
        judged = sorted(c.judged)
        gains = [float(sha in c.yes) for sha in judged]
        order = sorted(range(len(judged)), key=lambda j: -float(scores[i, column[judged[j]]]))
        recalls.append(sum(gains[j] for j in order[:AT]) / len(c.yes))
        ndcgs.append(ndcg_at(order, gains, AT))
    return Ranking(len(side), len(references), float(np.mean(recalls)), float(np.mean(ndcgs)),
                   float(np.mean(losses)))
