"""``GET /v1/images/{sha256}/visual-package``: an image's vision-tower output, ready for vLLM."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from rubricsearch.app.schemas.common import TINY_PNG, ImageId

MAX_IMAGE_REF_CHARS = 96 << 20  # a data: URL / base64 of an image up to the byte limit (checked again decoded)


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


MAX_PACKAGE_IMAGES = 64  # one package is [tokens, 4*H] values: a few MB of base64 per large image


class PackagesRequest(BaseModel):
    """Images to compute (or fetch cached) packages for, in order."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"images": [TINY_PNG, {"image_id": "9f86d081884c7d65" * 4}], "model": "embedding"}]})

    images: Annotated[list[Annotated[str, StringConstraints(max_length=MAX_IMAGE_REF_CHARS)] | ImageId],
                      Field(min_length=1, max_length=MAX_PACKAGE_IMAGES)] = Field(
        description='`data:` URLs, bare base64 image bytes, `http(s)` URLs (fetched through the server URL '
        'guard: public hosts only unless allowed), or `{"image_id": sha256}` of ingested images.')
    model: str | None = Field(None, description="Whose vision tower: `embedding` (default), `reranker`, or a "
                              "model id; use the model the vLLM server runs.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = as stored (the model's compute dtype)")


class PackagesResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[VisualPackageResponse] = Field(description="One package per image, in request order.")
