"""Durable staging of job inputs that exist only in the request: uploaded files and zip archives.

A job's inputs are written under ``root/.tmp-<job_id>-<rand>/`` (each file fsynced), then the directory is
renamed to ``root/<job_id>/`` and the parent fsynced, all *before* the job row is committed. So after a
crash a job row always finds its complete inputs, and a half-staged upload is only a ``.tmp-*`` directory
that :meth:`Staging.sweep` removes. The directory goes away when its job finishes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from rubricsearch.indexer.sources.base import ListedSource, SourceLimits
from rubricsearch.retrieval.durable import fsync_dir
from rubricsearch.retrieval.errors import ImageError, InvalidInput, NotFound, PayloadTooLarge

MANIFEST = "manifest.json"
ARCHIVE = "archive.zip"
FORMAT_VERSION = 1
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


def _check_job_id(job_id: str) -> str:
    if not _JOB_ID_RE.fullmatch(job_id):
        raise InvalidInput("invalid job id for staging", job_id=job_id[:80])
    return job_id


class StagedDir:
    """A staging directory being filled; :meth:`Staging.stage` publishes it atomically."""

    def __init__(self, path: Path, fsync: bool) -> None:
        self.path = path
        self.fsync = fsync

    def write_bytes(self, name: str, data: bytes) -> None:
        with open(self.path / name, "wb") as fh:
            fh.write(data)
            self._sync(fh)

    def copy_stream(self, name: str, stream: BinaryIO, limit: int) -> int:
        """Copy a binary stream into the directory, refusing more than ``limit`` bytes."""
        total = 0
        with open(self.path / name, "wb") as fh:
            while chunk := stream.read(_CHUNK):
                total += len(chunk)
                if total > limit:
                    raise PayloadTooLarge(f"the archive is larger than the limit of {limit} bytes", limit=limit)
                fh.write(chunk)
            self._sync(fh)
        return total

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        self.write_bytes(MANIFEST, json.dumps({"version": FORMAT_VERSION, **manifest}).encode())

    def _sync(self, fh: BinaryIO) -> None:
        fh.flush()
        if self.fsync:
            os.fsync(fh.fileno())


class Staging:
    """Per-job staging directories under one root (``data_dir/staging``)."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, job_id: str) -> Path:
        return self.root / _check_job_id(job_id)

    def exists(self, job_id: str) -> bool:
        return self.path(job_id).is_dir()

    @contextlib.contextmanager
    def stage(self, job_id: str) -> Iterator[StagedDir]:
        """Fill a temp directory inside the block; on success it becomes ``root/<job_id>`` atomically."""
        target = self.path(job_id)
        if target.exists():
            raise InvalidInput("this job already has staged inputs", job_id=job_id)
        tmp = self.root / f"{_TMP_PREFIX}{job_id}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            yield StagedDir(tmp, self.fsync)
            if self.fsync:
                fsync_dir(tmp)
            os.replace(tmp, target)
            if self.fsync:
                fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def stage_uploads(self, job_id: str, files: Sequence[tuple[str, bytes]]) -> Path:
        """Stage uploaded files (``(ref, bytes)`` in job order); the manifest keeps the refs."""
        with self.stage(job_id) as staged:
            entries = []
            for n, (ref, data) in enumerate(files):
                name = f"{n:06d}.bin"
                staged.write_bytes(name, data)
                entries.append({"ref": ref, "file": name, "size": len(data)})
            staged.write_manifest({"kind": "upload", "files": entries})
        return self.path(job_id)

    def manifest(self, job_id: str) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads((self.path(job_id) / MANIFEST).read_bytes())
        except FileNotFoundError:
            raise NotFound("the job's staged inputs are gone (removed after it finished?)", job_id=job_id) from None
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"the job's staging manifest is unreadable: {exc}", job_id=job_id) from exc
        if data.get("version") != FORMAT_VERSION:
            raise InvalidInput("unknown staging manifest version", job_id=job_id)
        return data

    def archive_path(self, job_id: str) -> Path:
        path = self.path(job_id) / ARCHIVE
        if not path.is_file():
            raise NotFound("the job's staged archive is gone (removed after it finished?)", job_id=job_id)
        return path

    def remove(self, job_id: str) -> bool:
        """Delete a job's staged inputs; False if there were none."""
        path = self.path(job_id)
        if not path.exists():
            return False
        # Rename first so a crash mid-delete leaves a temp dir (swept later), never a partial job dir.
        doomed = self.root / f"{_TMP_PREFIX}{job_id}-rm{uuid.uuid4().hex[:8]}"
        try:
            os.replace(path, doomed)
        except FileNotFoundError:
            return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def job_ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _JOB_ID_RE.fullmatch(p.name))

    def sweep(self, keep: Callable[[str], bool], *, grace_s: float = 600.0) -> int:
        """Remove temp dirs older than ``grace_s`` and job dirs for which ``keep(job_id)`` is False.

        The grace period protects a job being staged right now by another process; ``keep`` must say
        True for jobs that are queued or running.
        """
        removed = 0
        cutoff = time.time() - grace_s
        for entry in list(self.root.iterdir()):
            if entry.name.startswith(_TMP_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    if entry.stat().st_mtime <= cutoff:
                        shutil.rmtree(entry, ignore_errors=True)
                        removed += 1
            elif entry.is_dir() and _JOB_ID_RE.fullmatch(entry.name) and not keep(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    if entry.stat().st_mtime <= cutoff or grace_s <= 0:
                        removed += self.remove(entry.name)
        return removed


class StagedUploadSource(ListedSource):
    """The uploads of one job, read back lazily from staging (same refs and checks as UploadSource)."""

    kind = "upload"

    def __init__(self, staging: Staging, job_id: str, limits: SourceLimits | None = None) -> None:
        super().__init__(limits or SourceLimits())
        self._dir = staging.path(job_id)
        self._files: dict[str, str] = {}
        for entry in staging.manifest(job_id).get("files", []):
            ref = self._add(str(entry["ref"]), int(entry["size"]))
            if ref != entry["ref"]:
                raise InvalidInput("the staging manifest repeats a ref", ref=str(entry["ref"])[:200])
            self._files[ref] = str(entry["file"])

    def _load(self, ref: str) -> bytes:
        try:
            data = (self._dir / self._files[ref]).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{ref}: the staged upload is gone", ref=ref) from None
        if not data:
            raise ImageError(f"{ref} is empty (0 bytes)", ref=ref)
        limit = self.limits.max_item_bytes
        if len(data) > limit:
            raise PayloadTooLarge(f"{ref} is {len(data)} bytes; the limit is {limit}", limit=limit, ref=ref)
        return data
