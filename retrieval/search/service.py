"""Rubric search: instruction-aware query -> ANN shortlist -> reranking from cached reference packages.

References reach the reranker as :class:`~retrieval.images.ReferenceImage` handles, so when their
packages are cached (ingestion builds one for every distinct vision tower in use) no blob is read,
nothing is decoded and no tower runs for them. Only a new candidate image is encoded, once per distinct
tower. Every encode the request caused is counted by model and purpose in ``provenance.vision``:
``reference`` stays 0 unless a reference's package is missing (e.g. while a backfill job runs).

The second stage is any :class:`~retrieval.search.protocol.ShortlistScorer` (``rerank.rubric``), so
this module never imports the reranker. The scorer may keep the recall order (its own decision, e.g. a measured
policy): its scores then replace the vector scores in that order, and ``rerank_status`` gives its reason.

A candidate whose bytes are a reference of the searched set (same sha256) is that reference: no model has to
recognise it. Every search with a candidate marks that hit ``identical``; a candidate-only search serves it first
with score 1.0, fetched from the index when recall missed it (unless the request's filter excludes it). With
criteria, the criteria still decide its score and place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rubricsearch.retrieval.embedding.protocol import Embedder
from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.index.filters import Filter
from rubricsearch.retrieval.index.protocol import VectorIndex
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search.instructions import Rubric, build
from rubricsearch.retrieval.search.protocol import ScoringInstructions, ShortlistScorer, ShortlistScores
from rubricsearch.retrieval.search.provenance import (
    FilterUse,
    IdenticalUse,
    InstructionsUsed,
    JudgedOut,
    ModelRef,
    ScoreFormed,
    SearchProvenance,
    VisionUse,
)

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
    # the caller knows the set exists (its catalog has it): without a vector set yet (ingestion creates it with the
    # first reference) it is searched as empty; otherwise a set the index does not know is NotFound
    known_set: bool = False
    # a candidate alone: report this many of the set's best recall scores against it (SearchResult.cohort)
    cohort: int = 0


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
    provenance: SearchProvenance
    timings_ms: dict[str, float]
    # a candidate-only search that asked for ``cohort``: the set's best recall scores against the candidate, best
    # first, its identical image left out, whatever the request's top_k and filter (None: not asked)
    cohort: list[float] | None = None


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
        scorer_for: Callable[[str, ShortlistScorer | None], ShortlistScorer | None] | None = None,
        embedder_for: Callable[[str, Embedder], tuple[Embedder, str]] | None = None,
    ) -> None:
        self.embedder = embedder
        self.scorer = scorer
        self._scorer_for = scorer_for
        self._embedder_for = embedder_for
        self.index = index
        self.resolve_reference = resolve_reference
        self.max_criteria = max_criteria
        self.max_top_k = max_top_k

    def set_scorer(self, set_id: str) -> ShortlistScorer | None:
        """The scorer of the set's searches: ``scorer_for(set_id, scorer)`` (a version trained for the set) when
        given, else the one scorer."""
        return self._scorer_for(set_id, self.scorer) if self._scorer_for is not None else self.scorer

    def set_embedder(self, set_id: str) -> tuple[Embedder, str]:
        """The embedder of the set's queries and its version: ``embedder_for(set_id, embedder)`` (a version
        trained for the set, whose vectors the set holds) when given, else the one embedder (``base``)."""
        return self._embedder_for(set_id, self.embedder) if self._embedder_for is not None else (self.embedder,
                                                                                                 "base")

    def search(self, req: SearchRequest) -> SearchResult:
        """Embed the query, take the ANN shortlist, rerank it, cut it to ``top_n``; the identical image is marked
        (and, without criteria, served first). Nothing is written: a known set without a vector set is searched
        as the empty set it is."""
        if not 1 <= req.top_k <= self.max_top_k:
            raise InvalidInput(f"top_k must be between 1 and {self.max_top_k}")
        if req.top_n < 0:
            raise InvalidInput("top_n must not be negative")
        rubric = Rubric.parse(req.rubric, req.criteria, max_criteria=self.max_criteria)
        has_candidate = req.candidate is not None
        instr = build(rubric, has_candidate)
        # a known set without a vector set is empty; for a set the caller does not vouch for, the index's own
        # NotFound answers (index.dim below)
        indexed = self.index.has_set(req.set_id) or not req.known_set
        timings: dict[str, float] = {}
        usage = Usage()
        scorer = self.set_scorer(req.set_id)
        embedder, embedder_version = self.set_embedder(req.set_id)

        t0 = time.perf_counter()
        query = Content(texts=[rubric.text] if not rubric.empty else [],
                        images=[req.candidate] if req.candidate is not None else [])
        dim = self.index.dim(req.set_id) if indexed else embedder.dimension
        qvec = embedder.embed_contents([query], [instr.query], dimensions=dim, usage=usage)[0]
        timings["query_embedding"] = _ms(t0)

        t0 = time.perf_counter()
        hits = self.index.search(req.set_id, qvec, req.top_k, filter=req.filter)[0] if indexed else []
        timings["ann"] = _ms(t0)
        results = [SearchHit(sha256=h.id, rank=i + 1, score=h.score, ann_score=h.score) for i, h in enumerate(hits)]
        cohort = self._cohort(req, rubric, qvec, results, indexed)
        identical = self._identical(req, rubric, qvec, results) if indexed else None
        recall_rank = identical.rank if identical is not None else 0  # 0: fetched from the index, not recalled

        t0 = time.perf_counter()
        scored, status = self._second_stage(scorer, req, query, rubric, results, usage, indexed)
        timings["rerank"] = _ms(t0)
        reranked = scored is not None and scored.kept_recall_order is None
        if reranked:
            results.sort(key=lambda h: -(h.rerank_score or 0.0))
        if identical is not None and rubric.empty:  # the candidate itself: the best possible match
            identical.score = 1.0
            results.remove(identical)
            results.insert(0, identical)
        results = results[: req.top_n] if req.top_n > 0 else results
        for i, hit in enumerate(results):
            hit.rank = i + 1
        scoring = scorer.instructions(rubric, has_candidate) if scorer is not None and reranked else None
        vision = usage.to_dict()
        provenance = SearchProvenance(
            embedding_model=ModelRef(id=embedder.model_id, revision=embedder.revision),
            embedder_version=embedder_version,
            reranker_model=(ModelRef(id=scorer.model_id, revision=scorer.revision) if scorer is not None else None),
            reranker_version=scorer.version if scorer is not None else None,
            instructions=InstructionsUsed(query=instr.query, document=instr.document,
                                          rerank=scoring.overall if scoring is not None else None,
                                          per_criterion=list(scoring.per_criterion) if scoring is not None else []),
            criteria=list(rubric.criteria),
            score=_score_provenance(scoring, scored),
            reranked=reranked,
            rerank_status=status,
            rerank_policy=(scorer.policy_report(rubric, has_candidate) if scorer is not None else None),
            dimensions=dim,
            top_k=req.top_k,
            top_n=req.top_n,
            vision_encodes=vision["total"],
            vision=VisionUse(**vision, towers_shared=self._towers_shared()),
            filter=None if req.filter is None else _filter_provenance(self.index, req.set_id, req.filter, indexed),
            identical=None if identical is None else IdenticalUse(
                sha256=identical.sha256, found=IDENTICAL, recall_rank=recall_rank or None,
                score="1.0: it is the candidate" if rubric.empty else "the criteria's scores, as every hit"),
        )
        return SearchResult(hits=results, provenance=provenance, timings_ms=timings, cohort=cohort)

    def _second_stage(self, scorer: ShortlistScorer | None, req: SearchRequest, query: Content, rubric: Rubric,
                      results: list[SearchHit], usage: Usage, indexed: bool) -> tuple[ShortlistScores | None, str]:
        """The scorer's scores set on the shortlist's hits, and ``rerank_status``; None where it did not run."""
        if not req.rerank:
            return None, "skipped: reranking disabled"
        if scorer is None:
            return None, "skipped: no reranker configured"
        if req.top_n == 0:
            return None, "skipped: top_n=0"
        if not results:
            return None, "skipped: the shortlist is empty" + ("" if indexed else " (no reference is indexed yet)")
        docs = [Content(images=[self.resolve_reference(h.sha256)]) for h in results]
        try:
            scored = scorer.score(query, rubric, docs, [h.ann_score for h in results], usage=usage)
        except BackendUnavailable as exc:  # degrade to recall order, and say so
            return None, f"failed: {exc.message}"
        if scored.kept_recall_order is not None:  # the scorer's own decision: its scores, in recall order
            for hit, score in zip(results, scored.overall, strict=True):
                hit.score = score
            return scored, scored.kept_recall_order
        self._take_judgements(results, rubric, scored)
        return scored, "ok"

    @staticmethod
    def _take_judgements(results: list[SearchHit], rubric: Rubric, scored: ShortlistScores) -> None:
        """Each hit's score becomes the scorer's judgement, with the per-criterion breakdown beside it."""
        for hit, overall, per in zip(results, scored.overall, scored.per_criterion, strict=True):
            hit.rerank_score = overall
            hit.score = overall
            hit.criteria = dict(zip(rubric.criteria, per, strict=True))

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

    def _cohort(self, req: SearchRequest, rubric: Rubric, qvec: Any, recall: list[SearchHit], indexed: bool
                ) -> list[float] | None:
        """The set's ``req.cohort`` best recall scores against a candidate alone, its identical image left out.
        Read from the shortlist where it holds them (no filter, and that many other references recalled or the
        whole set), else from one more index query without the filter, so they are the same for any top_k."""
        if req.cohort <= 0 or req.candidate is None or not rubric.empty:
            return None
        if not indexed:
            return []
        sha = req.candidate.sha256
        if req.filter is None:
            others = [h.ann_score for h in recall if h.sha256 != sha]
            if len(others) >= req.cohort or len(recall) < req.top_k:
                return sorted(others, reverse=True)[: req.cohort]
        found = self.index.search(req.set_id, qvec, req.cohort + 1)[0]
        return sorted((h.score for h in found if h.id != sha), reverse=True)[: req.cohort]

    def _towers_shared(self) -> bool | None:
        """Whether recall and reranking use one vision tower (None: a tower is unknown here)."""
        if self.scorer is None:
            return None
        mine, theirs = self.embedder.packages.fingerprint, self.scorer.packages.fingerprint
        return None if mine is None or theirs is None else mine == theirs


def _filter_provenance(index: VectorIndex, set_id: str, f: Filter, indexed: bool) -> FilterUse:
    """What the filter kept; a filter that keeps nothing is an empty result with its reason, not an error."""
    matched = index.count(set_id, f) if indexed else 0
    reason = None if matched else "the filter matches no reference in this set"
    return FilterUse(applied=f.to_json(), matched=matched, reason=reason)


def _score_provenance(scoring: ScoringInstructions | None, scored: ShortlistScores | None) -> ScoreFormed:
    """How each hit's ``score`` was formed, and what the reranker judged for every criterion."""
    if scored is not None and scored.kept_recall_order is not None and scored.formed is not None:
        return ScoreFormed(formed=scored.formed)
    if scoring is None:
        return ScoreFormed(formed="the vector score (inner product of the query and reference embeddings)")
    return ScoreFormed(formed=scoring.formed,
                       judged=[JudgedOut(criterion=j.criterion, statement=j.statement,
                                         score="1 - P(statement)" if j.negated else "P(statement)")
                               for j in scoring.judged])


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 3)
