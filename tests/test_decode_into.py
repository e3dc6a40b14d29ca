"""Decoding into the caller's memory (``decode_image(memory=...)``, the GPU path's pinned buffers) gives the very
pixels of a plain decode, for every format and mode; images that need rotating or converting decode as before. A
request's bytes are hashed once, a stored blob is checked against its hash. Bit-identity of the whole tensor path
with the official pixel values: tests/test_exact_preprocess.py."""

from __future__ import annotations

import contextlib
import random
import warnings
from typing import Any

import numpy as np
import pytest
from PIL import Image

import rubricsearch.retrieval.images as images
from rubricsearch.retrieval.errors import ImageError, RubricSearchError
from rubricsearch.retrieval.images import EncodedImage, ReferenceImage, decode_image, image_handle
from tests import fixtures_images as fx

pytestmark = pytest.mark.timeout(60)


class Memory:
    """Buffers handed to the decoder, prefilled with a pattern no decoder writes by chance."""

    def __init__(self) -> None:
        self.given: list[np.ndarray] = []

    def __call__(self, width: int, height: int) -> np.ndarray:
        buffer = np.full((height, width, 4), 0xA5, dtype=np.uint8)
        self.given.append(buffer)
        return buffer


def _rgb(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def _noise_rgb(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _encoded(image: Image.Image, fmt: str, **params: Any) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()


def _exif() -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = 1  # orientation: as stored
    return exif


def _exif_after_pixels(png: bytes) -> bytes:
    """The PNG's eXIf chunk moved behind its image data (where the header check must find it without decoding)."""
    start = png.index(b"eXIf") - 4
    end = start + 12 + int.from_bytes(png[start:start + 4], "big")
    chunk, rest = png[start:end], png[:start] + png[end:]
    iend = rest.rindex(b"IEND") - 4
    return rest[:iend] + chunk + rest[iend:]


RGB_FILES = {  # RGB pixels as stored: decoded into the memory given
    "jpeg": lambda: _encoded(_noise_rgb(173, 91, 1), "JPEG", quality=85),
    "jpeg 4:2:0 odd sides": lambda: _encoded(_noise_rgb(61, 47, 2), "JPEG", quality=70, subsampling=2),
    "progressive jpeg": lambda: _encoded(_noise_rgb(120, 80, 3), "JPEG", progressive=True),
    "png": lambda: _encoded(_noise_rgb(99, 33, 12), "PNG"),
    "png with exif": lambda: _encoded(_noise_rgb(99, 33, 4), "PNG", exif=_exif()),
    "png with exif after its pixels": lambda: _exif_after_pixels(_encoded(_noise_rgb(57, 31, 15), "PNG", exif=_exif())),
    "interlaced png with exif": lambda: _encoded(_noise_rgb(64, 40, 5), "PNG", interlace=1, exif=_exif()),
    "bmp": lambda: _encoded(_noise_rgb(45, 30, 8), "BMP"),
    "tiff": lambda: _encoded(_noise_rgb(45, 30, 9), "TIFF"),
    "one pixel": lambda: _encoded(_noise_rgb(1, 1, 10), "JPEG"),
    "mpo (a phone's multi-picture jpeg)": lambda: _encoded(_noise_rgb(80, 60, 13), "MPO", save_all=True,
                                                          append_images=[_noise_rgb(80, 60, 14)]),
}
OTHER_FILES = {  # rotated, mirrored, converted or decoded already: decoded as before, the memory not used
    "webp lossy (its plugin decodes before it has tiles)": lambda: _encoded(_noise_rgb(77, 55, 6), "WEBP", quality=80),
    "webp lossless": lambda: _encoded(_noise_rgb(77, 55, 7), "WEBP", lossless=True),
    "exif rotated": lambda: fx.exif_rotated_jpeg(60, 40, orientation=6),
    "exif mirrored": lambda: fx.exif_rotated_jpeg(50, 30, orientation=2),
    "grey jpeg": lambda: _encoded(_noise_rgb(40, 30, 11).convert("L"), "JPEG"),
    "rgba png": lambda: fx.palette_alpha_png(16, 8),
    "cmyk jpeg": fx.cmyk_jpeg,
    "16-bit grey png": lambda: fx.png_16bit_gradient(64, 8),
    "animated gif": fx.animated_gif,
}


@pytest.mark.parametrize("name", sorted(RGB_FILES))
def test_rgb_files_decode_into_the_given_memory_bit_for_bit(name: str) -> None:
    data = RGB_FILES[name]()
    plain = decode_image(data)
    memory = Memory()
    into = decode_image(data, memory=memory)
    assert len(memory.given) == 1 and into.buffer is memory.given[0]
    assert (into.width, into.height, into.format) == (plain.width, plain.height, plain.format)
    assert np.array_equal(memory.given[0][..., :3], _rgb(plain.image)), "the buffer holds other pixels"
    assert np.array_equal(_rgb(into.image), _rgb(plain.image))


@pytest.mark.parametrize("name", sorted(OTHER_FILES))
def test_other_images_decode_as_before_and_say_so(name: str) -> None:
    data = OTHER_FILES[name]()
    plain = decode_image(data)
    into = decode_image(data, memory=Memory())
    assert into.buffer is None  # its pixels are not in the memory given: a user must copy them
    assert into.image.size == plain.image.size
    assert np.array_equal(_rgb(into.image), _rgb(plain.image))


def test_corrupt_files_are_typed_errors_with_memory_too() -> None:
    """The decoder writing into our memory fails as it fails in its own: a typed error, never a crash."""
    with pytest.raises(ImageError):
        decode_image(fx.truncated_jpeg(), memory=Memory())
    seeds = [RGB_FILES["jpeg"](), RGB_FILES["png with exif"](), RGB_FILES["bmp"](), RGB_FILES["tiff"]()]
    rng = random.Random(99)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(150):
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            with contextlib.suppress(RubricSearchError):
                decode_image(bytes(data[: rng.randrange(1, len(data) + 1)]), memory=Memory())


def _counting_hash(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = images.sha256_hex

    def counted(data: bytes) -> str:
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(images, "sha256_hex", counted)
    return calls


def test_request_bytes_are_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    data = RGB_FILES["jpeg"]()
    calls = _counting_hash(monkeypatch)
    handle = image_handle(data)
    assert handle.sha256 == images.hashlib.sha256(data).hexdigest()
    decoded = handle.decoded(Memory())
    assert decoded.sha256 == handle.sha256 and decoded.buffer is not None
    encoded = EncodedImage(data)
    assert encoded.decoded().sha256 == handle.sha256
    assert calls == [len(data), len(data)]  # one hash per handle, none in their decodes


def test_a_stored_blob_is_still_checked_against_its_hash() -> None:
    data = RGB_FILES["png with exif"]()
    good = ReferenceImage(images.sha256_hex(data), lambda: data)
    assert good.decoded().width == 99
    changed = ReferenceImage(images.sha256_hex(data), lambda: RGB_FILES["jpeg"]())
    with pytest.raises(ImageError, match="content hash"):
        changed.decoded()
