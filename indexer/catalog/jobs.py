"""Ingestion jobs: creation, listing, cancel, failure, retry and the finishing rule.

Claiming and completing items (the worker side) lives in :mod:`indexer.catalog.claims`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog.records import ItemRecord, ItemSpec, JobRecord
from rubricsearch.indexer.catalog.sets import new_id, set_row
from rubricsearch.indexer.catalog.tables import IngestionJob, ItemState, JobItem, JobState, utcnow
from rubricsearch.retrieval.errors import Conflict, InvalidInput, NotFound

ACTIVE_JOB_STATES = (JobState.QUEUED.value, JobState.RUNNING.value)
_OPEN_ITEMS = (ItemState.PENDING.value, ItemState.CLAIMED.value)
_INSERT_CHUNK = 1000


def _job_row(session: Session, job_id: str, *, lock: bool = False) -> IngestionJob:
    stmt = select(IngestionJob).where(IngestionJob.id == job_id)
    if lock and session.get_bind().dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    row = session.scalar(stmt.execution_options(populate_existing=True))
    if row is None:
        raise NotFound("ingestion job not found", job_id=job_id)
    return row


def create_job(
    session: Session,
    set_id: str,
    kind: str,
    items: Iterable[ItemSpec | str],
    *,
    options: Mapping[str, Any] | None = None,
    job_id: str | None = None,
) -> JobRecord:
    """Create a job with all its items at once (``seq`` is their order); an empty job is born succeeded."""
    set_row(session, set_id)
    if not kind or len(kind) > 32:
        raise InvalidInput("job kind must be 1..32 characters", kind=kind)
    specs = [i if isinstance(i, ItemSpec) else ItemSpec(source_ref=i) for i in items]
    now = utcnow()
    job = IngestionJob(
        id=job_id or new_id(),
        set_id=set_id,
        kind=kind,
        state=JobState.QUEUED.value if specs else JobState.SUCCEEDED.value,
        options=dict(options or {}),
        total=len(specs),
        done=0,
        failed=0,
        skipped=0,
        cancel_requested=False,
        created_at=now,
        finished_at=None if specs else now,
    )
    if session.get(IngestionJob, job.id) is not None:
        raise Conflict("an ingestion job with this id exists", job_id=job.id)
    session.add(job)
    session.flush()
    rows = [
        {
            "job_id": job.id,
            "seq": seq,
            "source_ref": spec.source_ref,
            "blob_sha256": spec.blob_sha256,
            "meta": spec.meta,
            "state": ItemState.PENDING.value,
            "attempts": 0,
        }
        for seq, spec in enumerate(specs)
    ]
    for start in range(0, len(rows), _INSERT_CHUNK):
        session.execute(insert(JobItem), rows[start : start + _INSERT_CHUNK])
    return JobRecord.of(job)


def get_job(session: Session, job_id: str) -> JobRecord:
    return JobRecord.of(_job_row(session, job_id))


def list_jobs(
    session: Session,
    *,
    set_id: str | None = None,
    states: Iterable[JobState] | None = None,
    limit: int = 50,
    offset: int = 0,
) -> list[JobRecord]:
    """Jobs, newest first."""
    stmt = select(IngestionJob)
    if set_id is not None:
        stmt = stmt.where(IngestionJob.set_id == set_id)
    if states is not None:
        stmt = stmt.where(IngestionJob.state.in_([JobState(s).value for s in states]))
    stmt = stmt.order_by(IngestionJob.created_at.desc(), IngestionJob.id.desc()).offset(offset).limit(limit)
    return [JobRecord.of(r) for r in session.scalars(stmt)]


def list_items(
    session: Session,
    job_id: str,
    *,
    states: Iterable[ItemState] | None = None,
    limit: int = 100,
    offset: int = 0,
) -> list[ItemRecord]:
    """A job's items in ``seq`` order (e.g. ``states=[ItemState.FAILED]`` for an error report)."""
    stmt = select(JobItem).where(JobItem.job_id == job_id)
    if states is not None:
        stmt = stmt.where(JobItem.state.in_([ItemState(s).value for s in states]))
    rows = session.scalars(stmt.order_by(JobItem.seq).offset(offset).limit(limit))
    return [ItemRecord.of(r) for r in rows]


