"""``rubricsearch worker``: a standalone ingestion worker on the shared catalog, blobs, packages and vectors.

The API process (``RUBRICSEARCH_INGEST__WORKERS=0``) only creates jobs; any number of these processes claim their
items (``FOR UPDATE SKIP LOCKED`` on PostgreSQL), run vision + embedding, and write blobs, packages,
vectors and catalog rows. Everything comes from the same settings as the server.

The worker id is stable, ``<hostname>:<slot>`` with the lowest free slot, so a restarted worker gets its
own claims back at once (``recover()``) instead of waiting for them to go stale. A lease makes the id
exclusive: a PostgreSQL advisory lock (any host), else a file lock under the data directory (one host,
the only case SQLite supports). Two live processes under one id would release each other's claims.

SIGTERM/SIGINT: no new batch is claimed, the batches in flight finish (up to
``WORKER_STOP_TIMEOUT_S`` in app/services.py), claims still held are released, the index is flushed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from rubricsearch.retrieval.errors import BackendUnavailable, Conflict, InvalidInput

if TYPE_CHECKING:  # the heavy imports wait for a command that runs (``--help`` stays quick)
    from rubricsearch.app.settings import Settings
    from rubricsearch.indexer.catalog import Catalog
    from rubricsearch.indexer.jobs import IngestionRunner

log = logging.getLogger("rubricsearch.worker")
MAX_SLOTS = 1024
_PG_KEY = "hashtextextended('rubricsearch-worker:' || current_schema() || ':' || :id, 0)"


def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="run an ingestion worker on the shared catalog (scale-out)")
    p.add_argument("--threads", type=int, default=None,
                   help="worker threads in this process (default: RUBRICSEARCH_INGEST__WORKERS, at least 1)")
    p.add_argument("--worker-id", default=None,
                   help="stable id for claims (default: <hostname>:<lowest free slot>)")
    p.add_argument("--once", action="store_true", help="process until no item is claimable, then exit")
    p.add_argument("--batch-size", type=int, default=None,
                   help="items per claimed batch (default: 64 with a CUDA device, 8 on the CPU)")
    p.add_argument("--poll-interval", type=float, default=None,
                   help="seconds between an idle worker's looks for new job items (default: 1)")
    p.add_argument("--no-reconcile", action="store_true",
                   help="at start-up settle own claims only; skip the index reconcile and the orphan-blob sweep "
                        "(they read every set and every blob: let one worker do them)")
    p.set_defaults(func=run)


# -- the worker id and its lease ---------------------------------------------------------------------------
class WorkerLease:
    """Holds a worker id exclusively while the process lives (released on close or death)."""

    def __init__(self, catalog: Catalog, lock_dir: Path) -> None:
        self.catalog = catalog
        self.lock_dir = lock_dir
        self._conn: Any = None
        self._file: Any = None
        self.worker_id: str | None = None

    def try_acquire(self, worker_id: str) -> bool:
        if self.catalog.dialect == "postgresql":
            return self._try_advisory(worker_id)
        return self._try_flock(worker_id)

    def _try_advisory(self, worker_id: str) -> bool:
        """A session advisory lock keyed by schema and id (advisory locks are per database, not per schema)."""
        from sqlalchemy import text

        if self._conn is None:  # one connection for the lease; session advisory locks die with it
            self._conn = self.catalog.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        if self._conn.execute(text(f"SELECT pg_try_advisory_lock({_PG_KEY})"), {"id": worker_id}).scalar():
            self.worker_id = worker_id
            return True
        return False

    def _try_flock(self, worker_id: str) -> bool:
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9._-]", "_", worker_id) + "-" + hashlib.sha256(worker_id.encode()).hexdigest()[:8]
        handle = open(self.lock_dir / f"{name}.lock", "a+b")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return False
        self._file, self.worker_id = handle, worker_id
        return True

    def close(self) -> None:
        if self._conn is not None:
            from sqlalchemy import text

            with contextlib.suppress(Exception):
                if self.worker_id is not None:  # at once: a closed session drops its locks only when it ends
                    self._conn.execute(text(f"SELECT pg_advisory_unlock({_PG_KEY})"), {"id": self.worker_id})
            with contextlib.suppress(Exception):
                self._conn.invalidate()  # not back to the pool
                self._conn.close()
            self._conn = None
        if self._file is not None:
            self._file.close()
            self._file = None


def acquire_worker_id(lease: WorkerLease, explicit: str | None, hostname: str | None = None) -> str:
    """The explicit id if nobody holds it (else Conflict), or ``<hostname>:<slot>`` with the lowest free slot."""
    if explicit:
        if not 0 < len(explicit) <= 200:
            raise InvalidInput("the worker id must be 1..200 characters")
        if not lease.try_acquire(explicit):
            raise Conflict(f"worker id {explicit!r} is held by another live worker process", worker_id=explicit)
        return explicit
    host = (hostname or socket.gethostname())[:180]
    for slot in range(MAX_SLOTS):
        if lease.try_acquire(f"{host}:{slot}"):
            return f"{host}:{slot}"
    raise Conflict(f"all {MAX_SLOTS} worker slots of host {host!r} are in use")


def release_own_claims(catalog: Catalog, worker_id: str) -> int:
    """Hand back what this worker still holds (a batch that outlived the stop timeout)."""
    from rubricsearch.indexer.catalog import ItemState, JobState, list_items, list_jobs, release_items

    released = 0
    with catalog.write() as s:
        for job in list_jobs(s, states=(JobState.QUEUED, JobState.RUNNING), limit=100_000):
            mine = [i.id for i in list_items(s, job.id, states=[ItemState.CLAIMED], limit=1_000_000)
                    if i.claimed_by == worker_id]
            released += release_items(s, worker_id, mine)
    return released


# -- running -----------------------------------------------------------------------------------------------
class WorkerProcess:
    """A runner plus the loop and the shutdown the CLI needs; separate from argparse so tests can drive it."""

    def __init__(self, runner: IngestionRunner, *, stop_timeout_s: float, out: TextIO = sys.stdout) -> None:
        self.runner = runner
        self.stop_timeout_s = stop_timeout_s
        self.out = out
        self.stopping = threading.Event()
        self.errors: list[BaseException] = []

    def say(self, line: str) -> None:
        """One status line on stdout (READY, IDLE, STOPPED...), for operators and the tests."""
        print(line, file=self.out, flush=True)

    def request_stop(self, signum: int | None = None, _frame: FrameType | None = None) -> None:
        if signum is not None and not self.stopping.is_set():
            log.info("signal %s: finishing the batches in flight, then stopping", signum)
        self.stopping.set()

    def install_signals(self) -> Callable[[], None]:
        """SIGTERM and SIGINT stop gracefully; returns a function that restores the old handlers."""
        old = {sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, handler in old.items():
                signal.signal(sig, handler)

        return restore

    def run_forever(self) -> bool:
        """Background threads until a stop request; True if they all finished in time."""
        self.runner.start()
        while not self.stopping.wait(0.5):
            pass
        self.runner.stop(timeout_s=self.stop_timeout_s)
        return not self.runner.running

    def run_once(self, threads: int) -> bool:
        """Each thread claims batches until nothing is claimable (or stop); True if they all finished."""
        workers = [threading.Thread(target=self._drain, name=f"ingest-once-{n}", daemon=True)
                   for n in range(max(1, threads))]
        for t in workers:
            t.start()
        while any(t.is_alive() for t in workers) and not self.stopping.wait(0.2):
            pass
        deadline = time.monotonic() + self.stop_timeout_s
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in workers)

    def _drain(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.runner.run_once() is None:
                    return
        except BaseException as exc:  # run_once released the batch; stop the others too
            log.exception("ingestion batch failed")
            self.errors.append(exc)
            self.stopping.set()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "faiss.loader", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from rubricsearch.app.services import WORKER_POLL_INTERVAL_S
    from rubricsearch.app.settings import Settings, worker_batch_size

    settings = Settings()
    threads = args.threads if args.threads is not None else max(1, settings.ingest.workers)
    if threads < 1 or (args.batch_size is not None and args.batch_size < 1):
        raise InvalidInput("--threads and --batch-size must be at least 1")
    return serve_worker(settings, threads=threads, worker_id=args.worker_id,
                        once=args.once, batch_size=args.batch_size or worker_batch_size(settings),
                        poll_interval_s=args.poll_interval or WORKER_POLL_INTERVAL_S,
                        reconcile=not args.no_reconcile)


def serve_worker(settings: Settings, *, threads: int, worker_id: str | None, once: bool, batch_size: int,
                 poll_interval_s: float, reconcile: bool, out: TextIO = sys.stdout) -> int:
    """Open the stores and the embedder, lease an id, recover, process; 0 on a clean stop."""
    from rubricsearch.app.services import (
        INGEST_BATCH_PIXELS,
        URL_FETCH_AHEAD_BYTES,
        URL_FETCH_THREADS,
        WORKER_STOP_TIMEOUT_S,
    )
    from rubricsearch.app.state import open_state
    from rubricsearch.indexer.jobs import IngestionRunner

    state = open_state(settings, ingest=True)
    lease = WorkerLease(state.catalog, settings.data_dir / "workers")
    try:
        service = state.ingestion
        if service.embedder is None:
            raise BackendUnavailable(
                "this worker's embedder cannot ingest: ingestion computes visual packages with a local vision "
                f"tower, and the {settings.backend('embedding')!r} embedder here has none"
            )
        wid = acquire_worker_id(lease, worker_id)
        runner = IngestionRunner(service, worker_id=wid, threads=threads, batch_size=batch_size,
                                 batch_pixels=INGEST_BATCH_PIXELS, poll_interval_s=poll_interval_s,
                                 fetch_threads=URL_FETCH_THREADS,
                                 fetch_ahead_bytes=URL_FETCH_AHEAD_BYTES)
        proc = WorkerProcess(runner, stop_timeout_s=WORKER_STOP_TIMEOUT_S, out=out)
        restore = proc.install_signals()
        try:
            report = runner.recover(reconcile=reconcile, orphan_blobs=reconcile)
            proc.say(f"READY worker_id={wid} threads={threads} released={report.released} "
                     f"abandoned={report.abandoned} reconciled={len(report.reconciled)}")
            finished = proc.run_once(threads) if once else proc.run_forever()
            if not finished:  # a batch outlived the timeout: nobody will complete its claims now
                released = release_own_claims(state.catalog, wid)
                log.error("batches still running after %.0f s; released %d claims", proc.stop_timeout_s, released)
        finally:
            restore()
        service.index.flush()
        proc.say(f"{'IDLE' if once and not proc.stopping.is_set() else 'STOPPED'} worker_id={wid} "
                 f"items={runner.processor.times.items}")
        if not finished:
            state.close()
            lease.close()
            os._exit(1)  # stuck threads (and the pool's non-daemon threads) must not keep the process up
        runner.processor.close()
        return 1 if proc.errors else 0
    finally:
        state.close()
        lease.close()
