"""Visual packages -> vLLM ``image_embeds`` content parts, validated before they leave the process.

vLLM's Qwen3-VL takes precomputed vision output as one tensor per image, ``[tokens, H*(1+L)]``: the
merged main features, then the L deepstack levels, concatenated on the hidden axis, plus the image's
pre-merge ``image_grid_thw`` as a 1-D ``[t, h, w]``. A wrong shape does not give a 400: a rank-3 tensor
or a width without the deepstack part kills vLLM's engine (every later request fails until restart),
and a grid that disagrees with the row count is silently accepted and yields a wrong prompt
(docs/vllm-notes.md). So every part is checked here and refused with :class:`PackageMismatch`.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rubricsearch.retrieval.errors import PackageMismatch


@dataclass(frozen=True)
class ServedVisionSpec:
    """What the served model expects of an image's embeds (read from its ``config.json``)."""

    hidden_size: int
    num_deepstack: int
    merge_size: int

    def __post_init__(self) -> None:
        if self.hidden_size <= 0 or self.num_deepstack < 0 or self.merge_size <= 0:
            raise ValueError(f"invalid served vision spec: {self}")

    @property
    def width(self) -> int:
        return self.hidden_size * (1 + self.num_deepstack)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ServedVisionSpec:
        """From a Qwen3-VL ``config.json`` dict: LM width, deepstack levels, spatial merge."""
        vision = config.get("vision_config") or {}
        text = config.get("text_config") or {}
        try:
            hidden = int(vision.get("out_hidden_size") or text["hidden_size"])
            levels = len(vision.get("deepstack_visual_indexes") or [])
            merge = int(vision.get("spatial_merge_size", 2))
        except (KeyError, TypeError, ValueError) as exc:
            raise PackageMismatch("model config lacks the Qwen3-VL vision fields", error=str(exc)) from exc
        return cls(hidden_size=hidden, num_deepstack=levels, merge_size=merge)


def check_grid(grid_thw: Sequence[Any] | torch.Tensor, merge_size: int) -> tuple[int, int, int]:
    """A 1-D ``(t, h, w)`` of positive ints whose spatial sides are multiples of the merge size."""
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.dim() != 1 or grid_thw.dtype.is_floating_point:
            raise PackageMismatch("image_grid_thw must be a 1-D integer [t, h, w]", shape=list(grid_thw.shape))
        grid_thw = grid_thw.tolist()
    if isinstance(grid_thw, (str, bytes)) or len(grid_thw) != 3:
        raise PackageMismatch("image_grid_thw must have exactly 3 entries [t, h, w]", grid=repr(grid_thw))
    values: list[int] = []
    for v in grid_thw:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise PackageMismatch("image_grid_thw entries must be positive ints", grid=repr(grid_thw))
        values.append(int(v))
    t, h, w = values
    if h % merge_size or w % merge_size:
        raise PackageMismatch(f"image_grid_thw h and w must be multiples of the merge size {merge_size}", grid=values)
    return t, h, w


def validate_image_embeds(tensor: torch.Tensor, grid_thw: Sequence[Any] | torch.Tensor, spec: ServedVisionSpec) -> None:
    """Refuse anything the served model would crash on or misread (see module docstring)."""
    t, h, w = check_grid(grid_thw, spec.merge_size)
    if tensor.dim() != 2:
        raise PackageMismatch(
            f"image_embeds must be rank 2 [tokens, {spec.width}], got rank {tensor.dim()}",
            shape=list(tensor.shape),
        )
    rows, width = tensor.shape
    if width != spec.width:
        raise PackageMismatch(
            f"image_embeds width {width} != hidden {spec.hidden_size} x (1 + {spec.num_deepstack} deepstack)",
            shape=list(tensor.shape),
            expected_width=spec.width,
        )
    expected_rows = t * h * w // (spec.merge_size**2)
    if rows != expected_rows:
        raise PackageMismatch(
            f"image_embeds has {rows} rows but grid {[t, h, w]} needs {expected_rows}",
            shape=list(tensor.shape),
            grid=[t, h, w],
        )
    if not tensor.dtype.is_floating_point:
        raise PackageMismatch(f"image_embeds must be floating point, got {tensor.dtype}")
    if not bool(torch.isfinite(tensor).all()):
        raise PackageMismatch("image_embeds contains NaN or infinite values")


