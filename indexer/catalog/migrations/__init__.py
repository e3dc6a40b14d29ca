"""Alembic migrations for the catalog (a package so they ship inside the wheel)."""
