"""Fine-tuning a set's reranker from its judgments: training jobs, the versions they register, activation behind
a side-by-side guard, and rollback.

Starting, cancelling and resuming a job, activating and rolling back are admin mutations; reading jobs and versions
takes what searching takes. Training runs on a thread of the server (searches keep being answered); a job is also
an entry of ``GET /v1/jobs`` (kind ``train``), whose event stream follows its steps.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Query

from rubricsearch.app.deps import JSON_BODY, AdminAccess, SearchAccess, SetPath, StateDep
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.model_versions import activate_version, rollback
from rubricsearch.app.refits import changed
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.schemas.training import (
    ActivationOut,
    ComparisonOut,
    TrainingBody,
    TrainingJobOut,
    TrainingProgressOut,
    VersionList,
    VersionOut,
)
from rubricsearch.app.sets import find_set
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import JobRecord
from rubricsearch.indexer.catalog.versions import MODELS, ModelName, active_version_id, get_version, list_versions

router = APIRouter(prefix="/v1", tags=["training"], route_class=BoundedJsonRoute)

JobPath = Annotated[str, Path(description="The training job's id.", max_length=64)]
VersionPath = Annotated[str, Path(description="The version's id.", max_length=64)]

CALIBRATION_STALE = ("the set's calibration was fitted on another reranker's scores: searches give no verdicts "
                     "from it while this one is active (provenance.calibration says so) until the refit on the "
                     "active reranker, scheduled in the background now (or POST /v1/sets/{set}/calibration), is "
                     "saved")


CALIBRATION_KEPT = ("unchanged: the set's calibration describes the reranker's scores, which the embedder does "
                    "not change")


def _job_out(job: JobRecord) -> TrainingJobOut:
    return TrainingJobOut(id=job.id, set_id=job.set_id, model=job.options.get("model", "reranker"),
                          state=job.state.value, steps_done=job.done,
                          steps_total=job.total, settings=job.options.get("settings", {}),
                          max_judgment_id=int(job.options.get("max_judgment_id", 0)),
                          progress=TrainingProgressOut.model_validate(job.options.get("progress", {})),
                          error=job.error, cancel_requested=job.cancel_requested, created_at=job.created_at,
                          started_at=job.started_at, finished_at=job.finished_at)


@router.post("/sets/{set_id}/training-jobs", status_code=202,
             summary="Fine-tune the set's reranker or embedder on its judgments",
             description="Starts a job that trains LoRA adapters on the language model of the reranker (or, with "
                         "`model: embedder`, the embedder: contrastive) from the set's "
                         "judgments of indexed references (read from their cached packages: no vision encode), "
                         "with a train/validation split by reference and early stopping, and registers the result "
                         "as a new version of the set (not active until activated). 409 while another training "
                         "job of the set runs; 400 for settings out of range, no judgments, or judgments that all "
                         "answer the same (422: a body not of the schema); nothing is recorded then.",
             dependencies=[JSON_BODY], responses=error_responses(400, 401, 403, 404, 409, 415, 422, 503))
def start_training(set_id: SetPath, body: Annotated[TrainingBody, Body()], state: StateDep,
                   _: AdminAccess) -> TrainingJobOut:
    return _job_out(state.training.start(find_set(state, set_id), body.settings(), body.model))


@router.get("/sets/{set_id}/training-jobs/{job_id}", summary="A training job: state, steps, losses, ETA",
            responses=error_responses(401, 404, 422, 503))
def get_training(set_id: SetPath, job_id: JobPath, state: StateDep, _: SearchAccess) -> TrainingJobOut:
    return _job_out(state.training.get(job_id, find_set(state, set_id).id))


@router.post("/sets/{set_id}/training-jobs/{job_id}/cancel", status_code=202, summary="Cancel a training job",
             description="The trainer stops at its next step and no version is written. 409 if it has finished.",
             responses=error_responses(401, 403, 404, 409, 422, 503))
def cancel_training(set_id: SetPath, job_id: JobPath, state: StateDep, _: AdminAccess) -> TrainingJobOut:
    state.training.get(job_id, find_set(state, set_id).id)
    return _job_out(state.training.cancel(job_id))


@router.post("/sets/{set_id}/training-jobs/{job_id}/resume", status_code=202, summary="Resume a training job",
             description="Runs a cancelled or failed job again, or one whose server stopped (no heartbeat for a "
                         "minute), in this server: from step 0 with the job's settings, seed and judgment "
                         "snapshot, so it makes the version an uninterrupted run makes. 409 for a job that "
                         "succeeded or is alive, or while another training job of the set runs.",
             responses=error_responses(401, 403, 404, 409, 422, 503))
def resume_training(set_id: SetPath, job_id: JobPath, state: StateDep, _: AdminAccess) -> TrainingJobOut:
    state.training.get(job_id, find_set(state, set_id).id)
    return _job_out(state.training.resume(job_id))


def _versions(state: AppState, set_id: str) -> VersionList:
    with state.catalog.read() as session:
        versions = list_versions(session, set_id)
        active: dict[str, str] = {m: active_version_id(session, set_id, m) or "base" for m in MODELS}
    return VersionList(active=active["reranker"], active_embedder=active["embedder"], data=[
        VersionOut(id=v.id, set_id=v.set_id, model=v.model, job_id=v.job_id,
                   active=v.id == active[v.model], created_at=v.created_at, card=v.card) for v in versions])


@router.get("/sets/{set_id}/versions", summary="The set's model versions, oldest first, and the active one",
            responses=error_responses(401, 404, 422))
def get_versions(set_id: SetPath, state: StateDep, _: SearchAccess) -> VersionList:
    return _versions(state, find_set(state, set_id).id)


@router.post("/sets/{set_id}/versions/{version_id}/activate", summary="Make a version the set's reranker or "
             "embedder, if it is better", description="Scores the held-out judgments neither the active model of "
             "the version's kind nor the version trained on with both (from cached packages), side by side. A "
             "reranker: AUC, log-loss, precision of `match` (P >= 0.5) and nDCG@10 over each criterion's "
             "references; searches of the set then score with it and name it in `provenance.reranker_version`. An "
             "embedder: nDCG@10 of the criteria it trained on and of the set's other judged criteria; the set's "
             "references are then re-embedded with it from their packages (the old vectors serve until the "
             "switch) and searches embed their queries with it (`provenance.embedder_version`). The version "
             "becomes active only with no metric worse and one better; otherwise 409 with the table in "
             "`error.details.comparison`, and nothing changes.",
             responses=error_responses(401, 403, 404, 409, 422, 503))
def post_activate(set_id: SetPath, version_id: VersionPath, state: StateDep, _: AdminAccess) -> ActivationOut:
    record = find_set(state, set_id)
    with state.catalog.read() as session:
        model = get_version(session, record.id, version_id).model
    table = activate_version(state, record, version_id)
    return ActivationOut(active=version_id, comparison=ComparisonOut.model_validate(table),
                         calibration=_calibration(state, record.id, model))


@router.post("/sets/{set_id}/versions/rollback", summary="Undo the last activation",
             description="The version of `model` active before it, or the base, serves the set's searches again "
                         "(an embedder's: the set's references are re-embedded with it first, from their "
                         "packages). 409 when the base is active.", responses=error_responses(401, 403, 404, 409, 422))
def post_rollback(set_id: SetPath, state: StateDep, _: AdminAccess,
                  model: Annotated[ModelName, Query(description="Which of the set's models.")] = "reranker"
                  ) -> ActivationOut:
    record = find_set(state, set_id)
    active = rollback(state, record, model)
    return ActivationOut(active=active, calibration=_calibration(state, record.id, model))


def _calibration(state: AppState, set_id: str, model: str) -> str:
    """A new reranker's scores need the set's calibration refitted (scheduled here); an embedder changes only
    which references are shortlisted, not their scores."""
    if model != "reranker":
        return CALIBRATION_KEPT
    changed(state.refits, set_id)
    return CALIBRATION_STALE
