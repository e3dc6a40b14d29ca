"""Bringing the vector index back in line with the catalog, and sweeping what crashes leave behind.

The catalog is the source of truth. After a crash the index can lag it (vectors accepted but not yet
flushed when a FAISS process died) or lead it (a vector upserted for an item whose commit never
happened, or an image deleted from the catalog before its vector). :func:`reconcile_set` re-embeds the
first kind from cached packages (or the stored blob) and deletes the second, and rewrites every payload
(what filters read) whose digest differs from its catalog row's metadata and facets.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rubricsearch.indexer.blobs import BlobStore
from rubricsearch.indexer.catalog import (
    Catalog,
    ImageRecord,
    ImageStatus,
    ItemState,
    JobState,
    delete_packages,
    get_set,
    list_images,
    list_items,
    list_jobs,
    list_sets,
    mark_image_failed,
    unreferenced_shas,
)
from rubricsearch.indexer.jobs.model import describe
from rubricsearch.indexer.jobs.staging import Staging
from rubricsearch.retrieval.embedding.protocol import Embedder, matryoshka
from rubricsearch.retrieval.errors import NotFound
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS, ReferenceImage
from rubricsearch.retrieval.index import VectorIndex
from rubricsearch.retrieval.packages import PackageStore, VisualPackages
from rubricsearch.retrieval.qwen.model.prompts import Content

log = logging.getLogger(__name__)
ACTIVE = (JobState.QUEUED, JobState.RUNNING)
_PAGE = 1000


@dataclass(frozen=True)
class ReconcileReport:
    """What :func:`reconcile_set` found and did; ``deferred`` means extras were left for a later run
    because items of the set are being processed right now (their vectors may precede their rows)."""

    set_id: str
    indexed_rows: int
    index_before: int
    reembedded: int
    removed: int
    failed: dict[str, str] = field(default_factory=dict)
    deferred: bool = False
    payloads_repaired: int = 0

    @property
    def consistent(self) -> bool:
        return not self.deferred and not self.failed


@dataclass(frozen=True)
class SweepReport:
    staging_removed: int = 0
    blob_temps_removed: int = 0
    orphan_blobs_removed: int = 0
    orphan_index_sets: tuple[str, ...] = ()


def all_images(catalog: Catalog, set_id: str) -> list[ImageRecord]:
    rows: list[ImageRecord] = []
    after: int | None = None
    with catalog.read() as s:
        while True:
            page = list_images(s, set_id, limit=_PAGE, after_id=after)
            rows.extend(page.items)
            if page.next_after is None:
                return rows
            after = page.next_after


def claims_open(catalog: Catalog, set_id: str) -> bool:
    """Whether any item of the set's active jobs is claimed (its worker may be between upsert and commit)."""
    with catalog.read() as s:
        for job in list_jobs(s, set_id=set_id, states=ACTIVE, limit=10_000):
            if list_items(s, job.id, states=[ItemState.CLAIMED], limit=1):
                return True
    return False


def reconcile_set(
    catalog: Catalog,
    index: VectorIndex,
    blobs: BlobStore,
    embedder: Embedder,
    set_id: str,
    *,
    packages: VisualPackages | None = None,
    batch_size: int = 16,
    image_max_bytes: int = DEFAULT_MAX_BYTES,
    image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
    documents: Callable[[], Embedder] | None = None,
) -> ReconcileReport:
    """Make the set's index ids equal its indexed catalog rows (one vector per image, none extra). ``documents``:
    the embedder of the set's missing vectors (its active version; default ``embedder``), asked for only when one
    is missing, since a version costs a model load."""
    with catalog.read() as s:
        ref_set = get_set(s, set_id)
    if not index.has_set(set_id):
        index.create_set(set_id, ref_set.embedding_dim or embedder.dimension)
    dim = index.dim(set_id)
    rows = all_images(catalog, set_id)
    ids = index.ids(set_id)
    indexed = [r for r in rows if r.status == ImageStatus.INDEXED]
    missing = [r for r in indexed if r.sha256 not in ids]
    failed: dict[str, str] = {}
    vectors = (documents or (lambda: embedder))() if missing else embedder
    for start in range(0, len(missing), batch_size):
        chunk = missing[start : start + batch_size]
        failed.update(_reembed(index, blobs, vectors, packages or embedder.packages.service, set_id, dim, chunk,
                               image_max_bytes, image_max_pixels))
    if failed:
        with catalog.write() as s:
            for row in missing:
                if row.sha256 in failed:
                    with contextlib.suppress(NotFound):
                        mark_image_failed(s, row.id, f"re-indexing failed: {failed[row.sha256]}")
    repaired = _repair_payloads(index, set_id, [r for r in indexed if r.sha256 in ids])
    known = {r.sha256 for r in rows}
    extras = ids - known
    deferred = bool(extras) and claims_open(catalog, set_id)
    if extras and not deferred:
        # Rows may have been committed since they were listed: only ids still without a row go.
        still = {r.sha256 for r in all_images(catalog, set_id)}
        extras -= still
        index.delete(set_id, sorted(extras))
    index.flush()
    report = ReconcileReport(
        set_id=set_id, indexed_rows=len(indexed), index_before=len(ids), reembedded=len(missing) - len(failed),
        removed=0 if deferred else len(extras), failed=failed, deferred=deferred, payloads_repaired=repaired,
    )
    if missing or extras or repaired:
        log.info("reconciled set %s: %s", set_id, report)
    return report


