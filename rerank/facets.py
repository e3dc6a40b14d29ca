"""Attribute facets from cached packages: the reranker's yes/no judgement of each allowed value, per image.

A value is judged as the reranker judges a rubric criterion with no candidate image
(:data:`rerank.rubric.CRITERION_TEXT_ONLY`): one language-model pass per (image, value) over the image's
cached visual package. A value described as an absence ("no forehead stripes") is judged as the rubric judges
a negative criterion: the positive statement, scored 1 − P (:func:`rerank.rubric.judged`), never left to the
model's grasp of "no". An attribute's values are mutually exclusive, so their yes/no logits become one
distribution over the values (a softmax). The reference's pixels are never handed over: an image without a
package fails (:class:`~retrieval.errors.NotFound`) instead of costing a vision encode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rubricsearch.rerank.protocol import Pair, Reranker
from rubricsearch.rerank.rubric import CRITERION_TEXT_ONLY, judged, logit
from rubricsearch.retrieval.errors import NotFound
from rubricsearch.retrieval.images import ReferenceImage
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.prompts import Content


def _no_pixels(sha256: str) -> bytes:
    raise NotFound(f"reference {sha256} has no cached visual package for the reranker's tower; facets are "
                   "computed from packages only (a backfill job builds the missing ones)", sha256=sha256)


def packaged_reference(sha256: str) -> ReferenceImage:
    """A reference whose pixels cannot be read, so only its cached package can serve it."""
    return ReferenceImage(sha256, lambda: _no_pixels(sha256))


def distribution(scores: Sequence[float]) -> list[float]:
    """Yes/no relevances of mutually exclusive values -> one probability per value (softmax of the logits)."""
    logits = [logit(s) for s in scores]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def judge_values(reranker: Reranker, images: Sequence[ReferenceImage], groups: Sequence[Sequence[str]], *,
                 usage: Usage | None = None) -> list[list[list[float]]]:
    """For each image, for each group of statements (an attribute's values), the distribution over the
    group; every (image, statement) pair goes in one ``score_pairs`` call."""
    statements = [judged(statement) for group in groups for statement in group]
    pairs = [Pair(Content(texts=[j.statement]), Content(images=[image]),
                  CRITERION_TEXT_ONLY.format(criterion=j.statement)) for image in images for j in statements]
    raw = reranker.score_pairs(pairs, usage=usage) if pairs else []
    scores = [1.0 - s if statements[i % len(statements)].negated else s for i, s in enumerate(raw)]
    out: list[list[list[float]]] = []
    at = 0
    for _ in images:
        per_group: list[list[float]] = []
        for group in groups:
            per_group.append(distribution(scores[at:at + len(group)]))
            at += len(group)
        out.append(per_group)
    return out
