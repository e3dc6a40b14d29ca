"""Catalog schema, sets, images and packages on SQLite and (when configured) PostgreSQL.

Jobs and claims are in ``test_catalog_jobs.py``.
"""

from __future__ import annotations

import hashlib
import threading
from datetime import UTC
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.blobs import BlobStore
from rubricsearch.indexer.catalog import Catalog, ImageSource, ImageStatus, SetRecord
from rubricsearch.indexer.catalog.db import _alembic_config
from rubricsearch.indexer.catalog.tables import Base
from rubricsearch.retrieval.errors import Conflict, InvalidInput, NotFound

TABLES = ["alembic_version", "calibrations", "images", "ingestion_jobs", "job_items", "judgments", "model_activations",
          "model_versions", "package_records", "reference_sets"]


def sha(n: int | str) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def add(s, set_id: str, n: int | str, **kw):
    kw.setdefault("byte_size", 100)
    kw.setdefault("source", ImageSource.UPLOAD)
    kw.setdefault("original_name", f"{n}.png")
    return cat.add_image(s, set_id, sha256=sha(n), **kw)


# -- schema -----------------------------------------------------------------------------------------


def test_migrations_create_schema_matching_models(catalog: Catalog) -> None:
    assert catalog.table_names() == TABLES
    assert cat.current_revision(catalog.engine) == cat.head_revision()
    assert catalog.is_ready()
    with catalog.engine.connect() as conn:
        dialect = conn.dialect.name

        def on_this_dialect(obj, _name, _type, _reflected, _compare_to) -> bool:
            """Objects declared ``ddl_if(dialect=...)`` (the PostgreSQL GIN index) exist only there."""
            condition = getattr(obj, "_ddl_if", None)
            return condition is None or condition.dialect in (None, dialect)

        opts = {"compare_type": True, "include_object": on_this_dialect}
        diffs = compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)
    assert diffs == []


def test_upgrade_is_idempotent_and_downgrade_roundtrips(catalog_url: str) -> None:
    assert cat.upgrade_to_head(catalog_url) == cat.head_revision()
    assert cat.upgrade_to_head(catalog_url) == cat.head_revision()
    engine = cat.create_engine_for(catalog_url)
    try:
        with engine.begin() as conn:
            command.downgrade(_alembic_config(conn), "base")
        assert Catalog(engine).table_names() == ["alembic_version"]
        assert cat.current_revision(engine) is None
        cat.upgrade_to_head(engine)
        assert Catalog(engine).table_names() == TABLES
    finally:
        engine.dispose()


def test_sqlite_connection_settings(sqlite_catalog: Catalog) -> None:
    with sqlite_catalog.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000


def test_unreachable_database_is_backend_unavailable(tmp_path) -> None:
    from rubricsearch.retrieval.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable):
        cat.upgrade_to_head(f"sqlite:///{tmp_path}")  # a directory is not a database file
    with pytest.raises(BackendUnavailable):
        cat.upgrade_to_head("postgresql://nobody:x@127.0.0.1:1/nothing?connect_timeout=2")  # refused


# -- sets -------------------------------------------------------------------------------------------


def test_set_crud(catalog: Catalog) -> None:
    with catalog.write() as s:
        a = cat.create_set(s, "  birds ", description="d", embedding_dim=512, settings={"k": 1})
        b = cat.create_set(s, "aircraft", set_id="aircraft-v1")
    assert a.name == "birds" and len(a.id) == 32 and a.embedding_dim == 512 and a.settings == {"k": 1}
    assert a.created_at.tzinfo is UTC
    assert b.id == "aircraft-v1" and b.embedding_dim is None and b.description == ""
    with catalog.read() as s:
        assert [x.name for x in cat.list_sets(s)] == ["aircraft", "birds"]
        assert cat.get_set(s, a.id) == a
        assert cat.get_set_by_name(s, "birds") == a
        assert cat.resolve_set(s, "aircraft-v1") == b
        assert cat.resolve_set(s, "birds") == a
    with catalog.write() as s:
        c = cat.update_set(s, a.id, name="songbirds", description="new", settings={"x": [1, 2]})
    assert (c.name, c.description, c.settings, c.embedding_dim) == ("songbirds", "new", {"x": [1, 2]}, 512)
    with catalog.write() as s:
        assert cat.delete_set(s, a.id) == []
    with catalog.read() as s:
        assert [x.id for x in cat.list_sets(s)] == ["aircraft-v1"]
        with pytest.raises(NotFound):
            cat.get_set(s, a.id)


