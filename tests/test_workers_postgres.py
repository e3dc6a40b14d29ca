"""Several ingestion workers on one PostgreSQL catalog: every item is processed exactly once.

FAISS and Qdrant's local mode have one owner process, so the two halves of scale-out are tested apart:
- three worker *threads* in one process, each with its own connection pool and worker id, run the whole
  pipeline (claims, vision, embedding, blobs, catalog) and write vectors through ONE shared FaissIndex;
- three worker *processes* claim from the same catalog (``FOR UPDATE SKIP LOCKED``) and do the
  catalog + blob half end to end: load from the job's source, decode, blob, image row, item outcome.
A Qdrant server (compose) is the shared vector owner of a real multi-process deployment.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.blobs import BlobStore
from rubricsearch.indexer.catalog import Catalog, ImageStatus, ItemState, JobState
from tests.conftest import noise_png

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(300)]
WORKERS = 3


def inputs() -> tuple[list[tuple[str, bytes]], dict[str, bytes], set[str]]:
    """36 uploads (30 unique) and a zip of 6 (2 already uploaded): 42 items, 34 unique images."""
    from rubricsearch.retrieval.images import decode_image

    uploads = [(f"u{i}.png", noise_png(28 + i % 11, 26 + i % 5, seed=7000 + i)) for i in range(30)]
    uploads += [(f"dup{i}.png", uploads[i * 4][1]) for i in range(6)]
    zipped = {f"z/{i}.png": noise_png(44, 20 + i, seed=8000 + i) for i in range(4)}
    zipped.update({"z/again0.png": uploads[1][1], "z/again1.png": uploads[2][1]})
    shas = {decode_image(d).sha256 for d in [d for _, d in uploads] + list(zipped.values())}
    assert len(shas) == 34
    return uploads, zipped, shas


def check_catalog(catalog: Catalog, set_id: str, job_ids: list[str], shas: set[str], workers: set[str]) -> Counter[str]:
    """Jobs succeeded, each item claimed once, one indexed row per unique image; returns items per worker."""
    with catalog.read() as s:
        jobs = [cat.get_job(s, j) for j in job_ids]
        items = [i for j in job_ids for i in cat.list_items(s, j, limit=1000)]
        rows = cat.list_images(s, set_id, limit=1000).items
    assert [j.state for j in jobs] == [JobState.SUCCEEDED] * len(jobs), jobs
    assert all(i.attempts == 1 for i in items), [i for i in items if i.attempts != 1]  # never claimed twice
    assert {i.state for i in items} <= {ItemState.DONE, ItemState.SKIPPED}
    assert {i.claimed_by for i in items} <= workers
    assert sum(j.done for j in jobs) == len(shas)  # each unique image indexed by exactly one item
    assert sorted(r.sha256 for r in rows) == sorted(shas)  # one row each, no duplicates
    assert {r.status for r in rows} == {ImageStatus.INDEXED}
    return Counter(str(i.claimed_by) for i in items)


def test_three_threads_share_one_faiss_owner(postgres_schema_url: str, tiny_embedding_dir: Path,
                                             tmp_path: Path) -> None:
    from rubricsearch.indexer.jobs import IngestionRunner, IngestionService, Staging
    from rubricsearch.retrieval import load_embedder
    from rubricsearch.retrieval.index import make_index
    from rubricsearch.retrieval.packages import PackageStore
    from tests.test_ingestion import zip_of

    uploads, zipped, shas = inputs()
    blobs, staging = BlobStore(tmp_path / "blobs"), Staging(tmp_path / "staging")
    index = make_index("faiss", path=tmp_path / "faiss", autoflush=False)  # the one owner
    store = PackageStore(tmp_path / "packages", storage_dtype="float32")
    embedder: Any = load_embedder(str(tiny_embedding_dir), store=store)  # the local one: its tower runs here
    services = [IngestionService(Catalog.open(postgres_schema_url), blobs, index, staging, embedder=embedder)
                for _ in range(WORKERS)]  # a catalog (engine + pool) per worker, as in separate processes
    try:
        ref = services[0].create_set("shared", embedding_dim=64)
        job_ids = [services[0].create_job_from_uploads(ref.id, uploads).id,
                   services[0].create_job_from_zip(ref.id, zip_of(zipped)).id]
        runners = [IngestionRunner(svc, worker_id=f"thread-{k}", batch_size=3, load_threads=1)
                   for k, svc in enumerate(services)]
        start = threading.Barrier(WORKERS)
        errors: list[BaseException] = []

        def work(runner: IngestionRunner) -> None:
            try:
                start.wait()
                runner.run_until_idle()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(r,)) for r in runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert not errors, errors
        per_worker = check_catalog(services[0].catalog, ref.id, job_ids, shas, {r.worker_id for r in runners})
        print("items per worker thread:", dict(per_worker))
        assert len(per_worker) >= 2  # the claims really were shared out
        assert index.ids(ref.id) == shas and index.count(ref.id) == len(shas)
        assert set(blobs.iter_shas()) == shas
        for r in runners:
            r.processor.close()
    finally:
        for svc in services:
            svc.catalog.dispose()
        index.close()


def _catalog_blob_worker(url: str, root: str, worker: str, go: Any, out: Any) -> None:
    """One worker process without vectors: claim, load from the job's source, decode, blob, row, outcome."""
    from rubricsearch.indexer.jobs import JobSources, Staging
    from rubricsearch.retrieval.images import decode_image

    catalog = Catalog(cat.create_engine_for(url))
    blobs, sources = BlobStore(Path(root) / "blobs"), JobSources(catalog, Staging(Path(root) / "staging"))
    claimed: list[int] = []
    go.wait(60)
    while True:
        with catalog.write() as s:
            items = cat.claim_next_items(s, worker, limit=2)
        if not items:
            break
        claimed += [i.id for i in items]
        for item in items:
            with catalog.read() as s:
                job = cat.get_job(s, item.job_id)
            image = decode_image(sources.get(job).load(item.source_ref))
            blobs.put(image.data)
            with catalog.write() as s:
                row, created = cat.add_image(s, job.set_id, sha256=image.sha256, byte_size=len(image.data),
                                             source=job.kind, original_name=item.source_ref,
                                             status=ImageStatus.INDEXED)
                outcome = ItemState.DONE if created else ItemState.SKIPPED
                cat.complete_item(s, item.id, worker, outcome, image_id=row.id, blob_sha256=image.sha256)
    sources.close_all()
    catalog.dispose()
    out.put((worker, claimed))


