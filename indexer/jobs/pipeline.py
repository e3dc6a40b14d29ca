"""Processing one claimed batch of job items: load, decode, dedup, preprocess, vision, embed, blob, vector, catalog.

The vision stage builds a package of every new image for every distinct vision tower in use (one preprocessing pass
per image for towers that preprocess alike, one tower pass per distinct tower), so a search never encodes a
reference. Items of a ``backfill`` job (``indexer.jobs.backfill``) are images already indexed: only the towers that
lack a package run for them, nothing else changes.

Each stage runs over the whole batch (the vision tower and the LM pass are batched across items), and an item that
fails a stage is recorded with its typed reason while the others go on. The expensive work is idempotent (blob put by
content, vector upsert by sha, packages by sha and fingerprint), so a batch cut short by a crash is done again. Only
the final step makes progress visible: the image rows (marked indexed) and the items' outcomes commit together, in
one transaction per batch, after the vector upsert.

The stages come in seven groups so a runner can overlap batches (:mod:`indexer.jobs.overlap`): prepare (CPU: load,
decode, dedup, preprocess), encode (GPU: the towers), pack (packages stored), embed (GPU: the LM pass), store (disk:
blobs, vectors), sync (the package files, one filesystem sync) and commit (the catalog); :meth:`process` runs them
in a row.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from rubricsearch.indexer.blobs import BlobStore
from rubricsearch.indexer.catalog import (
    Catalog,
    ImageRecord,
    ImageStatus,
    ItemRecord,
    JobRecord,
    fail_job,
    get_job,
    get_set,
    heartbeat,
)
from rubricsearch.indexer.catalog.tables import Image
from rubricsearch.indexer.catalog.versions import BASE, locked_active_version
from rubricsearch.indexer.jobs.batch import Batch
from rubricsearch.indexer.jobs.commit import BatchResult, Unit, commit_batch
from rubricsearch.indexer.jobs.model import GROUPS, PIPELINE_STAGES, PipelineTimes, StageTimes, describe
from rubricsearch.indexer.jobs.sizing import Restage, Seen, fit
from rubricsearch.indexer.sources import Source
from rubricsearch.retrieval.embedding.protocol import Embedder, matryoshka
from rubricsearch.retrieval.errors import BackendUnavailable, NotFound, RubricSearchError
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS, EncodedImage
from rubricsearch.retrieval.index import VectorIndex
from rubricsearch.retrieval.packages import Made, Preparation, VisualPackages
from rubricsearch.retrieval.pixel_budget import holding
from rubricsearch.retrieval.qwen.model.prompts import Content

__all__ = ["GROUPS", "PIPELINE_STAGES", "Batch", "BatchProcessor", "BatchResult", "Unit"]
log = logging.getLogger(__name__)
SourceFor = Callable[[JobRecord], Source]
# a set's id -> the embedder of its documents (the set's active embedder version, else the base) and that version's
# id (:data:`BASE`): a set's vectors all come from one embedder, the one that embeds its queries
EmbedderOf = Callable[[str], tuple[Embedder, str]]


class BatchProcessor:
    """Turns a list of claimed items into indexed images; shared by all worker threads."""

    def __init__(
        self,
        catalog: Catalog,
        blobs: BlobStore,
        index: VectorIndex,
        embedder: Embedder,
        *,
        packages: VisualPackages | None = None,
        worker_id: str,
        image_max_bytes: int = DEFAULT_MAX_BYTES,
        image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
        load_threads: int = 4,
        heartbeat_every_s: float = 30.0,
        batch_pixels: int | None = None,
        restage: Restage | None = None,
        embedder_of: EmbedderOf | None = None,
    ) -> None:
        self.catalog, self.blobs, self.index, self.embedder = catalog, blobs, index, embedder
        self.embedder_of: EmbedderOf = embedder_of or (lambda _set_id: (embedder, BASE))
        self.packages = packages if packages is not None else embedder.packages.service
        self.worker_id, self.image_max_bytes, self.image_max_pixels = worker_id, image_max_bytes, image_max_pixels
        self.heartbeat_every_s, self.batch_pixels = heartbeat_every_s, batch_pixels
        self.restage = restage  # where items the pixel bound cuts keep their fetched bytes (the fetch-ahead)
        self.times: StageTimes = PipelineTimes()
        self.seen = Seen()  # what this thread's last prepared batch held (the runner sizes claims by it)
        # URL items are fetched ahead (indexer/jobs/fetchahead.py): what these threads load is at hand
        self._pool = ThreadPoolExecutor(max_workers=max(1, load_threads), thread_name_prefix="ingest-load")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- the batch ----------------------------------------------------------------------------------
    def process(self, items: Sequence[ItemRecord], source_for: SourceFor) -> BatchResult:
        """Process claimed items (of any jobs); raises only for infrastructure failures (then release)."""
        return self.commit(self.sync(self.store(self.embed(self.pack(self.encode(self.prepare(items, source_for)))))))

    def prepare(self, items: Sequence[ItemRecord], source_for: SourceFor) -> Batch:
        """CPU stages: resolve jobs, load and decode (threads), dedup, preprocess for the tower."""
        with self.times.time("prepare"):
            batch = Batch(list(items), self._resolve(items), [time.monotonic()])
            self._load(batch.units, source_for)
            fit(batch, self.batch_pixels, self.catalog, self.worker_id, self.restage)
            self.seen.pixels = [u.decoded.width * u.decoded.height for u in batch.units if u.decoded is not None]
            with self.times.time("dedup"):
                self._dedup(batch.units)
            with self.times.time("preprocess"):
                self._preprocess(batch)
            self._heartbeat(batch)
        return batch

    def encode(self, batch: Batch) -> Batch:
        """GPU: each distinct vision tower once per new image (packages that :meth:`pack` stores)."""
        self._heartbeat(batch)
        with self.times.time("vision"):
            batch.made = self._vision(batch.working(), batch.prepared)
        batch.prepared = None
        return batch

    def pack(self, batch: Batch) -> Batch:
        """The packages :meth:`encode` made, quantised and stored (the LM pass reads them from the store)."""
        with self.times.time("pack"):
            self._keep(batch.working(), batch.made)
        batch.made = None
        return batch

    def embed(self, batch: Batch) -> Batch:
        """GPU: the document embeddings of the batch's new images, from their packages."""
        self._heartbeat(batch)
        with self.times.time("embed"):
            self._embed([u for u in batch.working() if not u.backfill])
        return batch

    def store(self, batch: Batch) -> Batch:
        """Disk: blobs (made durable by :meth:`sync`), then vectors."""
        with self.times.time("store"):
            self._heartbeat(batch)
            new = [u for u in batch.working() if not u.backfill]
            self._store_blobs(new)
            with self.times.time("index"):
                self._upsert(new)
        return batch

    def sync(self, batch: Batch) -> Batch:
        """The package files written, then one filesystem sync that makes the batch's blobs and packages durable
        before the catalog records them (a stage of its own: a sync can take longer than the GPU work of a
        batch, and the next batch's blobs need not wait for it)."""
        with self.times.time("sync"):
            self.packages.store.sync(*self.blobs.sync_roots())  # one syncfs where both share a filesystem
        return batch

    def commit(self, batch: Batch) -> BatchResult:
        """The one catalog commit that makes the batch's progress visible (after its :meth:`sync`)."""
        self._heartbeat(batch)  # it may have waited behind other batches' commits
        with self.times.time("catalog"):
            result = self._commit(batch.units)
        self.times.count(len(batch.units))
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
        futures = [self._pool.submit(self._load_one, u, sources) for u in loaded]
        for u, outcome in zip(loaded, (f.result() for f in futures), strict=True):
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

    def _load_one(self, u: Unit, sources: dict[str, Source | None]) -> EncodedImage | str:
        """The item's bytes, hashed and header-checked; decoding waits for preprocessing (where it runs in
        threads or on the GPU), so a duplicate found by its sha256 is never decoded."""
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
            return EncodedImage(data, max_bytes=self.image_max_bytes, max_pixels=self.image_max_pixels)
        except Exception as exc:
            return describe(exc)
        finally:
            self.times.add("decode", time.perf_counter() - start)

    def _dedup(self, units: list[Unit]) -> None:
        """Within the set: a sha already indexed is a skip; a repeat within the batch follows its first."""
        wanted: dict[str, set[str]] = {}
        for u in units:
            if u.working and not u.backfill:
                wanted.setdefault(u.job.set_id, set()).add(u.sha)
        present: dict[tuple[str, str], ImageRecord] = {}
        with self.catalog.read() as s:
            for set_id, shas in wanted.items():
                ordered = sorted(shas)
                for start in range(0, len(ordered), 500):
                    query = select(Image).where(Image.set_id == set_id, Image.sha256.in_(ordered[start:start + 500]))
                    for row in s.scalars(query):
                        present[(set_id, row.sha256)] = ImageRecord.of(row)
        first: dict[tuple[str, str], Unit] = {}
        for u in units:
            if not u.working or u.backfill:
                continue
            key = (u.job.set_id, u.sha)
            existing = present.get(key)
            if existing is not None and existing.status == ImageStatus.INDEXED:
                u.skip = (f"duplicate of {existing.original_name or existing.sha256[:12]}", existing.id)
            elif key in first:
                u.primary = first[key]
            else:
                first[key] = u
                u.existing = existing

    def _preprocess(self, batch: Batch) -> None:
        """Pixels for the towers, made here (while the GPU runs an earlier batch); failures are per image."""
        units = batch.working()
        if not units:
            return
        images = [u.decoded for u in units if u.decoded is not None]
        try:
            with holding(self.packages.pixel_budget, images, wait_s=math.inf):  # decoded here, then resized
                batch.prepared = self.packages.prepare(images)
        except Exception as exc:  # the vision stage preprocesses (and attributes failures) itself
            log.info("preprocessing ahead failed (%s); leaving it to the vision stage", describe(exc))
            return
        for u in units:
            if u.sha in batch.prepared.errors:
                u.error = describe(batch.prepared.errors[u.sha])

    def _vision(self, units: list[Unit], prepared: Preparation | None) -> Made | None:
        """One pass per distinct tower for the batch; if it fails, image by image to find the culprit (then
        stored at once, and nothing is left for :meth:`_keep`)."""
        if not units:
            return None
        try:
            return self.packages.make([u.decoded for u in units if u.decoded is not None], prepared)
        except Exception as exc:
            log.info("batched vision failed (%s); retrying image by image", describe(exc))
            self._one_by_one(units)
            return None

    def _keep(self, units: list[Unit], made: Made | None) -> None:
        if made is None:
            return
        try:
            built = self.packages.keep(made)
        except Exception as exc:
            log.info("storing the batch's packages failed (%s); retrying image by image", describe(exc))
            self._one_by_one(units)
            return
        for u in units:
            u.packages = built[u.sha]

    def _one_by_one(self, units: list[Unit]) -> None:
        for u in units:
            assert u.decoded is not None
            try:
                u.packages = self.packages.build([u.decoded])[u.sha]
            except Exception as one:
                u.error = describe(one)

    def _embed(self, units: list[Unit]) -> None:
        """Document embeddings (default instruction) from the cached packages, one batched LM pass per set (its
        active embedder version's)."""
        by_set: dict[str, list[Unit]] = {}
        for u in units:
            by_set.setdefault(u.job.set_id, []).append(u)
        for set_id, group in by_set.items():
            self._embed_with(*self.embedder_of(set_id), group)

    def _embed_with(self, embedder: Embedder, version: str, units: list[Unit]) -> None:
        try:
            full: np.ndarray | None = self._embed_full(embedder, units)
        except Exception as exc:
            log.info("batched embedding failed (%s); retrying item by item", describe(exc))
            full = None
        for k, u in enumerate(units):
            try:
                row = self._embed_full(embedder, [u]) if full is None else full[k : k + 1]
                u.vector, u.embedded_by = matryoshka(row, u.dim, embedder.dimension)[0], version
            except Exception as one:
                u.error = describe(one)

    @staticmethod
    def _embed_full(embedder: Embedder, units: list[Unit]) -> np.ndarray:
        contents = [Content(images=[u.decoded]) for u in units if u.decoded is not None]
        return embedder.embed_contents(contents, [None] * len(contents))

    def _store_blobs(self, units: list[Unit]) -> None:
        """Originals into the blob store (after the model accepted them, so rejects leave no blob)."""

        def put(u: Unit) -> None:
            assert u.decoded is not None
            start = time.perf_counter()
            try:
                if self.blobs.put(u.decoded.data, durable=False) != u.sha:  # pragma: no cover - a hashing bug
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
                if payloads := {u.sha: u.payload for u in group if u.payload}:
                    self.index.set_payloads(set_id, payloads)
            except BackendUnavailable:
                raise
            except RubricSearchError as exc:  # e.g. the set's index has another dimension
                for u in group:
                    u.error = describe(exc)

    def _heartbeat(self, batch: Batch) -> None:
        """Keep a slow batch's claims fresh; an item whose claim was taken over is dropped."""
        if time.monotonic() - batch.beat[0] < self.heartbeat_every_s:
            return
        mine = [u.item.id for u in batch.units if not u.lost]
        with self.catalog.write() as s:
            held = set(heartbeat(s, self.worker_id, mine))
        for u in batch.units:
            if u.item.id not in held:
                u.lost = True
        batch.beat[0] = time.monotonic()

    # -- the one commit ------------------------------------------------------------------------------
    def _commit(self, units: list[Unit]) -> BatchResult:
        with self.catalog.write() as s:
            self._follow_activations(s, units)
            return commit_batch(s, units, self.worker_id)

    def _follow_activations(self, s: Session, units: list[Unit]) -> None:
        """Units embedded by another embedder than their set's active one (a version activated or rolled back
        since: its re-embedding covered the references indexed before this commit) are embedded again with the
        active one and upserted in this transaction, which the set's row lock orders after the activation's."""
        by_set: dict[str, list[Unit]] = {}
        for u in units:
            if u.working and not u.backfill and u.vector is not None:
                by_set.setdefault(u.job.set_id, []).append(u)
        for set_id in sorted(by_set):
            try:
                active = locked_active_version(s, set_id, "embedder")
            except NotFound:  # the set was deleted meanwhile: its units are not recorded
                continue
            stale = [u for u in by_set[set_id] if u.embedded_by != active]
            if stale:
                self._embed_with(*self.embedder_of(set_id), stale)
                self._upsert([u for u in stale if u.error is None])
