"""retrieval.metrics.ndcg_at, the one nDCG the demo's evaluation, the embedder's validation and the version guard
share, against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from rubricsearch.retrieval.metrics import ndcg_at


def test_graded_gains() -> None:
    # gains in rank order 3, 2, 3, 0, 1, 2; the ideal order is 3, 3, 2, 2, 1, 0; rank r is discounted by log2(r+1)
    dcg = 3 + 2 / math.log2(3) + 3 / 2 + 0 + 1 / math.log2(6) + 2 / math.log2(7)
    idcg = 3 + 3 / math.log2(3) + 2 / 2 + 2 / math.log2(5) + 1 / math.log2(6)
    value = ndcg_at([0, 1, 2, 3, 4, 5], [3.0, 2.0, 3.0, 0.0, 1.0, 2.0], 6)
    assert value == pytest.approx(dcg / idcg) and value == pytest.approx(0.96081, abs=1e-5)
    # only the first k count, on both sides: at k=2 the order holds 3, 2 against the ideal 3, 3
    assert ndcg_at([0, 1, 2, 3, 4, 5], [3.0, 2.0, 3.0, 0.0, 1.0, 2.0], 2) == pytest.approx(
        (3 + 2 / math.log2(3)) / (3 + 3 / math.log2(3)))


def test_tied_gains() -> None:
    gains = [1.0, 1.0, 0.0]
    # swapping two documents of equal gain changes nothing; both orders are ideal
    assert ndcg_at([0, 1, 2], gains, 10) == ndcg_at([1, 0, 2], gains, 10) == 1.0
    # the miss first: (1/log2 3 + 1/2) / (1 + 1/log2 3)
    assert ndcg_at([2, 0, 1], gains, 10) == pytest.approx(0.69342, abs=1e-5)


def test_k_beyond_the_list() -> None:
    # a shortlist of one: the ideal still sorts every gain, so the relevant document left out counts against it
    assert ndcg_at([2], [1.0, 0.0, 1.0], 10) == pytest.approx(1 / (1 + 1 / math.log2(3)))
    assert ndcg_at([0, 1, 2], [0.0, 0.0, 1.0], 10) == pytest.approx(0.5)  # found third: 1/log2(4) of 1


def test_no_relevant_document_is_nan() -> None:
    assert math.isnan(ndcg_at([0, 1, 2], [0.0, 0.0, 0.0], 10))
    assert math.isnan(ndcg_at([], [], 10))
