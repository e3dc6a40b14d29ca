"""Ranking quality shared by every layer that measures an order: the demo's evaluation, the embedder trainer's
validation and the reranker version guard (it sits in ``retrieval``, the lowest layer all three may import)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def ndcg_at(ranked: Sequence[int], gains: Sequence[float], k: int) -> float:
    """nDCG@k of an order: ``ranked`` lists indices into ``gains`` best first (it may hold fewer than all of
    them, e.g. a shortlist); the ideal order sorts every gain, so a relevant document left out still counts against
    it. Rank r (from 1) is discounted by log2(r + 1). NaN where no gain is positive: there is nothing to find."""
    dcg = sum(gains[d] / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    ideal = sorted(gains, reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else math.nan
