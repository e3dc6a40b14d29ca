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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from indexer.catalog import Catalog, ImageRecord, ImageStatus, update_metadata
from indexer.catalog.metadata import ManifestRow, duplicate_rows, iter_manifest
from indexer.catalog.models import Image
from retrieval.errors import InvalidMetadata
from retrieval.index import VectorIndex

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
    apply the rows a chunk at a time inside one catalog transaction (each chunk's ORM rows let go once flushed), so
    what it holds is the rows' image names, not the rows."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    start = stream.tell()
    errors: list[dict[str, Any]] = []
    files: dict[str, int] = {}  # file name -> the line naming it
    named: dict[str, int] = {}  # every image reference -> the first line naming it
    rows = 0
    for item in iter_manifest(stream, name):
        if isinstance(item, dict):
            errors.append(item)
            continue
        rows += 1
        ref = item.file or item.sha256 or ""
        if ref in named:
            errors += duplicate_rows([(named[ref], ref), (item.line, ref)])
        named.setdefault(ref, item.line)
        if item.file is not None:
            files[item.file] = item.line
    del named
    by_name = _shas_by_name(catalog, set_id, sorted(files))
    for file, line in files.items():
        found = by_name.get(file, [])
        if len(found) != 1:
            errors.append({"line": line, "error": f"no image named {file!r} in this set" if not found
                           else f"{len(found)} images are named {file!r}; name it by sha256"})
    if errors:
        raise InvalidMetadata(f"{name}: {len(errors)} row(s) cannot be applied; nothing was changed",
                              errors=sorted(errors, key=lambda e: int(e.get("line", 0)))[:1000])
    stream.seek(start)
    return ManifestReport(rows=rows, updated=_apply_rows(catalog, index, set_id, stream, name, by_name))


def _shas_by_name(catalog: Catalog, set_id: str, names: list[str]) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    with catalog.read() as session:
        for start in range(0, len(names), _CHUNK):
            query = select(Image.original_name, Image.sha256).where(
                Image.set_id == set_id, Image.original_name.in_(names[start:start + _CHUNK]))
            for original, sha in session.execute(query):
                by_name.setdefault(original, []).append(sha)
    return by_name


def _apply_rows(catalog: Catalog, index: VectorIndex, set_id: str, stream: BinaryIO, name: str,
                by_name: Mapping[str, list[str]]) -> int:
    """The checked rows applied a chunk at a time in one transaction: every chunk's failures are listed (by line)
    and any failure rolls all back, the index payloads set so far restored from the catalog."""
    updated = 0
    touched: list[str] = []
    failures: list[dict[str, Any]] = []
    try:
        with catalog.write() as session:
            chunk: dict[int | str, dict[str, Any]] = {}
            lines: dict[str, int] = {}
            for row in iter_manifest(stream, name):
                if not isinstance(row, ManifestRow):
                    continue  # never: the first read found no malformed row
                sha = row.sha256 or by_name[row.file or ""][0]
                chunk[sha], lines[sha.lower()] = row.change, row.line
                if len(chunk) >= _CHUNK:
                    updated += _apply_chunk(session, index, set_id, chunk, lines, touched, failures)
                    chunk, lines = {}, {}
            if chunk:
                updated += _apply_chunk(session, index, set_id, chunk, lines, touched, failures)
            if failures:
                raise InvalidMetadata(f"{name}: {len(failures)} row(s) cannot be applied; nothing was changed",
                                      errors=failures[:1000])
    except BaseException:
        _restore_payloads(catalog, index, set_id, touched)
        raise
    return updated


def _apply_chunk(session: Session, index: VectorIndex, set_id: str, changes: dict[int | str, dict[str, Any]],
                 lines: Mapping[str, int], touched: list[str], failures: list[dict[str, Any]]) -> int:
    try:
        records = update_metadata(session, set_id, changes)
    except InvalidMetadata as exc:  # images not in the set, or over the bounds once merged
        failures.extend({"line": lines.get(str(e.get("image", "")).lower()), "error": e.get("error")}
                        for e in exc.details.get("errors", []))
        return 0
    session.expunge_all()  # flushed into the transaction: the chunk's rows need not stay in memory
    indexed = {r.sha256: r.payload for r in records if r.status == ImageStatus.INDEXED}
    if indexed and not failures and index.has_set(set_id):
        touched.extend(indexed)
        index.set_payloads(set_id, indexed)
    return len(records)


def _restore_payloads(catalog: Catalog, index: VectorIndex, set_id: str, shas: list[str]) -> None:
    """Index payloads of ``shas`` as the catalog holds them (after a rolled-back change set some)."""
    for start in range(0, len(shas), _CHUNK):
        with catalog.read() as session:
            rows = session.scalars(select(Image).where(Image.set_id == set_id,
                                                       Image.sha256.in_(shas[start:start + _CHUNK])))
            payloads = {r.sha256: ImageRecord.of(r).payload for r in rows}
        if payloads and index.has_set(set_id):
            index.set_payloads(set_id, payloads)
