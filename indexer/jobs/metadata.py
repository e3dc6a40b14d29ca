"""Metadata changes after ingestion: one image (a PATCH) or many (a manifest uploaded to an existing set).

The catalog is the source of truth and the vector index holds a copy as each image's payload (what filters
read); both change inside one catalog transaction, the index's copy just before the commit (and put back if the
commit fails), so a rejected change leaves both as they were. The index saves its copy later: a crash before that
loses it from the index's file, and start-up reconciliation restores it from the catalog. A manifest row naming
no image, naming one ambiguously, or malformed fails the whole upload with every such row listed: nothing
half-applied.
"""

from __future__ import annotations

import io
import sqlite3
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog import Catalog, ImageRecord, ImageStatus, update_metadata
from rubricsearch.indexer.catalog.metadata import ManifestRow, duplicate_rows, iter_manifest
from rubricsearch.indexer.catalog.tables import Image
from rubricsearch.retrieval.errors import InvalidMetadata
from rubricsearch.retrieval.index import VectorIndex

_CHUNK = 500


@dataclass(frozen=True)
class ManifestReport:
    rows: int
    updated: int


def change_metadata(catalog: Catalog, index: VectorIndex, set_id: str,
                    changes: Mapping[int | str, Mapping[str, Any]], *, replace: bool = False) -> list[ImageRecord]:
    """Apply metadata changes (merge patches, or whole objects with ``replace``) to images named by catalog id
    or sha256, in the catalog and the index payloads together."""
    touched: list[str] = []
    try:
        with catalog.write() as session:
            records = update_metadata(session, set_id, changes, replace=replace)
            indexed = {r.sha256: r.payload for r in records if r.status == ImageStatus.INDEXED}
            if indexed and index.has_set(set_id):
                touched = list(indexed)
                index.set_payloads(set_id, indexed)
    except BaseException:  # the commit failed: filters must not see what the catalog does not hold
        _restore_payloads(catalog, index, set_id, touched)
        raise
    return records


