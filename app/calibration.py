"""A set's calibration as the product runs it: scoring the judged cells, refitting, and verdicts on search hits.

A judged cell (reference, criterion) is scored exactly as search scores that criterion's cell in a search with
criteria and no candidate: the same :class:`~retrieval.search.protocol.ShortlistScorer` object search holds, the
criterion alone as the rubric, the reference as a cached-package handle, so no vision encoder runs for it (the
refit reports the encodes it caused, and the tests hold it at 0). Searches with a candidate judge a criterion
with another instruction ("matches the Query image on this criterion"), which these judgments do not measure:
their cells get no verdict.

A refit follows every change to a set's judgments on its own (:mod:`app.refits`, in the background: a fit is a
few reranker passes over every judged cell, too much work for the request that records a judgment) and can be
asked for (``POST /v1/sets/{set}/calibration``). Search always uses the set's latest saved fit; the calibration and
quality reports say how many judgments were recorded, replaced or deleted since it (``stale``). One refit of a set
runs at a time in a process (:func:`refit` takes the set's lock), so a background refit and an asked-for one never
race to save the same version.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from sqlalchemy.orm import Session

from rubricsearch.app.calibration_pairs import READS, fit_pairs, judged_by_reference, same_subject_scores, score_pairs
from rubricsearch.app.schemas.calibration import (
    CalibrationOut,
    CalibrationUse,
    QualityOut,
    RefitOut,
    SameSubjectQualityOut,
    StaleOut,
)
from rubricsearch.indexer.catalog import Catalog, get_images, list_judgments, page_judgments
from rubricsearch.indexer.catalog.calibrations import (
    Staleness,
    indexed_judgments,
    latest_calibration,
    save_calibration,
    staleness,
)
from rubricsearch.indexer.catalog.records import SetRecord
from rubricsearch.indexer.catalog.tables import ImageStatus, utcnow
from rubricsearch.rerank.calibration import Calibration, Verdict, fit
from rubricsearch.rerank.rubric import judged
from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search.instructions import Rubric
from rubricsearch.retrieval.search.protocol import ShortlistScorer
from rubricsearch.retrieval.search.service import ReferenceResolver, SearchResult, SearchService

BATCH = 64  # references per reranker call (all of one criterion)


def model_key(scorer: ShortlistScorer) -> str:
    """The reranker a calibration belongs to, as provenance names it: ``id@revision``, and ``+version`` for a
    version trained for the set (its scores differ from the base's, so the base's fit does not apply to it)."""
    return key_for(scorer.model_id, scorer.revision, scorer.version)


def key_for(model_id: str, revision: str, version: str) -> str:
    return f"{model_id}@{revision}" + ("" if version == "base" else f"+{version}")


def scorer_of(search: SearchService, set_id: str | None = None) -> ShortlistScorer:
    """The reranker that scores the set's searches (its active version), or the base without a set."""
    scorer = search.set_scorer(set_id) if set_id is not None else search.scorer
    if scorer is None:
        raise BackendUnavailable("calibration needs the reranker loaded in this process")
    return scorer


def score_cells(scorer: ShortlistScorer, resolve: ReferenceResolver, cells: Sequence[tuple[str, str]], *,
                usage: Usage, batch: int = BATCH) -> list[float | None]:
    """The score search gives each (reference sha256, criterion) cell in a search with that criterion and no
    candidate; the references of one criterion go to the reranker ``batch`` at a time. None where search gives
    that criterion no cell: the scorer keeps the recall order for its kind of query (a measured policy)."""
    out: list[float | None] = [None] * len(cells)
    by_criterion: dict[str, list[int]] = {}
    for i, (_, criterion) in enumerate(cells):
        by_criterion.setdefault(criterion, []).append(i)
    for criterion, at in by_criterion.items():
        rubric = Rubric.parse(None, [criterion])
        for start in range(0, len(at), batch):
            chunk = at[start:start + batch]
            docs = [Content(images=[resolve(cells[i][0])]) for i in chunk]
            scored = scorer.score(Content(), rubric, docs, [0.0] * len(docs), usage=usage)
            if scored.kept_recall_order is not None:
                break
            for i, per in zip(chunk, scored.per_criterion, strict=True):
                out[i] = per[0]
    return out


@dataclass(frozen=True)
class Refit:
    calibration: Calibration
    usage: Usage


