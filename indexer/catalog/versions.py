"""Training jobs, the model versions they register for a set, and which version is active.

A training job is an ingestion-jobs row of kind ``train`` (one job table, one cancel flag, one listing and event
stream): ``total`` is its steps, ``done`` the steps run, ``options`` its settings, judgment snapshot and progress.
It has no items, so ingestion workers never claim it; the process that starts it runs it.

Functions take a session inside a caller-owned transaction, like :mod:`indexer.catalog.judgments`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog.jobs import ACTIVE_JOB_STATES, _job_row
from rubricsearch.indexer.catalog.records import JobRecord
from rubricsearch.indexer.catalog.sets import new_id, set_row
from rubricsearch.indexer.catalog.tables import (
    IngestionJob,
    JobState,
    ModelActivation,
    ModelVersion,
    ReferenceSet,
    utcnow,
)
from rubricsearch.retrieval.errors import Conflict, InvalidInput, NotFound

TRAIN = "train"
ModelName = Literal["reranker", "embedder"]
MODELS: tuple[ModelName, ...] = ("reranker", "embedder")
BASE = "base"  # what serves a set with no active version, as provenance and the version listing name it


@dataclass(frozen=True, slots=True)
class VersionRecord:
    id: str
    set_id: str
    model: str
    job_id: str | None
    path: str
    card: dict[str, Any]
    created_at: datetime

    @classmethod
    def of(cls, row: ModelVersion) -> VersionRecord:
        return cls(id=row.id, set_id=row.set_id, model=row.model, job_id=row.job_id, path=row.path,
                   card=dict(row.card or {}), created_at=row.created_at)


@dataclass(frozen=True, slots=True)
class ActivationRecord:
    id: int
    version_id: str | None  # None: the base model
    activated_at: datetime
    comparison: dict[str, Any]


# -- training jobs -----------------------------------------------------------------------------------------


def create_training_job(session: Session, set_id: str, steps: int, options: Mapping[str, Any]) -> JobRecord:
    """A queued training job; :class:`Conflict` while another training job of the set is queued or running."""
    _lock_set(session, set_id)
    running = active_training_job(session, set_id)
    if running is not None:
        raise Conflict("a training job of this set is already running: cancel it or wait for it to finish",
                       set_id=set_id, job_id=running)
    job = IngestionJob(id=new_id(), set_id=set_id, kind=TRAIN, state=JobState.QUEUED.value, options=dict(options),
                       total=steps, done=0, failed=0, skipped=0, cancel_requested=False, created_at=utcnow())
    session.add(job)
    session.flush()
    return JobRecord.of(job)


def _lock_set(session: Session, set_id: str, *, shared: bool = False) -> None:
    """The set's row, locked on PostgreSQL until the transaction ends: two requests deciding from the same state
    (is a job running, which version is active) are served one after the other; ``shared`` holders (ingestion's
    batch commits) wait only for an exclusive one. SQLite has one writer anyway."""
    set_row(session, set_id)
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(ReferenceSet.id).where(ReferenceSet.id == set_id).with_for_update(read=shared))


def active_training_job(session: Session, set_id: str) -> str | None:
    return session.scalar(select(IngestionJob.id).where(IngestionJob.set_id == set_id, IngestionJob.kind == TRAIN,
                                                        IngestionJob.state.in_(ACTIVE_JOB_STATES)).limit(1))


def training_job(session: Session, job_id: str) -> JobRecord:
    row = _job_row(session, job_id)
    if row.kind != TRAIN:
        raise NotFound("training job not found", job_id=job_id)
    return JobRecord.of(row)


def start_training_job(session: Session, job_id: str, worker_id: str) -> JobRecord:
    """Mark the queued job (new, or reopened by a resume) running in this process; :class:`Conflict` if it is not
    queued any more (cancelled before it started)."""
    row = _job_row(session, job_id, lock=True)
    if row.state != JobState.QUEUED.value:
        raise Conflict(f"the job is {row.state}, not queued: it does not start", job_id=job_id, state=row.state)
    row.state, row.worker_id = JobState.RUNNING.value, worker_id[:200]
    row.started_at = row.heartbeat_at = utcnow()
    row.done, row.error, row.finished_at = 0, None, None
    session.flush()
    return JobRecord.of(row)


def record_progress(session: Session, job_id: str, step: int, progress: Mapping[str, Any]) -> bool:
    """Store the steps run and the progress detail; returns whether a cancel was asked for."""
    row = _job_row(session, job_id, lock=True)
    row.done, row.heartbeat_at = step, utcnow()
    row.options = {**(row.options or {}), "progress": dict(progress)}
    session.flush()
    return bool(row.cancel_requested)


def touch_training_job(session: Session, job_id: str) -> None:
    """The job's heartbeat: its process is alive (a step may take longer than the staleness bound)."""
    session.execute(update(IngestionJob).where(IngestionJob.id == job_id).values(heartbeat_at=utcnow()))


