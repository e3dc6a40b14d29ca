"""Overlapping consecutive batches: each group of stages on its own thread, batches handed on through queues.

Claim (the catalog), prepare (CPU: load, decode, preprocess), encode (the vision towers), pack (the packages
quantised and stored), embed (the LM pass), store (blobs, vectors), sync (the package files, one filesystem sync)
and commit (the catalog) each run on a thread of their own, so while batch *i* is committed, batch *i+1* is
synced, *i+2* stored, *i+3* in the LM, *i+4* packed, *i+5* in the towers, *i+6* decoded and *i+7* claimed (with
one-batch queues between them, up to ``prefetch`` + 14 claimed batches are in flight when the commit is the
slowest stage; ``disk_depth`` lets the queues before store, sync and commit hold more: no gain measured on an
H100, ``bench/gpu_run.sh depth81``). The GPU then waits neither for claims, decoding, fsyncs or the catalog nor
for one thread that launches a tower only after waiting for the previous LM pass (on an H100 that thread waited
for the LM a third of its time) or after packing the last batch (as long as the tower pass itself, every small
op paying a wait for the GIL). The price
is memory: up to three batches of tower outputs, not yet quantised, wait on the device between the towers and
the pack stage (one being packed, one queued, one just made). Each batch still goes through the stages in
order and commits alone, after its own sync, exactly as :meth:`BatchProcessor.process` would. When any stage
fails, nothing new is claimed, the batches in flight are dropped and their claims handed back, and the error
is raised once every thread has stopped.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable

from indexer.catalog import ItemRecord
from indexer.jobs.pipeline import Batch, BatchProcessor, BatchResult, SourceFor

log = logging.getLogger(__name__)

# Claims one ahead of the preparer (off: each claim waits until the batch before it is prepared, as the one thread
# that claimed and prepared did before 2026-11-26; the benches' ``--revert claim``)
CLAIM_AHEAD = True


class Overlap:
    """One run of overlapped batches until ``claim`` returns nothing; see the module docstring."""

    def __init__(
        self,
        processor: BatchProcessor,
        source_for: SourceFor,
        *,
        claim: Callable[[], list[ItemRecord] | None],
        settle: Callable[[BatchResult], None],
        give_back: Callable[[list[int], set[str]], None],
        prefetch: int = 1,
        disk_depth: int = 1,
    ) -> None:
        self.processor, self.source_for = processor, source_for
        self.claim, self.settle, self.give_back = claim, settle, give_back
        self._ready: queue.Queue[Batch | None] = queue.Queue(maxsize=max(1, prefetch))
        # claims are made on a thread of their own, one ahead of the preparer: a claim waits for the catalog's
        # writer (the commit stage's transaction) and took 30 ms of the preparer's 157 ms a batch at 448 px on an
        # H100, where the preparer (nvJPEG decode) was the slowest stage (bench/gpu_run.sh idle83)
        self._claimed: queue.Queue[tuple[int, list[ItemRecord]] | None] = queue.Queue(maxsize=1)
        self._prepared = 0  # batches the preparer is done with (the claimer waits for the first: its sizes)
        self._prepared_cv = threading.Condition()
        self._pixels: list[int] = []  # the image sizes of the last batch prepared, handed to the claimer's thread
        # a thread each after encode (the caller's thread), each fed by one queue; the last hands nothing on
        self._stages: tuple[tuple[str, Callable[[Batch], Batch | None]], ...] = (
            ("pack", processor.pack), ("embed", processor.embed), ("store", processor.store),
            ("sync", processor.sync), ("commit", self._commit))
        # The queues into the disk stages (store, sync, commit) may hold more than one batch: what waits there
        # is blobs and vectors, not device tensors, and a slow fsync or commit then no longer holds up the LM
        # pass, and through it the towers, by a batch's worth.
        self._queues: list[queue.Queue[Batch | None]] = [
            queue.Queue(maxsize=max(1, disk_depth) if name in ("store", "sync", "commit") else 1)
            for name, _ in self._stages]
        self._open: dict[int, list[ItemRecord]] = {}  # claimed and not yet committed, by claim number
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._error: BaseException | None = None
        self.handled = 0

    def run(self) -> int:
        """Process until nothing is claimable; returns the items handled (done, failed or skipped)."""
        claimer = threading.Thread(target=self._claim_loop, name="ingest-claim", daemon=True)
        preparer = threading.Thread(target=self._prepare_loop, name="ingest-prepare", daemon=True)
        stages = [threading.Thread(target=self._stage_loop, args=(k,), name=f"ingest-{name}", daemon=True)
                  for k, (name, _) in enumerate(self._stages)]
        started: list[threading.Thread] = []
        drained = False
        try:
            for thread in (claimer, preparer, *stages):  # inside the try: a failed start still cleans up
                thread.start()
                started.append(thread)
            while (batch := self._ready.get()) is not None:  # the preparer always ends with None
                if self._failed.is_set():
                    continue
                try:
                    self.processor.encode(batch)
                except BaseException as exc:
                    self._fail(exc)
                    continue
                self._queues[0].put(batch)
            drained = True
        finally:
            if not drained:  # interrupted here (e.g. KeyboardInterrupt): stop claiming, let the preparer end
                self._failed.set()
                if preparer not in started:  # nobody takes the claims: let the claimer end here
                    while claimer.is_alive():
                        with contextlib.suppress(queue.Empty):
                            self._claimed.get(timeout=0.05)
                elif claimer not in started:  # the preparer waits for the claimer's end
                    self._claimed.put(None)
                while preparer.is_alive() or not self._ready.empty():
                    with contextlib.suppress(queue.Empty):
                        self._ready.get(timeout=0.05)
            self._end(started, stages)
            self._release_open()
        if self._error is not None:
            raise self._error
        return self.handled

    def _end(self, started: list[threading.Thread], stages: list[threading.Thread]) -> None:
        """Send the end down the chain of stage threads (each passes it on) and wait for every started thread;
        a stage whose thread never started passes the end on here."""
        self._queues[0].put(None)
        for k, thread in enumerate(stages):
            if thread in started:
                thread.join()
            else:
                self._stage_loop(k, run=False)
        for thread in started:
            thread.join()

    def _claim_loop(self) -> None:
        n = 0
        try:
            while not self._failed.is_set():
                # the second claim is sized by the first batch's images, so it waits for them
                if n and not self._wait_prepared(min(n, 1) if CLAIM_AHEAD else n):
                    break
                with self._prepared_cv:
                    self.processor.seen.pixels = self._pixels  # claims are sized on this thread (``Seen``)
                items = self.claim()
                if not items:
                    break
                with self._lock:  # never our own claims in flight again (only if they went stale)
                    busy = {i.id for batch in self._open.values() for i in batch}
                    items = [i for i in items if i.id not in busy]
                    self._open[n] = items
                if not items:  # stale_after_s far too short for overlap: let the batches in flight end
                    log.warning("re-claimed only items already in flight; stopping this run early")
                    break
                self._claimed.put((n, items))
                n += 1
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._claimed.put(None)

    def _wait_prepared(self, count: int) -> bool:
        """Until ``count`` batches are prepared; False once the run failed."""
        with self._prepared_cv:
            while self._prepared < count and not self._failed.is_set():
                self._prepared_cv.wait(0.05)
        return not self._failed.is_set()

    def _prepare_loop(self) -> None:
        try:
            while (claimed := self._claimed.get()) is not None:
                if self._failed.is_set():
                    continue  # drain: the claimer may wait to hand on its next claim
                n, items = claimed
                try:
                    batch = self.processor.prepare(items, self.source_for)
                except BaseException as exc:
                    self._fail(exc)
                    continue
                finally:
                    with self._prepared_cv:
                        self._pixels = list(self.processor.seen.pixels)
                        self._prepared += 1
                        self._prepared_cv.notify_all()
                batch.claim_no = n
                self._ready.put(batch)
        finally:
            self._ready.put(None)

    def _stage_loop(self, k: int, run: bool = True) -> None:
        """Stage ``k`` on each batch until the end comes, then the end to the next stage; ``run=False`` (or a
        failure anywhere) only drains, dropping the batches in flight."""
        inbox = self._queues[k]
        outbox = self._queues[k + 1] if k + 1 < len(self._queues) else None
        stage = self._stages[k][1]
        try:
            while (batch := inbox.get()) is not None:
                if not run or self._failed.is_set():
                    continue
                try:
                    out = stage(batch)
                except BaseException as exc:
                    self._fail(exc)
                    continue
                if outbox is not None and out is not None:
                    outbox.put(out)
        finally:
            if outbox is not None:
                outbox.put(None)

    def _commit(self, batch: Batch) -> None:
        """The last stage: the catalog commit, then the batch's claims are no longer ours to hand back."""
        result = self.processor.commit(batch)
        with self._lock:
            self._open.pop(batch.claim_no, None)
        self.handled += result.done + result.failed + result.skipped
        self.settle(result)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc
        self._failed.set()

    def _release_open(self) -> None:
        with self._lock:
            batches, self._open = list(self._open.values()), {}
        for items in batches:
            self.give_back([i.id for i in items], {i.job_id for i in items})
