"""What a search reports about how it was made: a typed object, serialized as the API's ``provenance``.

Every field is present in every search (``None`` where it does not apply), so a reader of the JSON never has to
guess whether a key is missing or empty.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ModelRef(BaseModel):
    id: str
    revision: str


class InstructionsUsed(BaseModel):
    """The exact instructions of the search: recall's query and document instructions, and the scorer's."""

    query: str
    document: str
    rerank: str | None = Field(None, description="The reranker's instruction for a query without criteria.")
    per_criterion: list[str] = Field(default_factory=list, description="One reranker instruction per criterion.")


class JudgedOut(BaseModel):
    criterion: str = Field(description="The criterion as typed.")
    statement: str = Field(description="The positive statement the reranker judged.")
    score: str = Field(description="`P(statement)`, or `1 - P(statement)` for a criterion written as an absence.")


class ScoreFormed(BaseModel):
    formed: str = Field(description="How each hit's `score` was formed.")
    judged: list[JudgedOut] = Field(default_factory=list)


class NdcgPair(BaseModel):
    recall: float
    reranked: float


class Calibration(BaseModel):
    slope: float
    intercept: float


class PolicyReport(BaseModel):
    """The scorer's decision for this query's kind and what it was decided by (see the scorer's documentation)."""

    kind: str = Field(description="The query's kind: criteria, negative, candidate or candidate+criteria.")
    rerank: bool = Field(description="Whether the scorer reranks queries of this kind.")
    measured_ndcg10: NdcgPair | None = Field(None, description="nDCG@10 of the recall and the reranked order on "
                                             "the model's held-out measurement (null: not measured).")
    calibration: Calibration | None = Field(None, description="Maps a vector score to a match probability where "
                                            "the recall order is kept.")
    source: str | None = Field(None, description="Where the measurement was read from.")


class VisionUse(BaseModel):
    """Vision-encoder runs this search caused, by purpose and by model."""

    total: int
    ingest: int
    reference: int = Field(description="0 unless a reference's package was missing (e.g. during a backfill).")
    query: int = Field(description="The candidate, once per distinct vision tower.")
    by_model: dict[str, dict[str, int]]
    towers_shared: bool | None = Field(description="Recall and reranking use one vision tower (null: unknown).")


class FilterUse(BaseModel):
    applied: dict[str, Any] = Field(description="The filter in its canonical JSON form.")
    matched: int = Field(description="References of the set the filter keeps.")
    reason: str | None = Field(description="Why there are no hits, when the filter keeps nothing.")


class IdenticalUse(BaseModel):
    sha256: str
    found: str = Field(description="How it was found: the same bytes (sha256) as the candidate.")
    recall_rank: int | None = Field(description="Its rank in the recall shortlist (null: fetched from the index).")
    score: str = Field(description="How its score was formed.")


class SearchProvenance(BaseModel):
    """Models, instructions, how the scores were formed, and what the search cost in vision-encoder runs."""

    embedding_model: ModelRef
    embedder_version: str = Field("base", description="The embedder version that embedded the query (the set's "
                                  "vectors come from it): `base`, or the id of a version trained for the set and "
                                  "activated.")
    reranker_model: ModelRef | None
    reranker_version: str | None = Field(None, description="The reranker version that scored: `base`, or the id of "
                                         "a version trained for the set and activated (null: no reranker).")
    instructions: InstructionsUsed
    criteria: list[str]
    score: ScoreFormed
    reranked: bool
    rerank_status: str = Field(description="`ok`, `skipped: ...`, `failed: ...` or the scorer's reason for "
                               "keeping the recall order.")
    rerank_policy: PolicyReport | None
    dimensions: int
    top_k: int
    top_n: int
    vision_encodes: int
    vision: VisionUse
    filter: FilterUse | None
    identical: IdenticalUse | None = Field(description="The hit whose bytes are the candidate's (null: none).")
