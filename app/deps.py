"""Typed ``Annotated`` dependencies: routers declare what they need, never reach into ``app.state``.

    def handler(embedder: EmbedderDep, images: ImagesDep, _: SearchAccess) -> ...
"""

from __future__ import annotations

import email.message
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Depends, Path, Request

from rubricsearch.app.auth import Principal, require_admin, require_search
from rubricsearch.app.schemas.common import ContentPart, ImageId, ImageIdPart, ImageUrlPart, TextPart
from rubricsearch.app.schemas.rerank import RerankInput, RerankItem
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import AppState, ModelKind
from rubricsearch.app.warmup import Warmup
from rubricsearch.indexer.blobs import BlobStore
from rubricsearch.indexer.catalog import Catalog
from rubricsearch.rerank.protocol import Reranker
from rubricsearch.retrieval.embedding.protocol import Embedder
from rubricsearch.retrieval.errors import BackendUnavailable, ImageError, InvalidInput, Overloaded, UnsupportedMedia
from rubricsearch.retrieval.images import ImageLike, image_handle
from rubricsearch.retrieval.index import VectorIndex
from rubricsearch.retrieval.packages import VisualPackages


def get_state(request: Request) -> AppState:
    state = getattr(request.app.state, "rubricsearch", None)
    if not isinstance(state, AppState):
        raise not_ready(request)
    return state


def not_ready(request: Request) -> BackendUnavailable:
    """The 503 while there is no state: with the preparation's progress and a Retry-After while models are
    being prepared (the demo's first run trains them), else starting or shutting down."""
    warmup = getattr(request.app.state, "warmup", None)
    if isinstance(warmup, Warmup) and warmup.failure is None and not warmup.stopping:
        progress = warmup.progress
        return BackendUnavailable(f"not ready yet, {progress.text()}; retry in a moment",
                                  retry_after_s=progress.retry_after_s(), warmup=progress.as_dict())
    return BackendUnavailable("the service is starting or shutting down")


def get_stores(request: Request) -> AppState:
    """The state for routes that need no model: while the models are prepared, the warm-up's stores."""
    state = getattr(request.app.state, "rubricsearch", None)
    if isinstance(state, AppState):
        return state
    warmup = getattr(request.app.state, "warmup", None)
    if isinstance(warmup, Warmup) and warmup.stores is not None:
        return warmup.stores
    raise not_ready(request)


StateDep = Annotated[AppState, Depends(get_state)]
StoresDep = Annotated[AppState, Depends(get_stores)]  # catalog, blobs, index, sets: no model needed


def get_settings(request: Request) -> Settings:
    settings = request.app.state.settings
    assert isinstance(settings, Settings)
    return settings


def get_catalog(state: StateDep) -> Catalog:
    return state.catalog


def get_blobs(state: StateDep) -> BlobStore:
    return state.blobs


def get_packages(state: StateDep) -> VisualPackages:
    return state.packages


def get_index(state: StateDep) -> VectorIndex:
    return state.index


def get_embedder(state: StateDep) -> Embedder:
    return state.embedder


def get_reranker(state: StateDep) -> Reranker:
    return state.reranker


SettingsDep = Annotated[Settings, Depends(get_settings)]
CatalogDep = Annotated[Catalog, Depends(get_catalog)]
BlobsDep = Annotated[BlobStore, Depends(get_blobs)]
PackagesDep = Annotated[VisualPackages, Depends(get_packages)]
IndexDep = Annotated[VectorIndex, Depends(get_index)]
EmbedderDep = Annotated[Embedder, Depends(get_embedder)]
RerankerDep = Annotated[Reranker, Depends(get_reranker)]
SetPath = Annotated[str, Path(description="The set's id or its name.", max_length=200)]

# Access levels: put one in every route's signature (or ``dependencies=[...]`` of its router).
AdminAccess = Annotated[Principal, Depends(require_admin)]
SearchAccess = Annotated[Principal, Depends(require_search)]


def require_json(request: Request) -> None:
    """415 instead of a confusing 422 when a JSON route gets a form or text body (e.g. ``curl -d``)."""
    value = request.headers.get("content-type")
    if value is None:
        raise UnsupportedMedia("send the body as JSON (Content-Type: application/json)")
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    if message.get_content_maintype() != "application" or not (subtype == "json" or subtype.endswith("+json")):
        raise UnsupportedMedia(f"expected Content-Type application/json, got {message.get_content_type()}",
                               content_type=message.get_content_type())


JSON_BODY = Depends(require_json)


def require_multipart(request: Request) -> None:
    """415 naming the expected form when an upload route gets JSON or raw bytes."""
    message = email.message.Message()
    message["content-type"] = request.headers.get("content-type", "")
    if message.get_content_type() != "multipart/form-data":
        raise UnsupportedMedia("upload files as multipart/form-data (field `files`)",
                               content_type=message.get_content_type())


