"""Immutable records returned by the repository functions.

Callers get plain frozen dataclasses, not live ORM objects: they stay valid after the session closes,
can cross threads, and FastAPI/pydantic can read them with ``from_attributes``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Generic, TypeVar

from rubricsearch.indexer.catalog.tables import (
    Image,
    ImageSource,
    ImageStatus,
    IngestionJob,
    ItemState,
    JobItem,
    JobState,
    PackageRecord,
    ReferenceSet,
)
from rubricsearch.retrieval.index.filters import facet_payload
from rubricsearch.retrieval.index.values import value_problem

T = TypeVar("T")
log = logging.getLogger(__name__)


def _columns(cls: type, row: Any, **override: Any) -> dict[str, Any]:
    values = {f.name: getattr(row, f.name) for f in fields(cls) if f.name not in override}
    values.update(override)
    return values


@dataclass(frozen=True, slots=True)
class SetRecord:
    id: str
    name: str
    description: str
    embedding_dim: int | None
    settings: dict[str, Any]
    created_at: datetime

    @classmethod
    def of(cls, row: ReferenceSet) -> SetRecord:
        return cls(**_columns(cls, row, settings=dict(row.settings or {})))


@dataclass(frozen=True, slots=True)
class ImageRecord:
    id: int
    set_id: str
    sha256: str
    original_name: str
    byte_size: int
    width: int | None
    height: int | None
    source: ImageSource
    source_detail: str
    status: ImageStatus
    error: str | None
    created_at: datetime
    indexed_at: datetime | None
    meta: dict[str, Any] = field(default_factory=dict)
    facets: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, row: Image) -> ImageRecord:
        return cls(**_columns(cls, row, source=ImageSource(row.source), status=ImageStatus(row.status),
                              meta=_servable(row, dict(row.meta or {})), facets=dict(row.facets or {})))

    @property
    def payload(self) -> dict[str, Any]:
        """What the index holds for filters: the metadata and the computed facets' payload keys."""
        return {**self.meta, **facet_payload(self.facets)}


def _servable(row: Image, meta: dict[str, Any]) -> dict[str, Any]:
    """The metadata without the fields an older version let in that cannot be served (a lone surrogate, a NUL, an
    integer beyond int64): each is logged and left out of listings, exports, searches and the index payload, so
    one such field never breaks its set. A PATCH setting the field (or ``null``) replaces it."""
    bad = {key: problem for key, value in meta.items() if (problem := value_problem(value)) is not None}
    if not bad:
        return meta
    for key, problem in bad.items():
        log.warning("image %s of set %s: metadata field %r skipped: %s", row.sha256, row.set_id, key, problem)
    return {key: value for key, value in meta.items() if key not in bad}


@dataclass(frozen=True, slots=True)
class ImageDeletion:
    """What a delete removed, and whether its blob is now unreferenced (delete it after commit)."""

    image: ImageRecord
    blob_orphaned: bool


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: str
    set_id: str
    kind: str
    state: JobState
    options: dict[str, Any]
    total: int
    done: int
    failed: int
    skipped: int
    cancel_requested: bool
    error: str | None
    worker_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None

    @classmethod
    def of(cls, row: IngestionJob) -> JobRecord:
        return cls(**_columns(cls, row, state=JobState(row.state), options=dict(row.options or {})))

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def processed(self) -> int:
        return self.done + self.failed + self.skipped

    @property
    def progress(self) -> float:
        """Fraction of items processed, 1.0 for an empty job."""
        return 1.0 if self.total == 0 else min(1.0, self.processed / self.total)


@dataclass(frozen=True, slots=True)
class ItemRecord:
    id: int
    job_id: str
    seq: int
    source_ref: str
    blob_sha256: str | None
    image_id: int | None
    state: ItemState
    error: str | None
    claimed_by: str | None
    claimed_at: datetime | None
    finished_at: datetime | None
    attempts: int
    meta: dict[str, Any] | None = None

    @classmethod
    def of(cls, row: JobItem) -> ItemRecord:
        return cls(**_columns(cls, row, state=ItemState(row.state)))


@dataclass(frozen=True, slots=True)
class ItemSpec:
    """One unit of work when a job is created: where the bytes come from, and their sha if known."""

    source_ref: str
    blob_sha256: str | None = None
    meta: dict[str, Any] | None = None  # checked metadata for the image it becomes


@dataclass(frozen=True, slots=True)
class PackageInfo:
    sha256: str
    fingerprint: str
    byte_size: int
    created_at: datetime

    @classmethod
    def of(cls, row: PackageRecord) -> PackageInfo:
        return cls(**_columns(cls, row))


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a stable listing; pass ``next_after`` back as ``after_id`` for the next page."""

    items: list[T]
    total: int
    limit: int
    offset: int
    next_after: int | None = field(default=None)
