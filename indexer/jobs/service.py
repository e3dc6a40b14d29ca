"""The ingestion facade the REST API and the CLI call: create jobs, follow them, cancel, delete, reconcile.

Creating a job validates the source as a whole (an unreadable zip or a folder outside the allowed root is
refused right here, before anything is queued), stages request-only inputs durably, then commits the job
with one item per source entry. Workers (:class:`~indexer.jobs.runner.IngestionRunner`) do the rest.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from rubricsearch.indexer.blobs import BlobStore
from rubricsearch.indexer.catalog import (
    Catalog,
    ImageRecord,
    ItemRecord,
    ItemSpec,
    ItemState,
    JobRecord,
    SetRecord,
    delete_packages,
    get_job,
    get_set,
    list_items,
    list_jobs,
    new_id,
    request_cancel,
    retry_failed_items,
)
from rubricsearch.indexer.catalog import count_images as _count_images
from rubricsearch.indexer.catalog import create_job as _create_job
from rubricsearch.indexer.catalog import create_set as _create_set
from rubricsearch.indexer.catalog import delete_image as _delete_image
from rubricsearch.indexer.catalog import delete_set as _delete_set
from rubricsearch.indexer.catalog import list_sets as _list_sets
from rubricsearch.indexer.catalog.metadata import MANIFEST_NAMES
from rubricsearch.indexer.catalog.versions import BASE
from rubricsearch.indexer.jobs.manifests import (
    MAX_MANIFEST_BYTES,
    folder_manifest,
    specs_from_manifest,
    specs_from_objects,
)
from rubricsearch.indexer.jobs.reconcile import ReconcileReport, SweepReport, reconcile_set, sweep
from rubricsearch.indexer.jobs.sources import JobSources
from rubricsearch.indexer.jobs.staging import ARCHIVE, Staging
from rubricsearch.indexer.names import clean_name
from rubricsearch.indexer.reserve import SpaceReserve
from rubricsearch.indexer.sources import FolderSource, SourceLimits, UploadSource, UrlFetcher, UrlSource, ZipSource
from rubricsearch.indexer.sources.archive import DEFAULT_MAX_ARCHIVE_BYTES
from rubricsearch.indexer.sources.base import ListedSource
from rubricsearch.retrieval.embedding import Embedder
from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput, NotFound
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS
from rubricsearch.retrieval.index import VectorIndex
from rubricsearch.retrieval.packages import VisualPackages

log = logging.getLogger(__name__)
MAX_RECORDED_SKIPS = 100


@dataclass(frozen=True)
class SetDeletion:
    """What deleting a set removed (blobs and packages only where no other set uses the image)."""

    set_id: str
    images: int
    jobs: int
    blobs_removed: int


class IngestionService:
    """Jobs, deletes and consistency for reference sets; thread safe, one per process."""

    def __init__(
        self,
        catalog: Catalog,
        blobs: BlobStore,
        index: VectorIndex,
        staging: Staging,
        *,
        embedder: Embedder | None = None,
        packages: VisualPackages | None = None,
        limits: SourceLimits | None = None,
        max_archive_bytes: int = DEFAULT_MAX_ARCHIVE_BYTES,
        folder_root: str | Path | None = None,
        url_fetcher: UrlFetcher | None = None,
        image_max_bytes: int = DEFAULT_MAX_BYTES,
        image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
    ) -> None:
        self.catalog, self.blobs, self.index, self.staging = catalog, blobs, index, staging
        self.embedder = embedder
        # each set's embedder of its documents, when a set may serve another version than the base (the app's
        # active embedder versions); None: the base embeds every set
        self.set_embedders: Callable[[str], tuple[Embedder, str]] | None = None
        # The package stage the embedder registered with (the reranker too, in an app): ingestion builds a
        # package of every image for each distinct tower it holds.
        self.packages = packages if packages is not None else (
            embedder.packages.service if embedder is not None else None)
        self.limits = limits or SourceLimits()
        self.max_archive_bytes = max_archive_bytes
        self.image_max_bytes = image_max_bytes
        self.image_max_pixels = image_max_pixels
        self.paused: str | None = None  # why the workers are not processing now (the disk is full), else None
        self.reserve = SpaceReserve(blobs.root.parent / ".space-reserve")  # so deletes work on a full disk
        self.reserve.ensure()
        self.sources = JobSources(catalog, staging, blobs=blobs, limits=self.limits,
                                  max_archive_bytes=max_archive_bytes, folder_root=folder_root,
                                  url_fetcher=url_fetcher)
        self.listeners: list[Callable[[JobRecord], None]] = []  # e.g. a runner's wake()
        self.ended_listeners: list[Callable[[JobRecord], None]] = []  # e.g. the facets of new references

    @classmethod
    def open_local(
        cls, data_dir: str | Path, *, catalog_url: str | None = None, faiss_autoflush: bool = False, **options: Any
    ) -> IngestionService:
        """Everything under one data directory: SQLite catalog, blobs, FAISS, staging (the default layout)."""
        from rubricsearch.retrieval.index import make_index

        root = Path(data_dir)
        catalog = Catalog.open(catalog_url or f"sqlite:///{(root / 'catalog.db').resolve()}")
        index = make_index("faiss", path=root / "faiss", autoflush=faiss_autoflush)
        return cls(catalog, BlobStore(root / "blobs"), index, Staging(root / "staging"), **options)

    def close(self) -> None:
        """Flush the index and close sources; the caller closes what it passed in (catalog, index)."""
        self.index.flush()
        self.sources.close_all()

    # -- sets ---------------------------------------------------------------------------------------
    def create_set(self, name: str, *, description: str = "", embedding_dim: int | None = None,
                   settings: dict[str, Any] | None = None, set_id: str | None = None) -> SetRecord:
        """A catalog set plus its (empty) vector set, so searches work before the first image; the name is
        stored as :func:`~indexer.names.clean_name` makes it (look-alike spellings are one name)."""
        if not (name := clean_name(name)):
            raise InvalidInput("a set name needs a visible character")
        with self.catalog.write() as s:
            record = _create_set(s, name, description=description, set_id=set_id, settings=settings,
                                 embedding_dim=embedding_dim)
        self._ensure_index_set(record)
        return record

    def _ensure_index_set(self, ref_set: SetRecord) -> None:
        dim = ref_set.embedding_dim or (self.embedder.dimension if self.embedder is not None else None)
        if dim is not None and not self.index.has_set(ref_set.id):
            self.index.create_set(ref_set.id, dim)

    def _get_set(self, set_id: str) -> SetRecord:
        with self.catalog.read() as s:
            return get_set(s, set_id)

    # -- job creation ---------------------------------------------------------------------------------
    def create_job_from_uploads(self, set_id: str, files: Sequence[tuple[str | None, bytes]],
                                metadata: Mapping[str, Mapping[str, Any]] | None = None) -> JobRecord:
        """One item per uploaded ``(filename, bytes)``, with ``metadata`` by file name; the bytes are staged
        before the job exists."""
        ref_set = self._get_set(set_id)
        files = list(files)
        source = UploadSource(files, self.limits)  # refuses an oversized upload as a whole
        refs = source.refs()
        specs = specs_from_objects(refs, [name for name, _ in files], metadata, "file")
        job_id = new_id()
        self.staging.stage_uploads(job_id, [(ref, bytes(data)) for ref, (_, data) in zip(refs, files, strict=True)])
        return self._commit_job(ref_set, job_id, "upload", specs, {"files": len(refs)}, staged=True)

    def create_job_from_zip(
        self, set_id: str, archive: bytes | str | os.PathLike[str] | BinaryIO, *, name: str = "archive.zip"
    ) -> JobRecord:
        """One item per image entry of a zip (bytes, a path or a binary stream); unsafe entries fail alone."""
        ref_set = self._get_set(set_id)
        job_id = new_id()
        with self.staging.stage(job_id) as staged:
            if isinstance(archive, bytes | bytearray | memoryview):
                if len(archive) > self.max_archive_bytes:
                    raise InvalidInput(f"the archive is larger than {self.max_archive_bytes} bytes")
                staged.write_bytes(ARCHIVE, bytes(archive))
            elif isinstance(archive, str | os.PathLike):
                with open(archive, "rb") as fh:
                    staged.copy_stream(ARCHIVE, fh, self.max_archive_bytes)
            else:
                staged.copy_stream(ARCHIVE, archive, self.max_archive_bytes)
            with ZipSource(staged.path / ARCHIVE, self.limits, max_archive_bytes=self.max_archive_bytes) as source:
                refs, options = source.refs(), _skips(source)
                manifest = source.root_file(MANIFEST_NAMES, MAX_MANIFEST_BYTES)
            specs = specs_from_manifest(refs, manifest)  # a bad one: nothing staged
            _applied(options, manifest, specs)
        options["archive_name"] = Path(str(name)).name[:255] or "archive.zip"
        return self._commit_job(ref_set, job_id, "zip", specs, options, staged=True)

    def create_job_from_folder(self, set_id: str, path: str | os.PathLike[str]) -> JobRecord:
        """One item per image file under ``path`` (which must lie under the configured folder root)."""
        ref_set = self._get_set(set_id)
        source = FolderSource(path, allowed_root=self.sources.folder_root, limits=self.limits)
        with source:
            refs, options = source.refs(), _skips(source)
            manifest = folder_manifest(source.top)
            specs = specs_from_manifest(refs, manifest)
            _applied(options, manifest, specs)
        options["path"] = os.fspath(path)
        return self._commit_job(ref_set, new_id(), "folder", specs, options, staged=False)

    def create_job_from_urls(self, set_id: str, urls: Iterable[str],
                             metadata: Mapping[str, Mapping[str, Any]] | None = None) -> JobRecord:
        """One item per distinct URL, with ``metadata`` by URL; each is fetched (through the network guard) by
        the worker."""
        ref_set = self._get_set(set_id)
        source = UrlSource(urls, fetcher=self.sources.fetcher, limits=self.limits)
        refs, options = source.refs(), _skips(source)
        specs = specs_from_objects(refs, refs, metadata, "URL")
        options["urls"] = len(refs) + int(options.get("source_skipped", 0))
        return self._commit_job(ref_set, new_id(), "url", specs, options, staged=False)

    def _commit_job(self, ref_set: SetRecord, job_id: str, kind: str, refs: Sequence[str | ItemSpec],
                    options: dict[str, Any], *, staged: bool) -> JobRecord:
        try:
            with self.catalog.write() as s:
                job = _create_job(s, ref_set.id, kind, refs, options=options, job_id=job_id)
        except BaseException:
            if staged:
                self.staging.remove(job_id)
            raise
        if job.finished and staged:
            self.staging.remove(job_id)  # an empty job is born finished
        self._ensure_index_set(ref_set)
        for listener in list(self.listeners):
            listener(job)
        return job

    # -- following and steering jobs --------------------------------------------------------------------
    def get_job(self, job_id: str) -> JobRecord:
        with self.catalog.read() as s:
            return get_job(s, job_id)

    def list_jobs(self, *, set_id: str | None = None, limit: int = 50, offset: int = 0) -> list[JobRecord]:
        with self.catalog.read() as s:
            return list_jobs(s, set_id=set_id, limit=limit, offset=offset)

    def job_items(self, job_id: str, *, states: Iterable[ItemState] | None = None, limit: int = 100,
                  offset: int = 0) -> list[ItemRecord]:
        """A job's items with their outcome and reason (``states=[ItemState.FAILED]`` for an error report)."""
        with self.catalog.read() as s:
            get_job(s, job_id)
            return list_items(s, job_id, states=states, limit=limit, offset=offset)

    def watch(self, job_id: str, *, interval_s: float = 0.5, timeout_s: float | None = None) -> Iterator[JobRecord]:
        """Yield the job now and whenever its progress changes, until it finishes (for SSE)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last: tuple[Any, ...] | None = None
        while True:
            job = self.get_job(job_id)
            key = (job.state, job.done, job.failed, job.skipped, job.cancel_requested)
            if key != last:
                last = key
                yield job
            if job.finished or (deadline is not None and time.monotonic() >= deadline):
                return
            time.sleep(interval_s)

    def cancel(self, job_id: str) -> JobRecord:
        """Stop a job: pending items are cancelled now, claimed ones finish, then it is ``cancelled``."""
        with self.catalog.write() as s:
            job = request_cancel(s, job_id)
        if job.finished:
            self.job_ended(job)
        return job

    def retry_failed(self, job_id: str) -> JobRecord:
        """Reopen a finished job's failed items (URL and folder jobs; staged inputs are gone by then)."""
        with self.catalog.write() as s:
            job = retry_failed_items(s, job_id)
        for listener in list(self.listeners):
            listener(job)
        return job

    def job_ended(self, job: JobRecord) -> None:
        """Release a finished job's open source and staged inputs."""
        self.sources.close(job.id)
        self.staging.remove(job.id)
        for listener in list(self.ended_listeners):
            try:
                listener(job)
            except Exception:  # a follow-up must not break the worker that finished the job
                log.exception("after job %s ended", job.id)

    # -- deletes ----------------------------------------------------------------------------------------
    def delete_image(self, set_id: str, image_id: int) -> ImageRecord:
        """Remove an image from the catalog, the set's index and, unless another set uses it, the blob
        and its packages. The catalog goes first: a crash after it leaves only extras that
        :meth:`reconcile` and :meth:`collect_garbage` remove."""
        with self.catalog.write() as s:
            deletion = _delete_image(s, image_id, set_id=set_id)
            if deletion.blob_orphaned:
                delete_packages(s, deletion.image.sha256)
        sha = deletion.image.sha256
        if self.index.has_set(set_id):
            self.index.delete(set_id, [sha])
            self.index.flush()
        if deletion.blob_orphaned:
            self._drop_image_files(sha)
        return deletion.image

    def delete_set(self, set_id: str) -> SetDeletion:
        """Remove a set with its images, jobs (and their staged inputs), vectors, and unshared blobs."""
        with self.catalog.read() as s:
            get_set(s, set_id)
            jobs = list_jobs(s, set_id=set_id, limit=100_000)
            images = sum(_count_images(s, set_id).values())
        with self.catalog.write() as s:
            orphaned = _delete_set(s, set_id)
            for sha in orphaned:
                delete_packages(s, sha)
        if self.index.has_set(set_id):
            self.index.drop_set(set_id)
        for job in jobs:
            self.job_ended(job)
        for sha in orphaned:
            self._drop_image_files(sha)
        return SetDeletion(set_id=set_id, images=images, jobs=len(jobs), blobs_removed=len(orphaned))

    def _drop_image_files(self, sha: str) -> None:
        self.blobs.delete(sha)
        if self.packages is not None:
            self.packages.delete_image(sha)

    def embedder_of(self, set_id: str) -> tuple[Embedder, str]:
        """The embedder of the set's documents (its active version's, or the base) and that version's id."""
        if self.embedder is None:
            raise BackendUnavailable("embedding needs the embedding model, and none is loaded here")
        if self.set_embedders is None:
            return self.embedder, BASE
        return self.set_embedders(set_id)

    # -- consistency ------------------------------------------------------------------------------------
    def reconcile(self, set_id: str) -> ReconcileReport:
        """Make the set's vectors equal its indexed catalog rows (run at start-up and after crashes)."""
        if self.embedder is None:
            raise BackendUnavailable("reconciling needs the embedding model, and none is loaded here")
        return reconcile_set(self.catalog, self.index, self.blobs, self.embedder, set_id, packages=self.packages,
                             documents=lambda: self.embedder_of(set_id)[0],
                             image_max_bytes=self.image_max_bytes, image_max_pixels=self.image_max_pixels)

    def reconcile_all(self) -> list[ReconcileReport]:
        with self.catalog.read() as s:
            set_ids = [r.id for r in _list_sets(s)]
        reports = []
        for set_id in set_ids:
            try:
                reports.append(self.reconcile(set_id))
            except NotFound:
                continue  # deleted meanwhile
        return reports

    def collect_garbage(self, *, grace_s: float = 600.0, orphan_blobs: bool = True) -> SweepReport:
        """Sweep staging of finished jobs, temp files, unreferenced blobs and vector sets of deleted sets."""
        store = self.packages.store if self.packages is not None else None
        return sweep(self.catalog, self.staging, self.blobs, self.index, store, grace_s=grace_s,
                     orphan_blobs=orphan_blobs)


def _applied(options: dict[str, Any], manifest: tuple[str, bytes] | None, specs: Sequence[ItemSpec]) -> None:
    """Report the source's manifest as applied (``options["manifest"]``: its name, the images it gives metadata),
    not among the entries the source ignored (its name is not an image's, so the source skipped it)."""
    if manifest is None:
        return
    name = manifest[0]
    options["manifest"] = {"name": name, "images": sum(1 for spec in specs if spec.meta)}
    entries = options.get("skipped_entries", [])
    options["skipped_entries"] = [e for e in entries if e["ref"] != name]
    options["source_skipped"] = max(0, int(options.get("source_skipped", 0)) - 1)
    if not options["source_skipped"]:
        del options["skipped_entries"], options["source_skipped"]


def _skips(source: ListedSource) -> dict[str, Any]:
    """Entries the source saw but does not offer (not images, macOS metadata...), for the job report."""
    if not source.skipped_count:
        return {}
    entries = [{"ref": e.ref[:300], "reason": e.reason} for e in source.skipped[:MAX_RECORDED_SKIPS]]
    return {"source_skipped": source.skipped_count, "skipped_entries": entries}
