"""Attribute facets per image, computed from its cached packages (never user metadata, which stays in ``meta``).

Revision ID: 0003_facets
Revises: 0002_metadata
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003_facets"
down_revision: str | None = "0002_metadata"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FACETS = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("images") as batch:
        batch.add_column(sa.Column("facets", FACETS, nullable=False, server_default=sa.text("'{}'")))


def downgrade() -> None:
    with op.batch_alter_table("images") as batch:
        batch.drop_column("facets")
