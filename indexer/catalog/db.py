"""Engine, sessions and migrations for the catalog.

SQLite (the default) gets WAL, foreign keys and a busy timeout, and its transactions are begun by us:
``Catalog.write()`` issues ``BEGIN IMMEDIATE`` so a writer takes the single write lock up front and waits
for it (busy timeout) instead of failing half-way when a read must be upgraded. PostgreSQL needs none of
this. The schema comes only from the Alembic migrations shipped in ``indexer/catalog/migrations``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from rubricsearch.retrieval.errors import BackendUnavailable, require

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_BEGIN_OPTION = "rubricsearch_sqlite_begin"
_PG_MIGRATION_LOCK = 0x72756272  # any constant shared by all rubricsearch processes


def create_engine_for(url: str, *, echo: bool = False, busy_timeout_ms: int = 30_000) -> Engine:
    """Create an engine for a catalog URL (``sqlite:///path.db`` or ``postgresql+psycopg://...``)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            parsed,
            echo=echo,
            connect_args={"timeout": busy_timeout_ms / 1000, "check_same_thread": False},
        )
        _install_sqlite_hooks(engine, busy_timeout_ms)
        return engine
    if parsed.get_backend_name() == "postgresql":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        if parsed.drivername == "postgresql+psycopg":
            require("psycopg", "postgres")
    return create_engine(parsed, echo=echo, pool_pre_ping=True)


def _install_sqlite_hooks(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (see module docstring)
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            _enable_wal(cur, busy_timeout_ms / 1000)
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")


def _enable_wal(cur: Any, timeout_s: float) -> None:
    """Switch the file to WAL (persistent: once per database). The switch needs an exclusive lock, and SQLite
    reports ``database is locked`` at once, without its busy handler, while another connection holds any lock:
    several processes opening a new catalog together (API and workers starting) hit it. So: retry until the
    busy timeout, and skip the switch when the file is in WAL already."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _write_bind(engine: Engine) -> Engine:
    if engine.dialect.name == "sqlite":
        return engine.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})
    return engine


def upgrade_to_head(target: str | Engine) -> str:
    """Create or upgrade the schema to the newest migration; returns the head revision.

    Safe when several processes start at once: PostgreSQL takes an advisory lock and SQLite the write
    lock before Alembic reads the current version.
    """
    from alembic import command

    engine = create_engine_for(target) if isinstance(target, str) else target
    try:
        with _write_bind(engine).begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            config = _alembic_config(conn)
            command.upgrade(config, "head")
    except OperationalError as exc:
        raise BackendUnavailable(f"catalog database is not reachable: {exc.orig}") from exc
    finally:
        if isinstance(target, str):
            engine.dispose()
    return head_revision()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    from alembic.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _alembic_config(conn: Connection | None = None) -> Any:
    """An Alembic Config without an ini file, so migrations run from an installed package."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if conn is not None:
        config.attributes["connection"] = conn
    return config


class Catalog:
    """The catalog database: an engine plus read and write transaction scopes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._read = sessionmaker(bind=engine, expire_on_commit=False)
        self._write = sessionmaker(bind=_write_bind(engine), expire_on_commit=False)

    @classmethod
    def open(cls, url: str, *, migrate: bool = True, echo: bool = False) -> Catalog:
        """Connect, and (by default) bring the schema to head first."""
        engine = create_engine_for(url, echo=echo)
        if migrate:
            upgrade_to_head(engine)
        return cls(engine)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction that commits on success and rolls back on any exception."""
        with self._write() as session, session.begin():
            yield session

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only scope (rolled back at the end); on SQLite it never blocks writers."""
        with self._read() as session:
            try:
                yield session
            finally:
                session.rollback()

    def is_ready(self) -> bool:
        """True when the database answers and the schema is at head (readiness probe)."""
        try:
            return current_revision(self.engine) == head_revision()
        except OperationalError:
            return False

    def table_names(self) -> list[str]:
        return sorted(inspect(self.engine).get_table_names())

    def dispose(self) -> None:
        self.engine.dispose()
