"""The demo reranker's absent statements (:mod:`app.demo.absent`): true of no face, partly borrowing the criteria's
words, and sharing nothing with the statements the quality floors hold out."""

from __future__ import annotations

import random

import pytest

from rubricsearch.app.demo.absent import (
    CRITERION_MODIFIERS,
    CRITERION_NOUNS,
    FOREIGN,
    OBJECTS,
    STATES,
    absent_statement,
)
from rubricsearch.app.demo.faces import ATTRIBUTES, VALUES, Criterion
from rubricsearch.app.demo.trust import ABSENT

CRITERIA = [Criterion(a, v, neg).text for a in ATTRIBUTES for v in VALUES[a] for neg in (False, True)]
CRITERION_WORDS = {w for text in CRITERIA for w in text.split()} - {"a", "no", "not"}


def _borrows(statement: str) -> bool:
    return any(w in CRITERION_WORDS for w in statement.split())


def test_no_statement_is_true_of_a_face() -> None:
    """A statement names an object no face is, or gives a face's feature a colour or material no face has."""
    values = {w for a in ATTRIBUTES for v in VALUES[a] for w in (v, Criterion(a, v).text)}
    assert not set(FOREIGN) & (values | CRITERION_WORDS)
    assert not set(OBJECTS) & (values | CRITERION_WORDS)
    assert set(CRITERION_MODIFIERS) | {w for n in CRITERION_NOUNS for w in n.split()} <= CRITERION_WORDS
    rng = random.Random(0)
    for _ in range(2000):
        words = absent_statement(rng, 0.4).split()
        assert set(words) & set(OBJECTS) or (words[0] in FOREIGN and " ".join(words[1:]) in CRITERION_NOUNS)


@pytest.mark.parametrize("mixed", [0.0, 0.4, 1.0])
def test_the_mixed_share_borrows_the_criteria_words(mixed: float) -> None:
    rng = random.Random(1)
    statements = [absent_statement(rng, mixed) for _ in range(2000)]
    share = sum(map(_borrows, statements)) / len(statements)
    assert abs(share - mixed) < 0.04, share


def test_what_the_floors_hold_out_stays_unseen() -> None:
    """No word of the held-out absent statements is in the vocabulary, not even inside a longer word (the demo
    tokenizer reads words almost letter by letter)."""
    held_out = {w for text in ABSENT for w in text.split()} - {"a", "of"}
    vocabulary = set(OBJECTS + FOREIGN + STATES)
    assert not {(w, h) for w in vocabulary for h in held_out if h in w}
