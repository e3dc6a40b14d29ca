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
from pathlib import Path
from typing import Any


def unlocked_rename(store: Any) -> None:
    """``store``'s writers rename each finished file into place as soon as it is written, with no lock held; the
    store's publish, under the lock, then renames the file onto itself (nothing to do) and accounts for it. (The
    run of 2026-11-26 used a copy of the writer's ``_write`` doing the same; this form reuses the writer's own.)"""
    write_tmp = store._behind._write_tmp

    def write_and_rename(path: Path, tensors: dict[str, Any], meta: dict[str, str]) -> Path:
        os.replace(write_tmp(path, tensors, meta), path)
        return path

    store._behind._write_tmp = write_and_rename
