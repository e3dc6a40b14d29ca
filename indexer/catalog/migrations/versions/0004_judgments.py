"""Judgments (does a criterion hold for a reference, as someone judged it) and the calibrations fitted on them.

Revision ID: 0004_judgments
Revises: 0003_facets
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_judgments"
down_revision: str | None = "0003_facets"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the values allowed at this revision (never import live enums into a migration).
JUDGMENT_SOURCE = ("person", "api", "derived")

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _in(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    op.create_table(
        "judgments",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("set_id", sa.String(64), nullable=False),
        sa.Column("image_id", sa.BigInteger(), nullable=False),
        sa.Column("criterion", sa.String(500), nullable=False),
        sa.Column("holds", sa.Boolean(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("author", sa.String(200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_judgments"),
        sa.ForeignKeyConstraint(
            ["set_id"], ["reference_sets.id"], name="fk_judgments_set_id_reference_sets", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["image_id"], ["images.id"], name="fk_judgments_image_id_images", ondelete="CASCADE"),
        sa.UniqueConstraint("set_id", "image_id", "criterion", name="uq_judgments_set_id_image_id_criterion"),
        sa.CheckConstraint(_in("source", JUDGMENT_SOURCE), name="ck_judgments_source"),
        sa.CheckConstraint("length(criterion) BETWEEN 1 AND 500", name="ck_judgments_criterion"),
        sqlite_autoincrement=True,  # ids never reused: calibrations name their judgments by the largest id
    )
    op.create_index("ix_judgments_image_id", "judgments", ["image_id"])

    op.create_table(
        "calibrations",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("set_id", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("fitted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model_key", sa.String(256), nullable=False),
        sa.Column("max_judgment_id", sa.BigInteger(), nullable=True),
        sa.Column("judgment_count", sa.Integer(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_calibrations"),
        sa.ForeignKeyConstraint(
            ["set_id"], ["reference_sets.id"], name="fk_calibrations_set_id_reference_sets", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("set_id", "version", name="uq_calibrations_set_id_version"),
    )


def downgrade() -> None:
    op.drop_table("calibrations")
    op.drop_table("judgments")
