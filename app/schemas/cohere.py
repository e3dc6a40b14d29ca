"""``POST /v2/embed``: Cohere's v2 embed request and response, as vLLM serves them (RFC vllm#37000).

One of ``texts``, ``images`` or ``inputs`` (content lists of ``text`` / ``image_url`` parts). ``input_type``
picks a documented Qwen3-VL-Embedding instruction (:data:`INPUT_TYPE_INSTRUCTIONS`); ``instruction`` overrides
it (a rubricsearch extension: pass it with the cohere client's ``additional_body_parameters``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rubricsearch.app.schemas.common import (
    MAX_ITEMS,
    MAX_PARTS,
    TINY_PNG,
    DataUrl,
    ImageIdPart,
    ImageUrlPart,
    Instruction,
    Text,
    TextPart,
)
from rubricsearch.app.schemas.rerank import RerankInput

DEFAULT_INSTRUCTION = "Represent the user's input."
INPUT_TYPE_INSTRUCTIONS: dict[str, str] = {
    "search_query": "Retrieve images or text relevant to the user's query.",
    "search_document": DEFAULT_INSTRUCTION,
    "image": DEFAULT_INSTRUCTION,
    "classification": "Classify the given input.",
    "clustering": "Identify the category of the given input for clustering.",
}
InputType = Literal["search_query", "search_document", "image", "classification", "clustering"]
EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]

CohereContentPart = Annotated[TextPart | ImageUrlPart | ImageIdPart, Field(discriminator="type")]


class CohereInput(BaseModel):
    """One input: its content parts are embedded together (one embedding)."""

    model_config = ConfigDict(extra="forbid")

    content: Annotated[list[CohereContentPart], Field(min_length=1, max_length=MAX_PARTS)]


def _float_only() -> list[EmbeddingType]:
    return ["float"]


def _doc_table() -> str:
    return "; ".join(f"`{k}`: \"{v}\"" for k, v in INPUT_TYPE_INSTRUCTIONS.items())


class CohereEmbedRequest(BaseModel):
    """Cohere v2 embed request. Exactly one of ``texts``, ``images``, ``inputs``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The served embedding model id or an alias.")
    input_type: InputType = Field(
        "search_document", description="Picks the instruction (system prompt): " + _doc_table() + ".")
    instruction: Instruction | None = Field(
        None, description="Overrides the instruction `input_type` picks (rubricsearch extension).")
    texts: Annotated[list[Text], Field(min_length=1, max_length=MAX_ITEMS)] | None = None
    images: Annotated[list[DataUrl], Field(min_length=1, max_length=MAX_ITEMS)] | None = Field(
        None, description="`data:` URLs, one embedding each.")
    inputs: Annotated[list[CohereInput], Field(min_length=1, max_length=MAX_ITEMS)] | None = Field(
        None, description="Content lists of `text` / `image_url` (data: URL) / `image_id` parts; one embedding each.")
    embedding_types: Annotated[list[EmbeddingType], Field(min_length=1, max_length=6)] = Field(
        default_factory=_float_only,
        description="`float`; `int8`/`uint8`: per-vector symmetric scaling to ±127 (uint8 = int8 + 128, cosine "
        "kept); `binary`/`ubinary`: sign bits packed 8 per byte, first dimension in the highest bit (binary = "
        "ubinary − 128, as sentence-transformers); `base64`: little-endian float32 bytes.")
    output_dimension: int | None = Field(
        None, ge=1, description="Matryoshka size: the first N values, renormalised (64..hidden size).")
    truncate: Literal["NONE", "END", "START"] = Field(
        "END", description="Over the 8,192-token limit: `END` cuts the end of the text (Cohere's default), "
        "`NONE` refuses with 413 `payload_too_large`; `START` is not supported (400).")
    max_tokens: int | None = Field(
        None, ge=1, description="Accepted only up to the model's limit (8,192); shorter per-input limits are "
        "not supported and answered with 400.")
    priority: int | None = Field(None, description="Accepted for Cohere compatibility and ignored.")

    @model_validator(mode="after")
    def _one_source(self) -> CohereEmbedRequest:
        given = [n for n in ("texts", "images", "inputs") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'texts', 'images' and 'inputs'")
        return self

    def count(self) -> int:
        return len(self.texts or self.images or self.inputs or [])


class CohereEmbeddings(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    float_: list[list[float]] | None = Field(None, alias="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class CohereImageInfo(BaseModel):
    width: int
    height: int
    format: str
    bit_depth: int


class CohereBilledUnits(BaseModel):
    input_tokens: int
    images: int


class CohereMeta(BaseModel):
    api_version: dict[str, str] = Field(default_factory=lambda: {"version": "2"})
    billed_units: CohereBilledUnits
    tokens: dict[str, int]
    warnings: list[str] = Field(default_factory=list)


class CohereEmbedResponse(BaseModel):
    id: str
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"
    embeddings: CohereEmbeddings
    texts: list[str] = Field(default_factory=list)
    images: list[CohereImageInfo] = Field(default_factory=list)
    model: str = Field(description="The id of the model that produced the embeddings (not a path).")
    meta: CohereMeta


OPENAPI_EXAMPLES: dict[str, Any] = {
    "texts": {"summary": "Search queries",
              "value": {"model": "Qwen/Qwen3-VL-Embedding-2B", "input_type": "search_query",
                        "texts": ["short fur, triangular ears"], "embedding_types": ["float", "int8"]}},
    "images": {"summary": "Images as data: URLs",
               "value": {"model": "Qwen/Qwen3-VL-Embedding-2B", "input_type": "image", "images": [TINY_PNG],
                         "output_dimension": 64}},
    "inputs": {"summary": "Mixed content lists (vLLM's multimodal form)",
               "value": {"model": "Qwen/Qwen3-VL-Embedding-2B", "input_type": "search_document",
                         "inputs": [{"content": [{"type": "text", "text": "a cat in the snow"},
                                                 {"type": "image_url", "image_url": {"url": TINY_PNG}}]}],
                         "embedding_types": ["ubinary", "base64"]}},
}


class CohereRerankRequest(BaseModel):
    """Cohere v2 rerank request (what ``cohere.ClientV2.rerank`` posts); query and documents may also be
    multimodal items, as vLLM's ``/v2/rerank`` takes them."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The served reranker id or an alias.")
    query: RerankInput = Field(description="The search query: text, or an item with images.")
    documents: Annotated[list[RerankInput], Field(min_length=1, max_length=MAX_ITEMS)] = Field(
        description="Texts (or items with images) to judge against the query; results keep their indexes.")
    top_n: int | None = Field(None, ge=1, description="Return only the best N results (default: all).")
    max_tokens_per_doc: int | None = Field(
        None, ge=1, description="Accepted for compatibility; a pair over the model's limit is cut as the "
        "official class cuts it.")
    priority: int | None = Field(None, description="Accepted for compatibility; requests are served in order.")


class CohereRerankResult(BaseModel):
    index: int = Field(description="Position of the document in the request.")
    relevance_score: float = Field(description="P(\"yes\") of the official reranker prompt, in [0, 1].")


class CohereRerankMeta(BaseModel):
    api_version: dict[str, str] = Field(default_factory=lambda: {"version": "2"})
    billed_units: dict[str, int]
    tokens: dict[str, int]


class CohereRerankResponse(BaseModel):
    id: str
    results: list[CohereRerankResult] = Field(description="Best first.")
    meta: CohereRerankMeta
