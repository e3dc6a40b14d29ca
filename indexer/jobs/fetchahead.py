"""URL items fetched ahead of the batches that index them, so a slow or silent server never holds a worker.

A batch waits for every item it loads: were URL items fetched inside a batch, one silent server would hold the
whole batch (uploads to other sets in it included) until its fetch deadline, batch after batch. So the runner's
claim hands URL items to a :class:`FetchAhead` instead, which fetches them on a pool of its own and keeps each
one (its bytes, or the error its fetch ended with) *staged* in memory until a batch takes it; a batch takes only
staged items, never one still being fetched. Staging is bounded: at most ``max_items`` items staged or being
fetched, and no new URL is claimed while the staged bytes reach ``max_bytes`` (so at most ``max_bytes`` plus one
item's bytes per item being fetched is held). An item a batch hands back because the batch's pixel bound cut it
is staged again with its bytes where they fit in ``max_bytes`` (:meth:`FetchAhead.restage`): it is not fetched
twice.

The claims are the catalog's: made in the runner's claim transaction, refreshed there every ``heartbeat_every_s``
(:meth:`FetchAhead.held`), handed back when the runner stops. A worker killed mid-fetch has written nothing
(only a batch's commit makes an item's image visible); its restart hands its claims back to pending
(:meth:`~indexer.jobs.runner.IngestionRunner.recover`) and the URLs are fetched again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog import ItemRecord, JobRecord, claim_next_items, get_job
from rubricsearch.indexer.sources import Skipped, Source, SourceItem
from rubricsearch.retrieval.errors import BackendUnavailable

URL = "url"
DEFAULT_MAX_BYTES = 256 * 1024**2
SourceFor = Callable[[JobRecord], Source]


@dataclass(eq=False)
class _Held:
    """A URL item this worker claimed: being fetched until ``done``, then staged (bytes or error)."""

    item: ItemRecord
    job: JobRecord
    data: bytes | None = None
    error: BaseException | None = None
    done: bool = False


class FetchAhead:
    """URL items claimed, fetched on ``threads`` threads and staged for the batches; thread safe."""

    def __init__(self, source_for: SourceFor, *, threads: int = 8, max_items: int | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, on_ready: Callable[[], None] | None = None) -> None:
        self.source_for = source_for
        self.max_items = max_items or 2 * max(1, threads)  # every thread busy, as many staged for the batches
        self.max_bytes = max_bytes
        self.on_ready = on_ready
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ingest-fetch")
        self._cond = threading.Condition()
        self._held: dict[int, _Held] = {}  # by item id, in claim order
        self._taken: dict[int, dict[tuple[str, str], _Held]] = {}  # per claiming thread: its last batch's items
        self._staged_bytes = 0
        self._generation = 0  # fetches started before a drop() are not staged

    # -- claiming (in the runner's claim transaction) -----------------------------------------------
    def room(self) -> int:
        """How many more URL items may be claimed now."""
        with self._cond:
            return 0 if self._staged_bytes >= self.max_bytes else max(0, self.max_items - len(self._held))

    def claim(self, session: Session, worker_id: str, *, job_id: str | None, stale_after_s: float,
              max_attempts: int) -> list[_Held]:
        """Claim URL items for the free room in ``session``; :meth:`start` fetches them once it commits."""
        room = self.room()
        if not room:
            return []
        items = claim_next_items(session, worker_id, job_id=job_id, limit=room, kinds=(URL,),
                                 stale_after_s=stale_after_s, max_attempts=max_attempts)
        jobs = {jid: get_job(session, jid) for jid in {i.job_id for i in items}}
        return [_Held(i, jobs[i.job_id]) for i in items]

    def start(self, claimed: list[_Held]) -> None:
        """Fetch what :meth:`claim` claimed (its transaction committed)."""
        with self._cond:
            fresh = [h for h in claimed if h.item.id not in self._held]  # a re-claim of our own stale claim
            self._held.update((h.item.id, h) for h in fresh)
            generation = self._generation
        for h in fresh:
            self._pool.submit(self._fetch, h, generation)

    def held(self) -> list[int]:
        """The item ids whose claims this worker holds for the fetch-ahead (to refresh them)."""
        with self._cond:
            return list(self._held)

    def keep(self, still_held: set[int]) -> None:
        """Forget the items whose claims were taken over (a heartbeat did not find them ours)."""
        with self._cond:
            for item_id in [i for i in self._held if i not in still_held]:
                self._forget(item_id)

    def drop(self) -> list[int]:
        """Forget everything held (the runner stops, or releases all its claims); returns the item ids to release.
        Fetches still running finish into nothing."""
        with self._cond:
            ids = list(self._held)
            for item_id in ids:
                self._forget(item_id)
            self._taken.clear()
            self._generation += 1
            self._cond.notify_all()
        return ids

    def restage(self, handed: list[tuple[ItemRecord, JobRecord, bytes]]) -> set[int]:
        """Stage again, in order and first in line, URL items a batch took and then handed back (its pixel bound
        cut it: :func:`~indexer.jobs.sizing.fit`) with their bytes, their claims still ours, so the next batch
        takes them without fetching them again; returns the ids kept. The others (not URL items, or whose bytes
        would take the staged bytes over ``max_bytes``) are the caller's to release."""
        kept: dict[int, _Held] = {}
        with self._cond:
            for item, job, data in handed:
                if job.kind == URL and self._staged_bytes + len(data) <= self.max_bytes:
                    kept[item.id] = _Held(item, job, data=data, done=True)
                    self._staged_bytes += len(data)
            if kept:
                self._held = {**kept, **{i: h for i, h in self._held.items() if i not in kept}}
                self._cond.notify_all()
        return set(kept)

    def _forget(self, item_id: int) -> None:
        h = self._held.pop(item_id)
        self._staged_bytes -= len(h.data or b"")

    # -- fetching -----------------------------------------------------------------------------------
    def _fetch(self, h: _Held, generation: int) -> None:
        data: bytes | None = None
        error: BaseException | None = None
        try:
            data = self.source_for(h.job).load(h.item.source_ref)
        except Exception as exc:  # the item fails alone, with this reason, when a batch takes it
            error = exc
        with self._cond:
            if generation != self._generation or self._held.get(h.item.id) is not h:
                return
            h.data, h.error, h.done = data, error, True
            self._staged_bytes += len(data or b"")
            self._cond.notify_all()
        if self.on_ready is not None:
            self.on_ready()

    # -- the batches --------------------------------------------------------------------------------
    def staged(self, job_id: str | None = None) -> int:
        """Items staged for a batch (of ``job_id`` only, if given)."""
        with self._cond:
            return sum(1 for h in self._held.values() if h.done and job_id in (None, h.item.job_id))

    def fetching(self, job_id: str | None = None) -> bool:
        """Whether an item (of ``job_id``, if given) is still being fetched."""
        with self._cond:
            return any(not h.done and job_id in (None, h.item.job_id) for h in self._held.values())

    def take(self, limit: int, job_id: str | None = None) -> list[ItemRecord]:
        """Up to ``limit`` staged items for the calling thread's next batch, which reads them through
        :meth:`source` (the thread's previous batch has read its own by now)."""
        with self._cond:
            picked = [h for h in self._held.values() if h.done and job_id in (None, h.item.job_id)][:max(0, limit)]
            for h in picked:
                self._forget(h.item.id)
            if picked:
                self._taken[threading.get_ident()] = {(h.item.job_id, h.item.source_ref): h for h in picked}
            else:
                self._taken.pop(threading.get_ident(), None)
        return [h.item for h in picked]

    def wait(self, timeout_s: float) -> None:
        """Until a fetch ends or :meth:`nudge` (something else may be claimable), at most ``timeout_s``."""
        with self._cond:
            self._cond.wait(timeout_s)

    def nudge(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def source(self, job: JobRecord) -> Source:
        """What a batch loads a URL job's items through: the staged bytes, or the fetch's error raised again."""
        return _StagedUrls(self, job.id)

    def _load(self, job_id: str, ref: str) -> bytes:
        with self._cond:  # each taken item is read once, by the batch that took it
            h = next((t.pop((job_id, ref)) for t in self._taken.values() if (job_id, ref) in t), None)
        if h is None:  # only a batch that did not take the item through take() gets here
            raise BackendUnavailable(f"{ref}: not fetched ahead", ref=ref)
        if h.error is not None:
            raise h.error
        assert h.data is not None
        return h.data

    def close(self) -> None:
        """Stop fetching (running fetches end at their deadlines, into nothing); release via :meth:`drop` first."""
        self.drop()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _StagedUrls:
    """The :class:`~indexer.sources.Source` a batch reads a URL job's staged items from."""

    kind = URL

    def __init__(self, ahead: FetchAhead, job_id: str) -> None:
        self._ahead, self._job_id = ahead, job_id

    def __len__(self) -> int:
        return 0

    def items(self) -> Iterator[SourceItem]:
        return iter(())

    def load(self, ref: str) -> bytes:
        return self._ahead._load(self._job_id, ref)

    @property
    def skipped(self) -> list[Skipped]:
        return []

    @property
    def skipped_count(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing to release: the bytes belong to the fetch-ahead."""
