"""Ingestion that no one job or crash can hold up: claims take turns across jobs (a slow URL job does not hold an
upload to another set behind it), and an idle worker sweeps orphan blobs without waiting for a restart. Network
traffic goes to 127.0.0.1 only."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from indexer.sources import NetGuard, UrlFetcher
from tests.conftest import image_server, noise_png
from tests.test_ingestion import make_service, runner  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


def slow_pngs(pause_s: float) -> Callable[[str], tuple[int, bytes]]:
    """An image server's answer: ``/N.png`` is a PNG seeded by N, sent after ``pause_s`` (a slow remote host)."""

    def answer(path: str) -> tuple[int, bytes]:
        time.sleep(pause_s)
        return 200, noise_png(24, 24, seed=int(path.strip("/").split(".")[0]))

    return answer


def test_an_idle_worker_sweeps_orphan_blobs_without_a_restart(make_service) -> None:  # noqa: F811
    """Blobs a deletion cut short left behind (no image row refers to them) go once older than the grace, while
    the worker runs: not only at the next start."""
    import os

    service = make_service()
    orphan = service.blobs.put(noise_png(18, 18, seed=77))
    young = service.blobs.put(noise_png(19, 19, seed=78))
    old, recent = time.time() - 3600, time.time() + 3600
    os.utime(service.blobs.path(orphan), (old, old))
    os.utime(service.blobs.path(young), (recent, recent))  # stays younger than the grace while the test runs
    work = runner(service, temp_grace_s=1.0, poll_interval_s=0.05)
    work.start()
    try:
        deadline = time.monotonic() + 20
        while service.blobs.exists(orphan) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not service.blobs.exists(orphan)
        assert service.blobs.exists(young)  # younger than the grace: maybe work in flight elsewhere
    finally:
        work.stop(10)
        work.processor.close()


def test_a_slow_url_job_does_not_hold_an_upload_to_another_set(make_service) -> None:  # noqa: F811
    """16 URLs that each take 0.6 s, then a 4-image upload to another set: claims take turns across the jobs, so
    the upload is indexed within the first two batches, long before the URL job ends (claimed oldest-job-first
    it waited for every URL batch)."""

    with image_server(slow_pngs(0.6)) as base, UrlFetcher(NetGuard(allow_loopback=True)) as fetcher:
        service = make_service(url_fetcher=fetcher)
        slow_set, other = service.create_set("slow"), service.create_set("other")
        slow = service.create_job_from_urls(slow_set.id, [f"{base}/{900 + i}.png" for i in range(16)])
        upload = service.create_job_from_uploads(other.id, [(f"{i}.png", noise_png(25, 25, seed=950 + i))
                                                            for i in range(4)])
        work = runner(service, batch_size=4, load_threads=2, pipeline=False)
        batches = 0
        while work.run_once() is not None:
            batches += 1
            if service.get_job(upload.id).finished:
                break
        assert service.get_job(upload.id).done == 4 and batches <= 2
        assert not service.get_job(slow.id).finished
        work.run_until_idle()
        assert service.get_job(slow.id).done == 16


def test_urls_are_fetched_on_a_pool_of_their_own(make_service, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """URL items load on the ``ingest-fetch`` threads (as many at once as there are), uploads on the load threads:
    slow servers never occupy the threads that read uploads, archives and folders."""
    from indexer.jobs.pipeline import BatchProcessor

    seen: list[tuple[str, str]] = []
    real = BatchProcessor._load_one

    def spy(self: BatchProcessor, u: object, sources: object) -> object:
        seen.append((u.job.kind, threading.current_thread().name))  # type: ignore[attr-defined]
        return real(self, u, sources)  # type: ignore[arg-type]

    monkeypatch.setattr(BatchProcessor, "_load_one", spy)
    with image_server(slow_pngs(0.3)) as base, UrlFetcher(NetGuard(allow_loopback=True)) as fetcher:
        service = make_service(url_fetcher=fetcher)
        ref = service.create_set("pools")
        service.create_job_from_urls(ref.id, [f"{base}/{700 + i}.png" for i in range(6)])
        service.create_job_from_uploads(ref.id, [(f"{i}.png", noise_png(26, 26, seed=750 + i)) for i in range(3)])
        work = runner(service, batch_size=9, load_threads=1, fetch_threads=6, pipeline=False)
        assert work.run_until_idle() == 9
        work.close()
    kinds = {kind: {name.rsplit("_", 1)[0] for k, name in seen if k == kind} for kind, _ in seen}
    assert kinds == {"url": {"ingest-fetch"}, "upload": {"ingest-load"}}
    assert len({name for k, name in seen if k == "url"}) > 1  # fetched side by side
