"""Rubric search: instruction-aware query -> ANN shortlist -> reranking from cached reference packages.

References reach the reranker as :class:`~retrieval.images.ReferenceImage` handles, so when their
packages are cached (ingestion builds one for every distinct vision tower in use) no blob is read,
nothing is decoded and no tower runs for them. Only a new candidate image is encoded, once per distinct
tower. Every encode the request caused is counted by model and purpose in ``provenance["vision"]``:
``reference`` stays 0 unless a reference's package is missing (e.g. while a backfill job runs).

The second stage is any :class:`~retrieval.search.protocol.ShortlistScorer` (``rerank.rubric``), so
this module never imports the reranker. The scorer's measured policy decides per query kind whether it runs:
where reranking lost to the recall order on the model's held-out measurement, the recall order is served with
each vector score mapped to its calibrated match probability, and provenance says so.

A candidate whose bytes are a reference of the searched set (same sha256) is that reference: no model has to
recognise it. Every search with a candidate marks that hit ``identical``; a candidate-only search serves it first
with score 1.0, fetched from the index when recall missed it (unless the request's filter excludes it). With
criteria, the criteria still decide its score and place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rubricsearch.retrieval.embedding.protocol import Embedder
from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.index.filters import Filter
from rubricsearch.retrieval.index.protocol import VectorIndex
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search.instructions import Rubric, build
from rubricsearch.retrieval.search.protocol import KindPolicy, ScoringInstructions, ShortlistScorer

ReferenceResolver = Callable[[str], ImageLike]
IDENTICAL = "same bytes (sha256) as the candidate"


@dataclass
class SearchRequest:
    set_id: str
    rubric: str | None = None
    criteria: list[str] = field(default_factory=list)
    candidate: ImageLike | None = None
    top_k: int = 50
    top_n: int = 10
    rerank: bool = True
    filter: Filter | None = None


@dataclass
class SearchHit:
    sha256: str
    rank: int
    score: float
    ann_score: float
    rerank_score: float | None = None
    criteria: dict[str, float] = field(default_factory=dict)
    identical: bool = False  # the reference is the candidate image itself (same sha256)


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
        embedder: Embedder,
        scorer: ShortlistScorer | None,
        index: VectorIndex,
        resolve_reference: ReferenceResolver,
        *,
        max_criteria: int = 12,
        max_top_k: int = 1000,
    ) -> None:
        self.embedder = embedder
        self.scorer = scorer
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
        usage = Usage()

        t0 = time.perf_counter()
        query = Content(texts=[rubric.text] if not rubric.empty else [],
                        images=[req.candidate] if req.candidate is not None else [])
        dim = self.index.dim(req.set_id)
        qvec = self.embedder.embed_contents([query], [instr.query], dimensions=dim, usage=usage)[0]
        timings["query_embedding"] = _ms(t0)

        t0 = time.perf_counter()
        hits = self.index.search(req.set_id, qvec, req.top_k, filter=req.filter)[0]
        timings["ann"] = _ms(t0)
        filtered = None if req.filter is None else _filter_provenance(self.index, req.set_id, req.filter)

        results = [SearchHit(sha256=h.id, rank=i + 1, score=h.score, ann_score=h.score) for i, h in enumerate(hits)]
        identical = self._identical(req, rubric, qvec, results)
        identical_prov = None if identical is None else {
            "sha256": identical.sha256, "found": IDENTICAL, "recall_rank": identical.rank or None,
            "score": "1.0: it is the candidate" if rubric.empty else "the criteria's scores, as every hit"}
        status = "skipped: reranking disabled" if not req.rerank else "skipped: no reranker configured"
        reranked = False
        policy = self.scorer.policy(rubric, req.candidate is not None) if self.scorer is not None else None
        stepped_aside = bool(req.rerank and policy is not None and not policy.rerank and req.top_n > 0)
        t0 = time.perf_counter()
        if stepped_aside:
            assert policy is not None and policy.measured is not None
            for hit in results:  # the recall order stays; the score becomes the calibrated match probability
                hit.score = policy.recall_score(hit.ann_score)
            status = (f"stepped aside: for {policy.kind} searches this reranker lost to the recall order on its "
                      f"held-out measurement (nDCG@10 {policy.measured['reranked']:.3f} reranked, "
                      f"{policy.measured['recall']:.3f} recall order)")
        elif req.rerank and self.scorer is not None and results and req.top_n > 0:
            try:
                self._rerank(results, query, rubric, usage)
                reranked, status = True, "ok"
            except BackendUnavailable as exc:  # degrade to recall order, and say so
                status = f"failed: {exc.message}"
        elif req.rerank and req.top_n == 0:
            status = "skipped: top_n=0"
        timings["rerank"] = _ms(t0)
        if reranked:
            results.sort(key=lambda h: -(h.rerank_score or 0.0))
        if identical is not None and rubric.empty:  # the candidate itself: the best possible match
            identical.score = 1.0
            results.remove(identical)
            results.insert(0, identical)
        results = results[: req.top_n] if req.top_n > 0 else results
        for i, hit in enumerate(results):
            hit.rank = i + 1
        scoring = (self.scorer.instructions(rubric, req.candidate is not None)
                   if self.scorer is not None and reranked else None)
        vision = usage.to_dict()
        provenance = {
            "embedding_model": {"id": self.embedder.model_id, "revision": self.embedder.revision},
            "reranker_model": ({"id": self.scorer.model_id, "revision": self.scorer.revision}
                               if self.scorer is not None else None),
            "instructions": {"query": instr.query, "document": instr.document,
                             "rerank": scoring.overall if scoring is not None else None,
                             "per_criterion": list(scoring.per_criterion) if scoring is not None else []},
            "criteria": list(rubric.criteria),
            "score": _score_provenance(scoring, policy if stepped_aside else None),
            "reranked": reranked,
            "rerank_status": status,
            "rerank_policy": policy.to_dict() if policy is not None else None,
            "dimensions": dim,
            "top_k": req.top_k,
            "top_n": req.top_n,
            "vision_encodes": vision["total"],
            "vision": {**vision, "towers_shared": self._towers_shared()},
            "filter": filtered,
            "identical": identical_prov,
        }
        return SearchResult(hits=results, provenance=provenance, timings_ms=timings)

    def _identical(self, req: SearchRequest, rubric: Rubric, qvec: Any, results: list[SearchHit]
                   ) -> SearchHit | None:
        """The shortlist's hit that is the candidate itself, marked. A candidate-only search that recall missed
        it in takes it from the index (its rank is then 0: not a recall rank), replacing the last recall hit."""
        if req.candidate is None:
            return None
        sha = req.candidate.sha256
        found = next((h for h in results if h.sha256 == sha), None)
        if found is None and rubric.empty:
            vector = self.index.vectors(req.set_id, [sha]).get(sha)
            if vector is not None and (req.filter is None or sha in self.index.matching(req.set_id, [sha], req.filter)):
                score = float(vector @ qvec)
                found = SearchHit(sha256=sha, rank=0, score=score, ann_score=score)
                results[:] = [found, *results[: req.top_k - 1]]
        if found is not None:
            found.identical = True
        return found

    def _rerank(self, results: list[SearchHit], query: Content, rubric: Rubric, usage: Usage) -> None:
        assert self.scorer is not None
        docs = [Content(images=[self.resolve_reference(h.sha256)]) for h in results]
        scored = self.scorer.score(query, rubric, docs, usage=usage)
        for hit, overall, per in zip(results, scored.overall, scored.per_criterion, strict=True):
            hit.rerank_score = overall
            hit.score = overall
            hit.criteria = dict(zip(rubric.criteria, per, strict=True))

    def _towers_shared(self) -> bool | None:
        """Whether recall and reranking use one vision tower (None: a tower is unknown here)."""
        if self.scorer is None:
            return None
        mine, theirs = self.embedder.packages.fingerprint, self.scorer.packages.fingerprint
        return None if mine is None or theirs is None else mine == theirs


def _filter_provenance(index: VectorIndex, set_id: str, f: Filter) -> dict[str, Any]:
    """What the filter kept; a filter that keeps nothing is an empty result with its reason, not an error."""
    matched = index.count(set_id, f)
    reason = None if matched else "the filter matches no reference in this set"
    return {"applied": f.to_json(), "matched": matched, "reason": reason}


def _score_provenance(scoring: ScoringInstructions | None, aside: KindPolicy | None) -> dict[str, Any]:
    """How each hit's ``score`` was formed, and what the reranker judged for every criterion."""
    if aside is not None and aside.calibration is not None:
        slope, intercept = aside.calibration
        return {"formed": f"the match probability of the vector score s, sigmoid({slope:.3f} · s + {intercept:.3f}), "
                          f"calibrated with the reranker's measurement of {aside.kind} searches", "judged": []}
    if scoring is None:
        return {"formed": "the vector score (inner product of the query and reference embeddings)", "judged": []}
    return {"formed": scoring.formed,
            "judged": [{"criterion": j.criterion, "statement": j.statement,
                        "score": "1 - P(statement)" if j.negated else "P(statement)"} for j in scoring.judged]}


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 3)
