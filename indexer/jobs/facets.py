"""The facet job: every reference's attribute facets, computed from its cached packages, with progress and resume.

A job's items are the sha256s of the set's indexed images whose facets are out of date with its schema; it
lives in the catalog's job tables like ingestion and backfill (so it shows progress, can be cancelled, and
resumes after a restart: starting facets for a set with a facet job in flight continues that job). Each
batch recomputes, per image, only the attributes whose definition changed (their digest), through
:func:`rerank.facets.judge_values` (language-model passes over cached packages, no vision encode), then
writes the image's facets and its index payload in one catalog transaction. A set deleted under a running
job ends it quietly: its items are gone with the set.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rubricsearch.indexer.catalog import (
    Catalog,
    ItemRecord,
    ItemState,
    JobRecord,
    JobState,
    claim_next_items,
    complete_item,
    create_job,
    get_job,
    is_cancel_requested,
    list_items,
    list_jobs,
    release_items,
)
from rubricsearch.indexer.catalog.facets import (
    FACETS,
    Attribute,
    FacetSchema,
    get_schema,
    stale_attributes,
    stale_images,
    write_facets,
)
from rubricsearch.indexer.catalog.records import ImageRecord
from rubricsearch.indexer.catalog.tables import Image
from rubricsearch.indexer.jobs.model import describe
from rubricsearch.rerank.facets import judge_values, packaged_reference
from rubricsearch.rerank.protocol import Reranker
from rubricsearch.retrieval.errors import Conflict, NotFound
from rubricsearch.retrieval.index import VectorIndex
from rubricsearch.retrieval.packages import Usage

log = logging.getLogger(__name__)


def compute_facets(reranker: Reranker, attributes: Sequence[Attribute], shas: Sequence[str], *,
                   usage: Usage | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """``{sha: {attr: {"value", "p", "probs", "digest"}}}`` from the references' cached packages."""
    images = [packaged_reference(sha) for sha in shas]
    judged = judge_values(reranker, images, [a.statements() for a in attributes], usage=usage)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for sha, per_attr in zip(shas, judged, strict=True):
        facets: dict[str, dict[str, Any]] = {}
        for attr, probs in zip(attributes, per_attr, strict=True):
            best = max(range(len(probs)), key=probs.__getitem__)
            facets[attr.name] = {"value": attr.values[best], "p": round(probs[best], 6),
                                 "probs": {v: round(p, 6) for v, p in zip(attr.values, probs, strict=True)},
                                 "digest": attr.digest}
        out[sha] = facets
    return out


