"""Alembic environment: run by ``indexer.catalog.db.upgrade_to_head`` with a live connection.

The ``alembic`` command line also works, for writing new revisions: with an ini file holding only
``[alembic]`` and ``script_location = indexer/catalog/migrations``, run
``alembic -c that.ini -x url=sqlite:///tmp/c.db revision --autogenerate -m "what changed"``,
then rename the file ``NNNN_slug.py`` like ``0001_initial.py`` and review it by hand.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from rubricsearch.indexer.catalog.db import create_engine_for
from rubricsearch.indexer.catalog.tables import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite can only ALTER tables by copying them
        compare_type=True,
    )


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("pass the catalog URL: alembic -x url=sqlite:///data/catalog.db ...")
    engine = create_engine_for(url)
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run them against a database")
run_migrations_online()
