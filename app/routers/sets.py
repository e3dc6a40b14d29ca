"""Reference sets: create, list, read (by id or name), delete with everything that belongs to them.

None of them needs a model, so they are served while the models are prepared (:mod:`app.warmup`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Response

from rubricsearch.app.deps import JSON_BODY, AdminAccess, SearchAccess, SetPath, StoresDep
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.schemas.sets import SetCreate, SetList, SetOut
from rubricsearch.app.sets import check_dimensions, delete_set_everywhere, find_set, set_out
from rubricsearch.indexer.catalog import list_sets

router = APIRouter(prefix="/v1", tags=["sets"], route_class=BoundedJsonRoute)


@router.post("/sets", status_code=201, summary="Create a reference set",
             dependencies=[JSON_BODY], responses=error_responses(400, 401, 403, 409, 415, 422))
def create_set(body: Annotated[SetCreate, Body()], state: StoresDep, _: AdminAccess) -> SetOut:
    dims = check_dimensions(state, body.dimensions)
    record = state.ingestion.create_set(body.name, description=body.description, embedding_dim=dims)
    return set_out(state, record)


@router.get("/sets", summary="List reference sets", responses=error_responses(401, 429))
def get_sets(state: StoresDep, _: SearchAccess) -> SetList:
    with state.catalog.read() as session:
        records = list_sets(session)
    return SetList(data=[set_out(state, r) for r in records])


@router.get("/sets/{set_id}", summary="A reference set (by id or name)",
            responses=error_responses(401, 404, 422, 429))
def get_set(set_id: SetPath, state: StoresDep, _: SearchAccess) -> SetOut:
    return set_out(state, find_set(state, set_id))


@router.delete("/sets/{set_id}", status_code=204, response_class=Response,
               summary="Delete a set: its images, jobs, vectors, and blobs no other set uses",
               responses=error_responses(401, 403, 404, 422))
def delete_set(set_id: SetPath, state: StoresDep, _: AdminAccess) -> Response:
    record = find_set(state, set_id)
    state.ingestion.reserve.freeing(lambda: delete_set_everywhere(state, record))
    return Response(status_code=204)