def finish_training_job(session: Session, job_id: str, state: JobState, error: str | None = None) -> JobRecord:
    row = _job_row(session, job_id, lock=True)
    row.state, row.error, row.finished_at = state.value, error[:10_000] if error else None, utcnow()
    session.flush()
    return JobRecord.of(row)


def reopen_training_job(session: Session, job_id: str, stale_before: datetime) -> JobRecord:
    """Queue a cancelled or failed job again, or one left running by a process that stopped (no heartbeat since
    ``stale_before``); a succeeded job, or one still alive, is a :class:`Conflict`."""
    row = _job_row(session, job_id, lock=True)
    if row.kind != TRAIN:
        raise NotFound("training job not found", job_id=job_id)
    orphaned = row.state == JobState.RUNNING.value and (row.heartbeat_at is None or row.heartbeat_at < stale_before)
    if row.state not in (JobState.CANCELLED.value, JobState.FAILED.value) and not orphaned:
        raise Conflict(f"the job is {row.state}: only a cancelled, failed or interrupted job resumes",
                       job_id=job_id, state=row.state)
    other = active_training_job(session, row.set_id)
    if other is not None and other != job_id:
        raise Conflict("another training job of this set is running", set_id=row.set_id, job_id=other)
    row.state, row.cancel_requested, row.finished_at, row.error = JobState.QUEUED.value, False, None, None
    session.flush()
    return JobRecord.of(row)


def cancel_training_job(session: Session, job_id: str) -> JobRecord:
    """Ask a running job to stop at its next step (a queued one is cancelled at once)."""
    row = _job_row(session, job_id, lock=True)
    if JobState(row.state).finished:
        raise Conflict("the job has already finished", job_id=job_id, state=row.state)
    row.cancel_requested = True
    if row.state == JobState.QUEUED.value:
        row.state, row.finished_at = JobState.CANCELLED.value, utcnow()
    session.flush()
    return JobRecord.of(row)


# -- versions ----------------------------------------------------------------------------------------------


def add_version(session: Session, set_id: str, model: ModelName, path: str, card: Mapping[str, Any], *,
                version_id: str, job_id: str | None = None) -> VersionRecord:
    if model not in MODELS:
        raise InvalidInput("model must be reranker or embedder", model=model)
    set_row(session, set_id)
    row = ModelVersion(id=version_id, set_id=set_id, model=model, job_id=job_id, path=path, card=dict(card),
                       created_at=utcnow())
    session.add(row)
    session.flush()
    return VersionRecord.of(row)


def list_versions(session: Session, set_id: str, model: ModelName | None = None) -> list[VersionRecord]:
    """The set's versions, oldest first."""
    stmt = select(ModelVersion).where(ModelVersion.set_id == set_id)
    if model is not None:
        stmt = stmt.where(ModelVersion.model == model)
    return [VersionRecord.of(r) for r in session.scalars(stmt.order_by(ModelVersion.created_at, ModelVersion.id))]