def test_three_processes_claim_each_item_once(postgres_schema_url: str, tmp_path: Path) -> None:
    from rubricsearch.indexer.jobs import IngestionService, Staging
    from rubricsearch.retrieval.index import make_index
    from tests.test_ingestion import zip_of

    uploads, zipped, shas = inputs()
    catalog = Catalog.open(postgres_schema_url)
    index = make_index("faiss", path=tmp_path / "faiss")  # only for creating jobs; workers write no vectors
    service = IngestionService(catalog, BlobStore(tmp_path / "blobs"), index, Staging(tmp_path / "staging"))
    try:
        ref = service.create_set("procs", embedding_dim=64)
        job_ids = [service.create_job_from_uploads(ref.id, uploads).id,
                   service.create_job_from_zip(ref.id, zip_of(zipped)).id]
        ctx = multiprocessing.get_context("spawn")
        go, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_catalog_blob_worker, args=(postgres_schema_url, str(tmp_path), f"proc-{k}",
                                                                  go, out)) for k in range(WORKERS)]
        for p in procs:
            p.start()
        go.set()
        results = dict(out.get(timeout=180) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        assert [p.exitcode for p in procs] == [0] * WORKERS
        claims = [i for ids in results.values() for i in ids]
        assert len(claims) == len(set(claims)) == 42  # disjoint, and together every item
        per_worker = check_catalog(catalog, ref.id, job_ids, shas, set(results))
        print("items per worker process:", dict(per_worker))
        assert set(service.blobs.iter_shas()) == shas
    finally:
        index.close()
        catalog.dispose()
