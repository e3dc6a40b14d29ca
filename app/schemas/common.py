"""Shapes shared by every feature: the error envelope, token usage and image references."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from rubricsearch.app.errors import STATUS_BY_KIND

# Work per request is bounded here, before anything is tokenised or decoded; the limits show in OpenAPI and
# an over-limit field is a 422 that names it. Token limits (the models' max_length) are checked after
# tokenising: over them a request is refused unless it asks for truncation.
MAX_TEXT_CHARS = 32_768  # one text, query or document (the embedder reads 8,192 tokens, the reranker 10,240)
MAX_INSTRUCTION_CHARS = 4_096
MAX_CRITERION_CHARS = 1_000
MAX_ITEMS = 1_024  # inputs of one embeddings request, documents of one rerank request
MAX_PARTS = 64  # text parts or images of one item, messages of one conversation

MAX_URL_CHARS = 8_192  # one import URL
MAX_IMPORT_URLS = 2_000  # URLs of one import request: each may take the fetch deadline, on a small box
MAX_PATH_CHARS = 4_096  # a server folder (Linux PATH_MAX)
# Strings the server stores or hands to the file system: PostgreSQL text and POSIX paths cannot hold NUL.
NO_NUL = r"^[^\x00]*$"

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
StoredText = Annotated[str, StringConstraints(max_length=10_000, pattern=NO_NUL)]
ImportUrl = Annotated[str, StringConstraints(min_length=1, max_length=MAX_URL_CHARS, pattern=r"^[^\x00-\x20\x7f]+$")]
ServerFolder = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH_CHARS, pattern=NO_NUL)]
Instruction = Annotated[str, StringConstraints(max_length=MAX_INSTRUCTION_CHARS)]
Criterion = Annotated[str, StringConstraints(max_length=MAX_CRITERION_CHARS)]


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


Sha256 = Annotated[
    str,
    BeforeValidator(_lower),
    StringConstraints(pattern=r"^[0-9a-f]{64}$"),
    Field(description="sha256 (hex) of the image's original bytes", examples=["9f86d081884c7d65" * 4]),
]

TINY_PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)

DataUrl = Annotated[
    str,
    Field(
        description=(
            "An image as a `data:` URL (`data:image/png;base64,...`). JPEG, PNG, WEBP, GIF (first frame), "
            "BMP and TIFF are read. Remote `http(s)` URLs and server paths are refused on purpose: ingest "
            "remote images into a reference set and pass `{\"image_id\": sha256}` instead."
        ),
        examples=[TINY_PNG],
    ),
]


class ImageId(BaseModel):
    """A reference to an image already ingested into any reference set (no bytes are sent)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"image_id": "9f86d081884c7d65" * 4}]})

    image_id: Sha256


ImageRef = Annotated[
    DataUrl | ImageId,
    Field(description="An image: a `data:` URL string, or `{\"image_id\": \"<sha256>\"}` of an ingested image."),
]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: DataUrl
    detail: str | None = Field(None, description="Accepted for OpenAI compatibility and ignored.")


class ImageUrlPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageUrl


class ImageIdPart(BaseModel):
    """rubricsearch extension: an ingested image by sha256 instead of its bytes."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["image_id"]
    image_id: Sha256


ContentPart = Annotated[TextPart | ImageUrlPart | ImageIdPart, Field(discriminator="type")]


class ErrorDetail(BaseModel):
    type: str = Field(
        description="Stable machine-readable kind; one of: " + ", ".join(f"`{k}`" for k in STATUS_BY_KIND),
        examples=["invalid_input"],
    )
    message: str = Field(description="Human-readable explanation (wording may change; switch on `type`).")
    details: dict[str, Any] = Field(default_factory=dict, description="Structured context, e.g. the limit hit.")


class ErrorResponse(BaseModel):
    """Every error response has this body, whatever its status."""

    model_config = ConfigDict(json_schema_extra={
        "examples": [{"error": {"type": "not_found", "message": "image not found", "details": {"sha256": "..."}}}]
    })

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Language-model tokens processed, image tokens included.")
    total_tokens: int


_DESCRIPTIONS = {
    400: "Bad input (`invalid_input`, `invalid_image`)",
    401: "Missing or unknown API key (`unauthorized`)",
    403: "The key may not do this (`forbidden`)",
    404: "Unknown image, model or route (`not_found`)",
    409: "Conflict (`conflict`, `package_mismatch`)",
    413: "Body or image too large (`payload_too_large`)",
    415: "Body is not JSON or the image type is unsupported (`unsupported_media_type`)",
    422: "Request does not match the schema (`validation_error`)",
    429: "Too many requests (`rate_limited`); see `Retry-After`",
    503: "A model or store is not available (`backend_unavailable`)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries documenting the error envelope for these statuses."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS.get(s, "Error")} for s in statuses}


SEARCH_ERRORS = error_responses(400, 401, 403, 404, 413, 415, 422, 429, 503)
