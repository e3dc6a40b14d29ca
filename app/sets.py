"""Reference sets as the API and the CLI see them: lookup by id or name, the API view with its counts, the
dimension check of a new set, and deletion everywhere (catalog, vectors, blobs, packages, thumbnails)."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from rubricsearch.app.errors import DB_INT_MAX
from rubricsearch.app.schemas.sets import SetCounts, SetOut
from rubricsearch.app.state import AppState
from rubricsearch.app.thumbnails import drop_all_orphans
from rubricsearch.app.training_jobs import VERSIONS_DIR
from rubricsearch.indexer.catalog import (
    ImageRecord,
    ImageStatus,
    SetRecord,
    count_images,
    find_image,
    get_image,
    list_images,
    list_jobs,
    resolve_set,
)
from rubricsearch.indexer.catalog.facets import FACETS
from rubricsearch.indexer.jobs.backfill import BACKFILL
from rubricsearch.retrieval.errors import InvalidInput, NotFound

_ALL_JOBS = 100_000


def find_set(state: AppState, id_or_name: str) -> SetRecord:
    """A set by id or name (NotFound otherwise)."""
    with state.catalog.read() as session:
        return resolve_set(session, id_or_name)


def set_dimensions(state: AppState, record: SetRecord) -> int | None:
    if record.embedding_dim:
        return record.embedding_dim
    if state.index.has_set(record.id):
        return state.index.dim(record.id)
    return state.embedder_.dimension if state.embedder_ is not None else None


def set_out(state: AppState, record: SetRecord) -> SetOut:
    """The API view of a set, with its image and job counts."""
    with state.catalog.read() as session:
        images = count_images(session, record.id)
        jobs = list_jobs(session, set_id=record.id, limit=_ALL_JOBS)
    waiting = sum(j.total - j.processed for j in jobs if not j.finished)
    # A file that cannot be read or decoded never becomes an image: it is a failed item of its job, and
    # counts here too, so the table agrees with the job (facet and package-backfill items are not uploads).
    rejected = sum(j.failed for j in jobs if j.kind not in (FACETS, BACKFILL))
    counts = SetCounts(indexed=images[ImageStatus.INDEXED], pending=images[ImageStatus.PENDING] + waiting,
                       failed=images[ImageStatus.FAILED] + rejected)
    return SetOut(id=record.id, name=record.name, description=record.description,
                  dimensions=set_dimensions(state, record), counts=counts, created_at=record.created_at)


def check_dimensions(state: AppState, requested: int | None) -> int | None:
    """The requested Matryoshka size within 64..H; the model's H when none is."""
    full = state.embedder_.dimension if state.embedder_ is not None else None
    dims = requested or full
    if dims is None:
        return None
    low = min(64, full) if full is not None else 64
    if dims < low or (full is not None and dims > full):
        raise InvalidInput(f"dimensions must be from {low} to {full or 'the model hidden size'}, got {dims}",
                           dimensions=dims, min=low, max=full)
    return dims


def all_shas(state: AppState, set_id: str) -> list[str]:
    shas: list[str] = []
    after: int | None = None
    with state.catalog.read() as session:
        while True:
            page = list_images(session, set_id, limit=1000, after_id=after)
            shas += [r.sha256 for r in page.items]
            if page.next_after is None:
                return shas
            after = page.next_after


def delete_set_everywhere(state: AppState, record: SetRecord, *, settle_s: float = 10.0) -> None:
    """Stop its jobs, then remove catalog rows, vectors, unshared blobs, packages, thumbnails and the model
    versions trained for it.

    A batch already being processed finishes first (up to ``settle_s``): deleting under it would let its
    vectors and blobs land after the set is gone (the start-up sweep would remove them, but later)."""
    service = state.ingestion
    active = [j.id for j in service.list_jobs(set_id=record.id, limit=_ALL_JOBS) if not j.finished]
    for job_id in active:
        service.cancel(job_id)
    deadline = time.monotonic() + settle_s
    while active and time.monotonic() < deadline:
        active = [j for j in active if not service.get_job(j).finished]
        if active:
            time.sleep(0.05)
    shas = all_shas(state, record.id)
    service.delete_set(record.id)
    drop_all_orphans(state, shas)
    shutil.rmtree(Path(state.settings.data_dir) / VERSIONS_DIR / record.id, ignore_errors=True)


def find_set_image(state: AppState, set_id: str, image_id: str) -> ImageRecord:
    """An image of the set by catalog id or sha256."""
    with state.catalog.read() as session:
        if image_id.isdigit() and int(image_id) <= DB_INT_MAX:
            return get_image(session, int(image_id), set_id=set_id)
        if re.fullmatch(r"[0-9a-fA-F]{64}", image_id):
            found = find_image(session, set_id, image_id.lower())
            if found is not None:
                return found
    raise NotFound("image not found in this set", image_id=image_id[:80], set_id=set_id)
