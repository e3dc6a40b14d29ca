"""A PNG's EXIF orientation is read without decoding its pixels, and it is the orientation Pillow's ``getexif()``
gives (and the decode applies) for every PNG: eXIf before or after the image data, none, EXIF or XMP in text
chunks, animations, malformed chunk lists. ``getexif()`` itself decodes the whole image when the eXIf chunk may
follow the image data; the header check must not (``inspect_image`` runs before every ingested image's decode)."""

from __future__ import annotations

import io
import random
import struct
import warnings
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from PIL import Image

import rubricsearch.retrieval.image_probe as probe
from rubricsearch.retrieval.errors import ImageError
from rubricsearch.retrieval.images import EncodedImage, decode_image, inspect_image
from tests import fixtures_images as fx

pytestmark = pytest.mark.timeout(60)

Chunk = tuple[bytes, bytes]
_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunks(data: bytes) -> list[Chunk]:
    out, pos = [], len(_SIGNATURE)
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        out.append((data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]))
        pos += 12 + length
    return out


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png(chunks: list[Chunk]) -> bytes:
    return _SIGNATURE + b"".join(_chunk(kind, body) for kind, body in chunks)


def _plain(width: int = 40, height: int = 24, *, seed: int = 0, **params: object) -> list[Chunk]:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG", **params)
    return _chunks(buf.getvalue())


