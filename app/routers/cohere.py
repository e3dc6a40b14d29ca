"""``POST /v2/embed`` and ``POST /v2/rerank``: Cohere's v2 API, as vLLM serves it (the official client works)."""

from __future__ import annotations

import base64
import uuid
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Body

from rubricsearch.app.deps import (
    ADMITTED,
    JSON_BODY,
    ImageResolver,
    ImagesDep,
    SearchAccess,
    StateDep,
    official_input,
    requested_model,
)
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.schemas.cohere import (
    INPUT_TYPE_INSTRUCTIONS,
    OPENAPI_EXAMPLES,
    CohereBilledUnits,
    CohereEmbeddings,
    CohereEmbedRequest,
    CohereEmbedResponse,
    CohereMeta,
    CohereRerankMeta,
    CohereRerankRequest,
    CohereRerankResponse,
    CohereRerankResult,
)
from rubricsearch.app.schemas.common import SEARCH_ERRORS
from rubricsearch.app.schemas.embeddings import TOKEN_LIMITS
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.packages import Usage as UsageLedger

router = APIRouter(prefix="/v2", tags=["embeddings"], route_class=BoundedJsonRoute)

MODEL_TOKEN_LIMIT = TOKEN_LIMITS["embedding"]

DESCRIPTION = """\
Cohere v2 embed, as vLLM serves it (so the official `cohere` client works: `cohere.ClientV2(base_url=...)`).
Give one of `texts`, `images` (data: URLs) or `inputs` (content lists of `text`, `image_url`, `image_id`
parts, embedded together). `input_type` picks the instruction put in the system prompt; `instruction`
overrides it. All requested `embedding_types` are returned from one model pass.
"""


def quantize(vectors: np.ndarray, kind: str) -> list[list[float]] | list[list[int]] | list[str]:
    """One embedding type of L2-normalised float32 ``vectors`` (rows), in Cohere's response form."""
    if kind == "float":
        return [[float(x) for x in row] for row in vectors]
    if kind == "base64":
        return [base64.b64encode(np.ascontiguousarray(row, dtype="<f4").tobytes()).decode("ascii") for row in vectors]
    if kind in ("int8", "uint8"):
        scale = np.abs(vectors).max(axis=1, keepdims=True)
        scaled = np.rint(vectors / np.where(scale > 0, scale, 1.0) * 127).astype(np.int16)
        return (scaled + (128 if kind == "uint8" else 0)).tolist()
    packed = np.packbits(vectors > 0, axis=1).astype(np.int16)
    return (packed - (128 if kind == "binary" else 0)).tolist()


def _items(body: CohereEmbedRequest, images: ImageResolver) -> list[dict[str, Any]]:
    instruction = body.instruction if body.instruction is not None else INPUT_TYPE_INSTRUCTIONS[body.input_type]
    if body.texts is not None:
        return [ImageResolver.official([t], [], instruction) for t in body.texts]
    if body.images is not None:
        return [ImageResolver.official([], [images.image(url)], instruction) for url in body.images]
    out = []
    for entry in body.inputs or []:
        texts, found = images.parts(entry.content)
        out.append(ImageResolver.official([t for t in texts if t], found, instruction))
    return out


@router.post("/embed", summary="Create embeddings (Cohere v2 / vLLM /v2/embed)", description=DESCRIPTION,
             dependencies=[JSON_BODY, ADMITTED], responses=SEARCH_ERRORS)
def cohere_embed(
    body: Annotated[CohereEmbedRequest, Body(openapi_examples=OPENAPI_EXAMPLES)],
    state: StateDep,
    images: ImagesDep,
    _: SearchAccess,
) -> CohereEmbedResponse:
    model_id = requested_model(state, "embedding", body.model, body.count())
    if body.truncate == "START":
        raise InvalidInput("truncate=START is not supported: Qwen3-VL-Embedding keeps the start of the input; "
                           "use END or NONE")
    if body.max_tokens is not None and body.max_tokens < MODEL_TOKEN_LIMIT:
        raise InvalidInput(f"max_tokens below the model's limit ({MODEL_TOKEN_LIMIT}) is not supported",
                           limit=MODEL_TOKEN_LIMIT)
    items = _items(body, images)
    usage = UsageLedger()
    vectors = np.asarray(state.embedder.embed(items, body.output_dimension, truncate=body.truncate == "END",
                                              usage=usage), dtype=np.float32)
    embeddings = CohereEmbeddings.model_validate({kind: quantize(vectors, kind) for kind in body.embedding_types})
    n_images = sum(len(v) if isinstance(v, list) else 1 for v in (i.get("image") for i in items) if v is not None)
    tokens = usage.lm_tokens
    return CohereEmbedResponse(
        id=str(uuid.uuid4()), embeddings=embeddings, texts=list(body.texts or []), model=model_id,
        meta=CohereMeta(billed_units=CohereBilledUnits(input_tokens=tokens, images=n_images),
                        tokens={"input_tokens": tokens, "output_tokens": 0}),
    )


RERANK_DESCRIPTION = """\
Cohere v2 rerank, as vLLM serves it (the official client: `cohere.ClientV2(base_url=...).rerank(model=...,
query=..., documents=[...])`). Documents are texts, or items with images as in `/v1/rerank`; the judgement is
the reranker's default instruction. `relevance_score` is P("yes") of the official prompt, in [0, 1].
"""


@router.post("/rerank", summary="Rerank documents (Cohere v2 / vLLM /v2/rerank)", description=RERANK_DESCRIPTION,
             dependencies=[JSON_BODY, ADMITTED], responses=SEARCH_ERRORS, tags=["rerank"])
def cohere_rerank(body: CohereRerankRequest, state: StateDep, images: ImagesDep,
                  _: SearchAccess) -> CohereRerankResponse:
    requested_model(state, "reranker", body.model, len(body.documents))
    usage = UsageLedger()
    scores = state.reranker.score(official_input(body.query, images),
                                  [official_input(d, images) for d in body.documents], usage=usage)
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: body.top_n]
    return CohereRerankResponse(
        id=str(uuid.uuid4()), results=[CohereRerankResult(index=i, relevance_score=scores[i]) for i in order],
        meta=CohereRerankMeta(billed_units={"search_units": 1}, tokens={"input_tokens": usage.lm_tokens,
                                                                          "output_tokens": 0}))