def test_set_errors(catalog: Catalog, reference_set: SetRecord) -> None:
    with catalog.write() as s:
        with pytest.raises(Conflict):
            cat.create_set(s, "products")
        with pytest.raises(Conflict):
            cat.create_set(s, "other", set_id=reference_set.id)
        for bad in ("", "   ", "x" * 201, "tab\there"):
            with pytest.raises(InvalidInput):
                cat.create_set(s, bad)
        for bad_id in ("UPPER", "../x", "-lead", "a" * 65):
            with pytest.raises(InvalidInput):
                cat.create_set(s, "fine", set_id=bad_id)
        for dim in (0, -3, True):
            with pytest.raises(InvalidInput):
                cat.create_set(s, "fine", embedding_dim=dim)
        cat.create_set(s, "second")
        with pytest.raises(Conflict):
            cat.update_set(s, reference_set.id, name="second")
        with pytest.raises(NotFound):
            cat.delete_set(s, "nope")
        with pytest.raises(NotFound):
            cat.get_set_by_name(s, "nope")
        # The transaction is still usable after the domain errors above.
        cat.create_set(s, "third")
    with catalog.read() as s:
        assert {x.name for x in cat.list_sets(s)} == {"products", "second", "third"}


def test_write_rolls_back_on_error(catalog: Catalog, reference_set: SetRecord) -> None:
    with pytest.raises(RuntimeError), catalog.write() as s:
        add(s, reference_set.id, 1)
        cat.create_set(s, "half-written")
        raise RuntimeError("crash mid-transaction")
    with catalog.read() as s:
        assert cat.list_images(s, reference_set.id).total == 0
        assert [x.name for x in cat.list_sets(s)] == ["products"]


# -- images -----------------------------------------------------------------------------------------


def test_add_image_dedups_within_a_set_only(catalog: Catalog, reference_set: SetRecord) -> None:
    with catalog.write() as s:
        other = cat.create_set(s, "other")
        img, created = add(s, reference_set.id, 1, width=640, height=480, source_detail="a.zip!1.png")
        again, created_again = add(s, reference_set.id, 1, original_name="renamed.png")
        elsewhere, created_elsewhere = add(s, other.id, 1)
    assert created and not created_again and created_elsewhere
    assert again == img and again.original_name == "1.png"
    assert elsewhere.id != img.id and elsewhere.sha256 == img.sha256
    assert (img.width, img.height, img.status, img.source) == (640, 480, ImageStatus.PENDING, "upload")
    assert img.created_at.tzinfo is UTC and img.indexed_at is None
    with catalog.read() as s:
        assert cat.find_image(s, reference_set.id, sha(1)) == img
        assert cat.find_image(s, reference_set.id, sha(2)) is None
        assert cat.get_image(s, img.id) == img
        with pytest.raises(NotFound):
            cat.get_image(s, img.id, set_id=other.id)
        assert cat.get_images(s, [elsewhere.id, img.id, 10**9]) == {img.id: img, elsewhere.id: elsewhere}
        # a search's hits in one query: the set's own record per hash, hashes not in the set absent
        assert cat.find_images(s, reference_set.id, [sha(2), sha(1), sha(1)]) == {sha(1): img}
        assert cat.find_images(s, other.id, [sha(1)]) == {sha(1): elsewhere}


def test_add_image_validation(catalog: Catalog, reference_set: SetRecord) -> None:
    with catalog.write() as s:
        with pytest.raises(InvalidInput):
            cat.add_image(s, reference_set.id, sha256="../x", byte_size=1, source="upload")
        with pytest.raises(InvalidInput):
            cat.add_image(s, reference_set.id, sha256=sha(1), byte_size=1, source="ftp")
        with pytest.raises(NotFound):
            cat.add_image(s, "missing", sha256=sha(1), byte_size=1, source="url")


def test_list_images_pages_are_stable_and_complete(catalog: Catalog, reference_set: SetRecord) -> None:
    with catalog.write() as s:
        ids = [add(s, reference_set.id, n)[0].id for n in range(23)]
        cat.mark_images_indexed(s, ids[:5])
    seen: list[int] = []
    after = None
    with catalog.read() as s:
        while True:
            page = cat.list_images(s, reference_set.id, limit=10, after_id=after)
            assert page.total == 23
            seen += [i.id for i in page.items]
            if page.next_after is None:
                break
            after = page.next_after
        assert seen == sorted(ids)
        by_offset = [
            i.id for o in (0, 10, 20) for i in cat.list_images(s, reference_set.id, limit=10, offset=o).items
        ]
        assert by_offset == seen
        indexed = cat.list_images(s, reference_set.id, status=ImageStatus.INDEXED, limit=100)
        assert [i.id for i in indexed.items] == ids[:5] and indexed.total == 5 and indexed.next_after is None
        assert cat.count_images(s, reference_set.id) == {
            ImageStatus.PENDING: 18,
            ImageStatus.INDEXED: 5,
            ImageStatus.FAILED: 0,
        }
        for limit, offset in ((0, 0), (1001, 0), (10, -1)):
            with pytest.raises(InvalidInput):
                cat.list_images(s, reference_set.id, limit=limit, offset=offset)
        with pytest.raises(NotFound):
            cat.list_images(s, "missing")


