"""Rubric search: instruction building and the two-stage search service."""

from retrieval.search.instructions import Instructions, Rubric, build
from retrieval.search.service import SearchHit, SearchRequest, SearchResult, SearchService

__all__ = ["Instructions", "Rubric", "SearchHit", "SearchRequest", "SearchResult", "SearchService", "build"]