MULTIPART = Depends(require_multipart)
# Inputs waiting for the models above which new searches, embeddings and reranks get 503 `overloaded` with
# Retry-After: a few seconds of a GPU's work, so a refused client retries sooner than a queued one would finish.
MAX_QUEUED_MODEL_INPUTS = 8192
# Inputs of one /v1/embeddings request and documents of one /v1/rerank request (OpenAI's and Cohere's own bounds
# are in this range): one request's items are one batch of work admitted at once.
MAX_EMBEDDING_INPUTS = 512
MAX_RERANK_DOCUMENTS = 1000
MAX_INPUTS: dict[ModelKind, int] = {"embedding": MAX_EMBEDDING_INPUTS, "reranker": MAX_RERANK_DOCUMENTS}


def requested_model(state: AppState, kind: ModelKind, name: str | None, inputs: int) -> str:
    """The id of the model a request names (NotFound for a name not served here), once its ``inputs`` are
    within :data:`MAX_INPUTS` (InvalidInput otherwise): the OpenAI, Cohere and vLLM routes check both alike."""
    model_id = state.resolve_model(kind, name)
    if inputs > MAX_INPUTS[kind]:
        noun = "inputs" if kind == "embedding" else "documents"
        raise InvalidInput(f"at most {MAX_INPUTS[kind]} {noun} per request", limit=MAX_INPUTS[kind])
    return model_id


def admit(state: StateDep) -> None:
    """Admission control for model work: above ``MAX_QUEUED_MODEL_INPUTS`` waiting inputs a request is refused
    at once (503 ``overloaded``, Retry-After) instead of joining a queue whose wait would grow without bound."""
    limit = MAX_QUEUED_MODEL_INPUTS
    queued = state.queued_inputs()
    if sum(queued.values()) > limit:
        state.admission_refusals += 1
        raise Overloaded("the models are busy; retry shortly", retry_after_s=1, queued=queued, limit=limit)


ADMITTED = Depends(admit)


class ImageResolver:
    """Turns API image references into decoded images, with the configured limits.

    Only ``data:`` URLs and ``{"image_id": sha256}`` of ingested images are accepted: the model layer
    would also read server paths and ``file://`` URLs, which an API caller must never reach. Images are
    lazy handles: hashed now, decoded (and validated) only when a package has to be computed.
    """

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.max_bytes = state.settings.image_bytes
        self.max_pixels = state.settings.request_image_pixels
        self._ingested: dict[str, ImageLike] = {}

    def image(self, ref: str | ImageId) -> ImageLike:
        if isinstance(ref, ImageId):
            sha = ref.image_id
            if sha not in self._ingested:
                self._ingested[sha] = self.state.ingested_image(sha)
            return self._ingested[sha]
        if not isinstance(ref, str) or not ref.startswith("data:"):
            if isinstance(ref, str) and ref.startswith(("http://", "https://")):
                raise ImageError("remote image URLs are not fetched here; import the URL into a reference set "
                                 "and pass {\"image_id\": \"<sha256>\"}")
            raise ImageError("an image must be a data: URL or {\"image_id\": \"<sha256>\"} of an ingested image")
        return image_handle(ref, max_bytes=self.max_bytes, max_pixels=self.max_pixels)

    def images(self, value: str | ImageId | Sequence[str | ImageId] | None) -> list[ImageLike]:
        if value is None:
            return []
        refs: Sequence[str | ImageId] = [value] if isinstance(value, str | ImageId) else value
        return [self.image(r) for r in refs]

    def parts(self, parts: Sequence[ContentPart]) -> tuple[list[str], list[ImageLike]]:
        """vLLM / OpenAI content parts -> (texts, images), in order."""
        texts: list[str] = []
        images: list[ImageLike] = []
        for part in parts:
            if isinstance(part, TextPart):
                texts.append(part.text)
            elif isinstance(part, ImageUrlPart):
                images.append(self.image(part.image_url.url))
            elif isinstance(part, ImageIdPart):
                images.append(self.image(ImageId(image_id=part.image_id)))
        return texts, images

    @staticmethod
    def official(texts: list[str], images: list[ImageLike], instruction: str | None = None) -> dict[str, Any]:
        """The official ``{"text", "image", "instruction"}`` dict the embedder and reranker take."""
        item: dict[str, Any] = {}
        if texts:
            item["text"] = texts[0] if len(texts) == 1 else texts
        if images:
            item["image"] = images[0] if len(images) == 1 else images
        if instruction is not None:
            item["instruction"] = instruction
        return item


def get_image_resolver(state: StateDep) -> ImageResolver:
    return ImageResolver(state)


ImagesDep = Annotated[ImageResolver, Depends(get_image_resolver)]


def official_input(value: RerankInput, images: ImageResolver) -> dict[str, Any]:
    """A query or document of a rerank request as the official reranker class takes it."""
    if isinstance(value, str):
        return {"text": value}
    assert isinstance(value, RerankItem)
    if value.content is not None:
        texts, found = images.parts(value.content)
        return ImageResolver.official(texts, found)
    texts = [value.text] if isinstance(value.text, str) else list(value.text or [])
    return ImageResolver.official(texts, images.images(value.image))
