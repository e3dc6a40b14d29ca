"""``POST /v1/visual-packages``: packages for *any* images, not only ingested ones (seed 000).

A caller computes each image's vision-tower output here once, through the online API, and sends it to a
vLLM server (``--enable-mm-embeds``) with as many instructions as it likes: the vision encoder never runs
again for that image. Ingested images (``{"image_id"}``) use the package store; other images are cached
in the query package memory by fingerprint (a repeat is ``cached: true`` and encodes nothing).
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

from fastapi import APIRouter, File, Form, UploadFile

from rubricsearch.app.deps import ADMITTED, JSON_BODY, SearchAccess, SettingsDep, StateDep
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.package_views import OutDtype, model_view, package_response
from rubricsearch.app.schemas.common import ImageId, error_responses
from rubricsearch.app.schemas.packages import MAX_PACKAGE_IMAGES, PackagesRequest, PackagesResponse
from rubricsearch.app.services import url_fetcher
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import record_package
from rubricsearch.retrieval.errors import ImageError, InvalidInput, PayloadTooLarge
from rubricsearch.retrieval.images import ImageLike, image_handle
from rubricsearch.retrieval.packages import ModelPackages

router = APIRouter(prefix="/v1", tags=["packages"], route_class=BoundedJsonRoute)

ERRORS = error_responses(400, 401, 403, 404, 413, 415, 422, 429, 503)

DESCRIPTION = """\
One visual package per image, in the shape of `GET /v1/images/{sha256}/visual-package` (`format=vllm`).
Send each to a vLLM server started with `--enable-mm-embeds` as
`{"type": "image_embeds", "image_embeds": {"image_embeds": p["image_embeds"], "image_grid_thw": p["image_grid_thw"]}}`,
with any instruction: the vision encoder does not run there. JSON here; `POST /v1/visual-packages/upload`
takes the same as multipart files.
"""


def _resolve(ref: str | ImageId, state: AppState, settings: Settings) -> ImageLike:
    limits = {"max_bytes": settings.image_bytes, "max_pixels": settings.request_image_pixels}
    if isinstance(ref, ImageId):
        return state.ingested_image(ref.image_id)
    if ref.startswith("data:"):
        return image_handle(ref, **limits)
    if ref.startswith(("http://", "https://")):
        return image_handle(url_fetcher(settings).fetch(ref, max_bytes=settings.image_bytes), **limits)
    if len(ref) > (settings.image_bytes * 4) // 3 + 4:
        raise PayloadTooLarge(f"image is over the limit of {settings.image_bytes} bytes",
                              limit=settings.image_bytes)
    try:
        data = base64.b64decode(ref, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image must be a data: URL, base64 bytes, an http(s) URL or {\"image_id\"}") from None
    return image_handle(data, **limits)


def _packages(images: list[ImageLike], ingested: set[str], state: AppState, view: ModelPackages, model_id: str,
              dtype: OutDtype) -> PackagesResponse:
    cached = view.find(images)
    packages = view.get_or_encode(images)
    new_ingested = {p.fingerprint.digest(): p for img, p in zip(images, packages, strict=True)
                    if img.sha256 in ingested and img.sha256 not in cached}
    if new_ingested:
        with state.catalog.write() as session:
            for img, package in zip(images, packages, strict=True):
                if img.sha256 in ingested and img.sha256 not in cached:
                    record_package(session, img.sha256, package.fingerprint.digest(), package.nbytes)
    data = [package_response(img.sha256, p, model_id, dtype, img.sha256 in cached)
            for img, p in zip(images, packages, strict=True)]
    return PackagesResponse(model=model_id, data=data)


@router.post("/visual-packages", summary="Visual packages for any images (compute once, reuse in vLLM)",
             description=DESCRIPTION, dependencies=[JSON_BODY, ADMITTED], responses=ERRORS)
def create_packages(body: PackagesRequest, state: StateDep, settings: SettingsDep,
                    _: SearchAccess) -> PackagesResponse:
    view, model_id = model_view(state, body.model)
    images = [_resolve(ref, state, settings) for ref in body.images]
    ingested = {ref.image_id for ref in body.images if isinstance(ref, ImageId)}
    return _packages(images, ingested, state, view, model_id, body.dtype)


@router.post("/visual-packages/upload", summary="Visual packages for uploaded image files (multipart)",
             dependencies=[ADMITTED], responses=ERRORS)
def upload_packages(
    files: Annotated[list[UploadFile], File(description="Image files, one package each, in order")],
    state: StateDep,
    settings: SettingsDep,
    _: SearchAccess,
    model: Annotated[str | None, Form(description="embedding (default), reranker, or a model id")] = None,
    dtype: Annotated[OutDtype, Form(description="auto = as stored")] = "auto",
) -> PackagesResponse:
    view, model_id = model_view(state, model)
    if not files or len(files) > MAX_PACKAGE_IMAGES:
        raise InvalidInput(f"send 1 to {MAX_PACKAGE_IMAGES} files", limit=MAX_PACKAGE_IMAGES)
    images = []
    for upload in files:
        data = upload.file.read(settings.image_bytes + 1)
        images.append(image_handle(data, max_bytes=settings.image_bytes,
                                   max_pixels=settings.request_image_pixels))
    return _packages(images, set(), state, view, model_id, dtype)
