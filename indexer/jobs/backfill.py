"""Backfill: visual packages for references that lack one for a vision tower now in use.

Ingestion builds a package per image for every distinct tower in use at the time. When a data directory
is later served with a model whose tower is new (another reranker, a fine-tuned embedder, changed pixel
settings), or package files were lost, :func:`plan_backfill` finds the indexed images some local tower has
no package of and queues one ``backfill`` job per set. Its items are the images' sha256s; a worker loads
each blob (:class:`BlobSource`), decodes and preprocesses it once and runs only the towers that lack it
(``indexer.jobs.pipeline``), with progress and resume like any ingestion job. Until the job is done a
search still works: the reranker encodes the missing references itself, and the search's provenance
counts them as ``reference`` encodes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial

from sqlalchemy import select

from rubricsearch.indexer.blobs import BlobStore
from rubricsearch.indexer.catalog import Catalog, ImageStatus, JobRecord, JobState, create_job, list_items, list_jobs
from rubricsearch.indexer.catalog.tables import Image
from rubricsearch.indexer.sources.base import Skipped, SourceItem
from rubricsearch.retrieval.packages import VisualPackages

log = logging.getLogger(__name__)
BACKFILL = "backfill"
_PAGE = 5000


class BlobSource:
    """The originals of already-ingested images, by sha256 (a backfill job's source)."""

    kind = BACKFILL

    def __init__(self, blobs: BlobStore, refs: list[str]) -> None:
        self.blobs = blobs
        self.refs = refs

    def __len__(self) -> int:
        return len(self.refs)

    def items(self) -> Iterator[SourceItem]:
        for ref in self.refs:
            yield SourceItem(ref=ref, load=partial(self.blobs.get, ref))

    def load(self, ref: str) -> bytes:
        return self.blobs.get(ref)

    @property
    def skipped(self) -> list[Skipped]:
        return []

    @property
    def skipped_count(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing is held open."""


def plan_backfill(catalog: Catalog, packages: VisualPackages) -> list[JobRecord]:
    """Queue a backfill job per set whose indexed images miss a package of some local tower.

    An image in several sets is queued once. Images already in an active backfill job are not queued
    again, so a restart resumes the job in flight instead of stacking a new one on it.
    """
    towers = packages.local_towers()
    if not towers:
        return []
    queued = _in_active_backfills(catalog)
    todo: dict[str, list[str]] = {}
    seen: set[str] = set()
    for set_id, sha in _indexed(catalog):
        if sha in seen or sha in queued:
            continue
        seen.add(sha)
        if packages.missing(sha):
            todo.setdefault(set_id, []).append(sha)
    jobs: list[JobRecord] = []
    digests = sorted(t.fingerprint.digest() for t in towers)
    for set_id, shas in todo.items():
        with catalog.write() as s:
            jobs.append(create_job(s, set_id, BACKFILL, shas, options={"towers": digests}))
        log.warning("set %s: %d references lack packages of a vision tower in use; backfill job %s queued",
                    set_id, len(shas), jobs[-1].id)
    return jobs


def _indexed(catalog: Catalog) -> Iterator[tuple[str, str]]:
    last = 0
    while True:
        with catalog.read() as s:
            rows = s.execute(
                select(Image.id, Image.set_id, Image.sha256)
                .where(Image.status == ImageStatus.INDEXED.value, Image.id > last)
                .order_by(Image.id).limit(_PAGE)
            ).all()
        if not rows:
            return
        for image_id, set_id, sha in rows:
            last = image_id
            yield set_id, sha


def _in_active_backfills(catalog: Catalog) -> set[str]:
    shas: set[str] = set()
    with catalog.read() as s:
        for job in list_jobs(s, states=(JobState.QUEUED, JobState.RUNNING), limit=100_000):
            if job.kind == BACKFILL:
                shas.update(i.source_ref for i in list_items(s, job.id, limit=10_000_000))
    return shas
