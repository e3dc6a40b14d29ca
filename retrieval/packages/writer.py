"""Write-behind for the package store: files are written by background threads after ``put`` returns.

The store keeps serving a queued package from here until its file is published, so a reader never
misses a package that is only waiting for the disk. Publishing (the rename and the disk accounting)
runs under the store's lock, and a package deleted meanwhile is dropped instead of published.

A tower batch is queued as one group with its joint form (``storage_form.Joint``): its writer copies the
batch to the host with one copy per kind of tensor and cuts it there, instead of four copies, allocations and
waits per package (each torch call waits for the GIL, so the files, and the batch's sync behind them, would
come last in the pipeline).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class StoredLike(Protocol):
    """A package in storage form (``retrieval.packages.storage_form.Stored``)."""

    nbytes: int
    embeds: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]: ...


class JointLike(Protocol):
    """A batch in storage form as one tensor per kind (``retrieval.packages.storage_form.Joint``)."""

    tensors: dict[str, torch.Tensor]

    def split(self, tensors: dict[str, torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]: ...


WriteTmp = Callable[[Path, dict[str, torch.Tensor], dict[str, str]], Path]
Publish = Callable[[Path, Path], None]


class _Job:
    __slots__ = ("cancelled", "key", "meta", "path", "stored", "ticket")

    def __init__(self, key: str, path: Path, stored: StoredLike, meta: dict[str, str]) -> None:
        self.key, self.path, self.stored, self.meta = key, path, stored, meta
        self.cancelled = False
        self.ticket = -1  # given under the lock once the job is queued


class _Group:
    """Jobs queued together: one package, or a tower batch with its joint form (written from one host copy; on
    the CPU the same path, so CI runs it). ``hosts``: the jobs' host copies once made, when the writer that
    made them hands part of the files on to the other writers."""

    __slots__ = ("hosts", "jobs", "joint", "joint_bytes", "ready")

    def __init__(self, jobs: list[_Job], joint: JointLike | None, ready: Any,
                 hosts: list[dict[str, torch.Tensor] | None] | None = None) -> None:
        self.jobs, self.joint, self.ready, self.hosts = jobs, joint, ready, hosts
        # the joint form is a second copy of the batch until its host copy is made
        self.joint_bytes = 0 if joint is None else sum(t.numel() * t.element_size() for t in joint.tensors.values())


class WriteBehind:
    """Background writers for one store; every method except the writers' own loop needs ``lock`` held
    (``flush`` and ``close`` take it themselves)."""

    def __init__(self, lock: threading.RLock, *, threads: int, max_pending_bytes: int, write_tmp: WriteTmp,
                 publish: Publish) -> None:
        self._lock = lock
        self._changed = threading.Condition(lock)
        self.threads = max(1, threads)
        self.max_pending_bytes = max_pending_bytes
        self._write_tmp, self._publish = write_tmp, publish
        self._pending: dict[str, _Job] = {}
        self._inflight_bytes = 0
        self._tickets = 0  # one per submit_many, in order; flush waits for the tickets given before it
        self._left: dict[int, int] = {}  # writes not finished (cancelled ones included), by ticket
        self.errors = 0
        # (0, ticket, n, group): files handed on by a writer, ahead of (1, ticket, n, group): batches not copied
        # yet, each kind oldest batch first; then (2, 0, n, None): a writer's stop
        self._queue: queue.PriorityQueue[tuple[int, int, int, _Group | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._writers: list[threading.Thread] = []
        self._closing = 0  # closes stopping writers: no new writer starts meanwhile (it could take their stops)
        self._at_exit = False

    def submit_many(self, writes: list[tuple[str, Path, StoredLike, dict[str, str]]],
                    joint: JointLike | None = None) -> None:
        """Queue writes as one group (``joint``: the same packages as one tensor per kind, in order); waits
        while ``max_pending_bytes`` are queued already (back-pressure)."""
        group = _Group([_Job(key, path, stored, meta) for key, path, stored, meta in writes], joint, None)
        nbytes = sum(stored.nbytes for _, _, stored, _ in writes) + group.joint_bytes
        while self._left and self._inflight_bytes + nbytes > self.max_pending_bytes:
            self._changed.wait()
        if writes and writes[0][2].embeds.is_cuda:  # the writer copies on its own stream, once the tensors are made
            group.ready = torch.cuda.Event()
            group.ready.record()
        jobs, ticket = group.jobs, self._tickets  # (after the wait: another submit may have come meanwhile)
        self._tickets += 1
        for job in jobs:
            old = self._pending.pop(job.key, None)
            # a job replacing a queued one inherits its ticket: a flush that waits for the old file waits for
            # the file that now stands for it (the old one is dropped, not written)
            job.ticket = ticket if old is None else old.ticket
            if old is not None:
                old.cancelled = True
            self._left[job.ticket] = self._left.get(job.ticket, 0) + 1
            self._pending[job.key] = job
        self._inflight_bytes += nbytes
        if len(self._writers) < self.threads and not self._closing:
            self._start()
        self._queue.put((1, ticket, next(self._order), group))

    @property
    def inflight(self) -> int:
        """Queued writes not finished yet (cancelled ones included)."""
        return sum(self._left.values())

    def get(self, key: str) -> StoredLike | None:
        job = self._pending.get(key)
        return None if job is None else job.stored

    def __contains__(self, key: str) -> bool:
        return key in self._pending

    def cancel(self, match: Callable[[str], bool]) -> None:
        """Drop queued writes whose key matches (a deleted image must not come back from the queue)."""
        for key in [k for k in self._pending if match(k)]:
            self._pending.pop(key).cancelled = True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every file queued before this call is published (or dropped), not for those queued
        meanwhile (ingestion's next batches keep coming while one batch syncs); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            mark = self._tickets
            while self._left and min(self._left) < mark:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def close(self) -> None:
        """Flush, then stop the writer threads (a later submit starts them again).

        A submit while the writers stop starts none (a new writer could take a stop meant for an old one, whose
        join would then never return); what it queued is written by new writers started here once they are gone."""
        self.flush()
        with self._lock:
            writers, self._writers = self._writers, []
            self._closing += 1
        try:
            for _ in writers:
                self._queue.put((2, 0, next(self._order), None))
            for thread in writers:
                thread.join()
        finally:
            with self._lock:
                self._closing -= 1
                alive = [t for t in writers if t.is_alive()]  # only if interrupted (their stops are queued)
                self._writers = alive + self._writers
                if self._left and not self._closing and not self._writers:
                    self._start()

    def _start(self) -> None:
        if not self._at_exit:
            self._at_exit = True
            atexit.register(_flush_at_exit, weakref.ref(self))
        while len(self._writers) < self.threads:
            thread = threading.Thread(target=self._run, name=f"package-writer-{len(self._writers)}", daemon=True)
            thread.start()
            self._writers.append(thread)

    def _run(self) -> None:
        stream = None
        while (group := self._queue.get()[3]) is not None:
            if group.ready is not None:
                stream = stream or torch.cuda.Stream(device=group.jobs[0].stored.embeds.device)
            self._write_group(group, stream)
            del group  # an idle writer holds no batch

    def _write_group(self, group: _Group, stream: Any) -> None:
        """Copy a group to the host (once), then write its files, handing all but a share of them on to the other
        writers: behind one thread a batch's files wait in line, each file op for the GIL, and the batch's sync
        waits for the last of them."""
        hosts = group.hosts if group.hosts is not None else self._host_copies(group, stream)
        jobs, share = group.jobs, len(group.jobs)
        if group.hosts is None and self.threads > 1 and len(jobs) > 1:
            share = -(-len(jobs) // self.threads)
            for start in range(share, len(jobs), share):
                part = jobs[start:start + share]
                self._queue.put((0, min(job.ticket for job in part), next(self._order),
                                 _Group(part, None, None, hosts[start:start + share])))
        for job, host in zip(jobs[:share], hosts[:share], strict=True):
            self._write(job, host)

    def _host_copies(self, group: _Group, stream: Any) -> list[dict[str, torch.Tensor] | None]:
        """The jobs' tensors on the host, from the joint form if there is one (a copy per kind), else (or if
        that copy fails) package by package; ``None`` where a copy failed (its job counts an error)."""
        try:
            if group.joint is not None and any(not job.cancelled for job in group.jobs):
                tensors = group.joint.tensors
                return list(group.joint.split(tensors if group.ready is None else _to_host(tensors, group.ready,
                                                                                            stream)))
        except Exception:
            log.exception("copying a batch of %d packages to the host failed; copying them one by one",
                          len(group.jobs))
        finally:
            if group.joint is not None:  # its device memory is no longer needed (nor counted) either way
                group.joint = None
                with self._changed:
                    self._inflight_bytes -= group.joint_bytes
                    self._changed.notify_all()
        out: list[dict[str, torch.Tensor] | None] = []
        for job in group.jobs:
            try:
                out.append(self._host_copy(job, group.ready, stream))
            except Exception:
                log.exception("copying package %s to the host failed", job.path.name)
                out.append(None)
        return out

    @staticmethod
    def _host_copy(job: _Job, ready: Any, stream: Any) -> dict[str, torch.Tensor] | None:
        if job.cancelled:
            return None
        if ready is not None:
            return _to_host(job.stored.tensors(), ready, stream)
        return {k: v.to("cpu") for k, v in job.stored.tensors().items()}

    def _write(self, job: _Job, host: dict[str, torch.Tensor] | None) -> None:
        """Write and publish one file (nothing for a cancelled job; an error for a failed copy); the job is done
        after."""
        tmp: Path | None = None
        try:
            if host is None and not job.cancelled:
                raise RuntimeError("its copy to the host failed")
            if host is not None and not job.cancelled:
                tmp = self._write_tmp(job.path, host, job.meta)
            with self._lock:
                if tmp is not None and not job.cancelled:
                    self._publish(tmp, job.path)
                    tmp = None
        except Exception:  # a cache write: the package stays in memory and is recomputed if lost
            log.exception("writing package %s failed", job.path.name)
            with self._lock:
                self.errors += 1
        finally:
            try:
                if tmp is not None:
                    tmp.unlink(missing_ok=True)
            except OSError:  # the job still ends below, or every later flush would wait for it
                log.exception("removing %s failed", tmp)
            with self._changed:
                if self._pending.get(job.key) is job:
                    del self._pending[job.key]
                self._inflight_bytes -= job.stored.nbytes
                self._left[job.ticket] -= 1
                if not self._left[job.ticket]:
                    del self._left[job.ticket]
                self._changed.notify_all()


def _to_host(tensors: dict[str, torch.Tensor], ready: Any, stream: Any) -> dict[str, torch.Tensor]:
    """Device tensors copied to (cached) pinned host memory on the writer's stream, once ``ready``.

    Not ``.to("cpu")``: a copy into pageable memory is staged by the driver while it holds the context, so
    the model's threads could not launch or record anything meanwhile (photo batches are the largest copies);
    a pinned copy is a DMA the host just waits for."""
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in tensors.items()}
        for k, v in tensors.items():
            host[k].copy_(v, non_blocking=True)
    stream.synchronize()
    return host


def _flush_at_exit(ref: weakref.ref[WriteBehind]) -> None:
    """Publish what is still queued when the interpreter exits normally (the writers are daemon threads)."""
    writer = ref()
    if writer is not None:
        writer.flush(timeout=60.0)