class FacetJobs:
    """Start, run and resume facet jobs for a catalog, an index and a reranker whose packages are cached."""

    def __init__(self, catalog: Catalog, index: VectorIndex, reranker: Reranker, *, worker_id: str,
                 batch_size: int = 8) -> None:
        self.catalog, self.index, self.reranker = catalog, index, reranker
        self.worker_id = f"{worker_id}:facets"
        self.batch_size = batch_size
        self.usage = Usage()  # every facet pass's vision encodes: the promise is that this stays 0
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def start(self, set_id: str) -> JobRecord:
        """The set's facet job in flight, or a new one over the images whose facets are out of date.

        Resuming a job no thread of this process works on hands back the items this worker held when it
        stopped (a crash), so they are computed at once rather than after their claims go stale."""
        with self.catalog.write() as s:
            for job in list_jobs(s, set_id=set_id, states=(JobState.QUEUED, JobState.RUNNING), limit=1000):
                if job.kind == FACETS:
                    alive = self._threads.get(job.id)
                    if alive is None or not alive.is_alive():
                        held = list_items(s, job.id, states=(ItemState.CLAIMED,), limit=10_000_000)
                        release_items(s, self.worker_id, [i.id for i in held])
                    return job
            schema = get_schema(s, set_id)
            return create_job(s, set_id, FACETS, stale_images(s, set_id), options={"schema_version": schema.version})

    def start_in_background(self, set_id: str, on_end: Callable[[JobRecord | None], None] | None = None) -> JobRecord:
        """:meth:`start`, then :meth:`run` on a thread of its own (one per job)."""
        job = self.start(set_id)
        with self._lock:
            alive = self._threads.get(job.id)
            if job.state in (JobState.QUEUED, JobState.RUNNING) and (alive is None or not alive.is_alive()):
                def work() -> None:
                    ended = self.run(job.id)
                    if on_end is not None:
                        on_end(ended)

                thread = threading.Thread(target=work, name=f"facets-{job.id}", daemon=True)
                self._threads[job.id] = thread
                thread.start()
        return job

    def follow_up(self, ended: JobRecord) -> None:
        """After an ingestion job: facets for the set's new references, when the set has a schema."""
        if ended.kind == FACETS or not ended.done:
            return
        with self.catalog.read() as s:
            try:
                if not get_schema(s, ended.set_id).attributes:
                    return
            except NotFound:  # the set was deleted meanwhile
                return
        self.start_in_background(ended.set_id)

    def join(self, timeout_s: float | None = None) -> None:
        for thread in list(self._threads.values()):
            thread.join(timeout_s)

    def stop(self, timeout_s: float | None = None) -> None:
        """Let running jobs finish their batch and stop (they resume at the next :meth:`start`)."""
        self._stopping.set()
        self.join(timeout_s)

    def run(self, job_id: str) -> JobRecord | None:
        """Work a job until no item is left; ``None`` when its set (and so the job) was deleted meanwhile."""
        try:
            while not self._stopping.is_set():
                with self.catalog.write() as s:
                    if is_cancel_requested(s, job_id):
                        claim_next_items(s, self.worker_id, job_id=job_id, limit=1)  # settles the cancel
                        return get_job(s, job_id)
                    items = claim_next_items(s, self.worker_id, job_id=job_id, limit=self.batch_size)
                    job = get_job(s, job_id)
                if not items:
                    return job
                self._batch(job.set_id, items)
            with self.catalog.read() as s:
                return get_job(s, job_id)
        except (NotFound, Conflict) as exc:  # the set was deleted: its jobs and images went with it
            log.info("facet job %s ended: %s", job_id, exc)
            return None

    def _batch(self, set_id: str, items: Sequence[ItemRecord]) -> None:
        with self.catalog.read() as s:
            schema = get_schema(s, set_id)
            rows = {i.source_ref: s.query(Image.facets).filter(Image.set_id == set_id,
                                                               Image.sha256 == i.source_ref).scalar()
                    for i in items}
        groups: dict[tuple[str, ...], list[ItemRecord]] = {}
        for item in items:
            stale = stale_attributes(schema, dict(rows.get(item.source_ref) or {}))
            groups.setdefault(tuple(a.name for a in stale), []).append(item)
        for names, group in groups.items():
            try:
                results = self._compute(schema, names, group)
            except Exception:  # find which reference is the problem, keep the others
                results = {}
                for item in group:
                    try:
                        results.update(self._compute(schema, names, [item]))
                    except Exception as exc:
                        results[item.source_ref] = exc
            self._commit(set_id, schema, group, results)

    def _compute(self, schema: FacetSchema, names: Sequence[str],
                 items: Sequence[ItemRecord]) -> dict[str, Any]:
        attrs = [a for a in schema.attributes if a.name in names]
        return compute_facets(self.reranker, attrs, [i.source_ref for i in items], usage=self.usage)

    def _commit(self, set_id: str, schema: FacetSchema, items: Sequence[ItemRecord], results: dict[str, Any]) -> None:
        with self.catalog.write() as s:
            payloads: dict[str, dict[str, Any]] = {}
            for item in items:
                result = results[item.source_ref]
                if isinstance(result, Exception):
                    complete_item(s, item.id, self.worker_id, ItemState.FAILED, error=describe(result))
                    continue
                row = write_facets(s, set_id, item.source_ref, schema, result)
                if row is None:
                    complete_item(s, item.id, self.worker_id, ItemState.SKIPPED, error="the image was deleted")
                    continue
                payloads[item.source_ref] = ImageRecord.of(row).payload
                complete_item(s, item.id, self.worker_id, ItemState.DONE, image_id=row.id)
            if payloads and self.index.has_set(set_id):  # before the commit: a failure leaves both as they were
                self.index.set_payloads(set_id, payloads)
