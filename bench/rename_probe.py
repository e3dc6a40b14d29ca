"""An experiment for ``ingest_throughput.py --unlocked-rename`` (not the product's behaviour): the package writers
rename a finished file into place *outside* the package store's lock, then account for it under the lock.

idle85's timeline showed the towers' thread inside its vision stage until a sync or a catalog commit ended: the
stage looks up every new image in the package store (its lock, three times an image), and a writer holds that lock
while it renames a file into place, which on a journalling filesystem can wait for the journal commit that a
concurrent ``syncfs`` forces. Measured (``bench/gpu_run.sh rename86``, README): no gain, so the lock is not what
the GPU waits for and the product keeps the rename under it (where a deleted image's late rename cannot race). The
bench never deletes images, so that race cannot occur here.
"""

from __future__ import annotations

import os
from typing import Any


def unlocked_rename() -> None:
    import retrieval.packages.writer as writer

    def write(self: Any, job: Any, host: dict[str, Any] | None) -> None:
        tmp = None
        try:
            if host is None and not job.cancelled:
                raise RuntimeError("its copy to the host failed")
            if host is not None and not job.cancelled:
                tmp = self._write_tmp(job.path, host, job.meta)
            if tmp is not None:
                os.replace(tmp, job.path)  # no lock held
                tmp = None
                size = job.path.stat().st_size
                with self._lock:
                    _account(self, job.path, size)
        except Exception:
            writer.log.exception("writing package %s failed", job.path.name)
            with self._lock:
                self.errors += 1
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            with self._changed:
                if self._pending.get(job.key) is job:
                    del self._pending[job.key]
                self._inflight_bytes -= job.stored.nbytes
                self._left[job.ticket] -= 1
                if not self._left[job.ticket]:
                    del self._left[job.ticket]
                self._changed.notify_all()

    writer.WriteBehind._write = write  # type: ignore[method-assign]


def _account(behind: Any, path: Any, size: int) -> None:
    """The store's ``_publish`` after its rename and stat: the file's size into the disk tier's accounting."""
    store = behind._publish.__self__
    if path in store._disk:
        store._disk_used -= store._disk.pop(path)
    store._disk[path] = size
    store._disk_used += size
    store._evict_disk()
