"""``POST /v1/embeddings``: OpenAI's request and response, plus documented multimodal inputs.

Three input forms, all documented here with examples (vLLM documents only the first, which is why
users could not find how to send an image):

1. OpenAI: ``input`` is a string or a list of strings.
2. Items: ``input`` is a list whose entries are strings or ``{"text"?, "image"?, "instruction"?}``
   objects, the official Qwen3-VL-Embedding shape. One embedding per entry.
3. vLLM chat: ``messages`` is one conversation (one embedding) or a list of conversations; a system
   message is the instruction, user content parts are ``text``, ``image_url`` and ``image_id``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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

INSTRUCTION_DOC = (
    "Task instruction, placed in the system prompt exactly like the official Qwen3-VL-Embedding "
    "(default: \"Represent the user's input.\"). A final period is added when missing."
)


class EmbeddingItem(BaseModel):
    """One multimodal input: text, one or more images, or both; its own instruction is optional."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"image": TINY_PNG},
        {"text": "short fur, triangular ears", "image": {"image_id": "9f86d081884c7d65" * 4},
         "instruction": "Find images matching this description"},
    ]})

    text: Text | Annotated[list[Text], Field(max_length=MAX_PARTS)] | None = Field(
        None, description="Text; a list is joined as separate text parts.")
    image: ImageRef | Annotated[list[ImageRef], Field(max_length=MAX_PARTS)] | None = Field(
        None, description="One image or a list of images.")
    instruction: Instruction | None = Field(None, description=INSTRUCTION_DOC)


class ChatMessage(BaseModel):
    """A vLLM-style chat message. ``system`` = instruction; ``user`` = the content to embed; an optional
    trailing ``assistant`` message must be empty (vLLM examples send one)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)]


EmbeddingInput = Annotated[
    Text | Annotated[list[Text | EmbeddingItem], Field(max_length=MAX_ITEMS)],
    Field(description="A string, or a list of strings and/or multimodal items (one embedding per entry)."),
]


class EmbeddingRequest(BaseModel):
    """Give ``input`` or ``messages`` (with ``messages``, ``input`` may be omitted or ``[]``)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="The served model id or an alias; omitted = the embedder.")
    input: EmbeddingInput | None = None
    messages: (Annotated[list[ChatMessage], Field(max_length=MAX_PARTS)]
               | Annotated[list[Annotated[list[ChatMessage], Field(max_length=MAX_PARTS)]], Field(max_length=MAX_ITEMS)]
               | None) = Field(
        None, description="vLLM chat form: one conversation, or a list of conversations (one embedding each)."
    )
    instruction: Instruction | None = Field(
        None, description=INSTRUCTION_DOC + " Applies to entries without their own.")
    dimensions: int | None = Field(
        None, ge=1, description="Matryoshka size: keep the first N values and renormalise (64..hidden size)."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`base64` = little-endian float32 bytes, as OpenAI (the openai client's default)."
    )
    truncate: bool = Field(
        False, description="Over the model's token limit (embedder 8,192, reranker 10,240 tokens, images included), "
        "cut the text as the official classes do; by default such input is refused with 413 `payload_too_large`.")
    user: str | None = Field(None, description="Accepted for OpenAI compatibility and ignored.")
    continue_final_message: bool | None = Field(None, description="vLLM compatibility; ignored.")
    add_special_tokens: bool | None = Field(None, description="vLLM compatibility; ignored.")

    @field_validator("input", mode="before")
    @classmethod
    def _no_token_ids(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(
            isinstance(v, int) or (isinstance(v, list) and all(isinstance(x, int) for x in v)) for v in value
        ):
            raise ValueError("token-id input is not supported; send the text itself")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> EmbeddingRequest:
        has_input = self.input is not None and self.input != []
        if has_input == (self.messages is not None):
            raise ValueError("give exactly one of 'input' and 'messages'")
        return self


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="Floats, or base64 little-endian float32 bytes.")


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str = Field(description="The id of the model that produced the embeddings.")
    usage: Usage


TOKEN_LIMITS = {"embedding": 8_192, "reranker": 10_240}  # the official classes' max_length, images included


class ModelLimits(BaseModel):
    max_tokens: int = Field(description="Tokens per input (embedder) or query+document pair (reranker), images "
                            "included; over it: 413 unless `truncate`.")
    max_inputs: int = Field(description="Inputs per embeddings request, or documents per rerank request.")
    max_image_bytes: int
    max_image_pixels: int = Field(description="Decoded pixels per image (larger images are refused).")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "rubricsearch"
    kind: Literal["embedding", "reranker"]
    revision: str
    aliases: list[str] = Field(default_factory=list, description="Other names accepted in `model`.")
    test_model: bool = Field(False, description="True when demo or random-weight test checkpoints serve instead "
                             "of the configured models.")
    label: str | None = Field(None, description="What the model is when it is not the configured one; else null.")
    dimension: int | None = Field(None, description="Embedding size (embedder only).")
    dimensions_min: int | None = Field(None, description="Smallest Matryoshka `dimensions` accepted (embedder only).")
    limits: ModelLimits


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


OPENAPI_EXAMPLES: dict[str, Any] = {
    "texts": {
        "summary": "Texts (OpenAI form)",
        "value": {"model": "Qwen/Qwen3-VL-Embedding-2B", "input": ["a red cat", "a green dog"], "dimensions": 256},
    },
    "image_data_url": {
        "summary": "An image as a data: URL, with an instruction",
        "value": {"input": [{"image": TINY_PNG, "instruction": "Represent the colours of the image."}]},
    },
    "ingested_image": {
        "summary": "An ingested image by sha256, plus text",
        "value": {"input": [{"text": "dark forehead stripes", "image": {"image_id": "9f86d081884c7d65" * 4}}]},
    },
    "mixed": {
        "summary": "Strings and items mixed; request-wide instruction",
        "value": {"input": ["a cat", {"image": [TINY_PNG, TINY_PNG], "text": "two views"}],
                  "instruction": "Find images matching this description", "encoding_format": "base64"},
    },
    "vllm_messages": {
        "summary": "vLLM chat form (one conversation = one embedding)",
        "value": {"messages": [
            {"role": "system", "content": [{"type": "text", "text": "Represent the user input."}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": TINY_PNG}},
                                         {"type": "text", "text": "A cat in the snow."}]},
            {"role": "assistant", "content": [{"type": "text", "text": ""}]},
        ]},
    },
    "vllm_batched_messages": {
        "summary": "vLLM batched chat form (several conversations)",
        "value": {"messages": [
            [{"role": "user", "content": "a cat"}],
            [{"role": "user", "content": [{"type": "image_id", "image_id": "9f86d081884c7d65" * 4}]}],
        ]},
    },
}
