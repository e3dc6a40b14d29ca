"""Reference sets: create, list, read (by id or name), delete with everything that belongs to them."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Body, Path, Response

from app.deps import JSON_BODY, AdminAccess, SearchAccess, StateDep
from app.jsonbody import BoundedJsonRoute
from app.schemas.common import error_responses
from app.schemas.sets import SetCounts, SetCreate, SetList, SetOut
from app.state import AppState
from app.thumbnails import drop_all_orphans
from indexer.catalog import ImageStatus, SetRecord, count_images, list_images, list_jobs, list_sets, resolve_set
from retrieval.errors import InvalidInput

router = APIRouter(prefix="/v1", tags=["sets"], route_class=BoundedJsonRoute)

SetPath = Annotated[str, Path(description="The set's id or its name.", max_length=200)]
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
    counts = SetCounts(indexed=images[ImageStatus.INDEXED], pending=images[ImageStatus.PENDING] + waiting,
                       failed=images[ImageStatus.FAILED])
    return SetOut(id=record.id, name=record.name, description=record.description,
                  dimensions=set_dimensions(state, record), counts=counts, created_at=record.created_at)


def check_dimensions(state: AppState, requested: int | None) -> int | None:
    """Requested (or configured default) Matryoshka size within 64..H; the model's H when neither is set."""
    full = state.embedder_.dimension if state.embedder_ is not None else None
    dims = requested or state.settings.default_dimensions or full
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
    """Stop its jobs, then remove catalog rows, vectors, unshared blobs, packages and thumbnails.

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


@router.post("/sets", status_code=201, summary="Create a reference set",
             dependencies=[JSON_BODY], responses=error_responses(400, 401, 403, 409, 415, 422))
def create_set(body: Annotated[SetCreate, Body()], state: StateDep, _: AdminAccess) -> SetOut:
    dims = check_dimensions(state, body.dimensions)
    record = state.ingestion.create_set(body.name, description=body.description, embedding_dim=dims)
    return set_out(state, record)


@router.get("/sets", summary="List reference sets", responses=error_responses(401, 429))
def get_sets(state: StateDep, _: SearchAccess) -> SetList:
    with state.catalog.read() as session:
        records = list_sets(session)
    return SetList(data=[set_out(state, r) for r in records])


@router.get("/sets/{set_id}", summary="A reference set (by id or name)",
            responses=error_responses(401, 404, 422, 429))
def get_set(set_id: SetPath, state: StateDep, _: SearchAccess) -> SetOut:
    return set_out(state, find_set(state, set_id))


@router.delete("/sets/{set_id}", status_code=204, response_class=Response,
               summary="Delete a set: its images, jobs, vectors, and blobs no other set uses",
               responses=error_responses(401, 403, 404, 422))
def delete_set(set_id: SetPath, state: StateDep, _: AdminAccess) -> Response:
    record = find_set(state, set_id)
    state.ingestion.reserve.freeing(lambda: delete_set_everywhere(state, record))
    return Response(status_code=204)
