"""Images of a reference set, and JSON imports (URL lists, server folders)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rubricsearch.app.schemas.common import MAX_IMPORT_URLS, ImportUrl, ServerFolder

SHA_EXAMPLE = "9f86d081884c7d65" * 4


IMAGE_EXAMPLE: dict[str, Any] = {
    "id": 42, "sha256": SHA_EXAMPLE, "original_name": "tabby-01.jpg", "width": 640, "height": 480,
    "byte_size": 48213, "status": "indexed", "error": None, "source": "upload",
    "created_at": "2026-01-01T12:00:00Z", "url": f"/v1/images/{SHA_EXAMPLE}",
    "thumbnail_url": f"/v1/images/{SHA_EXAMPLE}/thumbnail",
    "metadata": {"label": "Tabby, rescue 2024", "tags": ["indoor", "striped"], "category": "cats"},
}


class ImageOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [IMAGE_EXAMPLE]})

    id: int = Field(description="Catalog id of the image in this set (used for paging and deletes).")
    sha256: str = Field(description="sha256 of the original bytes; pass `{\"image_id\": sha256}` to search.")
    original_name: str
    width: int | None
    height: int | None
    byte_size: int
    status: Literal["pending", "indexed", "failed"]
    error: str | None
    source: Literal["upload", "zip", "folder", "url"]
    created_at: datetime
    url: str = Field(description="The original bytes.")
    thumbnail_url: str = Field(description="A JPEG thumbnail (`?size=` 64..1024, default 256).")
    metadata: dict[str, Any] = Field(default_factory=dict, description="The reference's metadata: `label`, "
                                     "`tags` and further fields (search filters read them).")
    facets: dict[str, Any] = Field(default_factory=dict, description="Computed attribute facets (never user "
                                   "metadata): per attribute its chosen `value`, that value's probability `p` and "
                                   "every value's `probs`; filter them as `facets.<attribute>`.")


class ImagePage(BaseModel):
    data: list[ImageOut]
    total: int = Field(description="Images of the set matching the filter.")
    next_after: int | None = Field(description="Pass as `after` for the next page; null on the last page.")


class UrlItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: ImportUrl
    metadata: dict[str, Any] = Field(default_factory=dict, description="The image's metadata (`label`, `tags`, "
                                     "further fields).")


class ImportRequest(BaseModel):
    """Exactly one of ``urls`` or ``folder``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"urls": ["https://example.org/cats/tabby-01.jpg", "https://example.org/cats/siamese-07.png"]},
        {"folder": "cats/2024"},
        {"urls": [{"url": "https://example.org/cats/tabby-01.jpg",
                   "metadata": {"label": "Tabby", "tags": ["indoor"]}}]},
    ]})

    urls: list[ImportUrl | UrlItem] | None = Field(
        None, min_length=1, max_length=MAX_IMPORT_URLS,
        description="Public http(s) image URLs, or `{\"url\", \"metadata\"}` objects, fetched by the workers "
        "(private and loopback addresses are "
        "refused unless listed in RUBRICSEARCH_INGEST__URL_ALLOWED_HOSTS).",
    )
    folder: ServerFolder | None = Field(
        None, description="A server folder, relative to RUBRICSEARCH_IMPORT_ROOT or absolute "
        "inside it; 403 when no import root is configured.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ImportRequest:
        if (self.urls is None) == (self.folder is None):
            raise ValueError("give exactly one of `urls` or `folder`")
        return self
