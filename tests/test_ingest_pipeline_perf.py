"""Correctness of the fast ingestion paths: write-behind packages, preprocessing ahead of the tower (bit-identical
pixels and packages), grouped tower attention, the batched catalog commit (same rows as item by item), overlapped
batches (failures hand every claim back); SIGKILL with all of it on is in test_ingest_pipeline_crash.py. No timing
assertions: bench/ingest_throughput.py measures speed.
"""

from __future__ import annotations

import gc
import io
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.timeout(300)


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# -- write-behind package store --------------------------------------------------------------------------
def _pkgs(n: int, start: int = 0) -> list[Any]:
    from retrieval.packages import Fingerprint, VisualPackage

    fp = Fingerprint(tower="t" * 64, min_pixels=4096, max_pixels=1843200, patch_size=16, merge_size=2,
                     temporal_patch_size=2, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, resize="test")
    out = []
    for seed in range(start, start + n):
        g = torch.Generator().manual_seed(seed)
        out.append(VisualPackage(f"{seed:064x}", fp, (1, 4, 8), torch.randn(8, 32, generator=g),
                                 torch.randn(2, 8, 32, generator=g)))
    return out


def test_write_behind_serves_at_once_and_publishes_atomically(tmp_path: Path) -> None:
    from retrieval.packages import PackageStore

    store = PackageStore(tmp_path, storage_dtype="float32", memory_bytes=0, write_behind=True, writer_threads=2)
    pkgs = _pkgs(40)
    for p in pkgs:
        store.put(p)
    for p in pkgs:  # no memory tier: served from the write queue or, once written, from disk
        got = store.get(p.image_sha256, p.fingerprint)
        assert got is not None and torch.equal(got.embeds, p.embeds) and torch.equal(got.deepstack, p.deepstack)
    assert store.flush(timeout=60)
    assert store.stats()["pending_writes"] == 0 and store.stats()["write_errors"] == 0
    assert not list(tmp_path.rglob("*.tmp"))
    fresh = PackageStore(tmp_path, storage_dtype="float32")
    for p in pkgs:
        got = fresh.get(p.image_sha256, p.fingerprint)
        assert got is not None and torch.equal(got.deepstack, p.deepstack) and got.grid_thw == (1, 4, 8)
    store.close()


def test_write_behind_delete_never_resurrects_a_file(tmp_path: Path) -> None:
    from retrieval.packages import PackageStore

    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=1)
    pkgs = _pkgs(30, start=100)
    for p in pkgs:
        store.put(p)
        if p.image_sha256.endswith(("0", "5")):
            store.delete_image(p.image_sha256)  # queued, being written, or written: gone either way
    store.flush(timeout=60)
    on_disk = {f.name.split(".")[0] for f in tmp_path.rglob("*.safetensors")}
    deleted = {p.image_sha256 for p in pkgs if p.image_sha256.endswith(("0", "5"))}
    assert deleted and on_disk == {p.image_sha256 for p in pkgs} - deleted
    assert all(store.get(sha, pkgs[0].fingerprint) is None for sha in deleted)
    store.close()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float32"])
def test_write_behind_batches_are_written_as_groups(tmp_path: Path, dtype: str) -> None:
    """put_many queues a tower batch as one group: every file holds exactly what the store serves, and a
    package deleted while its group waits is dropped alone."""
    from retrieval.packages import PackageStore

    store = PackageStore(tmp_path, storage_dtype=dtype, write_behind=True, writer_threads=1)  # type: ignore[arg-type]
    batches = [_pkgs(12, start=300), _pkgs(12, start=400)]
    for batch in batches:
        store.put_many(batch)
    gone = batches[1][3].image_sha256
    store.delete_image(gone)
    assert store.flush(timeout=60) and store.stats()["write_errors"] == 0
    fresh = PackageStore(tmp_path, storage_dtype=dtype)  # type: ignore[arg-type]
    for p in (p for batch in batches for p in batch):
        hot, cold = store.get(p.image_sha256, p.fingerprint), fresh.get(p.image_sha256, p.fingerprint)
        if p.image_sha256 == gone:
            assert hot is None and cold is None
            continue
        assert hot is not None and cold is not None
        assert torch.equal(hot.embeds, cold.embeds) and torch.equal(hot.deepstack, cold.deepstack)
    assert fresh.stats()["disk_packages"] == 23
    hot = cold = None  # (float32 packages come back as the stored tensors themselves)
    held = [weakref.ref(t) for one in store._memory.values() for t in one.tensors().values()]
    for p in (p for batch in batches for p in batch):
        store.delete_image(p.image_sha256)
    gc.collect()
    assert held and not [r for r in held if r() is not None]  # an idle writer keeps no batch alive
    store.close()


