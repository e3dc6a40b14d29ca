"""The catalog never names a file that is not durable: every batch's blobs and package files are on disk and
covered by a filesystem sync before the catalog commit that records them, with and without overlapped batches.

A spy wraps the real ``syncfs`` (recording which blob and package files exist when each sync runs) and the real
catalog commit (checking, for each image it records, that its files were seen by an earlier sync). Nothing is
mocked: the files, the syncs and the commits are the product's own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import rubricsearch.retrieval.packages.store as package_store
from rubricsearch.indexer.catalog import JobState
from rubricsearch.indexer.jobs import IngestionService
from rubricsearch.indexer.jobs.commit import Unit
from tests.conftest import noise_png
from tests.test_ingestion import make_service, runner  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".tmp")}


@pytest.mark.parametrize("overlapped", [True, False], ids=["overlapped", "one-batch-at-a-time"])
def test_each_batch_is_synced_before_its_commit(make_service: Callable[..., IngestionService],  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch, overlapped: bool) -> None:
    service = make_service()
    package_root = service.embedder.packages.service.store.root
    blob_root = service.blobs.root
    synced: set[Path] = set()
    syncs: list[int] = []
    committed: list[str] = []
    real_syncfs = package_store.syncfs

    def spy_syncfs(*roots: Path) -> None:
        seen = _files(package_root) | _files(blob_root)  # what exists as the sync starts is what it covers
        real_syncfs(*roots)
        synced.update(seen)
        syncs.append(len(seen))

    monkeypatch.setattr(package_store, "syncfs", spy_syncfs)
    work = runner(service, batch_size=4, pipeline=overlapped)
    real_commit = work.processor._commit

    def checked_commit(units: list[Unit]) -> Any:
        for u in units:
            if not u.working or u.backfill:
                continue
            blob = service.blobs.path(u.sha)
            packages = set(package_root.rglob(f"{u.sha}.*.safetensors"))
            assert packages, f"no package file of {u.sha[:12]} at its commit"
            missing = [p for p in (blob, *packages) if p not in synced]
            assert not missing, f"committing {u.sha[:12]} before a sync covered {missing}"
            committed.append(u.sha)
        return real_commit(units)

    monkeypatch.setattr(work.processor, "_commit", checked_commit)
    ref = service.create_set("durable", embedding_dim=64)
    job = service.create_job_from_uploads(ref.id, [(f"{i}.png", noise_png(32 + 4 * i, 40, seed=i))
                                                   for i in range(14)])
    assert work.run_until_idle() == 14
    assert service.get_job(job.id).state == JobState.SUCCEEDED
    assert len(set(committed)) == 14 and len(syncs) >= 4  # every image checked; one sync per batch
