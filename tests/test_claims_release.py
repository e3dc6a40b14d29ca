"""Releasing claims of a job with a cancel request: the items are cancelled, so the job can finish.

Before the fix ``release_items`` put such items back to ``pending``; claims never hand out items of a
cancelled job, so the job stayed ``running`` forever. Runs on SQLite and (when configured) PostgreSQL.
"""

from __future__ import annotations

from sqlalchemy import update

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.catalog import Catalog, ItemState, JobState, SetRecord
from rubricsearch.indexer.catalog.tables import JobItem


def make_job(catalog: Catalog, set_id: str, n: int) -> cat.JobRecord:
    with catalog.write() as s:
        return cat.create_job(s, set_id, "upload", [f"img-{i}.png" for i in range(n)])


def states(catalog: Catalog, job_id: str) -> dict[str, int]:
    with catalog.read() as s:
        found: dict[str, int] = {}
        for item in cat.list_items(s, job_id, limit=1000):
            found[item.state.value] = found.get(item.state.value, 0) + 1
        return found


def test_release_of_a_cancelled_jobs_items_cancels_them_and_finishes_the_job(
    catalog: Catalog, reference_set: SetRecord
) -> None:
    job = make_job(catalog, reference_set.id, 4)
    with catalog.write() as s:
        held = cat.claim_next_items(s, "w1", job_id=job.id, limit=2)
    with catalog.write() as s:
        assert cat.request_cancel(s, job.id).state == JobState.RUNNING  # two items still in flight
    with catalog.write() as s:
        assert cat.release_items(s, "w1", [i.id for i in held]) == 2
    assert states(catalog, job.id) == {"cancelled": 4}
    with catalog.read() as s:
        final = cat.get_job(s, job.id)
    assert final.state == JobState.CANCELLED and final.finished_at is not None


def test_release_touches_only_the_cancelled_job(catalog: Catalog, reference_set: SetRecord) -> None:
    doomed, kept = make_job(catalog, reference_set.id, 2), make_job(catalog, reference_set.id, 2)
    with catalog.write() as s:
        held = cat.claim_next_items(s, "w1", limit=4)
    assert {i.job_id for i in held} == {doomed.id, kept.id}
    with catalog.write() as s:
        cat.request_cancel(s, doomed.id)
        assert cat.release_items(s, "w1", [i.id for i in held]) == 4
        assert cat.release_items(s, "w1", [i.id for i in held]) == 0  # no longer held
    assert states(catalog, doomed.id) == {"cancelled": 2}
    assert states(catalog, kept.id) == {"pending": 2}
    with catalog.read() as s:
        assert cat.get_job(s, doomed.id).state == JobState.CANCELLED
        assert cat.get_job(s, kept.id).state == JobState.RUNNING
    with catalog.write() as s:
        again = cat.claim_next_items(s, "w2", limit=10)
    assert sorted(i.id for i in again) == sorted(i.id for i in held if i.job_id == kept.id)


def test_a_pending_item_left_in_a_cancelled_job_is_settled_by_the_next_claim(
    catalog: Catalog, reference_set: SetRecord
) -> None:
    """The residue of a release racing a cancel on PostgreSQL (simulated): the next claim settles it."""
    job = make_job(catalog, reference_set.id, 3)
    with catalog.write() as s:
        held = cat.claim_next_items(s, "w1", job_id=job.id, limit=1)
        cat.request_cancel(s, job.id)
    with catalog.write() as s:  # what the old release did, after the cancel had run
        s.execute(update(JobItem).where(JobItem.id == held[0].id)
                  .values(state=ItemState.PENDING.value, claimed_by=None, claimed_at=None))
    with catalog.write() as s:
        assert cat.claim_next_items(s, "w2", limit=5) == []
    assert states(catalog, job.id) == {"cancelled": 3}
    with catalog.read() as s:
        assert cat.get_job(s, job.id).state == JobState.CANCELLED