def test_write_behind_a_failed_copy_loses_only_its_package(tmp_path: Path, monkeypatch: Any) -> None:
    """A batch whose copy to the host fails is copied package by package; one that fails again loses its file
    alone (an error counted; it is still served from memory)."""
    from retrieval.packages import PackageStore
    from retrieval.packages.storage_form import Joint
    from retrieval.packages.writer import WriteBehind

    pkgs = _pkgs(6, start=500)
    copy = WriteBehind._host_copy

    def flaky(job: Any, ready: Any, stream: Any) -> Any:
        if job.path.name.startswith(pkgs[2].image_sha256):
            raise OSError("no host memory")
        return copy(job, ready, stream)

    monkeypatch.setattr(WriteBehind, "_host_copy", staticmethod(flaky))
    split = Joint.split

    def joint_copy_fails(self: Any, tensors: Any = None) -> Any:
        if tensors is not None:  # the writer's cut of its host copy: the batch falls back to one by one
            raise OSError("no pinned memory")
        return split(self)

    monkeypatch.setattr(Joint, "split", joint_copy_fails)
    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=1)
    store.put_many(pkgs)
    assert store.flush(timeout=60) and store.stats()["write_errors"] == 1
    assert {f.name.split(".")[0] for f in tmp_path.rglob("*.safetensors")} == {
        p.image_sha256 for p in pkgs if p is not pkgs[2]}
    assert store.get(pkgs[2].image_sha256, pkgs[2].fingerprint) is not None  # still served from memory
    store.close()


def test_write_behind_back_pressure_bounds_the_queue(tmp_path: Path) -> None:
    from retrieval.packages import PackageStore

    one = _pkgs(1)[0].nbytes
    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=1,
                         max_pending_bytes=3 * one)
    for p in _pkgs(20, start=200):
        store.put(p)
        assert store.stats()["pending_writes"] <= 3
    store.close()
    assert store.stats()["disk_packages"] == 20


# -- preprocessing ahead, grouped attention ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_loaded(tiny_embedding_dir: Path) -> Any:
    from retrieval.qwen.loading import load_qwen

    return load_qwen(str(tiny_embedding_dir), device="cpu", dtype="float32")


def _images(n: int, seed: int = 0) -> list[Any]:
    from retrieval.images import decode_image

    return [decode_image(png(40 + 9 * (i % 3), 60 + 13 * (i % 2), seed + i)) for i in range(n)]


def test_preprocessing_is_bit_identical_to_one_processor_call(tiny_loaded: Any) -> None:
    from qwen_vl_utils import fetch_image

    from retrieval.qwen.vision import VisionEncoder

    images = _images(7)
    ip = tiny_loaded.processor.image_processor
    resized = [fetch_image({"image": im.image, "min_pixels": 4096, "max_pixels": 1800 * 32 * 32},
                           image_patch_size=int(ip.patch_size)) for im in images]
    ref = ip(images=resized, do_resize=False, return_tensors="pt")
    for threads in (1, 4):
        vision = VisionEncoder(tiny_loaded, preprocess_threads=threads)
        pixels, grids = vision.preprocess(images)
        assert torch.equal(pixels, ref["pixel_values"]) and torch.equal(grids, ref["image_grid_thw"])


@pytest.mark.parametrize("grouped", [False, True])
def test_prepared_packages_equal_the_reference_tower_call(tiny_loaded: Any, grouped: bool) -> None:
    """Preprocessed ahead, reordered by size and (optionally) with grouped attention: the very same packages
    as ``get_image_features`` on one batched processor output, and the tower runs once per image."""
    from retrieval.packages import PackageStore, VisualPackages
    from retrieval.qwen.vision import VisionEncoder

    images = _images(9, seed=10)
    vision = VisionEncoder(tiny_loaded, grouped_attention=grouped)
    pixels, grids = vision.preprocess(images)
    with torch.inference_mode():
        ref = tiny_loaded.model.get_image_features(pixels, grids, return_dict=True)
    stage = VisualPackages(PackageStore(storage_dtype="float32"))
    view = stage.register("embedding", None, vision)
    prepared = stage.prepare(images + images[:2])  # repeats are prepared once
    (ahead,) = prepared.by_key.values()
    assert set(ahead.pixels) == {im.sha256 for im in images} and not prepared.errors
    stage.build(images, prepared)
    stats = vision.stats()
    assert (stats["tower_images"], stats["tower_batches"]) == (9, 1)
    packages = view.get_or_encode(images)
    for k, pkg in enumerate(packages):
        assert pkg.image_sha256 == images[k].sha256
        assert torch.equal(pkg.embeds, ref.pooler_output[k])
        assert torch.equal(pkg.deepstack, torch.stack([lvl[k] for lvl in ref.deepstack_features]))
    assert stage.prepare(images).by_key == {}  # all in the store now: nothing to prepare
    stage.build(images, prepared)
    assert vision.stats()["tower_images"] == 9 and view.stats()["vision_encodes"] == 9


