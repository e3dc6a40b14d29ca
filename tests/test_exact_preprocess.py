"""The tensor preprocessing path gives the official pixels bit for bit (max |delta| = 0).

Pillow's bicubic resize is compared pixel for pixel on sizes that exercise every step of its arithmetic: both passes
and each alone, the vertical pass first (Pillow 13 orders the passes by how much each side shrinks), upscaling,
1-pixel sides, and saturated edges whose filter overshoot the 8-bit clip must cut. Then the whole path (decode,
resize, rescale, normalise, patchify) against the official ``pixel_values`` on JPEG, PNG and WebP of mixed sizes and
modes, EXIF orientation and a 12-megapixel photo; on CUDA too (``-m gpu``).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from bench.images import jpeg as photo_jpeg
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.images import EncodedImage, image_handle
from rubricsearch.retrieval.plugins.accelerated.exact_resize import coefficients, horizontal_first, resize
from rubricsearch.retrieval.plugins.accelerated.gpu_preprocess import GpuPreprocessor, _pinned_pixels
from rubricsearch.retrieval.plugins.accelerated.vision import AcceleratedVisionEncoder
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from tests.fixtures_images import cmyk_jpeg, exif_rotated_jpeg, palette_alpha_png, png_16bit_gradient
from tests.test_gpu_preprocess import photo

# (height, width) -> (height, width): each resize case names the step of Pillow's arithmetic it pins
SIZES = [
    ((300, 400), (117, 155)),  # both sides shrink alike: horizontal pass first, then vertical
    ((240, 100), (60, 90)),  # the height shrinks > 2x the width: Pillow 13 runs the vertical pass first
    ((213, 259), (63, 384)),  # height shrinks, width grows: vertical first
    ((37, 23), (224, 224)),  # upscaling both sides
    ((64, 500), (64, 224)),  # only the width changes
    ((500, 64), (224, 64)),  # only the height changes
    ((1, 40), (32, 96)),  # a 1-pixel side grows
    ((50, 3), (7, 1)),  # down to a 1-pixel side
    ((257, 129), (129, 257)),  # transposed aspect
]


def _harsh(height: int, width: int, seed: int) -> np.ndarray:
    """Noise over a black-and-white checkerboard: bicubic lobes overshoot 0..255 at its edges, so the clip counts."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    board = ((np.arange(height)[:, None] // 3 + np.arange(width)[None, :] // 2) % 2 * 255).astype(np.uint8)
    arr[: height // 2] = board[: height // 2, :, None]
    return arr


@pytest.mark.parametrize("source,target", SIZES)
def test_resize_is_pillows_bicubic_bit_for_bit(source: tuple[int, int], target: tuple[int, int]) -> None:
    arr = _harsh(*source, seed=source[0] * 7 + target[1])
    want = np.asarray(Image.fromarray(arr).resize((target[1], target[0])))
    got = resize(torch.from_numpy(arr).permute(2, 0, 1).contiguous(), target).permute(1, 2, 0).numpy()
    assert got.shape == want.shape
    assert np.array_equal(got, want), f"{int((got != want).sum())} values differ"


def test_random_sizes_match_pillow() -> None:
    """Sizes drawn at random (the seed fixed): no case picked by hand hides a different branch."""
    rng = np.random.default_rng(36)
    orders = set()
    for _ in range(40):
        h, w, oh, ow = (int(v) for v in rng.integers(1, 160, 4))
        orders.add(horizontal_first(h, w, oh, ow))
        arr = _harsh(h, w, seed=h * w + oh)
        want = np.asarray(Image.fromarray(arr).resize((ow, oh)))
        got = resize(torch.from_numpy(arr).permute(2, 0, 1).contiguous(), (oh, ow)).permute(1, 2, 0).numpy()
        assert np.array_equal(got, want), ((h, w), (oh, ow))
    assert orders == {True, False}


def test_weights_are_normalised_fixed_point() -> None:
    """Each output pixel's integer weights sum to one in fixed point, give or take the rounding of each weight."""
    for source, out in ((4000, 1568), (37, 224), (300, 117)):
        _, _, weights = coefficients(source, out)
        taps = weights.shape[1]
        sums = weights.astype(np.int64).sum(axis=1)
        assert np.all(np.abs(sums - (1 << 22)) <= taps)


@pytest.fixture(scope="module")
def loaded(tiny_embedding_dir: Path) -> Any:
    return load_qwen(tiny_embedding_dir, dtype="float32", device="cpu")


def tensor_path(loaded: Any, device: torch.device | None = None) -> GpuPreprocessor:
    """The preprocessing a GPU runs, here on the given device (the CPU by default)."""
    ip = loaded.processor.image_processor
    vision = VisionEncoder(loaded)
    return GpuPreprocessor(ip, min_pixels=vision.min_pixels, max_pixels=vision.max_pixels,
                           device=device or loaded.device, dtype=torch.float32)


def _save(img: Image.Image, fmt: str, **params: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **params)
    return buf.getvalue()


def inputs() -> dict[str, bytes]:
    """Every kind of input the product takes, each resized by a different amount (or not at all)."""
    rgb = Image.fromarray(_harsh(333, 517, 5))
    return {
        "photo jpeg 640x480": photo(1, 640, 480),
        "photo jpeg 300x900": photo(2, 300, 900),
        "bench photo 1024x768": photo_jpeg(1024, 768, 3),
        "grid-aligned 448x320 (no resize)": photo(7, 448, 320),
        "upscaled 40x30": photo(4, 40, 30),
        "png rgb": _save(rgb, "PNG"),
        "webp lossy": _save(rgb, "WEBP", quality=80),
        "webp lossless": _save(rgb, "WEBP", lossless=True),
        "grey jpeg": _save(rgb.convert("L"), "JPEG", quality=90),
        "rgba png": _save(Image.fromarray(np.dstack([_harsh(200, 150, 6), _harsh(200, 150, 8)[..., :1]])), "PNG"),
        "palette png": _save(rgb.convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
        "palette with transparency": palette_alpha_png(160, 90),
        "16-bit grey png": png_16bit_gradient(256, 40),
        "cmyk jpeg": cmyk_jpeg(),
        "exif rotated jpeg": exif_rotated_jpeg(600, 400, orientation=6),
        "exif mirrored jpeg": exif_rotated_jpeg(500, 300, orientation=2),
    }


def _assert_identical(want: list[Any], got: list[Any], names: list[str]) -> None:
    for name, w, g in zip(names, want, got, strict=True):
        assert not isinstance(w, Exception) and not isinstance(g, Exception), (name, w, g)
        assert w[1] == g[1], (name, w[1], g[1])
        delta = float((w[0].float() - g[0].float().cpu()).abs().max())
        assert delta == 0.0, f"{name}: max |delta| {delta}"


def _fresh(named: dict[str, bytes]) -> list[EncodedImage]:
    """Undecoded images for each path (a decoded one would hand the next path the pixels the first decoded)."""
    return [EncodedImage(data) for data in named.values()]


# decoded straight into the tensor path's buffers (RGB as stored, no rotation)
IN_PLACE = {"photo jpeg 640x480", "photo jpeg 300x900", "bench photo 1024x768", "grid-aligned 448x320 (no resize)",
            "upscaled 40x30", "png rgb"}


def test_tensor_path_gives_the_official_pixel_values(loaded: Any) -> None:
    named = inputs()
    official = VisionEncoder(loaded)  # the official path itself: the plain encoder has no other
    assert AcceleratedVisionEncoder(loaded)._gpu is None  # on a CPU the accelerated one runs it too
    want = official._process(_fresh(named))
    images = _fresh(named)
    got = tensor_path(loaded).process(images, lambda fn, xs: [fn(x) for x in xs])
    _assert_identical(want, got, list(named))
    assert {name for name, img in zip(named, images, strict=True) if img.decoded().buffer is not None} == IN_PLACE


def test_one_fingerprint_for_the_official_pixels(loaded: Any) -> None:
    """Identical pixels, identical packages: the tensor path makes no new fingerprint; nvJPEG does."""
    official = VisionEncoder(loaded)
    assert "Pillow" in official.fingerprint.resize and "nvjpeg" not in official.fingerprint.resize
    assert AcceleratedVisionEncoder(loaded).fingerprint == official.fingerprint
    nvjpeg = AcceleratedVisionEncoder(loaded, preprocess="gpu-nvjpeg")
    assert nvjpeg.fingerprint != official.fingerprint and "nvjpeg" in nvjpeg.fingerprint.resize
    with pytest.raises(InvalidInput, match="accelerated engine"):  # the plain encoder makes no nvJPEG pixels
        VisionEncoder(loaded, preprocess="gpu-nvjpeg")


@pytest.mark.slow
def test_twelve_megapixel_photo_is_bit_identical(loaded: Any) -> None:
    named = {"4000x3000": photo_jpeg(4000, 3000, 11), "3024x4032": photo_jpeg(3024, 4032, 12)}
    want = VisionEncoder(loaded)._process(_fresh(named))
    images = _fresh(named)
    got = tensor_path(loaded).process(images, lambda fn, xs: [fn(x) for x in xs])
    _assert_identical(want, got, list(named))
    assert all(img.decoded().buffer is not None for img in images)  # decoded in place, no copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gives_the_official_pixel_values(tiny_embedding_dir: Path) -> None:
    """On CUDA (the path the product runs there): the official CPU pixels, 12-MP photos included."""
    cpu = load_qwen(tiny_embedding_dir, dtype="float32", device="cpu")
    named = {**inputs(), "12-MP landscape": photo_jpeg(4000, 3000, 21), "12-MP portrait": photo_jpeg(3000, 4000, 22)}
    want = VisionEncoder(cpu)._process(_fresh(named))
    cuda = load_qwen(tiny_embedding_dir, dtype="float32", device="cuda")
    encoder = AcceleratedVisionEncoder(cuda)
    assert encoder._gpu is not None and encoder.fingerprint == VisionEncoder(cpu).fingerprint
    images = _fresh(named)
    _assert_identical(want, encoder._process(images), list(named))
    in_place = {name for name, img in zip(named, images, strict=True) if img.decoded().buffer is not None}
    assert in_place == IN_PLACE | {"12-MP landscape", "12-MP portrait"}  # into pinned memory
    handle = image_handle(photo_jpeg(4000, 3000, 23))
    for _ in range(2):  # the first decodes into pinned memory, the second (another tower) reads it again
        pixels = _pinned_pixels(handle)
        assert isinstance(pixels, torch.Tensor) and pixels.is_pinned()
        assert pixels.data_ptr() == handle.decoded().buffer.ctypes.data
