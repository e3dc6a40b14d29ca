"""A zip archive of images, read without ever trusting what its headers claim.

Defences, in the order an archive meets them: the archive's own size; the entry count and central
directory size from the end record (checked *before* :mod:`zipfile` builds one object per entry); the
declared uncompressed total; per entry a path check (absolute, ``..``, drive letters, NUL), symlink and
special-file modes, encryption and compression method (only stored and deflate: bzip2/lzma decompress a
whole input chunk at once, so one 4 KiB read can expand to gigabytes); and finally every read is capped
by :func:`~indexer.sources.base.read_limited`, whatever size the entry declared. Nothing is extracted to
disk and nested archives are never opened.
"""

from __future__ import annotations

import io
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Container
from pathlib import Path
from typing import BinaryIO

from rubricsearch.indexer.names import clean_name
from rubricsearch.indexer.sources.base import IMAGE_EXTENSIONS, ListedSource, SourceLimits, extension, read_limited
from rubricsearch.retrieval.errors import InvalidInput, PayloadTooLarge, RubricSearchError, UnsupportedMedia

DEFAULT_MAX_ARCHIVE_BYTES = 4 * 1024**3
# The smallest central directory record is 46 bytes; real ones (name + extra fields) average far less
# than this bound, which caps how many ZipInfo objects a lying end record can make zipfile allocate.
MAX_CENTRAL_DIRECTORY_BYTES_PER_ENTRY = 1024
ARCHIVE_EXTENSIONS = frozenset({".zip", ".jar", ".7z", ".rar", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst"})
_READABLE_METHODS = frozenset({zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED})
_EOCD = struct.Struct("<4s4H2LH")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")


def unsafe_name_reason(name: str) -> str | None:
    """Why an entry name is not acceptable as a relative path, or ``None`` if it is."""
    if not name:
        return "entry has an empty name"
    if "\x00" in name:
        return "entry name contains a NUL byte"
    unified = name.replace("\\", "/")
    if unified.startswith("/") or (len(unified) > 1 and unified[1] == ":"):
        return "entry has an absolute path"
    if ".." in unified.split("/"):
        return "entry path contains a '..' component"
    return None


def _entry_mode_reason(info: zipfile.ZipInfo) -> str | None:
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    if kind == stat.S_IFLNK:
        return "entry is a symbolic link"
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        return "entry is not a regular file"
    return None


def central_directory_stats(fp: BinaryIO) -> tuple[int, int] | None:
    """(declared entry count, central directory bytes) from the end records, or ``None`` if absent."""
    fp.seek(0, os.SEEK_END)
    size = fp.tell()
    tail_len = min(size, _EOCD.size + 0xFFFF)
    fp.seek(size - tail_len)
    tail = fp.read(tail_len)
    pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 or len(tail) - pos < _EOCD.size:
        return None
    _, _, _, _, count, cd_size, _, _ = _EOCD.unpack_from(tail, pos)
    if count == 0xFFFF or cd_size == 0xFFFFFFFF:
        loc_at = size - tail_len + pos - _ZIP64_LOCATOR.size
        if loc_at < 0:
            return None
        fp.seek(loc_at)
        sig, _, eocd64_at, _ = _ZIP64_LOCATOR.unpack(fp.read(_ZIP64_LOCATOR.size))
        if sig != b"PK\x06\x07" or eocd64_at + _ZIP64_EOCD.size > size:
            return None
        fp.seek(eocd64_at)
        record = _ZIP64_EOCD.unpack(fp.read(_ZIP64_EOCD.size))
        if record[0] != b"PK\x06\x06":
            return None
        count, cd_size = record[7], record[8]
    return count, cd_size


class ZipSource(ListedSource):
    """Images inside one zip archive (bytes, a path or a seekable binary file)."""

    kind = "zip"

    def __init__(
        self,
        archive: bytes | str | os.PathLike[str] | BinaryIO,
        limits: SourceLimits | None = None,
        *,
        max_archive_bytes: int = DEFAULT_MAX_ARCHIVE_BYTES,
    ) -> None:
        super().__init__(limits or SourceLimits())
        self._members: dict[str, zipfile.ZipInfo] = {}
        self._refusals: dict[str, RubricSearchError] = {}
        self._owned: BinaryIO | None = None
        self._closed = False
        fp = self._open_file(archive)
        try:
            self._check_archive(fp, max_archive_bytes)
            self._zip = zipfile.ZipFile(fp)
        except RubricSearchError:
            self.close()
            raise
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, struct.error,
                NotImplementedError, RuntimeError) as exc:  # NotImplementedError: "zip file version 9.0"
            self.close()
            raise InvalidInput(f"the archive is not a readable zip file: {exc}") from exc
        try:
            self._list()
        except BaseException:
            self.close()
            raise

    def _open_file(self, archive: bytes | str | os.PathLike[str] | BinaryIO) -> BinaryIO:
        if isinstance(archive, bytes | bytearray | memoryview):
            return io.BytesIO(bytes(archive))
        if isinstance(archive, str | os.PathLike):
            path = Path(archive)
            if not path.is_file():
                raise InvalidInput(f"archive {path.name} is not a file")
            self._owned = path.open("rb")
            return self._owned
        return archive

    def _check_archive(self, fp: BinaryIO, max_archive_bytes: int) -> None:
        size = fp.seek(0, os.SEEK_END)
        if size > max_archive_bytes:
            raise PayloadTooLarge(
                f"the archive is {size} bytes; the limit is {max_archive_bytes}", limit=max_archive_bytes
            )
        stats = central_directory_stats(fp)
        fp.seek(0)
        if stats is None:
            raise InvalidInput("the archive is not a zip file (no end of central directory record)")
        count, cd_size = stats
        cap = self.limits.max_items
        if count > cap or cd_size > max(cap, 1) * MAX_CENTRAL_DIRECTORY_BYTES_PER_ENTRY:
            raise PayloadTooLarge(
                f"the archive declares {count} entries ({cd_size} directory bytes); the limit is {cap}",
                limit=cap,
            )

    def _list(self) -> None:
        infos = self._zip.infolist()
        if len(infos) > self.limits.max_items:
            raise PayloadTooLarge(
                f"the archive has {len(infos)} entries; the limit is {self.limits.max_items}",
                limit=self.limits.max_items,
            )
        declared = 0
        for info in infos:
            name = info.filename
            reason = unsafe_name_reason(name) or _entry_mode_reason(info)
            if reason is not None:
                ref = self._add(name or "(empty name)")
                self._refusals[ref] = InvalidInput(f"{ref}: {reason}", ref=ref)
                continue
            if name.endswith(("/", "\\")) or stat.S_ISDIR(info.external_attr >> 16):
                continue
            base = name.replace("\\", "/").rsplit("/", 1)[-1]
            ext = extension(base)
            if name.startswith("__MACOSX/") or base.startswith("._"):
                self._skip(name, "macOS metadata")
            elif ext in ARCHIVE_EXTENSIONS:
                self._skip(name, "nested archives are not opened")
            elif ext not in IMAGE_EXTENSIONS:
                self._skip(name, f"not an image file name ({ext or 'no extension'})")
            else:
                ref = self._add(clean_name(name) or "(unprintable name)", info.file_size)  # shown, never a path
                refusal = self._entry_refusal(info, ref, self.limits.max_item_bytes)
                if refusal is None:
                    self._members[ref] = info
                    declared += info.file_size
                else:
                    self._refusals[ref] = refusal
        self._check_declared_total(declared)

    def _entry_refusal(self, info: zipfile.ZipInfo, ref: str, limit: int) -> RubricSearchError | None:
        if info.flag_bits & 0x1:
            return UnsupportedMedia(f"{ref}: encrypted entries are not read", ref=ref)
        if info.compress_type not in _READABLE_METHODS:
            return UnsupportedMedia(
                f"{ref}: compression method {info.compress_type} is not accepted (use stored or deflate)",
                ref=ref,
            )
        if info.file_size > limit:
            return PayloadTooLarge(
                f"{ref} declares {info.file_size} bytes uncompressed; the limit is {limit}",
                limit=limit,
                ref=ref,
            )
        return None

    def _load(self, ref: str) -> bytes:
        refusal = self._refusals.get(ref)
        if refusal is not None:
            raise type(refusal)(refusal.message, **refusal.details)
        return self._read(self._members[ref], self.limits.max_item_bytes, ref)

    def root_file(self, names: Container[str], max_bytes: int) -> tuple[str, bytes] | None:
        """The first entry at the archive's root whose lower-cased name is in ``names`` (a manifest), read under
        ``max_bytes`` whatever its header claims; ``None`` when there is none."""
        for info in self._zip.infolist():
            if info.filename.lower() in names:
                if info.file_size > max_bytes:
                    raise PayloadTooLarge(f"{info.filename} is over {max_bytes} bytes", limit=max_bytes)
                refusal = self._entry_refusal(info, info.filename, max_bytes)
                if refusal is not None:
                    raise refusal
                return info.filename, self._read(info, max_bytes, info.filename)
        return None

    def _read(self, info: zipfile.ZipInfo, limit: int, ref: str) -> bytes:
        if self._closed:
            raise InvalidInput(f"{ref}: the archive source is closed", ref=ref)
        try:
            with self._zip.open(info) as stream:
                return read_limited(stream, limit, ref)  # type: ignore[arg-type]
        except RubricSearchError:
            raise
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, RuntimeError,
                NotImplementedError) as exc:
            raise InvalidInput(f"{ref}: the archive entry is corrupt: {exc}", ref=ref) from exc

    def close(self) -> None:
        self._closed = True
        zf = getattr(self, "_zip", None)
        if zf is not None:
            zf.close()
        if self._owned is not None:
            self._owned.close()
            self._owned = None
