"""Initial catalog: reference sets, images, ingestion jobs and items, package records.

Revision ID: 0001_initial
Revises:
Create Date: 2026-05-20
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the values allowed at this revision (never import live enums into a migration).
IMAGE_STATUS = ("pending", "indexed", "failed")
IMAGE_SOURCE = ("upload", "zip", "folder", "url")
JOB_STATE = ("queued", "running", "succeeded", "completed_with_errors", "failed", "cancelled")
ITEM_STATE = ("pending", "claimed", "done", "failed", "skipped", "cancelled")

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _in(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _ts(name: str, nullable: bool) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "reference_sets",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("embedding_dim", sa.Integer(), nullable=True),
        sa.Column("settings", sa.JSON(), nullable=False),
        _ts("created_at", False),
        sa.PrimaryKeyConstraint("id", name="pk_reference_sets"),
        sa.UniqueConstraint("name", name="uq_reference_sets_name"),
    )
    op.create_table(
        "images",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("set_id", sa.String(64), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("original_name", sa.String(1024), nullable=False),
        sa.Column("byte_size", sa.BigInteger(), nullable=False),
        sa.Column("width", sa.Integer(), nullable=True),
        sa.Column("height", sa.Integer(), nullable=True),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("source_detail", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("created_at", False),
        _ts("indexed_at", True),
        sa.PrimaryKeyConstraint("id", name="pk_images"),
        sa.ForeignKeyConstraint(
            ["set_id"], ["reference_sets.id"], name="fk_images_set_id_reference_sets", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("set_id", "sha256", name="uq_images_set_id_sha256"),
        sa.CheckConstraint(_in("status", IMAGE_STATUS), name="ck_images_status"),
        sa.CheckConstraint(_in("source", IMAGE_SOURCE), name="ck_images_source"),
    )
    op.create_index("ix_images_sha256", "images", ["sha256"])
    op.create_index("ix_images_set_id_status", "images", ["set_id", "status"])

    op.create_table(
        "ingestion_jobs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("set_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("done", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("skipped", sa.Integer(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("worker_id", sa.String(200), nullable=True),
        _ts("created_at", False),
        _ts("started_at", True),
        _ts("finished_at", True),
        _ts("heartbeat_at", True),
        sa.PrimaryKeyConstraint("id", name="pk_ingestion_jobs"),
        sa.ForeignKeyConstraint(
            ["set_id"],
            ["reference_sets.id"],
            name="fk_ingestion_jobs_set_id_reference_sets",
            ondelete="CASCADE",
        ),
        sa.CheckConstraint(_in("state", JOB_STATE), name="ck_ingestion_jobs_state"),
    )
    op.create_index("ix_ingestion_jobs_set_id", "ingestion_jobs", ["set_id"])
    op.create_index("ix_ingestion_jobs_state_created_at", "ingestion_jobs", ["state", "created_at"])

    op.create_table(
        "job_items",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("source_ref", sa.Text(), nullable=False),
        sa.Column("blob_sha256", sa.String(64), nullable=True),
        sa.Column("image_id", sa.BigInteger(), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("claimed_by", sa.String(200), nullable=True),
        _ts("claimed_at", True),
        _ts("finished_at", True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_job_items"),
        sa.ForeignKeyConstraint(
            ["job_id"], ["ingestion_jobs.id"], name="fk_job_items_job_id_ingestion_jobs", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["image_id"], ["images.id"], name="fk_job_items_image_id_images", ondelete="SET NULL"
        ),
        sa.UniqueConstraint("job_id", "seq", name="uq_job_items_job_id_seq"),
        sa.CheckConstraint(_in("state", ITEM_STATE), name="ck_job_items_state"),
    )
    op.create_index("ix_job_items_image_id", "job_items", ["image_id"])
    op.create_index("ix_job_items_job_id_state_seq", "job_items", ["job_id", "state", "seq"])
    op.create_index("ix_job_items_state_claimed_at", "job_items", ["state", "claimed_at"])

    op.create_table(
        "package_records",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("fingerprint", sa.String(128), nullable=False),
        sa.Column("byte_size", sa.BigInteger(), nullable=False),
        _ts("created_at", False),
        sa.PrimaryKeyConstraint("id", name="pk_package_records"),
        sa.UniqueConstraint("sha256", "fingerprint", name="uq_package_records_sha256_fingerprint"),
    )
    op.create_index("ix_package_records_sha256", "package_records", ["sha256"])
    op.create_index("ix_package_records_fingerprint", "package_records", ["fingerprint"])


def downgrade() -> None:
    op.drop_table("package_records")
    op.drop_table("job_items")
    op.drop_table("ingestion_jobs")
    op.drop_table("images")
    op.drop_table("reference_sets")
