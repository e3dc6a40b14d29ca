"""Claiming and completing job items: crash-safe, resumable, multi-worker ingestion.

A worker loop is::

    with catalog.write() as s:
        items = claim_next_items(s, worker_id, limit=8)      # committed: the claim is durable
    for item in items:
        ...                                                   # fetch, decode, store blob, embed
        with catalog.write() as s:
            add_image(s, ...)                                 # result and progress commit together
            complete_item(s, item.id, worker_id, ItemState.DONE, image_id=...)

A claim older than ``stale_after_s`` belongs to a dead worker and is taken over, so a crashed job
resumes where it stopped; ``heartbeat`` keeps a slow item's claim fresh. On PostgreSQL claims use
``FOR UPDATE SKIP LOCKED``; on SQLite the claim runs in a ``BEGIN IMMEDIATE`` transaction
(``catalog.write()``), i.e. with the single write lock held. Lock order is always items, then job,
so concurrent claims, completions and cancels cannot deadlock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, update
from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog.jobs import ACTIVE_JOB_STATES, _job_row, finish_if_done, get_job
from rubricsearch.indexer.catalog.records import ItemRecord, JobRecord
from rubricsearch.indexer.catalog.tables import IngestionJob, ItemState, JobItem, JobState, utcnow
from rubricsearch.retrieval.errors import Conflict, InvalidInput, NotFound

DEFAULT_STALE_AFTER_S = 300.0
DEFAULT_MAX_ATTEMPTS = 3
_COUNTERS = {ItemState.DONE: "done", ItemState.FAILED: "failed", ItemState.SKIPPED: "skipped"}


def _stale(cutoff: datetime) -> ColumnElement[bool]:
    return and_(JobItem.state == ItemState.CLAIMED.value, JobItem.claimed_at < cutoff)


def _reap(session: Session, cutoff: datetime, max_attempts: int, job_id: str | None) -> None:
    """Settle stale claims that must not be retried: cancelled jobs, and items that used up their attempts."""
    stmt = (
        select(JobItem.id, JobItem.job_id, JobItem.attempts, IngestionJob.cancel_requested)
        .join(IngestionJob, IngestionJob.id == JobItem.job_id)
        .where(_stale(cutoff))
        .where(or_(IngestionJob.cancel_requested.is_(True), JobItem.attempts >= max_attempts))
    )
    if job_id is not None:
        stmt = stmt.where(JobItem.job_id == job_id)
    if session.get_bind().dialect.name == "postgresql":
        stmt = stmt.with_for_update(skip_locked=True, of=JobItem)
    now = utcnow()
    touched: set[str] = set()
    for item_id, item_job, attempts, cancelled in session.execute(stmt).all():
        values: dict[str, Any] = {"finished_at": now, "claimed_by": None}
        if cancelled:
            values["state"] = ItemState.CANCELLED.value
        else:
            values["state"] = ItemState.FAILED.value
            values["error"] = f"abandoned: its worker stopped {attempts} times while processing it"
        session.execute(update(JobItem).where(JobItem.id == item_id).values(**values))
        if not cancelled:
            session.execute(
                update(IngestionJob).where(IngestionJob.id == item_job).values(failed=IngestionJob.failed + 1)
            )
        touched.add(item_job)
    for jid in sorted(touched):
        finish_if_done(session, jid, now)


def claim_next_items(
    session: Session,
    worker_id: str,
    *,
    job_id: str | None = None,
    limit: int = 1,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    exclude_kinds: Sequence[str] = (),
    kinds: Sequence[str] = (),
) -> list[ItemRecord]:
    """Claim up to ``limit`` pending (or stale) items, taking turns across the jobs with work (oldest first, then
    one item of each in turn); never the same item twice.

    Call inside ``catalog.write()`` and commit before processing. Items of jobs with a cancel request
    are never handed out. An item whose claim went stale ``max_attempts`` times is marked failed
    (a poison input that keeps killing workers must not stall the job). ``kinds`` (if given) and ``exclude_kinds``
    choose the kinds of job whose items are claimed.
    """
    if not worker_id or len(worker_id) > 200:
        raise InvalidInput("worker_id must be 1..200 characters")
    if limit < 1:
        raise InvalidInput("limit must be >= 1", limit=limit)
    now = utcnow()
    cutoff = now - timedelta(seconds=stale_after_s)
    _reap(session, cutoff, max_attempts, job_id)
    _settle_cancelled(session, job_id)

    claimable = or_(JobItem.state == ItemState.PENDING.value, _stale(cutoff))
    open_items = (
        select(JobItem.id)
        .join(IngestionJob, IngestionJob.id == JobItem.job_id)
        .where(claimable, IngestionJob.cancel_requested.is_(False), IngestionJob.state.in_(ACTIVE_JOB_STATES))
    )
    if exclude_kinds:  # jobs other workers run (facets)
        open_items = open_items.where(IngestionJob.kind.not_in(list(exclude_kinds)))
    if kinds:  # URL items, claimed by the fetch-ahead (indexer/jobs/fetchahead.py)
        open_items = open_items.where(IngestionJob.kind.in_(list(kinds)))
    if job_id is not None:
        jobs = [job_id]
    else:  # the oldest jobs with work, each in turn: one slow or huge job cannot hold the others back
        jobs = list(session.scalars(
            select(JobItem.job_id).where(JobItem.id.in_(open_items)).group_by(JobItem.job_id)
            .order_by(func.min(JobItem.id)).limit(limit)))
    per_job = []
    for jid in jobs:
        pick = open_items.where(JobItem.job_id == jid).order_by(JobItem.seq).limit(limit)
        if session.get_bind().dialect.name == "postgresql":
            pick = pick.with_for_update(skip_locked=True, of=JobItem)
        per_job.append(list(session.scalars(pick)))
    ids = [ids[k] for k in range(limit) for ids in per_job if k < len(ids)][:limit]  # round-robin over jobs
    if not ids:
        return []
    # The WHERE re-checks claimability: correct even if the caller's transaction was not exclusive.
    claimed = session.scalars(
        update(JobItem)
        .where(JobItem.id.in_(ids), claimable)
        .values(
            state=ItemState.CLAIMED.value,
            claimed_by=worker_id,
            claimed_at=now,
            attempts=JobItem.attempts + 1,
        )
        .returning(JobItem)
        .execution_options(populate_existing=True)
    ).all()
    rank = {item_id: k for k, item_id in enumerate(ids)}  # keep the FIFO order of the pick
    records = sorted((ItemRecord.of(r) for r in claimed), key=lambda r: rank[r.id])
    for jid in sorted({r.job_id for r in records}):
        session.execute(
            update(IngestionJob)
            .where(IngestionJob.id == jid, IngestionJob.state.in_(ACTIVE_JOB_STATES))
            .values(
                state=JobState.RUNNING.value,
                started_at=func.coalesce(IngestionJob.started_at, now),
                heartbeat_at=now,
                worker_id=worker_id,
            )
        )
    return records


def complete_item(
    session: Session,
    item_id: int,
    worker_id: str,
    outcome: ItemState,
    *,
    error: str | None = None,
    image_id: int | None = None,
    blob_sha256: str | None = None,
) -> JobRecord:
    """Record an item's outcome (done, failed or skipped) and the job's counters in one step.

    Raises :class:`Conflict` if this worker no longer holds the claim (it went stale and was taken over,
    or the job was failed); roll back then: the new holder does the work.
    """
    outcome = ItemState(outcome)
    if outcome not in _COUNTERS:
        raise InvalidInput("outcome must be done, failed or skipped", outcome=outcome.value)
    now = utcnow()
    values: dict[str, Any] = {"state": outcome.value, "finished_at": now, "error": error}
    if image_id is not None:
        values["image_id"] = image_id
    if blob_sha256 is not None:
        values["blob_sha256"] = blob_sha256
    job_id = session.execute(
        update(JobItem)
        .where(
            JobItem.id == item_id,
            JobItem.state == ItemState.CLAIMED.value,
            JobItem.claimed_by == worker_id,
        )
        .values(**values)
        .returning(JobItem.job_id)
    ).scalar_one_or_none()
    if job_id is None:
        row = session.get(JobItem, item_id, populate_existing=True)
        if row is None:
            raise NotFound("job item not found", item_id=item_id)
        raise Conflict(
            "this worker no longer holds the item's claim",
            item_id=item_id,
            state=row.state,
            claimed_by=row.claimed_by,
        )
    column = getattr(IngestionJob, _COUNTERS[outcome])
    session.execute(
        update(IngestionJob)
        .where(IngestionJob.id == job_id)
        .values({_COUNTERS[outcome]: column + 1, "heartbeat_at": now})
    )
    finish_if_done(session, job_id, now)
    return get_job(session, job_id)


def heartbeat(session: Session, worker_id: str, item_ids: Sequence[int]) -> list[int]:
    """Refresh this worker's claims; returns the ids it still holds (a missing one was taken over)."""
    if not item_ids:
        return []
    now = utcnow()
    held = list(
        session.scalars(
            update(JobItem)
            .where(
                JobItem.id.in_(list(item_ids)),
                JobItem.state == ItemState.CLAIMED.value,
                JobItem.claimed_by == worker_id,
            )
            .values(claimed_at=now)
            .returning(JobItem.id)
        )
    )
    session.execute(
        update(IngestionJob)
        .where(IngestionJob.id.in_(select(JobItem.job_id).where(JobItem.id.in_(held))))
        .values(heartbeat_at=now)
    )
    return sorted(held)


