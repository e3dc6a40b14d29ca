"""``POST /v1/search``: rubric search in a reference set, as JSON or as an HTML-form style multipart post.

The references' visual packages come from the store (computed once at ingestion), so a search runs the
vision encoder at most once: for a new candidate image. ``provenance.vision_encodes`` shows it.
"""

from __future__ import annotations

import email.message
import json
import re
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from rubricsearch.app.deps import ADMITTED, ImageResolver, SearchAccess, StateDep
from rubricsearch.app.jsonbody import BoundedJsonRoute, parse_json, refuse_many_errors
from rubricsearch.app.schemas.common import SEARCH_ERRORS, ImageId
from rubricsearch.app.schemas.metadata import to_filter
from rubricsearch.app.schemas.search import (
    FORM_SCHEMA,
    OPENAPI_EXAMPLES,
    CandidateOut,
    SearchBody,
    SearchHitOut,
    SearchResponse,
)
from rubricsearch.app.sets import find_set, set_dimensions
from rubricsearch.app.state import AppState
from rubricsearch.app.views import image_out
from rubricsearch.indexer.catalog import find_images
from rubricsearch.retrieval.errors import UnsupportedMedia
from rubricsearch.retrieval.images import ImageLike, image_handle
from rubricsearch.retrieval.search import SearchRequest

router = APIRouter(prefix="/v1", tags=["search"], route_class=BoundedJsonRoute)
SHA_RE = re.compile(r"[0-9a-fA-F]{64}")

DESCRIPTION = """\
Find the references of a set that match a rubric and/or a candidate image.

1. The rubric and candidate become one instruction-aware query embedding (the candidate's vision
   features are cached like every image's).
2. Vector search takes a shortlist of `top_k` references.
3. The reranker scores the shortlist from the references' cached visual packages (the vision encoder
   does not run for them) and, for each criterion, gives a per-criterion score.

Send JSON (`image` as a `data:` URL or `{"image_id": sha256}` of an ingested image) or
`multipart/form-data` (fields `set_id`, `rubric`, `criteria` one per line, `image` a file, `top_k`,
`top_n`, `rerank`):

```bash
curl -F set_id=cats -F criteria=$'short fur\\ntriangular ears' -F image=@candidate.jpg \\
     http://localhost:8000/v1/search
```

`provenance` names the models, revisions and the exact instructions used; `test_models` is true when
random-weight test checkpoints are serving (the scores then mean nothing).
"""

_JSON_SCHEMA = SearchBody.model_json_schema(ref_template="#/components/schemas/{model}")
_JSON_SCHEMA.pop("$defs", None)  # ImageId is in components already (the embeddings routes use it)
OPENAPI_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": _JSON_SCHEMA, "examples": OPENAPI_EXAMPLES},
    "multipart/form-data": {"schema": FORM_SCHEMA},
}}}


def run_search(state: AppState, body: SearchBody, candidate: ImageLike | None) -> SearchResponse:
    """The search and its API view (the CLI prints the same)."""
    settings = state.settings
    record = find_set(state, body.set_id)
    service = state.search
    if not state.index.has_set(record.id):  # a set created before the model was known, still empty
        state.index.create_set(record.id, set_dimensions(state, record) or state.embedder.dimension)
    request = SearchRequest(
        set_id=record.id, rubric=body.rubric, criteria=list(body.criteria), candidate=candidate,
        top_k=body.top_k or settings.search.default_top_k,
        top_n=settings.search.default_top_n if body.top_n is None else body.top_n, rerank=body.rerank,
        filter=to_filter(body.filter, settings.search.facet_min_confidence),
    )
    result = service.search(request)
    with state.catalog.read() as session:
        images = find_images(session, record.id, [h.sha256 for h in result.hits])
    hits: list[SearchHitOut] = []
    for hit in result.hits:
        image = images.get(hit.sha256)
        if image is None:  # deleted while the search ran
            continue
        hits.append(SearchHitOut(rank=len(hits) + 1, score=hit.score, ann_score=hit.ann_score,
                                 rerank_score=hit.rerank_score, criteria=hit.criteria, identical=hit.identical,
                                 image=image_out(image)))
    provenance = {**result.provenance, "set": {"id": record.id, "name": record.name}}
    return SearchResponse(hits=hits, provenance=provenance, timings_ms=result.timings_ms,
                          candidate=CandidateOut(sha256=candidate.sha256) if candidate is not None else None,
                          test_models=state.test_models, models_label=state.models_label)


def _media_type(request: Request) -> str:
    message = email.message.Message()
    message["content-type"] = request.headers.get("content-type", "")
    return message.get_content_type()


def _validated(data: Any) -> SearchBody:
    try:
        return SearchBody.model_validate(data)
    except ValidationError as exc:
        refuse_many_errors(exc)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def _flag(value: str) -> bool | str:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "on", "yes"):
        return True
    if lowered in ("0", "false", "off", "no"):
        return False
    return value


async def _parse(request: Request, images: ImageResolver) -> tuple[SearchBody, ImageLike | None]:
    media = _media_type(request)
    if media == "application/json" or media.endswith("+json"):
        try:
            data = await parse_json(request, await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestValidationError([{"loc": ("body",), "msg": f"invalid JSON: {exc}", "type": "json_invalid"}],
                                         ) from None
        body = await anyio.to_thread.run_sync(_validated, data)
        return body, (images.image(body.image) if body.image is not None else None)
    if media not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        raise UnsupportedMedia("send the search as JSON or multipart/form-data", content_type=media)
    form = await request.form()
    fields: dict[str, Any] = {}
    for name in ("set_id", "rubric", "top_k", "top_n"):
        value = form.get(name)
        if isinstance(value, str) and value.strip():
            fields[name] = value.strip() if name != "rubric" else value
    raw_criteria = [c for c in form.getlist("criteria") if isinstance(c, str)]
    fields["criteria"] = [line.strip() for c in raw_criteria for line in c.splitlines() if line.strip()]
    rerank = form.get("rerank")
    if isinstance(rerank, str) and rerank.strip():
        fields["rerank"] = _flag(rerank)
    raw_filter = form.get("filter")
    if isinstance(raw_filter, str) and raw_filter.strip():
        try:
            fields["filter"] = json.loads(raw_filter)
        except json.JSONDecodeError as exc:
            raise RequestValidationError([{"loc": ("body", "filter"), "msg": f"the filter is not JSON: {exc}",
                                           "type": "json_invalid"}]) from None
    body = _validated(fields)
    upload = form.get("image")
    candidate: ImageLike | None = None
    if isinstance(upload, UploadFile) and (upload.filename or upload.size):
        data = await upload.read()
        candidate = image_handle(data, max_bytes=images.max_bytes, max_pixels=images.max_pixels)
    elif isinstance(upload, str) and upload.strip():  # a data: URL, or the sha256 of an ingested image
        value = upload.strip()
        candidate = images.image(ImageId(image_id=value) if SHA_RE.fullmatch(value) else value)
    return body, candidate


@router.post("/search", summary="Rubric search: vector shortlist, then reranking with a criteria breakdown",
             description=DESCRIPTION, openapi_extra=OPENAPI_BODY, responses=SEARCH_ERRORS,
             dependencies=[ADMITTED])
async def search(request: Request, state: StateDep, _: SearchAccess) -> SearchResponse:
    images = ImageResolver(state)
    body, candidate = await _parse(request, images)
    return await anyio.to_thread.run_sync(run_search, state, body, candidate)
