"""Generators of normal and hostile test images, built in memory (no binary files in the repository).

Each function returns the bytes of one file; the docstring says what a correct decoder must do with it.
"""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image

RGB = tuple[int, int, int]
RED: RGB = (220, 20, 20)
GREEN: RGB = (20, 200, 20)
BLUE: RGB = (20, 20, 220)


def _save(img: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **params)
    return buf.getvalue()


def solid(fmt: str = "PNG", width: int = 64, height: int = 48, color: RGB = RED) -> bytes:
    """A valid single-colour image in ``fmt`` (``JPEG``, ``PNG``, ``WEBP``, ``GIF``, ``BMP``, ``TIFF``)."""
    params: dict[str, object] = {"quality": 95} if fmt in ("JPEG", "WEBP") else {}
    return _save(Image.new("RGB", (width, height), color), fmt, **params)


def jpeg(width: int = 64, height: int = 48, color: RGB = RED) -> bytes:
    return solid("JPEG", width, height, color)


def png(width: int = 64, height: int = 48, color: RGB = RED) -> bytes:
    return solid("PNG", width, height, color)


def webp(width: int = 64, height: int = 48, color: RGB = RED) -> bytes:
    return solid("WEBP", width, height, color)


def zero_bytes() -> bytes:
    """Empty file: ImageError."""
    return b""


