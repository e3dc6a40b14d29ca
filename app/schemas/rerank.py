"""``POST /v1/rerank``: the Cohere/Jina shape with image parts and an instruction.

Query and documents are each a string, an item ``{"text"?, "image"?}`` (official Qwen3-VL-Reranker
shape) or vLLM's ``{"content": [parts]}``. Scores are the reranker's P(yes) in [0, 1].
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rubricsearch.app.schemas.common import (
    MAX_ITEMS,
    MAX_PARTS,
    TINY_PNG,
    ContentPart,
    ImageRef,
    Instruction,
    Text,
    Usage,
)


class RerankItem(BaseModel):
    """Text and/or images, or (vLLM form) a list of content parts; not both forms at once."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"text": "a tabby cat", "image": TINY_PNG},
        {"image": {"image_id": "9f86d081884c7d65" * 4}},
        {"content": [{"type": "image_url", "image_url": {"url": TINY_PNG}}]},
    ]})

    text: Text | Annotated[list[Text], Field(max_length=MAX_PARTS)] | None = None
    image: ImageRef | Annotated[list[ImageRef], Field(max_length=MAX_PARTS)] | None = None
    content: Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = Field(
        None, description="vLLM form: text / image_url / image_id parts.")

    @model_validator(mode="after")
    def _one_form(self) -> RerankItem:
        if self.content is not None and (self.text is not None or self.image is not None):
            raise ValueError("give either 'content' or 'text'/'image', not both")
        return self


RerankInput = Text | RerankItem


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="The served reranker id or an alias; omitted = the reranker.")
    query: RerankInput = Field(description="What the documents are judged against: text, image(s), or both.")
    documents: list[RerankInput] = Field(max_length=MAX_ITEMS,
                                         description="Candidates to score; the results keep their indexes.")
    instruction: Instruction | None = Field(
        None,
        description="The judging criterion (`<Instruct>` of the official prompt). Default: "
        "\"Given a search query, retrieve relevant candidates that answer the query.\"",
    )
    top_n: int | None = Field(None, ge=1, description="Return only the best N results (default: all).")
    return_documents: bool = Field(False, description="Echo each document (as sent) in its result.")
    truncate: bool = Field(
        False, description="Over the model's token limit (embedder 8,192, reranker 10,240 tokens, images included), "
        "cut the text as the official classes do; by default such input is refused with 413 `payload_too_large`.")


class RerankResult(BaseModel):
    index: int = Field(description="Position of the document in the request.")
    relevance_score: float = Field(description="sigmoid(logit_yes - logit_no) of the official prompt, in [0, 1].")
    document: dict[str, Any] | None = Field(None, description="The document as sent (strings as {\"text\": ...}).")


class RerankResponse(BaseModel):
    results: list[RerankResult] = Field(description="Best first.")
    model: str
    rerank_status: Literal["ok"] = Field("ok", description="`ok`: every document was scored by the reranker.")
    usage: Usage


OPENAPI_EXAMPLES: dict[str, Any] = {
    "texts": {
        "summary": "Text query, text documents",
        "value": {"query": "a cat with dark forehead stripes", "documents": ["a tabby cat", "a red car"], "top_n": 1},
    },
    "image_query": {
        "summary": "Image query with a rubric instruction against ingested images",
        "value": {
            "query": {"image": TINY_PNG},
            "documents": [{"image": {"image_id": "9f86d081884c7d65" * 4}}, {"text": "a grey cat"}],
            "instruction": "Do the two animals have the same ear shape and fur pattern?",
            "return_documents": True,
        },
    },
    "vllm_content": {
        "summary": "vLLM content-part form",
        "value": {
            "query": "a cat in the snow",
            "documents": [{"content": [{"type": "image_url", "image_url": {"url": TINY_PNG}}]}],
        },
    },
}
