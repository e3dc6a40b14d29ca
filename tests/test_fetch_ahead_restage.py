"""URL items a batch hands back because its pixel bound cut it keep the bytes the fetch-ahead fetched: they are
staged again (claims kept) and indexed by the next batches without a second request to their server, within the
fetch-ahead's byte bound; past it they go back to pending and are fetched again. Counted on a loopback server."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest

from rubricsearch.indexer.catalog import ItemState, JobState
from rubricsearch.indexer.jobs import IngestionRunner, IngestionService
from rubricsearch.indexer.sources import NetGuard, UrlFetcher
from tests.conftest import image_server, noise_png
from tests.test_ingestion import items, make_service, runner  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)

SIDE = 64
PNGS = {f"/{n}.png": noise_png(SIDE, SIDE, seed=360 + n) for n in range(8)}


def staged_ahead(work: IngestionRunner, want: int) -> None:
    """Every URL item claimed and fetched before the first batch, so that batch takes all of them at once."""
    with work.service.catalog.write() as s:
        claimed = work.fetch_ahead.claim(s, work.worker_id, job_id=None, stale_after_s=work.stale_after_s,
                                         max_attempts=work.max_attempts)
    work.fetch_ahead.start(claimed)
    deadline = time.monotonic() + 30
    while work.fetch_ahead.staged() < want and time.monotonic() < deadline:
        time.sleep(0.02)
    assert work.fetch_ahead.staged() == want


def run(make: Callable[..., IngestionService], overlapped: bool, fetch_ahead_bytes: int,
        ) -> tuple[Counter[str], list[int]]:
    """8 URL images of 64x64 through batches bounded to one image's pixels; (GETs per path, items per batch)."""
    fetched: Counter[str] = Counter()
    lock = threading.Lock()

    def answer(path: str) -> tuple[int, bytes]:
        with lock:
            fetched[path] += 1
        return (200, PNGS[path]) if path in PNGS else (404, b"missing")

    with image_server(answer) as base, UrlFetcher(NetGuard(allow_loopback=True)) as fetcher:
        service = make(url_fetcher=fetcher)
        ref_set = service.create_set("fetched", embedding_dim=64)
        job = service.create_job_from_urls(ref_set.id, [base + path for path in PNGS])
        work = runner(service, batch_size=8, batch_pixels=SIDE * SIDE, pipeline=overlapped,
                      fetch_ahead_bytes=fetch_ahead_bytes)
        batches: list[int] = []
        real_prepare = work.processor.packages.prepare

        def spy(images: list[object]) -> object:
            batches.append(len(images))
            return real_prepare(images)

        work.processor.packages.prepare = spy  # type: ignore[method-assign]
        try:
            staged_ahead(work, len(PNGS))
            assert work.run_until_idle() == len(PNGS)
        finally:
            work.close()
        assert service.get_job(job.id).state == JobState.SUCCEEDED
        assert all(i.state == ItemState.DONE and i.attempts == 1 for i in items(service, job.id))
        assert service.index.count(ref_set.id) == len(PNGS)
    return fetched, batches


@pytest.mark.parametrize("overlapped", [True, False], ids=["overlapped", "one-batch-at-a-time"])
def test_items_the_pixel_bound_hands_back_are_not_fetched_again(
        make_service: Callable[..., IngestionService], overlapped: bool) -> None:  # noqa: F811
    fetched, batches = run(make_service, overlapped, fetch_ahead_bytes=256 * 1024**2)
    assert batches == [1] * len(PNGS)  # the first batch took all 8 and kept one: 7 were handed back
    assert fetched == Counter(dict.fromkeys(PNGS, 1))


def test_past_the_byte_bound_handed_back_items_are_fetched_again(
        make_service: Callable[..., IngestionService]) -> None:  # noqa: F811
    """The staged bytes stay within ``fetch_ahead_bytes``: room for any two of the images, never three, so two of
    the seven handed back stay staged and five go back to pending and are fetched again."""
    sizes = sorted(len(png) for png in PNGS.values())
    assert sum(sizes[:3]) > sum(sizes[-2:])
    fetched, batches = run(make_service, False, fetch_ahead_bytes=sum(sizes[-2:]))
    assert batches == [1] * len(PNGS)
    assert sorted(fetched.values()) == [1, 1, 1, 2, 2, 2, 2, 2] and set(fetched) == set(PNGS)
