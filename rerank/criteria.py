"""Scoring a shortlist against a rubric: one overall judgement plus one per criterion, all batched."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rerank.protocol import Pair, Reranker
from retrieval.qwen.prompts import Content


@dataclass
class CriteriaScores:
    overall: list[float]
    per_criterion: list[list[float]]  # [document][criterion]


def score_rubric(
    reranker: Reranker,
    query: Content,
    criteria_queries: Sequence[Content],
    documents: Sequence[Content],
    overall_instruction: str,
    criterion_instructions: Sequence[str],
) -> CriteriaScores:
    """All (1 + C) x K judgements go to the reranker as one batch of pairs."""
    pairs = [Pair(query, doc, overall_instruction) for doc in documents]
    for crit_query, instruction in zip(criteria_queries, criterion_instructions, strict=True):
        pairs += [Pair(crit_query, doc, instruction) for doc in documents]
    scores = reranker.score_pairs(pairs)
    k = len(documents)
    overall = scores[:k]
    per = [[scores[k * (1 + c) + d] for c in range(len(criterion_instructions))] for d in range(k)]
    return CriteriaScores(overall=overall, per_criterion=per)
