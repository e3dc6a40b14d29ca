"""Training jobs, model versions and activations in the catalog (SQLite and, when configured, PostgreSQL): one
training job per set, cancel and resume (an interrupted job only once its heartbeat is stale), versions per set with
a model column, the activation history with its optimistic check, rollback down to the base, and the cascade when
the set goes."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import update

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.catalog import Catalog, SetRecord
from rubricsearch.indexer.catalog.tables import IngestionJob, JobState, utcnow
from rubricsearch.indexer.catalog.versions import (
    BASE,
    activate,
    active_version,
    active_version_id,
    add_version,
    cancel_training_job,
    create_training_job,
    finish_training_job,
    get_version,
    list_versions,
    locked_active_version,
    record_progress,
    reopen_training_job,
    roll_back,
    start_training_job,
    training_job,
)
from rubricsearch.retrieval.errors import Conflict, InvalidInput, NotFound


def test_one_training_job_per_set_and_its_life(catalog: Catalog, reference_set: SetRecord) -> None:
    set_id = reference_set.id
    with catalog.write() as s:
        job = create_training_job(s, set_id, 50, {"settings": {"steps": 50}, "max_judgment_id": 7})
    assert job.kind == "train" and job.state == JobState.QUEUED and job.total == 50
    with catalog.write() as s, pytest.raises(Conflict):
        create_training_job(s, set_id, 10, {})
    with catalog.write() as s:
        other = cat.create_set(s, "other")
        queued = create_training_job(s, other.id, 10, {})  # another set may train meanwhile
        cancel_training_job(s, queued.id)  # a queued job is cancelled at once, and never starts
        assert training_job(s, queued.id).state == JobState.CANCELLED
        with pytest.raises(Conflict):
            start_training_job(s, queued.id, "w1")
        start_training_job(s, job.id, "w1")
        assert not record_progress(s, job.id, 3, {"loss": 0.5})
    with catalog.write() as s:
        cancel_training_job(s, job.id)
        assert record_progress(s, job.id, 4, {"loss": 0.4}), "the next step sees the cancel"
        assert training_job(s, job.id).options["progress"] == {"loss": 0.4}
        # alive (fresh heartbeat) and not finished: resume is refused
        with pytest.raises(Conflict):
            reopen_training_job(s, job.id, utcnow() - timedelta(seconds=60))
        finish_training_job(s, job.id, JobState.CANCELLED)
    with catalog.write() as s:
        reopened = reopen_training_job(s, job.id, utcnow() - timedelta(seconds=60))
        assert reopened.state == JobState.QUEUED and not reopened.cancel_requested
        finish_training_job(s, job.id, JobState.SUCCEEDED)
        with pytest.raises(Conflict):
            reopen_training_job(s, job.id, utcnow())
        with pytest.raises(Conflict):
            cancel_training_job(s, job.id)


def test_a_job_left_running_by_a_stopped_process_resumes_once_stale(catalog: Catalog,
                                                                   reference_set: SetRecord) -> None:
    with catalog.write() as s:
        job = create_training_job(s, reference_set.id, 5, {})
        start_training_job(s, job.id, "gone")
    with catalog.write() as s, pytest.raises(Conflict):
        reopen_training_job(s, job.id, utcnow() - timedelta(seconds=60))
    with catalog.write() as s:
        s.execute(update(IngestionJob).where(IngestionJob.id == job.id)
                  .values(heartbeat_at=utcnow() - timedelta(minutes=5)))
    with catalog.write() as s:
        assert reopen_training_job(s, job.id, utcnow() - timedelta(seconds=60)).state == JobState.QUEUED


def test_an_ingestion_job_is_not_a_training_job(catalog: Catalog, reference_set: SetRecord) -> None:
    with catalog.write() as s:
        job = cat.create_job(s, reference_set.id, "upload", ["a.png"])
    with catalog.read() as s, pytest.raises(NotFound):
        training_job(s, job.id)


def test_versions_activations_and_rollback(catalog: Catalog, reference_set: SetRecord) -> None:
    set_id = reference_set.id
    with catalog.write() as s:
        v1 = add_version(s, set_id, "reranker", "/data/versions/v1", {"metrics": {}}, version_id="v1", job_id="j1")
        add_version(s, set_id, "reranker", "/data/versions/v2", {}, version_id="v2")
        add_version(s, set_id, "embedder", "/data/versions/e1", {}, version_id="e1")
        with pytest.raises(InvalidInput):
            add_version(s, set_id, "tower", "/x", {}, version_id="t1")  # type: ignore[arg-type]
    with catalog.read() as s:
        assert [v.id for v in list_versions(s, set_id)] == ["v1", "v2", "e1"]
        assert [v.id for v in list_versions(s, set_id, "reranker")] == ["v1", "v2"]
        assert get_version(s, set_id, "v1") == v1 and v1.card == {"metrics": {}}
        assert active_version(s, set_id, "reranker") is None
        with pytest.raises(NotFound):
            get_version(s, set_id, "nope")
    with catalog.write() as s:
        activate(s, set_id, "reranker", "v1", {"passed": True}, expected=None)
        with pytest.raises(Conflict):  # compared against the base, but v1 is active now
            activate(s, set_id, "reranker", "v2", {"passed": True}, expected=None)
        activate(s, set_id, "reranker", "v2", {"passed": True}, expected="v1")
    with catalog.read() as s:
        current = active_version(s, set_id, "reranker")
        assert current is not None and current.id == "v2" == active_version_id(s, set_id, "reranker")
        assert active_version(s, set_id, "embedder") is None  # per model
    with catalog.write() as s:
        assert roll_back(s, set_id, "reranker") == "v1"
        assert roll_back(s, set_id, "reranker") is None
        with pytest.raises(Conflict):
            roll_back(s, set_id, "reranker")
    with catalog.write() as s:
        cat.delete_set(s, set_id)
    with catalog.read() as s:
        assert list_versions(s, set_id) == []


def test_a_batch_commit_reading_the_active_embedder_orders_activations_after_it(catalog: Catalog,
                                                                                reference_set: SetRecord) -> None:
    """Ingestion's commit reads the set's active embedder under the set's row lock: an activation started meanwhile
    commits only after it (so the commit never records vectors of an embedder that is no longer active), and on
    PostgreSQL two commits' shared locks do not wait for each other. A copy reading without the lock fails on
    PostgreSQL (SQLite's single writer orders them anyway)."""
    set_id = reference_set.id
    with catalog.write() as s:
        add_version(s, set_id, "embedder", "/data/versions/e1", {}, version_id="e1")
    order: list[str] = []
    holding, other_holding = threading.Event(), threading.Event()

    def commit() -> None:
        with catalog.write() as s:
            assert locked_active_version(s, set_id, "embedder") == BASE
            holding.set()
            if catalog.dialect == "postgresql":  # a second shared holder gets in while this one holds
                assert other_holding.wait(10)
            time.sleep(0.3)
            order.append("commit")

    def other_commit() -> None:
        assert holding.wait(10)
        with catalog.write() as s:
            locked_active_version(s, set_id, "embedder")
            other_holding.set()

    def activation() -> None:
        assert holding.wait(10)
        with catalog.write() as s:
            activate(s, set_id, "embedder", "e1", {"passed": True}, expected=None)
            order.append("activation")

    threads = [threading.Thread(target=f) for f in (commit, activation)]
    if catalog.dialect == "postgresql":
        threads.append(threading.Thread(target=other_commit))
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert order == ["commit", "activation"]
    with catalog.write() as s:
        assert locked_active_version(s, set_id, "embedder") == "e1"
