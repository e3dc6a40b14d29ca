"""Overlapping consecutive batches: each group of stages on its own thread, batches handed on through queues.

Prepare (CPU: load, decode, preprocess), encode (the vision towers), embed (the LM pass), store (blobs,
vectors, one filesystem sync) and commit (the catalog) each run on a thread of their own, so while batch *i*
is committed, batch *i+1* is synced, *i+2* is in the LM, *i+3* in the towers and *i+4* decoded (with the
one-batch queues between them, up to ``prefetch`` + 8 claimed batches are in flight when the commit is the
slowest stage). The GPU
then waits neither for decoding, fsyncs or the catalog nor for one thread that launches a tower only after
waiting for the previous LM pass (on an H100 that thread waited for the LM a third of its time). Each
batch still goes through the stages in order and commits alone, after its own sync, exactly as
:meth:`BatchProcessor.process` would. When any stage fails, nothing new is claimed, the batches in flight
are dropped and their claims handed back, and the error is raised once every thread has stopped.
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
    ) -> None:
        self.processor, self.source_for = processor, source_for
        self.claim, self.settle, self.give_back = claim, settle, give_back
        self._ready: queue.Queue[Batch | None] = queue.Queue(maxsize=max(1, prefetch))
        # between the threads of encode -> embed -> store -> commit (the caller's thread encodes)
        self._stages = (processor.embed, processor.store)
        self._queues: list[queue.Queue[Batch | None]] = [queue.Queue(maxsize=1) for _ in range(len(self._stages) + 1)]
        self._open: dict[int, list[ItemRecord]] = {}  # claimed and not yet committed, by claim number
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._error: BaseException | None = None
        self.handled = 0

    def run(self) -> int:
        """Process until nothing is claimable; returns the items handled (done, failed or skipped)."""
        preparer = threading.Thread(target=self._prepare_loop, name="ingest-prepare", daemon=True)
        stages = [threading.Thread(target=self._stage_loop, args=(k,), name=f"ingest-{fn.__name__}", daemon=True)
                  for k, fn in enumerate(self._stages)]
        committer = threading.Thread(target=self._commit_loop, name="ingest-commit", daemon=True)
        started: list[threading.Thread] = []
        drained = False
        try:
            for thread in (preparer, *stages, committer):  # inside the try: a failed start still cleans up
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
                while preparer.is_alive() or not self._ready.empty():
                    with contextlib.suppress(queue.Empty):
                        self._ready.get(timeout=0.05)
            self._end(started, stages, committer)
            self._release_open()
        if self._error is not None:
            raise self._error
        return self.handled

    def _end(self, started: list[threading.Thread], stages: list[threading.Thread],
             committer: threading.Thread) -> None:
        """Send the end down the chain of stage threads (each passes it on) and wait for every started thread;
        a stage whose thread never started passes the end on here."""
        self._queues[0].put(None)
        for k, thread in enumerate(stages):
            if thread in started:
                thread.join()
            else:
                self._drain(self._queues[k], self._queues[k + 1])
        if committer in started:
            committer.join()
        for thread in started:
            thread.join()

    @staticmethod
    def _drain(inbox: queue.Queue[Batch | None], outbox: queue.Queue[Batch | None]) -> None:
        while inbox.get() is not None:
            pass
        outbox.put(None)

    def _prepare_loop(self) -> None:
        n = 0
        try:
            while not self._failed.is_set():
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
                batch = self.processor.prepare(items, self.source_for)
                batch.claim_no = n
                n += 1
                self._ready.put(batch)
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._ready.put(None)

    def _stage_loop(self, k: int) -> None:
        inbox, outbox = self._queues[k], self._queues[k + 1]
        try:
            while (batch := inbox.get()) is not None:
                if self._failed.is_set():
                    continue  # drain: the batches in flight are dropped
                try:
                    outbox.put(self._stages[k](batch))
                except BaseException as exc:
                    self._fail(exc)
        finally:
            outbox.put(None)

    def _commit_loop(self) -> None:
        while (batch := self._queues[-1].get()) is not None:
            if self._failed.is_set():
                continue
            try:
                result = self.processor.commit(batch)
                with self._lock:
                    self._open.pop(batch.claim_no, None)
                self.handled += result.done + result.failed + result.skipped
                self.settle(result)
            except BaseException as exc:
                self._fail(exc)

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
