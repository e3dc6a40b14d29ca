"""Ingestion jobs as the API shows them."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

JobStateName = Literal["queued", "running", "succeeded", "completed_with_errors", "failed", "cancelled"]


class JobErrorOut(BaseModel):
    ref: str = Field(description="The item: file name, archive entry, URL or path ('' for the job as a whole).")
    error: str = Field(description="`<kind>: <message>`, e.g. `invalid_image: cannot identify image file`.")


class JobIgnoredOut(BaseModel):
    ref: str = Field(description="The archive entry, file or URL the source saw but did not offer as an image.")
    reason: str = Field(description="Why, e.g. `nested archives are not opened`, `not an image file name (.txt)`.")


class JobManifestOut(BaseModel):
    name: str = Field(description="The manifest at the source's root: `manifest.csv` or `manifest.jsonl`.")
    images: int = Field(description="The job's images it gives metadata (each row's image, with that row's fields).")


class JobOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "id": "5b1a0c6e2f1d4c0c9a8e7d6c5b4a3f21", "set_id": "0f8fad5bd9cb469fa16570867728950e", "kind": "zip",
        "state": "running", "total": 120, "done": 64, "failed": 1, "skipped": 2, "progress": 0.5583,
        "source": "zoo.zip", "manifest": {"name": "manifest.csv", "images": 118}, "ignored": 1,
        "ignored_entries": [{"ref": "zoo/README.txt", "reason": "not an image file name (.txt)"}],
        "errors": [{"ref": "zoo/broken.jpg", "error": "invalid_image: image file is truncated"}],
        "created_at": "2026-01-01T12:00:00Z", "started_at": "2026-01-01T12:00:01Z", "finished_at": None,
    }]})

    id: str
    set_id: str
    kind: Literal["upload", "zip", "folder", "url"] | str
    state: JobStateName
    total: int = Field(description="Items (images found in the source).")
    done: int = Field(description="Items indexed.")
    failed: int
    skipped: int = Field(description="Items skipped as duplicates of an image already in the set.")
    source: str = Field(description="What the job reads: the archive's name, the folder, `N URLs` or "
                        "`N uploaded files`.")
    manifest: JobManifestOut | None = Field(None, description="The manifest applied with the job's images (a zip's "
                                            "or a folder's); null when the source has none.")
    ignored: int = Field(0, description="Entries of the source that were not images (not counted in `total`).")
    ignored_entries: list[JobIgnoredOut] = Field(
        default_factory=list, description="The first of those entries with the reason each was ignored.")
    progress: float = Field(ge=0, le=1, description="(done + failed + skipped) / total; 1 for an empty job.")
    errors: list[JobErrorOut] = Field(description="The first 100 failed items with their reasons.")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    paused: str | None = Field(None, description="Why an unfinished job is not progressing now (the server's disk "
                               "is full); it resumes by itself. Null otherwise.")


class JobList(BaseModel):
    data: list[JobOut]
