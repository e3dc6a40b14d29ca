"""Ingestion jobs end to end on CPU with the tiny checkpoint: uploads, zips, URLs, hostile inputs,
dedup, cancel, deletes, reconcile and resume. Network traffic goes to 127.0.0.1 only."""

from __future__ import annotations

import inspect
import io
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.catalog import ImageStatus, ItemState, JobState
from rubricsearch.indexer.jobs import IngestionRunner, IngestionService
from rubricsearch.indexer.sources import NetGuard, UrlFetcher
from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import PackageStore
from tests import fixtures_images as fx
from tests.conftest import image_server, noise_png

pytestmark = pytest.mark.timeout(120)


def index_vectors(service: IngestionService, set_id: str) -> dict[str, np.ndarray]:
    """Every stored vector of a FAISS set, by sha (reads the index's own storage)."""
    index: Any = service.index
    with index._open_set(set_id) as entry:
        return {sha: entry.index.reconstruct(slot) for sha, slot in entry.where.items()}


def catalog_shas(service: IngestionService, set_id: str, status: ImageStatus | None = None) -> list[str]:
    with service.catalog.read() as s:
        page = cat.list_images(s, set_id, status=status, limit=1000)
    return [r.sha256 for r in page.items]


def items(service: IngestionService, job_id: str) -> list[cat.ItemRecord]:
    return service.job_items(job_id, limit=1000)


@pytest.fixture
def make_service(tiny_embedding_dir: Path, tmp_path: Path) -> Iterator[Callable[..., IngestionService]]:
    made: list[IngestionService] = []

    def make(name: str = "data", **options: Any) -> IngestionService:
        store = PackageStore(tmp_path / name / "packages", storage_dtype="float32")
        embedder = load_embedder(str(tiny_embedding_dir), store=store)
        service = IngestionService.open_local(tmp_path / name, embedder=embedder, **options)
        made.append(service)
        return service

    yield make
    for service in made:
        service.close()
        service.index.close()
        service.catalog.dispose()


def runner(service: IngestionService, **options: Any) -> IngestionRunner:
    options.setdefault("batch_size", 8)
    options.setdefault("load_threads", 2)
    return IngestionRunner(service, worker_id="test-worker", **options)


