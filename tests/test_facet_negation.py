"""A facet value described as an absence is judged as a negative rubric criterion is: 1 − P(positive statement)
from the model's judgement of the positive statement, never the model's reading of "no"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rubricsearch.app.demo.evaluation import eval_set
from rubricsearch.rerank.facets import distribution, judge_values
from rubricsearch.rerank.protocol import Pair
from rubricsearch.rerank.rubric import CRITERION_TEXT_ONLY
from rubricsearch.retrieval.qwen.model.prompts import Content


def test_an_absence_value_is_one_minus_the_positive_statement(tiny_reranker_dir: Path) -> None:
    from rubricsearch.rerank import load_reranker
    from rubricsearch.retrieval.packages import PackageStore, VisualPackages

    _, images = eval_set(2)
    packages = VisualPackages(PackageStore(storage_dtype="float32"))
    reranker: Any = load_reranker(str(tiny_reranker_dir), device="cpu", packages=packages)
    try:
        packages.build(images)
        groups = [["dark forehead stripes", "no dark forehead stripes"], ["without a collar", "a collar"]]
        judged = judge_values(reranker, images, groups)
        positive = reranker.score_pairs([Pair(Content(texts=[s]), Content(images=[img]),
                                              CRITERION_TEXT_ONLY.format(criterion=s))
                                         for img in images for s in ("dark forehead stripes", "a collar")])
    finally:
        reranker.close()
    for i in range(len(images)):
        stripes, collar = positive[2 * i], positive[2 * i + 1]
        assert judged[i][0] == pytest.approx(distribution([stripes, 1 - stripes]), abs=1e-6)
        assert judged[i][1] == pytest.approx(distribution([1 - collar, collar]), abs=1e-6)
