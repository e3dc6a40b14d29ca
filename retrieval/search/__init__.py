"""Rubric search: recall instructions, the second-stage seam and the two-stage search service."""

from retrieval.search.instructions import QueryInstructions, Rubric, build
from retrieval.search.protocol import ScoringInstructions, ShortlistScorer, ShortlistScores
from retrieval.search.service import SearchHit, SearchRequest, SearchResult, SearchService

__all__ = ["QueryInstructions", "Rubric", "ScoringInstructions", "SearchHit", "SearchRequest", "SearchResult",
           "SearchService", "ShortlistScorer", "ShortlistScores", "build"]
