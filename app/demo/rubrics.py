"""Rubric queries about generated faces, with their ground truth: what the demo models learn from and what the
quality benchmark asks.

Four kinds, the ways a user searches: ``criteria`` (criteria text only), ``negative`` (criteria text with at
least one absence, e.g. "no forehead stripes"), ``candidate`` (a candidate image only: references showing the
same subject) and ``candidate+criteria`` (a candidate image plus criteria it satisfies). Relevance is exact
(every criterion holds; for a candidate alone, every attribute equal) and the graded gain used for nDCG gives
partial credit (the share of criteria that hold; the share of attributes a reference shares with the candidate).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from rubricsearch.app.demo.faces import ATTRIBUTES, VALUES, Criterion, Face

QueryKind = Literal["criteria", "negative", "candidate", "candidate+criteria"]
KINDS: tuple[QueryKind, ...] = ("criteria", "negative", "candidate", "candidate+criteria")


@dataclass(frozen=True)
class Query:
    """One search: criteria (in the order a user typed them) and/or a candidate face."""

    kind: QueryKind
    criteria: tuple[Criterion, ...] = ()
    candidate: Face | None = None

    @property
    def texts(self) -> list[str]:
        """The criteria as a user types them, one per line (what the search API receives)."""
        return [c.text for c in self.criteria]

    def relevant(self, face: Face) -> bool:
        if self.criteria:
            return all(c.holds(face) for c in self.criteria)
        assert self.candidate is not None
        return face.key == self.candidate.key

    def gain(self, face: Face) -> float:
        """Graded relevance in [0, 1.25] for nDCG: criteria first, then likeness to the candidate."""
        likeness = 0.0
        if self.candidate is not None:
            others = [a for a in ATTRIBUTES if a not in {c.attribute for c in self.criteria}]
            if others:
                likeness = sum(face.value(a) == self.candidate.value(a) for a in others) / len(others)
        if not self.criteria:
            return likeness
        held = sum(c.holds(face) for c in self.criteria) / len(self.criteria)
        return held + (0.25 * likeness if self.candidate is not None else 0.0)


def random_criteria(rng: random.Random, count: int, *, negatives: int = 0,
                    holds_for: Face | None = None) -> tuple[Criterion, ...]:
    """``count`` criteria about distinct attributes, ``negatives`` of them absences; all true of
    ``holds_for`` when given (a candidate's criteria describe the candidate)."""
    attributes = rng.sample(ATTRIBUTES, count)
    negative_at = set(rng.sample(range(count), negatives))
    out = []
    for i, attribute in enumerate(attributes):
        values = VALUES[attribute]
        negated = i in negative_at
        if holds_for is None:
            value = rng.choice(values)
        elif negated:
            value = rng.choice([v for v in values if v != holds_for.value(attribute)])
        else:
            value = holds_for.value(attribute)
        if attribute == "stripes" and negated:  # "no forehead stripes" has one form: the plain value
            value, negated = "plain", False
            if holds_for is not None and holds_for.stripes:
                value, negated = "stripes", False
        out.append(Criterion(attribute, value, negated))
    return tuple(out)


def sample_query(rng: random.Random, kind: QueryKind, candidates: list[Face], *, max_criteria: int = 3) -> Query:
    """One random query of a kind (candidates drawn from ``candidates``)."""
    if kind == "candidate":
        return Query(kind, candidate=rng.choice(candidates))
    if kind == "candidate+criteria":
        candidate = rng.choice(candidates)
        n = rng.randint(1, min(2, max_criteria))
        return Query(kind, random_criteria(rng, n, negatives=rng.randint(0, 1) if n > 1 else 0,
                                           holds_for=candidate), candidate)
    n = rng.randint(1, max_criteria)
    if kind == "negative":
        while True:
            criteria = random_criteria(rng, n, negatives=rng.randint(1, n))
            if any(c.negative for c in criteria):
                return Query(kind, criteria)
    while True:  # "criteria": only presences ("dark forehead stripes", not "no forehead stripes")
        criteria = random_criteria(rng, n)
        if not any(c.negative for c in criteria):
            return Query(kind, criteria)
