"""Catalog tables (SQLAlchemy 2 typed ORM).

The schema is created only by the Alembic migrations next to this file; these classes must match them
(``tests/test_catalog.py`` compares the two). Timestamps are timezone-aware UTC on every backend.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Metadata objects: JSONB on PostgreSQL (GIN-indexed on images), JSON text on SQLite.
MetaJSON = JSON().with_variant(postgresql.JSONB(), "postgresql")

# BIGINT on PostgreSQL, but INTEGER PRIMARY KEY (the rowid alias, which autoincrements) on SQLite.
BigIntId = BigInteger().with_variant(Integer(), "sqlite")

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes everywhere: SQLite keeps naive text, so normalise on the way in and out."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the catalog; use datetime.now(UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class ImageStatus(StrEnum):
    PENDING = "pending"
    INDEXED = "indexed"
    FAILED = "failed"


class ImageSource(StrEnum):
    UPLOAD = "upload"
    ZIP = "zip"
    FOLDER = "folder"
    URL = "url"


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    COMPLETED_WITH_ERRORS = "completed_with_errors"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING)


class JudgmentSource(StrEnum):
    PERSON = "person"
    API = "api"
    DERIVED = "derived"


class ItemState(StrEnum):
    PENDING = "pending"
    CLAIMED = "claimed"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"


def _in(column: str, enum: type[StrEnum]) -> str:
    return f"{column} IN ({', '.join(repr(m.value) for m in enum)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads this class attribute
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
    }


class ReferenceSet(Base):
    __tablename__ = "reference_sets"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    description: Mapped[str] = mapped_column(Text, default="")
    embedding_dim: Mapped[int | None] = mapped_column(Integer)
    settings: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Image(Base):
    __tablename__ = "images"
    __table_args__ = (
        UniqueConstraint("set_id", "sha256"),
        Index("ix_images_set_id_status", "set_id", "status"),
        CheckConstraint(_in("status", ImageStatus), name="status"),
        CheckConstraint(_in("source", ImageSource), name="source"),
        Index("ix_images_meta", "meta", postgresql_using="gin").ddl_if(dialect="postgresql"),
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    set_id: Mapped[str] = mapped_column(String(64), ForeignKey("reference_sets.id", ondelete="CASCADE"))
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    original_name: Mapped[str] = mapped_column(String(1024), default="")
    byte_size: Mapped[int] = mapped_column(BigInteger)
    width: Mapped[int | None] = mapped_column(Integer)
    height: Mapped[int | None] = mapped_column(Integer)
    source: Mapped[str] = mapped_column(String(16))
    source_detail: Mapped[str] = mapped_column(Text, default="")
    status: Mapped[str] = mapped_column(String(16), default=ImageStatus.PENDING.value)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    indexed_at: Mapped[datetime | None] = mapped_column()
    meta: Mapped[dict[str, Any]] = mapped_column(MetaJSON, default=dict, server_default=text("'{}'"))
    # computed attribute facets (indexer/catalog/facets.py), kept apart so user metadata is never overwritten
    facets: Mapped[dict[str, Any]] = mapped_column(MetaJSON, default=dict, server_default=text("'{}'"))


class IngestionJob(Base):
    __tablename__ = "ingestion_jobs"
    __table_args__ = (
        Index("ix_ingestion_jobs_state_created_at", "state", "created_at"),
        CheckConstraint(_in("state", JobState), name="state"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    set_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("reference_sets.id", ondelete="CASCADE"), index=True
    )
    kind: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(32), default=JobState.QUEUED.value)
    options: Mapped[dict[str, Any]] = mapped_column(default=dict)
    total: Mapped[int] = mapped_column(Integer, default=0)
    done: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    skipped: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column()
    heartbeat_at: Mapped[datetime | None] = mapped_column()


class JobItem(Base):
    __tablename__ = "job_items"
    __table_args__ = (
        UniqueConstraint("job_id", "seq"),
        Index("ix_job_items_job_id_state_seq", "job_id", "state", "seq"),
        Index("ix_job_items_state_claimed_at", "state", "claimed_at"),
        CheckConstraint(_in("state", ItemState), name="state"),
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(64), ForeignKey("ingestion_jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    source_ref: Mapped[str] = mapped_column(Text)
    blob_sha256: Mapped[str | None] = mapped_column(String(64))
    image_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("images.id", ondelete="SET NULL"), index=True
    )
    state: Mapped[str] = mapped_column(String(16), default=ItemState.PENDING.value)
    error: Mapped[str | None] = mapped_column(Text)
    claimed_by: Mapped[str | None] = mapped_column(String(200))
    claimed_at: Mapped[datetime | None] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column()
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    meta: Mapped[dict[str, Any] | None] = mapped_column(MetaJSON)  # given with the source, for its image


class PackageRecord(Base):
    """A visual package computed for an image: which fingerprint (model/processor) and how big."""

    __tablename__ = "package_records"
    __table_args__ = (UniqueConstraint("sha256", "fingerprint"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    fingerprint: Mapped[str] = mapped_column(String(128), index=True)
    byte_size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Judgment(Base):
    """Whether a criterion holds for a reference, as someone judged it; one row per (set, image, criterion) cell."""

    __tablename__ = "judgments"
    __table_args__ = (
        # leads with set_id, so it also serves a set's listings and the set-level cascade
        UniqueConstraint("set_id", "image_id", "criterion"),
        CheckConstraint(_in("source", JudgmentSource), name="source"),
        CheckConstraint("length(criterion) BETWEEN 1 AND 500", name="criterion"),
        # ids are never reused (SQLite reuses the largest rowid once it is deleted without AUTOINCREMENT): a
        # calibration identifies what it was fitted on by the largest judgment id and the count
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    set_id: Mapped[str] = mapped_column(String(64), ForeignKey("reference_sets.id", ondelete="CASCADE"))
    image_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("images.id", ondelete="CASCADE"), index=True)
    criterion: Mapped[str] = mapped_column(String(500))
    holds: Mapped[bool] = mapped_column(Boolean)
    source: Mapped[str] = mapped_column(String(16))
    author: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Calibration(Base):
    """A calibration fitted on a set's judgments for one reranker (written and read by ``rerank/calibration``)."""

    __tablename__ = "calibrations"
    __table_args__ = (UniqueConstraint("set_id", "version"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    set_id: Mapped[str] = mapped_column(String(64), ForeignKey("reference_sets.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    fitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    model_key: Mapped[str] = mapped_column(String(256))
    # the judgments it was fitted on: those of the set with id <= max_judgment_id (judgment_count of them)
    max_judgment_id: Mapped[int | None] = mapped_column(BigInteger)
    judgment_count: Mapped[int] = mapped_column(Integer)
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ModelVersion(Base):
    """A model trained for a set (a checkpoint folder under the data dir and its card), never overwritten."""

    __tablename__ = "model_versions"
    __table_args__ = (CheckConstraint("model IN ('reranker', 'embedder')", name="model"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    set_id: Mapped[str] = mapped_column(String(64), ForeignKey("reference_sets.id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(Text)
    card: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ModelActivation(Base):
    """One activation of a set's model: the newest row not rolled back names the active version (none: the base).

    A rollback marks the newest row, so the one before it (or the base) serves again; the rows are the history."""

    __tablename__ = "model_activations"
    __table_args__ = (Index("ix_model_activations_set_id_model", "set_id", "model"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    set_id: Mapped[str] = mapped_column(String(64), ForeignKey("reference_sets.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(16))
    version_id: Mapped[str | None] = mapped_column(String(64), ForeignKey("model_versions.id", ondelete="CASCADE"))
    activated_at: Mapped[datetime] = mapped_column(default=utcnow)
    comparison: Mapped[dict[str, Any]] = mapped_column(default=dict)  # the side-by-side table that allowed it
    rolled_back_at: Mapped[datetime | None] = mapped_column()
