"""Metadata changes after ingestion: one image (a PATCH) or many (a manifest uploaded to an existing set).

The catalog is the source of truth and the vector index holds a copy as each image's payload (what filters
read); both change inside one catalog transaction, the index's copy just before the commit (and put back if the
commit fails), so a rejected change leaves both as they were. The index saves its copy later: a crash before that
loses it from the index's file, and start-up reconciliation restores it from the catalog. A manifest row naming
no image, naming one ambiguously, or malformed fails the whole upload with every such row listed: nothing
half-applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from sqlalchemy import select

from indexer.catalog import Catalog, ImageRecord, ImageStatus, parse_manifest, update_metadata
from indexer.catalog.models import Image
from retrieval.errors import InvalidMetadata
from retrieval.index import VectorIndex


@dataclass(frozen=True)
class ManifestReport:
    rows: int
    updated: int


def change_metadata(catalog: Catalog, index: VectorIndex, set_id: str,
                    changes: Mapping[int | str, Mapping[str, Any]], *, replace: bool = False) -> list[ImageRecord]:
    """Apply metadata changes (merge patches, or whole objects with ``replace``) to images named by catalog id
    or sha256, in the catalog and the index payloads together."""
    before: dict[str, dict[str, Any]] = {}
    try:
        with catalog.write() as session:
            records = update_metadata(session, set_id, changes, replace=replace)
            indexed = {r.sha256: r.payload for r in records if r.status == ImageStatus.INDEXED}
            if indexed and index.has_set(set_id):
                before = index.payloads(set_id, indexed)
                index.set_payloads(set_id, indexed)
    except BaseException:
        if before:  # the commit failed: filters must not see what the catalog does not hold
            index.set_payloads(set_id, before)
        raise
    return records


def apply_manifest(catalog: Catalog, index: VectorIndex, set_id: str, data: bytes | BinaryIO, name: str
                   ) -> ManifestReport:
    """A ``manifest.csv`` / ``manifest.jsonl`` for images already in the set: rows name an image by ``sha256``
    or by ``file``, its original name (the path inside its zip or folder, or the uploaded file's name)."""
    manifest = parse_manifest(data, name)
    errors = list(manifest.errors)
    names = {row.file for row in manifest.rows if row.file is not None}
    by_name: dict[str, list[str]] = {}
    with catalog.read() as session:
        chunk = sorted(names)
        for start in range(0, len(chunk), 500):
            query = select(Image.original_name, Image.sha256).where(
                Image.set_id == set_id, Image.original_name.in_(chunk[start:start + 500]))
            for original, sha in session.execute(query):
                by_name.setdefault(original, []).append(sha)
    changes: dict[int | str, dict[str, Any]] = {}
    for row in manifest.rows:
        if row.sha256 is not None:
            changes[row.sha256] = row.change
            continue
        found = by_name.get(row.file or "", [])
        if len(found) != 1:
            errors.append({"line": row.line, "error": f"no image named {row.file!r} in this set" if not found
                           else f"{len(found)} images are named {row.file!r}; name it by sha256"})
        else:
            changes[found[0]] = row.change
    if errors:
        raise InvalidMetadata(f"{name}: {len(errors)} row(s) cannot be applied; nothing was changed",
                              errors=sorted(errors, key=lambda e: int(e.get("line", 0)))[:1000])
    try:
        records = change_metadata(catalog, index, set_id, changes)
    except InvalidMetadata as exc:  # images not in the set, or over the bounds once merged
        line_of = {(r.sha256 or "").lower(): r.line for r in manifest.rows}
        line_of.update({sha: r.line for r in manifest.rows for sha in by_name.get(r.file or "", [])})
        listed = [{"line": line_of.get(str(e.get("image", "")).lower()), "error": e.get("error")}
                  for e in exc.details.get("errors", [])]
        raise InvalidMetadata(f"{name}: {exc.message}", errors=listed) from None
    return ManifestReport(rows=len(manifest.rows), updated=len(records))
