"""The ingestion worker: claim a batch, process it, repeat; in the foreground or on background threads.

Start-up (:meth:`IngestionRunner.recover`) settles what a previous life of this worker left: its own
claims are handed back at once (or failed, for an item that has now been in flight ``max_attempts``
times: a poison input must not crash the worker forever), staging and temp files of dead work are swept,
and every set's index is reconciled with the catalog. Claims of *other* dead workers are taken over by
:func:`~indexer.catalog.claim_next_items` once they are ``stale_after_s`` old.

``run_until_idle`` and the background threads overlap consecutive batches (``pipeline=True``, see
:class:`~indexer.jobs.overlap.Overlap`): the towers, the LM pass, the disk writes and the catalog commit
of consecutive batches run at once, each on its own thread, while the next batch is claimed, loaded, decoded
and preprocessed. Crash safety is the serial loop's:
every claimed batch commits its rows and outcomes in one transaction after its vectors, and claims in
flight at a crash are released at the next start (or go stale). ``run_once`` stays one serial batch.
URL items reach a batch only once fetched (:class:`~indexer.jobs.fetchahead.FetchAhead`), so a slow server
never holds a batch.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_STALE_AFTER_S,
    ItemRecord,
    ItemState,
    JobRecord,
    JobState,
    claim_next_items,
    complete_item,
    get_job,
    heartbeat,
    is_cancel_requested,
    list_items,
    list_jobs,
    release_claims_of,
    release_items,
    request_cancel,
)
from rubricsearch.indexer.catalog.facets import FACETS
from rubricsearch.indexer.jobs.fetchahead import DEFAULT_MAX_BYTES, URL, FetchAhead
from rubricsearch.indexer.jobs.overlap import Overlap
from rubricsearch.indexer.jobs.pipeline import BatchProcessor, BatchResult
from rubricsearch.indexer.jobs.reconcile import ReconcileReport, SweepReport
from rubricsearch.indexer.jobs.service import IngestionService
from rubricsearch.indexer.jobs.sizing import claim_limit
from rubricsearch.indexer.sources import Source
from rubricsearch.retrieval.errors import BackendUnavailable, NotFound, disk_full

log = logging.getLogger(__name__)


def space_available(root: Path, probe_bytes: int = 1 << 20) -> bool:
    """Whether ``probe_bytes`` can be written (and synced) under ``root``: free-space figures do not say whether
    the next write fits (reserved blocks, quotas), a write does."""
    probe = root / f".space-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * probe_bytes)
            f.flush()
            os.fsync(f.fileno())
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def default_worker_id() -> str:
    """Unique per process; pass a stable id (per host and slot) to get claims back at once after a crash."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class RecoveryReport:
    released: int = 0
    abandoned: int = 0
    sweep: SweepReport = field(default_factory=SweepReport)
    reconciled: list[ReconcileReport] = field(default_factory=list)


