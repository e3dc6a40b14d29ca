"""Upload, zip and folder sources: listing, per-item errors, and the defences against hostile inputs."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import struct
import tracemalloc
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from rubricsearch.indexer.sources import FolderSource, Source, SourceItem, SourceLimits, UploadSource, ZipSource
from rubricsearch.indexer.sources.archive import unsafe_name_reason
from rubricsearch.indexer.sources.base import read_limited
from rubricsearch.retrieval.errors import Forbidden, InvalidInput, NotFound, PayloadTooLarge, UnsupportedMedia
from rubricsearch.retrieval.images import decode_image
from tests import fixtures_images as fx

pytestmark = pytest.mark.timeout(60)
MiB = 1024 * 1024
GiB = 1024 * MiB


# --- a raw zip writer: headers can say whatever a hostile archive says -------------------------------


@dataclass
class RawEntry:
    name: str
    payload: bytes = b""  # the bytes stored (already compressed for method 8)
    method: int = 0
    crc: int | None = None
    file_size: int | None = None  # declared uncompressed size
    flags: int = 0
    mode: int = stat.S_IFREG | 0o644


def raw_zip(entries: list[RawEntry], *, declared_count: int | None = None) -> bytes:
    out = io.BytesIO()
    central = io.BytesIO()
    for e in entries:
        name = e.name.encode("utf-8")
        crc = zlib.crc32(e.payload) if e.crc is None else e.crc
        size = len(e.payload) if e.file_size is None else e.file_size
        offset = out.tell()
        out.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, e.flags | 0x800, e.method, 0, 0x21,
                              crc, len(e.payload), size, len(name), 0) + name + e.payload)
        central.write(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", (3 << 8) | 20, 20, e.flags | 0x800,
                                  e.method, 0, 0x21, crc, len(e.payload), size, len(name), 0, 0, 0, 0,
                                  e.mode << 16, offset) + name)
    cd_offset, cd = out.tell(), central.getvalue()
    count = len(entries) if declared_count is None else declared_count
    out.write(cd + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(cd), cd_offset, 0))
    return out.getvalue()


def zeros_deflate(total: int) -> bytes:
    """A raw deflate stream of ``total`` zero bytes (a multiple of 1 MiB), built in milliseconds."""
    unit_co = zlib.compressobj(9, zlib.DEFLATED, -15)
    unit = unit_co.compress(b"\0" * MiB) + unit_co.flush(zlib.Z_FULL_FLUSH)  # self-contained blocks
    return unit * (total // MiB) + zlib.compressobj(9, zlib.DEFLATED, -15).flush()


def zeros_crc(total: int) -> int:
    crc, block = 0, b"\0" * MiB
    for _ in range(total // MiB):
        crc = zlib.crc32(block, crc)
    return crc


def normal_zip(files: dict[str, bytes], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def load_all(items: list[SourceItem]) -> dict[str, bytes | Exception]:
    results: dict[str, bytes | Exception] = {}
    for item in items:
        try:
            results[item.ref] = item.load()
        except Exception as exc:  # recorded, like the job runner does
            results[item.ref] = exc
    return results


# --- uploads --------------------------------------------------------------------------------------


def test_uploads_keep_display_names_only_and_fail_per_item() -> None:
    big = fx.png(300, 300)
    source = UploadSource(
        [("C:\\fakepath\\a.png", fx.png()), ("../../etc/a.png", fx.jpeg()), ("", b""), ("big.png", big)],
        SourceLimits(max_item_bytes=len(big) - 1),
    )
    assert isinstance(source, Source)
    assert [i.ref for i in source.items()] == ["a.png", "a.png#2", "upload-3", "big.png"]
    results = load_all(list(source.items()))
    assert decode_image(results["a.png"]).format == "PNG"  # type: ignore[arg-type]
    assert decode_image(results["a.png#2"]).format == "JPEG"  # type: ignore[arg-type]
    assert type(results["upload-3"]).__name__ == "ImageError"
    assert isinstance(results["big.png"], PayloadTooLarge)
    with pytest.raises(NotFound):
        source.load("nope.png")


def test_uploads_count_and_total_limits_refuse_the_source() -> None:
    with pytest.raises(PayloadTooLarge):
        UploadSource([(f"{i}.png", b"x") for i in range(3)], SourceLimits(max_items=2))
    with pytest.raises(PayloadTooLarge):
        UploadSource([("a.png", b"x" * 10), ("b.png", b"x" * 10)], SourceLimits(max_total_bytes=15))


# --- zip ------------------------------------------------------------------------------------------


def test_zip_lists_images_skips_the_rest_and_loads_each_entry() -> None:
    archive = normal_zip({
        "photos/": b"",
        "photos/b.png": fx.png(color=fx.BLUE),
        "photos/a.jpg": fx.jpeg(),
        "notes.txt": b"hello",
        "inner.zip": normal_zip({"x.png": fx.png()}),
        "__MACOSX/photos/._a.jpg": b"\0\x05\x16\x07",
        "holiday.jpg": fx.text_named_jpg()[1],
    })
    with ZipSource(archive) as source:
        assert source.refs() == ["photos/b.png", "photos/a.jpg", "holiday.jpg"]
        assert len(source) == 3
        reasons = {s.ref: s.reason for s in source.skipped}
        assert "nested" in reasons["inner.zip"] and "not an image" in reasons["notes.txt"]
        assert reasons["__MACOSX/photos/._a.jpg"] == "macOS metadata"
        assert decode_image(source.load("photos/b.png")).image.getpixel((1, 1)) == fx.BLUE
        # The .jpg name does not make text an image: the bytes load, decoding refuses them.
        with pytest.raises(InvalidInput):
            decode_image(source.load("holiday.jpg"))


def test_zip_unsafe_entries_fail_alone() -> None:
    good = fx.png()
    archive = raw_zip([
        RawEntry("ok.png", good),
        RawEntry("/etc/abs.png", good),
        RawEntry("../up.png", good),
        RawEntry("a/../../up2.png", good),
        RawEntry("..\\win.png", good),
        RawEntry("C:/drive.png", good),
        RawEntry("link.png", b"/etc/passwd", mode=stat.S_IFLNK | 0o777),
        RawEntry("fifo.png", b"", mode=stat.S_IFIFO | 0o644),
        RawEntry("", good),
    ])
    source = ZipSource(archive)
    results = load_all(list(source.items()))
    assert results.pop("ok.png") == good
    assert len(results) == 8 and "(empty name)" in results
    for ref, result in results.items():
        assert isinstance(result, InvalidInput), ref
    assert "symbolic link" in str(results["link.png"])


@pytest.mark.parametrize("name,reason", [("a/b.png", None), ("a/..b.png", None), ("x/../y.png", "'..'"),
                                         ("\\\\server\\share.png", "absolute"), ("a\x00.png", "NUL")])
def test_unsafe_name_reason(name: str, reason: str | None) -> None:
    result = unsafe_name_reason(name)
    assert (result is None) if reason is None else (reason in (result or ""))


def test_zip_that_is_not_a_zip_is_refused_at_open() -> None:
    for junk in (b"", b"not a zip at all", fx.png(), normal_zip({"a.png": fx.png()})[:-30]):
        with pytest.raises(InvalidInput, match="zip"):
            ZipSource(junk)


def test_zip_archive_size_and_entry_count_limits() -> None:
    archive = normal_zip({f"{i}.png": fx.png_1x1() for i in range(11)})
    with pytest.raises(PayloadTooLarge, match="entries"):
        ZipSource(archive, SourceLimits(max_items=10))
    with pytest.raises(PayloadTooLarge, match="archive"):
        ZipSource(archive, max_archive_bytes=len(archive) - 1)
    # An end record that under-declares its entries is caught once the directory is parsed.
    lying = raw_zip([RawEntry(f"{i}.png", b"x") for i in range(11)], declared_count=1)
    with pytest.raises(PayloadTooLarge):
        ZipSource(lying, SourceLimits(max_items=10))


def test_zip_bomb_one_gib_of_zeros_fails_cleanly_without_inflating() -> None:
    size = GiB
    bomb = raw_zip([RawEntry("bomb.png", zeros_deflate(size), method=8, crc=zeros_crc(size), file_size=size),
                    RawEntry("fine.png", fx.png())])
    assert len(bomb) < 2 * MiB
    tracemalloc.start()
    try:
        source = ZipSource(bomb)  # default limits: the entry's declared size exceeds the per-item cap
        with pytest.raises(PayloadTooLarge):
            source.load("bomb.png")
        assert decode_image(source.load("fine.png")).format == "PNG"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MiB, peak
    # With a large per-item cap, the declared total refuses the whole archive up front.
    with pytest.raises(PayloadTooLarge, match=r"holds \d+ bytes"):
        ZipSource(bomb, SourceLimits(max_item_bytes=2 * GiB, max_total_bytes=512 * MiB))


def test_zip_bomb_with_lying_sizes_is_cut_at_the_declared_size() -> None:
    # The directory claims 1 MiB; the stream would inflate to 1 GiB. Reading stops at the claim: with the
    # bomb's real checksum that is a clean per-item error, with a checksum of the claimed prefix it is
    # exactly the claimed bytes. Either way memory stays bounded by the cap.
    stream = zeros_deflate(GiB)
    bad_crc = raw_zip([RawEntry("liar.png", stream, method=8, crc=zeros_crc(GiB), file_size=MiB)])
    prefix_crc = raw_zip([RawEntry("liar.png", stream, method=8, crc=zeros_crc(MiB), file_size=MiB)])
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match="corrupt"):
            ZipSource(bad_crc, SourceLimits(max_item_bytes=2 * MiB)).load("liar.png")
        assert ZipSource(prefix_crc, SourceLimits(max_item_bytes=2 * MiB)).load("liar.png") == b"\0" * MiB
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MiB, peak


def test_zip_overlapping_entries_count_their_declared_sizes() -> None:
    # Many directory entries pointing at one local file: the classic overlapping-file bomb.
    entry = RawEntry("a.png", zeros_deflate(64 * MiB), method=8, crc=zeros_crc(64 * MiB), file_size=64 * MiB)
    archive = bytearray(raw_zip([entry]))
    eocd = archive.rfind(b"PK\x05\x06")
    cd_at = struct.unpack_from("<L", archive, eocd + 16)[0]
    record = bytes(archive[cd_at:eocd])
    many = bytes(archive[:cd_at]) + record * 100
    many += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 100, 100, len(record) * 100, cd_at, 0)
    with pytest.raises(PayloadTooLarge):
        ZipSource(many, SourceLimits(max_item_bytes=128 * MiB, max_total_bytes=GiB))


def test_corrupted_archives_only_ever_raise_typed_errors() -> None:
    """A short deterministic fuzz (a 30k-case run found zipfile's NotImplementedError and IndexError)."""
    import random

    seeds = [normal_zip({"a.png": fx.png(), "d/b.jpg": fx.jpeg(), "c.txt": b"hi"}),
             normal_zip({"a.png": fx.png()}, method=zipfile.ZIP_STORED)]
    rng = random.Random(99)
    for _ in range(300):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            source = ZipSource(bytes(data))
        except (InvalidInput, PayloadTooLarge):
            continue
        for item in source.items():
            with contextlib.suppress(InvalidInput):  # ImageError, UnsupportedMedia, PayloadTooLarge too
                item.load()


def test_read_limited_enforces_the_cap_whatever_was_declared() -> None:
    assert read_limited(io.BytesIO(b"x" * 100), 100, "r") == b"x" * 100
    with pytest.raises(PayloadTooLarge):
        read_limited(io.BytesIO(b"x" * 101), 100, "r")


def test_zip_entries_with_other_methods_or_encryption_fail_alone() -> None:
    bz = normal_zip({"b.png": fx.png()}, method=zipfile.ZIP_BZIP2)
    with pytest.raises(UnsupportedMedia, match="compression"):
        ZipSource(bz).load("b.png")
    enc = raw_zip([RawEntry("e.png", fx.png(), flags=0x1), RawEntry("ok.png", fx.png())])
    source = ZipSource(enc)
    with pytest.raises(UnsupportedMedia, match="encrypted"):
        source.load("e.png")
    assert source.load("ok.png") == fx.png()


def test_zip_corrupt_entry_and_duplicates() -> None:
    png = fx.png()
    stream = bytearray(zlib.compress(png)[2:-4])
    stream[len(stream) // 2] ^= 0xFF
    archive = raw_zip([RawEntry("bad.png", bytes(stream), method=8, crc=zlib.crc32(png), file_size=len(png)),
                       RawEntry("d.png", png), RawEntry("d.png", fx.jpeg())])
    source = ZipSource(archive)
    assert source.refs() == ["bad.png", "d.png", "d.png#2"]
    with pytest.raises(InvalidInput, match="corrupt"):
        source.load("bad.png")
    assert source.load("d.png") == png and source.load("d.png#2") == fx.jpeg()


def test_zip_from_a_path_is_closed_by_the_context_manager(tmp_path: Path) -> None:
    path = tmp_path / "set.zip"
    path.write_bytes(normal_zip({"a.png": fx.png()}))
    with ZipSource(path) as source:
        assert source.load("a.png") == fx.png()
    with pytest.raises(InvalidInput, match="closed"):
        source.load("a.png")


# --- folder ---------------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "allowed"
    outside = tmp_path / "outside"
    (root / "set" / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.png").write_bytes(fx.png(color=fx.GREEN))
    (root / "set" / "a.png").write_bytes(fx.png())
    (root / "set" / "sub" / "b.JPG").write_bytes(fx.jpeg())
    (root / "set" / "readme.md").write_text("hi")
    (root / "set" / ".hidden.png").write_bytes(fx.png())
    (root / "set" / "leak.png").symlink_to(outside / "secret.png")
    (root / "set" / "inside-link.png").symlink_to(root / "set" / "a.png")
    (root / "set" / "outdir").symlink_to(outside, target_is_directory=True)
    os.mkfifo(root / "set" / "pipe.png")
    return root, outside


def test_folder_walks_images_under_the_root(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    source = FolderSource("set", allowed_root=root)
    assert source.refs() == ["a.png", "inside-link.png", "leak.png", "sub/b.JPG"]
    reasons = {s.ref: s.reason for s in source.skipped}
    assert set(reasons) == {".hidden.png", "outdir", "pipe.png", "readme.md"}
    assert "not followed" in reasons["outdir"] and "regular" in reasons["pipe.png"]
    results = load_all(list(source.items()))
    assert results["a.png"] == fx.png() == results["inside-link.png"]
    assert results["sub/b.JPG"] == fx.jpeg()
    assert isinstance(results["leak.png"], Forbidden)


def test_folder_outside_the_root_is_forbidden(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    for path in (outside, root / ".." / "outside", "../outside", root / "set" / "outdir", "/"):
        with pytest.raises(Forbidden):
            FolderSource(path, allowed_root=root)
    with pytest.raises(Forbidden, match="disabled"):
        FolderSource(root, allowed_root=None)
    with pytest.raises(NotFound):
        FolderSource("missing", allowed_root=root)


def test_folder_file_swapped_for_a_link_after_listing_is_refused(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    source = FolderSource(root / "set", allowed_root=root)
    (root / "set" / "a.png").unlink()
    (root / "set" / "a.png").symlink_to(outside / "secret.png")
    with pytest.raises(Forbidden):
        source.load("a.png")
    # A directory swapped for a link is refused too (the per-component O_NOFOLLOW open).
    (root / "set" / "sub").rename(root / "set" / "sub-old")
    (root / "set" / "sub").symlink_to(root / "set" / "sub-old", target_is_directory=True)
    assert source.load("sub/b.JPG") == fx.jpeg()  # the link stays inside: allowed after re-resolving
    (root / "set" / "sub-old" / "b.JPG").unlink()
    with pytest.raises(NotFound):
        source.load("sub/b.JPG")


def test_folder_limits(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    with pytest.raises(PayloadTooLarge):
        FolderSource("set", allowed_root=root, limits=SourceLimits(max_items=2))
    small = FolderSource("set", allowed_root=root, limits=SourceLimits(max_item_bytes=100))
    with pytest.raises(PayloadTooLarge):
        small.load("a.png")
    with pytest.raises(PayloadTooLarge):
        FolderSource("set", allowed_root=root, limits=SourceLimits(max_total_bytes=100))
