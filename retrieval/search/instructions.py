"""Rubric -> instruction-aware recall queries. The templates here are documented in README.md.

Qwen3-VL-Embedding puts task instructions on queries only; reference images are embedded with the
default instruction (as in the official evaluation code), so one index serves every rubric. The
reranker's instructions for the same rubric live with the reranker (``rerank/rubric.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rubricsearch.retrieval.errors import InvalidInput

DOCUMENT_INSTRUCTION = "Represent the user's input."

QUERY_WITH_CANDIDATE = "Retrieve reference images that match the given image on these criteria: {criteria}"
QUERY_CANDIDATE_ONLY = "Retrieve reference images that show the same subject as the given image"
QUERY_TEXT_ONLY = "Retrieve reference images that show: {criteria}"


@dataclass(frozen=True)
class Rubric:
    """Free text and/or a list of criteria; ``criteria`` is what per-criterion scores are given for."""

    text: str
    criteria: tuple[str, ...]

    @classmethod
    def parse(cls, text: str | None, criteria: list[str] | None, *, max_criteria: int = 12) -> Rubric:
        items = [c.strip() for c in (criteria or []) if c and c.strip()]
        body = (text or "").strip()
        if not items and body and "\n" in body:
            items = [line.strip(" -•*\t") for line in body.splitlines() if line.strip(" -•*\t")]
        if len(items) > max_criteria:
            raise InvalidInput(f"at most {max_criteria} criteria are allowed, got {len(items)}")
        if any(len(c) > 500 for c in items) or len(body) > 4000:
            raise InvalidInput("rubric text is too long (4000 characters; 500 per criterion)")
        if not body:
            body = "; ".join(items)
        return cls(text=body, criteria=tuple(items))

    @property
    def summary(self) -> str:
        return "; ".join(self.criteria) if self.criteria else self.text

    @property
    def empty(self) -> bool:
        return not self.text


@dataclass(frozen=True)
class QueryInstructions:
    query: str
    document: str


def build(rubric: Rubric, has_candidate: bool) -> QueryInstructions:
    """The recall query's instruction (and the one the references were embedded with)."""
    if rubric.empty and not has_candidate:
        raise InvalidInput("give a rubric, a candidate image, or both")
    if has_candidate and not rubric.empty:
        query = QUERY_WITH_CANDIDATE.format(criteria=rubric.summary)
    elif has_candidate:
        query = QUERY_CANDIDATE_ONLY
    else:
        query = QUERY_TEXT_ONLY.format(criteria=rubric.summary)
    return QueryInstructions(query=query, document=DOCUMENT_INSTRUCTION)
