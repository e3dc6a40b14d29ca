"""The overlapped pipeline's threads without a model or a database: a processor that records what each stage
saw. Every batch goes through the stages in order and commits in claim order; a failure in any stage stops
the claiming, hands back every claim not committed and is raised once all threads have stopped."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rubricsearch.indexer.catalog import ItemRecord, ItemState
from rubricsearch.indexer.jobs.overlap import Overlap
from rubricsearch.indexer.jobs.pipeline import Batch, BatchProcessor, BatchResult, PipelineTimes

STAGES = ("prepare", "encode", "pack", "embed", "store", "sync", "commit")


class Recorder(BatchProcessor):
    """Each stage notes (stage, claim) and sleeps a little; ``fail`` = (stage, claim) raises there."""

    def __init__(self, fail: tuple[str, int] | None = None) -> None:  # no models, catalog or stores
        self.times = PipelineTimes()
        self.fail = fail
        self.seen: list[tuple[str, int]] = []
        self.threads: dict[str, set[str]] = {stage: set() for stage in STAGES}
        self._record = threading.Lock()

    def _note(self, stage: str, claim: int) -> None:
        with self._record:
            self.seen.append((stage, claim))
            self.threads[stage].add(threading.current_thread().name)
        time.sleep(0.002)
        if self.fail == (stage, claim):
            raise RuntimeError(f"{stage} failed on batch {claim}")

    def prepare(self, items: Any, source_for: Any) -> Batch:
        claim = items[0].id // 10
        self._note("prepare", claim)
        return Batch(list(items), [], [time.monotonic()])

    def encode(self, batch: Batch) -> Batch:
        self._note("encode", batch.claim_no)
        return batch

    def pack(self, batch: Batch) -> Batch:
        self._note("pack", batch.claim_no)
        return batch

    def embed(self, batch: Batch) -> Batch:
        self._note("embed", batch.claim_no)
        return batch

    def store(self, batch: Batch) -> Batch:
        self._note("store", batch.claim_no)
        return batch

    def sync(self, batch: Batch) -> Batch:
        self._note("sync", batch.claim_no)
        return batch

    def commit(self, batch: Batch) -> BatchResult:
        self._note("commit", batch.claim_no)
        return BatchResult(done=len(batch.items))


def _item(i: int) -> ItemRecord:
    return ItemRecord(id=i, job_id="job", seq=i, source_ref=str(i), blob_sha256=None, image_id=None,
                      state=ItemState.CLAIMED, error=None, claimed_by="w", claimed_at=None, finished_at=None,
                      attempts=1)


def _stage_threads() -> list[threading.Thread]:
    """The overlap's own threads still alive (other tests' loader pools may linger: not these)."""
    names = {f"ingest-{stage}" for stage in STAGES}
    return [t for t in threading.enumerate() if t.name in names]


def _run(processor: Recorder, batches: int, prefetch: int = 2) -> tuple[Overlap, list[int], list[int]]:
    claims = iter([[_item(10 * n + k) for k in range(3)] for n in range(batches)])
    handed_back: list[int] = []
    settled: list[int] = []
    overlap = Overlap(processor, lambda job: None,  # type: ignore[arg-type,return-value]
                      claim=lambda: next(claims, None),
                      settle=lambda result: settled.append(result.done),
                      give_back=lambda ids, jobs: handed_back.extend(ids), prefetch=prefetch)
    return overlap, handed_back, settled


def test_batches_pass_every_stage_in_order_on_a_thread_per_stage() -> None:
    processor = Recorder()
    overlap, handed_back, settled = _run(processor, batches=12)
    assert overlap.run() == 36 and settled == [3] * 12 and handed_back == []
    for claim in range(12):
        assert [stage for stage, n in processor.seen if n == claim] == list(STAGES)
    assert [n for stage, n in processor.seen if stage == "commit"] == list(range(12))
    names = {stage: next(iter(threads)) for stage, threads in processor.threads.items()}
    assert all(len(threads) == 1 for threads in processor.threads.values())
    assert len(set(names.values())) == len(STAGES)  # each stage on a thread of its own


@pytest.mark.parametrize("stage", STAGES)
def test_a_failing_stage_hands_back_what_was_not_committed(stage: str) -> None:
    processor = Recorder(fail=(stage, 3))
    overlap, handed_back, settled = _run(processor, batches=12)
    with pytest.raises(RuntimeError, match=f"{stage} failed on batch 3"):
        overlap.run()
    committed = [n for s, n in processor.seen if s == "commit" and (s, n) != processor.fail]
    assert committed == list(range(len(committed))) and 3 not in committed  # in order, none past the failure
    claimed = {n for s, n in processor.seen if s == "prepare"}
    assert sorted(handed_back) == sorted(10 * n + k for n in claimed - set(committed) for k in range(3))
    assert len(settled) == len(committed)
    assert not _stage_threads()  # every thread stopped


def test_a_thread_that_cannot_start_leaves_no_claim_and_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the stage threads can fail (no threads left); the ones already running stop, claims go back."""
    start = threading.Thread.start

    def refuse_the_committer(thread: threading.Thread) -> None:
        if thread.name == "ingest-commit":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse_the_committer)
    processor = Recorder()
    overlap, handed_back, settled = _run(processor, batches=12)
    with pytest.raises(RuntimeError, match="can't start"):
        overlap.run()
    claimed = {n for s, n in processor.seen if s == "prepare"}
    assert settled == [] and sorted(handed_back) == sorted(10 * n + k for n in claimed for k in range(3))
    assert not _stage_threads()
