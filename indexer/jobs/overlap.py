"""Overlapping consecutive batches: each group of stages on its own thread, batches handed on through queues.

Prepare (CPU: load, decode, preprocess), encode (the vision towers), pack (the packages quantised and stored),
embed (the LM pass), store (blobs, vectors), sync (the package files, one filesystem sync) and commit (the
catalog) each run on a thread of their own, so while batch *i* is committed, batch *i+1* is synced, *i+2*
stored, *i+3* in the LM, *i+4* packed, *i+5* in the towers and *i+6* decoded (with the one-batch queues
between them, up to ``prefetch`` + 13 claimed batches are in flight when the commit is the slowest stage). The
GPU then waits neither for decoding, fsyncs or the catalog nor for one thread that launches a tower only after
waiting for the previous LM pass (on an H100 that thread waited for the LM a third of its time) or after
packing the last batch (as long as the tower pass itself, every small op paying a wait for the GIL). The price
is memory: up to three batches of tower outputs, not yet quantised, wait on the device between the towers and
the pack stage (one being packed, one queued, one just made). Each batch still goes through the stages in
order and commits alone, after its own sync, exactly as :meth:`BatchProcessor.process` would. When any stage
fails, nothing new is claimed, the batches in flight are dropped and their claims handed back, and the error
is raised once every thread has stopped.

The embed stage runs on :data:`EMBED_WORKERS` threads that hand their batches on in claim order: while one
waits for its batch's vectors, the next batch's prompts and ids are made and its LM pass queues behind the
running one (on an H100 the LM stage had been the longest, 85 % of the wall time, and the GPU idled between
passes while one thread did that host work after each read-back).
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

EMBED_WORKERS = 2  # the embed stage's threads (``--revert embed-ahead`` in the benches: one)


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
        self._workers = [EMBED_WORKERS if name == "embed" else 1 for name, _ in self._stages]
        self._queues: list[queue.Queue[Batch | None]] = [queue.Queue(maxsize=1) for _ in self._stages]
        self._order = [_Turns() for _ in self._stages]
        self._open: dict[int, list[ItemRecord]] = {}  # claimed and not yet committed, by claim number
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._error: BaseException | None = None
        self.handled = 0

    def run(self) -> int:
        """Process until nothing is claimable; returns the items handled (done, failed or skipped)."""
        preparer = threading.Thread(target=self._prepare_loop, name="ingest-prepare", daemon=True)
        stages = [(k, threading.Thread(target=self._stage_loop, args=(k,), name=f"ingest-{name}", daemon=True))
                  for k, (name, _) in enumerate(self._stages) for _ in range(self._workers[k])]
        started: list[threading.Thread] = []
        drained = False
        try:
            preparer.start()
            started.append(preparer)
            for k, thread in stages:  # inside the try: a failed start still cleans up
                turns = self._order[k]
                with turns.done:  # before it runs: a sibling that meets the end must know it is not the last
                    turns.live += 1
                try:
                    thread.start()
                except BaseException:
                    with turns.done:
                        turns.live -= 1
                    raise
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

    def _end(self, started: list[threading.Thread], stages: list[tuple[int, threading.Thread]]) -> None:
        """Send the end down the chain of stage threads (each stage passes it on once its last thread meets it)
        and wait for every started thread; a stage none of whose threads started passes the end on here."""
        self._queues[0].put(None)
        for k in range(len(self._stages)):
            mine = [thread for j, thread in stages if j == k and thread in started]
            if not mine:
                with self._order[k].done:
                    self._order[k].live = 1
                self._stage_loop(k, run=False)
            for thread in mine:
                thread.join()
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
                batch.claim_no = n
                n += 1
                self._ready.put(batch)
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._ready.put(None)

    def _stage_loop(self, k: int, run: bool = True) -> None:
        """One thread of stage ``k``: the stage on each batch it takes, handed on in the order the batches came,
        until the end comes; the stage's last thread to meet it passes it on. ``run=False`` (or a failure
        anywhere) only drains, dropping the batches in flight."""
        inbox = self._queues[k]
        outbox = self._queues[k + 1] if k + 1 < len(self._queues) else None
        stage, turns = self._stages[k][1], self._order[k]
        try:
            while True:
                with turns.take:  # a ticket in the order the batches leave the inbox
                    batch = inbox.get()
                    ticket = turns.taken
                    turns.taken += 1
                if batch is None:
                    inbox.put(None)  # for this stage's other threads (the last one takes it back below)
                    break
                out = None
                if run and not self._failed.is_set():
                    try:
                        out = stage(batch)
                    except BaseException as exc:
                        self._fail(exc)
                with turns.done:
                    while turns.handed != ticket:
                        turns.done.wait()
                try:
                    if outbox is not None and out is not None:
                        outbox.put(out)
                finally:
                    with turns.done:
                        turns.handed += 1
                        turns.done.notify_all()
        finally:
            with turns.done:
                turns.live -= 1
                last = turns.live == 0
            if last:
                with contextlib.suppress(queue.Empty):
                    inbox.get_nowait()  # the end this thread put back: nobody is left to take it
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


class _Turns:
    """A stage's ordering: tickets taken as batches leave its inbox, handed on in ticket order."""

    def __init__(self) -> None:
        self.take = threading.Lock()
        self.done = threading.Condition()
        self.taken = self.handed = 0
        self.live = 0  # the stage's threads started and not yet ended
