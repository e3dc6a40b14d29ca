"""Judgments of a set: record (one or many), list or export (JSON, JSONL), import JSONL, delete, derive from
metadata.

Recording, importing, deriving and deleting are changes a team makes to its data, so they take an admin key (or
the web UI's admin session with its CSRF token), as every other mutation does; listing and exporting take what
searching takes. Every write is one transaction: a 200 means all of it is committed, an error that none of it is;
once committed, it schedules the set's refit in the background (:mod:`app.refits`).
"""

from __future__ import annotations

import email.message
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Body, Path, Query, Request
from fastapi.responses import StreamingResponse

from rubricsearch.app.deps import JSON_BODY, AdminAccess, SearchAccess, SetPath, StoresDep
from rubricsearch.app.errors import DB_INT_MAX
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.judgments import author_of, jsonl, outs, parse_jsonl, specs_for
from rubricsearch.app.refits import changed
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.schemas.judgments import (
    DeletedOut,
    DeriveBody,
    DerivedOut,
    DeriveOut,
    ImportOut,
    JudgmentIn,
    JudgmentList,
    JudgmentOut,
    Source,
    StatementOut,
)
from rubricsearch.app.sets import find_set, find_set_image
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import (
    JudgmentFilter,
    JudgmentSource,
    delete_judgment,
    delete_judgments,
    get_images,
    list_judgments,
    page_judgments,
    record_judgments,
)
from rubricsearch.indexer.catalog.judgment_rules import derive, record_derivation
from rubricsearch.indexer.catalog.judgments import MAX_BATCH, MAX_PAGE
from rubricsearch.retrieval.errors import InvalidInput, UnsupportedMedia

router = APIRouter(prefix="/v1", tags=["judgments"], route_class=BoundedJsonRoute)
NDJSON = "application/x-ndjson"
PREVIEW = 50

ImageQuery = Annotated[str | None, Query(max_length=64, description="Only this reference (catalog id or sha256).")]
CriterionQuery = Annotated[str | None, Query(max_length=1000, description="Only this criterion.")]
SourceQuery = Annotated[Source | None, Query(description="Only judgments from this source.")]


def _filter(state: AppState, set_id: str, image: str | None, criterion: str | None, source: str | None,
            until_id: int | None = None) -> JudgmentFilter:
    image_id = None if image is None else find_set_image(state, set_id, image).id
    return JudgmentFilter(image_id=image_id, criterion=criterion,
                          source=None if source is None else JudgmentSource(source), until_id=until_id)


@router.post("/sets/{set_id}/judgments", summary=f"Record judgments (one, or a list of at most {MAX_BATCH:,})",
             dependencies=[JSON_BODY], responses=error_responses(400, 401, 403, 404, 409, 413, 415, 422))
def post_judgments(set_id: SetPath, body: Annotated[JudgmentIn | list[JudgmentIn], Body()], state: StoresDep,
                   principal: AdminAccess) -> JudgmentList:
    """Each judgment replaces its cell's (reference, criterion) earlier one. A list is all or nothing: an unknown
    reference, a bad criterion or too many items (over the limit in the summary: 413) records none of it."""
    items = body if isinstance(body, list) else [body]
    record = find_set(state, set_id)
    with state.catalog.write() as session:
        specs = specs_for(session, record.id, items, author_of(principal, None))
        written = outs(session, record_judgments(session, record.id, specs))
    changed(state.refits, record.id)
    return JudgmentList(data=written, total=len(written))


def _wants_jsonl(request: Request, format: str | None) -> bool:
    if format is not None:
        return format == "jsonl"
    return NDJSON in request.headers.get("accept", "")


@router.get("/sets/{set_id}/judgments", summary="A set's judgments (JSON pages, or all as JSONL)",
            response_model=JudgmentList,
            responses={200: {"content": {NDJSON: {}}, "description": "JSON, or with `format=jsonl` (or `Accept: "
                             f"{NDJSON}`) every matching judgment, one JSON object a line"},
                       **error_responses(401, 404, 422)})
def get_judgments(set_id: SetPath, request: Request, state: StoresDep, _: SearchAccess,
                  image: ImageQuery = None, criterion: CriterionQuery = None, source: SourceQuery = None,
                  until_id: Annotated[int | None, Query(ge=0, le=DB_INT_MAX, description="Only judgments with "
                                                        "id <= this: what a calibration fitted up to it saw.")] = None,
                  limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
                  after: Annotated[int | None, Query(ge=0, le=DB_INT_MAX, description="`next_after` of the "
                                                     "previous page")] = None,
                  format: Annotated[Literal["json", "jsonl"] | None, Query()] = None) -> Any:
    record = find_set(state, set_id)
    where = _filter(state, record.id, image, criterion, source, until_id)
    if _wants_jsonl(request, format):
        with state.catalog.read() as session:
            every = outs(session, list_judgments(session, record.id, where))
        return StreamingResponse(jsonl(every), media_type=NDJSON, headers={
            "Content-Disposition": f'attachment; filename="{record.id}-judgments.jsonl"'})
    with state.catalog.read() as session:
        page = page_judgments(session, record.id, where, limit=limit, after_id=after)
        data = outs(session, page.items)
    return JudgmentList(data=data, total=page.total, next_after=page.next_after)