def is_cancel_requested(session: Session, job_id: str) -> bool:
    flag = session.scalar(select(IngestionJob.cancel_requested).where(IngestionJob.id == job_id))
    if flag is None:
        raise NotFound("ingestion job not found", job_id=job_id)
    return bool(flag)


def request_cancel(session: Session, job_id: str) -> JobRecord:
    """Stop a job: pending items are cancelled now; claimed ones may finish, then the job is cancelled."""
    job = get_job(session, job_id)
    if job.finished:
        return job
    now = utcnow()
    session.execute(
        update(JobItem)
        .where(JobItem.job_id == job_id, JobItem.state == ItemState.PENDING.value)
        .values(state=ItemState.CANCELLED.value, finished_at=now)
    )
    session.execute(
        update(IngestionJob)
        .where(IngestionJob.id == job_id, IngestionJob.state.in_(ACTIVE_JOB_STATES))
        .values(cancel_requested=True)
    )
    finish_if_done(session, job_id, now)
    return get_job(session, job_id)


def fail_job(session: Session, job_id: str, error: str) -> JobRecord:
    """Fail a whole job (e.g. its archive is unreadable): open items are cancelled, claims are void."""
    now = utcnow()
    session.execute(
        update(JobItem)
        .where(JobItem.job_id == job_id, JobItem.state.in_(_OPEN_ITEMS))
        .values(state=ItemState.CANCELLED.value, finished_at=now, claimed_by=None)
    )
    row = _job_row(session, job_id, lock=True)
    if not JobState(row.state).finished:
        row.state, row.error, row.finished_at = JobState.FAILED.value, error[:10_000], now
        session.flush()
    return JobRecord.of(row)


def retry_failed_items(session: Session, job_id: str) -> JobRecord:
    """Put a finished job's failed items back to pending and reopen the job (resume after a fix)."""
    job = get_job(session, job_id)
    if not job.finished:
        raise Conflict("job is still running", job_id=job_id, state=job.state.value)
    result = session.execute(
        update(JobItem)
        .where(JobItem.job_id == job_id, JobItem.state == ItemState.FAILED.value)
        .values(
            state=ItemState.PENDING.value,
            error=None,
            attempts=0,
            claimed_by=None,
            claimed_at=None,
            finished_at=None,
        )
    )
    reopened = int(result.rowcount)  # type: ignore[attr-defined]
    if reopened:
        session.execute(
            update(IngestionJob)
            .where(IngestionJob.id == job_id)
            .values(
                state=JobState.QUEUED.value,
                failed=IngestionJob.failed - reopened,
                cancel_requested=False,
                error=None,
                finished_at=None,
            )
        )
    return get_job(session, job_id)


def finish_if_done(session: Session, job_id: str, now: datetime | None = None) -> None:
    """Finish the job if no item is open.

    The job row is locked before counting, so of two workers completing the last two items the second
    to get the lock sees the first's commit: exactly one of them finishes the job.
    """
    row = _job_row(session, job_id, lock=True)
    if JobState(row.state).finished:
        return
    open_items = session.scalar(
        select(func.count(JobItem.id)).where(JobItem.job_id == job_id, JobItem.state.in_(_OPEN_ITEMS))
    )
    if open_items:
        return
    if row.cancel_requested:
        state = JobState.CANCELLED
    elif row.failed == 0:
        state = JobState.SUCCEEDED
    elif row.done + row.skipped == 0:
        state = JobState.FAILED
    else:
        state = JobState.COMPLETED_WITH_ERRORS
    row.state, row.finished_at = state.value, now or utcnow()
    session.flush()
