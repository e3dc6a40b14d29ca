"""The one catalog transaction of a batch: image rows, package records and item outcomes commit together.

:func:`commit_batch` does it in a handful of statements for the whole batch (claims checked in one query,
images inserted in one multi-row INSERT, outcomes written with one executemany per shape, job counters once
per job) and leaves the rows that ingesting the items one at a time would leave
(``tests/test_ingest_pipeline_perf.py`` states those rows for a batch holding every outcome). A failure
rolls the whole transaction back; the runner then releases the batch's claims, so it is retried.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import bindparam, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog import (
    ImageRecord,
    ImageSource,
    ImageStatus,
    ItemRecord,
    ItemState,
    JobRecord,
    finish_if_done,
    get_job,
    mark_images_indexed,
    release_items,
)
from rubricsearch.indexer.catalog.tables import Image, IngestionJob, JobItem, PackageRecord, ReferenceSet, utcnow
from rubricsearch.indexer.jobs.backfill import BACKFILL
from rubricsearch.retrieval.images import DecodedImage, EncodedImage

log = logging.getLogger(__name__)
_ROWS = 50  # rows per multi-row INSERT (SQLite's bound-parameter limit)
_COUNTERS = {ItemState.DONE: "done", ItemState.FAILED: "failed", ItemState.SKIPPED: "skipped"}


@dataclass(eq=False)
class Unit:
    """One claimed item on its way through the stages."""

    item: ItemRecord
    job: JobRecord
    dim: int
    decoded: EncodedImage | DecodedImage | None = None  # bytes, header and sha256; pixels decoded lazily
    error: str | None = None
    skip: tuple[str, int] | None = None  # (reason, image id) of a duplicate already in the set
    primary: Unit | None = None  # an earlier item of this batch with the same image
    existing: ImageRecord | None = None  # a row of this image that is not indexed yet
    packages: dict[str, int] | None = None  # fingerprint digest -> stored bytes, one per vision tower
    vector: np.ndarray | None = None
    embedded_by: str | None = None  # the embedder version the vector came from (versions.BASE: the base)
    image_id: int | None = None
    lost: bool = False  # the claim is no longer ours (job failed/deleted, or taken over)

    @property
    def working(self) -> bool:
        """Still to be indexed by this item itself (not failed, skipped, a duplicate or lost)."""
        return not (self.error or self.skip or self.primary or self.lost)

    @property
    def backfill(self) -> bool:
        """An already-indexed image that only needs packages of a new tower."""
        return self.job.kind == BACKFILL

    @property
    def sha(self) -> str:
        assert self.decoded is not None
        return self.decoded.sha256

    @property
    def payload(self) -> dict[str, Any]:
        """The image's metadata once committed: the item's for a new image; an existing row keeps its own."""
        return self.existing.meta if self.existing is not None else self.item.meta or {}


@dataclass
class BatchResult:
    done: int = 0
    failed: int = 0
    skipped: int = 0
    lost: int = 0
    jobs: dict[str, JobRecord] = field(default_factory=dict)

    @property
    def finished(self) -> list[JobRecord]:
        return [j for j in self.jobs.values() if j.finished]


def detail(job: JobRecord, ref: str) -> str:
    """Where the image came from, for provenance (the archive or folder, and the entry)."""
    match job.kind:
        case "zip":
            return f"{job.options.get('archive_name', 'archive.zip')}!{ref}"
        case "folder":
            return f"{str(job.options.get('path', '')).rstrip('/')}/{ref}"
        case "url":
            return ref
        case _:
            return f"upload:{ref}"


def _count(result: BatchResult, outcome: ItemState) -> None:
    setattr(result, _COUNTERS[outcome], getattr(result, _COUNTERS[outcome]) + 1)


def commit_batch(s: Session, units: Sequence[Unit], worker: str) -> BatchResult:
    """Record every unit's outcome (call inside ``catalog.write()``): an item whose claim, set or job is gone
    meanwhile is lost (not recorded); a repeat of a lost item is released for its first copy's new holder."""
    pg = s.get_bind().dialect.name == "postgresql"
    now = utcnow()
    result = BatchResult()
    ids = [u.item.id for u in units if not u.lost]
    held_q = select(JobItem.id).where(JobItem.id.in_(ids), JobItem.state == ItemState.CLAIMED.value,
                                      JobItem.claimed_by == worker)
    held = set(s.scalars(held_q.with_for_update() if pg else held_q)) if ids else set()
    set_ids = {u.job.set_id for u in units if not u.lost and u.primary is None and u.working and not u.backfill}
    sets = set(s.scalars(select(ReferenceSet.id).where(ReferenceSet.id.in_(set_ids)))) if set_ids else set()
    for u in units:
        if not u.lost and (u.item.id not in held or (u.working and not u.backfill and u.job.set_id not in sets)):
            log.info("item %s not recorded: its claim or set is gone", u.item.id)
            u.lost = True
    rows = _insert_images(s, [u for u in units if u.working and not u.backfill], now, pg)
    updates: list[dict[str, Any]] = []
    to_mark: list[int] = []
    packages: dict[tuple[str, str], int] = {}  # (sha256, fingerprint digest) -> bytes
    release: list[int] = []
    for u in units:
        if u.lost or (u.primary is not None and u.primary.lost):
            if not u.lost:
                release.append(u.item.id)
            result.lost += 1
            continue
        values: dict[str, Any] = {"_id": u.item.id}
        if u.error is not None:
            values.update(state=ItemState.FAILED, error=u.error)
        elif u.skip is not None:
            values.update(state=ItemState.SKIPPED, error=u.skip[0], image_id=u.skip[1], blob_sha256=u.sha)
            u.image_id = u.skip[1]
        elif u.primary is not None:
            p = u.primary
            if p.error is not None:
                values.update(state=ItemState.FAILED, error=p.error)
            else:
                values.update(state=ItemState.SKIPPED, error=f"duplicate of {p.item.source_ref}",
                              image_id=p.image_id, blob_sha256=u.sha)
                u.image_id = p.image_id
        elif u.backfill:
            assert u.packages is not None
            packages.update({(u.sha, digest): n for digest, n in u.packages.items()})
            values.update(state=ItemState.DONE, error=None, blob_sha256=u.sha)
        else:
            assert u.packages is not None
            row, created = rows[(u.job.set_id, u.sha)]
            u.image_id = row.id
            if not created and row.status == ImageStatus.INDEXED and u.existing is None:
                values.update(state=ItemState.SKIPPED, error=f"duplicate of {row.original_name or u.sha[:12]}",
                              image_id=row.id, blob_sha256=u.sha)
            else:
                if not created:
                    to_mark.append(row.id)
                packages.update({(u.sha, digest): n for digest, n in u.packages.items()})
                values.update(state=ItemState.DONE, error=None, image_id=row.id, blob_sha256=u.sha)
        values.setdefault("error", None)
        updates.append(values)
    if to_mark:
        mark_images_indexed(s, to_mark, at=now)
    _record_packages(s, packages, now, pg)
    _write_outcomes(s, updates, now)
    per_job: dict[str, Counter[str]] = {}
    job_of = {u.item.id: u.job.id for u in units}
    for values in updates:
        per_job.setdefault(job_of[values["_id"]], Counter())[_COUNTERS[values["state"]]] += 1
        _count(result, values["state"])
    for job_id in sorted(per_job):  # lock order: items (above), then jobs
        counts = per_job[job_id]
        s.execute(update(IngestionJob).where(IngestionJob.id == job_id).values(
            {**{c: getattr(IngestionJob, c) + n for c, n in counts.items()}, "heartbeat_at": now}))
        finish_if_done(s, job_id, now)
        result.jobs[job_id] = get_job(s, job_id)
    if release:
        release_items(s, worker, release)
    return result


