"""Attribute facets from cached packages: the reranker's yes/no judgement of each allowed value, per image.

A value is judged as the reranker judges a rubric criterion with no candidate image
(:data:`rerank.rubric.CRITERION_TEXT_ONLY`): one language-model pass per (image, value) over the image's
cached visual package. An attribute's values are mutually exclusive, so their yes/no logits become one
distribution over the values (a softmax). The reference's pixels are never handed over: an image without a
package fails (:class:`~retrieval.errors.NotFound`) instead of costing a vision encode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rerank.protocol import Pair, Reranker
from rerank.rubric import CRITERION_TEXT_ONLY
from retrieval.errors import NotFound
from retrieval.images import ReferenceImage
from retrieval.packages import Usage
from retrieval.qwen.model.prompts import Content

_EPS = 1e-6


def _no_pixels(sha256: str) -> bytes:
    raise NotFound(f"reference {sha256} has no cached visual package for the reranker's tower; facets are "
                   "computed from packages only (a backfill job builds the missing ones)", sha256=sha256)


def packaged_reference(sha256: str) -> ReferenceImage:
    """A reference whose pixels cannot be read, so only its cached package can serve it."""
    return ReferenceImage(sha256, lambda: _no_pixels(sha256))


def distribution(scores: Sequence[float]) -> list[float]:
    """Yes/no relevances of mutually exclusive values -> one probability per value (softmax of the logits)."""
    clipped = [min(max(s, _EPS), 1 - _EPS) for s in scores]
    logits = [math.log(s / (1 - s)) for s in clipped]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def judge_values(reranker: Reranker, images: Sequence[ReferenceImage], groups: Sequence[Sequence[str]], *,
                 usage: Usage | None = None) -> list[list[list[float]]]:
    """For each image, for each group of statements (an attribute's values), the distribution over the
    group; every (image, statement) pair goes in one ``score_pairs`` call."""
    pairs = [Pair(Content(texts=[statement]), Content(images=[image]),
                  CRITERION_TEXT_ONLY.format(criterion=statement))
             for image in images for group in groups for statement in group]
    scores = reranker.score_pairs(pairs, usage=usage) if pairs else []
    out: list[list[list[float]]] = []
    at = 0
    for _ in images:
        per_group: list[list[float]] = []
        for group in groups:
            per_group.append(distribution(scores[at:at + len(group)]))
            at += len(group)
        out.append(per_group)
    return out