def _exif_body(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()[6:]  # an eXIf chunk holds the TIFF structure without the "Exif\0\0" marker


def _after_pixels(chunks: list[Chunk], *extra: Chunk) -> list[Chunk]:
    """``extra`` between the last IDAT and IEND (where a camera app or an editor may append metadata)."""
    return [*chunks[:-1], *extra, chunks[-1]]


def _before_pixels(chunks: list[Chunk], *extra: Chunk) -> list[Chunk]:
    first = next(i for i, (kind, _) in enumerate(chunks) if kind == b"IDAT")
    return [*chunks[:first], *extra, *chunks[first:]]


def _split_idat(chunks: list[Chunk], parts: int) -> list[Chunk]:
    """The image data spread over several IDAT chunks, as encoders with a small buffer write it."""
    idat = b"".join(body for kind, body in chunks if kind == b"IDAT")
    step = -(-len(idat) // parts)
    pieces = [(b"IDAT", idat[i:i + step]) for i in range(0, len(idat), step)]
    first = next(i for i, (kind, _) in enumerate(chunks) if kind == b"IDAT")
    return [*chunks[:first], *pieces, *[c for c in chunks[first:] if c[0] != b"IDAT"]]


def _raw_profile(orientation: int) -> bytes:
    """EXIF as ImageMagick writes it into a PNG: hex in a text chunk named "Raw profile type exif"."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = exif.tobytes()
    return f"\nexif\n{len(data):8}\n{data.hex()}\n".encode()


def _xmp(orientation: int) -> bytes:
    xmp = f'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="{orientation}"/></x:xmpmeta>'
    return b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + xmp.encode()


def _apng(exif_at: str) -> bytes:
    """A two-frame animated PNG with an eXIf (orientation 6) after its first frame or at its very end."""
    frames = [Image.new("RGB", (20, 12), colour) for colour in ((200, 0, 0), (0, 0, 200))]
    buf = io.BytesIO()
    frames[0].save(buf, "PNG", save_all=True, append_images=frames[1:])
    chunks = _chunks(buf.getvalue())
    exif = (b"eXIf", _exif_body(6))
    if exif_at == "end":
        return _png(_after_pixels(chunks, exif))
    idat = max(i for i, (kind, _) in enumerate(chunks) if kind == b"IDAT")
    return _png([*chunks[:idat + 1], exif, *chunks[idat + 1:]])


_TURNS = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
          5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
          8: Image.Transpose.ROTATE_90}  # EXIF orientation -> the turn that shows the image upright


def pillow_orientation(data: bytes) -> int | None:
    """What Pillow's ``getexif()`` says (decoding the image where it must), ``None`` where it raises."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = int(Image.open(io.BytesIO(data)).getexif().get(0x0112, 1) or 1)
    except Exception:
        return None
    return value if 1 <= value <= 8 else 1


def inspected_orientation(data: bytes) -> int | None:
    try:
        return inspect_image(data).orientation
    except ImageError:
        return None


PNGS: dict[str, Callable[[], bytes]] = {
    "no exif": lambda: _png(_plain()),
    "interlaced, no exif": lambda: _png(_plain(interlace=1)),
    **{f"eXIf {o} before the image data": (lambda o=o: _png(_before_pixels(_plain(), (b"eXIf", _exif_body(o)))))
       for o in range(1, 9)},
    **{f"eXIf {o} after the image data": (lambda o=o: _png(_after_pixels(_plain(), (b"eXIf", _exif_body(o)))))
       for o in range(1, 9)},
    "eXIf after five IDAT chunks": lambda: _png(_after_pixels(_split_idat(_plain(), 5), (b"eXIf", _exif_body(6)))),
    "eXIf between the image data and an empty IDAT": lambda: _png(_after_pixels(
        _plain(), (b"eXIf", _exif_body(8)), (b"IDAT", b""))),
    "eXIf after the image data, wrong CRC (not checked there)": lambda: _png(_plain()[:-1])
        + _chunk(b"eXIf", _exif_body(3))[:-4] + b"\0\0\0\0" + _chunk(b"IEND", b""),
    "eXIf orientation 9 (out of range)": lambda: _png(_after_pixels(_plain(), (b"eXIf", _exif_body(9)))),
    "eXIf before (no rotation) and after (rotation): the first one counts":
        lambda: _png(_after_pixels(_before_pixels(_plain(), (b"eXIf", _exif_body(1))), (b"eXIf", _exif_body(6)))),
    "raw profile text after the image data": lambda: _png(_after_pixels(
        _plain(), (b"tEXt", b"Raw profile type exif\x00" + _raw_profile(5)))),
    "raw profile zTXt after the image data": lambda: _png(_after_pixels(
        _plain(), (b"zTXt", b"Raw profile type exif\x00\x00" + zlib.compress(_raw_profile(7))))),
    "XMP after the image data": lambda: _png(_after_pixels(_plain(), (b"iTXt", _xmp(6)))),
    "eXIf without orientation before, XMP after": lambda: _png(_after_pixels(
        _before_pixels(_plain(), (b"eXIf", Image.Exif().tobytes()[6:])), (b"iTXt", _xmp(6)))),
    "animation, eXIf after its first frame": lambda: _apng("first frame"),
    "animation, eXIf at its end (past the first frame: not read)": lambda: _apng("end"),
    "unknown private chunk after the image data": lambda: _png(_after_pixels(
        _plain(), (b"prVt", b"\x01" * 50), (b"eXIf", _exif_body(2)))),
    # malformed chunk lists: the same outcome as Pillow's getexif(), an error or a silently ignored rest
    "broken chunk type after the image data": lambda: _png(_after_pixels(_plain(), (b"e!If", _exif_body(6)),
                                                                         (b"eXIf", _exif_body(6)))),
    "eXIf truncated by the end of the file": lambda: _png(_plain()[:-1]) + _chunk(b"eXIf", _exif_body(6))[:20],
    "file ends after the image data": lambda: _png(_plain()[:-1]),
    "eXIf that is not TIFF data": lambda: _png(_after_pixels(_plain(), (b"eXIf", b"not exif at all"))),
    "truncated pHYs after the image data": lambda: _png(_after_pixels(_plain(), (b"pHYs", b"\x00\x01"))),
    "zTXt bomb after the image data": lambda: _png(_after_pixels(
        _plain(), (b"zTXt", b"Comment\x00\x00" + zlib.compress(b"A" * (64 * 1024 * 1024), 9)))),
    "no IDAT at all": lambda: _png([c for c in _plain() if c[0] != b"IDAT"]),
}


@pytest.mark.parametrize("name", sorted(PNGS))
def test_orientation_is_what_pillows_getexif_gives(name: str) -> None:
    data = PNGS[name]()
    expected = pillow_orientation(data)
    assert inspected_orientation(data) == expected
    if expected is None:
        with pytest.raises(ImageError):
            decode_image(data)
        return
    # the decode turns the pixels as stored by the orientation the header check found
    encoded, decoded = EncodedImage(data), decode_image(data)
    assert (encoded.width, encoded.height) == (decoded.width, decoded.height)
    stored = Image.open(io.BytesIO(data)).convert("RGB")
    turned = stored.transpose(_TURNS[expected]) if expected in _TURNS else stored
    assert np.array_equal(np.asarray(decoded.image), np.asarray(turned))


def test_the_orientations_tested_are_not_all_the_same() -> None:
    """The cases above vary what the orientation depends on: most orientations, both places, errors."""
    found = {pillow_orientation(make()) for make in PNGS.values()}
    assert found == {None, *range(1, 9)}
    assert pillow_orientation(PNGS["eXIf 6 after the image data"]()) == 6


@pytest.fixture
def decoders(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the pixel decoders Pillow makes (``zip`` inflates a PNG's image data)."""
    made: list[str] = []
    real = Image._getdecoder

    def counted(mode: str, decoder_name: str, *args: object) -> object:
        made.append(decoder_name)
        return real(mode, decoder_name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Image, "_getdecoder", counted)
    yield made


@pytest.mark.parametrize("name", ["no exif", "eXIf 6 after the image data", "eXIf 3 before the image data",
                                  "XMP after the image data", "animation, eXIf at its end (past the first frame: "
                                  "not read)", "raw profile zTXt after the image data"])
def test_the_header_check_decodes_no_pixels(name: str, decoders: list[str]) -> None:
    data = PNGS[name]()
    decoders.clear()  # making the file used Pillow's decoders
    inspect_image(data)
    EncodedImage(data)
    assert decoders == []
    decode_image(data)
    assert decoders == ["zip"]  # the decode is the first and only one


def test_corrupt_image_data_passes_the_header_check_and_fails_the_decode() -> None:
    """The header check reads around the image data, never into it: only the decode finds it corrupt."""
    corrupt = fx.png_corrupt_pixels()
    info = inspect_image(corrupt)
    assert (info.format, info.width, info.height, info.orientation) == ("PNG", 24, 16, 6)
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode_image(corrupt)


def test_other_formats_decode_no_pixels_in_their_header_check(decoders: list[str]) -> None:
    """JPEG, MPO, WebP and TIFF keep their EXIF in the header (WebP's plugin hands its pixels to a ``raw`` decoder
    once it has decoded them): reading it decodes nothing either."""
    image = Image.new("RGB", (30, 20), (10, 120, 200))
    exif = Image.Exif()
    exif[0x0112] = 6
    for fmt, params in [("JPEG", {}), ("WEBP", {}), ("WEBP", {"lossless": True}), ("TIFF", {}),
                        ("TIFF", {"compression": "tiff_adobe_deflate"}), ("BMP", {}), ("GIF", {}),
                        ("MPO", {"save_all": True, "append_images": [image]})]:
        buf = io.BytesIO()
        image.save(buf, fmt, exif=exif, **params)
        decoders.clear()
        info = inspect_image(buf.getvalue())
        assert info.orientation == (1 if fmt in ("BMP", "GIF") else 6), fmt
        assert decoders == [], fmt


def _pixel_data_end(data: bytes) -> int:
    """The offset just past the last IDAT chunk (its CRC included)."""
    pos = len(_SIGNATURE)
    end = pos
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        if data[pos + 4:pos + 8] == b"IDAT":
            end = pos + 12 + length
        pos += 12 + length
    return end


def test_random_damage_after_the_image_data_matches_pillow() -> None:
    """Bytes flipped or cut anywhere after the image data: the header check's outcome (orientation, or an error)
    is Pillow's own, chunk handler by chunk handler."""
    seeds = [PNGS[name]() for name in ("eXIf 6 after the image data", "raw profile text after the image data",
                                       "XMP after the image data", "eXIf after five IDAT chunks")]
    rng = random.Random(36)
    outcomes = set()
    for _ in range(400):
        seed = rng.choice(seeds)
        start = _pixel_data_end(seed)
        data = bytearray(seed)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(start, len(data))] = rng.randrange(256)
        damaged = bytes(data[: rng.randrange(start, len(data) + 1)])
        expected = pillow_orientation(damaged)
        assert inspected_orientation(damaged) == expected, damaged[start:]
        outcomes.add(expected)
    assert None in outcomes and len(outcomes) >= 3  # the damage did reach errors and other orientations


def test_random_damage_anywhere_is_caught_by_the_header_check_or_the_decode() -> None:
    """Damage in the image data is the decode's to find: the header check may pass such a file, the decode must
    refuse it, and where both pass the orientation is Pillow's."""
    seeds = [PNGS["eXIf 6 after the image data"](), PNGS["eXIf 8 before the image data"](), PNGS["no exif"]()]
    rng = random.Random(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(300):
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            damaged = bytes(data[: rng.randrange(1, len(data) + 1)])
            inspected, expected = inspected_orientation(damaged), pillow_orientation(damaged)
            if inspected is None:
                assert expected is None
            elif expected is None:
                with pytest.raises(ImageError):
                    decode_image(damaged)
            else:
                assert inspected == expected


def test_the_probe_module_owns_the_header_checks() -> None:
    """``retrieval.images`` keeps exporting what its users import (the split changed no import path)."""
    import rubricsearch.retrieval.images as images

    assert images.inspect_image is probe.inspect_image
    assert images.DEFAULT_MAX_BYTES == probe.DEFAULT_MAX_BYTES
    assert images.DEFAULT_MAX_DECODED_PIXELS == probe.DEFAULT_MAX_DECODED_PIXELS