def test_prepare_reports_bad_images_one_by_one(tiny_loaded: Any) -> None:
    from retrieval.errors import ImageError
    from retrieval.images import decode_image
    from retrieval.qwen.vision import VisionEncoder

    wide = decode_image(png(400, 1, 77))  # aspect ratio above 200: the official resize refuses it
    good = _images(3, seed=20)
    vision = VisionEncoder(tiny_loaded)
    prepared = vision.prepare([good[0], wide, good[1], good[2]])
    assert set(prepared.errors) == {wide.sha256} and isinstance(prepared.errors[wide.sha256], ImageError)
    assert len(vision.encode(good, prepared)) == 3
    with pytest.raises(ImageError):
        vision.encode([wide], prepared)


def test_runs_of_equal_segments() -> None:
    from retrieval.qwen.tower_attention import runs_of as _runs

    assert _runs([4, 4, 6, 6, 6, 4]) == [(0, 4, 2), (8, 6, 3), (26, 4, 1)]
    assert _runs([]) == []


# -- batched commit vs item by item ---------------------------------------------------------------------------
@pytest.fixture
def services(tiny_embedding_dir: Path, tmp_path: Path, catalog_url: str) -> Iterator[Callable[..., Any]]:
    from indexer.jobs import IngestionService
    from retrieval import load_embedder
    from retrieval.packages import PackageStore

    made: list[Any] = []

    def make(name: str = "data", **options: Any) -> Any:
        store = PackageStore(tmp_path / name / "packages", storage_dtype="float32", write_behind=True)
        embedder = load_embedder(str(tiny_embedding_dir), store=store)
        service = IngestionService.open_local(tmp_path / name, embedder=embedder, catalog_url=catalog_url, **options)
        made.append(service)
        return service

    yield make
    for service in made:
        _close(service)


def _stage(service: Any, name: str) -> tuple[Any, list[Any], Any]:
    """A claimed batch with every outcome: new, existing pending row, indexed duplicate, repeat in the batch,
    bad bytes, a model reject and its repeat, a lost claim and its repeat, a row indexed since dedup."""
    from sqlalchemy import update

    import indexer.catalog as cat
    from indexer.catalog.models import JobItem
    from indexer.jobs.pipeline import BatchProcessor
    from retrieval.images import decode_image

    ref_set = service.create_set(name, embedding_dim=64)
    data = {k: png(30 + i, 28 + 2 * i, 500 + i) for i, k in enumerate(["a", "b", "dup", "pend", "lost", "race"])}
    data["wide"] = png(400, 1, 599)
    sha = {k: decode_image(v).sha256 for k, v in data.items()}
    with service.catalog.write() as s:
        cat.add_image(s, ref_set.id, sha256=sha["dup"], byte_size=1, source="upload", original_name="old.png",
                      status=cat.ImageStatus.INDEXED)
        cat.add_image(s, ref_set.id, sha256=sha["pend"], byte_size=1, source="upload", status=cat.ImageStatus.PENDING)
    files = [("a.png", data["a"]), ("b.png", data["b"]), ("dup.png", data["dup"]), ("pend.png", data["pend"]),
             ("a-again.png", data["a"]), ("bad.png", b"not an image"), ("wide.png", data["wide"]),
             ("wide-again.png", data["wide"]), ("lost.png", data["lost"]), ("lost-again.png", data["lost"]),
             ("race.png", data["race"])]
    job = service.create_job_from_uploads(ref_set.id, files)
    with service.catalog.write() as s:
        claimed = cat.claim_next_items(s, "w", job_id=job.id, limit=100)
    processor = BatchProcessor(service.catalog, service.blobs, service.index, service.embedder, worker_id="w")
    batch = processor.embed(processor.pack(processor.encode(processor.prepare(claimed, service.sources.get))))
    by_ref = {u.item.source_ref: u for u in batch.units}
    with service.catalog.write() as s:  # taken over by another worker meanwhile
        s.execute(update(JobItem).where(JobItem.id == by_ref["lost.png"].item.id).values(claimed_by="other"))
        cat.add_image(s, ref_set.id, sha256=sha["race"], byte_size=1, source="upload", original_name="elsewhere.png",
                      status=cat.ImageStatus.INDEXED)  # another job indexed it since our dedup
    processor._upsert([u for u in batch.units if u.working])
    return job, batch.units, processor


