"""``POST /v1/rerank``: Cohere/Jina-shaped multimodal reranking with Qwen3-VL-Reranker."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body

from rubricsearch.app.deps import (
    ADMITTED,
    JSON_BODY,
    ImagesDep,
    SearchAccess,
    StateDep,
    official_input,
    requested_model,
)
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.schemas.common import SEARCH_ERRORS, Usage
from rubricsearch.app.schemas.rerank import (
    OPENAPI_EXAMPLES,
    RerankInput,
    RerankRequest,
    RerankResponse,
    RerankResult,
)
from rubricsearch.retrieval.packages import Usage as UsageLedger

router = APIRouter(prefix="/v1", tags=["rerank"], route_class=BoundedJsonRoute)

DESCRIPTION = """\
Scores every document against the query with Qwen3-VL-Reranker and returns them best first.

`query` and each document are a string, an item `{"text"?: str | [str], "image"?: image | [image]}`, or the
vLLM form `{"content": [parts]}` (parts: `text`, `image_url` with a `data:` URL, `image_id`). An image is a
`data:` URL or `{"image_id": "<sha256>"}` of an ingested image; ingested images reuse their cached visual
package, so their vision encoder does not run again. `instruction` is the judging criterion.
`relevance_score` is P("yes") of the official prompt, in [0, 1].
"""


def _echo(value: RerankInput) -> dict[str, Any]:
    return {"text": value} if isinstance(value, str) else value.model_dump(mode="json", exclude_none=True)


@router.post("/rerank", summary="Rerank documents (text, images, or both) against a query",
             description=DESCRIPTION, dependencies=[JSON_BODY, ADMITTED], responses=SEARCH_ERRORS,
             response_model_exclude_none=True)
def rerank(
    body: Annotated[RerankRequest, Body(openapi_examples=OPENAPI_EXAMPLES)],
    state: StateDep,
    images: ImagesDep,
    _: SearchAccess,
) -> RerankResponse:
    model_id = requested_model(state, "reranker", body.model, len(body.documents))
    query = official_input(body.query, images)
    documents = [official_input(d, images) for d in body.documents]
    reranker = state.reranker
    usage = UsageLedger()
    scores = reranker.score(query, documents, body.instruction, truncate=body.truncate, usage=usage)
    tokens = usage.lm_tokens
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: body.top_n]
    results = [
        RerankResult(index=i, relevance_score=scores[i],
                     document=_echo(body.documents[i]) if body.return_documents else None)
        for i in order
    ]
    return RerankResponse(results=results, model=model_id, usage=Usage(prompt_tokens=tokens, total_tokens=tokens))