def release_items(session: Session, worker_id: str, item_ids: Sequence[int], *, unattempted: bool = False) -> int:
    """Hand claimed items back (graceful shutdown) so another worker takes them at once; ``unattempted``: the
    claim did not try them (a batch cut to its pixel bound), so it does not count as one of their attempts.

    An item of a job with a cancel request is cancelled instead of going back to ``pending``: claims never
    hand those out, so a pending one would keep its job open forever. Returns the items handed back.
    """
    if not item_ids:
        return 0
    released = session.execute(
        update(JobItem)
        .where(
            JobItem.id.in_(list(item_ids)),
            JobItem.state == ItemState.CLAIMED.value,
            JobItem.claimed_by == worker_id,
        )
        .values(state=ItemState.PENDING.value, claimed_by=None, claimed_at=None,
                **({"attempts": JobItem.attempts - 1} if unattempted else {}))
        .returning(JobItem.job_id)
    ).scalars().all()
    now = utcnow()
    for jid in sorted(set(released)):  # lock order: items (above), then the job
        with contextlib.suppress(NotFound):
            if _job_row(session, jid, lock=True).cancel_requested:
                _cancel_pending(session, jid, now)
    return len(released)


def _cancel_pending(session: Session, job_id: str, now: datetime) -> None:
    session.execute(
        update(JobItem)
        .where(JobItem.job_id == job_id, JobItem.state == ItemState.PENDING.value)
        .values(state=ItemState.CANCELLED.value, finished_at=now)
    )
    finish_if_done(session, job_id, now)