def _rows(service: Any, job_id: str) -> dict[str, Any]:
    import indexer.catalog as cat

    with service.catalog.read() as s:
        job = cat.get_job(s, job_id)
        images = {r.id: r for r in cat.list_images(s, job.set_id, limit=1000).items}
        items = cat.list_items(s, job_id, limit=1000)
        packages = {(p.sha256, p.byte_size) for p in cat.list_packages(s)}
    return {
        "job": (job.state, job.done, job.failed, job.skipped),
        "items": {i.source_ref: (i.state, i.error, images[i.image_id].sha256 if i.image_id else None, i.blob_sha256,
                                 i.claimed_by) for i in items},
        "images": sorted((r.sha256, r.status, r.original_name, r.source_detail, r.byte_size, r.width, r.height)
                         for r in images.values()),
        "packages": packages,
    }


def test_batched_commit_equals_item_by_item(services: Callable[..., Any]) -> None:
    from indexer.jobs.commit import commit_bulk, commit_each

    outcomes = {}
    for name, commit in (("bulk", commit_bulk), ("each", commit_each)):
        service = services(name)
        job, units, processor = _stage(service, f"set-{name}")
        with service.catalog.write() as s:
            result = commit(s, units, "w")
        outcomes[name] = ((result.done, result.failed, result.skipped, result.lost), _rows(service, job.id))
        processor.close()
    assert outcomes["bulk"] == outcomes["each"]
    counts, rows = outcomes["bulk"]
    assert counts == (3, 3, 3, 2)  # a, b, pend | bad, wide, wide-again | dup, a-again, race | lost, lost-again
    assert rows["items"]["lost-again.png"][0] == "pending"  # released: its first copy's new holder indexes it
    assert rows["items"]["race.png"][:2] == ("skipped", "duplicate of elsewhere.png")
    assert rows["items"]["wide-again.png"][0] == "failed"


# -- overlapped batches -----------------------------------------------------------------------------------------
class DownOnce:
    """The real vector index, except that its first upsert finds the backend down."""

    def __init__(self, index: Any) -> None:
        self._index, self.failed = index, False

    def upsert(self, *args: Any, **kwargs: Any) -> Any:
        from retrieval.errors import BackendUnavailable

        if not self.failed:
            self.failed = True
            raise BackendUnavailable("vector index unreachable")
        return self._index.upsert(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._index, name)


def test_overlap_failure_hands_back_every_claim(services: Callable[..., Any]) -> None:
    import indexer.catalog as cat
    from indexer.catalog import JobState
    from indexer.jobs import IngestionRunner
    from retrieval.errors import BackendUnavailable

    service = services()
    service.index = DownOnce(service.index)
    ref_set = service.create_set("flaky")
    job = service.create_job_from_uploads(ref_set.id, [(f"{i}.png", png(24 + i, 24, 700 + i)) for i in range(14)])
    runner = IngestionRunner(service, worker_id="w", batch_size=3, load_threads=2, prefetch=2)
    assert runner.pipeline
    with pytest.raises(BackendUnavailable):
        runner.run_until_idle()
    with service.catalog.read() as s:
        states = [i.state for i in cat.list_items(s, job.id, limit=100)]
    assert cat.ItemState.CLAIMED not in states and states.count(cat.ItemState.PENDING) >= 3
    assert runner.run_until_idle() == 14 - states.count(cat.ItemState.DONE)
    job = service.get_job(job.id)
    assert (job.state, job.done) == (JobState.SUCCEEDED, 14)
    with service.catalog.read() as s:
        indexed = {r.sha256 for r in cat.list_images(s, ref_set.id, limit=100).items}
    assert service.index.ids(ref_set.id) == indexed and len(indexed) == 14
    assert service.embedder.stats["vision_encodes"] == 14  # nothing encoded twice: packages were kept
    runner.close()


def _close(service: Any) -> None:
    service.close()
    service.index.close()
    service.catalog.dispose()
