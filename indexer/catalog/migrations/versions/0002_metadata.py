"""Metadata per image (JSON; JSONB with a GIN index on PostgreSQL) and per job item (carried to the image).

Revision ID: 0002_metadata
Revises: 0001_initial
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002_metadata"
down_revision: str | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

META = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("images") as batch:
        batch.add_column(sa.Column("meta", META, nullable=False, server_default=sa.text("'{}'")))
    with op.batch_alter_table("job_items") as batch:
        batch.add_column(sa.Column("meta", META, nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.create_index("ix_images_meta", "images", ["meta"], postgresql_using="gin")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_images_meta", table_name="images")
    with op.batch_alter_table("job_items") as batch:
        batch.drop_column("meta")
    with op.batch_alter_table("images") as batch:
        batch.drop_column("meta")
