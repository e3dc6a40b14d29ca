"""Rubric search: recall instructions, the second-stage seam and the two-stage search service."""

from rubricsearch.retrieval.search.instructions import QueryInstructions, Rubric, build
from rubricsearch.retrieval.search.protocol import ScoringInstructions, ShortlistScorer, ShortlistScores
from rubricsearch.retrieval.search.provenance import SearchProvenance
from rubricsearch.retrieval.search.service import SearchHit, SearchRequest, SearchResult, SearchService

__all__ = ["QueryInstructions", "Rubric", "ScoringInstructions", "SearchHit", "SearchProvenance", "SearchRequest",
           "SearchResult", "SearchService", "ShortlistScorer", "ShortlistScores", "build"]