def test_image_status_transitions(catalog: Catalog, reference_set: SetRecord) -> None:
    with catalog.write() as s:
        img, _ = add(s, reference_set.id, 1)
        failed = cat.mark_image_failed(s, img.id, "decoder exploded")
        assert (failed.status, failed.error) == (ImageStatus.FAILED, "decoder exploded")
        done = cat.mark_image_indexed(s, img.id)
        assert done.status == ImageStatus.INDEXED and done.error is None and done.indexed_at is not None
        assert cat.mark_set_pending(s, reference_set.id) == 1
        assert cat.get_image(s, img.id).status == ImageStatus.PENDING
        with pytest.raises(NotFound):
            cat.mark_image_indexed(s, 10**9)
        with pytest.raises(NotFound):
            cat.mark_image_failed(s, 10**9, "x")


def test_blob_deleted_only_when_no_set_references_it(
    catalog: Catalog, reference_set: SetRecord, blob_store: BlobStore
) -> None:
    shared, own = blob_store.put(b"shared image"), blob_store.put(b"own image")
    with catalog.write() as s:
        other = cat.create_set(s, "other")
        a, _ = cat.add_image(s, reference_set.id, sha256=shared, byte_size=12, source="upload")
        b, _ = cat.add_image(s, other.id, sha256=shared, byte_size=12, source="zip")
        c, _ = cat.add_image(s, reference_set.id, sha256=own, byte_size=9, source="folder")
        assert cat.unreferenced_shas(s, [shared, own, sha("x")]) == [sha("x")]
    with catalog.write() as s:
        gone = cat.delete_image(s, a.id, set_id=reference_set.id)
    assert gone.image == a and gone.blob_orphaned is False
    with catalog.write() as s:
        assert cat.is_sha_referenced(s, shared)
        assert not cat.is_sha_referenced(s, shared, excluding_image_id=b.id)
        with pytest.raises(NotFound):
            cat.delete_image(s, c.id, set_id=other.id)
        gone = cat.delete_image(s, b.id)
    assert gone.blob_orphaned is True
    blob_store.delete(gone.image.sha256)
    assert not blob_store.exists(shared) and blob_store.exists(own)
    with catalog.write() as s:
        cat.add_image(s, other.id, sha256=own, byte_size=9, source="url")
        job = cat.create_job(s, reference_set.id, "upload", ["x.png"])
        assert cat.delete_set(s, reference_set.id) == []  # `own` is still used by `other`
        with pytest.raises(NotFound):
            cat.get_job(s, job.id)  # jobs go with their set
        assert cat.delete_set(s, other.id) == [own]


def test_package_records(catalog: Catalog) -> None:
    with catalog.write() as s:
        p = cat.record_package(s, sha(1), "vt:abc/proc:def", 4096)
        assert cat.record_package(s, sha(1), "vt:abc/proc:def", 1) == p  # idempotent
        cat.record_package(s, sha(1), "vt:zzz", 10)
        cat.record_package(s, sha(2), "vt:abc/proc:def", 20)
        assert p.byte_size == 4096 and p.created_at.tzinfo is UTC
        assert cat.get_package(s, sha(1), "vt:abc/proc:def") == p
        assert cat.get_package(s, sha(3), "vt:abc/proc:def") is None
        assert [x.fingerprint for x in cat.list_packages(s, sha256=sha(1))] == ["vt:abc/proc:def", "vt:zzz"]
        assert len(cat.list_packages(s, fingerprint="vt:abc/proc:def")) == 2
        assert cat.delete_packages(s, sha(1), fingerprint="vt:zzz") == 1
        assert cat.delete_packages(s, sha(1)) == 1
        assert [x.sha256 for x in cat.list_packages(s)] == [sha(2)]
        with pytest.raises(InvalidInput):
            cat.record_package(s, sha(1), "", 1)


def test_catalog_works_from_a_fresh_process_view(catalog_url: str) -> None:
    """Two Catalog objects on one URL (API + worker) see each other's commits."""
    api, worker = Catalog.open(catalog_url), Catalog.open(catalog_url)
    try:
        with api.write() as s:
            created = cat.create_set(s, "shared")
        with worker.read() as s:
            assert cat.get_set(s, created.id) == created
        with worker.write() as s:
            s.execute(text("SELECT 1"))
    finally:
        api.dispose()
        worker.dispose()


def _start_together(url: str, starts: int = 4) -> list[BaseException]:
    """``starts`` threads bringing the catalog at ``url`` to head at once; the errors they met."""
    errors: list[BaseException] = []

    def start() -> None:
        try:
            cat.upgrade_to_head(url)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(starts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return errors


def test_concurrent_start_ups_migrate_once(catalog_url: str) -> None:
    """API and workers may start together on an empty database: all must come up at head."""
    errors = _start_together(catalog_url)
    assert not errors, errors
    engine = cat.create_engine_for(catalog_url)
    try:
        assert cat.current_revision(engine) == cat.head_revision()
        assert Catalog(engine).table_names() == TABLES
    finally:
        engine.dispose()


def test_new_sqlite_files_opened_together_come_up(tmp_path: Path) -> None:
    """Four start-ups on a new SQLite file, 20 times: switching the file to WAL fails at once (SQLite's busy
    handler is not asked) while another connection holds a lock; it failed ~1 round in 15 before the retry."""
    for round_ in range(20):
        errors = _start_together(f"sqlite:///{tmp_path / f'c{round_}.db'}")
        assert not errors, (round_, errors)
