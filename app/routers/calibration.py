"""A set's calibration of the reranker's judgements (fitted on its judgments) and its quality report."""

from __future__ import annotations

from fastapi import APIRouter

from rubricsearch.app.calibration import (
    calibration_out,
    current,
    model_key,
    quality_out,
    refit,
    refit_out,
)
from rubricsearch.app.deps import ADMITTED, AdminAccess, SearchAccess, SetPath, StateDep
from rubricsearch.app.refits import pending
from rubricsearch.app.schemas.calibration import CalibrationOut, QualityOut, RefitOut
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.sets import find_set
from rubricsearch.retrieval.errors import NotFound

router = APIRouter(prefix="/v1", tags=["calibration"])


@router.post("/sets/{set_id}/calibration", summary="Refit the set's calibration on its judgments now",
             description="Scores every judged (reference, criterion) cell with the serving reranker, exactly as a "
                         "search with that criterion and no candidate scores it (from cached packages: no vision "
                         "encode), fits Platt scaling and isotonic regression, keeps whichever of them and the raw "
                         "score has the lowest held-out log-loss (folds split by reference), and sets the `match` / "
                         "`no_match` thresholds for the target precision. Saved as the set's next version; searches "
                         "use it from then on. Every change to the set's judgments also schedules one in the "
                         "background; this one is for when a team wants it now.",
             responses=error_responses(401, 403, 404, 409, 422, 503), dependencies=[ADMITTED])
def post_calibration(set_id: SetPath, state: StateDep, _: AdminAccess) -> RefitOut:
    record = find_set(state, set_id)
    done = refit(state.catalog, state.search, record)
    return refit_out(done, pending(state.refits, record.id))


@router.get("/sets/{set_id}/calibration", summary="The set's current calibration",
            description="The latest fit, with `stale` counting the judgments recorded, replaced or deleted since "
                        "(searches keep using it until the next fit is saved; `stale.refit_pending`: one is scheduled "
                        "or under way).",
            responses=error_responses(401, 404, 422))
def get_calibration(set_id: SetPath, state: StateDep, _: SearchAccess) -> CalibrationOut:
    record = find_set(state, set_id)
    found = current(state.catalog, record.id)
    if found is None:
        raise NotFound("this set has no calibration yet: POST /v1/sets/{set}/calibration fits one", set_id=record.id)
    return calibration_out(*found, pending(state.refits, record.id))


@router.get("/sets/{set_id}/quality", summary="Does it work on my images? The reranker measured on the set's "
            "judgments", description="Per criterion: how well the reranker's scores separate yes from no (AUC), the "
            "precision of `match` and `no_match` and the share `uncertain` on held-out judgments, and whether there "
            "are too few judgments to tell; the same for candidate-only searches on the set's same-subject "
            "pairs (`same_subject`); from the latest calibration (`status` `not_fitted` before the first).",
            responses=error_responses(401, 404, 422))
def get_quality(set_id: SetPath, state: StateDep, _: SearchAccess) -> QualityOut:
    record = find_set(state, set_id)
    scorer = state.search_.set_scorer(record.id) if state.search_ is not None else None
    return quality_out(record.id, current(state.catalog, record.id),
                       model_key(scorer) if scorer is not None else None, pending(state.refits, record.id))
