"""Judged cells as training pairs, and the split of a set's references into training and validation.

A cell (:class:`retrieval.tuning.judgments.JudgedCell`) becomes the pair search asks for that criterion with no
candidate (:func:`rerank.rubric.rubric_instructions`): the criterion's positive statement as the query, the
reference as the document, the per-criterion instruction. The label is whether the positive
statement holds, so a judged "no hairline crack" teaches "hairline crack" with the answer flipped.

References go to training or validation whole; the set's judged "no" cells are the negatives, the hardest the set
has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rubricsearch.rerank.protocol import Pair
from rubricsearch.rerank.rubric import rubric_instructions
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search.instructions import Rubric
from rubricsearch.retrieval.tuning.judgments import JudgedCell, held_out, reference


@dataclass(frozen=True)
class Example:
    """A cell as the reranker is asked it: the pair and whether the model should answer yes."""

    cell: JudgedCell
    pair: Pair
    yes: bool


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


def split_by_reference(examples: Sequence[Example], seed: int) -> Split:
    """:func:`retrieval.tuning.judgments.held_out` references hold out all of their cells. Both sides need a yes
    and a no: training learns nothing from one answer, and validation's AUC needs both."""
    held = held_out((e.cell.sha256 for e in examples), seed)
    split = Split([e for e in examples if e.cell.sha256 not in held], [e for e in examples if e.cell.sha256 in held])
    for side, rows in (("training", split.train), ("validation", split.validation)):
        answers = {e.yes for e in rows}
        if len(answers) < 2:
            raise InvalidInput(f"the {side} references' judgments all answer "
                               f"{'yes' if answers == {True} else 'no'}: judge more references both ways "
                               "(the split is by reference, seeded)", side=side, judgments=len(rows))
    return split
