"""Items in the official shape (``{"text"?, "image"?, "instruction"?}``) parsed into validated content.

A user of the official Qwen3VLEmbedder / Qwen3VLReranker can pass the same dicts here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rubricsearch.retrieval.errors import InvalidInput, UnsupportedMedia
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS, ImageLike, image_handle
from rubricsearch.retrieval.qwen.model.prompts import Content

EMBED_KEYS = frozenset({"text", "image", "instruction", "video", "fps", "max_frames"})
RERANK_KEYS = frozenset({"text", "image", "video", "fps", "max_frames"})


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def parse_content(
    item: Any,
    *,
    allowed: frozenset[str] = RERANK_KEYS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
) -> Content:
    """A str is a text; a dict may carry ``text`` (str or list) and ``image`` (one or a list)."""
    if isinstance(item, str):
        return Content(texts=[item])
    if not isinstance(item, Mapping):
        raise InvalidInput(f"an input must be a string or an object, got {type(item).__name__}")
    unknown = set(item) - allowed
    if unknown:
        raise InvalidInput(f"unknown input field(s): {', '.join(sorted(unknown))}")
    if item.get("video") is not None:
        raise UnsupportedMedia("video inputs are not supported yet; pass frames as images")
    texts = _as_list(item.get("text"))
    if not all(isinstance(t, str) for t in texts):
        raise InvalidInput("'text' must be a string or a list of strings")
    images: list[ImageLike] = [
        image_handle(src, max_bytes=max_bytes, max_pixels=max_pixels) for src in _as_list(item.get("image"))
    ]
    return Content(texts=texts, images=images)


def parse_instruction(item: Any) -> str | None:
    if isinstance(item, Mapping):
        value = item.get("instruction")
        if value is not None and not isinstance(value, str):
            raise InvalidInput("'instruction' must be a string")
        return value
    return None


def parse_embed_items(
    items: Any, *, max_bytes: int = DEFAULT_MAX_BYTES, max_pixels: int = DEFAULT_MAX_DECODED_PIXELS
) -> tuple[list[Content], list[str | None]]:
    """Official ``Qwen3VLEmbedder.process`` items (one dict or str, or a list) -> contents and instructions."""
    if isinstance(items, Mapping | str):
        items = [items]
    contents = [parse_content(item, allowed=EMBED_KEYS, max_bytes=max_bytes, max_pixels=max_pixels) for item in items]
    return contents, [parse_instruction(item) for item in items]
