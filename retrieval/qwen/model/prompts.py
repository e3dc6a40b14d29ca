"""Prompt plumbing both models share (content, chat-template rendering, token ids with image pads
expanded) and the embedder's prompt exactly as the official Qwen3VLEmbedder builds it. The reranker's
prompt lives with the reranker (``rerank/prompts.py``).

The conversation is rendered with the checkpoint's own chat template; each ``<|image_pad|>`` is then
expanded to the image's token count, which follows from its package's ``grid_thw``, so no pixel work
is needed to tokenize a cached image.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.packages import VisualPackage

IMAGE_PAD = "<|image_pad|>"
EMBED_DEFAULT_INSTRUCTION = "Represent the user's input."


@dataclass
class Content:
    """One side of an input: texts and decoded images (videos are not supported yet)."""

    texts: list[str] = field(default_factory=list)
    images: Sequence[ImageLike] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.images and not any(self.texts)


@dataclass
class Prompt:
    """A rendered prompt: template text plus the images whose pads it holds, in order."""

    text: str
    images: Sequence[ImageLike]


def finish_instruction(instruction: str | None, default: str) -> str:
    """Official rule: strip, and add a period when the instruction does not end in punctuation."""
    if instruction:
        instruction = instruction.strip()
        if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
            instruction += "."
    return instruction or default


def content_parts(content: Content) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image", "image": img.sha256} for img in content.images]
    parts += [{"type": "text", "text": t} for t in content.texts if t]
    return parts


def embed_conversation(content: Content, instruction: str | None, default: str) -> list[dict[str, Any]]:
    """System instruction, then user content: images, then texts; "NULL" for an empty input."""
    user = [{"type": "text", "text": "NULL"}] if content.empty else content_parts(content)
    return [
        {"role": "system", "content": [{"type": "text", "text": finish_instruction(instruction, default)}]},
        {"role": "user", "content": user},
    ]


def render(processor: Any, conversation: list[dict[str, Any]], images: Sequence[ImageLike]) -> Prompt:
    text = processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    if text.count(IMAGE_PAD) != len(images):
        raise InvalidInput("the chat template did not place one image placeholder per image")
    return Prompt(text=text, images=images)


def _template_key(conversation: list[dict[str, Any]]) -> tuple[object, ...]:
    """What a rendering depends on: roles and texts, and where images sit (not which images they are)."""
    return tuple((m["role"], tuple((p["type"], p.get("text")) for p in m["content"])) for m in conversation)


def _without_image_ids(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": m["role"], "content": [{**p, "image": ""} if p["type"] == "image" else p for p in m["content"]]}
            for m in conversation]


class Tokenizer:
    """Renders prompts and turns them into ids with pads expanded, caching both: a search renders the same
    conversation shape for every reference (only the image differs), and a jinja rendering per reranked pair is
    host time worth saving (docs/performance.md, "Measurements behind the code")."""

    CACHE_ENTRIES = 50_000

    def __init__(self, processor: Any, image_token_id: int) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token_id = image_token_id
        self._cache: dict[str, list[int]] = {}
        self._rendered: dict[tuple[object, ...], str] = {}

    def render(self, conversation: list[dict[str, Any]], images: Sequence[ImageLike]) -> Prompt:
        """:func:`render` with the template run once per conversation shape; images enter the template
        without their ids, so a cached text is exactly what rendering this conversation gives."""
        key = _template_key(conversation)
        text = self._rendered.get(key)
        if text is None:
            text = render(self.processor, _without_image_ids(conversation), images).text
            if len(self._rendered) < self.CACHE_ENTRIES:
                self._rendered[key] = text
        if text.count(IMAGE_PAD) != len(images):
            raise InvalidInput("the chat template did not place one image placeholder per image")
        return Prompt(text=text, images=images)

    def _encode(self, segment: str) -> list[int]:
        ids = self._cache.get(segment)
        if ids is None:
            ids = list(self.tokenizer.encode(segment, add_special_tokens=False)) if segment else []
            if len(self._cache) < self.CACHE_ENTRIES:
                self._cache[segment] = ids
        return ids

    def ids(self, prompt: Prompt, packages: Sequence[VisualPackage]) -> list[int]:
        segments = prompt.text.split(IMAGE_PAD)
        out: list[int] = list(self._encode(segments[0]))
        for pkg, segment in zip(packages, segments[1:], strict=True):
            out.extend([self.image_token_id] * pkg.tokens)
            out.extend(self._encode(segment))
        return out