def _insert(s: Session, model: Any, pg: bool) -> Any:
    return postgresql.insert(model) if pg else sqlite.insert(model)


def _insert_images(s: Session, units: list[Unit], now: Any, pg: bool) -> dict[tuple[str, str], tuple[Image, bool]]:
    """INSERT ... ON CONFLICT DO NOTHING for every working unit; the rows by (set, sha) and whether new."""
    rows: dict[tuple[str, str], tuple[Image, bool]] = {}
    created: set[int] = set()
    values = []
    for u in units:
        assert u.decoded is not None
        values.append({
            "set_id": u.job.set_id, "sha256": u.sha, "byte_size": len(u.decoded.data),
            "source": ImageSource(u.job.kind).value, "original_name": u.item.source_ref[:1024],
            "source_detail": detail(u.job, u.item.source_ref), "width": u.decoded.width,
            "height": u.decoded.height, "status": ImageStatus.INDEXED.value, "created_at": now, "indexed_at": now,
            "meta": u.item.meta or {},
        })
    for start in range(0, len(values), _ROWS):
        stmt = _insert(s, Image, pg).values(values[start:start + _ROWS])
        created.update(s.scalars(stmt.on_conflict_do_nothing(index_elements=["set_id", "sha256"]).returning(Image.id)))
    by_set: dict[str, list[str]] = {}
    for u in units:
        by_set.setdefault(u.job.set_id, []).append(u.sha)
    for set_id, shas in by_set.items():
        for start in range(0, len(shas), 500):
            query = select(Image).where(Image.set_id == set_id, Image.sha256.in_(shas[start:start + 500]))
            for row in s.scalars(query.execution_options(populate_existing=True)):
                rows[(set_id, row.sha256)] = (row, row.id in created)
    return rows


def _record_packages(s: Session, packages: dict[tuple[str, str], int], now: Any, pg: bool) -> None:
    values = [{"sha256": sha, "fingerprint": digest, "byte_size": n, "created_at": now}
              for (sha, digest), n in packages.items()]
    for start in range(0, len(values), _ROWS):
        stmt = _insert(s, PackageRecord, pg).values(values[start:start + _ROWS])
        s.execute(stmt.on_conflict_do_nothing(index_elements=["sha256", "fingerprint"]))


def _write_outcomes(s: Session, updates: list[dict[str, Any]], now: Any) -> None:
    """One executemany per set of columns (failed items leave image and blob untouched)."""
    table: Any = JobItem.__table__
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for values in updates:
        groups.setdefault(tuple(sorted(values)), []).append(
            {**values, "state": ItemState(values["state"]).value})
    for keys, params in groups.items():
        columns: dict[str, Any] = {k: bindparam(f"v_{k}") for k in keys if k != "_id"}
        stmt = update(table).where(table.c.id == bindparam("v__id")).values(finished_at=now, **columns)
        s.connection().execute(stmt, [{f"v_{k}": v for k, v in p.items()} for p in params])
