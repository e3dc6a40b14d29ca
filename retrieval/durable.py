"""Durability of renames: after ``os.replace`` into a directory, the directory's entry must reach the disk too."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s directory entries (the renames into it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
