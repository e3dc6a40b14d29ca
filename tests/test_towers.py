"""Vision towers: packages per distinct tower at ingestion, backfill for a new tower, honest encode accounting.

Every reuse promise is checked with a reranker whose tower equals the embedder's AND with one whose tower
differs (another seed), so nothing passes only because the test checkpoints happen to share a tower.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from sqlalchemy import select

from rubricsearch.app.state import AppState, foreground_runner, open_state
from rubricsearch.indexer.catalog import ImageStatus, JobState, count_images, get_job, list_jobs
from rubricsearch.indexer.catalog.tables import PackageRecord
from rubricsearch.indexer.jobs.backfill import BACKFILL, plan_backfill
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import Fingerprint, PackageStore, VisualPackage, VisualPackages
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder, preprocess_spec
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from tests.api_helpers import ADMIN_KEY, api_settings, bearer, client_for, data_url, wait_job
from tests.conftest import TOWERS

pytestmark = pytest.mark.timeout(300)


def photo(seed: int, size: tuple[int, int] = (72, 56)) -> bytes:
    """A JPEG with some structure (gradients plus noise), like a small photo."""
    rng = np.random.default_rng(seed)
    w, h = size
    grad = np.linspace(0, 255, w)[None, :, None] * rng.uniform(0.2, 1.0, (1, 1, 3))
    pixels = np.clip(grad + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


# -- fingerprints ------------------------------------------------------------------------------------------
def test_fingerprint_covers_every_preprocessing_setting(tiny_embedding_dir: Path) -> None:
    loaded = load_qwen(tiny_embedding_dir, dtype="float32")
    spec = preprocess_spec(loaded.processor, 4096, 1843200)
    base = Fingerprint.of(loaded.tower_hash, spec)
    assert base.image_mean == tuple(loaded.processor.image_processor.image_mean) and base.exif == "transpose"
    assert "qwen_vl_utils" in base.resize and "Pillow" in base.resize
    assert Fingerprint.from_json(base.to_json()) == base and base.preprocess == spec
    variants = {"tower": "0" * 64, "min_pixels": 8192, "max_pixels": 1 << 20, "patch_size": 14, "merge_size": 1,
                "temporal_patch_size": 1, "image_mean": (0.0, 0.0, 0.0), "image_std": (1.0, 1.0, 1.0),
                "resize": base.resize + " (older)", "exif": "ignored"}
    assert set(variants) == {f.name for f in dataclasses.fields(Fingerprint)}  # a new field needs a case here
    digests = {dataclasses.replace(base, **{k: v}).digest() for k, v in variants.items()}
    assert len(digests) == len(variants) and base.digest() not in digests
    processor = loaded.processor.image_processor
    processor.image_mean = [0.1, 0.2, 0.3]  # another processor config is another key
    assert Fingerprint.of(loaded.tower_hash, preprocess_spec(loaded.processor, 4096, 1843200)) != base


def test_packages_of_an_older_fingerprint_are_not_reused(tmp_path: Path, tiny_embedding_dir: Path,
                                                         make_png: Any) -> None:
    loaded = load_qwen(tiny_embedding_dir, dtype="float32")
    encoder = VisionEncoder(loaded)
    image = decode_image(make_png(64, 64, 1))
    pkg = encoder.encode([image])[0]
    older = dataclasses.replace(pkg.fingerprint, resize=pkg.fingerprint.resize.replace("rs1", "rs0"))
    store = PackageStore(tmp_path / "packages", storage_dtype="float32")
    store.put(VisualPackage(pkg.image_sha256, older, pkg.grid_thw, pkg.embeds, pkg.deepstack))
    store.flush()
    reopened = PackageStore(tmp_path / "packages", storage_dtype="float32")  # as after an upgrade
    assert reopened.get(image.sha256, older) is not None and reopened.get(image.sha256, encoder.fingerprint) is None
    stage = VisualPackages(reopened)
    view = stage.register("embedding", None, encoder)
    view.get_or_encode([image])
    assert view.stats()["vision_encodes"] == 1  # recomputed under the current fingerprint, not reused


def test_an_image_made_and_not_yet_stored_is_not_encoded_again(tmp_path: Path, tiny_embedding_dir: Path,
                                                                make_png: Any) -> None:
    """Ingestion stores a batch's packages on another thread than the one that runs the towers: an image in two
    batches in a row is encoded once (the second batch takes the package on its way to the store), and a batch
    dropped before it was stored leaves nothing behind."""
    import gc

    encoder = VisionEncoder(load_qwen(tiny_embedding_dir, dtype="float32"))
    stage = VisualPackages(PackageStore(tmp_path / "packages", storage_dtype="float32"))
    view = stage.register("embedding", None, encoder)
    a, b, c = (decode_image(make_png(64, 64 + 16 * i, 40 + i)) for i in range(3))
    first = stage.make([a, b])
    second = stage.make([b, c])  # before the first batch is stored
    sizes = [stage.keep(first), stage.keep(second)]
    assert encoder.stats()["tower_images"] == 3 and view.stats()["vision_encodes"] == 3  # a, b, c once each
    assert all(sha in sizes[1] and sizes[1][sha] for sha in (b.sha256, c.sha256))
    got = stage.store.get(b.sha256, encoder.fingerprint)
    assert got is not None and torch.equal(got.embeds, encoder.encode([b])[0].embeds)  # (a 4th tower image)
    d = decode_image(make_png(64, 128, 50))
    dropped = stage.make([d])  # a batch that fails before its keep
    del dropped
    gc.collect()
    stage.keep(stage.make([d]))
    assert encoder.stats()["tower_images"] == 6  # made again: nothing stale was taken
    assert view.stats()["vision_encodes"] == 4 and stage.store.contains(d.sha256, encoder.fingerprint)


def test_a_found_package_reports_its_stored_size(tmp_path: Path, tiny_embedding_dir: Path, make_png: Any) -> None:
    """The catalog records a package's size in storage form whether ingestion made it or found it stored (a
    float8 package dequantises to four times its stored bytes)."""
    encoder = VisionEncoder(load_qwen(tiny_embedding_dir, dtype="float32"))
    stage = VisualPackages(PackageStore(tmp_path / "packages", storage_dtype="float8_e4m3fn"))
    stage.register("embedding", None, encoder)
    image = decode_image(make_png(64, 96, 60))
    made, found = stage.build([image]), stage.build([image])
    assert found == made and encoder.stats()["tower_images"] == 1


# -- ingestion builds a package per distinct tower ---------------------------------------------------------------
@pytest.fixture(params=TOWERS)
def app_state(request: pytest.FixtureRequest, tmp_path: Path, tiny_embedding_dir: Path,
              reranker_dir_for: Any) -> Iterator[AppState]:
    settings = api_settings(tmp_path / "data", tiny_embedding_dir, reranker_dir_for(request.param),
                            ingest={"workers": 0}, packages={"storage_dtype": "float32"})
    state = AppState.build(settings)
    yield state
    state.close()


def test_ingestion_builds_every_tower_once(app_state: AppState, count_tower: Any, monkeypatch: Any) -> None:
    state = app_state
    shared = state.packages.describe()["shared"]
    emb, rr = state.embedder.packages, state.reranker.packages
    assert (emb.fingerprint == rr.fingerprint) is shared and len(state.packages.towers()) == (1 if shared else 2)
    towers = [count_tower(state.embedder.runtime.vision.loaded.model.visual),  # type: ignore[attr-defined]
              count_tower(state.reranker.runtime.vision.loaded.model.visual)]  # type: ignore[attr-defined]
    resized: list[str] = []
    original = VisionEncoder._resize

    def counted(self: VisionEncoder, img: Any) -> Any:
        resized.append(img.sha256)
        return original(self, img)

    monkeypatch.setattr(VisionEncoder, "_resize", counted)
    images = [photo(i, (64 + 8 * i, 48)) for i in range(10)]
    ref = state.ingestion.create_set("refs", embedding_dim=64)
    job = state.ingestion.create_job_from_uploads(ref.id, [(f"p{i}.jpg", d) for i, d in enumerate(images)])
    foreground_runner(state, batch_size=5).run_until_idle(job_id=job.id)
    shas = {decode_image(d).sha256 for d in images}
    assert sorted(resized) == sorted(shas)  # one preprocessing pass per image, for both towers
    assert towers[0].images == 10 and towers[1].images == (0 if shared else 10)  # one pass per distinct tower
    for view in (emb, rr):
        assert all(state.store.contains(sha, view.fingerprint) for sha in shas)  # type: ignore[arg-type]
    with state.catalog.read() as s:
        records = {(r.sha256, r.fingerprint) for r in s.scalars(select(PackageRecord))}
    assert records == {(sha, v.fingerprint.digest()) for sha in shas for v in (emb, rr)}  # type: ignore[union-attr]
    counts = state.packages.encode_counts()
    assert sum(n for (_, _, p), n in counts.items() if p == "ingest") == (10 if shared else 20)
    assert plan_backfill(state.catalog, state.packages) == []  # nothing missing for any tower


def test_readiness_and_metrics_show_the_towers(app_state: AppState) -> None:
    state = app_state
    client = client_for(state)
    ready = client.get("/readyz").json()
    shared = state.packages.describe()["shared"]
    assert ready["towers_shared"] is shared and len(ready["towers"]) == (1 if shared else 2)
    roles = sorted(r for t in ready["towers"] for r in t["roles"])
    assert roles == ["embedding", "reranker"] and all(t["local"] for t in ready["towers"])
    text = client.get("/metrics").text
    assert f"rubricsearch_vision_towers_shared {float(shared)}" in text
    assert text.count("rubricsearch_vision_tower{") == (1 if shared else 2)


# -- a new reranker tower on an existing data directory ------------------------------------------------------------
def test_backfill_builds_a_new_towers_packages(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                               tiny_reranker_other_tower_dir: Path) -> None:
    data = tmp_path / "data"
    images = [photo(100 + i) for i in range(8)]
    first = AppState.build(api_settings(data, tiny_embedding_dir, tiny_reranker_dir, ingest={"workers": 0}))
    try:  # ingested while embedder and reranker shared a tower: one package per image
        ref = first.ingestion.create_set("refs", embedding_dim=64)
        job = first.ingestion.create_job_from_uploads(ref.id, [(f"p{i}.jpg", d) for i, d in enumerate(images)])
        foreground_runner(first, batch_size=4).run_until_idle(job_id=job.id)
    finally:
        first.close()

    # The data directory is now served with a reranker whose tower differs (no workers yet: nothing backfills).
    settings = api_settings(data, tiny_embedding_dir, tiny_reranker_other_tower_dir, ingest={"workers": 0})
    state = open_state(settings, embedder=True, reranker=True)
    try:
        client = client_for(state)
        body = {"set_id": "refs", "rubric": "striped", "image": data_url(photo(999)), "top_k": 3, "top_n": 3}
        during = client.post("/v1/search", json=body).json()["provenance"]["vision"]
        assert during["reference"] == 3 and during["by_model"]["reranker"]["reference"] == 3  # said, not hidden
        jobs = plan_backfill(state.catalog, state.packages)
        assert [j.kind for j in jobs] == [BACKFILL] and jobs[0].total == 8 - 3
        assert plan_backfill(state.catalog, state.packages) == []  # queued once, resumed, never stacked
        foreground_runner(state, batch_size=2).run_until_idle(job_id=jobs[0].id)
        with state.catalog.read() as s:
            done = get_job(s, jobs[0].id)
        assert (done.state, done.done, done.failed) == (JobState.SUCCEEDED, 5, 0)
        body["image"] = data_url(photo(998))
        body["top_k"] = body["top_n"] = 8
        after = client.post("/v1/search", json=body).json()["provenance"]["vision"]
        assert after["reference"] == 0 and after["query"] == 2  # the candidate, once per tower
        with state.catalog.read() as s:
            assert count_images(s, jobs[0].set_id)[ImageStatus.INDEXED] == 8  # backfill adds no images
    finally:
        state.close()


def test_server_start_queues_and_runs_the_backfill(tmp_path: Path, tiny_embedding_dir: Path,
                                                   tiny_reranker_dir: Path, tiny_reranker_other_tower_dir: Path,
                                                   ) -> None:
    data = tmp_path / "data"
    first = AppState.build(api_settings(data, tiny_embedding_dir, tiny_reranker_dir, ingest={"workers": 1}))
    client = client_for(first)
    try:
        created = client.post("/v1/sets", json={"name": "refs", "dimensions": 64}, headers=bearer(ADMIN_KEY))
        assert created.status_code == 201
        files = [("files", (f"p{i}.jpg", photo(200 + i), "image/jpeg")) for i in range(6)]
        job = client.post("/v1/sets/refs/images", headers=bearer(ADMIN_KEY), files=files).json()
        assert wait_job(client, job["id"])["state"] == "succeeded"
    finally:
        first.close()
    state = AppState.build(api_settings(data, tiny_embedding_dir, tiny_reranker_other_tower_dir, ingest={"workers": 1}))
    client = client_for(state)
    try:
        with state.catalog.read() as s:
            (backfill,) = [j for j in list_jobs(s, limit=10) if j.kind == BACKFILL]
        assert backfill.total == 6
        final = wait_job(client, backfill.id)
        assert (final["state"], final["kind"], final["done"]) == ("succeeded", BACKFILL, 6)
        rr = state.reranker.packages.fingerprint
        assert rr is not None and all(state.store.contains(sha, rr) for sha in _shas(state))
    finally:
        state.close()


def _shas(state: AppState) -> list[str]:
    from rubricsearch.indexer.catalog.tables import Image

    with state.catalog.read() as s:
        return list(s.scalars(select(Image.sha256)))


# -- query images' packages ---------------------------------------------------------------------------------
def test_query_packages_stay_in_a_bounded_memory_tier(tmp_path: Path, tiny_embedding_dir: Path,
                                                      reranker_dir_for: Any, make_png: Any) -> None:
    """Open search can neither fill the disk nor evict references; a candidate reused soon is encoded once."""
    from rubricsearch.rerank import load_reranker
    from rubricsearch.retrieval import load_embedder
    from rubricsearch.retrieval.packages import EphemeralPackages
    from rubricsearch.retrieval.qwen.model.prompts import Content

    store = PackageStore(tmp_path / "packages", storage_dtype="float32", memory_bytes=64 << 20)
    stage = VisualPackages(store, EphemeralPackages(max_bytes=400_000))
    emb = load_embedder(str(tiny_embedding_dir), packages=stage)
    rr = load_reranker(str(reranker_dir_for("distinct")), packages=stage)
    refs = [decode_image(make_png(64, 64, 10 + i)) for i in range(4)]
    stage.build(refs)
    store.flush()
    on_disk = store.stats()["disk_packages"]
    candidates = [decode_image(make_png(96, 96, 100 + i)) for i in range(30)]
    for cand in candidates:
        emb.embed_contents([Content(images=[cand])], ["query"])
        rr.score({"image": cand.data}, [{"image": r.data} for r in refs[:1]], "Match")
    store.flush()
    assert store.stats()["disk_packages"] == on_disk and store.stats()["writes"] == 8  # only the references
    tier = stage.queries.stats()
    assert tier["bytes"] <= 400_000 and tier["evictions"] > 0
    assert all(store.contains(r.sha256, v.fingerprint) for r in refs for v in (emb.packages, rr.packages))
    before = emb.stats["vision_encodes"]
    emb.embed_contents([Content(images=[candidates[-1]])], ["another rubric"])  # the latest candidate, again
    assert emb.stats["vision_encodes"] == before
    stage.build([candidates[-1]])  # ingested later: moved to the store, not encoded again
    assert emb.stats["vision_encodes"] == before and store.contains(candidates[-1].sha256, emb.packages.fingerprint)
