"""Pytest plugin with catalog and blob-store fixtures (register with ``pytest_plugins``).

``catalog_url`` is parametrised over SQLite (always) and PostgreSQL (when
``RUBRICSEARCH_TEST_POSTGRES_URL`` is set, e.g. by ``scripts/ci_postgres.sh``; marked ``postgres``).
Each PostgreSQL test gets its own schema, dropped afterwards, so tests never see each other's rows.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rubricsearch.indexer.blobs import BlobStore
from rubricsearch.indexer.catalog import Catalog, SetRecord, create_set

POSTGRES_ENV = "RUBRICSEARCH_TEST_POSTGRES_URL"
CATALOG_BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def postgres_base_url() -> str | None:
    return os.environ.get(POSTGRES_ENV) or None


def _postgres_schema_url(base: str, schema: str) -> str:
    from sqlalchemy.engine import make_url

    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False)


@contextlib.contextmanager
def postgres_schema() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh, empty schema, dropped afterwards (skips without a server);
    a context manager, so module-scoped fixtures can hold one too."""
    base = postgres_base_url()
    if base is None:
        pytest.skip(f"{POSTGRES_ENV} is not set (run scripts/ci_postgres.sh)")
    from sqlalchemy import create_engine, text

    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        yield _postgres_schema_url(base, schema)
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    finally:
        admin.dispose()


@pytest.fixture
def postgres_schema_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh, empty schema (skips without a server)."""
    with postgres_schema() as url:
        yield url


@pytest.fixture(params=CATALOG_BACKENDS)
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty catalog database URL (schema not yet created)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    return str(request.getfixturevalue("postgres_schema_url"))


@pytest.fixture
def catalog(catalog_url: str) -> Iterator[Catalog]:
    """A migrated catalog on every configured backend."""
    cat = Catalog.open(catalog_url)
    try:
        yield cat
    finally:
        cat.dispose()


@pytest.fixture
def sqlite_catalog(tmp_path: Path) -> Iterator[Catalog]:
    """A migrated SQLite catalog only (for tests that are about SQLite itself or need no matrix)."""
    cat = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        yield cat
    finally:
        cat.dispose()


@pytest.fixture
def reference_set(catalog: Catalog) -> SetRecord:
    with catalog.write() as s:
        return create_set(s, "products", description="test set", embedding_dim=1024)


@pytest.fixture
def blob_store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")
