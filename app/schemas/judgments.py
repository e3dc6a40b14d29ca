"""Judgments of a set: whether a criterion holds for a reference, recorded, listed, imported and derived."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)

from rubricsearch.app.schemas.images import SHA_EXAMPLE
from rubricsearch.indexer.catalog.facets import MAX_VALUES
from rubricsearch.indexer.catalog.judgments import MAX_AUTHOR, MAX_CRITERION, clean_author, clean_criterion
from rubricsearch.retrieval.errors import InvalidInput


def _checked(clean: Callable[[Any], str | None]) -> Callable[[str], str]:
    """The store's own check as a field validator, so a body gets the same rule as a Python caller (as a 422)."""

    def check(value: str) -> str:
        try:
            cleaned = clean(value)
        except InvalidInput as exc:
            raise ValueError(exc.message) from None
        assert cleaned is not None
        return cleaned

    return check


# stripped first, then 1..MAX_CRITERION (MAX_AUTHOR) characters, so the schema's lengths are documented, not
# enforced before stripping (the body's size bounds what arrives)
CriterionText = Annotated[str, AfterValidator(_checked(clean_criterion)),
                          WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_CRITERION})]
Author = Annotated[str, AfterValidator(_checked(clean_author)),
                   WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_AUTHOR})]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$", to_lower=True)]
Source = Literal["person", "api", "derived"]

JUDGMENT_EXAMPLE: dict[str, Any] = {"sha256": SHA_EXAMPLE, "criterion": "has forehead stripes", "holds": True,
                                    "source": "person", "author": "ana"}
OUT_EXAMPLE: dict[str, Any] = {"id": 7, "image_id": 42, **JUDGMENT_EXAMPLE, "created_at": "2026-12-06T14:00:00Z"}


class JudgmentIn(BaseModel):
    """One cell: a reference (by `image_id` or `sha256`), a criterion, and whether it holds."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [JUDGMENT_EXAMPLE]})

    image_id: int | None = Field(None, ge=1, le=2**63 - 1, description="The reference's catalog id in the set.")
    sha256: Sha256 | None = Field(None, description="The reference's sha256 (instead of `image_id`).")
    criterion: CriterionText = Field(description="The criterion as search takes it (stripped, 1..500 characters).")
    holds: StrictBool = Field(description="Whether the criterion holds for the reference.")
    source: Literal["person", "api"] = Field("api", description="`person` when someone looked at the image; "
                                             "`api` for any other client (derived judgments come from `/derive`).")
    author: Author | None = Field(None, description="Who judged (default: the API key's short hash).")

    @model_validator(mode="after")
    def _one_reference(self) -> JudgmentIn:
        if (self.image_id is None) == (self.sha256 is None):
            raise ValueError("name the reference by exactly one of `image_id` or `sha256`")
        return self


class JudgmentLine(BaseModel):
    """A line of a JSONL import: an export's line, read by the reference's sha256 (catalog ids differ between
    catalogs); its `id`, `image_id` and `created_at` are the catalog's and are not read."""

    model_config = ConfigDict(extra="forbid")

    id: int | None = None
    image_id: int | None = None
    created_at: datetime | None = None
    sha256: Sha256
    criterion: CriterionText
    holds: StrictBool
    source: Source = "api"
    author: Author | None = None


class JudgmentOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [OUT_EXAMPLE]})

    id: int = Field(description="Grows with every judgment recorded; a replaced cell gets a new id.")
    image_id: int
    sha256: str
    criterion: str
    holds: bool
    source: Source
    author: str | None
    created_at: datetime


class JudgmentList(BaseModel):
    data: list[JudgmentOut]
    total: int = Field(description="Judgments of the set matching the filter.")
    next_after: int | None = Field(None, description="Pass as `after` for the next page; null on the last page.")


class ImportOut(BaseModel):
    lines: int = Field(description="Judgments read from the upload.")
    data: list[JudgmentOut] = Field(description="The judgment now recorded for each cell, in upload order.")


class DeletedOut(BaseModel):
    deleted: int


class DeriveBody(BaseModel):
    """Judgments implied by a metadata field whose values are mutually exclusive (`breed`: each image's value is a
    "yes" for its statement and a "no" for every other value's)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"key": "breed", "statements": {"tabby": "The cat is a tabby"}, "dry_run": True}]})

    key: str = Field(min_length=1, max_length=64, description="The metadata field; when the set's facet schema "
                     "has an attribute of that name, its values and descriptions are used.")
    statements: dict[str, CriterionText] = Field(
        default_factory=dict, max_length=MAX_VALUES, description="Wording per value, replacing the default (the "
        "facet attribute's description, or \"The <key> is <value>\").")
    dry_run: bool = Field(False, description="Return what would be recorded, and record nothing.")
    overwrite: bool = Field(False, description="Replace cells a person or an API client judged (by default they "
                            "are kept).")
    author: Author | None = None


class StatementOut(BaseModel):
    value: str
    statement: str = Field(description="The criterion judged for this value.")
    yes: int = Field(description="Images for which it holds.")
    no: int


class DerivedOut(BaseModel):
    image_id: int
    sha256: str
    criterion: str
    holds: bool


class DeriveOut(BaseModel):
    key: str
    statements: list[StatementOut]
    images: int = Field(description="Images holding one of the values.")
    skipped_images: int = Field(description="Images whose value is none of the values (nothing derived).")
    kept: int = Field(description="Cells judged by a person or an API client, left as they are.")
    judgments: int = Field(description="Judgments derived (recorded unless `dry_run`).")
    recorded: bool
    preview: list[DerivedOut] = Field(description="The first judgments derived.")

