"""A search in a reference set and its API view: what ``POST /v1/search``, ``rubricsearch search`` and Python
callers (``from rubricsearch import search_set``) run.

A search only reads: the catalog for the set, the hits' records and the set's latest calibration (whose
verdicts it adds, ``app/calibration.py``), the index for the shortlist. A set that no
image was ingested into yet may have no vector set (ingestion creates it); it is searched as the empty set it is.
"""

from __future__ import annotations

import time

from rubricsearch.app.calibration import applies, calibration_use, current_in, hit_verdicts, key_for
from rubricsearch.app.calibration_pairs import COHORT
from rubricsearch.app.deps import ImageResolver
from rubricsearch.app.evidence import explain_hits
from rubricsearch.app.refits import pending
from rubricsearch.app.schemas.calibration import CellOut
from rubricsearch.app.schemas.metadata import to_filter
from rubricsearch.app.schemas.search import CandidateOut, Provenance, SearchBody, SearchHitOut, SearchResponse, SetRef
from rubricsearch.app.services import DEFAULT_TOP_K, DEFAULT_TOP_N, FACET_MIN_CONFIDENCE
from rubricsearch.app.sets import find_set
from rubricsearch.app.state import AppState
from rubricsearch.app.views import image_out
from rubricsearch.indexer.catalog import find_images, judgments_of
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.search import SearchRequest


def search_set(state: AppState, query: SearchBody, candidate: ImageLike | None = None) -> SearchResponse:
    """Search the set ``query.set_id`` names with its rubric and/or candidate image.

    ``query.image`` (a ``data:`` URL or ``{"image_id": sha256}`` of an ingested image) is the candidate unless
    ``candidate`` is given: an image the caller has already read (an uploaded or local file)."""
    if candidate is None and query.image is not None:
        candidate = ImageResolver(state).image(query.image)
    record = find_set(state, query.set_id)
    request = SearchRequest(
        set_id=record.id, rubric=query.rubric, criteria=list(query.criteria), candidate=candidate,
        top_k=query.top_k or DEFAULT_TOP_K, top_n=DEFAULT_TOP_N if query.top_n is None else query.top_n,
        rerank=query.rerank, filter=to_filter(query.filter, FACET_MIN_CONFIDENCE), known_set=True, cohort=COHORT,
    )
    result = state.search.search(request)
    with state.catalog.read() as session:
        images = find_images(session, record.id, [h.sha256 for h in result.hits])
        criteria = {c: c.strip() for c in result.provenance.criteria}  # stored judgments' criteria are stripped
        judged = judgments_of(session, record.id, [i.id for i in images.values()], criteria.values())
        calibrated = current_in(session, record.id)
    use, verdicts = None, None
    if calibrated is not None:
        scored_by = result.provenance.reranker_model  # the reranker (version) this search scored with
        key = (key_for(scored_by.id, scored_by.revision, result.provenance.reranker_version or "base")
               if scored_by is not None else "none")
        alone = candidate is not None and not result.provenance.criteria and not (query.rubric or "").strip()
        why_not = applies(calibrated[0], key, result.provenance.criteria, candidate is not None,
                          result.provenance.reranked, alone)
        use = calibration_use(*calibrated, why_not, alone, pending=pending(state.refits, record.id))
        if why_not is None:
            verdicts = hit_verdicts(calibrated[0], result)
    hits: list[SearchHitOut] = []
    for i, hit in enumerate(result.hits):
        image = images.get(hit.sha256)
        if image is None:  # deleted while the search ran
            continue
        recorded = judged.get(image.id, {})
        verdict = verdicts[i] if verdicts is not None else None
        hits.append(SearchHitOut(
            rank=len(hits) + 1, score=hit.score, ann_score=hit.ann_score, rerank_score=hit.rerank_score,
            criteria=hit.criteria, identical=hit.identical, image=image_out(image),
            judgments={c: recorded[k] for c, k in criteria.items() if k in recorded},
            verdict=verdict.verdict if verdict is not None else None,
            probability=verdict.probability if verdict is not None else None,
            criteria_verdicts={c: CellOut(probability=cell.probability, verdict=cell.verdict)
                               for c, cell in verdict.cells.items()} if verdict is not None else {}))
    if query.explain is not False:
        started = time.perf_counter()
        records = [images[h.image.sha256] for h in hits]
        for out, evidence in zip(hits, explain_hits(state, records, result.provenance.criteria, query.explain,
                                                    candidate, candidate_maps=query.explain_candidate), strict=True):
            out.evidence = evidence
        result.timings_ms["evidence"] = (time.perf_counter() - started) * 1000
    provenance = Provenance(**dict(result.provenance), set=SetRef(id=record.id, name=record.name), calibration=use)
    return SearchResponse(hits=hits, provenance=provenance, timings_ms=result.timings_ms,
                          candidate=CandidateOut(sha256=candidate.sha256) if candidate is not None else None,
                          test_models=state.test_models, models_label=state.models_label)
