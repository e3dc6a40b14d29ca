"""Ingestion jobs and item claims: counters, finishing, cancel, crash recovery and concurrency.

Runs on SQLite and, when ``RUBRICSEARCH_TEST_POSTGRES_URL`` is set, on PostgreSQL.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
from datetime import timedelta

import pytest
from sqlalchemy import update

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.catalog import Catalog, ItemSpec, ItemState, JobState, SetRecord
from rubricsearch.indexer.catalog.tables import JobItem, utcnow
from rubricsearch.retrieval.errors import Conflict, InvalidInput, NotFound


def make_job(catalog: Catalog, set_id: str, n: int, kind: str = "zip") -> cat.JobRecord:
    with catalog.write() as s:
        return cat.create_job(s, set_id, kind, [f"entry-{i}.png" for i in range(n)], options={"src": "a.zip"})


def claim(catalog: Catalog, worker: str, **kw) -> list[cat.ItemRecord]:
    with catalog.write() as s:
        return cat.claim_next_items(s, worker, **kw)


def complete(
    catalog: Catalog, item: cat.ItemRecord, worker: str, outcome=ItemState.DONE, **kw
) -> cat.JobRecord:
    with catalog.write() as s:
        return cat.complete_item(s, item.id, worker, outcome, **kw)


def backdate_claims(catalog: Catalog, job_id: str, seconds: float = 3600) -> None:
    """Make every claim of a job look old, as if its worker died that long ago."""
    with catalog.write() as s:
        s.execute(
            update(JobItem)
            .where(JobItem.job_id == job_id, JobItem.state == "claimed")
            .values(claimed_at=utcnow() - timedelta(seconds=seconds))
        )


def test_create_get_list_jobs(catalog: Catalog, reference_set: SetRecord) -> None:
    with catalog.write() as s:
        job = cat.create_job(s, reference_set.id, "url", [ItemSpec("https://x/1.png"), "https://x/2.png"])
        empty = cat.create_job(s, reference_set.id, "folder", [])
        with pytest.raises(NotFound):
            cat.create_job(s, "missing", "zip", ["a"])
        with pytest.raises(InvalidInput):
            cat.create_job(s, reference_set.id, "", ["a"])
        with pytest.raises(Conflict):
            cat.create_job(s, reference_set.id, "zip", ["a"], job_id=job.id)
    assert (job.state, job.total, job.processed, job.progress, job.finished) == (
        JobState.QUEUED,
        2,
        0,
        0.0,
        False,
    )
    assert empty.state == JobState.SUCCEEDED and empty.finished_at is not None and empty.progress == 1.0
    with catalog.read() as s:
        assert cat.get_job(s, job.id) == job
        assert {j.id for j in cat.list_jobs(s)} == {job.id, empty.id}
        assert [j.id for j in cat.list_jobs(s, states=[JobState.QUEUED])] == [job.id]
        assert cat.list_jobs(s, set_id="missing") == []
        items = cat.list_items(s, job.id)
        assert [(i.seq, i.source_ref, i.state) for i in items] == [
            (0, "https://x/1.png", ItemState.PENDING),
            (1, "https://x/2.png", ItemState.PENDING),
        ]
        with pytest.raises(NotFound):
            cat.get_job(s, "missing")


def test_claim_complete_counters_and_success(catalog: Catalog, reference_set: SetRecord) -> None:
    job = make_job(catalog, reference_set.id, 3)
    first = claim(catalog, "w1", job_id=job.id, limit=2)
    assert [i.seq for i in first] == [0, 1]
    assert all(i.state == ItemState.CLAIMED and i.claimed_by == "w1" and i.attempts == 1 for i in first)
    with catalog.read() as s:
        running = cat.get_job(s, job.id)
    assert running.state == JobState.RUNNING and running.started_at is not None and running.worker_id == "w1"
    with catalog.write() as s:
        img, _ = cat.add_image(s, reference_set.id, sha256="a" * 64, byte_size=3, source="zip")
        after = cat.complete_item(s, first[0].id, "w1", ItemState.DONE, image_id=img.id, blob_sha256="a" * 64)
    assert (after.done, after.state) == (1, JobState.RUNNING)
    assert complete(catalog, first[1], "w1", ItemState.SKIPPED).skipped == 1
    last = claim(catalog, "w2")
    assert [i.seq for i in last] == [2]
    assert claim(catalog, "w3", job_id=job.id) == []
    final = complete(catalog, last[0], "w2", ItemState.DONE)
    assert (final.state, final.done, final.skipped, final.failed, final.progress) == (
        JobState.SUCCEEDED,
        2,
        1,
        0,
        1.0,
    )
    assert final.finished_at is not None
    with catalog.read() as s:
        items = cat.list_items(s, job.id)
    assert items[0].image_id == img.id and items[0].blob_sha256 == "a" * 64
    assert all(i.finished_at is not None for i in items)
    with pytest.raises(InvalidInput):
        complete(catalog, last[0], "w2", ItemState.PENDING)


@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [
        ([ItemState.DONE, ItemState.FAILED], JobState.COMPLETED_WITH_ERRORS),
        ([ItemState.SKIPPED, ItemState.FAILED], JobState.COMPLETED_WITH_ERRORS),
        ([ItemState.FAILED, ItemState.FAILED], JobState.FAILED),
        ([ItemState.SKIPPED, ItemState.SKIPPED], JobState.SUCCEEDED),
    ],
)
def test_final_state_from_outcomes(catalog: Catalog, reference_set: SetRecord, outcomes, expected) -> None:
    job = make_job(catalog, reference_set.id, len(outcomes))
    items = claim(catalog, "w", job_id=job.id, limit=10)
    for item, outcome in zip(items, outcomes, strict=True):
        result = complete(catalog, item, "w", outcome, error="bad" if outcome == ItemState.FAILED else None)
    assert result.state == expected and result.total == len(outcomes)
    with catalog.read() as s:
        failed = cat.list_items(s, job.id, states=[ItemState.FAILED])
    assert all(i.error == "bad" for i in failed) and len(failed) == outcomes.count(ItemState.FAILED)


def test_stale_claim_is_taken_over_and_old_worker_loses_it(
    catalog: Catalog, reference_set: SetRecord
) -> None:
    job = make_job(catalog, reference_set.id, 2)
    dead = claim(catalog, "dead-worker", limit=2)
    assert claim(catalog, "w2") == []  # fresh claims are respected
    backdate_claims(catalog, job.id)
    taken = claim(catalog, "w2", limit=5)
    assert [i.id for i in taken] == [i.id for i in dead]
    assert all(i.attempts == 2 and i.claimed_by == "w2" for i in taken)
    with pytest.raises(Conflict):
        complete(catalog, dead[0], "dead-worker")
    with pytest.raises(NotFound), catalog.write() as s:
        cat.complete_item(s, 10**9, "w2", ItemState.DONE)
    for item in taken:
        final = complete(catalog, item, "w2")
    assert (final.state, final.done) == (JobState.SUCCEEDED, 2)


def test_item_that_keeps_killing_workers_is_failed(catalog: Catalog, reference_set: SetRecord) -> None:
    job = make_job(catalog, reference_set.id, 2)
    for attempt in range(1, 4):
        items = claim(catalog, f"w{attempt}", limit=1)
        assert [(i.seq, i.attempts) for i in items] == [(0, attempt)]
        backdate_claims(catalog, job.id)
    rest = claim(catalog, "w9", limit=5, max_attempts=3)
    assert [i.seq for i in rest] == [1]
    with catalog.read() as s:
        poisoned = cat.list_items(s, job.id, states=[ItemState.FAILED])
        assert cat.get_job(s, job.id).failed == 1
    assert len(poisoned) == 1 and "3 times" in (poisoned[0].error or "")
    assert complete(catalog, rest[0], "w9").state == JobState.COMPLETED_WITH_ERRORS


def test_heartbeat_keeps_a_claim_and_release_returns_it(catalog: Catalog, reference_set: SetRecord) -> None:
    job = make_job(catalog, reference_set.id, 3)
    items = claim(catalog, "w1", limit=3)
    backdate_claims(catalog, job.id)
    with catalog.write() as s:
        assert cat.heartbeat(s, "w1", [items[0].id, items[1].id]) == [items[0].id, items[1].id]
        assert cat.heartbeat(s, "intruder", [items[2].id]) == []
        assert cat.heartbeat(s, "w1", []) == []
    stolen = claim(catalog, "w2", limit=5)
    assert [i.id for i in stolen] == [items[2].id]  # only the claim without heartbeat went stale
    with catalog.write() as s:
        assert cat.release_items(s, "w1", [items[0].id, items[2].id]) == 1
        assert cat.release_items(s, "w1", []) == 0
    again = claim(catalog, "w3", limit=5)
    assert [i.id for i in again] == [items[0].id]


def test_cancel_stops_new_claims_and_finishes_after_inflight(
    catalog: Catalog, reference_set: SetRecord
) -> None:
    job = make_job(catalog, reference_set.id, 4)
    inflight = claim(catalog, "w1", limit=1)
    with catalog.write() as s:
        requested = cat.request_cancel(s, job.id)
        assert cat.is_cancel_requested(s, job.id)
    assert requested.cancel_requested and requested.state == JobState.RUNNING
    assert claim(catalog, "w2", limit=5) == []
    final = complete(catalog, inflight[0], "w1")
    assert (final.state, final.done) == (JobState.CANCELLED, 1)
    with catalog.read() as s:
        assert len(cat.list_items(s, job.id, states=[ItemState.CANCELLED])) == 3
    with catalog.write() as s:
        assert cat.request_cancel(s, job.id) == final  # idempotent once finished
        with pytest.raises(NotFound):
            cat.is_cancel_requested(s, "missing")


def test_cancel_of_queued_job_and_of_job_whose_worker_died(
    catalog: Catalog, reference_set: SetRecord
) -> None:
    queued = make_job(catalog, reference_set.id, 2)
    with catalog.write() as s:
        assert cat.request_cancel(s, queued.id).state == JobState.CANCELLED
    orphan = make_job(catalog, reference_set.id, 2)
    claim(catalog, "dead", job_id=orphan.id, limit=1)
    with catalog.write() as s:
        assert cat.request_cancel(s, orphan.id).state == JobState.RUNNING
    backdate_claims(catalog, orphan.id)
    assert claim(catalog, "w2") == []
    with catalog.read() as s:
        assert cat.get_job(s, orphan.id).state == JobState.CANCELLED


def test_fail_job_voids_claims_and_retry_reopens(catalog: Catalog, reference_set: SetRecord) -> None:
    job = make_job(catalog, reference_set.id, 3)
    items = claim(catalog, "w1", limit=3)
    complete(catalog, items[0], "w1", ItemState.FAILED, error="boom")
    with catalog.write() as s:
        with pytest.raises(Conflict):
            cat.retry_failed_items(s, job.id)  # still running
        failed = cat.fail_job(s, job.id, "archive is corrupt")
    assert (failed.state, failed.error) == (JobState.FAILED, "archive is corrupt")
    with pytest.raises(Conflict):
        complete(catalog, items[1], "w1")
    with catalog.write() as s:
        reopened = cat.retry_failed_items(s, job.id)
    assert (reopened.state, reopened.failed, reopened.error, reopened.finished_at) == (
        JobState.QUEUED,
        0,
        None,
        None,
    )
    again = claim(catalog, "w2", limit=5)
    assert [(i.seq, i.attempts, i.error) for i in again] == [(0, 1, None)]
    assert complete(catalog, again[0], "w2").state == JobState.SUCCEEDED


def test_claims_take_turns_across_jobs_and_validate(catalog: Catalog, reference_set: SetRecord) -> None:
    """A claim takes one item of each job with work in turn (oldest job first, each job's items in order), so a
    large or slow job cannot keep a later job's items waiting behind all of its own."""
    older = make_job(catalog, reference_set.id, 5)
    newer = make_job(catalog, reference_set.id, 2)
    got = claim(catalog, "w", limit=3)
    assert [(i.job_id, i.seq) for i in got] == [(older.id, 0), (newer.id, 0), (older.id, 1)]
    got = claim(catalog, "w", limit=4)
    assert [(i.job_id, i.seq) for i in got] == [(older.id, 2), (newer.id, 1), (older.id, 3), (older.id, 4)]
    for bad in ({"worker_id": ""}, {"worker_id": "w", "limit": 0}):
        with pytest.raises(InvalidInput), catalog.write() as s:
            cat.claim_next_items(s, **bad)


def _drain(
    catalog: Catalog, worker: str, job_id: str | None, seen: list[int], start: threading.Barrier
) -> None:
    rng = random.Random(worker)
    start.wait()
    while items := claim(catalog, worker, job_id=job_id, limit=rng.randint(1, 4)):
        for item in items:
            seen.append(item.id)
            outcome = (
                ItemState.FAILED
                if item.seq % 7 == 3
                else ItemState.SKIPPED
                if item.seq % 5 == 1
                else ItemState.DONE
            )
            complete(catalog, item, worker, outcome)


@pytest.mark.parametrize("scope", ["one-job", "any-job"])
def test_three_threads_never_double_claim(catalog: Catalog, reference_set: SetRecord, scope: str) -> None:
    jobs = [make_job(catalog, reference_set.id, 60)]
    if scope == "any-job":
        jobs.append(make_job(catalog, reference_set.id, 30))
    seen: dict[str, list[int]] = {f"worker-{k}": [] for k in range(3)}
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def run(worker: str) -> None:
        try:
            _drain(catalog, worker, jobs[0].id if scope == "one-job" else None, seen[worker], start)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    claimed = [i for ids in seen.values() for i in ids]
    assert len(claimed) == len(set(claimed)) == sum(j.total for j in jobs)
    with catalog.read() as s:
        for job in jobs:
            final = cat.get_job(s, job.id)
            assert final.state == JobState.COMPLETED_WITH_ERRORS and final.processed == job.total
            assert final.failed == sum(1 for q in range(job.total) if q % 7 == 3)
            assert not cat.list_items(s, job.id, states=[ItemState.PENDING, ItemState.CLAIMED])


def _process_worker(url: str, worker: str, job_id: str, crash_after: int, out: multiprocessing.Queue) -> None:
    catalog = Catalog(cat.create_engine_for(url))
    claimed: list[int] = []
    while items := claim(catalog, worker, job_id=job_id, limit=2):
        claimed += [i.id for i in items]
        if crash_after and len(claimed) >= crash_after:
            out.put((worker, claimed))
            out.close()
            out.join_thread()  # the queue's feeder thread must flush before we die
            os._exit(17)  # die holding claims: no cleanup, no release
        for item in items:
            complete(catalog, item, worker)
    out.put((worker, claimed))


@pytest.mark.slow
def test_processes_share_a_job_and_a_crashed_one_is_resumed(
    catalog: Catalog, reference_set: SetRecord
) -> None:
    job = make_job(catalog, reference_set.id, 40)
    url = catalog.engine.url.render_as_string(hide_password=False)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_process_worker, args=(url, f"proc-{k}", job.id, 4 if k == 0 else 0, out))
        for k in range(3)
    ]
    # The crashing worker claims first: started together, the other two could finish all 40 items
    # before its spawn-started process had imported anything, and it would never hold a claim.
    procs[0].start()
    results = dict([out.get(timeout=60)])
    procs[0].join(timeout=60)
    for p in procs[1:]:
        p.start()
    results.update(out.get(timeout=60) for _ in procs[1:])
    for p in procs[1:]:
        p.join(timeout=60)
    assert procs[0].exitcode == 17 and all(p.exitcode == 0 for p in procs[1:])
    all_claims = [i for ids in results.values() for i in ids]
    assert len(all_claims) == len(set(all_claims))
    with catalog.read() as s:
        stuck = cat.list_items(s, job.id, states=[ItemState.CLAIMED])
        assert cat.get_job(s, job.id).state == JobState.RUNNING
    assert {i.claimed_by for i in stuck} == {"proc-0"} and stuck
    backdate_claims(catalog, job.id)  # time passes; the dead worker's claims go stale
    resumed = claim(catalog, "rescuer", job_id=job.id, limit=50)
    assert {i.id for i in resumed} == {i.id for i in stuck}
    for item in resumed:
        final = complete(catalog, item, "rescuer")
    assert (final.state, final.done) == (JobState.SUCCEEDED, 40)