def concat_package(embeds: torch.Tensor, deepstack: torch.Tensor | None) -> torch.Tensor:
    """``[tokens, H]`` + ``[L, tokens, H]`` -> ``[tokens, H*(1+L)]`` (main first, levels in order)."""
    if embeds.dim() != 2:
        raise PackageMismatch(f"embeds must be [tokens, H], got shape {list(embeds.shape)}")
    if deepstack is None or deepstack.numel() == 0:
        return embeds
    if deepstack.dim() != 3 or deepstack.shape[1:] != embeds.shape:
        raise PackageMismatch(
            f"deepstack {list(deepstack.shape)} does not fit embeds {list(embeds.shape)} (want [L, tokens, H])"
        )
    return torch.cat([embeds, *deepstack.unbind(0)], dim=-1)


def encode_tensor(tensor: torch.Tensor) -> str:
    """Base64 of ``torch.save`` (what vLLM's ``torch.load(weights_only=True)`` reads; keeps bf16)."""
    buf = io.BytesIO()
    # clone(): torch.save writes a view's whole storage, so never ship a slice of something bigger.
    torch.save(tensor.detach().to("cpu").contiguous().clone(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def image_embeds_part(
    embeds: torch.Tensor,
    deepstack: torch.Tensor | None,
    grid_thw: Sequence[Any] | torch.Tensor,
    spec: ServedVisionSpec,
    *,
    dtype: torch.dtype | None = None,
    uuid: str | None = None,
) -> dict[str, Any]:
    """One validated ``{"type": "image_embeds", ...}`` content part for one image.

    ``dtype`` converts before sending (e.g. the served dtype); ``uuid`` lets vLLM key its caches by
    the caller's content hash instead of hashing the payload.
    """
    if deepstack is not None and deepstack.dim() == 3 and deepstack.shape[0] != spec.num_deepstack:
        raise PackageMismatch(
            f"package has {deepstack.shape[0]} deepstack levels, the served model expects {spec.num_deepstack}"
        )
    if deepstack is None and spec.num_deepstack:
        raise PackageMismatch(f"package has no deepstack features, the served model expects {spec.num_deepstack}")
    if embeds.dim() == 2 and embeds.shape[1] != spec.hidden_size:
        raise PackageMismatch(f"embeds width {embeds.shape[1]} != served hidden size {spec.hidden_size}")
    tensor = concat_package(embeds, deepstack)
    if dtype is not None:
        tensor = tensor.to(dtype)
    validate_image_embeds(tensor, grid_thw, spec)
    grid = list(check_grid(grid_thw, spec.merge_size))
    part: dict[str, Any] = {
        "type": "image_embeds",
        "image_embeds": {"image_embeds": encode_tensor(tensor), "image_grid_thw": grid},
    }
    if uuid is not None:
        part["uuid"] = uuid
    return part


def payload_bytes(part: Mapping[str, Any]) -> int:
    """Approximate request bytes one part adds (for batching under a body-size budget)."""
    inner = part.get("image_embeds") or {}
    data = inner.get("image_embeds", "") if isinstance(inner, Mapping) else ""
    return len(data) + 64 if isinstance(data, str) else 64


def tokens_for_grid(grid_thw: Sequence[int], merge_size: int) -> int:
    """Number of ``<|image_pad|>`` tokens an image with this grid occupies in the prompt."""
    return math.prod(int(v) for v in grid_thw) // (merge_size**2)


def resized_image_part(
    image: Any, *, min_pixels: int, max_pixels: int, patch_size: int = 16, uuid: str | None = None
) -> dict[str, Any]:
    """A PIL image as an ``image_url`` part, resized exactly as the official embedder does.

    ``qwen_vl_utils.fetch_image`` (smart_resize to multiples of patch*merge within min/max pixels)
    runs here, so a server started with the same min/max pixels (``--mm-processor-kwargs``) keeps the
    size and sees the official pixels; PNG keeps them lossless.
    """
    from qwen_vl_utils import fetch_image

    resized = fetch_image(
        {"image": image, "min_pixels": min_pixels, "max_pixels": max_pixels}, image_patch_size=patch_size
    )
    buf = io.BytesIO()
    resized.save(buf, format="PNG")
    part: dict[str, Any] = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")},
    }
    if uuid is not None:
        part["uuid"] = uuid
    return part
