"""Reference sets: the request to create one and the ``Set`` every route returns."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from rubricsearch.app.schemas.common import StoredText
from rubricsearch.indexer.names import clean_name


class SetCreate(BaseModel):
    """A new, empty reference set. Its vectors use ``dimensions`` (Matryoshka) for its whole life."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"name": "cats", "description": "Reference photos of cat breeds", "dimensions": 1024},
    ]})

    name: Annotated[str, BeforeValidator(lambda v: clean_name(v) if isinstance(v, str) else v)] = Field(
        min_length=1, max_length=200, description="Unique name; routes accept it in place of the id. Stored in "
        "Unicode NFC without control, bidi-formatting or zero-width characters.")
    description: StoredText = ""
    dimensions: int | None = Field(
        None, ge=1, description="Matryoshka size of the set's vectors, 64..the model's hidden size. Default: the "
        "full hidden size. Smaller is faster and lighter, slightly less precise.",
    )


class SetCounts(BaseModel):
    indexed: int = Field(description="Images searchable now.")
    pending: int = Field(description="Images and job items still waiting to be indexed.")
    failed: int = Field(description="Files of the set's ingestion jobs that failed (could not be read or "
                        "decoded; each job lists them with its reason), plus images whose re-indexing failed.")


class SetOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "id": "0f8fad5bd9cb469fa16570867728950e", "name": "cats", "description": "Reference photos of cat breeds",
        "dimensions": 1024, "counts": {"indexed": 120, "pending": 8, "failed": 1},
        "created_at": "2026-01-01T12:00:00Z",
    }]})

    id: str
    name: str
    description: str
    dimensions: int | None = Field(description="Vector size; null only until the embedding model is known.")
    counts: SetCounts
    created_at: datetime


class SetList(BaseModel):
    data: list[SetOut]