def zip_of(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in entries.items():
            zf.writestr(zipfile.ZipInfo(name), data)
    return buf.getvalue()


def test_end_to_end_uploads_and_zip(make_service, tiny_embedding_dir: Path) -> None:
    service = make_service()
    ref_set = service.create_set("animals", embedding_dim=64)
    uploads = [(f"up-{i}.png", noise_png(40 + 7 * i, 90 - 3 * i, seed=i)) for i in range(18)]
    uploads += [("red.jpg", fx.jpeg(64, 48, fx.RED)), ("green.webp", fx.webp(50, 50, fx.GREEN))]
    uploads.append(("again.png", uploads[0][1]))  # the same image under another name, in the same job
    zipped = {f"zoo/z-{i}.png": noise_png(60, 30 + 5 * i, seed=100 + i) for i in range(10)}
    zipped["zoo/readme.txt"] = b"not an image"
    up_job = service.create_job_from_uploads(ref_set.id, uploads)
    zip_job = service.create_job_from_zip(ref_set.id, zip_of(zipped), name="zoo.zip")
    assert (up_job.total, zip_job.total) == (21, 10)
    assert zip_job.options["source_skipped"] == 1 and zip_job.options["archive_name"] == "zoo.zip"
    assert service.staging.exists(up_job.id) and service.staging.exists(zip_job.id)

    work = runner(service)
    assert work.run_until_idle() == 31
    up_job, zip_job = service.get_job(up_job.id), service.get_job(zip_job.id)
    assert (up_job.state, up_job.done, up_job.skipped, up_job.failed) == (JobState.SUCCEEDED, 20, 1, 0)
    assert (zip_job.state, zip_job.done) == (JobState.SUCCEEDED, 10)
    again = items(service, up_job.id)[-1]
    assert (again.state, again.error) == (ItemState.SKIPPED, "duplicate of up-0.png")
    assert not service.staging.exists(up_job.id) and not service.staging.exists(zip_job.id)

    all_bytes = [d for _, d in uploads[:-1]] + list(v for k, v in zipped.items() if k.endswith(".png"))
    shas = {decode_image(d).sha256 for d in all_bytes}
    assert len(shas) == 30
    assert set(catalog_shas(service, ref_set.id, ImageStatus.INDEXED)) == shas
    assert service.index.ids(ref_set.id) == shas and service.index.count(ref_set.id) == 30
    assert set(service.blobs.iter_shas()) == shas
    assert service.embedder.stats["vision_encodes"] == 30  # the tower ran once per image,
    assert service.embedder.runtime.vision.stats()["tower_batches"] <= 4  # batched across each claimed batch
    with service.catalog.read() as s:
        assert len(cat.list_packages(s)) == 30

    # Document vectors equal a direct embed with the default instruction (fresh model, no cache).
    direct = load_embedder(str(tiny_embedding_dir), store=PackageStore(storage_dtype="float32"))
    expected = direct.embed([{"image": d} for d in all_bytes], dimensions=64)
    stored = index_vectors(service, ref_set.id)
    for data, vec in zip(all_bytes, expected, strict=True):
        np.testing.assert_allclose(stored[decode_image(data).sha256], vec, atol=1e-5, rtol=0)

    # Re-adding the same images is a reported no-op: every item skipped, nothing re-encoded.
    redo = service.create_job_from_uploads(ref_set.id, uploads[:5])
    work.run_until_idle()
    redo = service.get_job(redo.id)
    assert (redo.state, redo.done, redo.skipped) == (JobState.SUCCEEDED, 0, 5)
    assert [i.error for i in items(service, redo.id)][:2] == ["duplicate of up-0.png", "duplicate of up-1.png"]
    assert service.embedder.stats["vision_encodes"] == 30 and service.index.count(ref_set.id) == 30


def test_hostile_inputs_fail_alone(make_service) -> None:
    service = make_service()
    ref_set = service.create_set("hostile")
    files: list[tuple[str, bytes]] = []
    for name, fn in inspect.getmembers(fx, inspect.isfunction):
        if fn.__module__ != fx.__name__ or name.startswith("_") or name == "solid":
            continue
        value = fn()
        files.append(value if isinstance(value, tuple) else (f"{name}.bin", value))
    expected_ok = set()
    for name, data in files:
        try:
            decode_image(data)
            expected_ok.add(name)
        except InvalidInput:
            pass
    assert {"zero_bytes.bin", "truncated_jpeg.bin", "png_huge_header.bin", "non_image_bytes.bin"}.isdisjoint(
        expected_ok)
    job = service.create_job_from_uploads(ref_set.id, files)
    good = noise_png(32, 32, seed=7)
    hostile_zip = zip_of({"../escape.png": good, "/etc/abs.png": good, "ok/fine.png": noise_png(30, 20, seed=8)})
    zip_job = service.create_job_from_zip(ref_set.id, hostile_zip)
    runner(service).run_until_idle()

    outcome = {i.source_ref: i for i in items(service, job.id)}
    for name, _ in files:
        item = outcome[name]
        if name in expected_ok:
            assert item.state in (ItemState.DONE, ItemState.SKIPPED), (name, item.error)
        else:
            assert item.state == ItemState.FAILED, name
            assert item.error and item.error.split(":")[0] in ("invalid_image", "payload_too_large"), item.error
    assert outcome["zero_bytes.bin"].error == "invalid_image: zero_bytes.bin is empty (0 bytes)"
    assert "10000000000 pixels" in (outcome["png_huge_header.bin"].error or "")
    zipped = {i.source_ref: i for i in items(service, zip_job.id)}
    assert zipped["../escape.png"].state == ItemState.FAILED
    assert "'..'" in (zipped["../escape.png"].error or "")
    assert "absolute path" in (zipped["/etc/abs.png"].error or "")
    assert zipped["ok/fine.png"].state == ItemState.DONE
    job = service.get_job(job.id)
    assert job.state == JobState.COMPLETED_WITH_ERRORS and job.done + job.skipped == len(expected_ok)
    indexed = catalog_shas(service, ref_set.id, ImageStatus.INDEXED)
    assert service.index.ids(ref_set.id) == set(indexed) and len(indexed) == job.done + 1


def test_cancel_mid_job(make_service) -> None:
    service = make_service()
    ref_set = service.create_set("cancel-me")
    job = service.create_job_from_uploads(ref_set.id, [(f"{i}.png", noise_png(24, 24, seed=i)) for i in range(12)])
    work = runner(service, batch_size=3)
    assert work.run_once() is not None
    job = service.cancel(job.id)
    assert job.state == JobState.CANCELLED  # nothing was in flight, so it is cancelled at once
    assert work.run_until_idle(job_id=job.id) == 0
    job = service.get_job(job.id)
    assert (job.state, job.done) == (JobState.CANCELLED, 3)
    states = [i.state for i in items(service, job.id)]
    assert states == [ItemState.DONE] * 3 + [ItemState.CANCELLED] * 9
    assert service.index.count(ref_set.id) == 3 == len(catalog_shas(service, ref_set.id))
    assert not service.staging.exists(job.id)


def test_cancel_while_batch_in_flight(make_service) -> None:
    """A cancel that lands while a batch is being processed: the batch completes, the rest is cancelled."""
    service = make_service()
    ref_set = service.create_set("cancel-in-flight")
    job = service.create_job_from_uploads(ref_set.id, [(f"{i}.png", noise_png(20, 20, seed=i)) for i in range(6)])
    work = runner(service, batch_size=2)
    original = work.processor.process

    def cancel_then_process(claimed: Any, source_for: Any) -> Any:
        service.cancel(job.id)
        return original(claimed, source_for)

    work.processor.process = cancel_then_process  # type: ignore[method-assign]
    work.run_once()
    job = service.get_job(job.id)
    assert (job.state, job.done, job.total) == (JobState.CANCELLED, 2, 6)


def test_delete_image_and_set(make_service) -> None:
    service = make_service()
    a = service.create_set("a")
    b = service.create_set("b")
    shared, only_a, only_b = noise_png(30, 30, seed=1), noise_png(31, 30, seed=2), noise_png(32, 30, seed=3)
    service.create_job_from_uploads(a.id, [("shared.png", shared), ("only_a.png", only_a)])
    service.create_job_from_uploads(b.id, [("shared.png", shared), ("only_b.png", only_b)])
    runner(service).run_until_idle()
    sha = {n: decode_image(d).sha256 for n, d in (("shared", shared), ("a", only_a), ("b", only_b))}
    store = service.packages.store if service.packages is not None else None
    assert store is not None
    fingerprint = service.embedder.packages.fingerprint

    with service.catalog.read() as s:
        image_a = cat.find_image(s, a.id, sha["a"])
        shared_a = cat.find_image(s, a.id, sha["shared"])
    assert image_a is not None and shared_a is not None
    service.delete_image(a.id, image_a.id)
    assert sha["a"] not in service.index.ids(a.id) and not service.blobs.exists(sha["a"])
    assert not store.contains(sha["a"], fingerprint)
    service.delete_image(a.id, shared_a.id)  # still used by set b: blob and package stay
    assert service.index.ids(a.id) == set() and service.blobs.exists(sha["shared"])
    assert store.contains(sha["shared"], fingerprint)
    with service.catalog.read() as s:
        assert cat.get_package(s, sha["a"], fingerprint.digest()) is None
        assert cat.get_package(s, sha["shared"], fingerprint.digest()) is not None

    deleted = service.delete_set(b.id)
    assert (deleted.images, deleted.blobs_removed) == (2, 2)
    assert not service.index.has_set(b.id)
    assert not any(service.blobs.exists(sha[k]) for k in ("shared", "b"))
    assert not any(store.contains(sha[k], fingerprint) for k in ("shared", "b"))
    with service.catalog.read() as s:
        assert cat.list_packages(s) == [] and [r.id for r in cat.list_sets(s)] == [a.id]
    assert list(service.blobs.iter_shas()) == [] and service.staging.job_ids() == []


def test_url_import_with_a_background_worker(make_service) -> None:
    routes = {f"/img/{i}.png": (200, noise_png(30 + i, 30, seed=50 + i)) for i in range(3)}
    routes["/text"] = (200, b"<html>no image here</html>")
    with (image_server(lambda path: routes.get(path, (404, b"missing"))) as base,
          UrlFetcher(NetGuard(allow_loopback=True)) as fetcher):
        service = make_service(url_fetcher=fetcher)
        ref_set = service.create_set("from-urls")
        work = runner(service, poll_interval_s=0.05)
        work.recover()
        work.start()
        try:
            urls = [f"{base}/img/{i}.png" for i in range(3)] + [f"{base}/gone", f"{base}/text", f"{base}/img/0.png"]
            job = service.create_job_from_urls(ref_set.id, urls)
            assert job.total == 5 and job.options["source_skipped"] == 1  # the repeated URL
            seen = list(service.watch(job.id, interval_s=0.05, timeout_s=60))
        finally:
            work.close()
    job = seen[-1]
    assert (job.state, job.done, job.failed) == (JobState.COMPLETED_WITH_ERRORS, 3, 2)
    errors = {i.source_ref.rsplit("/", 1)[1]: i.error for i in items(service, job.id) if i.error}
    assert errors["gone"] == f"not_found: {base}/gone: the server answered 404"
    assert (errors["text"] or "").startswith("invalid_image: not an image")
    assert service.index.count(ref_set.id) == 3
    with service.catalog.read() as s:
        image = cat.list_images(s, ref_set.id, limit=1).items[0]
    assert image.source == "url" and image.source_detail.startswith(base)


def test_reconcile_repairs_the_index_without_the_vision_tower(make_service) -> None:
    service = make_service()
    ref_set = service.create_set("drift")
    images = [noise_png(26, 26 + i, seed=200 + i) for i in range(4)]
    service.create_job_from_uploads(ref_set.id, [(f"{i}.png", d) for i, d in enumerate(images)])
    runner(service).run_until_idle()
    before = index_vectors(service, ref_set.id)
    lost = decode_image(images[2]).sha256
    stray = "f" * 64
    service.index.delete(ref_set.id, [lost])
    service.index.upsert(ref_set.id, [stray], np.eye(1, service.index.dim(ref_set.id), dtype=np.float32))
    encodes = service.embedder.stats["vision_encodes"]
    report = service.reconcile(ref_set.id)
    assert (report.reembedded, report.removed, report.consistent) == (1, 1, True)
    assert service.embedder.stats["vision_encodes"] == encodes  # from the cached package
    after = index_vectors(service, ref_set.id)
    assert set(after) == set(before)
    np.testing.assert_allclose(after[lost], before[lost], atol=1e-6)


def test_restart_takes_back_its_own_claims_and_sweeps(make_service, tmp_path: Path) -> None:
    service = make_service()
    ref_set = service.create_set("resume")
    job = service.create_job_from_uploads(ref_set.id, [(f"{i}.png", noise_png(22, 22, seed=300 + i))
                                                       for i in range(5)])
    with service.catalog.write() as s:  # this worker claimed three items, another one two; both died
        cat.claim_next_items(s, "test-worker", limit=3)
        cat.claim_next_items(s, "dead-worker", limit=2)
    (service.staging.root / ".tmp-deadbeef-1234").mkdir()  # a job that was being staged
    (service.blobs.root / "tmp" / "x.part").write_bytes(b"half a blob")
    work = runner(service, temp_grace_s=0, stale_after_s=3600)
    report = work.recover()
    assert (report.released, report.abandoned) == (3, 0)
    assert report.sweep.staging_removed == 1 and report.sweep.blob_temps_removed == 1
    assert work.run_until_idle() == 3  # the other worker's claims are not stale yet
    assert service.get_job(job.id).state == JobState.RUNNING
    assert runner(service, stale_after_s=0).run_until_idle() == 2  # now they are taken over
    assert service.get_job(job.id).state == JobState.SUCCEEDED
    assert service.index.count(ref_set.id) == 5


def test_poison_item_is_abandoned_after_max_attempts(make_service) -> None:
    service = make_service()
    ref_set = service.create_set("poison")
    job = service.create_job_from_uploads(ref_set.id, [("p.png", noise_png(20, 20, seed=9))])
    for attempt in (1, 2, 3):  # the worker claims it and dies, three times
        with service.catalog.write() as s:
            (item,) = cat.claim_next_items(s, "test-worker", limit=1)
        assert item.attempts == attempt
        report = runner(service).recover(reconcile=False)
    assert (report.released, report.abandoned) == (0, 1)
    (item,) = items(service, job.id)
    assert item.state == ItemState.FAILED and (item.error or "").startswith("abandoned")
    assert service.get_job(job.id).state == JobState.FAILED


def test_refused_sources_create_no_job(make_service, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    (root / "pics").mkdir(parents=True)
    (root / "pics" / "a.png").write_bytes(noise_png(20, 20, seed=1))
    service = make_service(folder_root=root)
    ref_set = service.create_set("refusals")
    with pytest.raises(InvalidInput):
        service.create_job_from_zip(ref_set.id, b"this is not a zip")
    from rubricsearch.retrieval.errors import Forbidden

    with pytest.raises(Forbidden):
        service.create_job_from_folder(ref_set.id, outside)
    assert service.list_jobs(set_id=ref_set.id) == [] and service.staging.job_ids() == []
    assert list(service.staging.root.iterdir()) == []
    job = service.create_job_from_folder(ref_set.id, "pics")
    runner(service).run_until_idle()
    assert service.get_job(job.id).state == JobState.SUCCEEDED
    with service.catalog.read() as s:
        assert cat.list_images(s, ref_set.id).items[0].source_detail == "pics/a.png"
