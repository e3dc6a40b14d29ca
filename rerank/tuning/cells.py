"""Judged cells as training pairs, and the split of a set's references into training and validation.

A cell is (reference, criterion, yes/no) as a judgment recorded it. It becomes the pair search asks for that
criterion with no candidate (:func:`rerank.rubric.rubric_instructions`): the criterion's positive statement as
the query, the reference as the document, the per-criterion instruction. The label is whether the positive
statement holds, so a judged "no hairline crack" teaches "hairline crack" with the answer flipped.

References go to training or validation whole (every cell of one reference on one side), so validation measures
references the model never saw; the set's judged "no" cells are the negatives, the hardest the set has.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from rubricsearch.rerank.protocol import Pair
from rubricsearch.rerank.rubric import rubric_instructions
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.images import ReferenceImage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search.instructions import Rubric

VALIDATION_SHARE = 0.25  # of the references, at least one


@dataclass(frozen=True)
class JudgedCell:
    """One judgment: whether ``criterion`` holds for the reference image ``sha256``."""

    judgment_id: int
    sha256: str
    criterion: str
    holds: bool


@dataclass(frozen=True)
class Example:
    """A cell as the reranker is asked it: the pair and whether the model should answer yes."""

    cell: JudgedCell
    pair: Pair
    yes: bool


def _no_pixels() -> bytes:
    # Training reads the reference's cached package; asking for its bytes means the tower was about to run.
    raise RuntimeError("fine-tuning reads references from their packages only")


def reference(sha256: str) -> ReferenceImage:
    """A reference as search passes it: a handle by sha256 whose pixels are never read here."""
    return ReferenceImage(sha256, _no_pixels)


def example(cell: JudgedCell) -> Example:
    instr = rubric_instructions(Rubric.parse(None, [cell.criterion]), False)
    judged = instr.judged[0]
    pair = Pair(Content(texts=[judged.statement]), Content(images=[reference(cell.sha256)]), instr.per_criterion[0])
    return Example(cell, pair, cell.holds != judged.negated)


@dataclass(frozen=True)
class Split:
    train: list[Example]
    validation: list[Example]

    @property
    def train_references(self) -> set[str]:
        return {e.cell.sha256 for e in self.train}

    @property
    def validation_references(self) -> set[str]:
        return {e.cell.sha256 for e in self.validation}


def split_by_reference(examples: Sequence[Example], seed: int, share: float = VALIDATION_SHARE) -> Split:
    """A seeded share of the references (at least one, never all) holds out all of its cells. Both sides need
    a yes and a no: training learns nothing from one answer, and validation's AUC needs both."""
    shas = sorted({e.cell.sha256 for e in examples})
    if len(shas) < 2:
        raise InvalidInput("fine-tuning needs judgments of at least 2 references (one to train on, one to validate)",
                           references=len(shas))
    rng = random.Random(seed)
    rng.shuffle(shas)
    held = set(shas[:max(1, min(len(shas) - 1, round(share * len(shas))))])
    split = Split([e for e in examples if e.cell.sha256 not in held], [e for e in examples if e.cell.sha256 in held])
    for side, rows in (("training", split.train), ("validation", split.validation)):
        answers = {e.yes for e in rows}
        if len(answers) < 2:
            raise InvalidInput(f"the {side} references' judgments all answer "
                               f"{'yes' if answers == {True} else 'no'}: judge more references both ways "
                               "(the split is by reference, seeded)", side=side, judgments=len(rows))
    return split
