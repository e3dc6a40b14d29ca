"""The feature store: visual packages on disk (one safetensors file each) behind an in-memory LRU.

Both tiers have byte budgets and evict least recently used packages; an evicted package is simply
recomputed on a later miss. A file that fails to load, or whose fingerprint or shapes disagree with
what was asked for, is deleted and treated as a miss, so a corrupt package is never used. Writes go
to a temporary file that is renamed into place, so a crash never leaves a half-written package.

With ``write_behind=True`` a put is served from memory at once and its file is written by background
threads (``flush()`` waits for them). The store is a cache: a package whose write a crash cut short is
simply recomputed on its next miss, and a ``.tmp`` file it left is removed at the next start.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from errno import ENOSYS
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file

from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.packages.files import FORMAT_VERSION, package_file, read_package_file
from rubricsearch.retrieval.packages.package import Fingerprint, VisualPackage
from rubricsearch.retrieval.packages.storage_form import (
    Fp8Scales,
    Joint,
    StorageDtype,
    Stored,
    pack,
    pack_many,
    unpack,
    unpack_many,
)
from rubricsearch.retrieval.packages.writer import WriteBehind


def _hex(sha: str) -> str:
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise InvalidInput(f"not a sha256 hex digest: {sha!r}")
    return sha


class PackageStore:
    """Disk + memory store of :class:`VisualPackage` objects keyed by (image sha256, fingerprint).

    ``root=None`` keeps packages in memory only (tests, throwaway runs). ``write_behind`` moves the disk
    writes to ``writer_threads`` background threads; at most ``max_pending_bytes`` wait (then a put waits).
    """

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        memory_bytes: int = 2 << 30,
        disk_bytes: int = 100 << 30,
        storage_dtype: StorageDtype = "bfloat16",
        fp8_scales: Fp8Scales = "token",
        memory_device: str | torch.device = "auto",
        write_behind: bool = False,
        writer_threads: int = 2,
        max_pending_bytes: int = 1 << 30,
    ) -> None:
        if storage_dtype not in ("float32", "bfloat16", "float8_e4m3fn"):
            raise InvalidInput(f"unknown package storage dtype {storage_dtype!r}")
        self.root = Path(root) if root is not None else None
        self.memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes
        self.storage_dtype: StorageDtype = storage_dtype
        self.fp8_scales: Fp8Scales = fp8_scales
        # On a GPU box the memory tier lives in GPU memory: a hit costs no host-to-device copy.
        if memory_device == "auto":
            memory_device = "cuda" if torch.cuda.is_available() else "cpu"
        self.memory_device = torch.device(memory_device)
        self._lock = threading.RLock()
        self._memory: OrderedDict[str, Stored] = OrderedDict()
        self._memory_used = 0
        self._disk: OrderedDict[Path, int] = OrderedDict()
        self._disk_used = 0
        self.counters = {"hits": 0, "misses": 0, "memory_hits": 0, "disk_hits": 0, "writes": 0,
                         "evictions_memory": 0, "evictions_disk": 0, "corrupt": 0}
        self._behind = WriteBehind(self._lock, threads=writer_threads, max_pending_bytes=max_pending_bytes,
                                   write_tmp=self._write_tmp, publish=self._publish)
        self.write_behind = write_behind and self.root is not None
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._scan_disk()

    # -- keys and paths -------------------------------------------------------------------------
    def _key(self, sha: str, fp: Fingerprint) -> str:
        return f"{fp.digest()}/{_hex(sha)}/{self.storage_dtype}"

    def _path(self, sha: str, fp: Fingerprint) -> Path:
        assert self.root is not None
        return package_file(self.root, sha, fp.digest(), self.storage_dtype)

    def published(self, sha: str, fp: Fingerprint) -> Path | None:
        """The package's file if it is on disk now (readers sharing the directory, e.g. vLLM, may open it)."""
        path = None if self.root is None else self._path(sha, fp)
        return path if path is not None and path.is_file() else None

    def _scan_disk(self) -> None:
        assert self.root is not None
        entries: list[tuple[float, Path, int]] = []
        for path in self.root.rglob("*"):
            if not path.is_file():
                continue
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # left behind by a crash mid-write
                continue
            if path.suffix == ".safetensors":
                st = path.stat()
                entries.append((st.st_mtime, path, st.st_size))
        for _, path, size in sorted(entries, key=lambda e: e[0]):
            self._disk[path] = size
            self._disk_used += size
        self._evict_disk()

    # -- public API -----------------------------------------------------------------------------
    def get(self, sha: str, fp: Fingerprint) -> VisualPackage | None:
        """The package, or ``None`` on a miss (never a package made under another fingerprint).

        The lock covers only the bookkeeping: file reads, checks and dequantisation run outside it, so
        concurrent searches do not queue behind one another's reads."""
        stored = self._lookup(sha, fp)
        return None if stored is None else unpack(stored, fp)

    def stored_bytes(self, sha: str, fp: Fingerprint) -> int | None:
        """The package's size in storage form (what its catalog record holds), or ``None`` on a miss; a hit is
        counted like :meth:`get`'s but not dequantised."""
        stored = self._lookup(sha, fp)
        return None if stored is None else stored.nbytes

    def get_many(self, shas: Iterable[str], fp: Fingerprint) -> dict[str, VisualPackage]:
        """The packages found of these images (misses left out), dequantised together (``unpack_many``)."""
        found: dict[str, Stored] = {}
        for sha in dict.fromkeys(shas):
            stored = self._lookup(sha, fp)
            if stored is not None:
                found[sha] = stored
        return dict(zip(found, unpack_many(list(found.values()), fp), strict=True))

    def _lookup(self, sha: str, fp: Fingerprint) -> Stored | None:
        key = self._key(sha, fp)
        with self._lock:
            stored = self._memory.get(key)
            if stored is not None:
                self._memory.move_to_end(key)
            else:
                stored = cast("Stored | None", self._behind.get(key))  # queued for the disk, not there yet
                if stored is not None:
                    self._remember(key, stored)
            if stored is not None:
                self.counters["hits"] += 1
                self.counters["memory_hits"] += 1
        if stored is None and self.root is not None:
            stored = self._read_disk(sha, fp)
            with self._lock:
                if stored is not None:
                    self.counters["hits"] += 1
                    self.counters["disk_hits"] += 1
                    self._remember(key, stored)
        if stored is None:
            with self._lock:
                self.counters["misses"] += 1
        return stored

    def contains(self, sha: str, fp: Fingerprint) -> bool:
        key = self._key(sha, fp)
        with self._lock:
            return key in self._memory or key in self._behind or (
                self.root is not None and self._path(sha, fp) in self._disk)

    def put(self, package: VisualPackage) -> VisualPackage:
        """Store a package; returns it as a later ``get`` will (storage dtype applied), so the first
        use of a package computes with exactly the values every later use sees."""
        package.validate()
        stored = pack(package, self.storage_dtype, self.fp8_scales, self.memory_device)
        self._keep([package], [stored])
        return unpack(stored, package.fingerprint)

    def put_many(self, packages: list[VisualPackage]) -> list[int]:
        """Store a tower batch's packages, quantised together (one pass over all their tokens instead of a
        few small kernels per image); returns each one's stored bytes. For ingestion, which needs no
        package back."""
        for package in packages:
            package.validate()
        stored, joint = pack_many(packages, self.storage_dtype, self.fp8_scales, self.memory_device)
        self._keep(packages, stored, joint)
        return [one.nbytes for one in stored]

    def _keep(self, packages: list[VisualPackage], stored: list[Stored], joint: Joint | None = None) -> None:
        """Into the memory tier, and to disk (queued as one group for the writers: ``joint`` lets them copy the
        batch to the host in one copy per kind)."""
        keys = [self._key(p.image_sha256, p.fingerprint) for p in packages]
        with self._lock:
            if self.write_behind:
                self._behind.submit_many([(key, self._path(p.image_sha256, p.fingerprint), one, self._meta(p))
                                          for key, p, one in zip(keys, packages, stored, strict=True)], joint)
            elif self.root is not None:
                for package, one in zip(packages, stored, strict=True):
                    self._write_disk(package, one)
            for key, one in zip(keys, stored, strict=True):
                self._remember(key, one)
            self.counters["writes"] += len(stored)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write-behind file queued before this call is published (a no-op without
        write-behind); False on timeout."""
        return self._behind.flush(timeout)

    def sync(self, *also: Path) -> None:
        """Publish every file queued before this call and make all published ones durable with one filesystem
        sync, which also covers the directories ``also`` (the blob store's, usually on the same filesystem).

        Files are written without an fsync each (that cost ~one disk round trip per package); ingestion
        calls this once per batch, before the catalog commit that records the batch's packages, so the
        catalog never names a package that is not complete on disk.
        """
        self._behind.flush()
        roots = (self.root, *also) if self.root is not None else also
        if roots:
            syncfs(*roots)

    def close(self) -> None:
        """Flush and stop the background writers."""
        self._behind.close()

    def delete_image(self, sha: str) -> int:
        """Remove every package of an image (all fingerprints and dtypes); returns files removed."""
        _hex(sha)
        removed = 0
        with self._lock:
            for key in [k for k in self._memory if k.split("/")[1] == sha]:
                self._memory_used -= self._memory.pop(key).nbytes
            self._behind.cancel(lambda key: key.split("/")[1] == sha)
            for path in [p for p in self._disk if p.name.startswith(sha + ".")]:
                self._drop_file(path)
                removed += 1
        return removed

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "memory_bytes": self._memory_used, "disk_bytes": self._disk_used,
                    "memory_packages": len(self._memory), "disk_packages": len(self._disk),
                    "pending_writes": self._behind.inflight, "write_errors": self._behind.errors}

    # -- memory tier ----------------------------------------------------------------------------
    def _remember(self, key: str, stored: Stored) -> None:
        if stored.nbytes > self.memory_bytes:
            return
        old = self._memory.pop(key, None)
        if old is not None:
            self._memory_used -= old.nbytes
        self._memory[key] = stored
        self._memory_used += stored.nbytes
        while self._memory_used > self.memory_bytes and self._memory:
            _, evicted = self._memory.popitem(last=False)
            self._memory_used -= evicted.nbytes
            self.counters["evictions_memory"] += 1

    # -- disk tier ------------------------------------------------------------------------------
    def _meta(self, package: VisualPackage) -> dict[str, str]:
        return {
            "format": FORMAT_VERSION,
            "image_sha256": package.image_sha256,
            "fingerprint": package.fingerprint.to_json(),
            "grid_thw": json.dumps(list(package.grid_thw)),
            "storage_dtype": self.storage_dtype,
        }

    def _write_disk(self, package: VisualPackage, stored: Stored) -> None:
        path = self._path(package.image_sha256, package.fingerprint)
        tmp = self._write_tmp(path, {k: v.to("cpu") for k, v in stored.tensors().items()}, self._meta(package))
        try:
            self._publish(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _write_tmp(self, path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
        """Serialise into a temp file beside ``path`` (needs no lock); durability comes from :meth:`sync`
        (write-behind) or an fsync here (a direct put)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            save_file(tensors, str(tmp), metadata=meta)
            if not self.write_behind:
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _publish(self, tmp: Path, path: Path) -> None:
        """Rename into place and account for the file (lock held)."""
        os.replace(tmp, path)
        size = path.stat().st_size
        if path in self._disk:
            self._disk_used -= self._disk.pop(path)
        self._disk[path] = size
        self._disk_used += size
        self._evict_disk()

    def _read_disk(self, sha: str, fp: Fingerprint) -> Stored | None:
        """Read and check a package file on the CPU (no GPU sync), then upload it without blocking."""
        path = self._path(sha, fp)
        with self._lock:
            known = path in self._disk
        if not known and not path.exists():
            return None
        try:
            stored, package = read_package_file(path, sha, self.storage_dtype)
            if package.fingerprint != fp:
                raise ValueError("the file holds another fingerprint's package")
            size = path.stat().st_size
        except Exception:  # any unreadable or inconsistent file is discarded and recomputed
            with self._lock:
                self.counters["corrupt"] += 1
                self._drop_file(path)
            return None
        if self.memory_device.type == "cuda":  # pinned + non_blocking: a pageable copy waits for the GPU queue
            stored = Stored(sha, stored.grid, {k: v.pin_memory().to(self.memory_device, non_blocking=True)
                                                for k, v in stored.tensors().items()})
        with self._lock:
            if path in self._disk:
                self._disk.move_to_end(path)
            else:
                self._disk[path] = size
                self._disk_used += size
        with contextlib.suppress(OSError):
            now = time.time()
            os.utime(path, (now, now))  # keeps LRU order across restarts
        return stored

    def _drop_file(self, path: Path) -> None:
        size = self._disk.pop(path, None)
        if size is not None:
            self._disk_used -= size
        path.unlink(missing_ok=True)

    def _evict_disk(self) -> None:
        while self._disk_used > self.disk_bytes and self._disk:
            path = next(iter(self._disk))
            self._drop_file(path)
            self.counters["evictions_disk"] += 1


@functools.cache
def _libc() -> Any:
    """The C library, looked up once: ``find_library`` runs ``ldconfig`` (a subprocess), and ingestion syncs
    every batch."""
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def syncfs(*roots: Path) -> None:
    """Flush the filesystems holding ``roots``, each once (Linux ``syncfs``; elsewhere the whole-system ``sync``):
    blobs and packages usually share one, and a second sync of it still costs a round trip to the kernel. A
    write-back error it reports (EIO, ENOSPC) raises, so the batch fails before its catalog commit."""
    import ctypes

    libc = _libc()
    if getattr(libc, "syncfs", None) is None:
        os.sync()  # no syncfs here: the whole system, every root at once (reports nothing)
        return
    done: set[int] = set()
    for root in roots:
        fd = os.open(root, os.O_RDONLY)
        try:
            device = os.fstat(fd).st_dev
            if device in done:
                continue
            done.add(device)
            if libc.syncfs(fd) != 0:
                errno = ctypes.get_errno()
                if errno != ENOSYS:
                    raise OSError(errno, f"syncfs of {root} failed: {os.strerror(errno)}")
                os.sync()  # a kernel without it: the whole system covers the other roots too
                return
        finally:
            os.close(fd)
