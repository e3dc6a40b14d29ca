"""Reference metadata: a change to one image, a manifest upload's report, and the filter of a search."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from rubricsearch.indexer.catalog import check_metadata
from rubricsearch.retrieval.errors import InvalidMetadata
from rubricsearch.retrieval.index.filters import Filter, parse_filter

METADATA_EXAMPLE: dict[str, Any] = {"label": "Tabby, rescue 2024", "tags": ["indoor", "striped"],
                                    "category": "cats", "weight_kg": 4.2}
FILTER_EXAMPLE: dict[str, Any] = {
    "must": [{"key": "category", "match": {"value": "boots"}}],
    "must_not": [{"key": "supplier", "match": {"any": ["B", "C"]}}],
    "should": [{"key": "price", "range": {"gte": 20, "lt": 80}}, {"key": "tags", "match": {"value": "sale"}}],
}


def _patch(value: dict[str, Any]) -> dict[str, Any]:
    try:
        return check_metadata(value, patch=True)
    except InvalidMetadata as exc:
        raise ValueError(exc.message) from None


def checked_filter(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A filter's JSON as sent, after :func:`parse_filter` accepted it (422 naming the bad part otherwise)."""
    try:
        parse_filter(value)
    except InvalidMetadata as exc:
        raise ValueError(exc.message) from None
    return value


def to_filter(value: dict[str, Any] | None, facet_min_confidence: float) -> Filter | None:
    return parse_filter(value, facet_min_confidence=facet_min_confidence)


MetadataPatch = Annotated[dict[str, Any], AfterValidator(_patch)]
FilterJSON = Annotated[dict[str, Any] | None, AfterValidator(checked_filter)]
FILTER_DESCRIPTION = (
    "Keep only references whose metadata passes this filter, in Qdrant's filter JSON: `must` / `should` / "
    "`must_not` lists of `{\"key\", \"match\": {\"value\"} | {\"any\": [...]}}`, `{\"key\", \"range\": "
    "{\"gt\", \"gte\", \"lt\", \"lte\"}}` or nested filters; computed facets as `{\"key\": \"facets.<attribute>\", "
    "\"match\": ..., \"min_confidence\"?}` (the chosen value, at that probability or more; by default the "
    "server's facet_min_confidence). "
    "Applied inside the vector search; a filter that "
    "matches nothing gives no hits and says so in `provenance.filter`.")


class ImageMetadataChange(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"metadata": {"label": "Tabby, rescue 2024", "tags": ["indoor"], "supplier": None}}]})

    metadata: MetadataPatch = Field(description="A JSON merge patch: fields given replace the stored ones, "
                                    "`null` removes a field, others stay. At most 64 keys and 16 KiB.")
    replace: bool = Field(False, description="Replace the whole object instead of merging.")


class ManifestOut(BaseModel):
    rows: int = Field(description="Rows read from the manifest.")
    updated: int = Field(description="Images whose metadata was written.")


class ValueCount(BaseModel):
    value: Any
    count: int = Field(description="Images of the set holding this value.")


class MetadataCounts(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"images": 120, "fields": {"category": [{"value": "sneakers", "count": 80}, {"value": "boots", "count": 40}]}},
    ]})

    images: int = Field(description="Images in the set.")
    fields: dict[str, list[ValueCount]] = Field(description="Per metadata key, its most frequent values (each "
                                                "element of a list counts), most frequent first.")
