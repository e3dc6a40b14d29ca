"""Vision-only worker: the tower alone gives VisionEncoder's packages bit for bit, under the same key."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rubricsearch.retrieval.embedding.factory import load_embedder
from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.images import DecodedImage, decode_image
from rubricsearch.retrieval.packages import PackageStore, VisualPackages
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder, tower_fingerprint
from rubricsearch.retrieval.qwen.engine.vision_only import checkpoint_parameter_counts, vision_fingerprint, vision_only
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen, load_qwen


@pytest.fixture(scope="module")
def images(make_png: Callable[..., bytes]) -> list[DecodedImage]:
    return [decode_image(make_png(w, h, s)) for w, h, s in [(200, 120, 1), (64, 300, 2), (97, 97, 3), (33, 500, 4)]]


@pytest.fixture(scope="module")
def full(tiny_embedding_dir: Path) -> LoadedQwen:
    return load_qwen(tiny_embedding_dir, dtype="float32")


@pytest.fixture(scope="module")
def worker(tiny_embedding_dir: Path) -> VisionEncoder:
    return vision_only(tiny_embedding_dir, dtype="float32")


def test_packages_bit_identical_to_vision_encoder(worker: VisionEncoder, full: LoadedQwen,
                                                  images: list[DecodedImage]) -> None:
    encoder = VisionEncoder(full)
    assert worker.fingerprint == encoder.fingerprint
    assert worker.loaded.tower_hash == full.tower_hash
    ours, theirs = worker.encode(images), encoder.encode(images)
    for a, b in zip(ours, theirs, strict=True):
        assert a.image_sha256 == b.image_sha256 and a.grid_thw == b.grid_thw
        assert a.embeds.dtype == b.embeds.dtype == torch.float32
        assert torch.equal(a.embeds, b.embeds) and torch.equal(a.deepstack, b.deepstack)
    single = worker.encode(images[:1])[0]  # batching does not change a package
    assert torch.equal(single.embeds, ours[0].embeds)


def test_store_shared_both_ways(tiny_embedding_dir: Path, full: LoadedQwen, images: list[DecodedImage]) -> None:
    # vision-only first, the local embedder then finds every package
    packages = VisualPackages(PackageStore(storage_dtype="float32"))
    packages.register("worker", None, vision_only(tiny_embedding_dir, dtype="float32")).get_or_encode(images)
    emb = load_embedder(full, packages=packages)
    emb.embed([{"image": im.data} for im in images])
    assert emb.stats["vision_encodes"] == 0 and emb.stats["package_hits"] == len(images)
    # local first, the vision-only worker then finds every package
    packages2 = VisualPackages(PackageStore(storage_dtype="float32"))
    load_embedder(full, packages=packages2).embed([{"image": im.data} for im in images])
    view = packages2.register("worker", None, vision_only(tiny_embedding_dir, dtype="float32"))
    pkgs = view.get_or_encode(images)
    assert view.stats()["vision_encodes"] == 0 and view.stats()["package_hits"] == len(images)
    assert len(packages2.towers()) == 1  # the same tower: one slot, whoever registered first
    assert [p.image_sha256 for p in pkgs] == [im.sha256 for im in images]


def test_loads_only_the_tower(worker: VisionEncoder, full: LoadedQwen, tiny_embedding_dir: Path) -> None:
    visual, total = checkpoint_parameter_counts(tiny_embedding_dir)
    assert worker.parameter_count == visual == sum(p.numel() for p in full.model.visual.parameters())
    full_count = sum(p.numel() for p in full.model.parameters())
    assert full_count <= total and worker.parameter_count < full_count
    assert not hasattr(worker.loaded.model, "language_model")
    print(f"vision-only parameters {worker.parameter_count:,} of {total:,} in the checkpoint "
          f"({worker.parameter_count / total:.0%}); local backend holds {full_count:,}")


def test_fingerprint_follows_dtype_and_weights(tiny_embedding_dir: Path, tmp_path: Path, full: LoadedQwen) -> None:
    fp32 = vision_fingerprint(tiny_embedding_dir, dtype="float32")
    assert fp32 == tower_fingerprint(full, fp32.min_pixels, fp32.max_pixels)
    bf16 = vision_fingerprint(tiny_embedding_dir, dtype="bfloat16")
    assert bf16.tower == load_qwen(tiny_embedding_dir, dtype="bfloat16").tower_hash
    assert bf16 != fp32  # packages made in another dtype are never mixed in
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    other = make_test_model(tmp_path / "other", "embedding", seed=1)
    assert vision_fingerprint(other, dtype="float32").tower != fp32.tower


def test_sharded_checkpoint(tiny_embedding_dir: Path, tmp_path: Path, full: LoadedQwen,
                            images: list[DecodedImage]) -> None:
    """A sharded checkpoint (index + several files) gives the same tower and packages."""
    from transformers import Qwen3VLForConditionalGeneration

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_embedding_dir, sharded, ignore=shutil.ignore_patterns("*.safetensors"))
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_embedding_dir, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").exists()
    worker = vision_only(sharded, dtype="float32")
    assert worker.loaded.tower_hash == full.tower_hash
    reference = VisionEncoder(full).encode(images[:2])
    for a, b in zip(worker.encode(images[:2]), reference, strict=True):
        assert torch.equal(a.embeds, b.embeds) and torch.equal(a.deepstack, b.deepstack)


def test_missing_checkpoint_is_backend_unavailable(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable):
        vision_only(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BackendUnavailable):
        vision_only(tmp_path / "empty")