_LOCKS: dict[str, threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()


def set_lock(set_id: str) -> threading.RLock:
    """The lock one refit of the set holds in this process (re-entrant: a caller may hold it across its own check
    of whether a refit is needed and the refit)."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(set_id, threading.RLock())


def refit(catalog: Catalog, search: SearchService, set_record: SetRecord) -> Refit:
    """Score every judged cell of the set with the serving reranker, fit, and save the next version. Judgments of
    references not indexed yet (no cached package to score them from) and of criteria whose kind of search the
    scorer serves in recall order (search gives them no cell) are counted as ``skipped``."""
    with set_lock(set_record.id):
        return _refit(catalog, search, set_record)


def needs_refit(catalog: Catalog, search: SearchService, set_id: str) -> bool:
    """Whether the set's judgments moved since its latest fit, a judged reference left out of it (not indexed then)
    is indexed now, the set has judgments and no fit for the serving reranker, or its candidate-only fit reads
    another score than served searches do (fitted before they read it)."""
    with catalog.read() as session:
        found = current_in(session, set_id)
        judged = found is not None or bool(page_judgments(session, set_id, limit=1).items)
        indexed = None if found is None else indexed_judgments(session, set_id, found[0].max_judgment_id)
    if found is None:
        return judged
    calibration, moved = found
    newly_indexed = calibration.indexed is not None and indexed is not None and indexed > calibration.indexed
    return (moved.stale or newly_indexed or calibration.model_key != model_key(scorer_of(search, set_id))
            or calibration.candidate is None or calibration.candidate.reads != READS)


def _refit(catalog: Catalog, search: SearchService, set_record: SetRecord) -> Refit:
    scorer = scorer_of(search, set_record.id)
    with catalog.read() as session:
        judgments = list_judgments(session, set_record.id)
        images = get_images(session, {j.image_id for j in judgments})
    indexed = [j for j in judgments if j.image_id in images and images[j.image_id].status == ImageStatus.INDEXED]
    usage = Usage()
    scores = score_cells(scorer, search.resolve_reference,
                         [(images[j.image_id].sha256, j.criterion) for j in indexed], usage=usage)
    scored = [(j, s) for j, s in zip(indexed, scores, strict=True) if s is not None]
    key, last, now = model_key(scorer), max((j.id for j in judgments), default=0), utcnow()
    calibration = fit([s for _, s in scored], [j.holds for j, _ in scored],
                      [images[j.image_id].sha256 for j, _ in scored], [j.criterion for j, _ in scored],
                      model_key=key, max_judgment_id=last, fitted_at=now)
    pairs = score_pairs(search, set_record.id, judged_by_reference(
        [(images[j.image_id].sha256, j.criterion, j.holds) for j in indexed]), usage=usage)
    listed = replace(calibration, judgments=len(judgments), skipped=len(judgments) - len(scored),
                     indexed=len(indexed), candidate=fit_pairs(pairs, model_key=key, max_judgment_id=last,
                                                               fitted_at=now))
    with catalog.write() as session:
        saved = save_calibration(session, set_record.id, listed)
    return Refit(saved, usage)


def current(catalog: Catalog, set_id: str) -> tuple[Calibration, Staleness] | None:
    """The set's latest calibration and how its judgments moved since (None: never fitted)."""
    with catalog.read() as session:
        return current_in(session, set_id)


def current_in(session: Session, set_id: str) -> tuple[Calibration, Staleness] | None:
    calibration = latest_calibration(session, set_id)
    return None if calibration is None else (calibration, staleness(session, set_id, calibration))


@dataclass(frozen=True)
class Cell:
    probability: float
    verdict: Verdict


@dataclass(frozen=True)
class HitVerdict:
    """A hit's verdict from its cells: a match when every criterion is, no match when any is, else uncertain;
    ``probability`` is the chance that every criterion holds (the cells' calibrated probabilities multiplied)."""

    probability: float
    verdict: Verdict
    cells: dict[str, Cell]


def applies(calibration: Calibration, key: str, criteria: Sequence[str], has_candidate: bool, reranked: bool,
            candidate_only: bool = False) -> str | None:
    """Why the calibration gives this search no verdicts (None: it does). ``reranked``: the scorer formed the
    scores (a candidate-only search's verdicts read its recall scores, whether or not the reranker ran)."""
    if calibration.model_key != key:
        return f"fitted for another reranker ({calibration.model_key}): refit for {key}"
    if candidate_only:
        pairs = calibration.candidate
        if pairs is None:
            return "fitted before candidate-only searches were calibrated: refit"
        if pairs.reads != READS:
            return "fitted on the shown score, before candidate-only verdicts read the cohort-normalised one: refit"
        if not pairs.applies:
            return f"too few same-subject pairs: {pairs.reason}"
        return None
    if not calibration.applies:
        return f"too few judgments: {calibration.reason}"
    if not reranked or not criteria:
        return "only criterion scores of a reranked search are calibrated"
    if has_candidate:
        return "fitted on criteria judged without a candidate image; this search judged them against one"
    return None


def hit_verdicts(calibration: Calibration, result: SearchResult) -> list[HitVerdict]:
    """Each hit's verdict; without criteria (a candidate alone), from the same-subject fit of its cohort-normalised
    recall score, but the candidate's identical image, which is the same subject by rule (as its score 1.0 is)."""
    hits, criteria = result.hits, result.provenance.criteria
    if not criteria:
        pairs = calibration.candidate
        assert pairs is not None  # applies() turned a calibration without one away
        scores = same_subject_scores(result)
        p, band = pairs.probability(scores), pairs.verdicts(scores)
        assert p is not None and band is not None  # applies() turned a calibration without a fit away
        return [HitVerdict(1.0, "match", {}) if h.identical else HitVerdict(float(q), v, {})
                for h, q, v in zip(hits, p, band, strict=True)]
    out = []
    statements = [judged(c).statement if judged(c).negated else None for c in criteria]
    for hit in hits:
        found = calibration.cells([hit.criteria[c] for c in criteria], criteria, statements)
        assert found is not None  # applies() turned a calibration without a fit away
        p, band = found
        probs = [float(x) for x in p]
        cells = {c: Cell(q, v) for c, q, v in zip(criteria, probs, band, strict=True)}
        verdict: Verdict = ("match" if all(v == "match" for v in band) else
                            "no_match" if any(v == "no_match" for v in band) else "uncertain")
        out.append(HitVerdict(float(np.prod(probs)), verdict, cells))
    return out


# -- API views --------------------------------------------------------------------------------------------------
def stale_out(moved: Staleness, pending: bool = False) -> StaleOut:
    return StaleOut(stale=moved.stale, new=moved.new, gone=moved.gone, refit_pending=pending)


def calibration_out(calibration: Calibration, moved: Staleness, pending: bool = False) -> CalibrationOut:
    return CalibrationOut.model_validate(calibration.to_json() | {"stale": stale_out(moved, pending)})


def refit_out(done: Refit, pending: bool = False) -> RefitOut:
    fresh = Staleness(new=0, gone=0)
    return RefitOut.model_validate(calibration_out(done.calibration, fresh, pending).model_dump()
                                   | {"vision_encodes": done.usage.total()})


def same_subject_out(pairs: Calibration | None) -> SameSubjectQualityOut | None:
    if pairs is None:
        return None
    counted = pairs.per_criterion[0] if pairs.per_criterion else None
    return SameSubjectQualityOut(
        status=pairs.status, reason=pairs.reason, pairs=pairs.judgments, same=counted.yes if counted else 0,
        different=counted.no if counted else 0,
        held_out=None if pairs.held_out is None else pairs.to_json()["held_out"]["band"])


def quality_out(set_id: str, found: tuple[Calibration, Staleness] | None, serving: str | None,
                pending: bool = False) -> QualityOut:
    if found is None:
        why = ("a refit of its judgments is under way" if pending else
               "it follows the set's judgments: record some (or POST .../calibration)")
        return QualityOut(set_id=set_id, status="not_fitted", reason=f"no calibration yet: {why}",
                          calibration_version=None, model_key=None, serving_model_key=serving, judgments=0,
                          overall=None, per_criterion=[], same_subject=None, stale=None)
    calibration, moved = found
    reason = calibration.reason
    if serving is not None and calibration.model_key != serving:
        reason = f"measured for another reranker ({calibration.model_key}); refit to measure {serving}. {reason}"
    data = calibration.to_json()
    return QualityOut(set_id=set_id, status=calibration.status, reason=reason, calibration_version=calibration.version,
                      model_key=calibration.model_key, serving_model_key=serving, judgments=calibration.judgments,
                      overall=None if calibration.held_out is None else data["held_out"]["band"],
                      per_criterion=data["per_criterion"], same_subject=same_subject_out(calibration.candidate),
                      stale=stale_out(moved, pending))


def calibration_use(calibration: Calibration, moved: Staleness, why_not: str | None, candidate_only: bool = False,
                    *, pending: bool = False) -> CalibrationUse:
    """What provenance says of the set's calibration: for a candidate-only search, the fit on same-subject pairs
    (its status, method, thresholds and held-out measurement), else the fit on criterion cells."""
    used = calibration.candidate if candidate_only and calibration.candidate is not None else calibration
    data = used.to_json()
    return CalibrationUse(version=calibration.version, status=used.status, applied=why_not is None,
                          reason=why_not, fitted_to="same_subject" if used is not calibration else "criteria",
                          model_key=calibration.model_key, method=None if used.mapping is None else used.mapping.method,
                          fitted_at=calibration.fitted_at, judgments=calibration.judgments,
                          max_judgment_id=calibration.max_judgment_id, reads=used.reads, match_at=used.match_at,
                          no_match_at=used.no_match_at, held_out=data["held_out"], stale=stale_out(moved, pending))
