"""``POST /v1/embeddings`` (OpenAI-compatible, multimodal) and ``GET /v1/models``."""

from __future__ import annotations

import base64
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Body

from rubricsearch.app.deps import (
    ADMITTED,
    JSON_BODY,
    MAX_INPUTS,
    ImageResolver,
    ImagesDep,
    SearchAccess,
    StateDep,
    requested_model,
)
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.schemas.common import SEARCH_ERRORS, Usage, error_responses
from rubricsearch.app.schemas.embeddings import (
    OPENAPI_EXAMPLES,
    TOKEN_LIMITS,
    ChatMessage,
    EmbeddingData,
    EmbeddingItem,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelCard,
    ModelLimits,
    ModelList,
)
from rubricsearch.app.state import AppState, ModelKind
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.packages import Usage as UsageLedger
from rubricsearch.retrieval.qwen.model.loading import public_model_id

router = APIRouter(prefix="/v1", tags=["embeddings"], route_class=BoundedJsonRoute)

DESCRIPTION = """\
OpenAI-compatible embeddings from Qwen3-VL-Embedding, for text, images and both together.
Vectors are L2-normalised float32; `dimensions` truncates them (Matryoshka) and renormalises.

**Inputs** (give `input` *or* `messages`):

| form | example | embeddings |
|---|---|---|
| string | `"input": "a red cat"` | 1 |
| list of strings | `"input": ["a", "b"]` | one per string |
| list of items | `"input": [{"image": "data:..."}, {"text": "..", "image": {"image_id": "<sha>"}}]` | one per item |
| vLLM chat | `"messages": [{"role": "system", "content": ".."}, {"role": "user", "content": [parts]}]` | 1 |
| vLLM batched chat | `"messages": [[...], [...]]` | one per conversation |

An **item** is `{"text"?: str | [str], "image"?: image | [image], "instruction"?: str}`, the official
Qwen3-VL-Embedding input. An **image** is a `data:` URL string or `{"image_id": "<sha256>"}` of an image
ingested into any reference set. **Content parts** (vLLM form) are `{"type": "text", "text"}`,
`{"type": "image_url", "image_url": {"url": "data:..."}}` and `{"type": "image_id", "image_id": "<sha256>"}`;
a system message is the instruction, and a trailing empty assistant message is accepted.

`instruction` (request-wide, or per item) goes in the system prompt as in the official model.
With the `openai` client pass items directly in `input`, or non-OpenAI fields via `extra_body`.
"""


def _encode(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def _conversation(messages: list[ChatMessage], images: ImageResolver) -> dict[str, Any]:
    """One vLLM-style conversation -> one official item (system = instruction, user content embedded)."""
    system: list[str] = []
    texts: list[str] = []
    found: list[Any] = []
    for message in messages:
        parts_texts, parts_images = (
            ([message.content], []) if isinstance(message.content, str) else images.parts(message.content)
        )
        if message.role == "system":
            if parts_images:
                raise InvalidInput("a system message may hold only text (the instruction)")
            system.extend(parts_texts)
        elif message.role == "user":
            texts.extend(parts_texts)
            found.extend(parts_images)
        elif any(parts_texts) or parts_images:
            raise InvalidInput("an assistant message must be empty; embeddings are taken of the user content")
    instruction = "\n".join(t for t in system if t) or None
    return ImageResolver.official([t for t in texts if t], found, instruction)


def _items(body: EmbeddingRequest, images: ImageResolver) -> list[dict[str, Any]]:
    if body.messages is not None:
        conversations = body.messages if body.messages and isinstance(body.messages[0], list) else [body.messages]
        items = [_conversation(list(c), images) for c in conversations]  # type: ignore[arg-type]
        if body.instruction is not None:
            for item in items:
                item.setdefault("instruction", body.instruction)
        return items
    entries = [body.input] if isinstance(body.input, str) else list(body.input or [])
    out = []
    for entry in entries:
        if isinstance(entry, str):
            out.append(ImageResolver.official([entry], [], body.instruction))
        else:
            assert isinstance(entry, EmbeddingItem)
            texts = [entry.text] if isinstance(entry.text, str) else list(entry.text or [])
            out.append(ImageResolver.official(texts, images.images(entry.image), entry.instruction or body.instruction))
    return out


def _count(body: EmbeddingRequest) -> int:
    if body.messages is not None:
        return len(body.messages) if body.messages and isinstance(body.messages[0], list) else 1
    return 1 if isinstance(body.input, str) else len(body.input or [])


@router.post("/embeddings", summary="Create embeddings (text, images, or both)", description=DESCRIPTION,
             dependencies=[JSON_BODY, ADMITTED], responses=SEARCH_ERRORS)
def create_embeddings(
    body: Annotated[EmbeddingRequest, Body(openapi_examples=OPENAPI_EXAMPLES)],
    state: StateDep,
    images: ImagesDep,
    _: SearchAccess,
) -> EmbeddingResponse:
    model_id = requested_model(state, "embedding", body.model, _count(body))
    items = _items(body, images)
    embedder = state.embedder
    usage = UsageLedger()
    vectors = embedder.embed(items, body.dimensions, truncate=body.truncate, usage=usage)
    tokens = usage.lm_tokens
    data = [EmbeddingData(index=i, embedding=_encode(v, body.encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingResponse(data=data, model=model_id, usage=Usage(prompt_tokens=tokens, total_tokens=tokens))


def _card(state: AppState, kind: ModelKind) -> ModelCard:
    model = state.model(kind)
    aliases = [n for n in state.model_names(kind) if n != model.model_id and public_model_id(n) == n]
    settings = state.settings
    dimension = state.embedder.dimension if kind == "embedding" else None
    limits = ModelLimits(
        max_tokens=TOKEN_LIMITS[kind], max_image_bytes=settings.image_bytes,
        max_image_pixels=settings.image_pixels,
        max_inputs=MAX_INPUTS[kind])
    return ModelCard(id=model.model_id, kind=kind, revision=model.revision, aliases=aliases,
                     test_model=state.test_models, label=state.models_label, dimension=dimension,
                     dimensions_min=min(64, dimension) if dimension else None, limits=limits)


@router.get("/models", summary="Served models (OpenAI-compatible listing)", responses=error_responses(401, 503))
def list_models(state: StateDep, _: SearchAccess) -> ModelList:
    return ModelList(data=[_card(state, "embedding"), _card(state, "reranker")])
