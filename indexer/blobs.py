"""Content-addressed blob store: original image bytes, keyed by their sha256.

Files live at ``root/ab/cd/<sha256>``. Writes go to a temp file in the same file system, are fsynced and
then renamed into place, so a crash never leaves a truncated blob under a valid name, and two writers of
the same content simply both succeed (the name is the content).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from rubricsearch.retrieval.durable import fsync_dir
from rubricsearch.retrieval.errors import InvalidInput, NotFound

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_TMP_DIR = "tmp"
_CHUNK = 1 << 20


def validate_sha256(sha: str) -> str:
    """Return ``sha`` if it is 64 lowercase hex digits, else raise (this also rules out path traversal)."""
    if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha):
        raise InvalidInput("not a sha256 hex digest", sha256=str(sha)[:80])
    return sha


class BlobStore:
    """Immutable files addressed by sha256 under one root directory."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / _TMP_DIR).mkdir(exist_ok=True)

    def path(self, sha: str) -> Path:
        validate_sha256(sha)
        return self.root / sha[:2] / sha[2:4] / sha

    def exists(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def put(self, data: bytes, *, durable: bool = True) -> str:
        """Store ``data`` and return its sha256; storing the same bytes again is a cheap no-op.

        ``durable=False`` skips the per-file fsyncs: a caller writing many blobs then syncs :meth:`sync_roots`
        once (ingestion does, per batch, with ``PackageStore.sync``, before its catalog commit)."""
        sha = hashlib.sha256(data).hexdigest()
        target = self.path(sha)
        if target.is_file() and target.stat().st_size == len(data):
            return sha
        tmp = self._tmp_path()
        fsync = self.fsync and durable
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())
            self._publish(tmp, target, fsync=fsync)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return sha

    def put_file(self, src: str | os.PathLike[str]) -> str:
        """Copy a file into the store while hashing it, without holding it in memory."""
        tmp = self._tmp_path()
        digest = hashlib.sha256()
        size = 0
        try:
            with open(src, "rb") as inp, open(tmp, "wb") as out:
                while chunk := inp.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                self._flush(out)
            sha = digest.hexdigest()
            target = self.path(sha)
            if not (target.is_file() and target.stat().st_size == size):
                self._publish(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return sha

    def get(self, sha: str, *, verify: bool = False) -> bytes:
        """Read a blob; with ``verify`` the content is re-hashed (detects bit rot or tampering)."""
        try:
            data = self.path(sha).read_bytes()
        except FileNotFoundError:
            raise NotFound("blob not found", sha256=sha) from None
        if verify and hashlib.sha256(data).hexdigest() != sha:
            raise InvalidInput("blob content does not match its sha256", sha256=sha)
        return data

    def open(self, sha: str) -> BinaryIO:
        try:
            return open(self.path(sha), "rb")
        except FileNotFoundError:
            raise NotFound("blob not found", sha256=sha) from None

    def size(self, sha: str) -> int:
        try:
            return self.path(sha).stat().st_size
        except FileNotFoundError:
            raise NotFound("blob not found", sha256=sha) from None

    def delete(self, sha: str) -> bool:
        """Remove a blob; returns False if it was not there. Empty shard directories are pruned."""
        target = self.path(sha)
        try:
            target.unlink()
        except FileNotFoundError:
            return False
        for parent in (target.parent, target.parent.parent):
            try:
                parent.rmdir()
            except OSError:
                break
        return True

    def iter_shas(self) -> Iterator[str]:
        """Every stored sha256, in sorted order (temp files and stray names are ignored)."""
        for first in sorted(self._subdirs(self.root)):
            for second in sorted(self._subdirs(first)):
                for entry in sorted(os.scandir(second), key=lambda e: e.name):
                    name = entry.name
                    if (
                        entry.is_file()
                        and _SHA_RE.fullmatch(name)
                        and name[:2] == first.name
                        and name[2:4] == second.name
                    ):
                        yield name

    def sweep_temp(self, older_than_s: float = 3600.0) -> int:
        """Remove temp files left behind by crashed writers; returns how many were removed."""
        cutoff = time.time() - older_than_s
        removed = 0
        for entry in os.scandir(self.root / _TMP_DIR):
            try:
                if entry.stat().st_mtime < cutoff:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    # -- internals -------------------------------------------------------------------------------

    @staticmethod
    def _subdirs(path: Path) -> Iterator[Path]:
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False) and re.fullmatch(r"[0-9a-f]{2}", entry.name):
                yield Path(entry.path)

    def _tmp_path(self) -> Path:
        tmp_dir = self.root / _TMP_DIR
        tmp_dir.mkdir(exist_ok=True)
        return tmp_dir / f"{uuid.uuid4().hex}.part"

    def _flush(self, fh: BinaryIO) -> None:
        fh.flush()
        if self.fsync:
            os.fsync(fh.fileno())

    def sync_roots(self) -> tuple[Path, ...]:
        """The directories whose filesystem sync makes every blob written with ``durable=False`` durable (none
        where this store never syncs); ingestion syncs them with the package store's in one call."""
        return (self.root,) if self.fsync else ()

    def _publish(self, tmp: Path, target: Path, *, fsync: bool = True) -> None:
        for attempt in range(3):
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(tmp, target)
                break
            except FileNotFoundError:
                # A concurrent delete() pruned the (then empty) shard directory; make it again.
                if attempt == 2:
                    raise
        if self.fsync and fsync:
            fsync_dir(target.parent)
