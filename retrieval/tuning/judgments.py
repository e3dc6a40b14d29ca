"""Judgments as both trainers read them, references as handles to their packages, and the split by reference.

A judgment is (reference, criterion, yes/no). References go to training or validation whole (every judgment of one
reference on one side), so validation measures references the model never saw.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.images import ReferenceImage

VALIDATION_SHARE = 0.25  # of the references, at least one


@dataclass(frozen=True)
class JudgedCell:
    """One judgment: whether ``criterion`` holds for the reference image ``sha256``."""

    judgment_id: int
    sha256: str
    criterion: str
    holds: bool


def check_cells(cells: Sequence[JudgedCell]) -> None:
    """Refuse judgments no model can train on (:class:`InvalidInput`): none, or all with the same answer."""
    if not cells:
        raise InvalidInput("no judgments to train on: record judgments of the set's references first")
    if len({c.holds for c in cells}) < 2:
        raise InvalidInput("every judgment answers the same: training needs yes and no judgments",
                           judgments=len(cells))


def _no_pixels() -> bytes:
    # Training reads the reference's cached package; asking for its bytes means the tower was about to run.
    raise RuntimeError("fine-tuning reads references from their packages only")


def reference(sha256: str) -> ReferenceImage:
    """A reference as search passes it: a handle by sha256 whose pixels are never read here."""
    return ReferenceImage(sha256, _no_pixels)


def held_out(references: Iterable[str], seed: int, share: float = VALIDATION_SHARE) -> set[str]:
    """A seeded share of the references (at least one, never all): the validation side."""
    shas = sorted(set(references))
    if len(shas) < 2:
        raise InvalidInput("fine-tuning needs judgments of at least 2 references (one to train on, one to validate)",
                           references=len(shas))
    rng = random.Random(seed)
    rng.shuffle(shas)
    return set(shas[:max(1, min(len(shas) - 1, round(share * len(shas))))])
