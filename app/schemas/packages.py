"""``GET /v1/images/{sha256}/visual-package``: an image's vision-tower output, ready for vLLM."""

from __future__ import annotations

from pydantic import BaseModel, Field


class FingerprintOut(BaseModel):
    """What produced the package besides the pixels (two towers with equal weights share packages)."""

    digest: str
    tower: str = Field(description="sha256 of the vision tower's weights")
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int


class VisualPackageResponse(BaseModel):
    """Send ``image_embeds`` and ``image_grid_thw`` to a vLLM server started with ``--enable-mm-embeds``
    as one content part per image: ``{"type": "image_embeds", "image_embeds": {"image_embeds": ...,
    "image_grid_thw": ...}}``."""

    image_sha256: str
    model: str = Field(description="Model whose vision tower produced the package.")
    format: str = Field("vllm", description="Layout of `image_embeds`.")
    image_embeds: str = Field(
        description="base64 of `torch.save(tensor)`, tensor `[tokens, hidden_size * (1 + deepstack_levels)]`: "
        "the merged vision features, then each deepstack level, concatenated on the last axis."
    )
    image_grid_thw: list[int] = Field(description="Pre-merge patch grid `[t, h, w]` (1-D, one image).")
    image_grid_thw_b64: str = Field(
        description="The grid as base64 `torch.save` of an int64 `[3]` tensor (for vLLM before JSON grids)."
    )
    tokens: int = Field(description="Rows of `image_embeds` = `t*h*w / merge_size**2` image tokens.")
    hidden_size: int
    deepstack_levels: int
    width: int = Field(description="`hidden_size * (1 + deepstack_levels)`.")
    dtype: str
    fingerprint: FingerprintOut
    cached: bool = Field(description="True when the package came from the store (no vision encoder run).")
