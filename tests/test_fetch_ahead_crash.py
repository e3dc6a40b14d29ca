"""A worker killed while it fetches URL items ahead: nothing is half-written, and its restart fetches them again
and indexes every one. Network traffic goes to 127.0.0.1 only."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.catalog import ItemState, JobState
from rubricsearch.indexer.jobs import IngestionService
from tests.test_ingestion_crash import Worker, temp_files
from tests.test_ingestion_fairness import image_server, serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_kill_during_fetch_then_resume(tiny_embedding_dir: Path, tmp_path: Path) -> None:
    """12 URLs whose server holds every answer until released: SIGKILL the worker while it fetches, then check
    that no image, blob, vector or temp file exists and the items are still claimed; a restarted worker (same id)
    hands them back, fetches them again (the server now answers) and indexes all 12."""
    data = tmp_path / "data"
    release = threading.Event()
    asked: list[int] = []

    def held(handler: object, n: int) -> None:
        asked.append(n)
        release.wait(60)
        serve(handler, n)  # type: ignore[arg-type]

    with image_server(held) as base:
        service = IngestionService.open_local(data)
        ref_set = service.create_set("fetched", embedding_dim=64)
        job = service.create_job_from_urls(ref_set.id, [f"{base}/{300 + i}.png" for i in range(12)])
        service.close()
        service.index.close()
        service.catalog.dispose()

        worker = Worker(data, tiny_embedding_dir, "--loopback-urls")
        assert worker.wait_for("READY")
        deadline = time.monotonic() + 60
        while len(asked) < 8 and time.monotonic() < deadline:  # the fetch pool's 8 threads all waiting
            time.sleep(0.05)
        assert len(asked) >= 8, asked
        assert worker.kill()

        service = IngestionService.open_local(data)
        try:
            with service.catalog.read() as s:
                assert cat.list_images(s, ref_set.id, limit=100).items == []
            items = service.job_items(job.id, limit=100)
            assert {i.state for i in items} <= {ItemState.CLAIMED, ItemState.PENDING}
            assert sum(i.state == ItemState.CLAIMED for i in items) >= 8
            assert list(service.blobs.iter_shas()) == [] and temp_files(data) == []
            assert not service.index.has_set(ref_set.id) or service.index.count(ref_set.id) == 0
        finally:
            service.index.close()
            service.catalog.dispose()

        release.set()
        final = Worker(data, tiny_embedding_dir, "--loopback-urls")
        assert final.wait_for("READY")
        assert final.seen[-1].startswith("READY released=") and "released=0 " not in final.seen[-1]
        assert final.wait_for("IDLE", timeout=240), final.stderr()
        assert final.proc.wait(timeout=60) == 0, final.stderr()

    service = IngestionService.open_local(data)
    try:
        done = service.get_job(job.id)
        assert done.state == JobState.SUCCEEDED and done.done == 12 and done.failed == 0, done
        with service.catalog.read() as s:
            rows = cat.list_images(s, ref_set.id, limit=100).items
        assert len(rows) == 12 and service.index.count(ref_set.id) == 12
        assert len(set(service.blobs.iter_shas())) == 12 and temp_files(data) == []
    finally:
        service.index.close()
        service.catalog.dispose()