def _require_ndjson(request: Request) -> None:
    message = email.message.Message()
    message["content-type"] = request.headers.get("content-type", "")
    if message.get_content_type() not in (NDJSON, "application/jsonl"):
        raise UnsupportedMedia(f"send the judgments as JSONL (Content-Type: {NDJSON})",
                               content_type=message.get_content_type())


@router.post("/sets/{set_id}/judgments/import", summary="Record judgments from JSONL (an export's lines)",
             openapi_extra={"requestBody": {"required": True, "content": {NDJSON: {"schema": {"type": "string"}}}}},
             responses=error_responses(401, 403, 404, 409, 413, 415, 422))
async def import_judgments(set_id: SetPath, request: Request, state: StoresDep,
                           principal: AdminAccess) -> ImportOut:
    """One judgment a line, as the JSONL export writes them; the reference is found by `sha256`, so an export
    moves between catalogs. All or nothing; a larger file than the limit a request takes (413 says it) is sent in
    parts."""
    _require_ndjson(request)
    lines = await anyio.to_thread.run_sync(parse_jsonl, await request.body())

    def record() -> ImportOut:
        found = find_set(state, set_id)
        with state.catalog.write() as session:
            specs = specs_for(session, found.id, lines, author_of(principal, None))
            written = outs(session, record_judgments(session, found.id, specs))
        changed(state.refits, found.id)
        return ImportOut(lines=len(lines), data=written)

    return await anyio.to_thread.run_sync(record)


@router.delete("/sets/{set_id}/judgments/{judgment_id}", summary="Delete one judgment (undo)",
               responses=error_responses(401, 403, 404, 422))
def delete_one(set_id: SetPath, judgment_id: Annotated[int, Path(ge=1, le=DB_INT_MAX)], state: StoresDep,
               _: AdminAccess) -> JudgmentOut:
    """Returns the deleted judgment, so a client can record it again (redo)."""
    record = find_set(state, set_id)
    with state.catalog.write() as session:
        gone = delete_judgment(session, record.id, judgment_id)
        sha = get_images(session, [gone.image_id])[gone.image_id].sha256
    changed(state.refits, record.id)
    return JudgmentOut(id=gone.id, image_id=gone.image_id, sha256=sha, criterion=gone.criterion, holds=gone.holds,
                       source=gone.source.value, author=gone.author, created_at=gone.created_at)


@router.delete("/sets/{set_id}/judgments", summary="Delete the judgments a filter selects",
               responses=error_responses(400, 401, 403, 404, 422))
def delete_many(set_id: SetPath, state: StoresDep, _: AdminAccess, image: ImageQuery = None,
                criterion: CriterionQuery = None, source: SourceQuery = None,
                all: Annotated[bool, Query(description="Delete every judgment of the set (no filter needed).")] = False,
                ) -> DeletedOut:
    if not all and image is None and criterion is None and source is None:
        raise InvalidInput("name what to delete (`image`, `criterion`, `source`) or pass `all=true`")
    record = find_set(state, set_id)
    where = _filter(state, record.id, image, criterion, source)
    with state.catalog.write() as session:
        deleted = delete_judgments(session, record.id, where)
    changed(state.refits, record.id)
    return DeletedOut(deleted=deleted)


@router.post("/sets/{set_id}/judgments/derive", summary="Derive judgments from a metadata field",
             dependencies=[JSON_BODY], responses=error_responses(400, 401, 403, 404, 409, 413, 415, 422))
def derive_judgments(set_id: SetPath, body: Annotated[DeriveBody, Body()], state: StoresDep,
                     principal: AdminAccess) -> DeriveOut:
    """Each image holding the field gets, per value, a judgment of that value's statement: it holds for the
    image's own value and not for the others. `dry_run` shows the statements and what would be recorded."""
    record = find_set(state, set_id)
    with state.catalog.read() if body.dry_run else state.catalog.write() as session:
        found = derive(session, record.id, body.key, statements=body.statements,
                       author=author_of(principal, body.author), overwrite=body.overwrite)
        if not body.dry_run:
            record_derivation(session, record.id, found)
        shown = found.judgments[:PREVIEW]
        shas = get_images(session, [j.image_id for j in shown])
    if not body.dry_run:
        changed(state.refits, record.id)
    return DeriveOut(key=found.key, images=found.images, skipped_images=found.skipped_images, kept=found.kept,
                     statements=[StatementOut(value=s.value, statement=s.statement, yes=s.yes, no=s.no)
                                 for s in found.statements],
                     judgments=len(found.judgments), recorded=not body.dry_run,
                     preview=[DerivedOut(image_id=j.image_id, sha256=shas[j.image_id].sha256, criterion=j.criterion,
                                         holds=j.holds) for j in shown])

