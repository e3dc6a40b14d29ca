"""``POST /v1/search``: rubric search in a reference set, as JSON or as an HTML-form style post.

The references' visual packages come from the store (computed once at ingestion), so a search runs the
vision encoder at most once: for a new candidate image. ``provenance.vision_encodes`` shows it.

FastAPI validates a body of one media type per route, so the path has two routes that call the same
:func:`~app.set_search.search_set`: one declares the JSON body (:class:`SearchBody`), the other the form
(:class:`SearchForm`) and matches only form posts. The JSON route documents both in the OpenAPI schema.
"""

from __future__ import annotations

import email.message
import re
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Body, Depends, Form, Request
from starlette.datastructures import Headers, UploadFile
from starlette.routing import Match
from starlette.types import Scope

from rubricsearch.app.deps import ADMITTED, ImageResolver, SearchAccess, StateDep
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.schemas.common import SEARCH_ERRORS, ImageId
from rubricsearch.app.schemas.search import OPENAPI_EXAMPLES, SearchBody, SearchForm, SearchResponse
from rubricsearch.app.set_search import search_set
from rubricsearch.app.state import AppState
from rubricsearch.retrieval.errors import UnsupportedMedia
from rubricsearch.retrieval.images import ImageLike, image_handle

router = APIRouter(prefix="/v1", tags=["search"], route_class=BoundedJsonRoute)
SHA_RE = re.compile(r"[0-9a-fA-F]{64}")
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")

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


OPENAPI_FORM: dict[str, Any] = {"requestBody": {"content": {
    "multipart/form-data": {"schema": SearchForm.model_json_schema(ref_template="#/components/schemas/{model}")},
}}}


def _media_type(headers: Any) -> str:
    message = email.message.Message()
    message["content-type"] = headers.get("content-type", "")
    return message.get_content_type()


class FormRoute(BoundedJsonRoute):
    """A route that matches form posts only, so the JSON route on the same path answers every other body."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is Match.FULL and _media_type(Headers(scope=scope)) not in FORM_TYPES:
            return Match.NONE, {}
        return match, child


def require_search_json(request: Request) -> None:
    """415 for a body that is neither JSON nor a form (the form route took the forms)."""
    media = _media_type(request.headers)
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMedia("send the search as JSON or multipart/form-data", content_type=media)


def _form_search(state: AppState, form: SearchForm, upload: bytes | None) -> SearchResponse:
    images = ImageResolver(state)
    candidate: ImageLike | None = None
    if upload is not None:
        candidate = image_handle(upload, max_bytes=images.max_bytes, max_pixels=images.max_pixels)
    elif isinstance(form.image, str) and form.image.strip():  # a data: URL, or the sha256 of an ingested image
        value = form.image.strip()
        candidate = images.image(ImageId(image_id=value) if SHA_RE.fullmatch(value) else value)
    return search_set(state, form.query(), candidate)


async def search_form(form: Annotated[SearchForm, Form(media_type="multipart/form-data")], state: StateDep,
                      _: SearchAccess) -> SearchResponse:
    image = form.image
    upload = await image.read() if isinstance(image, UploadFile) and (image.filename or image.size) else None
    return await anyio.to_thread.run_sync(_form_search, state, form, upload)


# before the JSON route: a router takes the first route that matches
router.add_api_route("/search", search_form, methods=["POST"], route_class_override=FormRoute,
                     include_in_schema=False, responses=SEARCH_ERRORS, dependencies=[ADMITTED])


@router.post("/search", summary="Rubric search: vector shortlist, then reranking with a criteria breakdown",
             description=DESCRIPTION, openapi_extra=OPENAPI_FORM, responses=SEARCH_ERRORS,
             dependencies=[Depends(require_search_json), ADMITTED])
async def search(body: Annotated[SearchBody, Body(openapi_examples=OPENAPI_EXAMPLES)], state: StateDep,
                 _: SearchAccess) -> SearchResponse:
    return await anyio.to_thread.run_sync(search_set, state, body)