def apply_manifest(catalog: Catalog, index: VectorIndex, set_id: str, data: bytes | BinaryIO, name: str
                   ) -> ManifestReport:
    """A ``manifest.csv`` / ``manifest.jsonl`` for images already in the set: rows name an image by ``sha256``
    or by ``file``, its original name (the path inside its zip or folder, or the uploaded file's name).

    The manifest is read twice, a line at a time: once to check every row and resolve the image it names, then to
    apply the rows a chunk at a time inside one catalog transaction (each chunk's ORM rows let go once flushed).
    Each row's image reference goes to a temporary SQLite file, not a dict, so memory does not grow with the
    rows (the peaks with and without the dict: docs/hardening.md, "Metadata text and numbers")."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    start = stream.tell()
    with tempfile.TemporaryDirectory(prefix="rubricsearch-manifest-") as tmp, ManifestRefs(Path(tmp)) as refs:
        rows = check_manifest(catalog, set_id, stream, name, refs)
        stream.seek(start)
        return ManifestReport(rows=rows, updated=_apply_rows(catalog, index, set_id, stream, name, refs))


class ManifestRefs:
    """The image each manifest row names (a ``sha256``, or a ``file`` once resolved), a row a line, on disk:
    duplicate rows, unresolved names and errors are found with SQLite's bounded page cache and its external sort
    rather than in memory."""

    def __init__(self, directory: Path) -> None:
        self._db = sqlite3.connect(directory / "refs.sqlite", isolation_level=None)
        # a scratch file: nothing to recover after a crash, so no journal and no fsync
        self._db.executescript("""
            PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF; PRAGMA cache_size = -2048;
            CREATE TABLE refs (line INTEGER PRIMARY KEY, ref TEXT NOT NULL, is_file INTEGER NOT NULL, image TEXT);
            CREATE INDEX refs_ref ON refs (ref);
            CREATE TABLE errors (line INTEGER NOT NULL, error TEXT NOT NULL);
            BEGIN;""")

    def __enter__(self) -> ManifestRefs:
        return self

    def __exit__(self, *exc: object) -> None:
        self._db.close()

    def add(self, line: int, ref: str, *, is_file: bool) -> None:
        self._db.execute("INSERT INTO refs VALUES (?, ?, ?, ?)", (line, ref, is_file, None if is_file else ref))

    def error(self, error: Mapping[str, Any]) -> None:
        self._db.execute("INSERT INTO errors VALUES (?, ?)", (int(error.get("line", 0)), str(error["error"])))

    def errors(self, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """How many errors, and the first ``limit`` by line."""
        count = int(self._db.execute("SELECT count(*) FROM errors").fetchone()[0])
        first = self._db.execute("SELECT line, error FROM errors ORDER BY line, rowid LIMIT ?", (limit,))
        return count, [{"line": line, "error": error} for line, error in first]

    def file_chunks(self, size: int) -> Iterator[dict[str, int]]:
        """Distinct file names (to the first line naming each) in name order, ``size`` at a time."""
        after = ""
        while chunk := dict(self._db.execute("SELECT ref, min(line) FROM refs WHERE is_file AND ref > ? GROUP BY ref "
                                             "ORDER BY ref LIMIT ?", (after, size)).fetchall()):
            yield chunk
            after = max(chunk)

    def resolve(self, file: str, sha: str) -> None:
        self._db.execute("UPDATE refs SET image = ? WHERE ref = ? AND is_file", (sha, file))

    def duplicates(self) -> Iterator[tuple[int, int]]:
        """(the first line, a later line) for each later row naming the same image as an earlier one, however
        named; an unresolved file name stands for itself."""
        key = "coalesce(image, 'file:' || ref)"
        self._db.execute(f"CREATE INDEX refs_image ON refs ({key}, line)")
        first, last = 0, None
        for image, line in self._db.execute(f"SELECT {key}, line FROM refs ORDER BY {key}, line"):
            if image == last:
                yield first, line
            else:
                first, last = line, image

    def sha_of(self, file: str) -> str:
        return str(self._db.execute("SELECT image FROM refs WHERE ref = ? AND is_file", (file,)).fetchone()[0])

    def shas_through(self, line: int) -> Iterator[str]:
        """The image of every row up to ``line``."""
        yield from (sha for (sha,) in self._db.execute(
            "SELECT image FROM refs WHERE line <= ? AND image IS NOT NULL ORDER BY line", (line,)))


def check_manifest(catalog: Catalog, set_id: str, stream: BinaryIO, name: str, refs: ManifestRefs) -> int:
    """Read the manifest once: every row well-formed, each ``file`` naming exactly one image of the set (its
    sha256 kept in ``refs``), no two rows naming one image; the number of rows, or :class:`InvalidMetadata`
    listing the failing rows by line."""
    rows = 0
    for item in iter_manifest(stream, name):
        if isinstance(item, dict):
            refs.error(item)
            continue
        rows += 1
        refs.add(item.line, item.file or item.sha256 or "", is_file=item.file is not None)
    for files in refs.file_chunks(_CHUNK):
        found: dict[str, list[str]] = {}
        with catalog.read() as session:
            query = select(Image.original_name, Image.sha256).where(Image.set_id == set_id,
                                                                    Image.original_name.in_(list(files)))
            for original, sha in session.execute(query):
                found.setdefault(original, []).append(sha)
        for file, line in files.items():
            shas = found.get(file, [])
            if len(shas) == 1:
                refs.resolve(file, shas[0])
            else:
                refs.error({"line": line, "error": f"no image named {file!r} in this set" if not shas
                            else f"{len(shas)} images are named {file!r}; name it by sha256"})
    for first, line in refs.duplicates():  # once names are resolved: a file's row and its sha256's row clash
        for error in duplicate_rows([(first, ""), (line, "")]):
            refs.error(error)
    count, errors = refs.errors(1000)
    if count:
        raise InvalidMetadata(f"{name}: {count} row(s) cannot be applied; nothing was changed", errors=errors)
    return rows


def _apply_rows(catalog: Catalog, index: VectorIndex, set_id: str, stream: BinaryIO, name: str,
                refs: ManifestRefs) -> int:
    """The checked rows applied a chunk at a time in one transaction: every chunk's failures are listed (by line)
    and any failure rolls all back, the index payloads set so far (every row up to the last chunk's) restored
    from the catalog."""
    updated = 0
    applied = 0  # the last line whose chunk's payloads reached the index
    failures: list[dict[str, Any]] = []  # the first 1000, by line (chunks go in line order): bounded memory
    failed = 0
    try:
        with catalog.write() as session:
            chunk: dict[int | str, dict[str, Any]] = {}
            lines: dict[str, int] = {}
            for row in iter_manifest(stream, name):
                if not isinstance(row, ManifestRow):
                    continue  # never: the first read found no malformed row
                sha = row.sha256 or refs.sha_of(row.file or "")
                chunk[sha], lines[sha.lower()] = row.change, row.line
                if len(chunk) >= _CHUNK:
                    done, failed = _apply_chunk(session, index, set_id, chunk, lines, failures, failed)
                    updated, applied, chunk, lines = updated + done, row.line, {}, {}
            if chunk:
                done, failed = _apply_chunk(session, index, set_id, chunk, lines, failures, failed)
                updated, applied = updated + done, max(lines.values())
            if failed:
                raise InvalidMetadata(f"{name}: {failed} row(s) cannot be applied; nothing was changed",
                                      errors=failures)
    except BaseException:
        _restore_payloads(catalog, index, set_id, refs.shas_through(applied))
        raise
    return updated


def _apply_chunk(session: Session, index: VectorIndex, set_id: str, changes: dict[int | str, dict[str, Any]],
                 lines: Mapping[str, int], failures: list[dict[str, Any]], failed: int) -> tuple[int, int]:
    """Rows updated, and the count of failed rows so far (the first 1000 listed in ``failures``)."""
    try:
        records = update_metadata(session, set_id, changes)
    except InvalidMetadata as exc:  # images not in the set, or over the bounds once merged
        errors = exc.details.get("errors", [])
        listed = ({"line": lines.get(str(e.get("image", "")).lower()), "error": e.get("error")} for e in errors)
        failures.extend(sorted(listed, key=lambda e: e["line"] or 0)[:1000 - len(failures)])
        return 0, failed + len(errors)
    session.expunge_all()  # flushed into the transaction: the chunk's rows need not stay in memory
    indexed = {r.sha256: r.payload for r in records if r.status == ImageStatus.INDEXED}
    if indexed and not failed and index.has_set(set_id):
        index.set_payloads(set_id, indexed)
    return len(records), failed


def _restore_payloads(catalog: Catalog, index: VectorIndex, set_id: str, shas: Iterable[str]) -> None:
    """Index payloads of ``shas`` as the catalog holds them (after a rolled-back change set some)."""
    pending = iter(shas)
    while chunk := list(islice(pending, _CHUNK)):
        with catalog.read() as session:
            rows = session.scalars(select(Image).where(Image.set_id == set_id, Image.sha256.in_(chunk)))
            payloads = {r.sha256: ImageRecord.of(r).payload for r in rows}
        if payloads and index.has_set(set_id):
            index.set_payloads(set_id, payloads)
