"""Embedder: faithful to the official computation, identical from cache, no tower run for cached images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.errors import InvalidInput, UnsupportedMedia
from rubricsearch.retrieval.packages import PackageStore
from tests.conftest import pil_item
from tests.reference_qwen import official_embed


@pytest.fixture(scope="module")
def images(make_png) -> dict[str, bytes]:
    return {"a": make_png(200, 120, 1), "b": make_png(64, 300, 2), "c": make_png(97, 97, 3)}


def _items(images: dict[str, bytes]) -> list[dict]:
    a, b, c = images["a"], images["b"], images["c"]
    return [
        {"image": a},
        {"image": a, "text": "short fur, triangular ears", "instruction": "Find images matching this description"},
        {"image": [b, c], "text": "two views"},
        {"text": "dark forehead stripes"},
        {"text": "a cat", "instruction": "Represent the colour"},
        {},
        {"image": c, "instruction": "Classify the object in this image."},
    ]


@pytest.fixture(scope="module")
def embedder(tiny_embedding_dir: Path):
    return load_embedder(str(tiny_embedding_dir), dtype="float32",
                         store=PackageStore(storage_dtype="float32"))


def test_matches_official_reference(embedder, images, tiny_embedding_dir: Path) -> None:
    items = _items(images)
    ref = official_embed(str(tiny_embedding_dir), [pil_item(i) for i in items]).numpy()
    ours = embedder.embed(items)
    cos = (ref * ours).sum(axis=1)
    assert cos.min() >= 0.99999, cos


def test_cached_equals_uncached_and_skips_tower(tiny_embedding_dir: Path, images, count_tower) -> None:
    store = PackageStore(storage_dtype="float32")
    emb = load_embedder(str(tiny_embedding_dir), store=store)
    counter = count_tower(emb.runtime.loaded.model.visual)
    cases = [
        [{"image": images["a"]}],
        [{"image": images["a"], "text": "short fur"}],
        [{"image": [images["b"], images["c"]]}],
        _items(images),
    ]
    first = [emb.embed(items) for items in cases]
    encoded = counter.images
    assert encoded == 3  # a, b, c: each distinct image through the tower exactly once
    calls = counter.calls
    second = [emb.embed(items) for items in cases]
    assert counter.calls == calls, "a cached image must not reach the vision tower"
    for x, y in zip(first, second, strict=True):
        assert np.abs(x - y).max() == 0.0
    # A fresh embedder on a fresh (uncached) store gives bit-identical vectors too.
    fresh = load_embedder(str(tiny_embedding_dir), store=PackageStore(storage_dtype="float32"))
    for items, x in zip(cases, first, strict=True):
        assert np.abs(fresh.embed(items) - x).max() == 0.0
    assert emb.stats["vision_encodes"] == 3
    assert emb.stats["package_hits"] > 0 and emb.stats["package_misses"] == 3


def test_cached_path_skips_preprocessing(tiny_embedding_dir: Path, images, monkeypatch) -> None:
    emb = load_embedder(str(tiny_embedding_dir), store=PackageStore(storage_dtype="float32"))
    emb.embed([{"image": images["a"]}])

    def boom(*args, **kwargs):
        raise AssertionError("pixel preprocessing ran for a cached image")

    monkeypatch.setattr(emb.runtime.vision, "preprocess", boom)
    emb.embed([{"image": images["a"], "text": "again", "instruction": "Another question"}])


def test_batch_equals_singles(embedder, images) -> None:
    items = _items(images)
    batch = embedder.embed(items)
    singles = np.concatenate([embedder.embed([i]) for i in items])
    assert np.abs(batch - singles).max() <= 1e-5


def test_matryoshka_prefix(embedder, images) -> None:
    items = _items(images)[:3]
    full = embedder.embed(items)
    for dim in (64, 96, embedder.dimension):
        cut = embedder.embed(items, dimensions=dim)
        assert cut.shape == (3, dim)
        np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-5)
        prefix = full[:, :dim] / np.linalg.norm(full[:, :dim], axis=1, keepdims=True)
        np.testing.assert_allclose(cut, prefix, atol=1e-6)
    for bad in (0, 63, embedder.dimension + 1):
        with pytest.raises(InvalidInput):
            embedder.embed(items, dimensions=bad)


def test_bad_items_are_typed_errors(embedder) -> None:
    with pytest.raises(InvalidInput):
        embedder.embed([{"txt": "typo"}])
    with pytest.raises(InvalidInput):
        embedder.embed([{"text": 3}])
    with pytest.raises(UnsupportedMedia):
        embedder.embed([{"video": "clip.mp4"}])
    with pytest.raises(InvalidInput):
        embedder.embed([{"image": "https://example.invalid/cat.jpg"}])  # never fetched
    assert embedder.embed([]).shape == (0, embedder.dimension)