def truncated_jpeg() -> bytes:
    """The first half of a noisy JPEG (no EOI, missing scan data): ImageError, never grey padding."""
    noisy = Image.effect_noise((256, 256), 80).convert("RGB")
    data = _save(noisy, "JPEG", quality=90)
    return data[: len(data) // 2]


def png_1x1(color: RGB = BLUE) -> bytes:
    """The smallest valid image: decodes to one RGB pixel."""
    return png(1, 1, color)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_huge_header(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose IHDR (with a valid CRC) claims ``width`` x ``height``: refused before any allocation."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" + b"\x00" * 3 * 8)  # one short row: the header alone must refuse it
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def jpeg_huge_header(width: int = 65_000, height: int = 65_000) -> bytes:
    """A small JPEG whose SOF0 frame header is patched to claim ``width`` x ``height``."""
    data = bytearray(jpeg(16, 16))
    sof = data.find(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, height, width)
    return bytes(data)


def bmp_huge_header(width: int = 60_000, height: int = 60_000) -> bytes:
    """A BMP whose info header claims ``width`` x ``height`` with almost no pixel data behind it."""
    data = bytearray(solid("BMP", 4, 4))
    struct.pack_into("<ii", data, 18, width, height)
    return bytes(data)


def png_text_bomb(inflated: int = 64 * 1024 * 1024) -> bytes:
    """A valid 8x8 PNG carrying a zTXt chunk that inflates to ``inflated`` bytes (Pillow caps text chunks)."""
    base = png(8, 8)
    ztxt = b"Comment\x00\x00" + zlib.compress(b"A" * inflated, 9)
    iend = base.rfind(b"IEND") - 4
    return base[:iend] + _chunk(b"zTXt", ztxt) + base[iend:]


def cmyk_jpeg(color_cmyk: tuple[int, int, int, int] = (0, 255, 255, 0)) -> bytes:
    """A CMYK JPEG; decodes to RGB. The default ink (no cyan, full magenta and yellow) is red."""
    return _save(Image.new("CMYK", (32, 24), color_cmyk), "JPEG", quality=95)


def png_16bit(value: int = 32768, width: int = 20, height: int = 10) -> bytes:
    """A 16-bit greyscale PNG (mode ``I;16``) of one value: decodes to the grey ``value / 257``."""
    img = Image.frombytes("I;16", (width, height), struct.pack("<H", value) * (width * height))
    return _save(img, "PNG")


def png_16bit_gradient(width: int = 256, height: int = 4) -> bytes:
    """A 16-bit greyscale ramp from 0 to 65535 left to right."""
    row = b"".join(struct.pack("<H", round(x * 65535 / (width - 1))) for x in range(width))
    return _save(Image.frombytes("I;16", (width, height), row * height), "PNG")


def palette_alpha_png(width: int = 16, height: int = 8) -> bytes:
    """Palette PNG with tRNS: left half index 0 (red, fully transparent), right half index 1 (opaque blue).

    A correct decoder composites on white: left half white, right half blue.
    """
    img = Image.new("P", (width, height), 0)
    img.putpalette([*RED, *BLUE] + [0, 0, 0] * 254)
    img.paste(1, (width // 2, 0, width, height))
    return _save(img, "PNG", transparency=bytes([0, 255]))


def rgba_half_transparent_png(width: int = 8, height: int = 8) -> bytes:
    """RGBA PNG of pure black at alpha 0: composites to white."""
    return _save(Image.new("RGBA", (width, height), (0, 0, 0, 0)), "PNG")


def exif_rotated_jpeg(width: int = 60, height: int = 40, orientation: int = 6) -> bytes:
    """A ``width`` x ``height`` JPEG, red in the stored top-left quadrant, EXIF Orientation = ``orientation``.

    Orientation 6 means "rotate 90° clockwise to display": the decoded image is ``height`` x ``width`` and
    the red quadrant appears at the top right.
    """
    img = Image.new("RGB", (width, height), (240, 240, 240))
    img.paste(RED, (0, 0, width // 2, height // 2))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(img, "JPEG", quality=95, exif=exif.tobytes())


def animated_gif(colors: tuple[RGB, ...] = (RED, GREEN, BLUE), size: tuple[int, int] = (24, 16)) -> bytes:
    """An animated GIF, one solid frame per colour: decodes to the first frame."""
    frames = [Image.new("RGB", size, c) for c in colors]
    return _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def non_image_bytes() -> bytes:
    """Binary garbage with no image signature."""
    return bytes((i * 37 + 11) % 256 for i in range(4096))


def text_named_jpg() -> tuple[str, bytes]:
    """An HTML/script text file wearing a ``.jpg`` name: the name must never make it an image."""
    return "holiday.jpg", b"<html><body><script>alert(document.cookie)</script></body></html>\n"


def gif_js_polyglot() -> bytes:
    """A GIF header that is also JavaScript (``GIF89a=...``) with no real image data: ImageError."""
    return b"GIF89a/*\x01\x00\x01\x00\x00\x00\x00*/=1;alert(document.domain);//" + b"\x00" * 8


def jpeg_with_trailing_html() -> bytes:
    """A valid JPEG followed by an HTML payload: decodes (the payload is past EOI) to the JPEG's pixels.

    Whoever serves stored originals back must send them with an image type and ``nosniff``.
    """
    return jpeg(16, 16, GREEN) + b"<html><script>alert(1)</script></html>"


def gif_huge_screen() -> bytes:
    """A GIF whose logical screen claims 65535 x 65535 around a 1x1 frame."""
    data = bytearray(solid("GIF", 1, 1))
    struct.pack_into("<HH", data, 6, 65535, 65535)
    return bytes(data)


def tiff_rational_strip_offsets() -> bytes:
    """A TIFF whose StripOffsets tag is typed RATIONAL: Pillow 13 raises a bare TypeError in ``load``.

    Found by fuzzing :func:`retrieval.images.decode_image`; it must become an ImageError.
    """
    data = bytearray(solid("TIFF", 4, 4))
    ifd = struct.unpack_from("<I", data, 4)[0]
    for i in range(struct.unpack_from("<H", data, ifd)[0]):
        at = ifd + 2 + 12 * i
        tag, _, count, _ = struct.unpack_from("<HHII", data, at)
        if tag == 273:  # StripOffsets -> type 5 (RATIONAL), value at offset 8
            struct.pack_into("<HHII", data, at, tag, 5, count, 8)
    return bytes(data)


def png_corrupt_pixels() -> bytes:
    """A PNG with a valid header and an eXIf (orientation 6) behind image data that is not a zlib stream: the header
    check passes it (it reads no pixels), the decode refuses it: ImageError, a per-item error at ingestion."""
    data = png(24, 16)
    start = data.index(b"IDAT") - 4
    length = struct.unpack(">I", data[start:start + 4])[0]
    exif = Image.Exif()
    exif[0x0112] = 6
    body = b"\x78\x9c" + b"\xff" * length
    return (data[:start] + _chunk(b"IDAT", body) + _chunk(b"eXIf", exif.tobytes()[6:])
            + data[start + 12 + length:])
