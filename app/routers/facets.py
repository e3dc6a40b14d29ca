"""Attribute facets per set: the schema, the job that computes them from cached packages, and their counts."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from rubricsearch.app.deps import JSON_BODY, AdminAccess, SearchAccess, SetPath, StateDep
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.schemas.facets import FacetCounts, FacetSchemaIn, FacetSchemaOut
from rubricsearch.app.schemas.jobs import JobOut
from rubricsearch.app.services import FACET_MIN_CONFIDENCE
from rubricsearch.app.sets import find_set
from rubricsearch.app.views import job_out
from rubricsearch.indexer.catalog.facets import FacetSchema, count_facets, get_schema, put_schema, stale_images

router = APIRouter(prefix="/v1", tags=["facets"])


def _out(schema: FacetSchema, stale: int) -> FacetSchemaOut:
    return FacetSchemaOut(version=schema.version, attributes=schema.to_json()["attributes"], stale=stale)


@router.get("/sets/{set_id}/facets/schema", summary="The set's attribute schema",
            responses=error_responses(401, 404, 422))
def get_facet_schema(set_id: SetPath, state: StateDep, _: SearchAccess) -> FacetSchemaOut:
    record = find_set(state, set_id)
    with state.catalog.read() as session:
        return _out(get_schema(session, record.id), len(stale_images(session, record.id)))


@router.put("/sets/{set_id}/facets/schema", summary="Replace the set's attribute schema",
            description="Attributes with their allowed values (at most 32 x 32). Only the attributes whose "
                        "definition changed are recomputed by the next facet job (POST .../facets/jobs).",
            dependencies=[JSON_BODY], responses=error_responses(401, 403, 404, 415, 422))
def put_facet_schema(set_id: SetPath, body: Annotated[FacetSchemaIn, Body()], state: StateDep,
                     _: AdminAccess) -> FacetSchemaOut:
    record = find_set(state, set_id)
    with state.catalog.write() as session:
        schema = put_schema(session, record.id, body.model_dump(exclude_none=True))
        return _out(schema, len(stale_images(session, record.id)))


@router.post("/sets/{set_id}/facets/jobs", summary="Compute the facets that are out of date",
             description="A job over the set's references whose facets are out of date with its schema, from "
                         "their cached visual packages (no vision encode); a facet job already in flight for "
                         "the set is resumed instead. Follow it at `/v1/jobs/{id}`.",
             status_code=202, responses=error_responses(401, 403, 404, 422, 503))
def start_facet_job(set_id: SetPath, state: StateDep, _: AdminAccess) -> JobOut:
    record = find_set(state, set_id)
    return job_out(state.ingestion, state.facets.start_in_background(record.id))


@router.get("/sets/{set_id}/facets/counts", summary="References per computed facet value",
            responses=error_responses(401, 404, 422))
def facet_counts(set_id: SetPath, state: StateDep, _: SearchAccess,
                 min_confidence: Annotated[float | None, Query(ge=0, le=1, description="Count a reference for its "
                                                                "chosen value at this probability or more (default: "
                                                                "0.5, the more likely value)")] = None,
                 ) -> FacetCounts:
    record = find_set(state, set_id)
    if min_confidence is None:
        min_confidence = FACET_MIN_CONFIDENCE
    with state.catalog.read() as session:
        images, counts = count_facets(session, record.id, min_confidence)
        version = get_schema(session, record.id).version
    return FacetCounts(images=images, min_confidence=min_confidence, schema_version=version, attributes=counts)
