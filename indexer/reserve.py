"""A few megabytes of the data directory's disk held back, so deletes still work when the disk is full.

Deleting an image or a set frees space, but first writes to the catalog (SQLite appends to its write-ahead log),
which on a disk with no byte left fails like any write. The reserve is a file of zeros made when the service
starts (and again once space is back); a delete that meets a full disk releases it and tries again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rubricsearch.retrieval.errors import disk_full

log = logging.getLogger(__name__)
T = TypeVar("T")
RESERVE_BYTES = 2 << 20


class SpaceReserve:
    def __init__(self, path: Path, size: int = RESERVE_BYTES) -> None:
        self.path, self.size = path, size
        self._lock = threading.Lock()

    def ensure(self) -> bool:
        """Make the reserve if it is missing; False where the disk has no room for it (yet)."""
        with self._lock:
            if self.path.exists() and self.path.stat().st_size == self.size:
                return True
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "wb") as f:
                    f.write(b"\0" * self.size)
                    f.flush()
                    os.fsync(f.fileno())
                return True
            except OSError as exc:
                self.path.unlink(missing_ok=True)
                log.warning("cannot hold %d bytes of disk in reserve at %s: %s", self.size, self.path, exc)
                return False

    def release(self) -> bool:
        """Free the reserve; False if there was none to free."""
        with self._lock:
            if not self.path.exists():
                return False
            self.path.unlink()
            log.warning("the disk is full: released %d reserved bytes so a delete can go on", self.size)
            return True

    def freeing(self, delete: Callable[[], T]) -> T:
        """Run ``delete``; if the disk is full, release the reserve and run it once more."""
        try:
            return delete()
        except Exception as exc:
            if not disk_full(exc) or not self.release():
                raise
        return delete()