class IngestionRunner:
    """Processes ingestion jobs with the service's catalog, stores, index and embedder."""

    def __init__(
        self,
        service: IngestionService,
        *,
        worker_id: str | None = None,
        threads: int = 1,
        batch_size: int = 8,
        batch_pixels: int | None = None,
        poll_interval_s: float = 1.0,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        flush_interval_s: float = 30.0,
        load_threads: int = 4,
        heartbeat_every_s: float = 30.0,
        temp_grace_s: float = 600.0,
        pipeline: bool = True,
        prefetch: int = 1,
        fetch_threads: int = 8,
        fetch_ahead_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        embedder = service.embedder
        if embedder is None or not embedder.packages.local:
            raise BackendUnavailable("an ingestion worker needs the embedding model with its vision tower here")
        self.service = service
        self.worker_id = worker_id or default_worker_id()
        self.threads = max(1, threads)
        self.batch_size = batch_size
        self.batch_pixels = batch_pixels  # image pixels per claimed batch (:func:`claim_limit`); 0 or None: no bound
        self.poll_interval_s = poll_interval_s
        self.stale_after_s = stale_after_s
        self.max_attempts = max_attempts
        self.flush_interval_s = flush_interval_s
        self.temp_grace_s = temp_grace_s
        # Overlap claims the next batch while one is in flight: that batch's claims must not look stale
        # to this very worker meanwhile (they are refreshed every heartbeat_every_s while processed).
        self.pipeline = pipeline and stale_after_s >= 2 * heartbeat_every_s
        self.prefetch = max(1, prefetch)
        self.heartbeat_every_s = heartbeat_every_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.fetch_ahead = FetchAhead(service.sources.get, threads=fetch_threads, max_bytes=fetch_ahead_bytes,
                                      on_ready=self._wake.set)
        self._fetch_beat = time.monotonic()
        self.processor = BatchProcessor(
            service.catalog, service.blobs, service.index, embedder, packages=service.packages,
            worker_id=self.worker_id,
            image_max_bytes=service.image_max_bytes, image_max_pixels=service.image_max_pixels,
            load_threads=load_threads, heartbeat_every_s=heartbeat_every_s,
            batch_pixels=batch_pixels, restage=self.fetch_ahead.restage, embedder_of=service.embedder_of,
        )
        self._last_sweep = time.monotonic()  # recover() sweeps at start
        self._threads: list[threading.Thread] = []
        self._flush_lock = threading.Lock()
        self._last_flush = time.monotonic()

    # -- start-up -----------------------------------------------------------------------------------
    def recover(self, *, reconcile: bool = True, orphan_blobs: bool = True) -> RecoveryReport:
        """Settle this worker's own claims, sweep leftovers, then reconcile every set's index."""
        report = RecoveryReport()
        catalog = self.service.catalog
        with catalog.write() as s:
            cancelled: list[str] = []
            for job in list_jobs(s, states=(JobState.QUEUED, JobState.RUNNING), limit=100_000):
                mine = [i for i in list_items(s, job.id, states=[ItemState.CLAIMED], limit=1_000_000)
                        if i.claimed_by == self.worker_id]
                for item in mine:
                    if item.attempts >= self.max_attempts:
                        complete_item(s, item.id, self.worker_id, ItemState.FAILED, error=(
                            f"abandoned: its worker stopped {item.attempts} times while processing it"))
                        report.abandoned += 1
                report.released += release_items(s, self.worker_id,
                                                  [i.id for i in mine if i.attempts < self.max_attempts])
                if job.cancel_requested:
                    cancelled.append(job.id)
            for job_id in cancelled:  # released items of a cancelled job must not stay pending
                request_cancel(s, job_id)
        report.sweep = self.service.collect_garbage(grace_s=self.temp_grace_s, orphan_blobs=orphan_blobs)
        if reconcile:
            report.reconciled = self.service.reconcile_all()
        log.info("ingestion worker %s recovered: %s", self.worker_id, report)
        return report

    # -- foreground ---------------------------------------------------------------------------------
    def run_once(self, *, job_id: str | None = None) -> BatchResult | None:
        """Claim and process one batch (no overlap); ``None`` when nothing is claimable."""
        items = self._claim(job_id)
        if not items:
            return None
        try:
            result = self.processor.process(items, self._source_for)
        except BaseException as exc:
            self._give_back([i.id for i in items], {i.job_id for i in items}, unattempted=disk_full(exc))
            raise
        self._settle(result)
        return result

    def _claim(self, job_id: str | None) -> list[ItemRecord]:
        """The next batch: claimed items of uploads, archives and folders, and URL items the fetch-ahead has staged
        (at most half the batch while other work is claimable, so each side keeps moving). URL items still being
        fetched are never in a batch: with nothing else to do, this waits for a fetch to end (or a wake-up)."""
        # claims and prepares run on one thread (a run's own preparer thread when overlapped)
        limit = claim_limit(self.batch_size, self.batch_pixels, self.processor.seen.pixels)
        while True:
            share = min(self.fetch_ahead.staged(job_id), max(1, limit // 2))
            with self.service.catalog.write() as s:
                self._refresh_fetch_claims(s)
                urls = self.fetch_ahead.claim(s, self.worker_id, job_id=job_id, stale_after_s=self.stale_after_s,
                                              max_attempts=self.max_attempts)
                others = claim_next_items(
                    s, self.worker_id, job_id=job_id, limit=limit - share, exclude_kinds=(FACETS, URL),
                    stale_after_s=self.stale_after_s, max_attempts=self.max_attempts) if limit > share else []
            self.fetch_ahead.start(urls)
            items = others + self.fetch_ahead.take(limit - len(others), job_id)
            if items or self._stop.is_set() or not self.fetch_ahead.fetching(job_id):
                return items
            self.fetch_ahead.wait(self.poll_interval_s)

    def _refresh_fetch_claims(self, session: Session) -> None:
        """Keep the claims of URL items being fetched or staged fresh (a batch refreshes its own)."""
        if time.monotonic() - self._fetch_beat < self.heartbeat_every_s:
            return
        self._fetch_beat = time.monotonic()
        self.fetch_ahead.keep(set(heartbeat(session, self.worker_id, self.fetch_ahead.held())))

    def _source_for(self, job: JobRecord) -> Source:
        """Where a batch loads a job's items from: a URL job's from the fetch-ahead, the others' from the job's
        source."""
        return self.fetch_ahead.source(job) if job.kind == URL else self.service.sources.get(job)

    def _settle(self, result: BatchResult) -> None:
        """After a batch's commit: close finished jobs' sources, flush the index when one ended."""
        for job in result.finished:
            self.service.job_ended(job)
        self._maybe_flush(force=bool(result.finished))

    def run_until_idle(self, *, job_id: str | None = None, max_batches: int | None = None) -> int:
        """Process batches until none is claimable (or the job is cancelled); returns items handled."""
        if self.pipeline:
            handled = self._overlapped(job_id=job_id, max_batches=max_batches)
        else:
            handled = batches = 0
            self.processor.seen.pixels = []  # a run starts with a small claim (FIRST_CLAIM)
            while max_batches is None or batches < max_batches:
                if job_id is not None and self._cancelled(job_id):
                    break
                result = self.run_once(job_id=job_id)
                if result is None:
                    break
                handled += result.done + result.failed + result.skipped
                batches += 1
        self._maybe_flush(force=True)
        return handled

    def _overlapped(self, *, job_id: str | None = None, max_batches: int | None = None,
                    stop: threading.Event | None = None) -> int:
        """Batches through :class:`Overlap` until none is claimable, the job is cancelled or ``stop``."""
        claimed = [0]

        def claim() -> list[ItemRecord] | None:
            if stop is not None and stop.is_set():
                return None
            if (max_batches is not None and claimed[0] >= max_batches) or (
                    job_id is not None and self._cancelled(job_id)):
                return None
            items = self._claim(job_id)
            claimed[0] += 1
            return items or None

        def give_back(item_ids: list[int], job_ids: set[str]) -> None:
            self._give_back(item_ids, job_ids, unattempted=disk_full(overlap.error))

        overlap = Overlap(self.processor, self._source_for, claim=claim, settle=self._settle,
                          give_back=give_back, prefetch=self.prefetch)
        return overlap.run()

    def _cancelled(self, job_id: str) -> bool:
        with self.service.catalog.read() as s:
            try:
                return is_cancel_requested(s, job_id) or get_job(s, job_id).finished
            except NotFound:
                return True

    def _give_back(self, item_ids: list[int], job_ids: set[str], *, unattempted: bool = False) -> None:
        """After an infrastructure failure: release the batch so it is retried (here or elsewhere); a full disk
        is no fault of the items, so it costs them no attempt (``unattempted``)."""
        try:
            with self.service.catalog.write() as s:
                release_items(s, self.worker_id, item_ids, unattempted=unattempted)
                for job_id in sorted(job_ids):
                    try:
                        if is_cancel_requested(s, job_id):
                            request_cancel(s, job_id)
                    except NotFound:
                        continue
        except Exception:  # the catalog itself may be what failed; the claims then go stale
            log.exception("could not release items %s", item_ids)

    def _maybe_flush(self, *, force: bool = False) -> None:
        """FAISS saves the whole set per flush, so flush at job ends and every ``flush_interval_s``; the
        package store's write-behind queue is drained at the same points (it is a cache: no commit waits)."""
        with self._flush_lock:
            if force or time.monotonic() - self._last_flush >= self.flush_interval_s:
                self.service.index.flush()
                flush = getattr(self.service.packages, "flush", None)
                if force and flush is not None:
                    flush()
                self._last_flush = time.monotonic()

    # -- background ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Run ``threads`` worker threads until :meth:`stop`; call :meth:`recover` first."""
        if self._threads:
            return
        self._stop.clear()
        self.service.listeners.append(self._on_job)
        for n in range(self.threads):
            thread = threading.Thread(target=self._loop, name=f"ingest-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _on_job(self, _job: object) -> None:
        self.wake()

    def wake(self) -> None:
        """A job was created: stop waiting for the next poll (or for a fetch to end)."""
        self._wake.set()
        self.fetch_ahead.nudge()

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def _loop(self) -> None:
        backoff = self.poll_interval_s
        while not self._stop.is_set():
            try:
                busy = self._overlapped(stop=self._stop) > 0 if self.pipeline else self.run_once() is not None
                backoff = self.poll_interval_s
            except Exception as exc:
                if disk_full(exc):
                    self._wait_for_space(exc)
                    continue
                log.exception("ingestion batch failed; its items were released")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 60.0)
                continue
            if not busy:
                self._maybe_flush()
                self._maybe_sweep()
                self._wake.wait(self.poll_interval_s)
                self._wake.clear()

    def _maybe_sweep(self) -> None:
        """While idle, every ``temp_grace_s``: what no committed state refers to (blobs of a deletion cut short,
        staging, temp files) goes once it is older than the grace, not only at the next start."""
        if time.monotonic() - self._last_sweep < self.temp_grace_s:
            return
        self._last_sweep = time.monotonic()
        report = self.service.collect_garbage(grace_s=self.temp_grace_s, orphan_blobs=True)
        if report.orphan_blobs_removed or report.orphan_index_sets:
            log.info("idle sweep: %s", report)

    def _wait_for_space(self, exc: BaseException) -> None:
        """A full disk pauses the workers (the reason shows on every unfinished job and in /readyz) until a probe
        write succeeds; then this worker's claims that could not be handed back are, without costing an attempt."""
        self.service.paused = ("paused: the data directory's disk is full; ingestion resumes by itself once space "
                               "is freed (deleting images or sets frees it)")
        log.warning("ingestion paused, the disk is full: %s", exc)
        self.fetch_ahead.drop()  # released below with the rest of this worker's claims
        while not self._stop.wait(self.poll_interval_s):
            if space_available(self.service.blobs.root):
                try:
                    with self.service.catalog.write() as s:
                        release_claims_of(s, self.worker_id, unattempted=True)
                except Exception as again:
                    if disk_full(again):
                        continue
                    raise
                self.service.reserve.ensure()
                log.info("disk space is back: ingestion resumes")
                break
        self.service.paused = None

    def stop(self, timeout_s: float = 60.0) -> None:
        """Finish the batches in flight, then stop; flushes the index."""
        self._stop.set()
        self.wake()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        if self._on_job in self.service.listeners:
            self.service.listeners.remove(self._on_job)
        self._release_fetched()
        self._maybe_flush(force=True)

    def _release_fetched(self) -> None:
        """URL items fetched ahead and not processed go back to pending; they cost no attempt (none failed)."""
        if held := self.fetch_ahead.drop():
            self._give_back(held, set(), unattempted=True)

    def close(self) -> None:
        self.stop()
        self.fetch_ahead.close()
        self.processor.close()
