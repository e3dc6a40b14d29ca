"""Correctness of the fast ingestion paths: preprocessing ahead of the tower (bit-identical pixels and packages;
write-behind packages are in test_write_behind.py), grouped tower attention, the batched catalog commit (the rows
one-at-a-time ingestion leaves), overlapped batches (failures hand every claim back); SIGKILL with all of it on is
in test_ingest_pipeline_crash.py. No timing assertions: bench/ingest_throughput.py measures speed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import noise_png

pytestmark = pytest.mark.timeout(300)


# -- preprocessing ahead, grouped attention ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_loaded(tiny_embedding_dir: Path) -> Any:
    from rubricsearch.retrieval.qwen.model.loading import load_qwen

    return load_qwen(str(tiny_embedding_dir), device="cpu", dtype="float32")


def _images(n: int, seed: int = 0) -> list[Any]:
    from rubricsearch.retrieval.images import decode_image

    return [decode_image(noise_png(40 + 9 * (i % 3), 60 + 13 * (i % 2), seed + i)) for i in range(n)]


def test_preprocessing_is_bit_identical_to_one_processor_call(tiny_loaded: Any) -> None:
    from qwen_vl_utils import fetch_image

    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder

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
    from rubricsearch.retrieval.packages import PackageStore, VisualPackages
    from rubricsearch.retrieval.plugins.accelerated.vision import AcceleratedVisionEncoder
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder

    images = _images(9, seed=10)
    vision = AcceleratedVisionEncoder(tiny_loaded, grouped_attention=True) if grouped else VisionEncoder(tiny_loaded)
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
    from rubricsearch.retrieval.errors import ImageError
    from rubricsearch.retrieval.images import decode_image
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder

    wide = decode_image(noise_png(400, 1, 77))  # aspect ratio above 200: the official resize refuses it
    good = _images(3, seed=20)
    vision = VisionEncoder(tiny_loaded)
    prepared = vision.prepare([good[0], wide, good[1], good[2]])
    assert set(prepared.errors) == {wide.sha256} and isinstance(prepared.errors[wide.sha256], ImageError)
    assert len(vision.encode(good, prepared)) == 3
    with pytest.raises(ImageError):
        vision.encode([wide], prepared)


def test_runs_of_equal_segments() -> None:
    from rubricsearch.retrieval.plugins.accelerated.tower_attention import runs_of as _runs

    assert _runs([4, 4, 6, 6, 6, 4]) == [(0, 4, 2), (8, 6, 3), (26, 4, 1)]
    assert _runs([]) == []


# -- the batched commit ------------------------------------------------------------------------------------------
@pytest.fixture
def services(tiny_embedding_dir: Path, tmp_path: Path, catalog_url: str) -> Iterator[Callable[..., Any]]:
    from rubricsearch.indexer.jobs import IngestionService
    from rubricsearch.retrieval import load_embedder
    from rubricsearch.retrieval.packages import PackageStore

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


def _stage(service: Any, name: str) -> tuple[Any, list[Any], Any, dict[str, bytes]]:
    """A claimed batch with every outcome: new, existing pending row, indexed duplicate, repeat in the batch,
    bad bytes, a model reject and its repeat, a lost claim and its repeat, a row indexed since dedup."""
    from sqlalchemy import update

    import rubricsearch.indexer.catalog as cat
    from rubricsearch.indexer.catalog.tables import JobItem
    from rubricsearch.indexer.jobs.pipeline import BatchProcessor
    from rubricsearch.retrieval.images import decode_image

    ref_set = service.create_set(name, embedding_dim=64)
    data = {k: noise_png(30 + i, 28 + 2 * i, 500 + i) for i, k in enumerate(["a", "b", "dup", "pend", "lost", "race"])}
    data["wide"] = noise_png(400, 1, 599)
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
    return job, batch.units, processor, data


def _rows(service: Any, job_id: str) -> dict[str, Any]:
    import rubricsearch.indexer.catalog as cat

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


def _one_at_a_time(data: dict[str, bytes], sha: dict[str, str]) -> dict[str, Any]:
    """The rows ingesting ``_stage``'s items one at a time, in order, leaves, written out from the rules (not by
    running another commit): the first copy of an image is indexed under its name, a later copy or an image the
    set holds indexed is a duplicate of the first, a pending row becomes indexed keeping its own fields, a reject
    fails each copy, a lost claim stays with its new holder and its repeat goes back to pending."""
    from rubricsearch.retrieval.images import decode_image

    aspect = ("invalid_image: image b074b87f17b1 cannot be resized for the model: absolute aspect ratio must be "
              "smaller than 200, got 400.0")
    not_image = "invalid_image: not an image in a supported format (BMP, GIF, JPEG, MPO, PNG, TIFF, WEBP)"

    def done(key: str) -> tuple[Any, ...]:
        return ("done", None, sha[key], sha[key], "w")

    def dup(key: str, of: str) -> tuple[Any, ...]:
        return ("skipped", f"duplicate of {of}", sha[key], sha[key], "w")

    def new_row(key: str) -> tuple[Any, ...]:
        image = decode_image(data[key])
        return (sha[key], "indexed", f"{key}.png", f"upload:{key}.png", len(data[key]), image.width, image.height)

    return {
        "job": ("running", 3, 3, 3),
        "items": {"a.png": done("a"), "b.png": done("b"), "dup.png": dup("dup", "old.png"), "pend.png": done("pend"),
                  "a-again.png": dup("a", "a.png"), "bad.png": ("failed", not_image, None, None, "w"),
                  "wide.png": ("failed", aspect, None, None, "w"),
                  "wide-again.png": ("failed", aspect, None, None, "w"),
                  "lost.png": ("claimed", None, None, None, "other"),
                  "lost-again.png": ("pending", None, None, None, None),
                  "race.png": dup("race", "elsewhere.png")},
        "images": sorted([new_row("a"), new_row("b"), (sha["dup"], "indexed", "old.png", "", 1, None, None),
                          (sha["pend"], "indexed", "", "", 1, None, None),
                          (sha["race"], "indexed", "elsewhere.png", "", 1, None, None)]),
        "packaged": {sha["a"], sha["b"], sha["pend"]},
    }


def test_the_batch_commit_leaves_what_one_at_a_time_ingestion_would(services: Callable[..., Any]) -> None:
    from rubricsearch.indexer.jobs.commit import commit_batch
    from rubricsearch.retrieval.images import decode_image

    service = services()
    job, units, processor, data = _stage(service, "set")
    with service.catalog.write() as s:
        result = commit_batch(s, units, "w")
    processor.close()
    rows = _rows(service, job.id)
    expected = _one_at_a_time(data, {k: decode_image(v).sha256 for k, v in data.items()})
    assert (result.done, result.failed, result.skipped, result.lost) == (3, 3, 3, 2)
    got_job = rows["job"]
    assert (got_job[0].value, *got_job[1:]) == expected["job"]
    assert {ref: (item[0].value, *item[1:]) for ref, item in rows["items"].items()} == expected["items"]
    assert sorted((r[0], r[1].value, *r[2:]) for r in rows["images"]) == expected["images"]
    assert {sha256 for sha256, _ in rows["packages"]} == expected["packaged"] and len(rows["packages"]) == 3


# -- overlapped batches -----------------------------------------------------------------------------------------
class DownOnce:
    """The real vector index, except that its first upsert finds the backend down."""

    def __init__(self, index: Any) -> None:
        self._index, self.failed = index, False

    def upsert(self, *args: Any, **kwargs: Any) -> Any:
        from rubricsearch.retrieval.errors import BackendUnavailable

        if not self.failed:
            self.failed = True
            raise BackendUnavailable("vector index unreachable")
        return self._index.upsert(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._index, name)


def test_overlap_failure_hands_back_every_claim(services: Callable[..., Any]) -> None:
    import rubricsearch.indexer.catalog as cat
    from rubricsearch.indexer.catalog import JobState
    from rubricsearch.indexer.jobs import IngestionRunner
    from rubricsearch.retrieval.errors import BackendUnavailable

    service = services()
    service.index = DownOnce(service.index)
    ref_set = service.create_set("flaky")
    job = service.create_job_from_uploads(ref_set.id, [(f"{i}.png", noise_png(24 + i, 24, 700 + i)) for i in range(14)])
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


def test_claim_limits_follow_the_pixel_budget() -> None:
    from rubricsearch.indexer.jobs.sizing import FIRST_CLAIM, claim_limit

    assert claim_limit(64, None, [12_000_000]) == 64  # no budget: the batch size
    assert claim_limit(64, 100_000_000, []) == FIRST_CLAIM == 8  # nothing seen yet: a small first batch
    assert claim_limit(4, 100_000_000, []) == 4
    assert claim_limit(64, 100_000_000, [12_192_768] * 8) == 8  # 12-MP photos
    assert claim_limit(64, 100_000_000, [448 * 448] * 64) == 64  # small images keep the whole batch
    assert claim_limit(64, 100_000_000, [448 * 448] * 7 + [12_192_768]) == 58  # the mean of the last batch
    assert claim_limit(64, 1_000, [12_192_768]) == 1  # never fewer than one


def test_claims_shrink_to_the_pixel_budget(services: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A job of large images is claimed a few at a time (several overlapped batches), after a first claim of
    FIRST_CLAIM; every item is still indexed once."""
    import rubricsearch.indexer.jobs.runner as runner_module
    from rubricsearch.indexer.catalog import JobState
    from rubricsearch.indexer.jobs import IngestionRunner

    service = services()
    ref_set = service.create_set("sized")
    job = service.create_job_from_uploads(ref_set.id, [(f"{i}.png", noise_png(40, 40, 800 + i)) for i in range(13)])
    limits: list[int] = []
    real = runner_module.claim_next_items
    monkeypatch.setattr(runner_module, "claim_next_items",
                        lambda s, worker, **kw: limits.append(kw["limit"]) or real(s, worker, **kw))
    runner = IngestionRunner(service, worker_id="w", batch_size=16, batch_pixels=3 * 40 * 40, load_threads=2)
    assert runner.run_until_idle() == 13
    assert limits[0] == 8 and set(limits[1:]) == {3} and len(limits) >= 3  # 8, 3, 2 items, then nothing left
    assert (service.get_job(job.id).state, service.get_job(job.id).done) == (JobState.SUCCEEDED, 13)
    assert service.embedder.stats["vision_encodes"] == 13
    limits.clear()  # a second run (another job) starts small again: what the last run saw does not carry over
    service.create_job_from_uploads(ref_set.id, [(f"b{i}.png", noise_png(40, 40, 900 + i)) for i in range(4)])
    assert runner.run_until_idle() == 4 and limits[0] == 8
    limits.clear()
    serial = IngestionRunner(service, worker_id="w2", batch_size=16, batch_pixels=3 * 40 * 40, pipeline=False)
    service.create_job_from_uploads(ref_set.id, [(f"c{i}.png", noise_png(40, 40, 950 + i)) for i in range(5)])
    assert not serial.pipeline and serial.run_until_idle() == 5 and limits[:2] == [8, 3]  # the serial runs too
    runner.close()
    serial.close()


def _close(service: Any) -> None:
    service.close()
    service.index.close()
    service.catalog.dispose()
