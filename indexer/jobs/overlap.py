"""Overlapping consecutive batches: each group of stages on its own thread, batches handed on through queues.

Prepare (CPU: load, decode, preprocess), encode (the vision towers), pack (the packages quantised and stored),
embed (the LM pass), store (blobs, vectors), sync (the package files, one filesystem sync) and commit (the
catalog) each run on a thread of their own, so while batch *i* is committed, batch *i+1* is synced, *i+2*
stored, *i+3* in the LM, *i+4* packed, *i+5* in the towers and *i+6* decoded (with the one-batch queues
between them, up to ``prefetch`` + 12 claimed batches are in flight when the commit is the slowest stage). The
GPU then waits neither for decoding, fsyncs or the catalog nor for one thread that launches a tower only after
waiting for the previous LM pass or after
packing the last batch (as long as the tower pass itself, every small op paying a wait for the GIL). The price
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

from rubricsearch.indexer.catalog import ItemRecord
from rubricsearch.indexer.jobs.batch import Batch
from rubricsearch.indexer.jobs.pipeline import BatchProcessor, BatchResult, SourceFor

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
        # a thread each after encode (the caller's thread), each fed by one queue; the last hands nothing on
        self._stages: tuple[tuple[str, Callable[[Batch], Batch | None]], ...] = (
            ("pack", processor.pack), ("embed", processor.embed), ("store", processor.store),
            ("sync", processor.sync), ("commit", self._commit))
        self._queues: list[queue.Queue[Batch | None]] = [queue.Queue(maxsize=1) for _ in self._stages]
        self._open: dict[int, list[ItemRecord]] = {}  # claimed and not yet committed, by claim number
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._error: BaseException | None = None
        self.handled = 0

    def run(self) -> int:
        """Process until nothing is claimable; returns the items handled (done, failed or skipped)."""
        preparer = threading.Thread(target=self._prepare_loop, name="ingest-prepare", daemon=True)
        stages = [threading.Thread(target=self._stage_loop, args=(k,), name=f"ingest-{name}", daemon=True)
                  for k, (name, _) in enumerate(self._stages)]
        started: list[threading.Thread] = []
        drained = False
        try:
            for thread in (preparer, *stages):  # inside the try: a failed start still cleans up
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
                with self._lock:  # prepare hands back the items over the batch's pixel bound
                    self._open[n] = batch.items
                batch.claim_no = n
                n += 1
                self._ready.put(batch)
        except BaseException as exc:
            self._fail(exc)
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

    @property
    def error(self) -> BaseException | None:
        """The first failure of a stage, once one failed."""
        return self._error

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
