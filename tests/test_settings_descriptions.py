"""Every setting says what it does in one sentence, and no figure that the next change would make stale: measured
numbers live in the performance docs, where their date and commit go with them."""

from __future__ import annotations

import re

import pytest

from rubricsearch.app.config_docs import variables

# a measured figure or its source: ratios, rates, timings, machines, "a -> b" before/after, pointers to the README
FIGURE = re.compile(r"->|\d+(\.\d+)?x\b|images/s|searches/s|\d\s*ms\b|\bH[12]00\b|README|bench/|\d+(\.\d+)? ?%")
SENTENCE_BREAK = re.compile(r"[.;!?]\s+[A-Z]")


@pytest.mark.parametrize("name", sorted(variables()))
def test_each_setting_has_one_sentence_of_what_it_does(name: str) -> None:
    text = variables()[name].description or ""
    assert text, f"{name} has no description"
    assert text.endswith("."), f"{name}: one sentence, ending with a full stop: {text!r}"
    assert not SENTENCE_BREAK.search(text[:-1]), f"{name}: more than one sentence: {text!r}"
    assert not FIGURE.search(text), f"{name}: a measured figure belongs in docs/performance.md: {text!r}"
