"""Re-opening the source of a job, in the worker that processes it (also after a restart).

Upload and zip jobs read their staged copy; folder jobs re-walk the folder (a file removed since then fails
alone with ``NotFound``); URL jobs re-fetch each URL; backfill jobs read ingested originals from the blob
store. Open sources are cached per job until it finishes.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rubricsearch.indexer.blobs import BlobStore
from rubricsearch.indexer.catalog import Catalog, JobRecord, list_items
from rubricsearch.indexer.jobs.backfill import BACKFILL, BlobSource
from rubricsearch.indexer.jobs.staging import StagedUploadSource, Staging
from rubricsearch.indexer.sources import FolderSource, NetGuard, Source, SourceLimits, UrlFetcher, UrlSource, ZipSource
from rubricsearch.indexer.sources.archive import DEFAULT_MAX_ARCHIVE_BYTES
from rubricsearch.retrieval.errors import InvalidInput

KINDS = ("upload", "zip", "folder", "url", BACKFILL)
_PAGE = 10_000


class JobSources:
    """Gives the worker a :class:`Source` for a job; thread safe."""

    def __init__(
        self,
        catalog: Catalog,
        staging: Staging,
        *,
        blobs: BlobStore | None = None,
        limits: SourceLimits | None = None,
        max_archive_bytes: int = DEFAULT_MAX_ARCHIVE_BYTES,
        folder_root: str | Path | None = None,
        url_fetcher: UrlFetcher | None = None,
    ) -> None:
        self.catalog = catalog
        self.staging = staging
        self.blobs = blobs
        self.limits = limits or SourceLimits()
        self.max_archive_bytes = max_archive_bytes
        self.folder_root = folder_root
        self._fetcher = url_fetcher
        self._own_fetcher = url_fetcher is None
        self._open: dict[str, Source] = {}
        self._lock = threading.Lock()

    @property
    def fetcher(self) -> UrlFetcher:
        """The URL fetcher (a default one, guarded against private addresses, unless one was given)."""
        with self._lock:
            if self._fetcher is None:
                self._fetcher = UrlFetcher(NetGuard(), max_bytes=self.limits.max_item_bytes)
            return self._fetcher

    def get(self, job: JobRecord) -> Source:
        """The job's source, opened once; raises a typed error if it cannot be opened any more."""
        with self._lock:
            source = self._open.get(job.id)
        if source is not None:
            return source
        source = self._reopen(job)
        with self._lock:
            existing = self._open.setdefault(job.id, source)
        if existing is not source:
            source.close()
        return existing

    def _reopen(self, job: JobRecord) -> Source:
        match job.kind:
            case "upload":
                return StagedUploadSource(self.staging, job.id, self.limits)
            case "zip":
                return ZipSource(
                    self.staging.archive_path(job.id), self.limits, max_archive_bytes=self.max_archive_bytes
                )
            case "folder":
                return FolderSource(str(job.options.get("path", "")), allowed_root=self.folder_root,
                                    limits=self.limits)
            case "url":
                return UrlSource(self._refs(job.id), fetcher=self.fetcher, limits=self.limits)
            case "backfill" if self.blobs is not None:
                return BlobSource(self.blobs, self._refs(job.id))
            case _:
                raise InvalidInput(f"unknown ingestion job kind {job.kind!r}", job_id=job.id)

    def _refs(self, job_id: str) -> list[str]:
        refs: list[str] = []
        with self.catalog.read() as s:
            while True:
                page = list_items(s, job_id, limit=_PAGE, offset=len(refs))
                refs.extend(item.source_ref for item in page)
                if len(page) < _PAGE:
                    return refs

    def close(self, job_id: str) -> None:
        with self._lock:
            source = self._open.pop(job_id, None)
        if source is not None:
            source.close()

    def close_all(self) -> None:
        with self._lock:
            sources, self._open = list(self._open.values()), {}
            fetcher, self._fetcher = (self._fetcher, None) if self._own_fetcher else (None, self._fetcher)
        for source in sources:
            source.close()
        if fetcher is not None:
            fetcher.close()
