"""The bounded tier for query images' packages: search candidates and images sent to the API.

Anyone who may search can send new images, so their packages must neither reach the disk (open search
could fill it) nor compete with reference packages for the store's memory (it could evict them, and a
search would then encode a reference). They live here instead: in memory, least recently used first out,
under their own byte budget. A candidate sent again soon (the same person refining a rubric) is found here
and not encoded again; one sent later is simply encoded again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from rubricsearch.retrieval.packages.package import Fingerprint, VisualPackage, owned


class EphemeralPackages:
    """A thread-safe LRU of :class:`VisualPackage` by (fingerprint, sha256) under ``max_bytes``."""

    def __init__(self, max_bytes: int = 512 << 20, device: str | torch.device = "cpu") -> None:
        self.max_bytes = max_bytes
        self.device = torch.device(device)
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[str, str], VisualPackage] = OrderedDict()
        self._bytes = 0
        self.counters = {"hits": 0, "misses": 0, "puts": 0, "evictions": 0}

    def get(self, sha256: str, fingerprint: Fingerprint) -> VisualPackage | None:
        key = (fingerprint.digest(), sha256)
        with self._lock:
            pkg = self._items.get(key)
            if pkg is None:
                self.counters["misses"] += 1
                return None
            self._items.move_to_end(key)
            self.counters["hits"] += 1
            return pkg

    def put(self, package: VisualPackage) -> VisualPackage:
        """Keep a package (on this tier's device); returns it as later gets will return it."""
        package.validate()
        kept = VisualPackage(package.image_sha256, package.fingerprint, package.grid_thw,
                             owned(package.embeds.detach().to(self.device)),
                             owned(package.deepstack.detach().to(self.device)))
        if kept.nbytes > self.max_bytes:
            return kept  # used once, kept never: larger than the whole tier
        key = (kept.fingerprint.digest(), kept.image_sha256)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[key] = kept
            self._bytes += kept.nbytes
            self.counters["puts"] += 1
            while self._bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.counters["evictions"] += 1
        return kept

    def pop(self, sha256: str, fingerprint: Fingerprint) -> VisualPackage | None:
        """Take a package out (a query image that is being ingested as a reference moves to the store)."""
        with self._lock:
            pkg = self._items.pop((fingerprint.digest(), sha256), None)
            if pkg is not None:
                self._bytes -= pkg.nbytes
            return pkg

    def delete_image(self, sha256: str) -> None:
        with self._lock:
            for key in [k for k in self._items if k[1] == sha256]:
                self._bytes -= self._items.pop(key).nbytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "bytes": self._bytes, "packages": len(self._items)}
