"""Scoring a shortlist against a rubric: one overall judgement plus one per criterion, all batched.

The reranker's instruction templates are documented in README.md next to the recall templates
(``retrieval/search/instructions.py``) they pair with.
"""

from __future__ import annotations

from collections.abc import Sequence

from rerank.protocol import Pair, Reranker
from retrieval.packages import ModelPackages, Usage
from retrieval.qwen.model.prompts import Content
from retrieval.search.instructions import Rubric
from retrieval.search.protocol import ScoringInstructions, ShortlistScores

RERANK_WITH_CANDIDATE = "Judge whether the Document image matches the Query image on these criteria: {criteria}"
RERANK_CANDIDATE_ONLY = "Judge whether the Document image shows the same subject as the Query image"
RERANK_TEXT_ONLY = "Judge whether the Document image shows: {criteria}"
CRITERION_WITH_CANDIDATE = "Judge whether the Document image matches the Query image on this criterion: {criterion}"
CRITERION_TEXT_ONLY = "Judge whether the Document image satisfies this criterion: {criterion}"


def rubric_instructions(rubric: Rubric, has_candidate: bool) -> ScoringInstructions:
    crit = rubric.summary
    if has_candidate and not rubric.empty:
        return ScoringInstructions(RERANK_WITH_CANDIDATE.format(criteria=crit),
                                   tuple(CRITERION_WITH_CANDIDATE.format(criterion=c) for c in rubric.criteria))
    if has_candidate:
        return ScoringInstructions(RERANK_CANDIDATE_ONLY, ())
    return ScoringInstructions(RERANK_TEXT_ONLY.format(criteria=crit),
                               tuple(CRITERION_TEXT_ONLY.format(criterion=c) for c in rubric.criteria))


class RubricReranker:
    """A :class:`~retrieval.search.protocol.ShortlistScorer` over any :class:`Reranker`.

    The overall judgement's query is the whole search query (candidate + rubric text); each criterion's
    query is the candidate with that criterion's text. All (1 + C) x K pairs go in one ``score_pairs``.
    """

    def __init__(self, reranker: Reranker) -> None:
        self.reranker = reranker
        self.model_id = reranker.model_id
        self.revision = reranker.revision

    @property
    def packages(self) -> ModelPackages:
        return self.reranker.packages

    def instructions(self, rubric: Rubric, has_candidate: bool) -> ScoringInstructions:
        return rubric_instructions(rubric, has_candidate)

    def score(self, query: Content, rubric: Rubric, documents: Sequence[Content], *,
              usage: Usage | None = None) -> ShortlistScores:
        instr = self.instructions(rubric, bool(query.images))
        pairs = [Pair(query, doc, instr.overall) for doc in documents]
        for criterion, instruction in zip(rubric.criteria, instr.per_criterion, strict=True):
            crit_query = Content(texts=[criterion], images=list(query.images))
            pairs += [Pair(crit_query, doc, instruction) for doc in documents]
        scores = self.reranker.score_pairs(pairs, usage=usage)
        k = len(documents)
        per = [[scores[k * (1 + c) + d] for c in range(len(instr.per_criterion))] for d in range(k)]
        return ShortlistScores(overall=scores[:k], per_criterion=per)
