"""Rubric search: instruction-aware query -> ANN shortlist -> reranking from cached reference packages.

References reach the reranker as :class:`~retrieval.images.StoredImage` handles, so when their
packages are cached (they are, after ingestion) no blob is read, nothing is decoded and the vision
tower does not run for them. Only a new candidate image is encoded, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rerank.criteria import score_rubric
from rerank.protocol import Reranker
from retrieval.embedding.local import LocalEmbedder
from retrieval.errors import BackendUnavailable, InvalidInput
from retrieval.images import ImageLike
from retrieval.index.protocol import VectorIndex
from retrieval.qwen.prompts import Content
from retrieval.search.instructions import Rubric, build

ReferenceResolver = Callable[[str], ImageLike]


@dataclass
class SearchRequest:
    set_id: str
    rubric: str | None = None
    criteria: list[str] = field(default_factory=list)
    candidate: ImageLike | None = None
    top_k: int = 50
    top_n: int = 10
    rerank: bool = True


@dataclass
class SearchHit:
    sha256: str
    rank: int
    score: float
    ann_score: float
    rerank_score: float | None = None
    criteria: dict[str, float] = field(default_factory=dict)


@dataclass
class SearchResult:
    hits: list[SearchHit]
    provenance: dict[str, Any]
    timings_ms: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"hits": [asdict(h) for h in self.hits], "provenance": self.provenance, "timings_ms": self.timings_ms}


class SearchService:
    """Stateless over its collaborators; safe to share between requests."""

    def __init__(
        self,
        embedder: LocalEmbedder,
        reranker: Reranker | None,
        index: VectorIndex,
        resolve_reference: ReferenceResolver,
        *,
        max_criteria: int = 12,
        max_top_k: int = 1000,
    ) -> None:
        self.embedder = embedder
        self.reranker = reranker
        self.index = index
        self.resolve_reference = resolve_reference
        self.max_criteria = max_criteria
        self.max_top_k = max_top_k

    def search(self, req: SearchRequest) -> SearchResult:
        if not 1 <= req.top_k <= self.max_top_k:
            raise InvalidInput(f"top_k must be between 1 and {self.max_top_k}")
        if req.top_n < 0:
            raise InvalidInput("top_n must not be negative")
        rubric = Rubric.parse(req.rubric, req.criteria, max_criteria=self.max_criteria)
        instr = build(rubric, req.candidate is not None)
        timings: dict[str, float] = {}
        encodes_before = self.embedder.stats["vision_encodes"]

        t0 = time.perf_counter()
        query = Content(texts=[rubric.text] if not rubric.empty else [],
                        images=[req.candidate] if req.candidate is not None else [])
        dim = self.index.dim(req.set_id)
        qvec = self.embedder.embed_contents([query], [instr.query], dimensions=dim)[0]
        timings["query_embedding"] = _ms(t0)

        t0 = time.perf_counter()
        hits = self.index.search(req.set_id, qvec, req.top_k)[0]
        timings["ann"] = _ms(t0)

        results = [SearchHit(sha256=h.id, rank=i + 1, score=h.score, ann_score=h.score) for i, h in enumerate(hits)]
        status = "skipped: reranking disabled" if not req.rerank else "skipped: no reranker configured"
        reranked = False
        t0 = time.perf_counter()
        if req.rerank and self.reranker is not None and results and req.top_n > 0:
            try:
                self._rerank(results, query, rubric, instr)
                reranked, status = True, "ok"
            except BackendUnavailable as exc:  # degrade to recall order, and say so
                status = f"failed: {exc.message}"
        elif req.rerank and req.top_n == 0:
            status = "skipped: top_n=0"
        timings["rerank"] = _ms(t0)
        if reranked:
            results.sort(key=lambda h: -(h.rerank_score or 0.0))
        results = results[: req.top_n] if req.top_n > 0 else results
        for i, hit in enumerate(results):
            hit.rank = i + 1
        provenance = {
            "embedding_model": {"id": self.embedder.model_id, "revision": self.embedder.revision},
            "reranker_model": ({"id": self.reranker.model_id, "revision": self.reranker.revision}
                               if self.reranker is not None else None),
            "instructions": {"query": instr.query, "document": instr.document, "rerank": instr.rerank,
                             "per_criterion": list(instr.per_criterion)},
            "criteria": list(rubric.criteria),
            "reranked": reranked,
            "rerank_status": status,
            "dimensions": dim,
            "top_k": req.top_k,
            "top_n": req.top_n,
            "vision_encodes": self.embedder.stats["vision_encodes"] - encodes_before,
        }
        return SearchResult(hits=results, provenance=provenance, timings_ms=timings)

    def _rerank(self, results: list[SearchHit], query: Content, rubric: Rubric, instr: Any) -> None:
        assert self.reranker is not None
        docs = [Content(images=[self.resolve_reference(h.sha256)]) for h in results]
        crit_queries = [Content(texts=[c], images=list(query.images)) for c in rubric.criteria]
        scored = score_rubric(self.reranker, query, crit_queries, docs, instr.rerank, instr.per_criterion)
        for hit, overall, per in zip(results, scored.overall, scored.per_criterion, strict=True):
            hit.rerank_score = overall
            hit.score = overall
            hit.criteria = dict(zip(rubric.criteria, per, strict=True))


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 3)
