"""Attribute facets: a set's schema, and how many references hold each computed value."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_EXAMPLE: dict[str, Any] = {"attributes": [
    {"name": "ear_shape", "values": ["upright triangular", "round",
                                     {"value": "folded", "description": "The ears fold forward"}]},
    {"name": "fur_length", "values": ["short", "long"]},
]}


class FacetValueIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: str = Field(description="The value as filters and counts name it.")
    description: str | None = Field(None, description="What the model judges instead of \"The <attribute> is "
                                    "<value>\".")


class FacetAttributeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The attribute, filtered as `facets.<name>` (1-48 letters, digits, '_' or '-').")
    values: list[str | FacetValueIn] = Field(description="Its 2..32 mutually exclusive values.")


class FacetSchemaIn(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [SCHEMA_EXAMPLE]})

    attributes: list[FacetAttributeIn] = Field(description="At most 32 attributes.")


class FacetSchemaOut(BaseModel):
    version: int = Field(description="Grows with every change; 0 before any schema was given.")
    attributes: list[dict[str, Any]] = Field(description="Each attribute's `name` and `values` "
                                             "(`{\"value\", \"description\"}`).")
    stale: int = Field(description="Indexed references whose facets are out of date with this schema.")


class FacetCounts(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"images": 120, "min_confidence": 0.5, "schema_version": 2,
         "attributes": {"ear_shape": {"upright triangular": 70, "round": 30, "folded": 12}}}]})

    images: int = Field(description="References that have computed facets.")
    min_confidence: float = Field(description="A reference counts for its chosen value at this probability or more.")
    schema_version: int
    attributes: dict[str, dict[str, int]] = Field(description="Per attribute, references per chosen value.")