def payload_digest(payload: Mapping[str, Any]) -> str:
    """A payload's canonical JSON digest: ``1``, ``1.0`` and ``true`` differ, as filters tell them apart."""
    body = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(body.encode()).hexdigest()


def repair_payloads(catalog: Catalog, index: VectorIndex) -> int:
    """Only the payload half of :func:`reconcile_set`, for every set: what a process that reconciles no vectors (no
    embedding model, no workers) still owes filters after a crash. Returns how many payloads were rewritten."""
    with catalog.read() as s:
        set_ids = [r.id for r in list_sets(s)]
    repaired = 0
    for set_id in set_ids:
        if index.has_set(set_id):
            with contextlib.suppress(NotFound):  # deleted meanwhile
                rows = [r for r in all_images(catalog, set_id) if r.status == ImageStatus.INDEXED]
                repaired += _repair_payloads(index, set_id, rows)
    if repaired:
        index.flush()
        log.info("repaired %d index payloads that differed from the catalog", repaired)
    return repaired


def _repair_payloads(index: VectorIndex, set_id: str, rows: list[ImageRecord]) -> int:
    """Give every indexed row the payload its catalog row holds where the index's differs: a metadata change
    commits in the catalog first, and a crash before the index's next save would otherwise lose it from filters
    for good. Returns how many payloads were rewritten."""
    repaired = 0
    for start in range(0, len(rows), _PAGE):
        chunk = rows[start : start + _PAGE]
        stored = index.payloads(set_id, [r.sha256 for r in chunk])
        drift = {r.sha256: r.payload for r in chunk
                 if r.sha256 in stored and payload_digest(stored[r.sha256]) != payload_digest(r.payload)}
        if drift:
            index.set_payloads(set_id, drift)
            repaired += len(drift)
    return repaired


def _reembed(
    index: VectorIndex,
    blobs: BlobStore,
    embedder: Embedder,
    packages: VisualPackages,
    set_id: str,
    dim: int,
    rows: list[ImageRecord],
    max_bytes: int,
    max_pixels: int,
) -> dict[str, str]:
    """Vectors for catalog rows the index lacks: from the cached package, else decoded from the blob
    (packages of every local tower are made then, as ingestion makes them)."""
    failed: dict[str, str] = {}
    images = {r.sha256: ReferenceImage(r.sha256, partial(blobs.get, r.sha256), max_bytes=max_bytes,
                                       max_pixels=max_pixels) for r in rows}
    try:
        packages.build(list(images.values()))
    except Exception:  # find which image is the problem
        for sha, image in images.items():
            try:
                packages.build([image])
            except Exception as exc:
                failed[sha] = describe(exc)
    good = [sha for sha in images if sha not in failed]
    if good:
        full = embedder.embed_contents([Content(images=[images[sha]]) for sha in good], [None] * len(good))
        index.upsert(set_id, good, matryoshka(full, dim, embedder.dimension))
        metadata = {r.sha256: r.payload for r in rows if r.sha256 in images and r.sha256 not in failed and r.payload}
        if metadata:  # the payloads filters read, restored from the catalog
            index.set_payloads(set_id, metadata)
    return failed


def sweep(
    catalog: Catalog,
    staging: Staging,
    blobs: BlobStore,
    index: VectorIndex,
    packages: PackageStore | None,
    *,
    grace_s: float = 600.0,
    orphan_blobs: bool = True,
) -> SweepReport:
    """Remove what no committed state refers to: staging of finished or never-created jobs, blob temp
    files, blobs no image references (with their packages) and index sets of deleted sets.

    ``grace_s`` spares anything younger, so work in flight in another process is never swept.
    """
    staged = staging.job_ids()
    active: set[str] = set()
    with catalog.read() as s:
        for job in list_jobs(s, states=ACTIVE, limit=100_000):
            active.add(job.id)
        set_ids = {r.id for r in list_sets(s)}
    staging_removed = staging.sweep(lambda job_id: job_id in active, grace_s=grace_s)
    temps = blobs.sweep_temp(older_than_s=grace_s)
    removed = _sweep_blobs(catalog, blobs, packages, grace_s) if orphan_blobs else 0
    orphan_sets = tuple(sorted(set(index.list_sets()) - set_ids))
    for set_id in orphan_sets:
        with contextlib.suppress(NotFound):
            index.drop_set(set_id)
    if staged and staging_removed:
        log.info("swept %d staging directories", staging_removed)
    return SweepReport(staging_removed, temps, removed, orphan_sets)


def _sweep_blobs(catalog: Catalog, blobs: BlobStore, packages: PackageStore | None, grace_s: float) -> int:
    cutoff = time.time() - grace_s
    removed = 0
    shas = list(blobs.iter_shas())
    for start in range(0, len(shas), _PAGE):
        with catalog.read() as s:
            orphans = unreferenced_shas(s, shas[start : start + _PAGE])
        for sha in orphans:
            with contextlib.suppress(FileNotFoundError):
                if blobs.path(sha).stat().st_mtime > cutoff:
                    continue  # maybe an item in flight: its row is not committed yet
            with catalog.write() as s:
                if unreferenced_shas(s, [sha]):
                    delete_packages(s, sha)
                else:
                    continue
            blobs.delete(sha)
            if packages is not None:
                packages.delete_image(sha)
            removed += 1
    return removed
