"""Automatic refits: a set's calibration follows its judgments without anyone asking.

Every change to a set's judgments (recorded one at a time or in bulk, imported, derived, deleted, or gone with a
deleted reference) calls :meth:`Refitter.changed`; one background thread refits the changed sets, one at a time,
never on a request's path. Changes are coalesced: a set is refitted once its judgments have been quiet for
:data:`QUIET_S`, or :data:`LONGEST_WAIT_S` after its first unfitted change while they keep coming, and a change
made during its refit is picked up by one more refit after it, no sooner than that refit took again after its
end, so a set judged without pause is refitted at most half the time, whatever its size. Searches keep using the
set's latest saved fit until the new one is saved (a new version; provenance names it), so they neither wait for a
refit nor see half of one.

At start, and every :data:`LOOK_S` after, the thread refits every set whose fit lags the catalog
(:func:`app.calibration.needs_refit`: judgments moved, a judged reference indexed since, another reranker, a
candidate-only fit reading another score than searches do), and before each refit it checks again, so a set an
asked-for refit (``POST .../calibration``) brought up to date in the meantime is left as it is. The look is what
follows whatever no request here reported: judgments another process wrote, and indexing. A judgment of a
reference not indexed is left out of a fit (no package to score it from) and a fit counts the judgments it could
score, so a look finds the set once that reference is indexed, by this process's ingestion or another's (a
``rubricsearch worker``) alike; ingestion tells no refitter.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from rubricsearch.app.calibration import needs_refit, refit, set_lock
from rubricsearch.indexer.catalog import Catalog, get_set
from rubricsearch.indexer.catalog.calibrations import judged_sets
from rubricsearch.retrieval.errors import Conflict, NotFound
from rubricsearch.retrieval.search.service import SearchService

log = logging.getLogger("rubricsearch.app")

QUIET_S = 2.0  # a burst of marks or single judgments (one request each) is one refit
LONGEST_WAIT_S = 30.0  # judgments recorded without pause still get refitted this often
RETRY_S = 5.0  # after another process saved the same version (Conflict)
# Between looks for sets whose fit lags the catalog: a few catalog reads per judged set, and a judged reference
# indexed (here or elsewhere) is taken in within LONGEST_WAIT_S of it, as a judgment recorded without pause would be.
LOOK_S = LONGEST_WAIT_S


@dataclass
class _Pending:
    first: float  # monotonic time of the first change not yet refitted
    last: float  # and of the latest one
    rest_until: float = 0.0  # not before: the end of the set's last refit plus the time it took


class Refitter:
    """The background refits of one process's sets (see the module's docstring)."""

    def __init__(self, catalog: Catalog, search: SearchService, *, quiet_s: float = QUIET_S,
                 longest_wait_s: float = LONGEST_WAIT_S, look_s: float = LOOK_S) -> None:
        self.catalog = catalog
        self.search = search
        self.quiet_s = quiet_s
        self.longest_wait_s = longest_wait_s
        self.look_s = look_s
        self.refits = 0  # saved by this refitter
        self.failures = 0
        self._pending: dict[str, _Pending] = {}
        self._running: str | None = None
        self._rest_until: dict[str, float] = {}  # per set: its last refit's end plus its duration
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="rubricsearch-refits", daemon=True)

    def start(self) -> Refitter:
        self._thread.start()
        return self

    def stop(self, timeout: float) -> None:
        """Stop after the refit under way, if any (at most ``timeout`` seconds of waiting for it)."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def changed(self, set_id: str) -> None:
        """The set's judgments changed: refit it once they have been quiet for a while."""
        self._schedule(set_id, time.monotonic())

    def pending(self, set_id: str) -> bool:
        """Whether a refit of the set is scheduled or under way."""
        with self._wake:
            return set_id in self._pending or self._running == set_id

    @property
    def running(self) -> str | None:
        """The set being refitted now (None: none)."""
        with self._wake:
            return self._running

    def _schedule(self, set_id: str, at: float) -> None:
        with self._wake:
            found = self._pending.get(set_id)
            if found is None:
                self._pending[set_id] = _Pending(first=at, last=at, rest_until=self._rest_until.get(set_id, 0.0))
            else:
                found.last = max(found.last, at)
            self._wake.notify_all()

    def _due(self, now: float) -> tuple[str | None, float]:
        """The set to refit now (None: none yet) and how long until the next one is due."""
        wait = float("inf")
        for set_id, p in self._pending.items():
            at = max(min(p.last + self.quiet_s, p.first + self.longest_wait_s), p.rest_until)
            if at <= now:
                return set_id, 0.0
            wait = min(wait, at - now)
        return None, wait

    def _run(self) -> None:
        self._catch_up()
        look_at = time.monotonic() + self.look_s
        while True:
            with self._wake:
                while True:
                    if self._stopping:
                        return
                    now = time.monotonic()
                    set_id, wait = self._due(now)
                    if set_id is not None or now >= look_at:
                        break
                    self._wake.wait(min(wait, look_at - now))
                if set_id is None:  # time to look for what other processes changed
                    look_at = now + self.look_s
                else:
                    del self._pending[set_id]
                    self._running = set_id
            if set_id is None:
                self._catch_up()
                continue
            began = time.monotonic()
            try:
                self._refit(set_id)
            finally:
                ended = time.monotonic()
                with self._wake:
                    self._running = None
                    rest = self._rest_until[set_id] = ended + (ended - began)
                    if set_id in self._pending:  # changed during the refit
                        self._pending[set_id].rest_until = rest

    def _catch_up(self) -> None:
        """Schedule the sets whose judgments moved while no process followed them (now due: nothing to wait for)."""
        try:
            with self.catalog.read() as session:
                sets = judged_sets(session)
            for set_id in sets:
                if needs_refit(self.catalog, self.search, set_id):
                    self._schedule(set_id, time.monotonic() - self.longest_wait_s)
        except Exception:  # a catalog that fails here fails every request too; the next change schedules again
            log.exception("could not look for sets whose calibration lags their judgments")

    def _refit(self, set_id: str) -> None:
        try:
            with set_lock(set_id):  # checked under the lock: an asked-for refit may have just saved one
                if not needs_refit(self.catalog, self.search, set_id):
                    return
                with self.catalog.read() as session:
                    record = get_set(session, set_id)
                saved = refit(self.catalog, self.search, record).calibration
            self.refits += 1
            log.info("set %s: calibration v%d refitted on %d judgments (%s)", set_id, saved.version,
                     saved.judgments, saved.status)
        except NotFound:  # the set was deleted meanwhile
            return
        except Conflict:  # another process saved this version first: look again shortly
            self._schedule(set_id, time.monotonic() + RETRY_S)
        except Exception:  # the set stays stale (its reports say so); its next change or a restart tries again
            self.failures += 1
            log.exception("set %s: automatic refit failed", set_id)


def changed(refits: Refitter | None, set_id: str) -> None:
    """Tell the process's refitter (None: this process runs none, as the CLI) that a set's judgments changed."""
    if refits is not None:
        refits.changed(set_id)



def pending(refits: Refitter | None, set_id: str) -> bool:
    """Whether the process's refitter has a refit of the set scheduled or under way."""
    return refits is not None and refits.pending(set_id)
