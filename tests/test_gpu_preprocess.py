"""Preprocessing as tensor ops (the GPU path, run here on the CPU): per-image errors, EXIF orientation, and
images batched by size exactly as alone. Bit-identity with the official path: tests/test_exact_preprocess.py."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from rubricsearch.retrieval.errors import ImageError
from rubricsearch.retrieval.images import EncodedImage, decode_image, image_handle
from rubricsearch.retrieval.plugins.accelerated.gpu_preprocess import GpuPreprocessor, _pil_pixels
from rubricsearch.retrieval.plugins.accelerated.vision import AcceleratedVisionEncoder
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
from rubricsearch.retrieval.qwen.model.loading import load_qwen
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


def tensor_encoder(loaded: Any) -> AcceleratedVisionEncoder:
    """An encoder whose preprocessing is the GPU's tensor path, run here on the CPU (where the product picks PIL)."""
    encoder = AcceleratedVisionEncoder(loaded)
    encoder._gpu = GpuPreprocessor(loaded.processor.image_processor, min_pixels=encoder.min_pixels,
                                   max_pixels=encoder.max_pixels, device=loaded.device, dtype=torch.float32)
    return encoder


def test_errors_are_per_image_and_exif_is_applied(loaded: Any) -> None:
    fast = tensor_encoder(loaded)
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
    fast = tensor_encoder(loaded)
    sizes = [(640, 480), (300, 900), (640, 480), (448, 448), (640, 480), (300, 900)]
    images = [EncodedImage(photo(20 + i, w, h)) for i, (w, h) in enumerate(sizes)]
    bad = EncodedImage(truncated_jpeg())
    together = fast._process([*images[:3], bad, *images[3:]])
    assert isinstance(together[3], Exception)
    del together[3]
    for img, got in zip(images, together, strict=True):
        (want_p, want_g), = fast._process([img])  # type: ignore[misc]
        assert not isinstance(got, Exception) and got[1] == want_g and torch.equal(got[0], want_p)


def test_a_second_tower_reads_the_pixels_decoded_for_the_first() -> None:
    """Towers of their own each preprocess a search's candidate: the second reads the memory the first decoded the
    file into (no second decode, no copy), a rotated image the one copy made for the first."""
    for handle in (image_handle(photo(3, 640, 480)), image_handle(exif_rotated_jpeg(60, 40, orientation=6))):
        first, second = _pil_pixels(handle), _pil_pixels(handle)
        assert isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
        assert torch.equal(first, second)
    assert first.shape[1:] == (60, 40)
    straight = image_handle(photo(3, 640, 480))
    first, second = _pil_pixels(straight), _pil_pixels(straight)
    assert isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
    assert first.data_ptr() == second.data_ptr()


def test_memory_a_decoder_did_not_use_holds_the_pasted_pixels() -> None:
    """A decoder may be handed memory and still make its own image (Pillow replaces an image core it cannot
    use): the pixels are then pasted into the memory it was handed, not into a second buffer."""

    class DecodesElsewhere:
        def __init__(self, data: bytes) -> None:
            self.data, self.handed = data, None

        def decoded(self, memory: Any = None) -> Any:
            image = decode_image(self.data)
            if memory is not None:
                self.handed = memory(image.width, image.height)
            return image

    handle = DecodesElsewhere(photo(5, 64, 48))
    pixels = _pil_pixels(handle)  # type: ignore[arg-type]
    assert isinstance(pixels, torch.Tensor) and handle.handed is not None
    assert pixels.data_ptr() == handle.handed.ctypes.data
    want = torch.from_numpy(np.asarray(decode_image(handle.data).image)).permute(2, 0, 1)
    assert torch.equal(pixels[:3], want)
