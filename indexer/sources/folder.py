"""A server-side folder of images, confined to an allowed root that the operator configures.

The folder's real path (symlinks resolved) must lie under the root's real path, or it is refused with
``Forbidden`` before anything about it is revealed. The walk never descends into directory links, skips
hidden entries and special files, and lists image file names only. Each load re-resolves its path and then
opens it one component at a time from the root with ``O_NOFOLLOW``, so a file or directory swapped for a
link after listing cannot make it read outside the root; a FIFO is opened non-blocking and refused.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from rubricsearch.indexer.sources.base import IMAGE_EXTENSIONS, ListedSource, SourceLimits, extension, read_limited
from rubricsearch.retrieval.errors import Forbidden, InvalidInput, NotFound, PayloadTooLarge

MAX_DEPTH = 64
SCAN_FACTOR = 10  # how many directory entries per allowed item the walk may look at before giving up
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def is_within(path: Path, root: Path) -> bool:
    """True if the (already resolved) ``path`` is ``root`` or below it."""
    return path == root or root in path.parents


class FolderSource(ListedSource):
    """Image files under ``path`` (absolute, or relative to ``allowed_root``), walked recursively."""

    kind = "folder"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        allowed_root: str | os.PathLike[str] | None,
        limits: SourceLimits | None = None,
    ) -> None:
        super().__init__(limits or SourceLimits())
        if allowed_root is None:
            raise Forbidden("folder import is disabled: no allowed root is configured")
        self._root = Path(os.path.realpath(allowed_root))
        if not self._root.is_dir():
            raise InvalidInput("the configured allowed root is not a directory")
        wanted = Path(path)
        try:  # a NUL byte, or a name over the file system's limits, is the caller's mistake
            top = Path(os.path.realpath(wanted if wanted.is_absolute() else self._root / wanted))
            if not is_within(top, self._root):
                raise Forbidden(f"{os.fspath(path)[:200]!r} is outside the allowed root for folder imports")
            if not top.is_dir():
                raise NotFound(f"{os.fspath(path)[:200]!r} is not a directory under the allowed root")
        except (ValueError, OSError) as exc:
            raise InvalidInput(f"{os.fspath(path)[:200]!r} is not a usable folder name: {exc}") from None
        self._top = top
        self._walk()

    @property
    def top(self) -> Path:
        """The folder, resolved and checked to lie under the allowed root."""
        return self._top

    def _walk(self) -> None:
        declared = 0
        scanned = 0
        scan_cap = max(self.limits.max_items, 1) * SCAN_FACTOR
        stack: list[tuple[Path, str, int]] = [(self._top, "", 0)]
        while stack:
            directory, prefix, depth = stack.pop()
            try:
                with os.scandir(directory) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as exc:
                self._skip(prefix or ".", f"cannot list directory: {exc.strerror or exc}")
                continue
            subdirs: list[tuple[Path, str, int]] = []
            for entry in entries:
                scanned += 1
                if scanned > scan_cap:
                    raise PayloadTooLarge(
                        f"the folder has more than {scan_cap} entries to scan", limit=scan_cap
                    )
                rel = f"{prefix}{entry.name}"
                if entry.name.startswith("."):
                    self._skip(rel, "hidden entry")
                elif entry.is_symlink():
                    self._add_link(entry, rel)
                elif entry.is_dir(follow_symlinks=False):
                    if depth + 1 >= MAX_DEPTH:
                        self._skip(rel, f"deeper than {MAX_DEPTH} levels")
                    else:
                        subdirs.append((Path(entry.path), f"{rel}/", depth + 1))
                elif not entry.is_file(follow_symlinks=False):
                    self._skip(rel, "not a regular file")
                elif extension(entry.name) not in IMAGE_EXTENSIONS:
                    self._skip(rel, f"not an image file name ({extension(entry.name) or 'no extension'})")
                else:
                    size = entry.stat(follow_symlinks=False).st_size
                    self._add(rel, size)
                    declared += size
            stack.extend(reversed(subdirs))  # depth-first, in name order
        self._check_declared_total(declared)

    def _add_link(self, entry: os.DirEntry[str], rel: str) -> None:
        if entry.is_dir():
            self._skip(rel, "directory links are not followed")
        elif extension(entry.name) not in IMAGE_EXTENSIONS:
            self._skip(rel, "not an image file name")
        else:
            # Listed so that a link leaving the root is reported as Forbidden when it is loaded.
            self._add(rel)

    def _load(self, ref: str) -> bytes:
        real = Path(os.path.realpath(self._top / ref))
        if not is_within(real, self._root) or real == self._root:
            raise Forbidden(f"{ref} resolves outside the allowed root", ref=ref)
        try:
            fd = self._open_beneath_root(real.relative_to(self._root).parts)
        except FileNotFoundError as exc:
            raise NotFound(f"{ref} no longer exists", ref=ref) from exc
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.EPERM):
                raise Forbidden(f"{ref} cannot be opened safely: {exc.strerror}", ref=ref) from exc
            raise InvalidInput(f"{ref} cannot be read: {exc.strerror or exc}", ref=ref) from exc
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise InvalidInput(f"{ref} is not a regular file", ref=ref)
            limit = self.limits.max_item_bytes
            if info.st_size > limit:
                raise PayloadTooLarge(
                    f"{ref} is {info.st_size} bytes; the limit is {limit}", limit=limit, ref=ref
                )
            try:
                return read_limited(f, limit, ref)
            except OSError as exc:
                raise InvalidInput(f"{ref} cannot be read: {exc.strerror or exc}", ref=ref) from exc

    def _open_beneath_root(self, parts: tuple[str, ...]) -> int:
        """Open root/parts... refusing any link on the way (the race-free half of the containment check)."""
        dir_fd = os.open(self._root, _O_DIR)
        try:
            for part in parts[:-1]:
                next_fd = os.open(part, _O_DIR, dir_fd=dir_fd)
                os.close(dir_fd)
                dir_fd = next_fd
            return os.open(parts[-1], _O_FILE, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
