"""Processing one claimed batch of job items: load, decode, dedup, vision, embed, blob, vector, catalog.

Each stage runs over the whole batch (the vision tower and the LM pass are batched across items), and
an item that fails a stage is recorded with its typed reason while the others go on. The expensive work
is idempotent (blob put by content, vector upsert by sha, packages by sha and fingerprint), so a batch cut
short by a crash is simply done again. Only the final step makes progress visible: per item, the image
row (marked indexed) and the item's outcome commit together, one savepoint each, one transaction per batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy.orm import Session

from indexer.blobs import BlobStore
from indexer.catalog import (
    Catalog,
    ImageRecord,
    ImageStatus,
    ItemRecord,
    ItemState,
    JobRecord,
    add_image,
    complete_item,
    fail_job,
    find_image,
    get_job,
    get_set,
    heartbeat,
    mark_image_indexed,
    record_package,
    release_items,
)
from indexer.jobs.model import PackageEmbedder, StageTimes, describe
from indexer.sources import Source
from retrieval.embedding.protocol import matryoshka
from retrieval.errors import BackendUnavailable, Conflict, NotFound, RubricSearchError
from retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS, DecodedImage, decode_image
from retrieval.index import VectorIndex
from retrieval.packages import VisualPackage
from retrieval.qwen.prompts import Content

log = logging.getLogger(__name__)
SourceFor = Callable[[JobRecord], Source]


@dataclass(eq=False)
class Unit:
    """One claimed item on its way through the stages."""

    item: ItemRecord
    job: JobRecord
    dim: int
    decoded: DecodedImage | None = None
    error: str | None = None
    skip: tuple[str, int] | None = None  # (reason, image id) of a duplicate already in the set
    primary: Unit | None = None  # an earlier item of this batch with the same image
    existing: ImageRecord | None = None  # a row of this image that is not indexed yet
    package: VisualPackage | None = None
    vector: np.ndarray | None = None
    image_id: int | None = None
    lost: bool = False  # the claim is no longer ours (job failed/deleted, or taken over)

    @property
    def working(self) -> bool:
        """Still to be indexed by this item itself (not failed, skipped, a duplicate or lost)."""
        return not (self.error or self.skip or self.primary or self.lost)

    @property
    def sha(self) -> str:
        assert self.decoded is not None
        return self.decoded.sha256


@dataclass
class BatchResult:
    done: int = 0
    failed: int = 0
    skipped: int = 0
    lost: int = 0
    jobs: dict[str, JobRecord] = field(default_factory=dict)

    @property
    def finished(self) -> list[JobRecord]:
        return [j for j in self.jobs.values() if j.finished]


class BatchProcessor:
    """Turns a list of claimed items into indexed images; shared by all worker threads."""

    def __init__(
        self,
        catalog: Catalog,
        blobs: BlobStore,
        index: VectorIndex,
        embedder: PackageEmbedder,
        *,
        worker_id: str,
        image_max_bytes: int = DEFAULT_MAX_BYTES,
        image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
        load_threads: int = 4,
        heartbeat_every_s: float = 30.0,
    ) -> None:
        self.catalog, self.blobs, self.index, self.embedder = catalog, blobs, index, embedder
        self.worker_id = worker_id
        self.image_max_bytes = image_max_bytes
        self.image_max_pixels = image_max_pixels
        self.heartbeat_every_s = heartbeat_every_s
        self.times = StageTimes()
        self._pool = ThreadPoolExecutor(max_workers=max(1, load_threads), thread_name_prefix="ingest-load")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- the batch ----------------------------------------------------------------------------------
    def process(self, items: Sequence[ItemRecord], source_for: SourceFor) -> BatchResult:
        """Process claimed items (of any jobs); raises only for infrastructure failures (then release)."""
        units = self._resolve(items)
        beat = [time.monotonic()]
        self._load(units, source_for)
        with self.times.time("dedup"):
            self._dedup(units)
        self._heartbeat(units, beat)
        with self.times.time("vision"):
            self._vision([u for u in units if u.working])
        self._heartbeat(units, beat)
        with self.times.time("embed"):
            self._embed([u for u in units if u.working])
        self._heartbeat(units, beat)
        self._store_blobs([u for u in units if u.working])
        with self.times.time("index"):
            self._upsert([u for u in units if u.working])
        with self.times.time("catalog"):
            result = self._commit(units)
        self.times.count(len(units))
        return result

    def _resolve(self, items: Sequence[ItemRecord]) -> list[Unit]:
        units: list[Unit] = []
        dims: dict[str, int] = {}
        with self.catalog.read() as s:
            jobs: dict[str, JobRecord | None] = {}
            for item in items:
                if item.job_id not in jobs:
                    try:
                        jobs[item.job_id] = get_job(s, item.job_id)
                    except NotFound:
                        jobs[item.job_id] = None  # deleted with its set
                job = jobs[item.job_id]
                if job is None:
                    continue
                if job.set_id not in dims:
                    ref_set = get_set(s, job.set_id)
                    dims[job.set_id] = ref_set.embedding_dim or self.embedder.dimension
                units.append(Unit(item=item, job=job, dim=dims[job.set_id]))
        for set_id in dims:
            if self.index.has_set(set_id):
                dims[set_id] = self.index.dim(set_id)  # the index's dimension wins once it exists
        for u in units:
            u.dim = dims[u.job.set_id]
        return units

    def _load(self, units: list[Unit], source_for: SourceFor) -> None:
        sources: dict[str, Source | None] = {}
        for u in units:
            if u.job.id not in sources:
                sources[u.job.id] = self._open_source(u.job, source_for)
            if sources[u.job.id] is None:
                u.lost = True
        loaded = [u for u in units if not u.lost]
        for u, outcome in zip(loaded, self._pool.map(lambda u: self._load_one(u, sources), loaded), strict=True):
            if isinstance(outcome, str):
                u.error = outcome
            else:
                u.decoded = outcome

    def _open_source(self, job: JobRecord, source_for: SourceFor) -> Source | None:
        try:
            return source_for(job)
        except RubricSearchError as exc:
            log.warning("ingestion job %s: cannot open its source: %s", job.id, exc)
            with self.catalog.write() as s:
                fail_job(s, job.id, f"cannot open the job's source: {describe(exc)}")
            return None

    def _load_one(self, u: Unit, sources: dict[str, Source | None]) -> DecodedImage | str:
        source = sources[u.job.id]
        assert source is not None
        start = time.perf_counter()
        try:
            data = source.load(u.item.source_ref)
        except Exception as exc:  # a source must fail per item, whatever went wrong
            return describe(exc)
        finally:
            self.times.add("load", time.perf_counter() - start)
        start = time.perf_counter()
        try:
            return decode_image(data, max_bytes=self.image_max_bytes, max_pixels=self.image_max_pixels)
        except Exception as exc:
            return describe(exc)
        finally:
            self.times.add("decode", time.perf_counter() - start)

    def _dedup(self, units: list[Unit]) -> None:
        """Within the set: a sha already indexed is a skip; a repeat within the batch follows its first."""
        present: dict[tuple[str, str], ImageRecord | None] = {}
        first: dict[tuple[str, str], Unit] = {}
        with self.catalog.read() as s:
            for u in units:
                if not u.working:
                    continue
                key = (u.job.set_id, u.sha)
                if key not in present:
                    present[key] = find_image(s, u.job.set_id, u.sha)
                existing = present[key]
                if existing is not None and existing.status == ImageStatus.INDEXED:
                    u.skip = (f"duplicate of {existing.original_name or existing.sha256[:12]}", existing.id)
                elif key in first:
                    u.primary = first[key]
                else:
                    first[key] = u
                    u.existing = existing

    def _vision(self, units: list[Unit]) -> None:
        """One tower pass for the batch; if it fails, image by image to find the culprit."""
        if not units:
            return
        images = [u.decoded for u in units if u.decoded is not None]
        try:
            packages = self.embedder.vision.packages(images)
        except Exception as exc:
            log.info("batched vision failed (%s); retrying image by image", describe(exc))
            for u, image in zip(units, images, strict=True):
                try:
                    u.package = self.embedder.vision.packages([image])[0]
                except Exception as one:
                    u.error = describe(one)
            return
        for u, pkg in zip(units, packages, strict=True):
            u.package = pkg

    def _embed(self, units: list[Unit]) -> None:
        """Document embeddings (default instruction) from the cached packages, one batched LM pass."""
        if not units:
            return
        try:
            full: np.ndarray | None = self._embed_full(units)
        except Exception as exc:
            log.info("batched embedding failed (%s); retrying item by item", describe(exc))
            full = None
        for k, u in enumerate(units):
            try:
                row = self._embed_full([u]) if full is None else full[k : k + 1]
                u.vector = matryoshka(row, u.dim, self.embedder.dimension)[0]
            except Exception as one:
                u.error = describe(one)

    def _embed_full(self, units: list[Unit]) -> np.ndarray:
        contents = [Content(images=[u.decoded]) for u in units if u.decoded is not None]
        return self.embedder.embed_contents(contents, [None] * len(contents))

    def _store_blobs(self, units: list[Unit]) -> None:
        """Originals into the blob store (after the model accepted them, so rejects leave no blob)."""

        def put(u: Unit) -> None:
            assert u.decoded is not None
            start = time.perf_counter()
            try:
                if self.blobs.put(u.decoded.data) != u.sha:  # pragma: no cover - a hashing bug
                    raise RuntimeError("blob store and decoder disagree on the sha256")
            finally:
                self.times.add("blob", time.perf_counter() - start)

        list(self._pool.map(put, units))  # an OSError here is infrastructure: the batch is released

    def _upsert(self, units: list[Unit]) -> None:
        by_set: dict[str, list[Unit]] = {}
        for u in units:
            by_set.setdefault(u.job.set_id, []).append(u)
        for set_id, group in by_set.items():
            try:
                if not self.index.has_set(set_id):
                    self.index.create_set(set_id, group[0].dim)
                vectors = np.stack([u.vector for u in group if u.vector is not None])
                self.index.upsert(set_id, [u.sha for u in group], vectors)
            except BackendUnavailable:
                raise
            except RubricSearchError as exc:  # e.g. the set's index has another dimension
                for u in group:
                    u.error = describe(exc)

    def _heartbeat(self, units: list[Unit], beat: list[float]) -> None:
        """Keep a slow batch's claims fresh; an item whose claim was taken over is dropped."""
        if time.monotonic() - beat[0] < self.heartbeat_every_s:
            return
        mine = [u.item.id for u in units if not u.lost]
        with self.catalog.write() as s:
            held = set(heartbeat(s, self.worker_id, mine))
        for u in units:
            if u.item.id not in held:
                u.lost = True
        beat[0] = time.monotonic()

    # -- the one commit ------------------------------------------------------------------------------
    def _commit(self, units: list[Unit]) -> BatchResult:
        result = BatchResult()
        release: list[int] = []
        with self.catalog.write() as s:
            for u in units:
                if u.lost or (u.primary is not None and u.primary.lost):
                    if not u.lost:
                        release.append(u.item.id)  # the item its first copy went to will index it
                    result.lost += 1
                    continue
                try:
                    with s.begin_nested():
                        outcome, job, image_id = self._complete(s, u)
                except (Conflict, NotFound) as exc:  # claim taken over, or job/set deleted meanwhile
                    log.info("item %s not recorded: %s", u.item.id, exc)
                    u.lost = True
                    result.lost += 1
                    continue
                u.image_id = image_id
                result.jobs[job.id] = job
                if outcome == ItemState.DONE:
                    result.done += 1
                elif outcome == ItemState.SKIPPED:
                    result.skipped += 1
                else:
                    result.failed += 1
            if release:
                release_items(s, self.worker_id, release)
        return result

    def _complete(self, s: Session, u: Unit) -> tuple[ItemState, JobRecord, int | None]:
        item, worker = u.item.id, self.worker_id
        if u.error is not None:
            return ItemState.FAILED, complete_item(s, item, worker, ItemState.FAILED, error=u.error), None
        if u.skip is not None:
            reason, image_id = u.skip
            job = complete_item(s, item, worker, ItemState.SKIPPED, error=reason, image_id=image_id,
                                blob_sha256=u.sha)
            return ItemState.SKIPPED, job, image_id
        if u.primary is not None:
            p = u.primary
            if p.error is not None:
                return ItemState.FAILED, complete_item(s, item, worker, ItemState.FAILED, error=p.error), None
            job = complete_item(s, item, worker, ItemState.SKIPPED, error=f"duplicate of {p.item.source_ref}",
                                image_id=p.image_id, blob_sha256=u.sha)
            return ItemState.SKIPPED, job, p.image_id
        assert u.decoded is not None and u.package is not None
        image, created = add_image(
            s, u.job.set_id, sha256=u.sha, byte_size=len(u.decoded.data), source=u.job.kind,
            original_name=u.item.source_ref, source_detail=_detail(u.job, u.item.source_ref),
            width=u.decoded.width, height=u.decoded.height, status=ImageStatus.INDEXED,
        )
        if not created and image.status == ImageStatus.INDEXED and u.existing is None:
            # Another job indexed the same image since the dedup check: this one is a duplicate.
            job = complete_item(s, item, worker, ItemState.SKIPPED, image_id=image.id, blob_sha256=u.sha,
                                error=f"duplicate of {image.original_name or u.sha[:12]}")
            return ItemState.SKIPPED, job, image.id
        if not created:
            mark_image_indexed(s, image.id)
        record_package(s, u.sha, self.embedder.vision.fingerprint.digest(), u.package.nbytes)
        job = complete_item(s, item, worker, ItemState.DONE, image_id=image.id, blob_sha256=u.sha)
        return ItemState.DONE, job, image.id


def _detail(job: JobRecord, ref: str) -> str:
    """Where the image came from, for provenance (the archive or folder, and the entry)."""
    match job.kind:
        case "zip":
            return f"{job.options.get('archive_name', 'archive.zip')}!{ref}"
        case "folder":
            return f"{str(job.options.get('path', '')).rstrip('/')}/{ref}"
        case "url":
            return ref
        case _:
            return f"upload:{ref}"
