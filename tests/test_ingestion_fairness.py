"""Ingestion that no one job or crash can hold up: claims take turns across jobs, URL items are fetched ahead of
the batches (a slow or silent server never holds a batch, so an upload to another set is not held behind it), and
an idle worker sweeps orphan blobs without waiting for a restart. Network traffic goes to 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

import pytest

from rubricsearch.indexer.catalog import ItemState
from rubricsearch.indexer.sources import NetGuard, UrlFetcher
from tests.conftest import http_server, noise_png
from tests.test_ingestion import make_service, runner  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


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


def image_server(answer: Callable[[BaseHTTPRequestHandler, int], None]) -> contextlib.AbstractContextManager[str]:
    """A loopback HTTP server whose ``GET /<n>.png`` runs ``answer(handler, n)`` (conftest's :func:`http_server`);
    ``serve`` (below) is the usual answer: a noise PNG seeded by ``n``."""
    return http_server(lambda handler: answer(handler, int(handler.path.strip("/").split(".")[0])))


def serve(handler: BaseHTTPRequestHandler, n: int, delay_s: float = 0.0) -> None:
    time.sleep(delay_s)
    body = noise_png(24, 24, seed=n)
    handler.send_response(200)
    handler.send_header("Content-Type", "image/png")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_a_slow_url_job_does_not_hold_an_upload_to_another_set(make_service) -> None:  # noqa: F811
    """16 URLs that each take 0.6 s, then a 4-image upload to another set: the upload is indexed by the first two
    batches, long before the URL job ends (claimed oldest-job-first it waited for every URL batch)."""
    with image_server(lambda h, n: serve(h, n, 0.6)) as base, \
            UrlFetcher(NetGuard(allow_loopback=True)) as fetcher:
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
        work.close()


def test_urls_are_fetched_on_a_pool_of_their_own(make_service, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """URLs are fetched on the ``ingest-fetch`` threads (as many at once as there are), uploads read on the load
    threads: slow servers never occupy the threads that read uploads, archives and folders."""
    from rubricsearch.indexer.jobs.pipeline import BatchProcessor

    seen: list[tuple[str, str]] = []
    real_fetch, real_load = UrlFetcher.fetch, BatchProcessor._load_one

    def fetch(self: UrlFetcher, url: str, **kw: object) -> bytes:
        seen.append(("url", threading.current_thread().name))
        return real_fetch(self, url, **kw)  # type: ignore[arg-type]

    def load(self: BatchProcessor, u: object, sources: object) -> object:
        if u.job.kind == "upload":  # type: ignore[attr-defined]
            seen.append(("upload", threading.current_thread().name))
        return real_load(self, u, sources)  # type: ignore[arg-type]

    monkeypatch.setattr(UrlFetcher, "fetch", fetch)
    monkeypatch.setattr(BatchProcessor, "_load_one", load)
    with image_server(lambda h, n: serve(h, n, 0.3)) as base, \
            UrlFetcher(NetGuard(allow_loopback=True)) as fetcher:
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


def test_silent_urls_never_hold_the_worker(make_service) -> None:  # noqa: F811
    """32 URLs whose server never answers (16) or trickles a byte a second (16), then a 5-image upload to another
    set, on a background worker: the upload is indexed before any URL reaches its deadline (were URLs fetched in
    the batches, the upload's items would share a batch with them and wait for the deadline), and every URL then
    fails alone with its timeout."""
    deadline_s = 6.0
    gone = threading.Event()

    def answer(handler: BaseHTTPRequestHandler, n: int) -> None:
        if n % 2:  # silent
            gone.wait(60)
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Content-Length", "100000")
        handler.end_headers()
        while not gone.wait(1.0):  # trickle, a byte at a time
            with contextlib.suppress(OSError):
                handler.wfile.write(b"\0")
                handler.wfile.flush()

    with image_server(answer) as base, UrlFetcher(NetGuard(allow_loopback=True), read_timeout=deadline_s,
                                                  total_timeout=deadline_s) as fetcher:
        service = make_service(url_fetcher=fetcher)
        slow_set, other = service.create_set("silent"), service.create_set("other")
        slow = service.create_job_from_urls(slow_set.id, [f"{base}/{i}.png" for i in range(32)])
        work = runner(service, fetch_threads=16, poll_interval_s=0.05)
        try:
            work.start()
            upload = service.create_job_from_uploads(other.id, [(f"{i}.png", noise_png(27, 27, seed=960 + i))
                                                                for i in range(5)])
            started = time.monotonic()
            finished = list(service.watch(upload.id, interval_s=0.05, timeout_s=60))[-1]
            took = time.monotonic() - started
            urls = service.get_job(slow.id)
            print(f"upload indexed in {took:.2f} s, URL job then {urls.done} done {urls.failed} failed")
            assert finished.done == 5, finished
            assert urls.done + urls.failed == 0 and took < deadline_s, (urls, took)  # no URL deadline passed yet
            urls = list(service.watch(slow.id, interval_s=0.1, timeout_s=90))[-1]
            assert urls.failed == 32 and urls.done == 0, urls
            errors = [i.error or "" for i in service.job_items(slow.id, states=[ItemState.FAILED], limit=100)]
            assert len(errors) == 32 and all("timed out" in e or "time limit" in e for e in errors), errors
        finally:
            gone.set()
            work.close()


def test_fetch_ahead_stages_within_its_bounds(make_service) -> None:  # noqa: F811
    """The fetch-ahead claims no more than ``max_items`` URL items, none while the staged bytes reach ``max_bytes``,
    hands a batch only items whose fetch ended (bytes or error), each read once. The source here is a stand-in
    that waits for the test (the loopback fetches are the other tests')."""
    from rubricsearch.indexer.jobs.fetchahead import FetchAhead
    from rubricsearch.retrieval.errors import NotFound

    gate = threading.Event()

    class Held:
        def load(self, ref: str) -> bytes:
            gate.wait(30)
            if ref.endswith("/gone.png"):
                raise NotFound(f"{ref}: the server answered 404", ref=ref)
            return b"x" * 1000

    service = make_service()
    ref_set = service.create_set("bounded")
    job = service.create_job_from_urls(ref_set.id, ["http://images.example/gone.png"]
                                       + [f"http://images.example/{i}.png" for i in range(9)])
    ahead = FetchAhead(lambda job: Held(), threads=2, max_items=4, max_bytes=1500)  # type: ignore[arg-type,return-value]

    def claim() -> list[object]:
        with service.catalog.write() as s:
            held = ahead.claim(s, "w", job_id=None, stale_after_s=300, max_attempts=3)
        ahead.start(held)
        return held  # type: ignore[return-value]

    try:
        assert len(claim()) == 4 and ahead.room() == 0 and claim() == []
        assert ahead.take(10) == [] and ahead.fetching()  # nothing fetched yet: nothing for a batch
        gate.set()
        deadline = time.monotonic() + 20
        while ahead.staged() < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ahead.staged() == 4 and ahead.room() == 0
        (gone,) = ahead.take(1)
        assert ahead.room() == 0  # three held (room for one more), but 3,000 staged bytes >= 1,500
        source = ahead.source(service.get_job(job.id))
        with pytest.raises(NotFound, match="404"):
            source.load(gone.source_ref)  # the fetch's own error, for this item alone
        taken = ahead.take(2)  # this thread's next batch
        assert len(taken) == 2 and ahead.room() == 3  # 1,000 bytes left staged, one item held
        assert source.load(taken[0].source_ref) == b"x" * 1000
        with pytest.raises(Exception, match="not fetched ahead"):
            source.load(taken[0].source_ref)  # read once
        assert len(ahead.drop()) == 1 and ahead.staged() == 0 and ahead.room() == 4
    finally:
        gate.set()
        ahead.close()
