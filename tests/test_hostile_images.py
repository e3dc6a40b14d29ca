"""Every generated hostile or unusual image goes through ``decode_image``: a correct RGB image or a typed
error, never a crash, never a hang (each test runs under its own timeout)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rubricsearch.retrieval.errors import ImageError, PayloadTooLarge, RubricSearchError
from rubricsearch.retrieval.images import DecodedImage, decode_image
from tests import fixtures_images as fx

pytestmark = pytest.mark.timeout(30)


def px(decoded: DecodedImage, x: int, y: int) -> tuple[int, int, int]:
    pixel = decoded.image.getpixel((x, y))
    assert isinstance(pixel, tuple) and len(pixel) == 3
    return (int(pixel[0]), int(pixel[1]), int(pixel[2]))


def _close(pixel: tuple[int, ...], expected: tuple[int, int, int], tol: int = 12) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(pixel, expected, strict=True))


def _decode(data: bytes, **kwargs: int) -> DecodedImage:
    decoded = decode_image(data, **kwargs)
    assert decoded.image.mode == "RGB"
    assert decoded.image.size == (decoded.width, decoded.height)
    return decoded


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_valid_images_decode_to_their_size_and_colour(fmt: str) -> None:
    decoded = _decode(fx.solid(fmt, 37, 23, fx.BLUE))
    assert (decoded.width, decoded.height) == (37, 23)
    assert decoded.format == fmt
    assert _close(px(decoded, 18, 11), fx.BLUE)


def test_one_pixel_png() -> None:
    decoded = _decode(fx.png_1x1(fx.GREEN))
    assert decoded.image.size == (1, 1)
    assert px(decoded, 0, 0) == fx.GREEN


def test_exif_orientation_6_swaps_width_and_height() -> None:
    decoded = _decode(fx.exif_rotated_jpeg(60, 40, orientation=6))
    assert decoded.image.size == (40, 60)
    # The stored top-left red quadrant is displayed at the top right after a 90° clockwise turn.
    assert _close(px(decoded, 39, 0), fx.RED, tol=30)
    assert _close(px(decoded, 0, 0), (240, 240, 240), tol=30)


def test_palette_with_alpha_is_composited_on_white() -> None:
    decoded = _decode(fx.palette_alpha_png(16, 8))
    assert px(decoded, 2, 4) == (255, 255, 255)  # transparent red -> white
    assert px(decoded, 13, 4) == fx.BLUE


def test_rgba_transparent_black_becomes_white() -> None:
    assert px(_decode(fx.rgba_half_transparent_png()), 3, 3) == (255, 255, 255)


def test_cmyk_jpeg_becomes_rgb() -> None:
    decoded = _decode(fx.cmyk_jpeg((0, 255, 255, 0)))
    red, green, blue = px(decoded, 5, 5)
    assert red > 200 and green < 60 and blue < 60


@pytest.mark.parametrize("value", [0, 1000, 32768, 65535])
def test_16bit_grey_scales_by_a_fixed_factor(value: int) -> None:
    # Regression: scaling by the image's own peak turned a uniform mid-grey (32768) into white.
    decoded = _decode(fx.png_16bit(value))
    expected = round(value / 257)
    assert px(decoded, 3, 3) == (expected, expected, expected)


def test_16bit_gradient_keeps_its_range() -> None:
    decoded = _decode(fx.png_16bit_gradient(256, 4))
    row = [px(decoded, x, 1)[0] for x in (0, 64, 128, 255)]
    assert row == [0, 64, 128, 255]


def test_animated_gif_uses_its_first_frame() -> None:
    decoded = _decode(fx.animated_gif((fx.RED, fx.GREEN, fx.BLUE)))
    assert decoded.image.size == (24, 16)
    assert _close(px(decoded, 5, 5), fx.RED)


def test_jpeg_with_trailing_html_decodes_its_pixels() -> None:
    # Accepted as the JPEG it is; the stored original keeps the tail, so it must be served as image/jpeg
    # with nosniff (noted for the web layer).
    decoded = _decode(fx.jpeg_with_trailing_html())
    assert _close(px(decoded, 8, 8), fx.GREEN)


HOSTILE: dict[str, tuple[Callable[[], bytes], type[RubricSearchError]]] = {
    "zero_bytes": (fx.zero_bytes, ImageError),
    "truncated_jpeg": (fx.truncated_jpeg, ImageError),
    "png_claims_100000x100000": (fx.png_huge_header, ImageError),
    "jpeg_claims_65000x65000": (fx.jpeg_huge_header, ImageError),
    "bmp_claims_60000x60000": (fx.bmp_huge_header, ImageError),
    "gif_screen_65535x65535": (fx.gif_huge_screen, ImageError),
    "png_ztxt_bomb": (fx.png_text_bomb, ImageError),
    "png_corrupt_pixels": (fx.png_corrupt_pixels, ImageError),
    "non_image_bytes": (fx.non_image_bytes, ImageError),
    "text_with_jpg_name": (lambda: fx.text_named_jpg()[1], ImageError),
    "gif_js_polyglot": (fx.gif_js_polyglot, ImageError),
    "tiff_rational_strip_offsets": (fx.tiff_rational_strip_offsets, ImageError),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_input_is_a_typed_error(name: str) -> None:
    make, error = HOSTILE[name]
    with pytest.raises(error) as info:
        decode_image(make())
    assert info.value.kind == error.kind
    assert "BytesIO" not in info.value.message


@pytest.mark.parametrize("width,height", [(9000, 8000), (100_000, 100_000)])
def test_pixel_limit_refuses_from_the_header_alone(width: int, height: int) -> None:
    # 72 MP is under Pillow's own bomb threshold: decode_image's max_pixels must refuse it by itself,
    # from the header (the file carries one short row, so a decode attempt would fail differently).
    with pytest.raises(ImageError, match="pixel"):
        decode_image(fx.png_huge_header(width, height))


def test_custom_pixel_limit() -> None:
    with pytest.raises(ImageError, match="limit"):
        decode_image(fx.png(64, 64), max_pixels=64 * 63)
    assert decode_image(fx.png(64, 64), max_pixels=64 * 64).width == 64


def test_byte_limit_is_payload_too_large() -> None:
    data = fx.png(64, 64)
    with pytest.raises(PayloadTooLarge):
        decode_image(data, max_bytes=len(data) - 1)


def test_unsupported_formats_are_refused_before_parsing() -> None:
    import io

    from PIL import Image

    for fmt in ("PPM", "TGA", "ICO", "PCX"):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, fmt)
        with pytest.raises(ImageError, match="supported format"):
            decode_image(buf.getvalue())


def test_small_random_corruptions_never_escape_as_untyped_errors() -> None:
    """A short deterministic fuzz over every valid fixture (the long one found the TIFF TypeError)."""
    import contextlib
    import random
    import warnings

    seeds = [fx.exif_rotated_jpeg(), fx.png(16, 16), fx.animated_gif(), fx.webp(16, 16),
             fx.solid("TIFF", 16, 16), fx.solid("BMP", 16, 16), fx.palette_alpha_png(), fx.cmyk_jpeg()]
    rng = random.Random(1234)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(400):
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            with contextlib.suppress(RubricSearchError):
                decode_image(bytes(data[: rng.randrange(1, len(data) + 1)]))