def _settle_cancelled(session: Session, job_id: str | None) -> None:
    """Cancel pending items that a cancel request missed (a release racing it); finishes their jobs.

    ``request_cancel`` cancels the items that are pending when it runs; on PostgreSQL a release committed
    just after can still put an item back to ``pending``. No claim hands such an item out, so without this
    its job would never finish.
    """
    stmt = (
        select(JobItem.job_id)
        .join(IngestionJob, IngestionJob.id == JobItem.job_id)
        .where(
            JobItem.state == ItemState.PENDING.value,
            IngestionJob.cancel_requested.is_(True),
            IngestionJob.state.in_(ACTIVE_JOB_STATES),
        )
        .distinct()
    )
    if job_id is not None:
        stmt = stmt.where(JobItem.job_id == job_id)
    now = utcnow()
    for jid in sorted(session.scalars(stmt).all()):
        _cancel_pending(session, jid, now)


def release_claims_of(session: Session, worker_id: str, *, unattempted: bool = False) -> int:
    """Hand back every item ``worker_id`` holds (see :func:`release_items`)."""
    held = session.execute(select(JobItem.id).where(JobItem.state == ItemState.CLAIMED.value,
                                                    JobItem.claimed_by == worker_id)).scalars().all()
    return release_items(session, worker_id, list(held), unattempted=unattempted)