def get_version(session: Session, set_id: str, version_id: str) -> VersionRecord:
    row = session.get(ModelVersion, version_id)
    if row is None or row.set_id != set_id:
        raise NotFound("model version not found in this set", set_id=set_id, version_id=version_id)
    return VersionRecord.of(row)


def _current(session: Session, set_id: str, model: ModelName) -> ModelActivation | None:
    return session.scalars(select(ModelActivation)
                           .where(ModelActivation.set_id == set_id, ModelActivation.model == model,
                                  ModelActivation.rolled_back_at.is_(None))
                           .order_by(ModelActivation.id.desc()).limit(1)).first()


def active_version_id(session: Session, set_id: str, model: ModelName) -> str | None:
    """The id of the set's active version of ``model`` (None: the base serves): one indexed read, no card."""
    return session.scalar(select(ModelActivation.version_id)
                          .where(ModelActivation.set_id == set_id, ModelActivation.model == model,
                                 ModelActivation.rolled_back_at.is_(None))
                          .order_by(ModelActivation.id.desc()).limit(1))


def locked_active_version(session: Session, set_id: str, model: ModelName) -> str:
    """The set's active version id of ``model`` (:data:`BASE` for the base), the set's row locked until the
    transaction ends (shared, on PostgreSQL; SQLite has one writer): an activation of the set waits for it, or it
    for the activation, and other holders of the shared lock wait for neither."""
    _lock_set(session, set_id, shared=True)
    return active_version_id(session, set_id, model) or BASE


def active_version(session: Session, set_id: str, model: ModelName) -> VersionRecord | None:
    """The set's active version of ``model`` (None: the base serves)."""
    row = _current(session, set_id, model)
    if row is None or row.version_id is None:
        return None
    return get_version(session, set_id, row.version_id)


def activate(session: Session, set_id: str, model: ModelName, version_id: str | None,
             comparison: Mapping[str, Any], *, expected: str | None) -> ActivationRecord:
    """Make ``version_id`` the active one, if the active one is still ``expected`` (the version the comparison
    was made against): a change in between is a :class:`Conflict`, so a guard never passes against a stale
    table."""
    _lock_set(session, set_id)
    current = _current(session, set_id, model)
    if (current.version_id if current is not None else None) != expected:
        raise Conflict("the active version changed while this one was compared: try again", set_id=set_id)
    row = ModelActivation(set_id=set_id, model=model, version_id=version_id, activated_at=utcnow(),
                          comparison=dict(comparison))
    session.add(row)
    session.flush()
    return ActivationRecord(row.id, row.version_id, row.activated_at, dict(row.comparison))


def previous_version_id(session: Session, set_id: str, model: ModelName) -> str | None:
    """What a rollback would make active now: the version active before the newest activation (None: the
    base). :class:`Conflict` when the base is active already."""
    newest = session.execute(select(ModelActivation.version_id)
                             .where(ModelActivation.set_id == set_id, ModelActivation.model == model,
                                    ModelActivation.rolled_back_at.is_(None))
                             .order_by(ModelActivation.id.desc()).limit(2)).all()
    if not newest:
        raise Conflict("the base model is active: there is nothing to roll back", set_id=set_id, model=model)
    return newest[1][0] if len(newest) > 1 else None


def roll_back(session: Session, set_id: str, model: ModelName) -> str | None:
    """Undo the newest activation: the version active before it (or the base) serves again; returns it.
    :class:`Conflict` when the base is active already."""
    _lock_set(session, set_id)
    current = _current(session, set_id, model)
    if current is None:
        raise Conflict("the base model is active: there is nothing to roll back", set_id=set_id, model=model)
    session.execute(update(ModelActivation).where(ModelActivation.id == current.id)
                    .values(rolled_back_at=utcnow()))
    session.flush()
    previous = _current(session, set_id, model)
    return previous.version_id if previous is not None else None
