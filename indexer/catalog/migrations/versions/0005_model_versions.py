"""Model versions trained for a set and the history of which one is active.

Revision ID: 0005_model_versions
Revises: 0004_judgments
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_model_versions"
down_revision: str | None = "0004_judgments"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "model_versions",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("set_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(16), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("card", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_model_versions"),
        sa.ForeignKeyConstraint(
            ["set_id"], ["reference_sets.id"], name="fk_model_versions_set_id_reference_sets", ondelete="CASCADE"
        ),
        sa.CheckConstraint("model IN ('reranker', 'embedder')", name="ck_model_versions_model"),
    )
    op.create_index("ix_model_versions_set_id", "model_versions", ["set_id"])

    op.create_table(
        "model_activations",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("set_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(16), nullable=False),
        sa.Column("version_id", sa.String(64), nullable=True),
        sa.Column("activated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("comparison", sa.JSON(), nullable=False),
        sa.Column("rolled_back_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_model_activations"),
        sa.ForeignKeyConstraint(
            ["set_id"], ["reference_sets.id"], name="fk_model_activations_set_id_reference_sets", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["version_id"], ["model_versions.id"], name="fk_model_activations_version_id_model_versions",
            ondelete="CASCADE"
        ),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_model_activations_set_id_model", "model_activations", ["set_id", "model"])


def downgrade() -> None:
    op.drop_table("model_activations")
    op.drop_table("model_versions")
