"""Images of reference sets: uploads and imports (as ingestion jobs), listing, deletes, bytes and thumbnails."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, File, Form, Path, Query, Response, UploadFile
from fastapi.responses import FileResponse

from rubricsearch.app import http_limits
from rubricsearch.app.deps import (
    JSON_BODY,
    MULTIPART,
    AdminAccess,
    SearchAccess,
    SetPath,
    SettingsDep,
    StateDep,
    StoresDep,
)
from rubricsearch.app.errors import DB_INT_MAX
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.refits import changed
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.schemas.images import ImagePage, ImportRequest
from rubricsearch.app.schemas.jobs import JobOut
from rubricsearch.app.sets import find_set, find_set_image
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import AppState
from rubricsearch.app.thumbnails import DEFAULT_SIZE, content_type, drop_thumbnails, thumbnail
from rubricsearch.app.views import image_out, job_out
from rubricsearch.indexer.catalog import ImageStatus, list_images
from rubricsearch.indexer.jobs import IngestionService, create_job_from_files
from rubricsearch.retrieval.errors import (
    Forbidden,
    InvalidMetadata,
)

router = APIRouter(prefix="/v1", tags=["images"], route_class=BoundedJsonRoute)

Sha256Path = Annotated[str, Path(pattern=r"^[0-9a-fA-F]{64}$", description="sha256 of an ingested image")]
IMMUTABLE = "public, max-age=31536000, immutable"

UPLOAD_DESCRIPTION = """\
`multipart/form-data` with one or more `files` fields: images (JPEG, PNG, WEBP, GIF, BMP, TIFF) and/or
`.zip` archives of images. Returns the ingestion job at once (202); follow it with `GET /v1/jobs/{id}` or
the event stream `GET /v1/jobs/{id}/events`. A file that is not a valid image fails alone (see the job's
`errors`); an image already in the set is `skipped`. A `manifest.csv` / `manifest.jsonl` at a zip's root gives
its images metadata when the zip is uploaded on its own (the job's `manifest` reports it); a manifest that would
not apply (one of the files, or inside a zip sent with others) is refused (422), never dropped.

```bash
curl -H "Authorization: Bearer $ADMIN_KEY" -F files=@tabby.jpg -F files=@more-cats.zip \\
     http://localhost:8000/v1/sets/cats/images
```
"""


def _metadata_field(raw: str | None) -> dict[str, Any] | None:
    """The ``metadata`` form field: a JSON object of metadata objects keyed by uploaded file name."""
    if raw is None or not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidMetadata(f"the `metadata` field is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidMetadata("the `metadata` field is a JSON object keyed by file name")
    return value


def create_upload_job(state: AppState, set_id: str, uploads: list[UploadFile], metadata: str | None = None) -> JobOut:
    """One job for the request: an upload job, or a zip job when it is a single archive."""
    files = [(upload.filename, upload.file) for upload in uploads]
    job = create_job_from_files(state.ingestion, set_id, files, _metadata_field(metadata),
                                max_expanded_bytes=http_limits.MAX_REQUEST_BYTES)
    return job_out(state.ingestion, job)


@router.post("/sets/{set_id}/images", status_code=202, summary="Upload images and/or zip archives (a job)",
             description=UPLOAD_DESCRIPTION, responses=error_responses(400, 401, 403, 404, 413, 415, 422))
def upload_images(
    set_id: SetPath,
    state: StateDep,
    _: AdminAccess,
    files: Annotated[list[UploadFile], File(description="Image files and/or .zip archives of images.")],
    metadata: Annotated[str | None, Form(description="Metadata per image file: a JSON object keyed by file name, "
                                         "e.g. `{\"tabby.jpg\": {\"label\": \"Tabby\"}}` (a zip carries "
                                         "a manifest.csv or manifest.jsonl instead).")] = None,
    __: None = MULTIPART,
) -> JobOut:
    return create_upload_job(state, find_set(state, set_id).id, files, metadata)


def create_import_job(state: AppState, settings: Settings, set_id: str, body: ImportRequest) -> JobOut:
    service: IngestionService = state.ingestion
    if body.urls is not None:
        urls = [u if isinstance(u, str) else u.url for u in body.urls]
        given = {u.url.strip(): u.metadata for u in body.urls if not isinstance(u, str) and u.metadata}
        return job_out(service, service.create_job_from_urls(set_id, urls, given or None))
    if settings.import_root is None:
        raise Forbidden("folder imports are disabled: the operator has not set RUBRICSEARCH_IMPORT_ROOT")
    assert body.folder is not None
    return job_out(service, service.create_job_from_folder(set_id, body.folder))


@router.post("/sets/{set_id}/imports", status_code=202, summary="Import images from URLs or a server folder",
             dependencies=[JSON_BODY], responses=error_responses(400, 401, 403, 404, 413, 415, 422))
def import_images(set_id: SetPath, body: Annotated[ImportRequest, Body()], state: StateDep, settings: SettingsDep,
                  _: AdminAccess) -> JobOut:
    return create_import_job(state, settings, find_set(state, set_id).id, body)


@router.get("/sets/{set_id}/images", summary="A page of a set's images", responses=error_responses(401, 404, 422))
def get_images(
    set_id: SetPath,
    state: StoresDep,
    _: SearchAccess,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    after: Annotated[int | None, Query(ge=0, le=DB_INT_MAX, description="`next_after` of the previous page")] = None,
    status: Annotated[Literal["pending", "indexed", "failed"] | None, Query()] = None,
) -> ImagePage:
    record = find_set(state, set_id)
    with state.catalog.read() as session:
        page = list_images(session, record.id, status=ImageStatus(status) if status else None, limit=limit,
                           after_id=after)
    return ImagePage(data=[image_out(r) for r in page.items], total=page.total, next_after=page.next_after)


@router.delete("/sets/{set_id}/images/{image_id}", status_code=204, response_class=Response,
               summary="Remove an image from a set (its blob goes when no other set uses it)",
               responses=error_responses(401, 403, 404, 422))
def delete_image(
    set_id: SetPath,
    image_id: Annotated[str, Path(description="The image's id in the set, or its sha256.", max_length=64)],
    state: StateDep,
    _: AdminAccess,
) -> Response:
    record = find_set(state, set_id)
    image = find_set_image(state, record.id, image_id)
    state.ingestion.reserve.freeing(lambda: state.ingestion.delete_image(record.id, image.id))
    changed(state.refits, record.id)  # its judgments went with it
    if not state.blobs.exists(image.sha256):
        drop_thumbnails(state, image.sha256)
    return Response(status_code=204)


@router.get("/images/{sha256}", summary="The original bytes of an ingested image", response_class=FileResponse,
            responses={200: {"content": {"image/*": {}}, "description": "The image as it was ingested"},
                       **error_responses(401, 404, 422, 429)})
def get_image_bytes(sha256: Sha256Path, state: StoresDep, _: SearchAccess) -> FileResponse:
    sha = sha256.lower()
    state.require_ingested(sha)
    path = state.blobs.path(sha)
    with open(path, "rb") as fh:
        media_type = content_type(fh.read(16))
    return FileResponse(path, media_type=media_type, headers={
        "X-Content-Type-Options": "nosniff", "Cache-Control": IMMUTABLE, "ETag": f'"{sha}"'})


@router.get("/images/{sha256}/thumbnail", summary="A JPEG thumbnail of an ingested image",
            response_class=FileResponse,
            responses={200: {"content": {"image/jpeg": {}}, "description": "JPEG, longest side `size` or less"},
                       **error_responses(401, 404, 422, 429)})
def get_thumbnail(
    sha256: Sha256Path,
    state: StoresDep,
    _: SearchAccess,
    size: Annotated[int, Query(ge=16, le=1024, description="Longest side; rounded up to 64, 128, 256, 512 "
                                                           "or 1024")] = DEFAULT_SIZE,
) -> FileResponse:
    sha = sha256.lower()
    state.require_ingested(sha)
    return FileResponse(thumbnail(state, sha, size), media_type="image/jpeg", headers={
        "X-Content-Type-Options": "nosniff", "Cache-Control": IMMUTABLE})
