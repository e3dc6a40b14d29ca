"""Reference metadata after ingestion: change one image (PATCH), upload a manifest, export one."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Body, File, Path, Query, UploadFile
from fastapi.responses import StreamingResponse

from rubricsearch.app.deps import JSON_BODY, MULTIPART, AdminAccess, SearchAccess, SetPath, StateDep
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.schemas.images import ImageOut
from rubricsearch.app.schemas.metadata import ImageMetadataChange, ManifestOut, MetadataCounts, ValueCount
from rubricsearch.app.sets import find_set, find_set_image
from rubricsearch.app.views import image_out
from rubricsearch.indexer.catalog import count_values, iter_metadata
from rubricsearch.indexer.jobs.metadata import apply_manifest, change_metadata
from rubricsearch.retrieval.errors import PayloadTooLarge

router = APIRouter(prefix="/v1", tags=["images"])
MAX_MANIFEST_BYTES = 64 << 20

MANIFEST_DESCRIPTION = """\
`multipart/form-data` with one `file`: a `manifest.csv` (a header row; a `file` column with the image's
original name, i.e. its path inside the zip or folder it came from, or a `sha256` column; every other column a
field; empty cells leave a field alone, numbers and `true`/`false` are typed, `tags` splits on `;`) or a
`manifest.jsonl` (one JSON object a line, `null` removes a field). Each row merges into that image's metadata.
All or nothing: a row that names no image or is malformed fails the upload (422, every such row listed in
`details.errors`) and nothing changes.
"""


@router.patch("/sets/{set_id}/images/{image_id}", summary="Change one image's metadata",
              dependencies=[JSON_BODY], responses=error_responses(401, 403, 404, 415, 422))
def patch_image(set_id: SetPath,
                image_id: Annotated[str, Path(description="The image's id in the set, or its sha256.", max_length=64)],
                body: Annotated[ImageMetadataChange, Body()], state: StateDep, _: AdminAccess) -> ImageOut:
    record = find_set(state, set_id)
    image = find_set_image(state, record.id, image_id)
    [changed] = change_metadata(state.catalog, state.index, record.id, {image.id: body.metadata},
                                replace=body.replace)
    return image_out(changed)


@router.post("/sets/{set_id}/manifest", summary="Update many images' metadata from a CSV or JSONL manifest",
             description=MANIFEST_DESCRIPTION, responses=error_responses(401, 403, 404, 413, 415, 422))
def upload_manifest(set_id: SetPath, state: StateDep, _: AdminAccess,
                    file: Annotated[UploadFile, File(description="manifest.csv or manifest.jsonl")],
                    __: None = MULTIPART) -> ManifestOut:
    record = find_set(state, set_id)
    size = file.file.seek(0, os.SEEK_END)
    file.file.seek(0)
    if size > MAX_MANIFEST_BYTES:
        raise PayloadTooLarge(f"a manifest is at most {MAX_MANIFEST_BYTES} bytes", limit=MAX_MANIFEST_BYTES)
    # the spooled upload is parsed a line at a time, never read whole into memory
    report = apply_manifest(state.catalog, state.index, record.id, file.file, file.filename or "manifest")
    return ManifestOut(rows=report.rows, updated=report.updated)


@router.get("/sets/{set_id}/manifest.jsonl", summary="Every image's metadata as a JSONL manifest",
            response_class=StreamingResponse,
            responses={200: {"content": {"application/x-ndjson": {}},
                             "description": "One object a line: `sha256`, `file`, then the metadata fields"},
                       **error_responses(401, 404, 422)})
def export_manifest(set_id: SetPath, state: StateDep, _: SearchAccess) -> StreamingResponse:
    record = find_set(state, set_id)

    def lines() -> Iterator[bytes]:
        with state.catalog.read() as session:
            for image in iter_metadata(session, record.id):
                row = {"sha256": image.sha256, "file": image.original_name, **image.meta}
                yield (json.dumps(row, ensure_ascii=False) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson", headers={
        "Content-Disposition": f'attachment; filename="{record.id}-manifest.jsonl"'})


@router.get("/sets/{set_id}/metadata/counts", summary="How many images hold each metadata value",
            responses=error_responses(401, 404, 422))
def metadata_counts(set_id: SetPath, state: StateDep, _: SearchAccess,
                    per_key: Annotated[int, Query(ge=1, le=200, description="Values listed per key")] = 20,
                    ) -> MetadataCounts:
    record = find_set(state, set_id)
    with state.catalog.read() as session:
        images, fields = count_values(session, record.id, per_key=per_key)
    return MetadataCounts(images=images, fields={k: [ValueCount(value=v, count=n) for v, n in values]
                                                 for k, values in fields.items()})
