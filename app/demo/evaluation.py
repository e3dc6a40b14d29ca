"""Retrieval-quality evaluation on generated faces (what ``bench/quality.py`` and the quality tests run).

The documents are the held-out ``eval`` split of :mod:`app.demo.faces` (never trained on); queries come
from :mod:`app.demo.rubrics` in the four kinds a user searches with, with candidates from the separate
``candidate`` split. :mod:`app.demo.search_eval` runs them through the product's search service.
R@k = |relevant ∩ top k| / min(k, |relevant|); nDCG@10 uses the graded gains of
:meth:`app.demo.rubrics.Query.gain` (:func:`retrieval.metrics.ndcg_at`).
"""


from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from rubricsearch.app.demo.faces import DEFAULT_SIZE, Face, draw_face, faces, png_bytes
from rubricsearch.app.demo.rubrics import KINDS, Query, QueryKind, sample_query
from rubricsearch.retrieval.images import ImageLike, decode_image
from rubricsearch.retrieval.metrics import ndcg_at

EVAL_SEED = 11
CANDIDATE_SEED = 12
QUERY_SEED = 13


@dataclass(frozen=True)
class Scores:
    """Mean metrics of one query kind."""

    kind: str
    queries: int
    r1: float
    r5: float
    ndcg10: float


def eval_set(count: int, *, size: int = DEFAULT_SIZE) -> tuple[list[Face], list[ImageLike]]:
    docs = faces("eval", count, seed=EVAL_SEED)
    return docs, [decode_image(png_bytes(draw_face(f, size=size, seed=EVAL_SEED))) for f in docs]


def eval_queries(per_kind: int, *, kinds: tuple[QueryKind, ...] = KINDS) -> list[Query]:
    """A fixed list of queries (seeded); candidates come from the ``candidate`` split."""
    rng = random.Random(QUERY_SEED)
    candidates = faces("candidate", 120, seed=CANDIDATE_SEED)
    return [sample_query(rng, kind, candidates) for kind in kinds for _ in range(per_kind)]


def recall_at(ranked: list[int], relevant: set[int], k: int) -> float:
    if not relevant:
        return math.nan
    return len(set(ranked[:k]) & relevant) / min(k, len(relevant))


def per_query(queries: list[Query], docs: list[Face], rankings: list[list[int]]
              ) -> dict[str, list[tuple[float, float, float]]]:
    """Each query's R@1, R@5 and nDCG@10, per kind (queries without any relevant document are skipped)."""
    by_kind: dict[str, list[tuple[float, float, float]]] = {}
    for q, ranked in zip(queries, rankings, strict=True):
        relevant = {i for i, f in enumerate(docs) if q.relevant(f)}
        if not relevant:
            continue
        gains = [q.gain(f) for f in docs]
        by_kind.setdefault(q.kind, []).append((recall_at(ranked, relevant, 1), recall_at(ranked, relevant, 5),
                                               ndcg_at(ranked, gains, 10)))
    return by_kind


def score(queries: list[Query], docs: list[Face], rankings: list[list[int]]) -> list[Scores]:
    """Mean R@1, R@5 and nDCG@10 per kind (queries without any relevant document are skipped)."""
    out = []
    for kind, rows in per_query(queries, docs, rankings).items():
        a = np.array(rows)
        out.append(Scores(kind, len(rows), *(float(x) for x in a.mean(axis=0))))
    return out
