"""Preprocessing as tensor ops (the GPU path, run here on the CPU): same grids as the official path, the
same patches given the same resized pixels, a small measured deviation otherwise, per-image errors."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from retrieval.errors import ImageError
from retrieval.images import EncodedImage
from retrieval.qwen.loading import load_qwen
from retrieval.qwen.vision import VisionEncoder
from tests.fixtures_images import exif_rotated_jpeg, truncated_jpeg


@pytest.fixture(scope="module")
def loaded(tiny_embedding_dir: Path) -> Any:
    return load_qwen(tiny_embedding_dir, dtype="float32")


def photo(seed: int, w: int, h: int) -> bytes:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (max(1, h // 16), max(1, w // 16), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=92)
    return buf.getvalue()


def test_patches_match_the_official_path(loaded: Any) -> None:
    official = VisionEncoder(loaded)
    fast = VisionEncoder(loaded, preprocess="gpu")
    assert fast.fingerprint != official.fingerprint and "gpu" in fast.fingerprint.resize
    images = [EncodedImage(photo(i, w, h)) for i, (w, h) in enumerate([(640, 480), (300, 900), (448, 448)])]
    want = official._process(images)
    got = fast._process(images)
    for (wp, wg), (gp, gg) in zip(want, got, strict=True):  # type: ignore[misc]
        assert wg == gg and wp.shape == gp.shape
        # pixels differ by the resize implementation only: at most a couple of 8-bit levels
        assert float((wp - gp).abs().max()) <= 3 * 2 / 255 / 0.5 + 1e-6
        assert float((wp - gp).abs().mean()) <= 0.01


def test_same_pixels_give_exactly_the_official_patches(loaded: Any) -> None:
    """An image already at a grid-aligned size is not resized: the patches are bit-identical."""
    official = VisionEncoder(loaded)
    fast = VisionEncoder(loaded, preprocess="gpu")
    img = EncodedImage(photo(7, 448, 320))
    (wp, wg), (gp, gg) = official._process([img])[0], fast._process([img])[0]  # type: ignore[misc]
    assert wg == gg and torch.equal(wp, gp)


def test_errors_are_per_image_and_exif_is_applied(loaded: Any) -> None:
    fast = VisionEncoder(loaded, preprocess="gpu")
    wide = Image.new("RGB", (400, 1), (9, 9, 9))
    buf = io.BytesIO()
    wide.save(buf, "PNG")
    good = EncodedImage(photo(1, 320, 240))
    images = [good, EncodedImage(truncated_jpeg()), EncodedImage(buf.getvalue())]
    prepared = fast.prepare(images)
    assert set(prepared.pixels) == {good.sha256}
    assert all(isinstance(e, ImageError) for e in prepared.errors.values()) and len(prepared.errors) == 2
    rotated = EncodedImage(exif_rotated_jpeg(60, 40, orientation=6))
    (_, grid), = [r for r in fast._process([rotated]) if not isinstance(r, Exception)]
    (_, want), = [r for r in VisionEncoder(loaded)._process([rotated]) if not isinstance(r, Exception)]
    assert grid == want  # the rotated (portrait) size, as the official path sees it


def test_images_of_one_size_are_preprocessed_together_exactly_as_alone(loaded: Any) -> None:
    """Same-size images go through resize, normalise and patchify as one batch: each gets the very patches it
    gets alone (a batch of one), other sizes and failures keep their own places."""
    fast = VisionEncoder(loaded, preprocess="gpu")
    sizes = [(640, 480), (300, 900), (640, 480), (448, 448), (640, 480), (300, 900)]
    images = [EncodedImage(photo(20 + i, w, h)) for i, (w, h) in enumerate(sizes)]
    bad = EncodedImage(truncated_jpeg())
    together = fast._process([*images[:3], bad, *images[3:]])
    assert isinstance(together[3], Exception)
    del together[3]
    for img, got in zip(images, together, strict=True):
        (want_p, want_g), = fast._process([img])  # type: ignore[misc]
        assert not isinstance(got, Exception) and got[1] == want_g and torch.equal(got[0], want_p)
